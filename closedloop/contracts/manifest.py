"""The policy boundary: sampler configuration and the immutable PolicyManifest (docs/concepts.md,
policy manifest).

The deployed policy is more than weights: Π = (weights, system prompt, chat template, tool
schemas, parser, memory/compactor, retry/step budgets, sampler). Every rollout, update and
evaluation points to one ``PolicyManifest.manifest_hash()``. ``scaffold_hash()`` covers every field
except the weights' identity, so scaffold drift between checkpoints is a hash comparison.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from closedloop.contracts.hashing import content_hash, is_content_hash
from closedloop.errors import ContractError


@dataclass(frozen=True)
class SamplerConfig:
    """How action tokens are sampled.

    temperature: > 0 (divide logits); 0 is not allowed here, greedy decoding is ``greedy=True``.
    top_p: nucleus mass in (0, 1]; 1.0 disables it. top_k: None or >= 1.
    greedy: argmax decoding; behaviour log-probs are then 0 on the chosen token (a point mass).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
            raise ContractError(f"sampler temperature must be a finite number > 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise ContractError(f"sampler top_p must be in (0, 1], got {p!r}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ContractError(f"sampler top_k must be None or an int >= 1, got {k!r}")
        if not isinstance(self.greedy, bool):
            raise ContractError("sampler greedy must be a bool")

    @property
    def truncates_support(self) -> bool:
        """True when top-p or top-k can remove tokens from the sampling support."""
        return self.top_p < 1.0 or self.top_k is not None or self.greedy

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return asdict(self)

    def config_hash(self) -> str:
        """Return the content hash of the sampler configuration."""
        return content_hash(self.to_dict())


_IDENTITY_FIELDS = ("policy_version", "weight_checksum", "base_weight_checksum",
                    "adapter_checksum")


@dataclass(frozen=True)
class PolicyManifest:
    """Everything that defines the policy being sampled, trained or evaluated.

    Hash-valued fields hold ``sha256:<hex>`` content hashes. ``weight_checksum`` covers base and
    adapter weights together (LoRA: base revision + adapter revision is one policy version).
    """

    policy_version: str
    weight_checksum: str
    tokenizer_revision: str
    system_prompt_hash: str
    chat_template_hash: str
    tool_schema_hash: str
    parser_version: str
    memory_policy: str
    compactor_version: str | None
    retry_budget: int
    step_budget: int
    max_action_tokens: int
    sampler: SamplerConfig
    model_id: str = "unknown"
    dtype: str = "float32"
    generator_build: str = "unknown"
    base_weight_checksum: str | None = None
    adapter_checksum: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("weight_checksum", "tokenizer_revision", "system_prompt_hash",
                     "chat_template_hash", "tool_schema_hash"):
            if not is_content_hash(getattr(self, name)):
                raise ContractError(f"manifest field {name} must be a sha256: content hash")
        for name in ("retry_budget", "step_budget", "max_action_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ContractError(f"manifest field {name} must be an int >= 0")
        if not isinstance(self.sampler, SamplerConfig):
            raise ContractError("manifest field sampler must be a SamplerConfig")
        if not self.policy_version:
            raise ContractError("manifest field policy_version must be non-empty")

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form (the sampler as a nested object)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["sampler"] = self.sampler.to_dict()
        out["extra"] = dict(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PolicyManifest:
        """Rebuild a manifest from its JSON form, rejecting unknown or missing fields."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ContractError(f"unknown manifest fields: {unknown}")
        values = dict(data)
        sampler = values.get("sampler")
        if not isinstance(sampler, dict):
            raise ContractError("manifest field sampler must be an object")
        values["sampler"] = SamplerConfig(**sampler)
        try:
            return cls(**values)
        except TypeError as exc:
            raise ContractError(f"manifest: {exc}") from None

    def manifest_hash(self) -> str:
        """Return the content hash of the whole manifest."""
        return content_hash(self.to_dict())

    def scaffold_hash(self) -> str:
        """Return the hash of everything but the weights' identity (prompt, template, tools...).

        Two checkpoints of one run must have equal scaffold hashes: drift is zero.
        """
        data = self.to_dict()
        for name in _IDENTITY_FIELDS:
            data.pop(name)
        return content_hash(data)

    def with_weights(self, policy_version: str, weight_checksum: str,
                     adapter_checksum: str | None = None) -> PolicyManifest:
        """Return the manifest of a new checkpoint with the scaffold unchanged."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(policy_version=policy_version, weight_checksum=weight_checksum,
                      adapter_checksum=adapter_checksum)
        return PolicyManifest(**values)
