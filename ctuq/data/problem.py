"""The loaded CT problem every scan format produces (:class:`CTData`) and the rows of the scan's angles that the
run does not use (:class:`HeldoutData`), read in the same pass (:func:`ctuq.data.loader.load_slice`), so the
held-out check never opens the scan again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import RayTransform

__all__ = [
    "CTData",
    "HeldoutData",
    "HELDOUT_GIVEN_IN_CODE",
    "HELDOUT_VOLUME",
    "HELDOUT_NO_UNUSED_ANGLES",
    "HELDOUT_NOT_READ",
    "heldout_every_angle_used",
]

#: Why a problem has no held-out rows (``CTData.heldout_reason``, in metrics.json as ``uq.heldout_skipped``).
HELDOUT_GIVEN_IN_CODE = "the problem was given in code, not as a scan with unused angles"
HELDOUT_VOLUME = "the held-out check is implemented for 2D slices only (data.ndim = 3)"
HELDOUT_NO_UNUSED_ANGLES = (
    "the scan has no unused angles (data.angular_subsampling = 1); a K-fold over the used angles is not done: it "
    "needs one DIP refit per fold"
)
HELDOUT_NOT_READ = "the held-out rows were not read (the scan was loaded with heldout=False)"


def heldout_every_angle_used(path: str | Path) -> str:
    """The reason when subsampling leaves no angle of the scan at ``path`` unused (a scan of one distinct angle)."""
    return f"{path}: every angle of the scan is used by the run"


def _check_rows(name: str, t: torch.Tensor | None, shape: tuple[int, ...], owner: str) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{owner}: {name} must have the sinogram's shape {shape}, got {got}")
    bad = ~(torch.isfinite(t) & (t > 0)) if name == "variances" else ~torch.isfinite(t)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        what = "finite and positive" if name == "variances" else "finite"
        raise ValueError(
            f"{owner}: {name} must be {what}; {int(bad.sum())} are not (first at index {first}: {float(t[first])})"
        )


@dataclasses.dataclass
class HeldoutData:
    """The scan's angles a run does not use (2D slices): the held-out check's measurements.

    Attributes
    ----------
    op : RayTransform
        ``T_h`` on the run's image grid, measurement shape ``(n_angles, n_cols)``, on the run's device (the same
        backend as the run's operator: the sparse fan-beam matrix, or the exact cone-beam slice of ``astra_cuda``).
    y : torch.Tensor
        ``(n_angles, n_cols)`` float32 held-out line integrals (dimensionless), on ``op.device``.
    geometry_rows : np.ndarray
        ``(n_angles,)`` int64: the scan's geometry rows held out, in scan order (the bootstrap's block labels).
    n_used : int
        Angles the run uses (``CTData.y.shape[0]``).
    variances : torch.Tensor or None
        ``(n_angles, n_cols)`` float32 *absolute* per-measurement variances (data units², for a gain of one count
        per photon) from the photon counts, as :attr:`CTData.variances` gives the used rows', on ``op.device``;
        ``None`` when the scan holds no counts (line integrals without variances).
    """

    op: RayTransform
    y: torch.Tensor
    geometry_rows: np.ndarray
    n_used: int
    variances: torch.Tensor | None = None

    def __post_init__(self):
        self.geometry_rows = np.asarray(self.geometry_rows, dtype=np.int64).reshape(-1)
        shape = (len(self.geometry_rows), *tuple(self.y.shape[1:]))
        if tuple(self.y.shape) != shape or self.y.ndim != 2:
            raise ValueError(
                f"HeldoutData: y must be (n_angles, n_cols) with one row per held-out geometry row "
                f"({len(self.geometry_rows)}), got {tuple(self.y.shape)}"
            )
        if self.op is not None and tuple(self.op.measurement_shape) != tuple(self.y.shape):
            raise ValueError(
                f"HeldoutData: y {tuple(self.y.shape)} differs from the operator's measurement shape "
                f"{tuple(self.op.measurement_shape)}"
            )
        _check_rows("variances", self.variances, tuple(self.y.shape), "HeldoutData")

    @property
    def n_angles(self) -> int:
        """Held-out angles."""
        return int(len(self.geometry_rows))

    def subset(self, positions) -> HeldoutData:
        """The held-out rows at ``positions`` (indices into this object's rows, in order): operator, rows,
        geometry rows and variances."""
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if positions.size == 0 or positions.min() < 0 or positions.max() >= self.n_angles:
            raise ValueError(f"HeldoutData.subset: positions must lie in 0 … {self.n_angles - 1}, got {positions}")
        index = torch.as_tensor(positions, device=self.y.device)
        return HeldoutData(
            op=self.op.subset(positions.tolist()) if self.op is not None else None,
            y=self.y.index_select(0, index),
            geometry_rows=self.geometry_rows[positions],
            n_used=self.n_used,
            variances=None if self.variances is None else self.variances.index_select(0, index),
        )

    def split(self) -> tuple[HeldoutData, HeldoutData]:
        """``(tuning, check)``: the held-out angles split in two interleaved halves (even and odd positions in scan
        order), so both cover the whole orbit. The reconstruction is tuned on the first (``ctuq.reconstruct.heldout``)
        and the held-out check scores the std map on the second, which the tuning never saw. Needs two angles."""
        if self.n_angles < 2:
            raise ValueError(f"HeldoutData.split: needs at least 2 held-out angles, has {self.n_angles}")
        positions = np.arange(self.n_angles)
        return self.subset(positions[0::2]), self.subset(positions[1::2])


@dataclasses.dataclass
class CTData:
    """A loaded scan: operator, measurements, ground truth, geometry, and the rows of its unused angles.

    Attributes
    ----------
    op : RayTransform or None
        ``T`` on the requested device (``None`` from the ``read_*`` functions, which build no operator).
    y : torch.Tensor
        Log-transformed projections, ``op.measurement_shape`` — ``(n_angles, n_cols)`` for a slice,
        ``(n_angles, n_rows, n_cols)`` for a volume — float32, on the device (CPU for ``read_*``); line
        integrals (dimensionless: mm⁻¹ × mm).
    ground_truth : torch.Tensor or None
        ``op.image_shape`` (``(H, W)`` or ``(D, H, W)``), float32, CPU, mm⁻¹; ``None`` without one.
    volume : VolumeGeometry
        The image grid (mm), centred at the origin (2D: the slice plane).
    geometry : ProjectionGeometry
        2D: the slice's ``fanflat_vec`` (or ``parallel_vec``) geometry (also when the operator is the exact
        cone-beam slice, whose own one-row ``cone_vec`` geometry is ``slice_cone_geometry``); 3D: the subsampled
        ``cone_vec`` (or ``parallel3d_vec``) geometry.
    meta : dict
        JSON-serialisable record: files and geometry rows used, slice index and ``z``, voxel sizes, detector rows
        used, subsampling, cone angle, backend, …
    slice_cone_geometry : ProjectionGeometry or None
        2D: the exact one-row ``cone_vec`` geometry of the slice (detector centre at the interpolated row).
    variances : torch.Tensor or None
        Predicted variance of each measurement from the photon statistics (:mod:`ctuq.data.walnut`), same shape,
        axis order, dtype and device as ``y``, in data units² for a gain of one count per photon (on real data only
        the ratios are meaningful); ``None`` where a source has no counts.
    heldout : HeldoutData or None
        The rows of the scan's angles the problem does not use (a 2D slice loaded with ``heldout=True`` and
        ``angular_subsampling > 1``).
    heldout_reason : str
        Why ``heldout`` is ``None`` (one line: every angle used, a volume, not read, …); empty when there are
        held-out rows. A problem built in code without either gets :data:`HELDOUT_GIVEN_IN_CODE`.
    """

    op: RayTransform | None
    y: torch.Tensor
    ground_truth: torch.Tensor | None
    volume: VolumeGeometry
    geometry: ProjectionGeometry
    meta: dict
    slice_cone_geometry: ProjectionGeometry | None = None
    variances: torch.Tensor | None = None
    heldout: HeldoutData | None = None
    heldout_reason: str = ""

    def __post_init__(self):
        _check_rows("variances", self.variances, tuple(self.y.shape), "CTData")
        if self.heldout is not None and self.heldout_reason:
            raise ValueError(
                f"CTData: held-out rows are given, so heldout_reason must be empty, got {self.heldout_reason!r}"
            )
        if self.heldout is None and not self.heldout_reason:
            self.heldout_reason = HELDOUT_GIVEN_IN_CODE
