"""Small terminal-repair tasks for the environment tests (no task registry needed)."""

from closedloop.envs import TaskSpec
from closedloop.envs.terminal import EnvConfig, SandboxConfig, TerminalRepairEnv

ALL_TOOLS = ("list_dir", "read_file", "write_file", "replace", "run")

VALIDATE_PY = """\
import json
import sys

try:
    with open("config.json") as fh:
        data = json.load(fh)
except ValueError as exc:
    print(f"invalid: {exc}")
    sys.exit(1)
print("valid", sorted(data))
"""

PROG_PY = """\
import os
import random
import sys


def total(path):
    with open(path) as fh:
        return sum(int(x) for x in fh.read().split(",") if x.strip())


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "run"
    if cmd == "run":
        print("total:", total("data.txt"))
    elif cmd == "roll":
        print("seed", os.environ["CLOSEDLOOP_SEED"], "clock", os.environ["CLOSEDLOOP_CLOCK"],
              "roll", random.randint(0, 10**9))
    elif cmd == "save":
        with open("out/result.txt", "w") as fh:
            fh.write("saved " + " ".join(sys.argv[2:]) + "\\n")
        print("saved")
    else:
        print("unknown command", cmd, file=sys.stderr)
        sys.exit(2)
"""

TEST_PROG_PY = """\
import prog

got = prog.total("data.txt")
print("PASS" if got == 10 else f"FAIL: total is {got}, expected 10")
"""


def json_task(budget: int = 12) -> TaskSpec:
    return TaskSpec(
        task_id=f"fixture-json/{budget}", family="fixture-json", template="trailing-comma",
        split="train", objective="Make config.json valid JSON without changing its values.",
        initial_files={"config.json": '{"name": "demo", "port": 80,}\n',
                       "README.md": "# demo\nRun validate to check config.json.\n",
                       "validate.py": VALIDATE_PY, "sub/notes.txt": "nothing here\n"},
        allowed_tools=ALL_TOOLS, commands={"validate": ("python3", "validate.py")},
        protected_paths=("validate.py",), step_budget=budget)


def cli_task(budget: int = 12) -> TaskSpec:
    return TaskSpec(
        task_id=f"fixture-cli/{budget}", family="fixture-cli", template="bad-separator",
        split="train", objective="Fix data.txt so that the test prints PASS.",
        initial_files={"prog.py": PROG_PY, "test_prog.py": TEST_PROG_PY,
                       "data.txt": "1;2,3,4\n"},
        allowed_tools=ALL_TOOLS,
        commands={"run": ("python3", "prog.py", "run"), "roll": ("python3", "prog.py", "roll"),
                  "save": ("python3", "prog.py", "save"), "test": ("python3", "test_prog.py")},
        protected_paths=("prog.py", "test_prog.py"), step_budget=budget)


def readonly_task() -> TaskSpec:
    spec = json_task()
    return TaskSpec(**{**spec.__dict__, "task_id": "fixture-readonly",
                       "allowed_tools": ("list_dir", "read_file"), "commands": {}})


SPECS = {s.task_id: s for s in (json_task(), json_task(3), json_task(100_000), cli_task(),
                                cli_task(40), readonly_task())}
JSON_TASK = json_task().task_id
JSON_SHORT = json_task(3).task_id
JSON_LONG = json_task(100_000).task_id
CLI_TASK = cli_task().task_id
CLI_LONG = cli_task(40).task_id
READONLY_TASK = readonly_task().task_id

FAST_SANDBOX = SandboxConfig(timeout_s=5.0, output_cap_bytes=4096)


def source(task_id: str) -> TaskSpec:
    return SPECS[task_id]


def make_env(config: EnvConfig | None = None) -> TerminalRepairEnv:
    return TerminalRepairEnv(source, config or EnvConfig(sandbox=FAST_SANDBOX))
