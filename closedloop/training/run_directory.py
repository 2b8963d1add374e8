"""The run directory as one open object: locked, its config checked against the recorded one,
its precision resolved, and the two writers every role uses (an atomic JSON file, one
``metrics.jsonl`` record).

Opening is the first half of the one set-up path every entry point shares
(``closedloop.training.run.open_run``); what the directory holds is listed in
``closedloop.training``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from closedloop.config import RunConfig
from closedloop.contracts.metrics_log import MetricsLog
from closedloop.engine import PrecisionChoice, resolve_device, resolve_for_run
from closedloop.progress import log
from closedloop.training.integrity import RunLock, check_config, recorded_meta

__all__ = ["RunDirectory", "git_revision", "library_versions"]


def git_revision() -> str:
    """The checkout's commit (``unknown`` outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5, check=False)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def library_versions() -> dict[str, str]:
    """torch, transformers, peft and Python versions and the machine (config.json keeps them)."""
    import peft
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus"}


class RunDirectory:
    """One run directory, opened by one launch (``run.lock`` held until ``close``).

    ``precision``: a resolution to adopt on the first launch (an experiment's arms share their
    cold start's); a directory's recorded one always wins. ``config_override``: the declared
    reason for a config that differs from the recorded one (``integrity.check_config``).
    """

    def __init__(self, path: str | Path, cfg: RunConfig, config_override: str | None = None,
                 precision: PrecisionChoice | None = None) -> None:
        self.path = Path(path)
        for sub in ("traces", "checkpoints", "sft"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        self._lock = RunLock(self.path)
        try:
            recorded = recorded_meta(self.path).get("precision")
            self.device = resolve_device(cfg.training.device)
            self.precision = resolve_for_run(
                cfg.training.precision,
                recorded if recorded is not None or precision is None else precision.to_dict(),
                device=self.device)
            log(f"precision: {self.precision.describe()}")
            check_config(self.path, cfg.to_dict(), {"config_hash": cfg.config_hash(),
                                                    "git_revision": git_revision(),
                                                    "versions": library_versions(),
                                                    "precision": self.precision.to_dict()},
                         config_override)
            self.run_id = self.path.name
            self.metrics_path = self.path / "metrics.jsonl"
            self.metrics = MetricsLog(self.metrics_path)
        except BaseException:
            self._lock.release()
            raise
        if self.metrics.repaired_tail:
            log(f"{self.metrics_path}: cut off a last line a killed launch left unfinished")

    def trace(self, name: str) -> Path:
        """``traces/<name>.jsonl``."""
        return self.path / "traces" / f"{name}.jsonl"

    def write_json(self, name: str, data: Any) -> None:
        """Replace ``<dir>/<name>`` with ``data`` as JSON, atomically."""
        path = self.path / name
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, path)

    def log_metrics(self, kind: str, data: dict[str, Any], step: int) -> None:
        """Store one record in metrics.jsonl, exactly once per key (``(kind, step, label)``,
        ``closedloop.contracts.metrics_log``): a record without ``step`` or ``label`` is keyed
        by ``step`` (the run's current step); one that names its source, ``seeded_from``, by
        that."""
        line = {"kind": kind, "time": time.time(), **data}
        if "label" not in line and "seeded_from" in line:
            line["label"] = str(line["seeded_from"])
        if "step" not in line and "label" not in line:
            line["step"] = step
        self.metrics.put(line)

    def close(self) -> None:
        """Release the directory's lock."""
        self._lock.release()
