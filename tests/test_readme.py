"""The README is a user's document that runs as written: it opens with the two commands, stays
short and undated, its quick start runs, and its bring-your-own-environment example (under 30
lines) passes ``check_package`` and trains one step through ``closedloop train``.

The quick start's blocks run in order in one namespace on the tiny random Llama; the gates block
reads the synthetic clean run of the gate tests in place of ``runs/my-run``. The environment
example is saved as ``lock.py`` on the import path, exactly as the README tells a user to.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.evaluate.synthetic_run import clean_run

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
HISTORY = re.compile(r"\bsession [0-9]|tried and dropped|commit [0-9a-f]{7}|\b[0-9a-f]{7,40}\b"
                     r"|\b20[0-9]{2}-[0-9]{2}-[0-9]{2}\b", flags=re.I)
"""A diary in the README: sessions, commits, commit ids, dated figures."""


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def quick_start() -> list[str]:
    return [b for b in blocks("python") if "lock" not in b]


def lock_blocks() -> tuple[str, str]:
    env, check = [b for b in blocks("python") if "lock" in b]
    return env, check


def test_the_readme_opens_with_the_two_commands_and_stays_a_users_document() -> None:
    first = blocks("bash")[0].strip().splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make smoke", "make test"]
    assert README.index("make smoke") < README.index("## ")
    assert len(README.splitlines()) <= 160
    assert HISTORY.findall(README) == []


def test_the_quick_start_runs() -> None:
    code = quick_start()
    assert len(code) == 2  # an episode group; a training step and the gates
    assert 'evaluate_gates("runs/my-run")' in code[1]
    code[1] = code[1].replace('"runs/my-run"', repr(str(clean_run())))
    namespace: dict[str, Any] = {}
    for block in code:
        exec(compile(block, "README.md", "exec"), namespace)  # the README's own code
    assert len(namespace["group"].episodes) == 2
    assert namespace["result"].metrics["optim/steps_on_batch"] == 1
    assert namespace["report"].gates and namespace["report"].exit_code in (0, 1, 3)


def test_the_readme_links_resolve() -> None:
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", README)
    assert {"docs/README.md", "docs/config.md", "docs/environments.md"} <= set(links)
    assert [link for link in links if not (ROOT / link).is_file()] == []


# --------------------------------------------------------------------------- bring your own env
@pytest.fixture
def lock_module(tmp_path: Path) -> Iterator[Path]:
    """The README's ``lock.py``, saved and importable (as ``PYTHONPATH=.`` makes it)."""
    env, _ = lock_blocks()
    (tmp_path / "lock.py").write_text(env, encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("lock", None)


def test_the_environment_example_is_under_30_lines() -> None:
    env, _ = lock_blocks()
    code = [line for line in env.splitlines() if line.strip()]
    assert 20 < len(code) < 30
    assert "rules_package(" in env and "environment.factory" in README


def test_the_environment_example_passes_check_package(lock_module: Path) -> None:
    _, check = lock_blocks()
    namespace: dict[str, Any] = {}
    exec(compile(check, "README.md", "exec"), namespace)  # the README's own code
    from closedloop.envs import check_package

    report = check_package(namespace["lock_package"]())
    assert report.missing == () and report.fork_checks > 0 and report.sampler_actions > 0
    assert report.package_checks == 4  # env version + the expert on each of three tasks


def _readme_config() -> dict[str, Any]:
    """The YAML the README's shell block writes to ``lock.yaml``."""
    (shell,) = [b for b in blocks("bash") if "lock.yaml" in b]
    assert "closedloop train lock.yaml" in shell
    lines = [q for q in re.findall(r"'([^']*)'", shell) if q != "%s\\n"]
    config: dict[str, Any] = yaml.safe_load("\n".join(lines))
    return config


@pytest.mark.slow  # closedloop train end to end (warm start, evaluations, audit, one RL step)
def test_the_environment_example_runs_through_closedloop_train(
        lock_module: Path, tiny_agent_dir: Path) -> None:
    from closedloop.config import load_config
    from closedloop.errors import UnscorableRunError
    from closedloop.training.loop import train

    config = _readme_config()
    assert config["environment"]["factory"] == "lock:lock_package"
    cheap = {  # the README's config, on the tiny model and at its smallest
        "model": str(tiny_agent_dir),
        "environment": {"train_tasks": 2, "heldout_tasks": 2},
        "rollout": {"group_size": 2, "max_action_tokens": 32},
        "evaluation": {"attempts_per_task": 1, "curve_points": 2, "cold_start_train_eval": False},
        "training": {"rl_steps": 1, "groups_per_step": 1},
        "sft": {"demonstrations": 2, "epochs": 1, "batch_size": 2},
    }
    for section, values in cheap.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) \
            else values
    path = lock_module / "lock.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    run = lock_module / "runs" / "lock"
    # the tiny model was taught terminal actions, not the lock's: in the lock world every one
    # of its actions runs past the token limit, nothing is scored, and the run stops naming the
    # key instead of ending well having trained nothing (closedloop.evaluate.scorable)
    with pytest.raises(UnscorableRunError) as info:
        train(load_config(path), run)
    assert info.value.keys[0] == "rollout.max_action_tokens"
    assert json.loads((run / "tasks.json").read_text())["env_id"] == "lock-v1"
    trace = (run / "traces" / "step-0000.jsonl").read_text().splitlines()
    trajectories = [r for r in map(json.loads, trace) if r["record"] == "trajectory"]
    assert len(trajectories) == 2 and {t["env_version"] for t in trajectories} == {"lock-v1"}
    demos = (run / "traces" / "sft-demos.jsonl").read_text()
    assert '"lock-v1/pair/' in demos  # the warm start played the package's noisy expert
