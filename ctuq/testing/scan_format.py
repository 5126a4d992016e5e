"""The scan-format contract (:class:`ScanFormatContract`, its checks in its docstring), its case type
(:class:`ScanFormatCase`), the damages it applies (:class:`Damage`) and the small scan it writes
(:func:`small_scan_content`)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ctuq.data.formats import DATA_FORMATS, detect_format
from ctuq.data.loader import load_slice, read_slice
from ctuq.data.scan_format import CircularOrbit, ScanContent, ScanFormat, ScanOrbit
from ctuq.data.source import count_variance
from ctuq.errors import CTUQError

__all__ = ["Damage", "ScanFormatCase", "ScanFormatContract", "small_scan_content"]


def small_scan_content(
    *,
    n_angles: int = 6,
    det_shape: tuple[int, int] = (4, 10),
    gt_shape: tuple[int, int, int] = (3, 8, 8),
    voxel_size: float = 1.5,
    read_noise: float = 2.0,
    closing: bool = True,
    seed: int = 0,
) -> ScanContent:
    """A seeded small scan to write (:class:`~ctuq.data.scan_format.ScanContent`): one cone-beam orbit 2 of
    ``n_angles`` degree angles (source in the detector centre's plane, 66 mm and 133 mm, 3 mm pixels), uint16 raw
    counts with two flats and one dark (flat ≈ 2000, dark ≈ 100, transmissions 0.3 … 0.95, so every ``−log`` is
    defined), a closing projection, and a float32 ground truth ``gt_shape`` (mm⁻¹) at ``voxel_size`` mm."""
    rng = np.random.default_rng(seed)
    rows, cols = det_shape
    dark = np.round(100.0 + rng.normal(0.0, 3.0, det_shape))
    gain = 2000.0 + rng.normal(0.0, 20.0, det_shape)
    flats = np.stack([np.round(gain + rng.normal(0.0, 40.0, det_shape)) + dark for _ in range(2)])

    def frame() -> np.ndarray:
        return np.round(dark + rng.uniform(0.3, 0.95, det_shape) * gain)

    projections = np.stack([frame() for _ in range(n_angles)])
    geometry = CircularOrbit(
        n_angles=n_angles, pixel_size=3.0, row_pixel_size=3.0, source_object=66.0, object_detector=133.0
    )
    orbit = ScanOrbit(
        geometry,
        projections.astype(np.uint16),
        flats.astype(np.uint16),
        dark[None].astype(np.uint16),
        closing=frame().astype(np.uint16) if closing else None,
    )
    gt = rng.uniform(0.0, 0.05, gt_shape).astype(np.float32)
    return ScanContent(
        orbits={2: orbit},
        ground_truth=gt,
        gt_shape=gt_shape,
        voxel_size=voxel_size,
        read_noise=read_noise,
        title="ctuq contract scan",
    )


@dataclasses.dataclass
class Damage:
    """One way to damage a written scan: ``apply(path)`` edits the scan whose :meth:`ScanFormat.write` returned
    ``path`` (a copy) and returns the text the one-line error must contain (e.g. the damaged file's name)."""

    name: str
    apply: Callable[[Path], str]


def _largest_written(fmt: type[ScanFormat], path: Path) -> Path:
    folder = path if path.is_dir() else path.parent
    files = fmt.written_files(folder) or [p for p in folder.rglob("*") if p.is_file()]
    return max(files, key=lambda p: (p.stat().st_size, str(p)))


def _damage_largest(fmt: type[ScanFormat], name: str, damage: Callable[[Path], Any]) -> Damage:
    def apply(path: Path) -> str:
        victim = _largest_written(fmt, path)
        damage(victim)
        return victim.name

    return Damage(name, apply)


@dataclasses.dataclass
class ScanFormatCase:
    """One format under test: the format class, the options of its ``write`` (a ``--layout``'s), its own malformed
    files (beyond the generic truncated and deleted largest file) and the scan written (default
    :func:`small_scan_content`)."""

    format: type[ScanFormat]
    write_options: dict = dataclasses.field(default_factory=dict)
    damages: list[Damage] = dataclasses.field(default_factory=list)
    content: ScanContent | None = None


class ScanFormatContract:
    """The scan-format contract. Subclass and set :attr:`format` (a :class:`~ctuq.data.scan_format.ScanFormat`
    subclass or a registered name), :attr:`write_options` and :attr:`damages`, or override the class-scoped
    ``case`` fixture (e.g. parametrised over every ``--layout`` of :data:`~ctuq.registry.DATA_FORMATS`).

    Checks, on the written scan opened with the format's ``open``: the class facts (name, what it expects,
    ``--layout`` names, error class; a format detects what it wrote, and registered formats are detected from the
    folder); the geometry (``vectors`` of the distinct angles, detector and grid shape, voxel size) and the
    measurements (every projection, the closing one where the format keeps it, mean flat and dark, read noise,
    ground truth) equal the content bit for bit; line integrals and their variances are
    :func:`~ctuq.data.source.count_variance`'s of the content's counts bit for bit; a slice loads, and a subsampled
    load with ``heldout=True`` splits the all-angle rows bit for bit into the used and held-out rows; damaged files
    (the largest file the write left truncated or deleted, plus :attr:`damages`) raise one line, a
    :class:`~ctuq.errors.CTUQError` naming the file; a degenerate geometry written in the format (a zero detector
    pixel, the source on the rotation axis, the detector between the source and the axis) is refused, by ``open``
    or by :func:`ctuq.data.plausibility.check_geometry`, in one line naming the written file that holds it. The
    default scan has two flats and one dark (the walnut layout's), so the mean frames compare bit for bit."""

    format: type[ScanFormat] | str | None = None
    """The format under test."""
    write_options: dict = {}
    """Options of :meth:`ScanFormat.write` (a layout's, e.g. ``{"arrays": "tiff"}``)."""
    damages: list[Damage] = []
    """The format's own malformed files."""

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls) -> ScanFormatCase:
        fmt = DATA_FORMATS[cls.format] if isinstance(cls.format, str) else cls.format
        return ScanFormatCase(fmt, dict(cls.write_options), list(cls.damages))

    @pytest.fixture(scope="class")
    @classmethod
    def written(cls, case, tmp_path_factory) -> tuple[Path, ScanContent]:
        """``(path to open, content)`` of the scan written once per case."""
        content = case.content if case.content is not None else small_scan_content()
        folder = tmp_path_factory.mktemp(f"scan_{case.format.name}")
        path = case.format.write(folder / "scan", content, **case.write_options)
        return Path(path), content

    @pytest.fixture
    def scan_format(self, case) -> type[ScanFormat]:
        return case.format

    @pytest.fixture
    def scan(self, scan_format, written):
        return scan_format.open(written[0], 2)

    @staticmethod
    def _orbit(content: ScanContent) -> ScanOrbit:
        return content.orbits[2] if 2 in content.orbits else next(iter(content.orbits.values()))

    @staticmethod
    def _mean_frames(orbit: ScanOrbit) -> tuple[np.ndarray, np.ndarray]:
        """The mean flat and dark of what was written (float64, the readers' summation)."""
        return tuple(f.astype(np.float64).sum(axis=0) * (1.0 / len(f)) for f in (orbit.flats, orbit.darks))

    # ------------------------------------------------------------------------------------------ class facts
    def test_class_facts(self, scan_format, written):
        fmt = scan_format
        assert issubclass(fmt, ScanFormat) and isinstance(fmt.name, str) and fmt.name
        assert isinstance(fmt.expects, str) and fmt.expects and isinstance(fmt.folder_lacks(), str)
        layouts = fmt.write_layouts()
        assert layouts and all(isinstance(k, str) and isinstance(v, dict) for k, v in layouts.items())
        assert issubclass(fmt.error, CTUQError)
        path, _content = written
        assert fmt.detect(path) == path
        folder = path if path.is_dir() else path.parent
        assert fmt.detect(folder) == path, "detecting the folder the write filled gives what open takes"
        assert set(fmt.written_files(folder)) <= {p for p in folder.rglob("*") if p.is_file()}
        if DATA_FORMATS.get(fmt.name) is fmt:
            assert detect_format(folder)[0] is fmt

    def test_nothing_is_detected_in_an_empty_folder(self, scan_format, tmp_path):
        assert scan_format.detect(tmp_path) is None

    # ------------------------------------------------------------------------------------------ round trip
    def test_geometry_round_trip(self, scan, written):
        _path, content = written
        orbit = self._orbit(content)
        rows, files = scan.angle_plan(1)
        assert scan.n_distinct_angles == len(rows) == orbit.geometry.n_angles
        assert np.array_equal(rows, np.arange(orbit.geometry.n_angles))
        assert scan.vectors[rows].tobytes() == orbit.geometry.vectors().tobytes()
        assert tuple(scan.det_shape) == orbit.det_shape
        assert tuple(scan.gt_shape) == content.gt_shape and scan.voxel_size == content.voxel_size
        assert scan.geometry_type == "cone" and isinstance(scan.describe_angles(), str)

    def test_measurements_round_trip(self, scan, written):
        _path, content = written
        orbit = self._orbit(content)
        rows, files = scan.angle_plan(1)
        for k, f in zip(rows, files):
            assert np.array_equal(scan.projection(int(f)), orbit.projections[k].astype(np.float64)), f"projection {k}"
        for f in sorted(set(range(scan.n_files)) - {int(f) for f in files}):  # kept beyond the distinct angles
            want = orbit.closing if orbit.closing is not None else orbit.projections[0]
            assert np.array_equal(scan.projection(f), want.astype(np.float64)), f"closing projection (file {f})"
        assert (scan.n_flats, scan.n_darks) == (len(orbit.flats), len(orbit.darks))
        assert all(np.array_equal(got, want) for got, want in zip(scan.flat_dark(), self._mean_frames(orbit)))
        assert scan.read_noise == content.read_noise

    def test_ground_truth_round_trip(self, scan, written):
        _path, content = written
        assert scan.has_ground_truth == (content.ground_truth is not None)
        if content.ground_truth is not None:
            for k in range(content.gt_shape[0]):
                got = scan.read_ground_truth_slice(k)
                assert got.dtype == np.float64 and np.array_equal(got, content.ground_truth[k].astype(np.float64))

    def test_line_integrals_and_variances(self, scan, written):
        _path, content = written
        orbit = self._orbit(content)
        flat, dark = self._mean_frames(orbit)
        all_rows, all_cols = np.arange(orbit.det_shape[0]), np.arange(orbit.det_shape[1])
        rows, files = scan.angle_plan(1)
        for k, f in zip(rows, files):
            P, F = orbit.projections[k].astype(np.float64) - dark, flat - dark
            ell, var = scan.log_rows(int(f), all_rows, all_cols, None)
            assert ell.tobytes() == (-np.log(P / F)).tobytes(), f"line integrals of projection {k}"
            want = count_variance(P, F, content.read_noise, len(orbit.flats), len(orbit.darks))
            assert var is not None and var.tobytes() == want.tobytes(), f"variances of projection {k}"

    def test_slice_and_heldout_rows_split_the_scan(self, scan):
        full = read_slice(scan, angular_subsampling=1, progress=False)
        n = full.y.shape[0]
        assert full.heldout is None and full.heldout_reason
        assert tuple(full.y.shape) == (n, scan.det_shape[1]) and full.variances is not None
        sub = load_slice(scan, angular_subsampling=2, backend="sparse", heldout=True, progress=False)
        rows = np.asarray(full.meta["geometry_rows"])
        used = np.isin(rows, sub.meta["geometry_rows"])
        assert used.sum() == sub.y.shape[0] == sub.heldout.n_used and (~used).sum() == sub.heldout.n_angles
        assert torch.equal(sub.y, full.y[torch.from_numpy(used)])
        assert torch.equal(sub.variances, full.variances[torch.from_numpy(used)])
        assert np.array_equal(sub.geometry.vectors, full.geometry.vectors[used])
        assert np.array_equal(sub.heldout.geometry_rows, rows[~used]) and sub.heldout_reason == ""
        assert torch.equal(sub.heldout.y, full.y[torch.from_numpy(~used)])
        assert torch.equal(sub.heldout.variances, full.variances[torch.from_numpy(~used)])
        assert tuple(sub.heldout.op.measurement_shape) == tuple(sub.heldout.y.shape)
        assert sub.heldout.op.image_shape == sub.op.image_shape
        if full.ground_truth is not None:
            assert torch.equal(sub.ground_truth, full.ground_truth)

    # ------------------------------------------------------------------------------------------ bad input
    @staticmethod
    def _read_everything(fmt: type[ScanFormat], path: Path) -> None:
        scan = fmt.open(path, 2)
        scan.flat_dark()
        for f in range(scan.n_files):
            scan.projection(f)
        if scan.has_ground_truth:
            for k in range(scan.gt_shape[0]):
                scan.read_ground_truth_slice(k)
        read_slice(scan, angular_subsampling=1, progress=False)

    def test_damaged_files_are_one_line_errors_naming_the_file(self, case, scan_format, written, tmp_path):
        path, _content = written
        source = path if path.is_dir() else path.parent
        damages = [
            _damage_largest(
                scan_format, "truncated file", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
            ),
            _damage_largest(scan_format, "missing file", Path.unlink),
            *case.damages,
        ]
        for i, damage in enumerate(damages):
            copy_dir = tmp_path / f"damage{i}"
            shutil.copytree(source, copy_dir)
            target = copy_dir if path.is_dir() else copy_dir / path.name
            expect = damage.apply(target)
            with pytest.raises(CTUQError) as info:
                self._read_everything(scan_format, target)
            message = str(info.value)
            assert "\n" not in message, f"{damage.name}: not one line: {message!r}"
            assert expect in message, f"{damage.name}: {message!r} does not name {expect!r}"

    @pytest.mark.parametrize(
        "degenerate",
        [
            {"pixel_size": 0.0},  # a zero detector step
            {"source_object": 0.0},  # the source on the rotation axis
            {"object_detector": -33.0},  # the detector between the source (66 mm) and the axis
        ],
        ids=["zero-pixel", "source-on-axis", "detector-inside"],
    )
    def test_degenerate_geometry_is_refused_naming_the_file(self, case, scan_format, degenerate, tmp_path):
        from ctuq.data.plausibility import check_geometry  # what every run checks right after opening

        content = case.content if case.content is not None else small_scan_content()
        orbits = {
            n: dataclasses.replace(o, geometry=dataclasses.replace(o.geometry, **degenerate))
            for n, o in content.orbits.items()
        }
        path = scan_format.write(tmp_path / "scan", dataclasses.replace(content, orbits=orbits), **case.write_options)
        with pytest.raises(CTUQError) as info:
            check_geometry(scan_format.open(Path(path), 2))
        message = str(info.value)
        assert "\n" not in message, f"not one line: {message!r}"
        written = [p for p in (tmp_path / "scan").rglob("*") if p.is_file()]
        assert any(str(p) in message for p in written), f"{message!r} names no file of the scan"
