"""The actions ``check_env`` plays: the environment's own (from its sampler), garbage text,
malformed calls and ``finish``; and the terminal environment's random actions.

``ActionMix`` draws one action at a time from four sources, by weight:

- ``sampler``: the environment package's ``action_sampler(rng, task_id)``; an ``Action`` is
  played as its canonical text with probability 0.3, so the env's parser is exercised too;
- ``garbage``: text that is not an action (no call, broken JSON, two calls, a bad name);
- ``malformed``: calls of the env's own tool names with broken arguments (a key dropped, a value
  of the wrong type, a junk key, no arguments) or a name the env does not have;
- ``finish``: ``finish`` (or ``abstain``), which ends most episodes.

A source the env cannot feed (no sampler; no tool names) gets weight 0 and is named in
``ActionMix.missing``. ``counts`` holds how many actions each source gave. Weights are checked:
an unknown key, a negative or non-finite weight, or no positive weight left is a
``CheckOptionError`` naming it.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from closedloop.contracts import Action, parse_action
from closedloop.envs.task_records import TaskSpec
from closedloop.errors import ActionParseError, CheckOptionError

ActionLike = Action | str
Sampler = Callable[[random.Random, str], ActionLike]

DEFAULT_MIX: Mapping[str, float] = {"sampler": 8.0, "garbage": 1.0, "malformed": 1.0,
                                    "finish": 0.25}
GARBAGE: tuple[str, ...] = (
    "", "hello", "<tool_call>", "<tool_call>{</tool_call>", "<tool_call>[]</tool_call>",
    '<tool_call>{"name": 5}</tool_call>', "<tool_call>{}</tool_call><tool_call>{}</tool_call>",
    '<tool_call>{"name": "finish"}</tool_call> trailing', "</tool_call>",
    '<tool_call>{"name": "Read-File"}</tool_call>', '{"name": "finish"}')
"""Texts that never parse as an action (``closedloop.contracts.parse_action`` rejects each)."""


def check_weights(weights: Mapping[str, float] | None, known: Mapping[str, float],
                  what: str) -> dict[str, float]:
    """``known`` updated with ``weights``, validated (see the module docstring)."""
    out = dict(known)
    for key, value in (weights or {}).items():
        if key not in known:
            raise CheckOptionError(f"{what}: unknown key {key!r} (known: {sorted(known)}); the "
                                   "env's own actions come from its action sampler")
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                not math.isfinite(value) or value < 0:
            raise CheckOptionError(f"{what}: weight of {key!r} must be a finite number >= 0, "
                                   f"got {value!r}")
        out[key] = float(value)
    return out


def _is_unparsable(text: str) -> bool:
    try:
        parse_action(text)
    except ActionParseError:
        return True
    return False


def garbage_text(rng: random.Random) -> str:
    """One unparsable text: a fixed garbage string with a few random junk characters."""
    while True:
        text = rng.choice(GARBAGE) + "".join(rng.choice("<>{}\":x ")
                                             for _ in range(rng.randrange(4)))
        if _is_unparsable(text):
            return text


_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_WRONG_TYPES: tuple[Any, ...] = (12345, -1, "x", [], {"a": None}, None, True, 3.5)


def malformed_call(rng: random.Random, tool_names: Sequence[str],
                   examples: Mapping[str, Action]) -> Action:
    """A call to one of ``tool_names`` with broken arguments, or to a tool that does not exist.

    ``examples`` (tool name -> a valid call seen from the sampler) gives real argument names to
    break; without one the call gets no or junk arguments.
    """
    names = [n for n in tool_names if n not in ("finish", "abstain") and _NAME_RE.match(n)]
    if not names or rng.random() < 0.15:
        return Action.tool("no_such_tool_" + str(rng.randrange(3)), junk=rng.randrange(9))
    name = rng.choice(names)
    args = dict(examples[name].args) if name in examples else {}
    how = rng.choice(("drop", "retype", "junk", "empty"))
    if args and how == "drop":
        args.pop(rng.choice(sorted(args)))
    elif args and how == "retype":
        key = rng.choice(sorted(args))
        args[key] = next(v for v in rng.sample(_WRONG_TYPES, len(_WRONG_TYPES))
                         if type(v) is not type(args[key]))
    elif how == "junk" or not args:
        args["zz_junk"] = rng.choice(_WRONG_TYPES)
    else:
        args = {}
    return Action.tool(name, **args)


class ActionMix:
    """Draws check actions from the four sources (see the module docstring)."""

    def __init__(self, sampler: Sampler | None, tool_names: Sequence[str] = (),
                 weights: Mapping[str, float] | None = None) -> None:
        mix = check_weights(weights, DEFAULT_MIX, "mix")
        self.missing: list[str] = []
        if sampler is None:
            mix["sampler"] = 0.0
            self.missing.append("action_sampler")
        if not any(w > 0 for w in mix.values()):
            raise CheckOptionError("mix: every source has weight 0")
        self.sampler = sampler
        self.tool_names = list(tool_names)
        self.weights = mix
        self.examples: dict[str, Action] = {}
        self.counts: dict[str, int] = dict.fromkeys(DEFAULT_MIX, 0)

    def sequence(self, rng: random.Random, task_id: str, n: int) -> list[ActionLike]:
        """``n`` actions for ``task_id``."""
        kinds = [k for k, w in self.weights.items() if w > 0]
        probs = [self.weights[k] for k in kinds]
        return [self.one(rng, task_id, rng.choices(kinds, probs)[0]) for _ in range(n)]

    def one(self, rng: random.Random, task_id: str, kind: str) -> ActionLike:
        """One action of source ``kind``."""
        self.counts[kind] += 1
        if kind == "garbage":
            return garbage_text(rng)
        if kind == "finish":
            return Action.finish() if rng.random() < 0.8 else Action.abstain()
        if kind == "malformed":
            call = malformed_call(rng, self.tool_names or sorted(self.examples), self.examples)
            return call.canonical_text() if rng.random() < 0.3 else call
        if self.sampler is None:
            raise CheckOptionError("mix: no action sampler to draw from")
        action = self.sampler(rng, task_id)
        if isinstance(action, Action):
            if action.kind == "tool":
                self.examples.setdefault(action.name, action)
            return action.canonical_text() if rng.random() < 0.3 else action
        if not isinstance(action, str):
            raise CheckOptionError(f"the action sampler returned {type(action).__name__}, not "
                                   "an Action or text")
        return action


# --------------------------------------------------------------------------- terminal actions
DEFAULT_WEIGHTS: Mapping[str, float] = {
    "read_file": 2.0, "list_dir": 1.0, "write_file": 2.0, "replace": 2.0, "run": 1.0,
    "invalid": 2.0, "unknown_tool": 0.5, "finish": 0.3,
}
_BAD_PATHS = ("../escape.txt", "/etc/passwd", ".grader/answer.json", ".closedloop/x", "a//b",
              "", "dir/../../x", "no_such_file.txt")


def random_actions(rng: random.Random, spec: TaskSpec, n: int,
                   weights: Mapping[str, float] | None = None) -> list[ActionLike]:
    """Return ``n`` random terminal actions for ``spec``: valid tool calls, bad calls, garbage
    text, finish.

    Tool calls come as ``Action`` or as their canonical text (so parsing is exercised). ``run``
    is drawn only if the task allows it and has commands; ``weights`` overrides the mix (keys of
    ``DEFAULT_WEIGHTS``, else ``CheckOptionError``; weight 0 removes a kind).
    """
    mix = check_weights(weights, DEFAULT_WEIGHTS, "weights")
    if "run" not in spec.allowed_tools or not spec.commands:
        mix["run"] = 0.0
    kinds = [k for k, w in mix.items() if w > 0]
    if not kinds:
        raise CheckOptionError(f"weights: no action kind left for task {spec.task_id!r}")
    probs = [mix[k] for k in kinds]
    out: list[ActionLike] = []
    for i in range(n):
        action = _one_action(rng, spec, rng.choices(kinds, probs)[0], i)
        out.append(action.canonical_text() if isinstance(action, Action) and
                   rng.random() < 0.3 else action)
    return out


def _pick_path(rng: random.Random, spec: TaskSpec) -> str:
    files = sorted(spec.initial_files)
    if files and rng.random() < 0.7:
        return rng.choice(files)
    return rng.choice(_BAD_PATHS)


def _one_action(rng: random.Random, spec: TaskSpec, kind: str, i: int) -> ActionLike:
    if kind == "invalid":
        return garbage_text(rng)
    if kind == "finish":
        return Action.finish() if rng.random() < 0.8 else Action.abstain()
    if kind == "unknown_tool":
        return Action.tool("delete_everything", path=_pick_path(rng, spec))
    if kind == "list_dir":
        return Action.tool("list_dir", path=rng.choice([".", "sub", "..", ".grader", "."]))
    if kind == "read_file":
        return Action.tool("read_file", path=_pick_path(rng, spec))
    if kind == "write_file":
        path = _pick_path(rng, spec) if rng.random() < 0.6 else f"notes/n{rng.randrange(5)}.txt"
        return Action.tool("write_file", path=path, content=f"v{i}-{rng.randrange(1000)}\n")
    if kind == "replace":
        return _random_replace(rng, spec)
    names = sorted(spec.commands)
    command = rng.choice(names) if rng.random() < 0.9 else "not_a_command"
    args = [] if rng.random() < 0.7 else [rng.choice(["x", "--verbose", "../up", "a=b"])]
    return Action.tool("run", command=command, args=args)


def _random_replace(rng: random.Random, spec: TaskSpec) -> ActionLike:
    files = sorted(p for p, t in spec.initial_files.items() if t)
    if not files:
        return Action.tool("replace", path="missing.txt", old="a", new="b")
    path = rng.choice(files)
    text = spec.initial_files[path]
    start = rng.randrange(len(text))
    old = text[start:start + rng.randint(1, 8)]
    return Action.tool("replace", path=path, old=old, new=f"<{rng.randrange(100)}>",
                       count=rng.choice([1, 1, 1, 2]))
