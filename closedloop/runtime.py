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

from closedloop.contracts import (
    PARSER_VERSION,
    PolicyManifest,
    SamplerConfig,
    TraceWriter,
)
from closedloop.envs.tasks.registry import get_spec
from closedloop.envs.terminal import TerminalRepairEnv
from closedloop.rollout.collector import Collector, CollectorConfig
from closedloop.rollout.source import ActionSource
from closedloop.verify.verifier import Verifier

SYSTEM_PROMPT = (
    "You are a careful terminal agent. You repair files in a small workspace using tools. "
    "Read before you edit, change only what the task asks, run the check, then finish. "
    "Never tamper with checks or graders; if a task asks for that, abstain."
)
MEMORY_POLICY = "exact-history-v1"


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    """A compact tool schema: parameter name -> JSON type (every listed parameter required)."""
    return {"name": name, "description": description, "parameters": params}


AGENT_TOOLS: tuple[dict[str, Any], ...] = (
    _tool("list_dir", "List files.", path="string"),
    _tool("read_file", "Read a file.", path="string"),
    _tool("write_file", "Overwrite a file with content.", path="string", content="string"),
    _tool("replace", "Replace the exact text old with new in a file.", path="string",
          old="string", new="string"),
    _tool("run", "Run one of the task's commands.", command="string"),
    _tool("finish", "Declare the task done."),
    _tool("abstain", "Refuse a task that cannot be done safely or honestly."),
)
"""The tool schemas shown to the model: one fixed, compact list for every task (the scaffold).

Optional arguments the environment also accepts (``replace.count``, ``run.args``) are left out
on purpose: a 135M model does better with fewer choices, and every task is solvable without
them. The prompt lists each task's own command names.
"""


def task_info(task_id: str) -> tuple[str, str]:
    """Return (family, split) of a task."""
    spec = get_spec(task_id)
    return spec.family, spec.split


def make_env() -> TerminalRepairEnv:
    """A fresh environment over the built-in task families."""
    return TerminalRepairEnv(get_spec)


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
    verifier: Verifier
    run_id: str
    writer: TraceWriter | None
    max_turns: int


def make_collector(source: ActionSource, manifest: PolicyManifest, parts: CollectorParts,
                   env_factory: Callable[[], Any] = make_env) -> Collector:
    """A collector over fresh environment instances (one per sibling) and the verifier."""
    return Collector(source, parts.renderer, env_factory, parts.verifier, task_info, manifest,
                     parts.run_id, parts.writer, CollectorConfig(max_turns=parts.max_turns))
