# The two commands of the README: `make smoke` (the main job) and `make test` (the suite).
.PHONY: smoke test lint bench setup

setup:
	@scripts/setup

smoke: setup
	.venv/bin/closedloop smoke

test: setup lint
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check closedloop tests benchmarks
	.venv/bin/mypy

THREADS ?= 1
bench: setup
	.venv/bin/python benchmarks/run_all.py --threads $(THREADS)
