"""The single-turn workload of ``bench_trl.py`` as an environment package (``single-turn-v1``),
so that the real ``rl_step`` (lease, clean-room verifier step, admission, ledger, checkpoint,
publication) runs it exactly as a user's run would.

One task per prompt (``PROMPTS``, the same eight prompts TRL gets). ``reset`` shows the prompt;
the model's first action, whatever its text, ends the episode (``agent_finish``) and is kept in
the state; the verifier reads the exported state bytes only and scores the shared verifier-free
reward, ``task_success = len(answer) % 2`` (identical to ``trl_grpo_step.reward_parity``). An
action cut by the token budget is censored by the collector (``max_token_truncation``), as in
every closedloop run.

The scaffold: a one-line system prompt and one tool (``finish``), rendered by closedloop's chat
renderer; TRL is given the same rendered system message, so both sides prompt with the same ids.

Used through the config's ``environment.factory: "single_turn_pkg:package"`` (the benchmarks
folder on ``sys.path``). Imports closedloop's contracts only.
"""

from __future__ import annotations

import json
from typing import Any

from closedloop.contracts import SnapshotRef, Termination, Transition, content_hash
from closedloop.contracts.package import EnvPackage, EnvTaskSets, TaskInfo, TaskSetRequest
from closedloop.contracts.verification import ScoreResult
from closedloop.errors import SnapshotMismatchError

ENV_ID = "single-turn-v1"
ENV_VERSION = "single-turn-v1.0"
SYSTEM_PROMPT = "You are a helpful assistant. Answer in one short reply."
TOOLS: tuple[dict[str, Any], ...] = (
    {"name": "finish", "description": "End the conversation.", "parameters": {}},)
PROMPTS = (
    "Write a one-line Python function that reverses a string.",
    "Name three prime numbers greater than 50.",
    "Explain in one sentence what a hash function does.",
    "Give a shell command that counts lines in a file.",
    "What is the capital of Australia? Answer briefly.",
    "Suggest a name for a cat that likes boxes.",
    "Convert 3 kilometres to metres and show the arithmetic.",
    "List two differences between TCP and UDP.",
)
HELDOUT = "Name one colour of the rainbow."
TASKS = {f"prompt-{i}": p for i, p in enumerate(PROMPTS)} | {"heldout-0": HELDOUT}


def reward_parity(text: str) -> float:
    """The shared verifier-free reward (identical in ``trl_grpo_step.py``)."""
    return float(len(text) % 2)


class SingleTurnEnv:
    """One prompt, one reply (module doc). The state is a plain JSON record."""

    env_version = ENV_VERSION

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}
        self.snaps: dict[str, dict[str, Any]] = {}

    def reset(self, task_id: str, seed: int) -> str:
        """Load the task; the first observation is its prompt."""
        self.state = {"task": task_id, "seed": seed, "answer": None, "steps": 0}
        self.snaps = {}
        return TASKS[task_id]

    def step(self, action: Any) -> Transition:
        """Any reply ends the episode; its text is kept for the verifier."""
        text = action if isinstance(action, str) else action.model_text()
        self.state = {**self.state, "answer": text, "steps": self.state["steps"] + 1}
        return Transition("done", True, self.state_hash(), self.state["steps"],
                          Termination.AGENT_FINISH)

    def export_state(self) -> bytes:
        """The canonical bytes of the state."""
        return json.dumps(self.state, sort_keys=True).encode()

    def state_hash(self) -> str:
        """The content hash of the state."""
        return content_hash(self.state)

    def snapshot(self, label: str) -> SnapshotRef:
        """Capture the state (deterministic id: the state's hash and the label)."""
        digest = content_hash([self.state, label]).split(":", 1)[1][:32]
        ref = SnapshotRef(f"snap-{digest}", None, ENV_VERSION, self.state_hash(),
                          content_hash("no-rng"), label)
        self.snaps[ref.snapshot_id] = dict(self.state)
        return ref

    def restore(self, snapshot: SnapshotRef) -> None:
        """Return to a captured state."""
        if snapshot.snapshot_id not in self.snaps:
            raise SnapshotMismatchError(f"unknown snapshot {snapshot.snapshot_id}")
        self.state = dict(self.snaps[snapshot.snapshot_id])

    def fork(self, snapshot: SnapshotRef, branch_id: str) -> SingleTurnEnv:
        """An independent env at ``snapshot``."""
        child = SingleTurnEnv()
        child.snaps = dict(self.snaps)
        child.restore(snapshot)
        return child


class ParityVerifier:
    """Scores the exported state: ``task_success = len(answer) % 2``."""

    verifier_version = "parity-v1"

    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        """Score the reply recorded in the exported bytes."""
        state = json.loads(final_state)
        if state.get("task") != task_id or not isinstance(state.get("answer"), str):
            return ScoreResult(task_id, None, "invalid_state: no reply for this task",
                               self.verifier_version)
        return ScoreResult.of(task_id, reward_parity(state["answer"]), self.verifier_version)


def _task_sets(request: TaskSetRequest) -> EnvTaskSets:
    train = tuple(f"prompt-{i}" for i in range(min(request.train_tasks, len(PROMPTS))))
    return EnvTaskSets(train, ("heldout-0",))


def _task_info(task_id: str) -> TaskInfo:
    split = "heldout" if task_id.startswith("heldout") else "train"
    return TaskInfo(task_id, "prompts-v1", split, TASKS[task_id])


def package() -> EnvPackage:
    """The single-turn benchmark package."""
    return EnvPackage(env_id=ENV_ID, env_version=ENV_VERSION, make_env=SingleTurnEnv,
                      task_sets=_task_sets, task_info=_task_info, make_verifier=ParityVerifier,
                      tool_schemas=TOOLS, system_prompt=SYSTEM_PROMPT,
                      description="bench_trl's single-turn workload")
