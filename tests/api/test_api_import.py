"""``import ctuq`` and ``ctuq --help`` stay light and fast (the issue's "under a second"), and the public names
resolve, to the API's objects also after the subpackage ``ctuq.reconstruct`` has been imported.

The speed is checked by what is imported, not by a wall clock on shared cores: ``import ctuq`` loads nothing outside
the standard library (numpy, torch and ASTRA load with the first public name used) and ``ctuq --help`` none of the
heavy libraries; the time Python's ``-X importtime`` reports for ctuq's own modules (measured: ~3 ms and ~90 ms)
is asserted under the second with a margin of ten times and more."""

import subprocess
import sys

import ctuq

HEAVY = ("numpy", "torch", "astra", "scipy", "matplotlib", "ctuq.run", "ctuq.scan", "ctuq.pipeline")

PROBE = """
import sys
before = set(sys.modules)
import ctuq
new = sorted(set(sys.modules) - before)
print("\\n".join(new))
"""


def _imports(argv: list[str]) -> tuple[str, dict[str, int], set[str]]:
    """Run ``python -X importtime ARGV``: its stdout, the microseconds each top-level import took (cumulative: the
    report's unindented lines) and every module it imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, check=True, timeout=120
    )
    top, every = {}, set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            _self, cumulative, name = line.removeprefix("import time:").split("|")
            every.add(name.strip())
            if not name.startswith("  ") and cumulative.strip().isdigit():
                top[name.strip()] = int(cumulative)
    return done.stdout, top, every


def _heavy(modules) -> list[str]:
    return sorted(m for m in modules if m in HEAVY or m.split(".")[0] in HEAVY)


def test_import_ctuq_loads_only_the_standard_library():
    stdout, top, every = _imports(["-c", PROBE])
    new = stdout.split()
    assert "ctuq" in new and "ctuq" in every
    outside = [m for m in new if m.split(".")[0] not in sys.stdlib_module_names and m != "ctuq"]
    assert outside == [], outside
    assert _heavy(new) == [] and _heavy(every) == []
    assert top["ctuq"] < 1_000_000, top["ctuq"]


def test_ctuq_help_loads_no_heavy_library():
    stdout, top, every = _imports(["-m", "ctuq", "--help"])
    assert stdout.startswith("usage: ctuq")
    for command in ("simulate", "reconstruct", "uq", "design"):
        assert f"    {command} " in stdout, command
    assert "ctuq.cli" in every and _heavy(every) == []
    ours = sum(t for name, t in top.items() if name.split(".")[0] == "ctuq")
    assert 0 < ours < 1_000_000, top


def test_every_public_name_resolves():
    from ctuq import run, scan

    assert ctuq.__all__[0] == "__version__" and isinstance(ctuq.__version__, str)
    homes = {"load_scan": scan, "Scan": scan}
    for name in ctuq.__all__[1:]:
        obj = getattr(ctuq, name)
        assert obj is getattr(homes.get(name, run), name), name
        assert name in dir(ctuq)
    try:
        ctuq.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("ctuq.no_such_name resolved")


def test_reconstruct_is_the_function_after_the_subpackage_of_that_name_is_imported():
    """``ctuq/reconstruct/`` (the fits) shares the name: importing it must not replace ``ctuq.reconstruct``, while
    ``from ctuq.reconstruct import ...`` still reaches the subpackage."""
    import importlib

    from ctuq.reconstruct import fit_dip  # imports the subpackage

    assert ctuq.reconstruct is ctuq.run.reconstruct and callable(ctuq.reconstruct)
    from ctuq import reconstruct

    assert reconstruct is ctuq.run.reconstruct
    assert importlib.import_module("ctuq.reconstruct").fit_dip is fit_dip
    assert sys.modules["ctuq.reconstruct"].__name__ == "ctuq.reconstruct"
