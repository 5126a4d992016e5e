# Two commands on a fresh clone (README "Quick start"):
#   make demo    set up .venv once, then reconstruct the bundled scan with uncertainty (prints the run folder)
#   make test    set up .venv once, then ruff (lint, format check), the test suite and the docs build; CI runs this
#                (.ci/run)
#   make test-fast   the tests not marked slow (every package, about a minute): while you work
#   make docs    set up .venv once, then build the documentation site into docs/_build/html (no warning allowed)
# The work is in scripts/dev.sh (also usable without make: `bash scripts/dev.sh demo|test`). Options:
#   make demo OUT=runs/mine DEMO_ARGS=--no-uq      make test PYTEST_ARGS="-x tests/data"
#   CTUQ_SKIP_INSTALL=1 (use .venv as it is), PYTHON, VENV, TORCH_SPEC, TORCH_PIP_ARGS (see scripts/dev.sh)

SHELL := /bin/bash
export OUT DEMO_ARGS PYTEST_ARGS PYTHON VENV TORCH_SPEC TORCH_PIP_ARGS CTUQ_SKIP_INSTALL

.PHONY: help setup demo test test-fast docs

help:
	@echo "make demo    set up .venv (once) and run the demo: ctuq reconstruct --config demo"
	@echo "make test    set up .venv (once), lint, run the tests and build the docs (what CI runs)"
	@echo "make test-fast  set up .venv (once) and run the fast tests (every package, about a minute)"
	@echo "make docs    set up .venv (once) and build the documentation site: docs/_build/html/index.html"
	@echo "make setup   set up .venv only (python3 -m venv; pip install torch==2.13.0; pip install -e \".[test]\")"

setup:
	bash scripts/dev.sh setup

demo:
	bash scripts/dev.sh demo

test:
	bash scripts/dev.sh test

test-fast:
	bash scripts/dev.sh test-fast

docs:
	bash scripts/dev.sh docs
