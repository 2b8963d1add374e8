"""What a generator proves about the weights it holds (atomic weight publication,
docs/concepts.md): its own hash of its tensors, tensor by tensor, and a fixed probe served by
its own engine.

A ``Proof`` is computed by the worker from what it holds, never from a checksum it was handed:

- ``checksum``: the combined base + adapter checksum of its tensors (the manifest's
  ``weight_checksum`` when it holds the version);
- ``digests``: the checksum of each adapter tensor (the registry's ``digests.json`` names the
  tensor that differs);
- ``probe_ids``/``probe_logprobs``: what its generator samples on a fixed prompt with a fixed
  seed and the run's sampler. Two workers holding the same weights in the same engine sample
  the same ids with the same log-probs; the trainer scores those ids at the staged version,
  so a worker whose engine serves other weights than it hashes is caught too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from closedloop.contracts import SamplerConfig, content_hash
from closedloop.policy.chat import ChatMessage

__all__ = ["PROBE_TEXT", "Probe", "Proof", "probe_of", "probe_prompt"]

PROBE_TEXT = "Probe: repair config.json so that it parses."
"""The task text the probe prompt renders (any fixed text: only identity matters)."""


@dataclass(frozen=True)
class Probe:
    """The fixed probe: prompt ids, sampler, length and seed."""

    prompt_ids: tuple[int, ...]
    sampler: SamplerConfig
    max_new_tokens: int = 8
    seed: int = 20_240_601


def probe_prompt(renderer: Any, text: str = PROBE_TEXT) -> tuple[int, ...]:
    """The probe's prompt ids: ``text`` as the only user message of the run's chat template,
    then the assistant header.

    The probe proves which weights an engine serves, and every prompt and sampled token
    passes every adapted projection of every layer, so a short prompt tests the same thing
    as turn 0's: the scaffold's system block (tools included, ~230 ids on the terminal
    tasks) would only add its prefill to each proof and to the trainer's reference."""
    template = renderer.template
    return tuple(renderer.encode(template.render_messages([ChatMessage("user", text)],
                                                          add_generation_prompt=True)))


def probe_of(renderer: Any, sampler: SamplerConfig) -> Probe:
    """The run's probe: ``probe_prompt`` of ``PROBE_TEXT``, the run's sampler."""
    return Probe(probe_prompt(renderer), sampler)


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
