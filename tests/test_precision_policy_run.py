"""The precision policy through a whole run's set-up: one resolution per run, recorded in
config.json, and applied to every matmul path (warm start, generator, trainer, manifests); a
forced bf16 on a host that emulates it warns before the first step.

The host class is played with ``CLOSEDLOOP_CPU_FLAGS`` (the suite's default is a CPU without
native bf16); the tiny agent keeps the bf16 paths cheap even where bf16 is emulated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import closedloop.training.warm_start as warm_start_module
from closedloop.config import parse_config
from closedloop.engine import MatmulRates
from closedloop.errors import EmulatedBf16Warning
from closedloop.policy.registry import version_name
from closedloop.training.loop import opened_run
from closedloop.training.resume import resume
from closedloop.training.run import manifest_for, publish
from tests.conftest import short_run_config

AMX_FLAGS = "fpu sse2 avx2 avx512f amx_tile amx_bf16"
LABELS = {"float32": "float32", "bfloat16": "bfloat16-matmul/float32"}


def config(model_dir: Path, precision: str | None) -> dict[str, Any]:
    data = short_run_config(model_dir, rl_steps=1)
    data["sft"] = {"enabled": True, "demonstrations": 2, "epochs": 1, "batch_size": 2}
    if precision is not None:
        data["training"] = {**data["training"], "precision": precision}
    return data


def open_and_record(cfg: dict[str, Any], run_dir: Path, monkeypatch) -> dict[str, Any]:
    """Open a run (warm start included) and return what each matmul path was given."""
    seen: dict[str, Any] = {}
    real = warm_start_module.supervised_warm_start

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen["warm_start"] = kwargs["precision"]
        return real(*args, **kwargs)

    monkeypatch.setattr(warm_start_module, "supervised_warm_start", spy)
    with opened_run(parse_config(cfg), run_dir) as run:
        assert run.trainer is not None
        assert run.worker is not None
        assert not resume(run)  # a new run: checkpoint 0
        publish(run, version_name(0))  # staged, proved by the worker, active
        seen.update(run=run.ctx.precision.precision, trainer=run.trainer.config.precision,
                    generator=run.worker.generator.precision,
                    manifest=manifest_for(run, "v0000").dtype,
                    probe_gated=(run.publisher.reference is not None,
                                 run.publisher.probe_tol is not None,
                                 run.probe is not None),
                    probe_ids=len(run.probe.ids) if run.probe is not None else 0)
    seen["recorded"] = json.loads((run_dir / "config.json").read_text())["precision"]
    seen["ack"] = json.loads((run_dir / "registry" / "acks" / "v0000" / "generator-0.json"
                              ).read_text())
    return seen


@pytest.mark.parametrize(("flags", "expected"), [(None, "float32"), (AMX_FLAGS, "bfloat16")],
                         ids=["no-native-bf16", "amx"])
def test_auto_resolves_once_and_every_path_follows(tiny_agent_dir: Path, tmp_path: Path,
                                                   monkeypatch, flags: str | None,
                                                   expected: str) -> None:
    if flags is not None:
        monkeypatch.setenv("CLOSEDLOOP_CPU_FLAGS", flags)
    seen = open_and_record(config(tiny_agent_dir, None), tmp_path / "run", monkeypatch)
    assert seen["run"] == seen["warm_start"] == seen["trainer"] == seen["generator"] == expected
    assert seen["manifest"] == LABELS[expected]
    assert seen["recorded"]["requested"] == "auto"
    assert seen["recorded"]["precision"] == expected
    # the probe gates float32 publications; a bf16 run scores none (docs/concepts.md, atomic
    # weight publication), and its ACK still carries the worker's own hashes
    gated = expected == "float32"
    assert seen["probe_gated"] == (gated, gated, gated)
    assert len(seen["ack"]["probe_logprobs"]) == (seen["probe_ids"] - 1 if gated else 0)
    assert (seen["ack"]["probe_max_abs_delta"] is not None) == gated
    assert seen["ack"]["checksum_loaded"].startswith("sha256:") and seen["ack"]["digests_hash"]


def test_a_resumed_run_keeps_its_precision_on_another_host(tiny_agent_dir: Path,
                                                           tmp_path: Path, monkeypatch) -> None:
    data = config(tiny_agent_dir, None)
    data["sft"] = {"enabled": False}
    with opened_run(parse_config(data), tmp_path / "run") as run:
        assert run.ctx.precision.precision == "float32"
    monkeypatch.setenv("CLOSEDLOOP_CPU_FLAGS", AMX_FLAGS)  # the same directory, an AMX host
    with opened_run(parse_config(data), tmp_path / "run") as run:
        assert run.ctx.precision.precision == "float32"
        assert run.trainer is not None and run.trainer.config.precision == "float32"


def test_forcing_bf16_on_an_emulating_host_warns_before_the_first_step(
        tiny_agent_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("closedloop.engine.host_precision.measure_matmul_rates",
                        lambda: MatmulRates(1024, 111.0, 0.9))
    data = config(tiny_agent_dir, "bfloat16")
    data["sft"] = {"enabled": False}
    with pytest.warns(EmulatedBf16Warning, match=r"123x slower than float32"), \
            opened_run(parse_config(data), tmp_path / "run") as run:
        assert run.state.step == 0 and not (tmp_path / "run" / "checkpoints" / "step-0000").exists()
        assert run.ctx.precision.precision == "bfloat16" and run.ctx.precision.emulated_bf16
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["precision"]
    assert recorded["rates"]["bfloat16_gflops"] == 0.9
