"""Go/no-go gates (docs/concepts.md, go/no-go gates): named checks with a verdict and evidence,
from a run directory.

Every gate of the go/no-go list is one function ``(RunDir, GateOptions) -> Gate``, in the list's
order (:data:`GATES`), plus ``trace_records_valid`` first. The list's "independent toy-logit
test" is not a gate: it decides nothing about a run, and is a unit test of the objectives
(``tests/learn/test_objectives.py``). A gate reads the run's own files
(traces, ledger, registry, checkpoints, metrics, config) or re-executes part of the run
(environment resets and replays, the run's objective on its recorded batches, the
verifier on adjudicated fixtures). Verdicts:

- ``passed=True``: checked and held; ``passed=False``: checked and violated, or the check
  itself raised (a gate fails closed, the error is its evidence);
- ``passed=None``: not measured (the run lacks what the gate needs), with the reason;
- ``applicable=False`` with ``passed=True``: the gate guards a mode the run does not use
  (async-vs-sync equivalence on a synchronous run); shown as N/A.

``GateReport.all_passed`` is True only when every gate of the list was evaluated and passed;
"not measured" is not a pass. ``GateReport.exit_code`` (the ``closedloop gates`` exit status):
0 every gate passed, 1 a gate failed, 3 none failed but some were not measured (or evaluated).

``evaluate_gates`` accepts a run directory or an experiment directory (then the gates are those
of its RL arm: the arm named ``rloo``, else the first arm that is not a control).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from closedloop.errors import RunDirError, UnknownGateError
from closedloop.evaluate.gates import environment as _env
from closedloop.evaluate.gates import exactly_once as _ledger
from closedloop.evaluate.gates import live as _live
from closedloop.evaluate.gates import signal as _signal
from closedloop.evaluate.gates import traces as _traces
from closedloop.evaluate.gates.base import Gate, GateFn, GateOptions, GateReport
from closedloop.evaluate.gates.environment import FN_UPPER_BOUND, FP_UPPER_BOUND
from closedloop.evaluate.rundir import find_arms, load_run

__all__ = ["FN_UPPER_BOUND", "FP_UPPER_BOUND", "GATES", "GATE_NAMES", "Gate", "GateOptions",
           "GateReport", "evaluate_gates", "format_table", "main_run_of"]

GATES: tuple[tuple[str, GateFn], ...] = (
    ("trace_records_valid", _traces.gate_trace_records_valid),
    ("reset_state_hash", _env.gate_reset_state_hash),
    ("restore_replay", _env.gate_restore_replay),
    ("fork_isolation_and_seal", _env.gate_fork_isolation),
    ("manifest_scaffold_drift", _traces.gate_scaffold_drift),
    ("behavior_logprobs_finite_aligned", _traces.gate_behavior_logprobs),
    ("policy_roles_unambiguous", _ledger.gate_policy_roles),
    ("one_behavior_version", _traces.gate_one_behavior_version),
    ("weight_checksums", _traces.gate_weight_checksums),
    ("train_inference_mismatch", _ledger.gate_train_inference_mismatch),
    ("ratio_on_policy", _signal.gate_ratio_on_policy),
    ("max_version_lag", _ledger.gate_max_version_lag),
    ("exactly_once_groups", _ledger.gate_exactly_once),
    ("async_equals_sync", _ledger.gate_async_equals_sync),
    ("stale_drop_stratified", _ledger.gate_stale_drop_stratified),
    ("sample_provenance_complete", _ledger.gate_provenance),
    ("termination_codes", _traces.gate_termination_codes),
    ("episode_sum_score_function", _live.gate_episode_sum),
    ("verifier_fp_fn", _env.gate_verifier_fp_fn),
    ("cold_start_band", _signal.gate_cold_start_band),
    ("learning_signal", _signal.gate_learning_signal),
    ("shuffled_reward_control", _live.gate_shuffled_control),
)
GATE_NAMES: tuple[str, ...] = tuple(name for name, _ in GATES)

_CONTROL_WORDS = ("frozen", "shuffl", "sft")


def main_run_of(path: str | Path) -> Path:
    """The run whose gates decide: ``path`` itself, or an experiment's RL arm."""
    arms = find_arms(path)
    if not arms:
        return Path(path)
    if "rloo" in arms:
        return arms["rloo"]
    for name, arm in sorted(arms.items()):
        if not any(w in name.lower() for w in _CONTROL_WORDS):
            return arm
    raise RunDirError(f"{path}: the experiment has no RL arm (arms: {sorted(arms)})")


def evaluate_gates(run_dir: str | Path, options: GateOptions | None = None,
                   only: Sequence[str] | None = None) -> GateReport:
    """Evaluate every gate (or the named ones, in the list's order) on a run directory.

    Raises ``RunDirError`` when ``run_dir`` is not a run directory and ``UnknownGateError``
    (a ``KeyError``) for an unknown gate name. A gate that raises fails with the error as its
    evidence.
    """
    opts = options or GateOptions()
    unknown = sorted(set(only or ()) - set(GATE_NAMES))
    if unknown:
        raise UnknownGateError(f"unknown gates {unknown}; known: {list(GATE_NAMES)}")
    run = load_run(main_run_of(run_dir))
    gates = []
    for name, fn in GATES:
        if only is not None and name not in only:
            continue
        try:
            gate = fn(run, opts)
        except Exception as exc:  # fail closed: a check that crashes is not a pass
            gate = Gate(name, False, {"error": f"{type(exc).__name__}: {exc}"},
                        f"the check raised {type(exc).__name__}: {exc}")
        gates.append(gate)
    done = {g.name for g in gates}
    return GateReport(str(run.path), tuple(gates),
                      tuple(n for n in GATE_NAMES if n not in done))


def _short(evidence: dict[str, object], width: int) -> str:
    scalars = {k: v for k, v in evidence.items() if isinstance(v, int | float | str | bool)
               or v is None}
    text = json.dumps(scalars, default=str, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 3] + "..."


def format_table(report: GateReport, evidence_width: int = 90) -> str:
    """A plain-text table: gate, status, detail and the scalar evidence, then a verdict line."""
    name_w = max(len(g.name) for g in report.gates) if report.gates else 4
    lines = [f"{'gate':<{name_w}}  {'status':<12}  detail / evidence", "-" * (name_w + 110)]
    for g in report.gates:
        lines.append(f"{g.name:<{name_w}}  {g.status:<12}  {g.detail}")
        lines.append(f"{'':<{name_w}}  {'':<12}  {_short(dict(g.evidence), evidence_width)}")
    verdict = ("ALL GATES PASSED" if report.all_passed else
               f"FAILED: {', '.join(report.failed)}" if report.failed else
               f"NOT MEASURED: {', '.join(report.not_measured + list(report.not_evaluated))}")
    lines.append(f"{verdict}  ({report.run_dir})")
    return "\n".join(lines)
