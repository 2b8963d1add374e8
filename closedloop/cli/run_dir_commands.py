"""``gates``, ``report`` and ``export``: the commands that read a finished run directory."""

from __future__ import annotations

import argparse

from closedloop.cli.text import emit


def cmd_gates(args: argparse.Namespace) -> int:
    """Evaluate the go/no-go gates of a run; exit 0 all pass, 1 a gate failed, 3 only
    not-measured gates remain (2: not a run directory)."""
    from closedloop.evaluate.gates import evaluate_gates, format_table

    report = evaluate_gates(args.run_dir)
    emit(report.to_dict(), args.json, format_table(report))
    return report.exit_code


def cmd_report(args: argparse.Namespace) -> int:
    """Write report.html and report.json for a run (or experiment) directory."""
    from closedloop.evaluate.report import write_report

    html_path, json_path = write_report(args.run_dir)
    emit({"html": str(html_path), "json": str(json_path)}, args.json,
           f"report: {html_path}\ndata: {json_path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a run's trace records as Parquet tables or a Hugging Face dataset (checked by
    reading them back)."""
    from closedloop.export import export_run

    result = export_run(args.run_dir, args.format, args.out, overwrite=args.overwrite)
    data = {"path": str(result.path), "format": result.format, "counts": dict(result.counts)}
    counts = ", ".join(f"{n} {k}" for k, n in result.counts.items())
    emit(data, args.json, f"exported {counts} to {result.path} ({result.format}; read back "
           "equal to the JSONL)")
    return 0
