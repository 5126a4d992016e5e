"""The tutorial (docs/tutorial.md, a MyST notebook) runs: jupytext reads it, nbclient executes every cell on a
``python3`` kernel (ipykernel), and any cell error fails the test with the cell and its traceback. It runs on the
``tiny`` setting: 35-70 s on 2 CPU cores (idle to busy). Its own cells assert what they show (a saved run loads back
with the same arrays).

Needs jupytext, nbclient, ipykernel and matplotlib-inline (the ``test`` extra, which CI installs); skipped, saying which
is missing, without them."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"
NEEDS = ("jupytext", "nbclient", "ipykernel", "matplotlib_inline")

pytestmark = pytest.mark.slow


def _read_notebook():
    import jupytext

    return jupytext.read(TUTORIAL)


def test_tutorial_is_a_myst_notebook_on_python3():
    """The source stays in jupytext's MyST format (text diffs, rendered by the Sphinx site) with code cells."""
    head = TUTORIAL.read_text(encoding="utf-8").split("---", 2)[1]
    assert "format_name: myst" in head and "name: python3" in head
    assert TUTORIAL.read_text(encoding="utf-8").count("```{code-cell} ipython3") >= 8


def test_tutorial_runs(tmp_path, monkeypatch):
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"executing the tutorial needs {', '.join(missing)} (pip install -e '.[test]')")
    from nbclient import NotebookClient

    notebook = _read_notebook()
    # the kernel inherits the environment: its temporary folders (the tutorial's run folders) go under tmp_path, and
    # its thread pools get one thread each like the rest of the suite (tests/conftest.py)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the cell on the first error
    elapsed = time.perf_counter() - start

    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    errors = [out for out in outputs if out.get("output_type") == "error"]
    assert not errors, errors[0]
    figures = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(figures) == 3, f"the tutorial draws 3 figures (images, samples, angles); got {len(figures)}"
    text = "".join(out.get("text", "") for out in outputs if out.get("output_type") == "stream")
    assert "held-out check on" in text and "Design(" in text, text[-2000:]
    print(f"tutorial executed in {elapsed:.1f} s")
