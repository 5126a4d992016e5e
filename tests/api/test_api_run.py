"""The acceptance script of the public API (issue 43), as tests: a fan-beam scan given as numpy arrays and ASTRA
geometry dicts (``ctuq.Scan.from_astra``), reconstructed in memory with the bundled ``tiny`` config, its images,
error bars, metrics, held-out check and posterior read from the :class:`ctuq.Run`, saved and loaded back with the
same arrays, and the command line run on the same scan written as ``scan.yaml`` giving the very same arrays.

Cost: two runs with uncertainty (the in-memory one shared through ``conftest.fan_run``, the command line's here;
~10-15 s each on one core), one posterior rebuilt from a run folder (~3-5 s), one restricted and extended (~3 s)
and one held-out check (~1 s); the rest read those runs, or run a few DIP steps without uncertainty (< 1 s).
"""

import gc
import json
import shutil

import numpy as np
import pytest
from api_cases import SET, N, set_args

import ctuq
from ctuq import run as api
from ctuq.cli import main
from ctuq.errors import CTUQError

METHODS = {"fbp", "tv", "dip"}  # tiny runs TV
SCORES = ("psnr", "ssim", "coverage", "marginal_ll", "joint_ll")  # the metrics that are numbers of the run


@pytest.fixture(scope="module")
def cli_run(fan_scan, tmp_path_factory):
    """``ctuq reconstruct --config tiny --data <the fan scan written by Scan.save> --set ...`` (the settings of
    ``fan_run``), through :func:`ctuq.cli.main` in this process: the run folder."""
    base = tmp_path_factory.mktemp("cli")
    scan_file = fan_scan.save(base / "scan")
    out = base / "run"
    argv = ["reconstruct", "--config", "tiny", "--data", str(scan_file), "--out", str(out), *set_args(SET)]
    assert main([*argv, "--no-progress"]) == 0
    return out


def _config_without_path(run) -> dict:
    cfg = run.config.to_dict()
    cfg["data"].pop("path")
    return cfg


@pytest.mark.slow
def test_a_scan_given_as_arrays_reconstructs_in_memory(fan_run, fan_scan):
    run = fan_run
    assert run.temporary and run.path.is_dir()
    assert repr(run).startswith("Run(a temporary folder: FBP ") and repr(run).endswith("; with uncertainty)")
    images = run.images
    assert set(images) == METHODS
    for name, image in images.items():
        assert image.shape == (N, N) and image.dtype == np.float32 and np.isfinite(image).all(), name
    # in fan_scan's array order (ASTRA's): each image is closer to the phantom than to its mirror image (measured:
    # mean error 0.56 of the mirror's for FBP, 0.08 for TV, 0.71 for the 30-step DIP)
    truth = run.ground_truth
    assert np.array_equal(truth, np.asarray(fan_scan.load().ground_truth))
    error = {k: np.abs(v - truth).mean() / np.abs(v - np.flipud(truth)).mean() for k, v in images.items()}
    assert max(error.values()) < 0.85 and error["tv"] < 0.3, error
    std = run.std
    assert std.shape == (N, N) and std.dtype == np.float32 and (std > 0).all() and np.isfinite(std).all()
    m = run.metrics
    assert set(m["psnr"]) == METHODS and all(np.isfinite(v) for v in m["psnr"].values())
    assert m["uq"]["calibration"] is not None and m["config"]["data"]["angular_subsampling"] == 2
    assert run.config.data.path == "scan/scan.yaml" and (run.path / "scan" / "scan.yaml").is_file()


@pytest.mark.slow
def test_the_held_out_check_of_a_saved_run(fan_run_saved, tmp_path):
    """``Run.check()`` on the check half (10) of the 20 angles ``tiny``'s ``angular_subsampling = 2`` left out: the
    other 10 tuned TV and the DIP (on a copy: it writes ``heldout.json`` into the run folder)."""
    run = ctuq.load_run(ctuq.load_run(fan_run_saved).save(tmp_path / "run"))
    assert run.metrics["data"]["heldout_split"] == {"tuning_angles": 10, "check_angles": 10}
    check = run.check()
    assert check.n_angles == 10
    assert set(check.coverage) == {"0.5", "0.9", "0.95"} and all(0 <= c <= 1 for c in check.coverage.values())
    assert check.call in {"too narrow", "about right", "too wide"}
    assert "held-out check on 10 unused angles" in str(check)
    assert json.loads((run.path / "heldout.json").read_text())["n_angles"] == 10


@pytest.mark.slow
def test_the_posterior_samples_scores_patches_restricts_and_extends(fan_run, fan_scan):
    post = fan_run.posterior
    assert post.image_shape == (N, N) and post.n_measurements == 20 * 48
    samples = post.sample(8, seed=3)
    assert samples.shape == (8, N, N) and samples.dtype == np.float32 and np.isfinite(samples).all()
    assert np.array_equal(samples, post.sample(8, seed=3)) and not np.array_equal(samples, post.sample(8, seed=4))
    # the samples spread about the reconstruction, on the scale of the posterior's own std map
    spread = samples.std(axis=0).mean() / fan_run.std_uncalibrated.mean()
    assert 0.3 < spread < 3.0, spread
    ll = post.log_likelihood(fan_run.ground_truth, n_samples=64, patch_sizes=[1, 2, 4])
    assert set(ll) == {"marginal", "joint_1", "joint_2", "joint_4"} and all(np.isfinite(v) for v in ll.values())
    assert ll["joint_1"] == pytest.approx(ll["marginal"], rel=1e-9)  # 1 × 1 patches are the pixels
    far = post.log_likelihood(np.flipud(fan_run.ground_truth), n_samples=32, patch_sizes=[2])
    assert far["joint_2"] < ll["joint_2"]  # the phantom's mirror image is less likely than the phantom
    # given a quarter of its angles the posterior widens; given then 4 of the held-out angles it narrows again (same
    # prior scales, a and σ²; the held-out rows of a subset that leaves those 4 out). Few rows: each extended row
    # costs network products.
    few = post.restrict(range(0, 20, 4), 48)
    extra = fan_scan.subset([i for i in range(40) if i not in (1, 11, 21, 31)]).load().heldout
    more = few.extend(extra.op, extra.y)
    assert (few.n_measurements, more.n_measurements) == (5 * 48, 9 * 48)
    widths = [p.std(16, seed=5).mean() for p in (post, few, more)]  # measured: 0.0024, 0.0043, 0.0035
    assert widths[1] > widths[0] and widths[1] > widths[2], widths


@pytest.mark.slow
def test_a_saved_run_loads_back_with_the_same_arrays(fan_run, fan_run_saved):
    loaded = ctuq.load_run(fan_run_saved)
    assert not loaded.temporary and loaded.path == fan_run_saved
    images = fan_run.images
    assert set(loaded.images) == set(images)
    for name, image in loaded.images.items():
        assert np.array_equal(image, images[name]), name
    for name in ("std", "std_uncalibrated", "ground_truth"):
        assert np.array_equal(getattr(loaded, name), getattr(fan_run, name)), name
    assert loaded.metrics == fan_run.metrics
    assert loaded.config.to_dict() == fan_run.config.to_dict()
    assert (fan_run_saved / "scan" / "scan.yaml").is_file()  # the scan given as arrays travels with the run
    assert repr(loaded) == repr(fan_run).replace("a temporary folder", str(fan_run_saved))


@pytest.mark.slow
def test_the_command_line_on_the_saved_scan_gives_the_same_arrays(fan_run, cli_run):
    """The acceptance test: ``ctuq reconstruct`` on ``Scan.save``'s ``scan.yaml`` is bitwise the in-memory run, and
    its loaded run rebuilds the same posterior (its samples bitwise the in-memory posterior's)."""
    cli = ctuq.load_run(cli_run)
    images = fan_run.images
    assert set(cli.images) == set(images)
    for name, image in cli.images.items():
        assert np.array_equal(image, images[name]), name
    assert np.array_equal(cli.std, fan_run.std)
    assert np.array_equal(cli.std_uncalibrated, fan_run.std_uncalibrated)
    for key in SCORES:
        assert cli.metrics[key] == fan_run.metrics[key], key
    assert _config_without_path(cli) == _config_without_path(fan_run)
    # a loaded run rebuilds its posterior from uq_state.pt (scan reloaded, DIP restored): the same one
    assert np.array_equal(cli.posterior.sample(4, seed=1), fan_run.posterior.sample(4, seed=1))


# ------------------------------------------------------------------------------------------------ subsets, folders
TWO_STEPS = {"dip.iterations": 2, "tv.enabled": False, "output.figure": False}  # a run of ~0.3 s (no uncertainty)


@pytest.fixture
def made(monkeypatch) -> list:
    """The temporary folders that runs made without ``out=`` create during the test, recorded as they are made."""
    folders = []
    make = api._temporary_folder

    def recorded(kind: str):
        folders.append(make(kind))
        return folders[-1]

    monkeypatch.setattr(api, "_temporary_folder", recorded)
    return folders


@pytest.mark.slow
def test_a_run_of_a_subset_measures_its_angles_and_its_folder_goes_with_it(fan_scan, tmp_path, made):
    """A subset's run measures exactly its angles; the temporary folder of a run made without ``out=`` is removed
    when the :class:`ctuq.Run` is garbage-collected (what ``Run.save`` wrote stays)."""
    sub = fan_scan.subset(range(0, 40, 4))
    run = ctuq.reconstruct(sub, config="tiny", set=TWO_STEPS, uq=False, progress=False)
    assert run.config.data.angles == list(range(0, 40, 4)) and run.config.data.angular_subsampling == 1
    assert run.images["dip"].shape == (N, N) and run.std is None
    assert repr(run).endswith("; without uncertainty)")
    with pytest.raises(CTUQError, match="no uncertainty phase"):
        run.posterior  # noqa: B018
    assert made == [run.path] and (run.path / "metrics.json").is_file()
    kept = run.save(tmp_path / "kept")
    del run
    gc.collect()
    assert not made[0].exists()
    assert ctuq.load_run(kept).config.data.angles == list(range(0, 40, 4))


def test_a_failed_run_leaves_no_temporary_folder(fan_scan, made):
    """A run that fails after its temporary folder was made (here: the subset has fewer angles than
    ``data.min_angles``, found when the scan is loaded) removes the folder: nothing could resume it."""
    with pytest.raises(CTUQError, match="fewer than data.min_angles = 4"):
        ctuq.reconstruct(fan_scan.subset([0, 1, 2]), config="tiny", set=TWO_STEPS, uq=False, progress=False)
    assert len(made) == 1 and not made[0].exists()


@pytest.mark.slow
def test_a_failed_uncertainty_leaves_no_temporary_copy(fan_run_saved, tmp_path, made):
    """``ctuq.uncertainty`` of a run, into a temporary copy, that fails after the copy was made (here: the run's
    scan is gone) removes the copy."""
    broken = ctuq.load_run(fan_run_saved).save(tmp_path / "run")
    shutil.rmtree(broken / "scan")
    with pytest.raises(FileNotFoundError, match="scan"):
        ctuq.uncertainty(broken, set={"uq.samples": 16}, progress=False)
    assert len(made) == 1 and not made[0].exists()
