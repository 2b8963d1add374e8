"""One training run: set-up, warm start, RL steps with resume, evaluation.

``closedloop.training.run.open_run`` opens a run directory and returns a ``Run`` record; the
roles below act on it and ``closedloop.training.loop`` reads like the minimal training loop
(docs/concepts.md) as those roles taking turns. A run directory holds::

    config.json        the resolved config (and its hash), environment and package versions
    launches.jsonl     one line per launch (git revision, versions, a declared config override)
    run.lock           held by the one launch using the directory
    template.json      the chat template's append-only check
    tasks.json         the train/held-out ids, solvability discards and the overlap audit
    traces/            JSONL traces: sft-demos, step-NNNN (one per RL step), eval-<label>
    ledger.sqlite      every group exactly once: collected, admitted, consumed, quarantined
    registry/          staged immutable policy versions, ACTIVE pointer, publish log
    checkpoints/       atomic trainer checkpoints (adapter, optimizer, step, consumed groups,
                       every RNG state, a digest of the ledger rows), step 0 included
    sft/               the warm-start adapter (merged into the base the RL adapter sits on)
    metrics.jsonl      one record per (kind, step, label), each written exactly once
    summary.json       the final summary (written only once every RL step is committed)

Every launch first proves the directory (``closedloop.training.integrity``): the config is the
recorded one unless an override is declared, the ledger passes its integrity checks and the
newest checkpoint's digest, and checkpoints, ledger, registry, metrics and traces agree; what
cannot be reconciled stops the run with an error naming the file. Resume: the latest
checkpoint is the source of truth. The ledger is reconciled with it; a step whose trace file
is complete is not collected again (its buffered groups are reused, never dropped or applied
twice); a partial trace (``.partial``) is discarded and the step collected again with the same
seeds and weights; a checkpoint whose step record never reached ``metrics.jsonl`` (a kill
right after its commit) is set aside and its step run again; so a resumed run ends with the
weights and the metrics of an uninterrupted one.

The run is roles with narrow interfaces, one module each, and plain functions over a ``Run``
record (``run``: ``open_run``, the one set-up path of every entry point; ``RunContext``, what
the roles share): the generator worker (``rollout_worker.RolloutWorker``: an inference-only
copy of π_beh^v that collects complete groups), the verifier step
(``closedloop.rollout.verifier_step``: clean-room scoring after collection), admission
(``closedloop.rollout.admission``), the trainer (``trainer_role.TrainerRole``: π_train^u and its
optimizer), the publisher (``publisher.Publisher``: stage, every worker acknowledges the hash
of what it holds, then ACTIVE), and the run directory (``run_directory.RunDirectory``).
``collection`` commits a trace (rollout, then the verifier step); ``warm_start`` (SFT and the
SFT-only control), ``run_evaluation`` (suites, retain, audit), ``rl_step``, ``resume``
(checkpoint, commit, resume), ``integrity`` (the run directory proved on every launch) and
``loop`` (the reference loop, ``opened_run`` and ``train``).
"""

from closedloop.contracts import canonical_json
from closedloop.training.rl_step import StepReport
from closedloop.training.run import Run, open_run, write_summary

__all__ = ["Run", "StepReport", "canonical_json", "open_run", "write_summary"]
