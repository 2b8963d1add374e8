# The two commands of the README: `make smoke` (the main job) and `make test` (the suite).
.PHONY: smoke test lint bench setup

setup:
	@scripts/setup

smoke: setup
	.venv/bin/closedloop smoke

test: setup lint
	.venv/bin/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder

lint: setup
	.venv/bin/ruff check closedloop tests benchmarks
	.venv/bin/mypy

THREADS ?= 1
bench: setup .bench-venv/.ready
	.venv/bin/python benchmarks/run_all.py --threads $(THREADS)

# TRL lives only in the benchmark's own environment (never a dependency of closedloop).
.bench-venv/.ready:
	python3 -m venv .bench-venv
	.bench-venv/bin/pip install -q torch==2.13.0
	.bench-venv/bin/pip install -q trl==1.16.0 peft==0.21.2 transformers==5.24.0 datasets==5.2.0
	touch $@
