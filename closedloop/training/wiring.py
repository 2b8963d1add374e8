"""Wiring: the scaffold (system prompt, tool schemas, renderer), the manifest, and the parts a
run assembles (environments, verifier, collectors). The CLI and the reference loop call these.

The scaffold is fixed for a run and hashed into the ``PolicyManifest``: every checkpoint of a
run shares one ``scaffold_hash`` (``lock_scaffold_across_checkpoints``).
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from closedloop.config import EnvironmentSection
from closedloop.contracts import (
    PARSER_VERSION,
    PolicyManifest,
    SamplerConfig,
    TaskVerifier,
    TraceWriter,
)
from closedloop.contracts.package import EnvPackage
from closedloop.envs.discovery import resolve_package, resolve_section
from closedloop.rollout.collector import Collector, CollectorConfig
from closedloop.rollout.source import ActionSource

MEMORY_POLICY = "exact-history-v1"
__all__ = ["MEMORY_POLICY", "CollectorParts", "build_manifest", "generator_build",
           "make_collector", "make_renderer", "run_package"]


def make_renderer(tokenizer: Any, package: EnvPackage | None = None) -> Any:
    """The chat renderer of a package's scaffold (system prompt + tool schemas; default: the
    default package's, ``closedloop.envs.discovery``): what every manifest of a run hashes."""
    from closedloop.policy import ChatRenderer

    pkg = package or resolve_package()
    return ChatRenderer(tokenizer, pkg.system_prompt, [dict(t) for t in pkg.tool_schemas])


def generator_build(dtype: str) -> str:
    """Identify the generation stack (engine, library versions, dtype)."""
    import torch
    import transformers

    return (f"hf-transformers:{transformers.__version__}/torch:{torch.__version__}/"
            f"{dtype}/{platform.machine()}")


def build_manifest(*, policy_version: str, weight_checksum: str, tokenizer_revision: str,
                   renderer: Any, sampler: SamplerConfig, step_budget: int,
                   max_action_tokens: int, model_id: str, dtype: str = "float32",
                   base_weight_checksum: str | None = None,
                   adapter_checksum: str | None = None) -> PolicyManifest:
    """Assemble the PolicyManifest of one checkpoint under the run's scaffold."""
    return PolicyManifest(
        policy_version=policy_version, weight_checksum=weight_checksum,
        tokenizer_revision=tokenizer_revision,
        system_prompt_hash=renderer.system_prompt_hash(),
        chat_template_hash=renderer.template_hash(),
        tool_schema_hash=renderer.tool_schema_hash(),
        parser_version=PARSER_VERSION, memory_policy=MEMORY_POLICY, compactor_version=None,
        retry_budget=0, step_budget=step_budget, max_action_tokens=max_action_tokens,
        sampler=sampler, model_id=model_id, dtype=dtype, generator_build=generator_build(dtype),
        base_weight_checksum=base_weight_checksum, adapter_checksum=adapter_checksum)


@dataclass
class CollectorParts:
    """What a collector needs besides its action source."""

    renderer: Any
    verifier: TaskVerifier | None  # None: a generator that only rolls out (no ``collect``)
    run_id: str
    writer: TraceWriter | None
    max_turns: int
    package: EnvPackage | None = None
    sampling_salt: int | None = None  # per-episode sampling streams (CollectorConfig)


def make_collector(source: ActionSource, manifest: PolicyManifest, parts: CollectorParts,
                   env_factory: Callable[[], Any] | None = None) -> Collector:
    """A collector over fresh environment instances (one per sibling) and the verifier.

    Environments and task families come from ``parts.package`` (default: the default
    package, ``closedloop.envs.discovery``); ``env_factory`` overrides the package's
    ``make_env``.
    """
    package = parts.package or resolve_package()
    return Collector(source, parts.renderer, env_factory or package.make_env, parts.verifier,
                     package.family_split, manifest, parts.run_id, parts.writer,
                     CollectorConfig(max_turns=parts.max_turns,
                                     sampling_salt=parts.sampling_salt))


def run_package(env: EnvironmentSection) -> EnvPackage:
    """The environment package a config's ``environment`` section names (``id`` or
    ``factory``; else ``domain``, the built-in terminal tasks)."""
    return resolve_section({"id": env.id, "factory": env.factory, "domain": env.domain})
