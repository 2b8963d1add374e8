"""``python -m closedloop.cli``: the ``closedloop`` command."""

from closedloop.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
