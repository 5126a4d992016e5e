"""Loading the scan a config names, with the checks that make a bad setting fail fast and clearly.

:func:`load_scan` opens the scan (geometry, headers and listings only), checks the config's ``data`` section
against it — device and backend, slice and subsampling in range, image grid, at least ``data.min_angles``
projection angles — and only then reads pixel data. A setting the scan can give but that differs from the one a
published config states (``data.expect_angles`` / ``data.expect_columns``) loads with a warning saying what the
scan gives instead and why.

The scan's format (walnut folder, ``scan.yaml``, NXtomo, any registered one) is detected by
:mod:`ctuq.data.formats`, and the opened :class:`~ctuq.data.source.ScanSource` loaded by the one loader
(:mod:`ctuq.data.loader`). The scan is read once: a 2D slice comes with the rows of the angles the run does not use
(``CTData.heldout``, or ``CTData.heldout_reason`` saying why there are none), so nothing opens the scan again
after loading.

Errors are :class:`ctuq.errors.DataError` / :class:`~ctuq.errors.DeviceError` (option or scan folder first);
the loaders' own errors (:class:`~ctuq.data.walnut.WalnutFormatError`, :class:`~ctuq.data.projections.
ScanFormatError`: damaged or missing files, malformed descriptions) pass through.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ctuq.config import Config
from ctuq.data.formats import open_scan
from ctuq.data.loader import load_slice, load_volume
from ctuq.data.plausibility import check_geometry, truncation_warning
from ctuq.data.problem import CTData
from ctuq.data.source import ScanSource, SubsetSource
from ctuq.data.walnut import default_data_dir
from ctuq.errors import DataError, DeviceError
from ctuq.geometry import VolumeGeometry

__all__ = [
    "subset_of",
    "data_path",
    "check_device",
    "check_scan_setting",
    "expected_setting_warnings",
    "load_scan",
    "count_kept",
]

# The walnut data set (Der Sarkissian et al. 2019) the published settings subsample.
_WALNUT_ANGLES, _WALNUT_COLUMNS = 1200, 768


def count_kept(n: int, step: int) -> int:
    """Items ``0, step, 2·step, … < n`` kept by subsampling ``n`` items with ``step`` (the loader's rule for
    angles and detector columns)."""
    return len(range(0, n, step))


def data_path(cfg: Config, run_dir: Path | None = None) -> Path:
    """The scan of ``cfg.data.path`` (a walnut folder, a ``scan.yaml``, an NXtomo file, or a folder holding one),
    or the default one (``$CTUQ_DATA`` or the bundled scan). A relative path names a scan inside the run folder
    ``run_dir`` when there is one there (a scan given as arrays travels with its runs, ``ctuq.reconstruct``), else
    one relative to the working directory.

    Raises ``FileNotFoundError`` naming ``data.path`` when it does not exist.
    """
    if cfg.data.path is None:
        return default_data_dir()
    path = Path(cfg.data.path).expanduser()
    if run_dir is not None and not path.is_absolute() and (Path(run_dir) / path).exists():
        path = Path(run_dir) / path
    if not path.exists():
        raise FileNotFoundError(f"data.path {str(path)!r}: no such scan folder or file (set it with --data PATH)")
    return path


def subset_of(scan: ScanSource, angles) -> SubsetSource:
    """``scan`` measured at the distinct angles ``angles`` only (indices in geometry-row order: ``data.angles``);
    :class:`~ctuq.errors.DataError` naming ``data.angles`` for an index the scan does not have."""
    rows = scan.angle_plan(1)[0]
    bad = [int(i) for i in angles if not 0 <= int(i) < len(rows)]
    if bad:
        raise DataError(
            f"data.angles: {bad[:3]} out of range: {scan.path} has {len(rows)} distinct angles (0 … {len(rows) - 1})"
        )
    return SubsetSource(scan, rows[np.sort(np.asarray(angles, dtype=np.int64))])


def check_device(cfg: Config, device: torch.device) -> None:
    """Refuse settings that need CUDA on a CPU ``device`` (3D volumes, the ``astra_cuda`` backend)."""
    if device.type == "cuda":
        return
    if cfg.data.ndim == 3:
        raise DeviceError(
            f"data.ndim = 3: volumes need a CUDA device (ASTRA has no 3D CPU projectors), but this "
            f"run uses {device}; use --device cuda on a GPU machine, or data.ndim = 2"
        )
    if cfg.data.backend == "astra_cuda":
        raise DeviceError(
            f"data.backend = 'astra_cuda' needs a CUDA device, but this run uses {device}; use "
            f"--device cuda, or --set data.backend=sparse"
        )


def check_scan_setting(scan: ScanSource, cfg: Config) -> None:
    """Check ``cfg.data`` against the opened scan (any format's :class:`~ctuq.data.source.ScanSource`) before
    pixels are read.

    Raises
    ------
    DataError
        ``data.slice_index`` beyond the ground-truth slices, a detector subsampling larger than the detector,
        an ``image_shape`` that changes the field of view's aspect ratio, or fewer than ``data.min_angles``
        projection angles left by the files and ``data.angular_subsampling`` (the message names the scan folder,
        the number of angles left and how to get more).
    """
    dc = cfg.data
    n_rows, n_cols = scan.det_shape
    if dc.ndim == 2 and dc.slice_index is not None and not dc.slice_index < scan.gt_shape[0]:
        n_z = scan.gt_shape[0]
        raise DataError(
            f"data.slice_index: {dc.slice_index} is out of range: {scan.path} has {n_z} ground-truth "
            f"slices (0 … {n_z - 1}); set it below {n_z}, or null for the central slice"
        )
    if dc.detector_subsampling > n_cols:
        raise DataError(
            f"data.detector_subsampling: {dc.detector_subsampling} exceeds the {n_cols} detector "
            f"columns of {scan.proj_dir}"
        )
    if dc.ndim == 3 and dc.detector_subsampling > n_rows:
        raise DataError(
            f"data.detector_subsampling: {dc.detector_subsampling} exceeds the {n_rows} detector rows "
            f"of {scan.proj_dir} (3D subsamples rows and columns alike)"
        )
    if dc.image_shape is not None:
        grid = scan.ground_truth_grid() if dc.ndim == 3 else VolumeGeometry(scan.gt_shape[1:], scan.voxel_size)
        try:
            grid.coarsened(dc.image_shape)
        except ValueError:
            raise DataError(
                f"data.image_shape: {list(dc.image_shape)} changes the aspect ratio of the scan's "
                f"ground-truth grid {list(grid.shape)} ({scan.path}); the field of view is kept, so "
                f"use a shape with the same aspect ratio"
            ) from None
    distinct, holds = scan.n_distinct_angles, scan.describe_angles()
    kept = count_kept(distinct, dc.angular_subsampling)
    if kept < dc.min_angles:
        fits = [k for k in range(distinct, 0, -1) if count_kept(distinct, k) >= dc.min_angles]
        if fits and fits[0] < dc.angular_subsampling:
            fix = f"lower data.angular_subsampling to at most {fits[0]}"
        else:
            fix = "use a scan with more projections"
        raise DataError(
            f"{scan.path}: only {kept} projection angle{'s' if kept != 1 else ''} left ({holds}; "
            f"data.angular_subsampling = "
            f"{dc.angular_subsampling} keeps one in {dc.angular_subsampling}), fewer than data.min_angles = "
            f"{dc.min_angles}: a reconstruction from so few angles is not meaningful; {fix}, or set "
            f"data.min_angles={kept} to run anyway"
        )


def expected_setting_warnings(scan: ScanSource, cfg: Config, measurement_shape: tuple[int, ...]) -> list[str]:
    """Warnings (one line each) when the loaded ``measurement_shape`` ``(n_angles, [n_rows,] n_cols)`` differs
    from ``data.expect_angles`` / ``data.expect_columns`` (the setting a published config states): what the scan
    gave, why, and the subsampling that would give the expected setting on this scan if there is one."""
    dc = cfg.data
    got_a, got_c = int(measurement_shape[0]), int(measurement_shape[-1])
    want_a = dc.expect_angles if dc.expect_angles is not None else got_a
    want_c = dc.expect_columns if dc.expect_columns is not None else got_c
    if (got_a, got_c) == (want_a, want_c):
        return []
    distinct, n_cols = scan.n_distinct_angles, scan.det_shape[1]
    why = []
    if got_a != want_a:
        why.append(f"its {distinct} distinct angles, one in {dc.angular_subsampling}, leave {got_a}")
    if got_c != want_c:
        why.append(f"its {n_cols} detector columns, one in {dc.detector_subsampling}, leave {got_c}")
    k_a = next((k for k in range(1, distinct + 1) if count_kept(distinct, k) == want_a), None)
    k_c = next((k for k in range(1, n_cols + 1) if count_kept(n_cols, k) == want_c), None)
    if k_a is not None and k_c is not None:
        fix = (
            f"--set data.angular_subsampling={k_a} --set data.detector_subsampling={k_c} gives "
            f"{want_a} × {want_c} on this scan"
        )
    else:
        fix = (
            f"this scan cannot give {want_a} × {want_c} (the walnut data set has {_WALNUT_ANGLES} angles × "
            f"{_WALNUT_COLUMNS} columns)"
        )
    return [
        f"{scan.path}: the config states {want_a} angles × {want_c} detector columns "
        f"(data.expect_angles/expect_columns) but this scan gives {got_a} × {got_c}: {'; '.join(why)}; {fix}; "
        f"results are not comparable with the published setting"
    ]


def load_scan(
    cfg: Config, device: torch.device, *, progress: bool = True, heldout: bool = True, run_dir: Path | None = None
) -> tuple[CTData, Path, list[str]]:
    """Load the scan of ``cfg.data`` onto ``device`` after checking the setting against it, reading it once.

    ``data.angles`` measures those distinct angles only (:class:`~ctuq.data.source.SubsetSource`; the others are
    held out); ``run_dir`` is the run folder a relative ``data.path`` may name a scan in (:func:`data_path`).
    ``heldout``: also read the angles ``data.angular_subsampling`` leaves out (2D slices) into ``CTData.heldout``,
    for the held-out check (the run's own rows are the same either way); callers that never check (``ctuq design``,
    ``ctuq pretrain``) pass ``False``.

    Returns
    -------
    data : ctuq.data.CTData
        Operator, sinogram ``y`` (``(n_angles, n_cols)`` or ``(n_angles, n_rows, n_cols)``, on ``device``), ground
        truth (``image_shape``, mm⁻¹, or ``None``); ``heldout`` (:class:`~ctuq.data.HeldoutData`: ``T_h`` on
        ``device``, ``y_h``, geometry rows, absolute variances) or ``None`` with ``heldout_reason``.
    path : Path
        The scan folder or file (``data.path``).
    warnings : list of str
        An implausible geometry (:func:`ctuq.data.plausibility.check_geometry`: a voxel or detector pixel outside
        0.1 µm – 10 mm, e.g. a ``scan.yaml`` whose ``units`` do not fit its numbers), truncated projections
        (:func:`~ctuq.data.plausibility.truncation_warning`) and :func:`expected_setting_warnings`; empty when all
        is as expected.

    Raises
    ------
    FileNotFoundError, DeviceError, DataError, WalnutFormatError, ScanFormatError
        See :func:`data_path`, :func:`check_device`, :func:`check_scan_setting` and the loader.
    """
    dc = cfg.data
    check_device(cfg, device)
    path = data_path(cfg, run_dir)
    _fmt, scan = open_scan(path, dc.orbit)
    if dc.angles is not None:
        scan = subset_of(scan, dc.angles)
    implausible = check_geometry(scan)  # impossible geometry is refused here, before any pixel is read
    check_scan_setting(scan, cfg)
    kwargs = dict(
        angular_subsampling=dc.angular_subsampling,
        detector_subsampling=dc.detector_subsampling,
        image_shape=None if dc.image_shape is None else tuple(dc.image_shape),
        backend=dc.backend,
        device=device,
        progress=progress,
    )
    if dc.ndim == 2:
        d = load_slice(scan, slice_index=dc.slice_index, heldout=heldout, **kwargs)
    else:
        d = load_volume(scan, heldout=heldout, **kwargs)
    warnings = [w for w in (implausible, truncation_warning(d.y, str(scan.origin("projections")))) if w]
    return d, path, warnings + expected_setting_warnings(scan, cfg, tuple(d.op.measurement_shape))
