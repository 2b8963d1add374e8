"""``TrainingRun``: one run directory opened (locked, its config and tasks checked, the model
loaded) with the parts that act on it, and ``write_summary`` at its end."""

from __future__ import annotations

import os
import platform
import random
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from closedloop.config import RunConfig, task_set_request
from closedloop.contracts.metrics_log import MetricsLog
from closedloop.contracts.package import TaskSetRequest
from closedloop.engine import PrecisionChoice, resolve_for_run
from closedloop.errors import EnvPackageError
from closedloop.policy import check_append_only, load_model
from closedloop.policy.registry import PolicyRegistry
from closedloop.progress import log, phase
from closedloop.rollout.admission import AdmissionController
from closedloop.rollout.ledger import Ledger
from closedloop.rollout.task_sampler import DifficultyBandSampler
from closedloop.training.integrity import (
    RunLock,
    check_config,
    check_tasks,
    recorded_meta,
    require_complete,
)
from closedloop.training.rl_step import RunRLStep
from closedloop.training.run_evaluation import RunEvaluation
from closedloop.training.warm_start import RunWarmStart
from closedloop.training.wiring import make_renderer, run_package


def _seed_all(seed: int) -> None:
    """Seed the process-wide RNGs (Python, NumPy, torch); checkpoints capture all three."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _git_revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5, check=False)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _versions() -> dict[str, str]:
    import peft
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus"}


class TrainingRun(RunRLStep, RunEvaluation, RunWarmStart):
    """The state of one run (see ``closedloop.training``): set-up here; the policy and
    collection (``closedloop.training.run_policy``), the warm start and SFT-only control
    (``.warm_start``), evaluation and audit (``.evaluation``), the RL step (``.rl_step``) and
    checkpoint/resume (``.checkpoints``) are its parts."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path,
                 config_override: str | None = None,
                 precision: PrecisionChoice | None = None) -> None:
        """Lock the run directory and check its config against the recorded one
        (``closedloop.training.integrity``; ``config_override`` is the declared reason for a
        change).
        ``precision``: a resolution to adopt on the first launch (an experiment's arms share
        their cold start's); a run directory's recorded one always wins.
        """
        self.cfg = cfg
        self.dir = Path(run_dir)
        for sub in ("traces", "checkpoints", "sft"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self._lock = RunLock(self.dir)
        try:
            self._open(cfg, config_override, precision)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, cfg: RunConfig, config_override: str | None,
              precision: PrecisionChoice | None) -> None:
        recorded = recorded_meta(self.dir).get("precision")
        self.precision = resolve_for_run(
            cfg.training.precision,
            recorded if recorded is not None or precision is None else precision.to_dict())
        log(f"precision: {self.precision.describe()}")
        check_config(self.dir, cfg.to_dict(), {"config_hash": cfg.config_hash(),
                                               "git_revision": _git_revision(),
                                               "versions": _versions(),
                                               "precision": self.precision.to_dict()},
                     config_override)
        self.run_id = f"{self.dir.name}"
        self.metrics_path = self.dir / "metrics.jsonl"
        self.metrics = MetricsLog(self.metrics_path)
        if self.metrics.repaired_tail:
            log(f"{self.metrics_path}: cut off a last line a killed launch left unfinished")
        _seed_all(cfg.training.seed)
        self.package = run_package(cfg.environment)  # tasks, env, verifier, scaffold
        tasks_json = self.dir / "tasks.json"
        recorded_tasks = tasks_json.read_bytes() if tasks_json.is_file() else None
        self._build_tasks()
        check_tasks(tasks_json, recorded_tasks, {"train": self.train_tasks,
                                                 "heldout": self.heldout_tasks},
                    config_override)
        with phase("model load"):
            self._load_policy()
        self.verifier = self.package.verifier()
        self.ledger = Ledger(self.dir / "ledger.sqlite")
        self.registry = PolicyRegistry(self.dir / "registry")
        self.admission = AdmissionController(cfg.rollout.max_version_lag,
                                             censor_rule=cfg.credit.censor_rule)
        self.sampler = DifficultyBandSampler(
            self.train_tasks, [self.package.task_info(t).family for t in self.train_tasks],
            seed=cfg.training.seed)
        self.trainer = None
        self.step = 0
        self.consumed = set()
        self.sft_tokens = 0

    # ------------------------------------------------------------------ set-up
    def _build_tasks(self) -> None:
        request = task_set_request(self.cfg, self.package)
        sets = self.package.task_sets(request)
        self.train_tasks, self.heldout_tasks = list(sets.train), list(sets.heldout)
        if request.family_tasks and "family" not in sets.suites:
            raise EnvPackageError(f"environment package {self.package.env_id!r} has no "
                                  "family-disjoint suite; set evaluation."
                                  "environment_family_disjoint: false")
        self.family_tasks = list(sets.suites.get("family", ()))
        self.demo_tasks = self._demo_tasks(request)
        self._write_json("tasks.json", {
            "env_id": self.package.env_id, "train": self.train_tasks,
            "heldout": self.heldout_tasks, "family": self.family_tasks,
            "demo": self.demo_tasks, "discarded": list(sets.discarded), **sets.audit})
        log(f"tasks: {len(self.train_tasks)} train / {len(self.heldout_tasks)} held-out "
            f"(template-disjoint) / {len(self.family_tasks)} family-disjoint "
            f"of {self.package.env_id}, {len(sets.discarded)} discarded by the solvability "
            f"filter; demonstrations on {len(self.demo_tasks)} other train-template tasks")

    def _demo_tasks(self, request: TaskSetRequest) -> list[str]:
        """The tasks the noisy expert demonstrates: other instances of the train templates (the
        package's train set at ``task_seed + 1``, less every train and evaluation task), so the
        warm start teaches the templates without memorizing the tasks RL then trains on and the
        cold start's train success measures the policy, not recall. A package that has no other
        instances leaves the train tasks themselves (logged)."""
        other = self.package.task_sets(replace(request, seed=request.seed + 1, family_tasks=0))
        taken = {*self.train_tasks, *self.heldout_tasks, *self.family_tasks}
        demo = [t for t in other.train if t not in taken]
        if not demo:
            log("demonstrations: the package has no train-template tasks besides the run's; "
                "the warm start demonstrates the train tasks")
            return list(self.train_tasks)
        return demo

    def _load_policy(self) -> None:
        cfg = self.cfg
        model_arg = None if cfg.model == "embedded" else cfg.model
        self.loaded = load_model(model_arg, dtype=cfg.training.dtype)
        log(f"model {self.loaded.model_id} loaded from {self.loaded.source} in "
            f"{self.loaded.load_seconds:.1f}s")
        self.tokenizer = self.loaded.tokenizer
        self.model = self.loaded.model
        if getattr(self.model, "hf_quantizer", None) is not None:
            self.model.hf_quantizer.remove_quantization_config(self.model)
        self.renderer = make_renderer(self.tokenizer, self.package)
        report = check_append_only(self.renderer)
        self._write_json("template.json", report._asdict() if hasattr(report, "_asdict")
                         else report.__dict__)
        self.pad_id = int(self.tokenizer.pad_token_id or 0)

    def close(self) -> None:
        """Stop the scale-out workers, close the ledger and release the run directory."""
        try:
            scale = getattr(self, "_scale_out", None)
            if scale is not None:
                scale.close()
            self.ledger.close()
        finally:
            self._lock.release()


def write_summary(run: TrainingRun, data: dict[str, Any]) -> Path:
    """Write summary.json atomically and return its path, once every RL step of the config is
    committed and logged (``RunStateError`` otherwise)."""
    require_complete(run.dir, run.cfg.training.rl_steps, run.metrics)
    run._write_json("summary.json", data)
    return run.dir / "summary.json"
