"""The ``closedloop`` command. Every subcommand takes ``--json`` for machine-readable output.

One module per command group: ``env_commands`` (``tasks``, ``play``, ``replay``, ``collect``:
the commands that take an environment), ``run_commands`` (``train``, ``experiment``,
``smoke``, ``reevaluate``: the commands that run training or evaluation), ``run_dir_commands``
(``gates``, ``report``, ``export``: the commands that read a finished run directory);
``parser`` builds the argument parser and ``text`` formats results for the terminal.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from closedloop.cli.parser import build_parser
from closedloop.engine import tune_allocator
from closedloop.errors import ClosedloopError

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``closedloop`` console script: parse, run the subcommand, return its
    exit code (2 on a ``ClosedloopError``, printed as ``closedloop: <class>: <message>``)."""
    args = build_parser().parse_args(argv)
    tune_allocator()
    try:
        return int(args.fn(args))
    except ClosedloopError as exc:
        print(f"closedloop: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
