"""The README's quick start runs as written and its links into docs/ resolve.

The Python blocks run in order in one namespace on the tiny random Llama; the last block reads
the gates of a run directory, given the synthetic clean run of the gate tests in place of
``runs/my-run``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.evaluate.synthetic_run import clean_run

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_the_quick_start_runs() -> None:
    blocks = python_blocks()
    assert len(blocks) == 4  # tasks, an episode, a training step, the gates
    assert 'evaluate_gates("runs/my-run")' in blocks[3]
    blocks[3] = blocks[3].replace('"runs/my-run"', repr(str(clean_run())))
    namespace: dict[str, Any] = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # the README's own code
    assert len(namespace["group"].episodes) == 2
    assert namespace["result"].metrics["optim/steps_on_batch"] == 1
    assert namespace["report"].gates and namespace["report"].exit_code in (0, 1, 3)


def test_the_readme_links_resolve() -> None:
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", README)
    assert "docs/architecture.md" in links and "docs/gates.md" in links
    # docs/results.md is written by the experiments' own report (it may not exist yet)
    missing = [link for link in links if link != "docs/results.md" and not (ROOT / link).is_file()]
    assert missing == []
