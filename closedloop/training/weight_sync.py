"""What a generator proves about the weights it holds (atomic weight publication,
docs/concepts.md): its own hash of its tensors, tensor by tensor, and a fixed probe served by
its own engine.

A ``Proof`` is computed by the worker from what it holds, never from a checksum it was handed:

- ``checksum``: the combined base + adapter checksum of its tensors (the manifest's
  ``weight_checksum`` when it holds the version);
- ``digests``: the checksum of each adapter tensor (the registry's ``digests.json`` names the
  tensor that differs);
- ``probe_ids``/``probe_logprobs``: a fixed sequence and its teacher-forced log-probs, scored
  by its own generator in one prefill at the run's temperature (``HFGenerator.score``). The
  trainer path scores the same ids at the staged version, so a worker whose engine serves other
  weights than it hashes is caught: every scored position passes every projection of every
  layer and the whole vocabulary head.

Teacher forcing, not sampling: a sampled probe costs one weight-streaming decode step per id
at one row (on a CPU, several times the prefill of the same ids) and proves nothing more about
which weights the engine holds; sampling itself is audited on every rollout token (the
generator/trainer log-prob audit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from closedloop.contracts import SamplerConfig, content_hash

__all__ = ["PROBE_TEXT", "Probe", "Proof", "probe_ids", "probe_of", "score_probe"]

PROBE_TEXT = "Probe: repair config.json."
"""The text whose ids the probe scores (any fixed text: only identity matters)."""


@dataclass(frozen=True)
class Probe:
    """The fixed probe: the ids every worker scores teacher-forced, and the sampler (its
    temperature only: ``probe_of``) whose behaviour log-probs it scores."""

    ids: tuple[int, ...]
    sampler: SamplerConfig

    def __post_init__(self) -> None:
        if len(self.ids) < 2:
            raise ValueError("a probe needs at least two ids (one to condition on)")


def probe_ids(renderer: Any, text: str = PROBE_TEXT) -> tuple[int, ...]:
    """The probe's ids: ``text`` encoded by the run's tokenizer, no chat template.

    The probe proves which weights an engine serves; each scored id passes every adapted
    projection of every layer, so a short plain text tests the same thing as a rendered turn,
    and its cost (one prefill in the worker, one trainer-path forward in the publisher) stays
    a few weight reads."""
    return tuple(renderer.encode(text))


def score_probe(generator: Any, probe: Probe | None
                ) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A proof's probe fields: ``probe``'s ids and their log-probs scored by ``generator``
    (``HFGenerator.score``), or empty where the run's publication gates no probe (``None``:
    bf16 runs, docs/concepts.md, atomic weight publication)."""
    if probe is None:
        return (), ()
    return probe.ids, tuple(generator.score(probe.ids, probe.sampler))


def probe_of(renderer: Any, sampler: SamplerConfig) -> Probe:
    """The run's probe: ``probe_ids`` of ``PROBE_TEXT`` at ``sampler``'s temperature."""
    return Probe(probe_ids(renderer), SamplerConfig(sampler.temperature))


@dataclass(frozen=True)
class Proof:
    """A worker's proof that it holds ``version`` (module doc)."""

    worker_id: str
    version: str
    checksum: str
    digests: dict[str, str]
    probe_ids: tuple[int, ...]
    probe_logprobs: tuple[float, ...]
    load_s: float

    @property
    def digests_hash(self) -> str:
        """The content hash of the per-tensor checksums."""
        return content_hash(dict(sorted(self.digests.items())))

    def ack_fields(self) -> dict[str, Any]:
        """The registry ACK's proof fields (``PolicyRegistry.ack``)."""
        return {"digests_hash": self.digests_hash, "probe_ids": self.probe_ids,
                "probe_logprobs": self.probe_logprobs, "load_s": self.load_s}

    def to_dict(self) -> dict[str, Any]:
        """Plain values (what a replica process sends back)."""
        return {"worker_id": self.worker_id, "version": self.version,
                "checksum": self.checksum, "digests": dict(self.digests),
                "probe_ids": list(self.probe_ids), "probe_logprobs": list(self.probe_logprobs),
                "load_s": self.load_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Proof:
        """The proof ``to_dict`` wrote."""
        return cls(str(data["worker_id"]), str(data["version"]), str(data["checksum"]),
                   {str(k): str(v) for k, v in data["digests"].items()},
                   tuple(int(i) for i in data["probe_ids"]),
                   tuple(float(x) for x in data["probe_logprobs"]), float(data["load_s"]))
