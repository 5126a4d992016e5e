"""A scan format defined here, touching no file of ``ctuq/``: one ``.toy.npz`` holding raw counts, flats, darks,
the cone-beam vectors and the ground truth. Registered with one line (and unregistered afterwards), it passes the
shipped contract, is written by the simulator through the registry (``--layout toy``) and runs through the CLI."""

import zipfile
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from tiny import NO_FIGURES, tiny_args

from ctuq.cli import main
from ctuq.data import load_data
from ctuq.data.scan_format import ScanFormat
from ctuq.data.simulate import SimulationParameters, simulate_scan
from ctuq.data.source import ScanSource
from ctuq.errors import CTUQError
from ctuq.registry import DATA_FORMATS
from ctuq.testing import ScanFormatContract

SUFFIX = ".toy.npz"
KEYS = ("projections", "flats", "darks", "vectors", "ground_truth", "voxel_size", "read_noise")


class ToyFormatError(CTUQError):
    """A malformed toy scan."""


class ToyScan(ScanSource):
    """The whole scan in memory (a toy: the arrays are small)."""

    format = "toy_npz"
    geometry_type = "cone"
    measurement = "counts"
    error = ToyFormatError

    def __init__(self, path: Path):
        self.path = self.proj_dir = Path(path)
        if not self.path.is_file():
            raise ToyFormatError(f"{self.path}: file missing")
        try:
            with np.load(self.path, allow_pickle=False) as z:
                missing = [k for k in KEYS if k not in z.files]
                if missing:
                    raise ToyFormatError(f"{self.path}: no array {missing[0]!r}")
                arrays = {k: np.asarray(z[k]) for k in KEYS}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise ToyFormatError(f"{self.path}: not a readable .npz ({type(exc).__name__}: {exc})") from None
        self.counts = arrays["projections"].astype(np.float64)
        self.vectors = arrays["vectors"]
        self.gt = arrays["ground_truth"]
        flats, darks = arrays["flats"].astype(np.float64), arrays["darks"].astype(np.float64)
        self.n_flats, self.n_darks = len(flats), len(darks)
        self.flat = flats.sum(axis=0) * (1.0 / self.n_flats)
        self.dark = darks.sum(axis=0) * (1.0 / self.n_darks)
        self.det_shape = tuple(self.counts.shape[1:])
        self.gt_shape = tuple(self.gt.shape)
        self.voxel_size, self.voxel_size_source = float(arrays["voxel_size"]), "toy file"
        self.read_noise = float(arrays["read_noise"])
        self.n_files = self.n_distinct_angles = len(self.vectors)
        self.has_ground_truth = True

    def describe_angles(self) -> str:
        return f"it holds {self.n_files} projections"

    def angle_plan(self, angular_subsampling: int):
        rows = np.arange(0, self.n_files, int(angular_subsampling))
        return rows, rows.copy()

    def read_ground_truth_slice(self, slice_index: int) -> np.ndarray:
        return self.gt[slice_index].astype(np.float64)

    def projection(self, index: int) -> np.ndarray:
        return self.counts[index]

    def flat_dark(self):
        return self.flat, self.dark


class ToyFormat(ScanFormat):
    name = "toy_npz"
    expects = "a toy scan (*.toy.npz)"
    layouts = {"toy": {}}
    error = ToyFormatError

    @classmethod
    def detect(cls, path: Path):
        if path.is_file() and path.name.endswith(SUFFIX):
            return path
        found = sorted(path.glob(f"*{SUFFIX}")) if path.is_dir() else []
        return found[0] if len(found) == 1 else None

    @classmethod
    def open(cls, path: Path, orbit: int = 2) -> ToyScan:
        return ToyScan(path)

    @classmethod
    def write(cls, folder: Path, content, *, compress: bool = True, **options) -> Path:
        orbit = content.only_orbit("a toy scan")
        path = Path(folder) / f"scan{SUFFIX}"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(
            path,
            projections=orbit.projections,
            flats=orbit.flats,
            darks=orbit.darks,
            vectors=orbit.geometry.vectors(),
            ground_truth=content.ground_truth,
            voxel_size=content.voxel_size,
            read_noise=content.read_noise,
        )
        return path

    @classmethod
    def written_files(cls, folder: Path):
        return sorted(Path(folder).glob(f"*{SUFFIX}"))


@pytest.fixture(scope="module", autouse=True)
def toy_registered():
    DATA_FORMATS.register(ToyFormat)  # the one line that makes it a format of --data and --layout
    yield
    DATA_FORMATS.unregister(ToyFormat.name)


class TestToyFormat(ScanFormatContract):
    format = ToyFormat


def test_the_simulator_writes_the_toy_layout_through_the_registry(tmp_path):
    params = SimulationParameters.preset(
        "tiny", corrections=False, n_projections=9, gt_shape=(3, 32, 32), gt_voxel_size=1.6, supersampling=1
    )
    simulate_scan(tmp_path / "s", params, preset="tiny", progress=False, layouts=("walnut", "toy"))
    assert (tmp_path / "s" / "toy" / "scan.toy.npz").is_file()
    options = dict(angular_subsampling=2, detector_subsampling=3, image_shape=(16, 16), backend="sparse", heldout=True)
    walnut = load_data(tmp_path / "s" / "walnut", progress=False, **options)
    toy = load_data(tmp_path / "s" / "toy", progress=False, **options)  # the folder: detected through the registry
    assert toy.meta["format"] == "toy_npz"
    for a, b in ((walnut, toy), (walnut.heldout, toy.heldout)):
        assert torch.equal(a.y, b.y) and torch.equal(a.variances, b.variances)
    assert torch.equal(walnut.ground_truth, toy.ground_truth)
    assert np.array_equal(walnut.geometry.vectors, toy.geometry.vectors)


@pytest.mark.slow
def test_the_cli_simulates_and_reconstructs_the_toy_format(tmp_path, capsys):
    scan = tmp_path / "scan"
    assert main(["simulate", "--preset", "tiny", "--layout", "toy", "--out", str(scan), "--no-progress"]) == 0
    path = scan / "scan.toy.npz"
    assert path.is_file() and not (scan / "Projections").exists()
    out = tmp_path / "run"
    assert main(["reconstruct", "--data", str(path), "--out", str(out), *tiny_args(*NO_FIGURES)]) == 0
    std = tifffile.imread(out / "std.tif")
    assert std.shape == (32, 32) and np.all(np.isfinite(std)) and std.max() > 0
    # an unknown layout names the toy's among the valid ones
    assert main(["simulate", "--layout", "zarr", "--out", str(tmp_path / "z"), "--no-progress"]) == 2
    assert "toy" in capsys.readouterr().err
