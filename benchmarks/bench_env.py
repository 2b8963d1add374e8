"""Throughput of TerminalRepairEnv operations on a small fixture task.

Prints operations per second for reset, step (read_file, write_file, an invalid action, run),
snapshot, restore, fork and export, each measured in this one run, plus ratios against a plain
``read_file`` step (the host drifts between runs; compare ratios, not absolute numbers). Steps
are measured in episodes of realistic length: every 16 steps the env is restored to the start
(that restore is included, amortized, in the step figures).

    .venv/bin/python benchmarks/bench_env.py [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

from closedloop.contracts import Action
from closedloop.envs import TaskSpec
from closedloop.envs.terminal import TerminalRepairEnv, network_namespace_available

PROG = """\
import sys
print("total:", sum(int(x) for x in open("data.txt").read().split(",")))
"""

SPEC = TaskSpec(
    task_id="bench/0", family="bench", template="sum", split="train",
    objective="Make prog.py print the right total.",
    initial_files={"prog.py": PROG, "data.txt": "1,2,3,4\n", "README.md": "# bench\n" * 20,
                   **{f"src/mod{i}.py": f"X = {i}\n" * 30 for i in range(20)}},
    allowed_tools=("list_dir", "read_file", "write_file", "replace", "run"),
    commands={"run": ("python3", "prog.py")}, protected_paths=("prog.py",),
    step_budget=1_000_000_000)


EPISODE_STEPS = 16


def rate(fn: Callable[[], object], seconds: float, min_calls: int = 3) -> tuple[float, int]:
    """Call ``fn`` repeatedly for about ``seconds``; return (calls per second, calls)."""
    calls = 0
    start = time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and calls >= min_calls:
            return calls / elapsed, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="time per operation")
    args = parser.parse_args()
    env = TerminalRepairEnv(lambda task_id: SPEC)
    env.reset(SPEC.task_id, 0)
    ref = env.snapshot("bench")
    read = Action.tool("read_file", path="README.md")
    write = Action.tool("write_file", path="notes.txt", content="x" * 200)
    run = Action.tool("run", command="run")

    def step(action: Action | str) -> Callable[[], object]:
        count = [0]

        def op() -> object:
            count[0] += 1
            if count[0] % EPISODE_STEPS == 0:
                env.restore(ref)
            return env.step(action)
        return op

    ops: list[tuple[str, Callable[[], object]]] = [
        ("step read_file", step(read)),
        ("step write_file", step(write)),
        ("step invalid text", step("not a tool call")),
        ("step run (process)", step(run)),
        ("snapshot", lambda: env.snapshot("bench")),
        ("restore", lambda: env.restore(ref)),
        ("fork", lambda: env.fork(ref, "b")),
        ("export_state", env.export_state),
        ("reset", lambda: env.reset(SPEC.task_id, 0)),  # last: reset empties the store
    ]
    print(f"machine: {platform.platform()}, python {platform.python_version()}, "
          f"{os.cpu_count()} cpus, unshare -n: {network_namespace_available()}")
    print(f"task: {len(SPEC.initial_files)} files, "
          f"{sum(len(t) for t in SPEC.initial_files.values())} bytes")
    results: dict[str, float] = {}
    for name, fn in ops:
        env.restore(ref)
        per_s, calls = rate(fn, args.seconds)
        results[name] = per_s
        print(f"{name:>20}: {per_s:>10.0f} ops/s  ({1e3 / per_s:8.3f} ms/op, {calls} calls)")
    base = results["step read_file"]
    ratios = [f"{name} {base / per_s:.2f}x" for name, per_s in results.items()
              if name != "step read_file"]
    print("cost relative to a read_file step: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
