#!/usr/bin/env bash
# Set up the virtual environment README describes and run the demo or the tests; `make demo` / `make test` call
# this script, and it works the same without make:
#
#   bash scripts/dev.sh demo     # set up, then `ctuq reconstruct --config demo` into a new run folder
#   bash scripts/dev.sh test     # set up, then ruff (lint + format check) and the test suite
#   bash scripts/dev.sh test-fast   # set up, then the tests not marked slow (every package, about a minute)
#   bash scripts/dev.sh docs     # set up, then build the documentation site (docs/_build/html) with no warning
#   bash scripts/dev.sh setup    # set up only
#
# Set-up is README's three commands: `python3 -m venv .venv`, `pip install torch==2.13.0`, `pip install -e
# ".[test]"` (the test extra brings the docs one: the tests execute the tutorial, `test` builds the site). It runs
# once: a stamp file in the venv records the torch spec and a hash of pyproject.toml, so a second call installs
# nothing unless the dependencies changed (delete .venv/.ctuq-setup to force it).
#
# Environment: PYTHON (default python3, ≥ 3.10), VENV (default .venv), TORCH_SPEC (default torch==2.13.0; the
# PyPI wheel runs on the CPU and brings CUDA where a GPU is), TORCH_PIP_ARGS (more pip options for torch only, e.g.
# the index of PyTorch's CPU-only wheels), CTUQ_SKIP_INSTALL=1 (use the venv as it is), OUT (the
# demo's run folder, default runs/demo-<time>), DEMO_ARGS (more `ctuq reconstruct` options, e.g. --no-uq),
# PYTEST_ARGS (more pytest options, e.g. "-x tests/data").
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
STAMP="$VENV/.ctuq-setup"

say() { echo "dev.sh: $*" >&2; }

stamp_text() {
    # what the installed set depends on: the torch spec and the project's dependency list
    echo "$TORCH_SPEC ${TORCH_PIP_ARGS:-} $("$VENV/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
}

installed() {
    # the stamp matches and both packages are still there (found without importing torch: that takes seconds)
    [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp_text)" ] &&
        "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("torch") and u.find_spec("ctuq")))'
}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        if ! command -v "$PYTHON" >/dev/null 2>&1; then
            say "$PYTHON not found; install Python ≥ 3.10 (Debian: apt-get install python3 python3-venv) or set PYTHON"
            exit 1
        fi
        if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
            say "$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'); ctuq needs ≥ 3.10 (set PYTHON)"
            exit 1
        fi
        say "creating $VENV with $PYTHON"
        if ! "$PYTHON" -m venv "$VENV"; then
            rm -rf "$VENV"
            say "'$PYTHON -m venv' failed; on Debian/Ubuntu install the venv module: apt-get install python3-venv"
            exit 1
        fi
    fi
    # shellcheck disable=SC1091  # the venv's own activation script
    . "$VENV/bin/activate"
    if [ "${CTUQ_SKIP_INSTALL:-0}" = 1 ]; then
        say "CTUQ_SKIP_INSTALL=1: using $VENV as it is"
        return
    fi
    if installed; then
        say "$VENV is set up ($TORCH_SPEC, ctuq[test]); delete $STAMP to reinstall"
        return
    fi
    rm -f "$STAMP"
    say "installing $TORCH_SPEC, then ctuq with its test extra (once; the next run skips this)"
    # TORCH_PIP_ARGS is split into words on purpose: it holds pip options (e.g. another index for a CPU-only build)
    # shellcheck disable=SC2086
    pip install "$TORCH_SPEC" ${TORCH_PIP_ARGS:-}
    pip install -e ".[test]"
    stamp_text >"$STAMP"
}

demo() {
    setup
    local out="${OUT:-runs/demo-$(date +%Y%m%d-%H%M%S)}"
    say "running: ctuq reconstruct --config demo --out $out ${DEMO_ARGS:-}"
    # DEMO_ARGS is split into words on purpose: it holds options
    # shellcheck disable=SC2086
    ctuq reconstruct --config demo --out "$out" ${DEMO_ARGS:-}
    # the commands README shows next, with this run's folder (README writes runs/demo for it)
    cat >&2 <<EOF
dev.sh: the demo's run folder is $out (reconstruction.tif, std.tif, uncertainty.png, metrics.json). Next, in this shell:
  . $VENV/bin/activate
  ctuq uq $out --check
      (the std map against the scan's unused angles)
  ctuq uq $out --set uq.samples=4096
      (rerun only the inference, with more samples)
  ctuq view $out
      (the images side by side in napari; pip install 'ctuq[view]')
EOF
}

build_docs() {
    # the guide, the tutorial (rendered, not executed: tests/test_tutorial.py runs it) and the API reference; -W
    # makes every warning an error, --keep-going reports them all first, -E rereads every page (an incremental build
    # would not repeat the warnings of unchanged pages)
    say "docs: python -m sphinx -W --keep-going -E -q docs docs/_build/html"
    python -m sphinx -W --keep-going -E -q docs docs/_build/html
    say "docs: built docs/_build/html/index.html"
}

run_tests() {
    setup
    say "lint: ruff check ctuq tests scripts && ruff format --check ctuq tests scripts"
    ruff check ctuq tests scripts
    ruff format --check ctuq tests scripts
    say "tests: python -m pytest -q --durations=25 ${PYTEST_ARGS:-}"
    # --durations=25: the slowest tests in the log, to keep the suite within CI's time
    # shellcheck disable=SC2086
    python -m pytest -q --durations=25 ${PYTEST_ARGS:-}
    build_docs
}

run_fast_tests() {
    setup
    say "fast tests: python -m pytest -q -m 'not slow' ${PYTEST_ARGS:-} (the whole suite: make test)"
    # shellcheck disable=SC2086
    python -m pytest -q -m "not slow" ${PYTEST_ARGS:-}
}

case "${1:-}" in
setup) setup ;;
demo) demo ;;
test) run_tests ;;
test-fast) run_fast_tests ;;
docs)
    setup
    build_docs
    ;;
*)
    echo "usage: bash scripts/dev.sh setup|demo|test|test-fast|docs   (or: make setup|demo|test|test-fast|docs)" >&2
    exit 2
    ;;
esac
