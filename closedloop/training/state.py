"""The state a training run's parts share: what its run directory holds open, and the two
writers every part uses (an atomic JSON file, one ``metrics.jsonl`` record).

``RunState`` declares the attributes ``closedloop.training.run.TrainingRun`` sets when it opens
a run directory; the other parts of the run (policy, warm start, evaluation, RL step,
checkpoints) are mixins over it and read them through ``self``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from closedloop.config import RunConfig
from closedloop.contracts import GuardedVerifier
from closedloop.contracts.metrics_log import MetricsLog
from closedloop.contracts.package import EnvPackage
from closedloop.engine import HFGenerator, PrecisionChoice
from closedloop.learn.trainer import Trainer
from closedloop.policy import LoadedModel
from closedloop.policy.registry import PolicyRegistry
from closedloop.rollout.admission import AdmissionController
from closedloop.rollout.ledger import Ledger
from closedloop.rollout.task_sampler import DifficultyBandSampler


class RunState:
    """The attributes of one open run (set by ``TrainingRun``) and its file writers."""

    cfg: RunConfig
    dir: Path
    run_id: str
    precision: PrecisionChoice  # resolved once per run; every matmul path uses .precision
    metrics_path: Path
    metrics: MetricsLog
    package: EnvPackage  # tasks, env, verifier, scaffold
    train_tasks: list[str]
    heldout_tasks: list[str]
    family_tasks: list[str]
    demo_tasks: list[str]  # what the noisy expert demonstrates (never a train or eval task)
    loaded: LoadedModel
    tokenizer: Any
    model: Any  # the base, then base + SFT merged, then wrapped with the RL adapter
    renderer: Any
    pad_id: int
    verifier: GuardedVerifier
    ledger: Ledger
    registry: PolicyRegistry
    admission: AdmissionController
    sampler: DifficultyBandSampler
    trainer: Trainer | None  # set by attach_rl_adapter
    generator: HFGenerator  # set by attach_rl_adapter
    step: int
    consumed: set[str]
    sft_tokens: int

    def _write_json(self, name: str, data: Any) -> None:
        path = self.dir / name
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, path)

    def log_metrics(self, kind: str, data: dict[str, Any]) -> None:
        """Store one record in metrics.jsonl, exactly once per key (``(kind, step, label)``,
        ``closedloop.contracts.metrics_log``): a record without ``step`` or ``label`` is keyed
        by the run's current step (one that names its source, ``seeded_from``, by that)."""
        line = {"kind": kind, "time": time.time(), **data}
        if "label" not in line and "seeded_from" in line:
            line["label"] = str(line["seeded_from"])
        if "step" not in line and "label" not in line:
            line["step"] = self.step
        self.metrics.put(line)
