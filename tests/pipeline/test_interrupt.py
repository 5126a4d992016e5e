"""Ctrl-C and SIGTERM (ctuq.interrupt): a run stopped during the DIP, the EM or the prediction writes a checkpoint at
the next safe point, prints one line naming the exact ``--resume`` command and exits 130 (SIGINT) / 143 (SIGTERM);
that command then finishes bit-identically to a run that was never interrupted.

The signals are real (``os.kill`` of this process at a chosen step, or of a ``python -m ctuq`` subprocess); the
runs are the tiny simulated scan at 32², every angle used (no held-out check), no TV and no figures."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from tiny import NO_FIGURES, NO_TV, sets, tiny_args

from ctuq import interrupt
from ctuq.cli import main
from ctuq.metrics import SampleMoments
from ctuq.pipeline import checkpoints
from ctuq.reconstruct import dip as dip_module

FAST = tiny_args(
    "data.angular_subsampling=1",
    "model.channels=[2, 2]",
    "model.skip_channels=[0, 1]",
    "dip.iterations=40",
    "dip.checkpoint_every=10",
    *NO_TV,
    "uq.sample_chunk=16",
    "uq.em_tol=0",
    *NO_FIGURES,
)
LINE = re.compile(
    r"^ctuq reconstruct: interrupted by (SIG\w+) during (.+?) \(checkpoint written: (.+?)\); resume with: (.+)$"
)


def _argv(scan, out, *extra):
    return ["reconstruct", "--data", str(scan), "--out", str(out), *FAST, *extra]


@pytest.fixture(scope="module")
def reference(tiny_scan, tmp_path_factory):
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("interrupt") / "reference"
    assert main(_argv(tiny_scan, out)) == 0
    return out


def _assert_same_results(a: Path, b: Path) -> None:
    """Reconstruction, std and every number of the two runs' metrics bit-identical (timings aside)."""
    for name in ("reconstruction.tif", "std.tif", "fbp.tif"):
        np.testing.assert_array_equal(tifffile.imread(a / name), tifffile.imread(b / name), err_msg=name)
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (a, b))
    for key in ("psnr", "ssim", "marginal_ll", "joint_ll", "coverage"):
        assert ma[key] == mb[key], key
    for key in ("best_loss", "best_iteration", "final_loss", "iterations", "best_psnr_history"):
        assert ma["dip"][key] == mb["dip"][key], key
    for key in ("a", "sigma2", "n_samples", "mean_std", "summary"):
        assert ma["uq"][key] == mb["uq"][key], key
    numbers = ("step", "a", "a_new", "gamma", "weight_norm_sq", "sigma2_new")
    assert [[r.get(k) for k in numbers] for r in ma["em_trace"]] == [
        [r.get(k) for k in numbers] for r in mb["em_trace"]
    ]


def _interrupted_line(err: str) -> re.Match:
    lines = [ln for ln in err.splitlines() if ln.startswith("ctuq reconstruct: ")]
    assert len(lines) == 1, err
    m = LINE.match(lines[0])
    assert m, lines[0]
    return m


def _resume(command: str) -> int:
    args = shlex.split(command)
    assert args[0] == "ctuq" and "--resume" in args
    return main(args[1:])


def _signal_on_call(monkeypatch, owner, name, when, signum):
    """Make ``owner.name`` send ``signum`` to this process right after its call number ``when`` (1-based) returns."""
    original = getattr(owner, name)
    calls = []

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == when:
            os.kill(os.getpid(), signum)
        return result

    monkeypatch.setattr(owner, name, wrapped)
    return calls


def test_module_defers_inside_safe_points_and_stops_at_once_outside():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with interrupt.handling():
        with pytest.raises(interrupt.Interrupted) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler raises at the next bytecode, long before this ends
        assert info.value.exit_status == 143 and info.value.describe() == "interrupted by SIGTERM"
        with pytest.raises(interrupt.Interrupted) as info:
            with interrupt.safe_points():
                os.kill(os.getpid(), signal.SIGINT)
                assert interrupt.requested() == signal.SIGINT  # noted, not raised
                interrupt.stop("step 3 of 5", "work/state.pt")
        assert info.value.exit_status == 130
        assert info.value.describe() == "interrupted by SIGINT during step 3 of 5 (checkpoint written: work/state.pt)"
        with pytest.raises(interrupt.Interrupted) as info:  # a second signal while one is pending: at once
            with interrupt.safe_points():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
        assert info.value.signum == signal.SIGTERM and interrupt.requested() is None
        with pytest.raises(interrupt.Interrupted) as info:  # noted after the last poll: raised when the region ends
            for _ in interrupt.safe_iter(range(1)):
                os.kill(os.getpid(), signal.SIGTERM)
        assert info.value.signum == signal.SIGTERM and info.value.checkpoint is None
        with interrupt.safe_points(enabled=False), pytest.raises(interrupt.Interrupted):
            os.kill(os.getpid(), signal.SIGINT)  # a region that cannot checkpoint: at once
            time.sleep(1)
        assert interrupt.requested() is None
    assert {s: signal.getsignal(s) for s in before} == before


def test_resume_command_names_the_run_folder_and_adds_resume():
    argv = ["reconstruct", "--data", "my scan", "--set", "dip.lr=1e-3"]
    assert interrupt.resume_command("reconstruct", argv, "runs/2026") == (
        "ctuq reconstruct --data 'my scan' --set dip.lr=1e-3 --out runs/2026 --resume"
    )
    assert interrupt.resume_command("reconstruct", argv) is None  # no folder yet: nothing to resume
    assert interrupt.resume_command("uq", ["uq", "runs/a", "--resume"]) == "ctuq uq runs/a --resume"
    assert interrupt.resume_command("design", ["design", "--out=d"], "d") == "ctuq design --out=d --resume"
    assert interrupt.resume_command("simulate", ["simulate", "--out", "s"], "s") is None
    assert interrupt.resume_command("uq", ["uq", "runs/a", "--check"]) is None


def _stopped(rc, capsys, signum, point, ckpt):
    """The one line of a run stopped by ``signum`` at ``point`` with ``ckpt`` written; returns its resume command."""
    err = capsys.readouterr().err
    assert rc == 128 + signum, err
    m = _interrupted_line(err)
    assert m.group(1) == signal.Signals(signum).name and m.group(2) == point and Path(m.group(3)) == ckpt
    assert ckpt.is_file() and not list(ckpt.parent.glob(".*.tmp"))
    assert not (ckpt.parent / "metrics.json").exists()
    return m.group(4)


@pytest.mark.slow
def test_run_interrupted_in_dip_em_and_prediction_resumes_bit_identically(
    reference, tiny_scan, tmp_path, monkeypatch, capsys
):
    """One run stopped three times: Ctrl-C during the DIP (iteration 15 of 40), SIGTERM after EM step 2 of 3, Ctrl-C
    while the second of four sample chunks is summed; each printed command resumes it, and the finished run equals
    the uninterrupted one bit for bit."""
    out = tmp_path / "run"
    _signal_on_call(monkeypatch, dip_module, "tv_anisotropic", 15, signal.SIGINT)  # one TV per DIP iteration
    rc = main(_argv(tiny_scan, out))
    again = _stopped(rc, capsys, signal.SIGINT, "the DIP fit after iteration 15 of 40", out / "dip_checkpoint.pt")
    assert again == shlex.join(["ctuq", *_argv(tiny_scan, out), "--resume"])
    monkeypatch.undo()

    original, stages = checkpoints.save_uq_checkpoint, []

    def signal_after_em_step_2(path, fingerprint, **content):
        original(path, fingerprint, **content)
        stages.append(content.get("stage"))
        if content.get("stage") == "em" and stages.count("em") == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(checkpoints, "save_uq_checkpoint", signal_after_em_step_2)
    rc = _resume(again)
    again = _stopped(rc, capsys, signal.SIGTERM, "the EM after step 2 of 3", out / "uq_state.pt")
    monkeypatch.undo()

    _signal_on_call(monkeypatch, SampleMoments, "update", 2, signal.SIGINT)
    rc = _resume(again)
    again = _stopped(rc, capsys, signal.SIGINT, "the prediction after sample chunk 2 of 4", out / "uq_moments.pt")
    monkeypatch.undo()

    assert _resume(again) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["dip"]["resumed_from_iteration"] == 40
    _assert_same_results(reference, out)


@pytest.mark.slow
def test_sigterm_to_a_real_process_then_resume(tiny_scan, tmp_path):
    """``python -m ctuq reconstruct`` stopped by SIGTERM during its DIP; the printed command resumes it in this
    process to the numbers of an uninterrupted run (same torch thread count in both processes)."""
    argv = [*sets("dip.iterations=60", "dip.checkpoint_every=5"), "--no-uq"]
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), CTUQ_NO_PROGRESS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ctuq", *_argv(tiny_scan, out, *argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 300
        while not (out / "dip_checkpoint.pt").is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    m = _interrupted_line(err)
    assert m.group(1) == "SIGTERM" and m.group(2).startswith("the DIP fit after iteration ")
    assert Path(m.group(3)) == out / "dip_checkpoint.pt"
    assert 5 <= int(m.group(2).split()[-3]) < 60
    assert _resume(m.group(4)) == 0
    ref = tmp_path / "reference"
    assert main(_argv(tiny_scan, ref, *argv)) == 0
    np.testing.assert_array_equal(
        tifffile.imread(out / "reconstruction.tif"), tifffile.imread(ref / "reconstruction.tif")
    )
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (out, ref))
    assert ma["psnr"] == mb["psnr"] and ma["ssim"] == mb["ssim"]
    for key in ("best_loss", "best_iteration", "final_loss", "best_psnr_history"):
        assert ma["dip"][key] == mb["dip"][key], key
    assert ma["dip"]["resumed_from_iteration"] == int(m.group(2).split()[-3])
