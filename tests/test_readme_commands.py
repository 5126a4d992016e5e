"""Every command README.md and the guide (docs/guide.md, README's long form) show runs as shown: each `ctuq ...` line
of their code blocks parses with the CLI's own parser (the command exists, every option exists and takes the value
given), each `python scripts/X.py ...` names a script that exists and whose --help lists every option used, and each
`make X` names a target of the Makefile."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ctuq.cli import _command_in, build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, ROOT / "docs" / "guide.md")


def _command_lines(page: Path) -> list[str]:
    """The command lines of a page's code blocks, comments and prompts stripped (output lines are left out)."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
        for raw in block.splitlines():
            line = raw.split(" #", 1)[0].strip()
            if re.match(r"(ctuq|python|torchrun|make)\b", line) and not line.startswith("ctuq reconstruct:"):
                lines.append(line)
    return lines


LINES = list(dict.fromkeys(line for page in PAGES for line in _command_lines(page)))  # each distinct line once
CTUQ = [line for line in LINES if line.startswith(("ctuq ", "torchrun "))]
SCRIPTS = [line for line in LINES if line.startswith("python scripts/")]
MAKE = [line for line in LINES if line.startswith("make ")]


def test_readme_shows_commands_of_each_kind():
    readme = _command_lines(README)
    assert sum(line.startswith("ctuq ") for line in readme) >= 10, "README: the ctuq commands a first user needs"
    assert any(line.startswith("make ") for line in readme), "README: the make targets (demo, test)"
    assert len(CTUQ) >= 15 and SCRIPTS and MAKE


@pytest.mark.parametrize("line", CTUQ)
def test_every_ctuq_line_parses(line):
    words = shlex.split(line)
    if words[0] == "torchrun":  # torchrun --nproc_per_node=N -m ctuq ARGS
        words = words[words.index("ctuq") + 1 :]
    else:
        words = words[1:]
    parser = build_parser(_command_in(words))
    try:
        args = parser.parse_args(words)
    except SystemExit as exc:
        pytest.fail(f"README/guide: `{line}` does not parse (exit {exc.code})")
    assert getattr(args, "func", None) is not None, f"README/guide: `{line}` runs no command"


@pytest.fixture(scope="module")
def script_help():
    cache: dict[str, str] = {}

    def get(script: str) -> str:
        if script not in cache:
            done = subprocess.run(
                [sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, f"{script} --help failed: {done.stderr[-500:]}"
            cache[script] = done.stdout
        return cache[script]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("line", SCRIPTS)
def test_every_script_line_names_a_script_and_its_options(line, script_help):
    words = shlex.split(line)
    script = words[1]
    assert (ROOT / script).is_file(), f"README/guide: `{line}`: {script} does not exist"
    text = script_help(script)
    for option in (w.split("=", 1)[0] for w in words[2:] if w.startswith("--")):
        assert option in text, f"README/guide: `{line}`: {script} has no option {option}"


@pytest.mark.parametrize("line", MAKE)
def test_every_make_line_names_a_target(line):
    target = shlex.split(line)[1]
    assert re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), re.M), f"no make target {target}"
