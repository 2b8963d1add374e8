"""Session fixtures shared by the run-level tests: the tiny agent (taught once per session), one
finished four-arm experiment on it, the kill tests' zygote and uninterrupted reference run
(each started once per session), and the verifier audit of the ``verifier_fp_fn`` gate,
computed once per fixture set and verifier (``tests.shared_audit``)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

SUITE_CPU_FLAGS = "fpu sse2 avx avx2 fma"
"""The precision policy resolves ``training.precision: auto`` from the host's CPU flags; the
suite plays one host class (no native bf16, so ``auto`` is float32) on every CPU, subprocesses
included, so its runs compute alike everywhere. Tests of the policy inject facts of their own."""
os.environ["CLOSEDLOOP_CPU_FLAGS"] = SUITE_CPU_FLAGS

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:  # `make test` runs the suite on pytest-xdist workers: share the cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` (``make test``): a test without an ``xdist_group`` joins its
    module's group, so a module-scoped fixture is built on one worker only; and the slow tests
    come first, so the longest work units start first and the short ones fill in the tail
    (with ``--no-loadscope-reorder`` xdist keeps this order)."""
    if not getattr(config.option, "loadgroup", False):  # set on each xdist worker
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Stop when pytest-xdist did not tag the groups (its tag is the node id's ``@group``
    suffix, which pytest 9.2 no longer lets it set): every group would be split over the
    workers and each worker would build every costly shared fixture."""
    if not getattr(session.config.option, "loadgroup", False) or not session.items:
        return
    if not any("@" in item.nodeid for item in session.items):
        raise pytest.UsageError(
            f"pytest-xdist {_xdist_version()} did not group the tests under pytest "
            f"{pytest.__version__} (no node id carries its '@group' tag): install the "
            "versions pyproject.toml pins (scripts/setup)")


def _xdist_version() -> str:
    from importlib.metadata import version

    return version("pytest-xdist")


@pytest.fixture(scope="session", autouse=True)
def _verifier_audit_once() -> Iterator[object]:
    """The ``verifier_fp_fn`` gate's audit computed once per fixture set and verifier
    (``tests.shared_audit``); yields the real ``audit_verifier``."""
    from closedloop.evaluate.gates import environment
    from tests.shared_audit import install

    original = install()
    yield original
    environment.audit_verifier = original


@pytest.fixture(autouse=True)
def _fresh_verifier_audit(request: pytest.FixtureRequest, _verifier_audit_once: object,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``fresh_verifier_audit`` (it changes a verifier's code) audits anew."""
    if request.node.get_closest_marker("fresh_verifier_audit") is not None:
        from closedloop.evaluate.gates import environment

        monkeypatch.setattr(environment, "audit_verifier", _verifier_audit_once)


TRAIN_TASKS, HELDOUT_TASKS, SEED = 2, 2, 0
"""The task sets the tiny agent is taught on (and every run that uses it trains on)."""


@pytest.fixture(scope="session")
def tiny_agent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama that solves the two train tasks about half the time (tests.tiny_agent),
    saved as a local model folder a run config's ``model:`` accepts. Built once per test run:
    under pytest-xdist the first worker to ask builds it in the run's shared temporary folder
    while the others wait on its lock (it is deterministic, built on one thread)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return _build_tiny_agent(tmp_path_factory.mktemp("tiny-agent") / "model")
    shared = tmp_path_factory.getbasetemp().parent / "tiny-agent"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "built").exists():
            _build_tiny_agent(shared / "model")
            (shared / "built").touch()
    return shared / "model"


def _build_tiny_agent(folder: Path) -> Path:
    from closedloop.envs.terminal.task_sets import build_task_sets
    from tests.tiny_agent import build_tiny_agent

    sets = build_task_sets(TRAIN_TASKS, HELDOUT_TASKS, seed=SEED)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        agent = build_tiny_agent(folder, sets.train_ids, sets.heldout_ids, seed=SEED)
    finally:
        torch.set_num_threads(threads)
    assert agent.mixed_tasks, f"the tiny agent never both solves and fails: {agent.outcomes}"
    return agent.folder


def short_run_config(model_dir: Path, rl_steps: int) -> dict[str, object]:
    """A short tiny-agent run: 2 train tasks, ``rl_steps`` steps of 2 groups x 4 siblings, no
    SFT, no retain suites, only the start and final held-out evaluations."""
    return {
        "model": str(model_dir),
        "environment": {"train_tasks": TRAIN_TASKS, "heldout_tasks": HELDOUT_TASKS,
                        "max_turns": 6},
        "rollout": {"group_size": 4, "max_action_tokens": 64, "temperature": 1.0},
        "credit": {"censor_rule": "drop_censored"},
        "evaluation": {"attempts_per_task": 1, "retain_suites": [], "curve_points": 2,
                       "environment_family_disjoint": False, "cold_start_train_eval": False},
        "training": {"rl_steps": rl_steps, "groups_per_step": 2, "learning_rate": 1e-3,
                     "seed": SEED, "package_check": "quick"},
        "sft": {"enabled": False},
    }


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster for the test session: 2 CPUs, a 100 MB object store, no dashboard
    (skipped, naming why, where ray is not installed)."""
    from closedloop.rollout.ray_workers import RayWorkersConfig, ray_cluster, ray_unavailable_reason

    reason = ray_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with ray_cluster(RayWorkersConfig(num_cpus=2, object_store_mb=100)) as resources:
        yield resources


KILL_RL_STEPS = 3
"""RL steps of the kill tests' run (tests/test_chaos.py, tests/test_crash_resume.py)."""


@pytest.fixture(scope="session")
def kill_bed(tiny_agent_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The kill tests' zygote and the uninterrupted reference of ``short_run_config`` with
    ``KILL_RL_STEPS`` steps (``tests.forked_launch.KillBed``): started on first use, shared."""
    from tests.forked_launch import KillBed

    bed = KillBed(tmp_path_factory.mktemp("kill-bed"),
                  short_run_config(tiny_agent_dir, KILL_RL_STEPS))
    yield bed
    bed.close()


def experiment_config(model_dir: Path) -> dict[str, object]:
    """The shared experiment's config: ``short_run_config`` with 2 RL steps, a held-out curve
    point after step 1 (``curve_points: 3``), the train suite evaluated
    (``cold_start_train_eval``), the safety retain suite, and the optional branching-credit
    arm (K = 2)."""
    data = short_run_config(model_dir, 2)
    data["evaluation"] = {**data["evaluation"], "curve_points": 3,  # type: ignore[dict-item]
                          "cold_start_train_eval": True, "retain_suites": ["safety"]}
    data["credit"] = {**data["credit"],  # type: ignore[dict-item]
                      "experiment_arm": "branching", "branch_k": 2}
    return data


@pytest.fixture(scope="session")
def tiny_experiment(tiny_agent_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished experiment (four arms and the branching-credit arm) of
    ``experiment_config`` on the tiny agent, run once per session on one thread. Read-only:
    a test that changes it works on ``copy_experiment``."""
    from closedloop.config import parse_config
    from closedloop.experiments.controls import run_experiment

    exp = tmp_path_factory.mktemp("tiny-experiment") / "exp"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_experiment(parse_config(experiment_config(tiny_agent_dir)), exp)
    finally:
        torch.set_num_threads(threads)
    return exp


def copy_experiment(exp: Path, dst: Path) -> Path:
    """A writable copy of an experiment directory (its arms read their own copies)."""
    import shutil

    return Path(shutil.copytree(exp, dst, ignore=shutil.ignore_patterns("run.lock")))
