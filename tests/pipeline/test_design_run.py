"""``ctuq design`` end to end on the bundled scan in a tiny setting, its resume, and its bad inputs.

Tiny: 32² image, 32 detector columns, 24 candidate angles of the scan's 240, a 4-angle pilot, 3 acquisitions,
64 samples, 10 DIP iterations (the network through JVPs/VJPs, not assembled), no reconstruction figures.
"""

import json

import numpy as np
import pytest
import tifffile

from ctuq.cli import main

TINY = [
    "--no-progress",
    "--candidates",
    "24",
    "--acquire",
    "3",
    "--samples",
    "64",
    "--set",
    "data.image_shape=[32, 32]",
    "--set",
    "data.detector_subsampling=8",
    "--set",
    "dip.iterations=10",
    "--set",
    "dip.warm_start_iterations=10",
    "--set",
    "tv.iterations=10",
    "--set",
    "design.std_samples=16",
    "--set",
    "design.dense=never",
    "--set",
    "output.figure=false",
]


@pytest.fixture(scope="module")
def design_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("design") / "run"
    assert main(["design", "--out", str(out), "--pilot", "4", *TINY]) == 0
    return out


@pytest.mark.slow
def test_design_end_to_end_writes_every_output(design_run):
    out = design_run
    rec = json.loads((out / "design.json").read_text())
    assert rec["strategy"] == "eig" and rec["route"] == "sampled" and rec["prior"]["kind"] == "dip"
    assert len(rec["pilot"]["angles_deg"]) == 4 and len(rec["acquired"]) == 3
    assert len(set(rec["angles_deg"])) == 7 and len(rec["criterion_traces"]) == 3
    for step in rec["acquired"]:  # every step records its time and the values of all 24 candidates
        assert step["time_s"] > 0 and step["criterion"] is not None
    assert all(len(v) == 24 for v in rec["criterion_traces"])
    lines = [ln for ln in (out / "angles.txt").read_text().splitlines() if not ln.startswith("#")]
    assert [ln.split()[1] for ln in lines] == ["pilot"] * 4 + ["acquired"] * 3
    np.testing.assert_allclose([float(ln.split()[0]) for ln in lines], rec["angles_deg"], atol=1e-5)
    for name in ("design_polar.png", "std.png", "config.yaml"):
        assert (out / name).is_file()
    s0, s1 = tifffile.imread(out / "std_pilot.tif"), tifffile.imread(out / "std_design.tif")
    assert s0.shape == s1.shape == (32, 32) and s1.mean() < s0.mean()  # more angles, less posterior std
    for name in ("designed", "equidistant"):
        comp = rec["comparison"][name]
        assert comp["n_angles"] == 7 and set(comp["psnr"]) == {"fbp", "tv", "dip"}
        assert (out / name / "metrics.json").is_file()
    assert (out / "pilot" / "dip_model.pt").is_file()


def test_design_resumes_from_its_checkpoint(design_run, capsys):
    out = design_run
    first = json.loads((out / "design.json").read_text())
    assert main(["design", "--out", str(out), "--pilot", "4", *TINY]) == 2  # finished: refused without --resume
    assert "already holds a finished design" in capsys.readouterr().err
    (out / "design.json").unlink()  # as if killed after the last step
    assert main(["design", "--out", str(out), "--pilot", "4", "--resume", *TINY]) == 0
    again = json.loads((out / "design.json").read_text())
    assert again["timings"]["resumed_steps"] == 3
    assert again["angles_deg"] == first["angles_deg"]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--pilot", "30"], "--pilot: 30 pilot angles but only 24 candidate angles"),
        (["--pilot", "4", "--acquire", "0"], "--acquire: must be at least 1"),
        (["--pilot", "4", "--candidates", "300"], "--candidates: 300 candidate angles but the scan"),
        (["--pilot", "4", "--set", "design.criterion=best"], "design.criterion must be one of"),
        (["--resume"], "--resume: needs --out"),
    ],
)
def test_bad_inputs_are_one_line_errors(argv, fragment, tmp_path, capsys):
    rc = main(
        ["design", "--out", str(tmp_path / "o"), *TINY, *argv] if argv != ["--resume"] else ["design", "--resume"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and fragment in err and err.startswith("ctuq design: ") and err.count("\n") == 1


def test_pilot_angles_outside_the_scan_or_the_candidates_are_refused(tmp_path, capsys):
    # The bundled scan has 240 angles, 1.5° apart from 270.51°; 24 candidates keep every 10th (15° apart).
    off_scan, off_candidates = tmp_path / "a.txt", tmp_path / "b.txt"
    off_scan.write_text("270.51\n271.2\n")
    off_candidates.write_text("# degrees\n270.51\n272.01\n")
    rc = main(["design", "--out", str(tmp_path / "o"), "--pilot-angles", str(off_scan), *TINY])
    err = capsys.readouterr().err
    assert rc == 2 and "--pilot-angles (the scan's angles): angle 271.2° is not among" in err
    rc = main(["design", "--out", str(tmp_path / "o"), "--pilot-angles", str(off_candidates), *TINY])
    err = capsys.readouterr().err
    assert rc == 2 and "--pilot-angles: angle 272.01° is not among the 24 candidate angles" in err
    assert "the pilot's geometry must be part of the candidate set" in err
    rc = main(["design", "--out", str(tmp_path / "o"), "--pilot-angles", str(tmp_path / "none.txt"), *TINY])
    assert rc == 2 and "none.txt: no such file" in capsys.readouterr().err
