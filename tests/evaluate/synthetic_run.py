"""Build small, complete run directories for the gate and report tests, with the real parts.

The traces come from the real collector, environment and verifier; only the model is replaced by
``SampledSource``, which plays the expert's gold actions (success) or finishes at once (failure)
and labels them as sampled tokens with finite log-probs. The registry, ledger, admission
controller, checkpoints and objective metrics are the library's own. The layout is that of
``closedloop.training`` (see its module docstring).
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch

from closedloop.config import RunConfig
from closedloop.contracts import (
    PARSER_VERSION,
    Action,
    PolicyManifest,
    SamplerConfig,
    TraceWriter,
    sha256_hex,
)
from closedloop.contracts.update import ObjectiveInputs
from closedloop.envs.scripted import ExpertPolicy
from closedloop.envs.terminal.families.registry import FAMILIES, generate_task, get_bundle
from closedloop.envs.terminal.verifier import Verifier
from closedloop.evaluate.gates import GateReport, evaluate_gates
from closedloop.evaluate.heldout import summarize_eval
from closedloop.learn.checkpoint import save_checkpoint
from closedloop.learn.credit import group_advantages
from closedloop.learn.objectives import reinforce_with_kl
from closedloop.learn.trainer import TrainerConfig
from closedloop.policy.registry import PolicyRegistry, version_name
from closedloop.rollout.admission import AdmissionController, apply_decision
from closedloop.rollout.collector import CollectedGroup
from closedloop.rollout.ledger import GroupSummary, Ledger
from closedloop.rollout.source import ActionSample, ScriptedSource
from closedloop.rollout.tensors import build_training_batch, shift_targets
from closedloop.training.wiring import CollectorParts, make_collector

SYSTEM_PROMPT = "You repair files with tools."
WORKER = "generator-0"
FAST = ("json-repair-v1", "file-repair-v1", "schema-repair-v1")  # no program grading


class ByteRenderer:
    """Token ids = UTF-8 bytes (+ a marker): enough to thread contexts exactly."""

    def render_prompt(self, task_text: str) -> list[int]:
        return [256, *task_text.encode()[:48], 257]

    def render_observation(self, observation_text: str, *, turn_closed: bool = False) -> list[int]:
        return [258, *observation_text.encode()[:24], 257]

    def turn_closed(self, action_ids: Sequence[int]) -> bool:
        return False


Succeed = Callable[[str, str], bool]  # (task_id, episode key) -> play the gold actions?


class SampledSource:
    """Stands in for the generator: gold actions or an immediate finish, as sampled tokens."""

    build = "synthetic-generator"

    def __init__(self, succeed: Succeed) -> None:
        self.succeed = succeed
        self.plans: dict[str, list[str]] = {}

    def open(self, key: str, task_id: str, prompt_ids: list[int], observation: str,
             stream: int | None = None) -> None:
        plan = ExpertPolicy(get_bundle(task_id)).plan if self.succeed(task_id, key) else []
        self.plans[key] = [*plan] if plan else [Action.finish().canonical_text()]

    def extend(self, key: str, observation: str, observation_ids: list[int]) -> None:
        pass

    def act(self, keys: Sequence[str]) -> list[ActionSample]:
        out = []
        for key in keys:
            plan = self.plans[key]
            text = plan.pop(0) if plan else Action.finish().canonical_text()
            ids = [b % 200 + 300 for b in text.encode()[:12]]
            lps = [-0.05 * (1 + i % 7) for i in ids]
            out.append(ActionSample(text, ids, lps, [lp - 0.01 for lp in lps], "stop"))
        return out

    def close(self, key: str) -> None:
        self.plans.pop(key, None)


def default_succeed(task_id: str, key: str) -> bool:
    """Even sibling indices and the first evaluation seed succeed."""
    return key.endswith("/0") and ("s22" not in key)


@dataclass(frozen=True)
class Spec:
    """What to build. ``prompts`` gives the system prompt of each registry version."""

    steps: int = 2
    groups_per_step: int = 2
    group_size: int = 2
    heldout: int = 4
    seeds: tuple[int, ...] = (11, 22)
    succeed_start: Succeed = default_succeed
    succeed_final: Succeed = lambda task, key: key.endswith("/0")
    succeed_train: Succeed = lambda task, key: key.endswith("/0")
    prompts: tuple[str, ...] = ()
    hold_back_first_group: bool = False  # consume step 0's first group one step late


def tasks(split: str, n: int) -> list[str]:
    """``n`` tasks of ``split`` from the fast families, round-robin over their templates."""
    pool = [generate_task(f, t, i).spec for i in range(3) for f in FAST
            for t in FAMILIES[f].templates]
    return [s.task_id for s in pool if s.split == split][:n]


def template(prompt: str = SYSTEM_PROMPT) -> PolicyManifest:
    return PolicyManifest(
        policy_version="v0000", weight_checksum=sha256_hex("init"),
        tokenizer_revision=sha256_hex("tok"), system_prompt_hash=sha256_hex(prompt),
        chat_template_hash=sha256_hex("chatml"), tool_schema_hash=sha256_hex("tools"),
        parser_version=PARSER_VERSION, memory_policy="exact-history-v1", compactor_version=None,
        retry_budget=0, step_budget=8, max_action_tokens=96, sampler=SamplerConfig(),
        model_id="synthetic", generator_build=SampledSource.build)


def _collect(root: Path, name: str, source: Any, manifest: PolicyManifest,
             groups: list[tuple[str, str, int, int]]) -> list[CollectedGroup]:
    with TraceWriter(root / "traces" / f"{name}.jsonl") as writer:
        collector = make_collector(source, manifest, CollectorParts(
            ByteRenderer(), Verifier(), root.name, writer, max_turns=8))
        leases = [collector.make_lease(*g) for g in groups]
        return collector.collect(leases)


def _publish(reg: PolicyRegistry, k: int, prompt: str) -> PolicyManifest:
    staged = reg.stage({"w": torch.full((2, 2), float(k))}, template(prompt),
                       version=version_name(k))
    reg.ack(WORKER, staged.version, staged.manifest.weight_checksum)
    reg.publish(staged.version, require_acks_from=[WORKER])
    return staged.manifest


def _step_metrics(groups: list[CollectedGroup]) -> tuple[dict[str, Any], int, int]:
    """Run the real objective on the admitted episodes (new = behaviour + a small shift)."""
    eps, adv, zero = [], [], 0
    for g in groups:
        rewards = [ep.trajectory.task_success for ep in g.episodes]
        credit = group_advantages(rewards, "rloo", [r is None for r in rewards],
                                  "discard_group")
        if credit.advantages is None:
            continue
        zero += credit.zero_variance
        for pos, i in enumerate(credit.member_indices):
            eps.append(g.episodes[i])
            adv.append(float(credit.advantages[pos]))
    if not eps:
        return {}, zero, len(groups)
    sh = shift_targets(build_training_batch(eps))
    new = (sh.behavior_logprobs_B_T.double() + 1e-5).requires_grad_(True)
    out = reinforce_with_kl(ObjectiveInputs(
        new_logprobs_B_T=new, behavior_logprobs_B_T=sh.behavior_logprobs_B_T,
        advantages_B=torch.tensor(adv, dtype=torch.float64), mask_B_T=sh.mask_B_T,
        ref_logprobs_B_T=new.detach() - 0.01, success_B=torch.tensor([a > 0 for a in adv])))
    out.loss.backward()
    assert new.grad is not None
    return {**out.metrics(), "optim/grad_norm": float(new.grad.norm())}, zero, len(groups)


def build_run(root: Path, spec: Spec = Spec()) -> Path:
    """Write a complete run directory at ``root`` and return it."""
    (root / "traces").mkdir(parents=True)
    train, heldout = tasks("train", 8), tasks("heldout", spec.heldout)
    cfg = RunConfig(model="embedded")
    cfg = cfg.with_overrides(
        rollout=replace(cfg.rollout, group_size=spec.group_size),
        evaluation=replace(cfg.evaluation, attempts_per_task=len(spec.seeds),
                           seeds=list(spec.seeds)),
        training=replace(cfg.training, rl_steps=spec.steps,
                         groups_per_step=spec.groups_per_step))
    _json(root / "config.json", {"config": cfg.to_dict(), "config_hash": cfg.config_hash(),
                                 "git_revision": "test", "versions": {}})
    _json(root / "trainer.json", TrainerConfig().__dict__)
    _json(root / "tasks.json", {"train": train, "heldout": heldout, "discarded": []})
    _json(root / "template.json", {"append_only": True})
    prompts = spec.prompts or (SYSTEM_PROMPT,) * (spec.steps + 1)
    _demos(root, train)
    reg = PolicyRegistry(root / "registry")
    metrics: list[dict[str, Any]] = [{"kind": "sft", "episodes": 2, "losses": [1.0, 0.5],
                                      "trained_action_tokens": 40, "time": 0.0}]
    manifest = _publish(reg, 0, prompts[0])
    metrics.append(_eval(root, "start", manifest, heldout, spec, spec.succeed_start))
    cold = set(train[::3])  # the cold start solves 3 of the 8 train tasks: inside the band
    metrics.append(_eval(root, "start-train", manifest, train, replace(spec, seeds=spec.seeds[:1]),
                         lambda task, key: task in cold))
    with Ledger(root / "ledger.sqlite") as ledger:
        consumed: list[str] = []
        held: list[CollectedGroup] = []
        for s in range(spec.steps):
            manifest = reg.manifest(version_name(s))
            groups = _collect(root, f"step-{s:04d}", SampledSource(spec.succeed_train), manifest,
                              [(f"s{s:04d}-g{j}", train[(2 * s + j) % len(train)], 100 + s * 10
                                + j, spec.group_size) for j in range(spec.groups_per_step)])
            admitted = held + _admit(ledger, groups, s)
            held = []
            if spec.hold_back_first_group and s == 0 and admitted:
                held, admitted = admitted[:1], admitted[1:]
            step_metrics, zero, n = _step_metrics(admitted)
            consumed += [g.lease.group_id for g in admitted]
            save_checkpoint(root / "checkpoints", s + 1, {"w": torch.full((2, 2), float(s + 1))},
                            {}, version_name(s + 1), consumed, None, {})
            if admitted:
                ledger.mark_consumed([g.lease.group_id for g in admitted], s + 1,
                                     version_name(s + 1))
            _publish(reg, s + 1, prompts[s + 1])
            scores = [ep.trajectory.task_success for g in groups for ep in g.episodes]
            metrics.append({
                "kind": "rl_step", "step": s, "behavior_version": version_name(s),
                "output_version": version_name(s + 1), "groups": len(groups),
                "admitted": len(admitted), "zero_variance": zero, "discarded": n - len(admitted),
                "mean_success": sum(x or 0 for x in scores) / len(scores), "metrics": step_metrics,
                "seconds": {"collect_s": 0.5, "update_s": 0.2}, "time": 10.0 + s,
                "credit": {"n_groups": n, "n_scored_groups": len(admitted),
                           "zero_variance_rate": zero / max(1, len(admitted))}})
    final = reg.manifest(version_name(spec.steps))
    metrics.append(_eval(root, "final", final, heldout, spec, spec.succeed_final))
    (root / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    _json(root / "summary.json", {"rl_steps": spec.steps})
    return root


def _admit(ledger: Ledger, groups: list[CollectedGroup], step: int) -> list[CollectedGroup]:
    controller = AdmissionController(0)
    admitted = []
    for g in groups:
        trajs = [ep.trajectory for ep in g.episodes]
        ledger.record_collected(g.lease, GroupSummary.from_trajectories(trajs))
        decision = controller.admit(trajs, g.lease, step)
        apply_decision(ledger, decision)
        if decision.admitted:
            admitted.append(g)
    return admitted


def _demos(root: Path, train: list[str]) -> None:
    # as closedloop.training.run.manifest_for(demo=True): the scaffold, with the script as identity
    data = template().to_dict()
    data.update(policy_version="scripted-noisy-expert", weight_checksum=sha256_hex("script"),
                base_weight_checksum=None, adapter_checksum=None)
    manifest = PolicyManifest.from_dict(data)
    source = ScriptedSource(lambda task, key: ExpertPolicy(get_bundle(task)),
                            lambda text: [b % 200 + 300 for b in text.encode()[:12]])
    _collect(root, "sft-demos", source, manifest,
             [(f"demo-{i:04d}", t, 1000 + i, 1) for i, t in enumerate(train[:2])])


def _eval(root: Path, label: str, manifest: PolicyManifest, heldout: list[str], spec: Spec,
          succeed: Succeed) -> dict[str, Any]:
    groups = _collect(root, f"eval-{label}", SampledSource(succeed), manifest,
                      [(f"eval-{label}-{i:03d}-s{seed}", t, seed, 1)
                       for i, t in enumerate(heldout) for seed in spec.seeds])
    summary = summarize_eval([ep for g in groups for ep in g.episodes], k=len(spec.seeds))
    return {"kind": "eval", "label": label, "time": 1.0, **summary.to_dict()}


def build_eval_run(root: Path, succeed_start: Succeed, succeed_final: Succeed,
                   heldout: int = 4) -> Path:
    """A minimal arm of an experiment: config, registry v0000 and the two evaluations."""
    return build_run(root, Spec(steps=0, heldout=heldout, succeed_start=succeed_start,
                                succeed_final=succeed_final))


def _json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


# --------------------------------------------------------------------------- shared, cached
_TMP = Path(tempfile.mkdtemp(prefix="closedloop-evaluate-tests-"))
atexit.register(shutil.rmtree, _TMP, True)


@cache
def clean_run() -> Path:
    """One clean run per test process (read-only: copy it before breaking it)."""
    return build_run(_TMP / "clean")


@cache
def clean_gates() -> GateReport:
    """Every gate of the clean run, evaluated once per test process."""
    return evaluate_gates(clean_run())


def copy_run(dst: Path, src: Path | None = None) -> Path:
    """A writable copy of ``src`` (default: the clean run)."""
    return Path(shutil.copytree(src or clean_run(), dst))


Edit = Callable[[dict[str, Any]], dict[str, Any] | list[dict[str, Any]] | None]


def edit_trace(run: Path, name: str, fn: Edit) -> int:
    """Rewrite the raw lines of ``traces/<name>.jsonl``: ``fn`` returns the line (possibly
    changed), several lines, or None to keep it. Returns how many lines ``fn`` changed."""
    path = run / "traces" / f"{name}.jsonl"
    out, changed = [], 0
    for line in path.read_text().splitlines():
        raw = json.loads(line)
        before = json.dumps(raw, sort_keys=True)
        new = fn(raw)
        items = [raw] if new is None else new if isinstance(new, list) else [new]
        changed += [json.dumps(x, sort_keys=True) for x in items] != [before]
        out += [json.dumps(x, sort_keys=True) for x in items]
    path.write_text("".join(line + "\n" for line in out))
    return changed


def half_success(task: str, key: str) -> bool:
    """Seed 11 succeeds, the others fail: success 0.5 on every task at start and final."""
    return key.endswith("s11/0")


def audit_record(run: Path, abs_max: float = 1e-5, abs_p95: float = 1e-6,
                 k3: float = 1e-11, abs_p99: float = 5e-6) -> dict[str, Any]:
    """An ``audit.json`` as ``run_evaluation.audit_frozen`` writes it, for the run's v0000."""
    checksum = PolicyRegistry(run / "registry").manifest("v0000").weight_checksum
    return {"label": "start", "version": "v0000", "n_episodes": 8, "n_tokens": 240,
            "signed_mean": 0.0, "abs_p95": abs_p95, "abs_p99": abs_p99, "abs_max": abs_max,
            "k3": k3, "log_ppl_diff": 0.0, "tolerance_max": 1e-3, "tolerance_p95": 1e-4,
            "tolerance_p99": 1e-3, "tolerance_source": "bf16_same_engine_baseline",
            "passed": abs_max <= 1e-3 and abs_p95 <= 1e-4, "weight_checksum": checksum,
            "trainer_dtype": "float32"}


def build_experiment(root: Path) -> Path:
    """The layout of ``closedloop.experiments.controls``: experiment.json and arms/{frozen, rloo,
    shuffled, sft_only}. rloo is a copy of the clean run with a passing consistency audit;
    frozen has only its start evaluation (it is never updated); shuffled and sft_only change
    nothing."""
    arms = root / "arms"
    arms.mkdir(parents=True)
    copy_run(arms / "rloo")
    _json(arms / "rloo" / "audit.json", audit_record(arms / "rloo"))
    build_eval_run(arms / "frozen", half_success, half_success)
    (arms / "frozen" / "traces" / "eval-final.jsonl").unlink()
    build_eval_run(arms / "shuffled", half_success, half_success)
    build_eval_run(arms / "sft_only", half_success, half_success)
    _json(root / "experiment.json", {"arms": {name: {"run_dir": str(arms / name)} for name in
                                              ("frozen", "rloo", "shuffled", "sft_only")}})
    return root


@cache
def clean_experiment() -> Path:
    """One experiment whose every gate passes (read-only)."""
    return build_experiment(_TMP / "experiment")


@cache
def experiment_gates() -> GateReport:
    """Every gate of the clean experiment, evaluated once per test process."""
    return evaluate_gates(clean_experiment())
