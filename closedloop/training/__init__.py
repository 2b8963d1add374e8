"""One training run: set-up, warm start, synchronous RL steps with resume, evaluation.

``TrainingRun`` owns the run directory and every part a step touches; ``closedloop.training.loop``
reads like the minimal training loop (docs/concepts.md) and calls its methods. A run directory
holds::

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

The run's parts, one module each: ``wiring`` (scaffold, manifest, collector parts), ``run``
(``TrainingRun`` and its set-up), ``state`` (what the parts share), ``run_policy`` (adapter,
manifest, publication, collection), ``warm_start`` (SFT and the SFT-only control),
``run_evaluation`` (suites, retain, audit), ``rl_step``, ``resume`` (checkpoint and resume),
``integrity`` (the run directory proved on every launch) and ``loop`` (the reference loop).
"""

from closedloop.contracts import canonical_json
from closedloop.training.rl_step import StepReport
from closedloop.training.run import TrainingRun, write_summary

__all__ = ["StepReport", "TrainingRun", "canonical_json", "write_summary"]
