"""A 3D parallel-beam ray transform assembled slice by slice from ASTRA's 2D CPU projectors (CPU and CUDA).

For parallel rays perpendicular to the rotation axis ``z`` and one detector row per volume slice (row pitch =
voxel size, rows centred on the slices), every slice projects only onto its own detector row, so

    T₃ = I_D ⊗ T₂ :  y[a, k, :] = T₂ x[k]   for slice k = 0 … D − 1, angle a,

with ``T₂`` the 2D parallel-beam :class:`~ctuq.operators.sparse.SparseRayTransform` of one ``(H, W)`` slice.
The adjoint is exact (``Tᵀ₃ = I_D ⊗ Tᵀ₂``) and the whole volume goes through one batched sparse product.

This is what makes the 3D code of ctuq (3D U-Net, 3D Jacobian products, streaming 3D statistics, orthogonal-slice
figures) testable on a CPU, where ASTRA has no 3D projectors; the walnut data themselves are cone beam and need
:class:`~ctuq.operators.astra_cuda.AstraCudaRayTransform` on a GPU. :meth:`SlicewiseParallelRayTransform.geometry` is
the equivalent ASTRA ``parallel3d`` geometry (checked against the per-slice vectors in the tests), so
:func:`~ctuq.operators.fbp.fdk` reconstructs its data like any parallel-beam volume.

Layout: images ``(D, H, W)`` = ``(z, y, x)``; sinograms angle-major ``(n_angles, D, n_det)`` (detector rows =
slices, increasing with ``z``), as for every 3D backend.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators.base import RayTransform
from ctuq.operators.sparse import SparseRayTransform

__all__ = ["SlicewiseParallelRayTransform"]


class SlicewiseParallelRayTransform(RayTransform):
    """3D parallel beam about ``z`` as ``I_D ⊗ T₂`` (module docstring).

    Parameters
    ----------
    volume : VolumeGeometry
        3D grid ``(D, H, W)`` (mm, cubic voxels).
    angles : array_like
        ``(n_angles,)`` projection angles (rad), as for a 2D ``parallel`` geometry.
    det_count : int
        Detector columns per row.
    det_spacing : float
        Column pitch (mm).
    device, dtype
        As for :class:`~ctuq.operators.sparse.SparseRayTransform`.
    slice_operator : SparseRayTransform, optional
        A ready ``T₂`` for these angles (used by :meth:`subset`; skips ASTRA).
    """

    def __init__(self, volume: VolumeGeometry, angles, det_count: int, det_spacing: float, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 slice_operator: SparseRayTransform | None = None):
        if not isinstance(volume, VolumeGeometry) or volume.ndim != 3:
            raise ValueError(f"SlicewiseParallelRayTransform: volume must be a 3D VolumeGeometry, got {volume!r}")
        D, H, W = volume.shape
        cx, cy, _ = volume.center
        angles = np.asarray(angles, dtype=np.float64).reshape(-1)
        if angles.size == 0:
            raise ValueError("SlicewiseParallelRayTransform: no projection angles")
        if slice_operator is None:
            geom2 = ProjectionGeometry("parallel", (int(det_count),), angles=angles, det_spacing=float(det_spacing))
            slice_operator = SparseRayTransform(VolumeGeometry((H, W), volume.voxel_size, (cx, cy)), geom2,
                                                device=device, dtype=dtype)
        self.slice_operator = slice_operator
        self.volume = volume
        self.det_spacing = float(det_spacing)
        n_det = int(slice_operator.measurement_shape[1])
        self.geometry = ProjectionGeometry("parallel3d", (D, n_det), angles=slice_operator.angles,
                                           det_spacing=(volume.voxel_size, self.det_spacing))
        self.image_shape = (D, H, W)
        self.measurement_shape = (slice_operator.n_angles, D, n_det)
        self.angles = slice_operator.angles
        self.device = slice_operator.device
        self.dtype = slice_operator.dtype

    @classmethod
    def from_geometry(cls, volume: VolumeGeometry, geometry: ProjectionGeometry, *,
                      device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                      ) -> "SlicewiseParallelRayTransform":
        """From an ASTRA ``parallel3d`` geometry whose detector rows are the volume's slices.

        Raises ``ValueError`` naming what does not fit: another kind, a row count other than ``D``, or a row pitch
        other than the voxel size (rows must coincide with slices for ``T₃ = I_D ⊗ T₂``).
        """
        if geometry.kind != "parallel3d":
            raise ValueError(f"SlicewiseParallelRayTransform: needs a 'parallel3d' geometry (rays perpendicular to "
                             f"z), got {geometry.kind!r}; cone beam needs backend 'astra_cuda'")
        rows, cols = geometry.det_shape
        row_pitch = float(np.atleast_1d(np.asarray(geometry.det_spacing, dtype=np.float64))[0])
        if rows != volume.shape[0] or abs(row_pitch - volume.voxel_size) > 1e-9 * volume.voxel_size:
            raise ValueError(
                f"SlicewiseParallelRayTransform: detector rows ({rows}, pitch {row_pitch} mm) must coincide with the "
                f"volume's slices ({volume.shape[0]}, voxel {volume.voxel_size} mm)")
        col_pitch = float(np.atleast_1d(np.asarray(geometry.det_spacing, dtype=np.float64))[-1])
        return cls(volume, geometry.angles, cols, col_pitch, device=device, dtype=dtype)

    # ------------------------------------------------------------------ backend hooks
    def _forward_raw(self, x: torch.Tensor) -> torch.Tensor:
        B, (D, H, W) = x.shape[0], self.image_shape
        A, _, n = self.measurement_shape
        y = self.slice_operator._forward_raw(x.reshape(B * D, H, W))  # (B·D, A, n)
        return y.reshape(B, D, A, n).permute(0, 2, 1, 3).contiguous()

    def _adjoint_raw(self, y: torch.Tensor) -> torch.Tensor:
        B, (A, D, n) = y.shape[0], self.measurement_shape
        H, W = self.image_shape[1:]
        y2 = y.permute(0, 2, 1, 3).reshape(B * D, A, n).contiguous()
        return self.slice_operator._adjoint_raw(y2).reshape(B, D, H, W)

    # ------------------------------------------------------------------ views
    def subset(self, angle_indices: Sequence[int]) -> "SlicewiseParallelRayTransform":
        """The operator for ``angle_indices`` (the 2D operator's row blocks; no ASTRA call)."""
        sub = self.slice_operator.subset(angle_indices)
        return SlicewiseParallelRayTransform(self.volume, sub.angles, sub.measurement_shape[1], self.det_spacing,
                                             slice_operator=sub)

    def to(self, device: torch.device | str) -> "SlicewiseParallelRayTransform":
        """A copy on ``device`` (the 2D matrices are moved, not rebuilt)."""
        moved = self.slice_operator.to(device)
        if moved is self.slice_operator:
            return self
        return SlicewiseParallelRayTransform(self.volume, moved.angles, moved.measurement_shape[1], self.det_spacing,
                                             slice_operator=moved)

    def __repr__(self) -> str:
        return (f"SlicewiseParallelRayTransform(image_shape={self.image_shape}, measurement_shape="
                f"{self.measurement_shape}, nnz per slice={self.slice_operator.nnz}, device={self.device})")
