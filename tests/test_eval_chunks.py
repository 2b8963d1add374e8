"""An evaluation larger than ``EVAL_CHUNK_EPISODES`` runs in chunks kept on disk: the joined
trace holds the same episodes as one collection would, and a crash between chunks loses only
the chunk that was running."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import closedloop.training.run_evaluation as evaluation
from closedloop.config import parse_config
from closedloop.contracts import load_episodes
from closedloop.policy.registry import version_name
from closedloop.training.loop import opened_run
from closedloop.training.resume import resume
from closedloop.training.run import publish
from closedloop.training.run_evaluation import evaluate
from tests.conftest import short_run_config

pytestmark = pytest.mark.slow


def _evaluate(run_dir: Path, model: Path) -> tuple[Any, list[Any]]:
    data = short_run_config(model, 1)
    data["evaluation"]["attempts_per_task"] = 3  # type: ignore[index]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with opened_run(parse_config(data), run_dir) as run:
            if not resume(run):
                publish(run, version_name(0))
            summary = evaluate(run, "start", run.registry.manifest(version_name(0)))
    finally:
        torch.set_num_threads(threads)
    return summary, list(load_episodes(run_dir / "traces" / "eval-start.jsonl")[1])


def _actions(episodes: list[Any]) -> dict[str, list[list[int]]]:
    return {ep.trajectory.episode_id: [list(t.action_token_ids) for t in ep.turns]
            for ep in episodes}


def test_a_chunked_evaluation_equals_one_collection_and_resumes_chunk_by_chunk(
        tiny_agent_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole, whole_eps = _evaluate(tmp_path / "whole", tiny_agent_dir)
    assert len(whole_eps) == 6  # 2 held-out tasks x 3 attempts: one collection

    monkeypatch.setattr(evaluation, "EVAL_CHUNK_EPISODES", 2)
    real_collect = evaluation.collect_with_worker
    chunks: list[int] = []

    def crash_on_the_second_chunk(run: Any, manifest: Any, path: Path, groups: Any,
                                  desc: str) -> Any:
        chunks.append(len(groups))
        if len(chunks) == 2:
            raise RuntimeError("killed between chunks")
        return real_collect(run, manifest, path, groups, desc)

    monkeypatch.setattr(evaluation, "collect_with_worker", crash_on_the_second_chunk)
    run_dir = tmp_path / "chunked"
    with pytest.raises(RuntimeError, match="killed between chunks"):
        _evaluate(run_dir, tiny_agent_dir)
    kept = run_dir / "traces" / ".chunks" / "eval-start"
    assert [p.name for p in sorted(kept.iterdir())] == ["000.jsonl"]
    assert not (run_dir / "traces" / "eval-start.jsonl").exists()

    chunks.clear()

    def count(run: Any, manifest: Any, path: Path, groups: Any, desc: str) -> Any:
        chunks.append(len(groups))
        return real_collect(run, manifest, path, groups, desc)

    monkeypatch.setattr(evaluation, "collect_with_worker", count)
    resumed, resumed_eps = _evaluate(run_dir, tiny_agent_dir)
    assert chunks == [2, 2]  # the kept chunk is not collected again
    assert not (run_dir / "traces" / ".chunks" / "eval-start").exists()
    assert _actions(resumed_eps) == _actions(whole_eps)  # each episode's own stream
    assert json.dumps(resumed.to_dict()["tasks"]) == json.dumps(whole.to_dict()["tasks"])
