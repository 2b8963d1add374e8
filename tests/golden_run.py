"""The synchronous run's fingerprint: what a short tiny-agent run produced before the run was
split into roles (generator, verifier step, admission queue, trainer, publisher).

``tests/golden/sync_run.json`` was written once from the code before the restructuring
(``python -m tests.golden_run OUT``); ``tests/test_sync_golden.py`` runs the same config with
the code as it is and compares. The fingerprint keeps only what a host-independent comparison
can hold: per episode of every trace the action and prompt token ids (hashed), the summed
behaviour log-prob, reward, termination and version; the ledger's final states; every metrics
record (wall-clock fields aside; floats compared within a relative tolerance); the final
adapter's per-tensor sum and norm. Records and fields added since are allowed (the golden's
must be present and equal); none may change.

Bits are a host's: a CPU whose float32 kernels sum in another order drifts by ~1e-3 through the
warm start, and a sampled token flips (seen on a second AVX2 EPYC). So a host whose kernels
round differently (``host_numerics``) keeps its own fingerprint, ``sync_run.<numerics>.json``,
written by ``main`` on that host; a host without one is compared with ``sync_run.json``.
The run keeps the decode attention in torch's matmul form (``CLOSEDLOOP_NATIVE=0``): the C loops
(``closedloop.engine.attention_loops``) are compiled for each host's instruction set, so their
rounding is not among the bits ``host_numerics`` reads; they are tested against the matmul form
on their own.

Hashes of weights (``WEIGHT_HASH_KEYS``: a record's weight checksum, and the manifest hash that
contains it) follow the bits of every product of training, not only the host's: a product
summed in another order moves them while every figure stays within ``REL_TOL``. They are
compared by their pattern (``weight_hash_pattern``: which records saw the same weights, and
which other weights), so an evaluation of the wrong policy still fails; the weights themselves
are compared by the adapter's per-tensor sums and norms.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from closedloop.contracts import content_hash, load_episodes
from closedloop.contracts.metrics_log import VOLATILE, read_metrics
from closedloop.learn.checkpoint import load_latest
from closedloop.rollout.ledger import Ledger

GOLDEN = Path(__file__).parent / "golden" / "sync_run.json"
RL_STEPS = 2
REL_TOL = 1e-4
"""Floats agree within this relative tolerance (1e-9 absolute floor): the golden may have been
written on another CPU, whose kernels round differently in the last bits."""


def host_numerics() -> str:
    """How this host's float32 kernels round, as 16 hex digits: the bits of fixed GEMMs of the
    tiny agent's shapes and of a causal attention, at one thread."""
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = [torch.randn(m, k, generator=g) @ torch.randn(k, n, generator=g)
                for m, k, n in ((7, 64, 96), (33, 96, 64), (1, 64, 2048), (40, 64, 192))]
        q, k, v = (torch.randn(1, 4, 9, 16, generator=g) for _ in range(3))
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    finally:
        torch.set_num_threads(threads)
    digest = hashlib.sha256()
    for out in outs:
        digest.update(out.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def golden_for_host() -> Path:
    """This host's fingerprint file if its kernels have one, else ``GOLDEN``."""
    own = GOLDEN.with_name(f"sync_run.{host_numerics()}.json")
    return own if own.is_file() else GOLDEN


def golden_config(model_dir: Path) -> dict[str, Any]:
    """The fingerprinted run: the tiny agent, a 4-demonstration warm start, 2 RL steps of 2
    groups x 4 siblings, start (held-out and train) and final evaluations."""
    return {
        "model": str(model_dir),
        "environment": {"train_tasks": 2, "heldout_tasks": 2, "max_turns": 6},
        "rollout": {"group_size": 4, "max_action_tokens": 64, "temperature": 1.0},
        "credit": {"censor_rule": "drop_censored"},
        "evaluation": {"attempts_per_task": 1, "retain_suites": [], "curve_points": 2,
                       "environment_family_disjoint": False, "cold_start_train_eval": True},
        "training": {"rl_steps": RL_STEPS, "groups_per_step": 2, "learning_rate": 1e-3,
                     "seed": 0},
        "sft": {"enabled": True, "demonstrations": 4, "epochs": 1, "batch_size": 4,
                "learning_rate": 1e-3},
    }


def _steady(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _steady(v) for k, v in value.items()
                if k not in VOLATILE and not str(k).endswith("_s")}
    if isinstance(value, list):
        return [_steady(v) for v in value]
    return value


def fingerprint(run_dir: Path) -> dict[str, Any]:
    """The fingerprint of a finished run directory (module docstring)."""
    traces: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((run_dir / "traces").glob("*.jsonl")):
        _, episodes = load_episodes(path)
        traces[path.name] = [{
            "episode": ep.trajectory.episode_id,
            "actions": content_hash([list(t.action_token_ids) for t in ep.turns]),
            "prompts": content_hash([list(t.prompt_token_ids) for t in ep.turns]),
            "logp": sum(sum(t.behavior_logprobs) for t in ep.turns),
            "reward": ep.trajectory.reward, "termination": ep.trajectory.termination.value,
            "version": ep.trajectory.behavior_policy_version}
            for ep in sorted(episodes, key=lambda e: e.trajectory.episode_id)]
    with Ledger(run_dir / "ledger.sqlite") as ledger:
        rows = {g: ledger.get(g) for g in ledger.group_ids()}
        states = {g: [r.state, r.reason, r.consumed_step] for g, r in sorted(rows.items())}
    metrics = {json.dumps([r["kind"], r.get("step"), r.get("label")]): _steady(r)
               for r in read_metrics(run_dir / "metrics.jsonl")}
    ckpt = load_latest(run_dir / "checkpoints")
    assert ckpt is not None
    adapter = {k: [float(v.double().sum()), float(v.double().norm())]
               for k, v in sorted(ckpt.model_state.items())}
    return {"traces": traces, "ledger": states, "metrics": metrics, "adapter": adapter,
            "checkpoint_step": ckpt.step, "torch": torch.__version__}


WEIGHT_HASH_KEYS = ("weight_checksum", "manifest_hash")


def weight_hash_paths(fp: dict[str, Any]) -> list[tuple[str, ...]]:
    """The paths (below ``metrics``) of every ``WEIGHT_HASH_KEYS`` field of ``fp``, sorted."""
    paths: list[tuple[str, ...]] = []

    def walk(value: Any, path: tuple[str, ...]) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if k in WEIGHT_HASH_KEYS and isinstance(v, str):
                    paths.append((*path, k))
                else:
                    walk(v, (*path, k))

    walk(fp.get("metrics", {}), ())
    return sorted(paths)


def weight_hash_pattern(fp: dict[str, Any], paths: list[tuple[str, ...]]) -> dict[str, Any]:
    """``fp`` with the weight hash at each of ``paths`` (``weight_hash_paths`` of the golden)
    replaced by a label, ``<key>#<n>``: the n-th distinct value of that key along ``paths``.
    Equal hashes get equal labels and the bits are dropped (module doc); hashes at other paths
    (records the golden does not have) are left as they are."""
    out = json.loads(json.dumps(fp))
    labels: dict[str, dict[str, str]] = {key: {} for key in WEIGHT_HASH_KEYS}
    for path in paths:
        record = out.get("metrics", {})
        for k in path[:-1]:
            record = record.get(k, {}) if isinstance(record, dict) else {}
        key = path[-1]
        if isinstance(record, dict) and isinstance(record.get(key), str):
            seen = labels[key]
            record[key] = seen.setdefault(record[key], f"{key}#{len(seen)}")
    return out


NOISE_ABS_TOL = 1e-3
"""Figures that measure rounding itself (the generator/trainer log-prob gap: ``ratio/*``,
``policies/d_sample``, the audit record) are compared within this absolute tolerance: on
another CPU, or after a change of the shapes the products run at, they are other rounding noise
of the same size."""


def _close(a: Any, b: Any, where: str) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        noise = "/ratio/" in where or '"audit"' in where or where.endswith("/d_sample")
        return math.isclose(float(a), float(b), rel_tol=REL_TOL,
                            abs_tol=NOISE_ABS_TOL if noise else 1e-9)
    return bool(a == b)


def differences(golden: Any, now: Any, where: str = "") -> list[str]:
    """Where ``now`` departs from ``golden``: a golden key missing or a value changed (dicts
    may have gained keys; lists must match element by element)."""
    if isinstance(golden, dict):
        if not isinstance(now, dict):
            return [f"{where}: {type(now).__name__}, golden a dict"]
        out = []
        for k, v in golden.items():
            if k not in now:
                out.append(f"{where}/{k}: missing")
            else:
                out += differences(v, now[k], f"{where}/{k}")
        return out
    if isinstance(golden, list):
        if not isinstance(now, list) or len(now) != len(golden):
            return [f"{where}: {now!r:.200} != golden {golden!r:.200}"]
        return [d for i, (g, n) in enumerate(zip(golden, now, strict=True))
                for d in differences(g, n, f"{where}[{i}]")]
    if _close(golden, now, where):
        return []
    return [f"{where}: {now!r:.200} != golden {golden!r:.200}"]


def main(argv: list[str]) -> int:
    """Build the tiny agent in ``argv[0]``, run the golden config and write the fingerprint to
    ``argv[1]`` (default: this host's ``sync_run.<numerics>.json``)."""
    import os

    import yaml

    from closedloop.config import parse_config
    from closedloop.engine import NATIVE_ENV
    from closedloop.envs.terminal.task_sets import build_task_sets
    from closedloop.training.loop import train
    from tests.conftest import HELDOUT_TASKS, SEED, TRAIN_TASKS
    from tests.tiny_agent import build_tiny_agent

    os.environ[NATIVE_ENV] = "0"  # the module doc: torch's kernels only
    work = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else GOLDEN.with_name(
        f"sync_run.{host_numerics()}.json")
    torch.set_num_threads(1)
    sets = build_task_sets(TRAIN_TASKS, HELDOUT_TASKS, seed=SEED)
    agent = build_tiny_agent(work / "model", sets.train_ids, sets.heldout_ids, seed=SEED)
    data = golden_config(agent.folder)
    (work / "run.yaml").write_text(yaml.safe_dump(data))
    train(parse_config(data), work / "run")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fingerprint(work / "run"), indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
