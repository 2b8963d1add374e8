"""Scripted policies: expert, noisy expert and random (demonstrations and controls).

Every policy answers ``act(observation, history=None)`` with model-format *text*: the
``<tool_call>`` text of an action as demonstrations write it (``Action.model_text()``: the
tool's name first, its arguments in order) or, for the noisy expert, a deliberately malformed
call. Their episodes are therefore demonstrations in the model's own
format. A policy instance plays one episode: it counts its own steps; when ``history`` (the
agent's previous action texts) is given, ``len(history)`` is the step index instead.

- ``ExpertPolicy(bundle)``: plays the task's gold actions, then ``finish``.
- ``NoisyExpertPolicy(bundle, error_rate, seed)``: before each gold tool action, with
  probability ``error_rate``, makes one mistake and recovers: a malformed call (then the right
  one), a wrong path (then the right one), a ``replace`` whose ``old`` text is not in the file
  (the ``new`` text in its place, the commonest slip of a model copying an edit; the tool's
  ``not_found`` error, then the right one), or a wrong edit (the edit with a stray ``~``, then
  the ``check`` run that shows it, then the corrective edit). The plan is cut at the step
  budget, so many errors can make it fail; at ``error_rate=0.2`` it usually solves.
- ``RandomPolicy(seed)``: uniformly random tool calls with random arguments (and ``finish``);
  it almost never solves.

``play(env, policy, task_id, seed)`` runs one episode and returns the texts, transitions and the
exported final state.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from closedloop.contracts import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Action, AgentEnv, Transition
from closedloop.envs.task_records import TaskBundle

CORRUPTION = "~"  # never occurs in generated task files, so a corrupted edit is unique


class ScriptedPolicy(Protocol):
    """A policy that answers with an action or raw model-like text."""

    def act(self, observation: str, history: Sequence[Any] | None = None) -> Action | str:
        """Return the next action (or text, possibly malformed on purpose)."""
        ...


class _PlannedPolicy:
    """Plays a fixed plan of texts, then ``finish``."""

    def __init__(self, plan: Sequence[str]) -> None:
        self.plan: tuple[str, ...] = tuple(plan)
        self._step = 0

    def act(self, observation: str, history: Sequence[Any] | None = None) -> Action | str:
        """Return the plan's next text (``finish`` after the plan)."""
        step = self._step if history is None else len(history)
        self._step = step + 1
        return self.plan[step] if step < len(self.plan) else Action.finish().model_text()

    def reset(self) -> None:
        """Start the plan over (for a new episode of the same task)."""
        self._step = 0


class ExpertPolicy(_PlannedPolicy):
    """Plays the gold actions of ``bundle``."""

    def __init__(self, bundle: TaskBundle) -> None:
        super().__init__([a.model_text() for a in bundle.grader.gold_actions])


def _malformed(action: Action, rng: random.Random) -> str:
    text = action.model_text()
    body = text[len(TOOL_CALL_OPEN):-len(TOOL_CALL_CLOSE)]
    return rng.choice((
        text[:-len(TOOL_CALL_CLOSE)],                               # unclosed call
        f"{TOOL_CALL_OPEN}{body[:-1]}{TOOL_CALL_CLOSE}",            # truncated JSON
        f"I will call {action.name} now.",                          # no call at all
    ))


def _wrong_path(action: Action) -> Action:
    path = str(action.args["path"])
    stem, dot, ext = path.rpartition(".")
    wrong = f"{stem}_old.{ext}" if dot else f"{path}_old"
    return Action.tool(action.name, **{**action.args, "path": wrong})


def _corrupt(text: str) -> str:
    first, nl, rest = text.partition("\n")
    return f"{first}{CORRUPTION}{nl}{rest}"


def _wrong_old(action: Action, files: Mapping[str, str]) -> Action:
    """A ``replace`` whose ``old`` does not occur in the file: its ``new`` text (old and new
    swapped), or, when that occurs, ``old`` with one character dropped (``~`` appended if even
    that occurs), so the tool answers ``not_found`` and nothing changes."""
    args = action.args
    old, new = str(args["old"]), str(args["new"])
    text = files.get(str(args["path"]), "")
    candidates = (new, old[: len(old) // 2] + old[len(old) // 2 + 1:], old + CORRUPTION)
    wrong = next(c for c in candidates if c and c != old and c not in text)
    return Action.tool("replace", **{**args, "old": wrong})


def _wrong_edit(action: Action) -> tuple[Action, Action]:
    """Return (wrong edit, corrective edit) for a ``replace`` or ``write_file`` action."""
    args = action.args
    if action.name == "replace":
        bad = str(args["new"]) + CORRUPTION
        return (Action.tool("replace", **{**args, "new": bad}),
                Action.tool("replace", path=args["path"], old=bad, new=args["new"]))
    return (Action.tool("write_file", path=args["path"], content=_corrupt(str(args["content"]))),
            action)


def noisy_plan(bundle: TaskBundle, error_rate: float, seed: int) -> list[str]:
    """The noisy expert's texts for one episode, cut at the task's step budget."""
    rng = random.Random(f"noisy/{seed}/{bundle.spec.task_id}")
    has_check = "check" in bundle.spec.commands
    plan: list[str] = []
    for action in bundle.grader.gold_actions:
        if action.kind == "tool" and rng.random() < error_rate:
            kinds = ["malformed"]
            if "path" in action.args and action.name in ("read_file", "replace"):
                kinds.append("wrong_path")
            if action.name == "replace":
                kinds.append("wrong_old")
            if action.name in ("replace", "write_file"):
                kinds.append("wrong_edit")
            kind = rng.choice(kinds)
            if kind == "malformed":
                plan.append(_malformed(action, rng))
            elif kind == "wrong_path":
                plan.append(_wrong_path(action).model_text())
            elif kind == "wrong_old":
                plan.append(_wrong_old(action, bundle.spec.initial_files).model_text())
            else:
                wrong, fix = _wrong_edit(action)
                plan.append(wrong.model_text())
                if has_check:
                    plan.append(Action.tool("run", command="check").model_text())
                action = fix
        plan.append(action.model_text())
    return plan[:bundle.spec.step_budget]


class NoisyExpertPolicy(_PlannedPolicy):
    """The expert with recoverable mistakes at ``error_rate`` per gold tool action."""

    def __init__(self, bundle: TaskBundle, error_rate: float = 0.2, seed: int = 0) -> None:
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        super().__init__(noisy_plan(bundle, error_rate, seed))


_RANDOM_PATHS = ("config.json", "records.json", "data.csv", "app.ini", "prog.py", "README.md",
                 "input.txt", "check.py", "notes.txt", "out.txt", ".", "sub/dir.txt")
_RANDOM_COMMANDS = ("check", "prog", "test", "ls")
_RANDOM_TOOLS = ("list_dir", "read_file", "write_file", "replace", "run", "finish")


class RandomPolicy:
    """Uniformly random tool calls with random arguments; deterministic in (seed, step)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._step = 0

    def _word(self, rng: random.Random) -> str:
        return "".join(rng.choice("abcdefghij{}[],:\"0123456789 \n") for _ in range(rng.randint(
            1, 12)))

    def act(self, observation: str, history: Sequence[Any] | None = None) -> Action | str:
        """Return a random action's canonical text."""
        step = self._step if history is None else len(history)
        self._step = step + 1
        rng = random.Random(f"random-policy/{self.seed}/{step}")
        tool = rng.choice(_RANDOM_TOOLS)
        path = rng.choice(_RANDOM_PATHS)
        if tool == "finish":
            action = Action.finish()
        elif tool in ("list_dir", "read_file"):
            action = Action.tool(tool, path=path)
        elif tool == "write_file":
            action = Action.tool(tool, path=path, content=self._word(rng))
        elif tool == "replace":
            action = Action.tool(tool, path=path, old=self._word(rng), new=self._word(rng))
        else:
            action = Action.tool("run", command=rng.choice(_RANDOM_COMMANDS))
        return action.canonical_text()

    def reset(self) -> None:
        """Start a new episode (step counter back to 0)."""
        self._step = 0


@dataclass(frozen=True)
class ScriptedEpisode:
    """One played episode: the action texts, the transitions and the exported final state."""

    texts: tuple[str, ...]
    transitions: tuple[Transition, ...]
    final_state: bytes


def play(env: AgentEnv, policy: ScriptedPolicy, task_id: str, seed: int = 0,
         max_steps: int = 64) -> ScriptedEpisode:
    """Reset ``env`` on ``task_id`` and let ``policy`` act until the episode ends."""
    observation = env.reset(task_id, seed)
    texts: list[str] = []
    transitions: list[Transition] = []
    for _ in range(max_steps):
        action = policy.act(observation, texts)
        text = action.canonical_text() if isinstance(action, Action) else action
        tr = env.step(text)
        texts.append(text)
        transitions.append(tr)
        observation = tr.observation
        if tr.done:
            break
    return ScriptedEpisode(tuple(texts), tuple(transitions), env.export_state())
