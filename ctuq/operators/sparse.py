"""The ``sparse`` backend: the ray transform as an assembled sparse matrix, built with ASTRA's CPU projectors.

Two operators, one backend (:data:`ctuq.registry.RAY_TRANSFORMS` ``"sparse"``):

* :class:`SparseRayTransform` — 2D parallel and fan beams (``parallel``, ``parallel_vec``, ``fanflat``,
  ``fanflat_vec``);
* :class:`SlicewiseParallelRayTransform` — 3D parallel beam about ``z`` with one detector row per slice
  (``parallel3d``), ``I_D ⊗ T₂`` of the 2D operator (below).

2D
--

``T`` is assembled once by ``astra.projector.matrix`` (entries are intersection lengths in mm, so ``T x`` is a line
integral in mm of an image in mm⁻¹) and kept as two torch CSR matrices, ``T`` and ``Tᵀ``: the adjoint is exact by
construction (the same numbers, transposed), and storing the transpose makes the back-projection as fast as the
projection (torch's CSR kernels are row-parallel; multiplying by a transposed CSR is several times slower).
Both live on the operator's device, so the same object works on CPU and, after ``.to("cuda")``, on the GPU
(cuSPARSE SpMM).

Measured on a 2-core CPU, 128² image, 60 angles × 128 detector pixels (nnz 1.3M): forward/adjoint of one image
~1.3–2 ms; a batch of 64 ~12 ms (``scripts/benchmark_operators.py`` prints the table).

3D parallel beam, slice by slice
--------------------------------
For parallel rays perpendicular to the rotation axis ``z`` and one detector row per volume slice (row pitch =
voxel size, rows centred on the slices), every slice projects only onto its own detector row, so

    T₃ = I_D ⊗ T₂ :  y[a, k, :] = T₂ x[k]   for slice k = 0 … D − 1, angle a,

with ``T₂`` the 2D parallel-beam :class:`SparseRayTransform` of one ``(H, W)`` slice. The adjoint is exact
(``Tᵀ₃ = I_D ⊗ Tᵀ₂``) and the whole volume goes through one batched sparse product.

This is what makes the 3D code of ctuq (3D U-Net, 3D Jacobian products, streaming 3D statistics, orthogonal-slice
figures) testable on a CPU, where ASTRA has no 3D projectors; the walnut data themselves are cone beam and need
:class:`~ctuq.operators.astra_cuda.AstraCudaRayTransform` on a GPU. :attr:`SlicewiseParallelRayTransform.geometry`
is the equivalent ASTRA ``parallel3d`` geometry (checked against the per-slice vectors in the tests), so
:func:`~ctuq.operators.fbp.fdk` reconstructs its data like any parallel-beam volume.

Layout: images ``(D, H, W)`` = ``(z, y, x)``; sinograms angle-major ``(n_angles, D, n_det)`` (detector rows =
slices, increasing with ``z``), as for every 3D backend.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import astra
import numpy as np
import scipy.sparse as sp
import torch
from scipy.sparse.linalg import svds

from ctuq.geometry import ProjectionGeometry, VolumeGeometry, astra_geometries
from ctuq.operators.base import RayTransform

__all__ = ["SparseRayTransform", "SlicewiseParallelRayTransform", "assemble_matrix", "DEFAULT_PROJECTORS"]

# ASTRA CPU projector kinds per geometry: 'linear' (Joseph's interpolation) for parallel beams, and
# 'line_fanflat' — the only CPU kernel that accepts fanflat_vec — for fan beams. These are also ODL's choices.
DEFAULT_PROJECTORS = {
    "parallel": "linear",
    "parallel_vec": "linear",
    "fanflat": "line_fanflat",
    "fanflat_vec": "line_fanflat",
}
_VALID_PROJECTORS = {
    "parallel": ("linear", "line", "strip"),
    "parallel_vec": ("linear", "line", "strip"),
    "fanflat": ("line_fanflat",),
    "fanflat_vec": ("line_fanflat",),
}


def assemble_matrix(
    volume: VolumeGeometry, geometry: ProjectionGeometry, projector: str | None = None
) -> sp.csr_matrix:
    """The ``c × d_x`` matrix of ``T`` (float64 scipy CSR) for a 2D geometry, in ctuq's conventions.

    Rows are angle-major (row ``a·n_det + k`` is detector pixel ``k`` at angle ``a``), columns follow the image's
    C order (``i·n_x + j`` for pixel ``[i, j]``, row index ↔ ``y``). Entries are ray/pixel intersection weights
    in mm.

    Parameters
    ----------
    volume : VolumeGeometry
        2D pixel grid ``(n_y, n_x)`` (mm).
    geometry : ProjectionGeometry
        ``parallel``, ``parallel_vec``, ``fanflat`` or ``fanflat_vec``.
    projector : str, optional
        ASTRA projector kind (default :data:`DEFAULT_PROJECTORS`).
    """
    if volume.ndim != 2 or geometry.ndim != 2:
        raise ValueError(
            f"assemble_matrix: the sparse backend is 2D only; got a {volume.ndim}D volume {volume.shape} and a "
            f"{geometry.ndim}D geometry {geometry.kind!r} (3D needs backend 'astra_cuda')"
        )
    projector = projector or DEFAULT_PROJECTORS[geometry.kind]
    if projector not in _VALID_PROJECTORS[geometry.kind]:
        raise ValueError(
            f"assemble_matrix: projector {projector!r} does not support geometry {geometry.kind!r}; "
            f"valid: {list(_VALID_PROJECTORS[geometry.kind])}"
        )
    vol_geom, proj_geom = astra_geometries(volume, geometry)
    pid = astra.create_projector(projector, proj_geom, vol_geom)
    try:
        mid = astra.projector.matrix(pid)
        try:
            matrix = astra.matrix.get(mid)
        finally:
            astra.matrix.delete(mid)
    finally:
        astra.projector.delete(pid)
    matrix = sp.csr_matrix(matrix, dtype=np.float64)
    matrix.sort_indices()
    expected = (geometry.n_angles * geometry.det_shape[0], volume.shape[0] * volume.shape[1])
    if matrix.shape != expected:  # guards against an ASTRA layout change
        raise RuntimeError(f"assemble_matrix: ASTRA returned a {matrix.shape} matrix, expected {expected}")
    return matrix


def _functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a torch.func wrapper (GradTracking/Batched tensor) rather than a plain tensor."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check(t)) if check is not None else False


def _torch_csr(m: sp.csr_matrix, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        # torch ≥ 2.11 warns about disabled invariant checks even when they are disabled explicitly, as here
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
        return torch.sparse_csr_tensor(
            torch.from_numpy(m.indptr.astype(np.int64)),
            torch.from_numpy(m.indices.astype(np.int64)),
            torch.from_numpy(m.data).to(dtype),
            size=m.shape,
            check_invariants=False,  # built from scipy's canonical CSR, so they hold; checking costs a pass
        ).to(device)


class SparseRayTransform(RayTransform):
    """``T`` for a 2D parallel or fan-beam geometry as an assembled sparse matrix (CPU and CUDA).

    Parameters
    ----------
    volume : VolumeGeometry
        2D pixel grid; ``image_shape = volume.shape = (n_y, n_x)``.
    geometry : ProjectionGeometry
        2D geometry; ``measurement_shape = (n_angles, n_det)``.
    device : torch.device or str
        Where inputs, outputs and the matrices live.
    dtype : torch.dtype
        ``float32`` (default) or ``float64`` (exact references in tests).
    projector : str, optional
        ASTRA projector kind (:data:`DEFAULT_PROJECTORS`).
    matrix : scipy.sparse matrix, optional
        A precomputed ``c × d_x`` matrix for this geometry (used by :meth:`subset`; skips ASTRA).

    Attributes
    ----------
    matrix : scipy.sparse.csr_matrix
        The float64 master copy on the CPU (``c × d_x``), for small problems and tests.
    """

    geometry_kinds = ("parallel", "parallel_vec", "fanflat", "fanflat_vec", "parallel3d")
    devices = ("cpu", "cuda")
    dtypes = (torch.float32, torch.float64)
    exact_adjoint = True
    auto_ndims = (2,)

    @classmethod
    def from_geometry(
        cls,
        volume: VolumeGeometry,
        geometry: ProjectionGeometry,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> RayTransform:
        """The ``sparse`` backend's operator: a :class:`SparseRayTransform` for a 2D geometry, or the
        :class:`SlicewiseParallelRayTransform` for a ``parallel3d`` geometry whose detector rows are the volume's
        slices; ``ValueError`` for other 3D geometries (cone beam needs ``astra_cuda``)."""
        if volume.ndim == 3 and geometry.kind == "parallel3d":
            return SlicewiseParallelRayTransform.from_geometry(volume, geometry, device=device, dtype=dtype)
        if volume.ndim != 2:
            raise ValueError(
                "make_ray_transform: backend 'sparse' is 2D only (and 3D parallel beam with one detector "
                "row per slice, geometry 'parallel3d'); cone-beam volumes need 'astra_cuda' (GPU)"
            )
        return cls(volume, geometry, device=device, dtype=dtype)

    def __init__(
        self,
        volume: VolumeGeometry,
        geometry: ProjectionGeometry,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        projector: str | None = None,
        matrix: sp.spmatrix | None = None,
    ):
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"SparseRayTransform: dtype must be float32 or float64, got {dtype}")
        self.volume = volume
        self.geometry = geometry
        self.projector = projector or DEFAULT_PROJECTORS.get(geometry.kind)
        self.image_shape = tuple(volume.shape)
        self.measurement_shape = tuple(geometry.measurement_shape)
        self.angles = geometry.angles
        self.dtype = dtype
        self.device = torch.device(device)
        if matrix is None:
            matrix = assemble_matrix(volume, geometry, self.projector)
        else:
            matrix = sp.csr_matrix(matrix, dtype=np.float64)
            if matrix.shape != (self.c, self.d_x):
                raise ValueError(
                    f"SparseRayTransform: matrix has shape {matrix.shape}; the geometry needs {(self.c, self.d_x)}"
                )
        self.matrix = matrix
        self._T = _torch_csr(matrix, dtype, self.device)
        self._Tt = _torch_csr(matrix.T.tocsr(), dtype, self.device)

    # ------------------------------------------------------------------ backend hooks
    def _forward_raw(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        if _functorch_wrapped(x):
            return self._coo_product(x.reshape(b, self.d_x), transpose=False).reshape(b, *self.measurement_shape)
        # (d_x, B) dense right-hand side: one SpMM for the whole batch.
        y = self._T @ x.reshape(b, self.d_x).T
        return y.T.reshape(b, *self.measurement_shape)

    def _adjoint_raw(self, y: torch.Tensor) -> torch.Tensor:
        b = y.shape[0]
        if _functorch_wrapped(y):
            return self._coo_product(y.reshape(b, self.c), transpose=True).reshape(b, *self.image_shape)
        x = self._Tt @ y.reshape(b, self.c).T
        return x.T.reshape(b, *self.image_shape)

    def _coo_product(self, v: torch.Tensor, transpose: bool) -> torch.Tensor:
        """``T v`` / ``Tᵀ v`` for ``v`` ``(B, n)`` with dense gather/scatter ops only.

        torch.func transforms (``jvp``, ``grad`` of a ``jvp``, …) hand the operator wrapped tensors, and the
        wrappers do not support sparse CSR products ("Sparse CSR tensors do not have strides"); gathers and
        ``index_add`` work under every transform. Costs ``B × nnz`` memory, so it is only the fallback.
        """
        if getattr(self, "_coo", None) is None or self._coo[0].device != self.device:
            m = self.matrix.tocoo()
            self._coo = (
                torch.as_tensor(m.row, dtype=torch.int64, device=self.device),
                torch.as_tensor(m.col, dtype=torch.int64, device=self.device),
                torch.as_tensor(m.data, dtype=self.dtype, device=self.device),
            )
        rows, cols, vals = self._coo
        src, dst, n_out = (rows, cols, self.d_x) if transpose else (cols, rows, self.c)
        out = torch.zeros((v.shape[0], n_out), dtype=v.dtype, device=v.device)
        return out.index_add(1, dst, v[:, src] * vals)

    # ------------------------------------------------------------------ views
    def subset(self, angle_indices: Sequence[int]) -> SparseRayTransform:
        """The operator for ``angle_indices`` (in that order): the matching row blocks of ``T``, no ASTRA call."""
        idx = np.asarray(angle_indices, dtype=np.int64).reshape(-1)
        geometry = self.geometry.subset(idx)  # validates the indices
        n_det = self.measurement_shape[1]
        idx = np.where(idx < 0, idx + self.n_angles, idx)
        rows = (idx[:, None] * n_det + np.arange(n_det)[None, :]).reshape(-1)
        return SparseRayTransform(
            self.volume,
            geometry,
            device=self.device,
            dtype=self.dtype,
            projector=self.projector,
            matrix=self.matrix[rows],
        )

    def to(self, device: torch.device | str) -> SparseRayTransform:
        """A copy on ``device`` (the matrices are moved, not rebuilt)."""
        device = torch.device(device)
        if device.type == self.device.type and device.index == self.device.index:
            return self
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("SparseRayTransform.to('cuda'): torch sees no CUDA device")
        new = object.__new__(SparseRayTransform)
        new.__dict__.update(self.__dict__)
        new.device = device
        new._coo = None
        new._T = self._T.to(device)
        new._Tt = self._Tt.to(device)
        return new

    @property
    def csr(self) -> torch.Tensor:
        """``T`` as a torch sparse CSR tensor ``(c, d_x)`` on :attr:`device` (the matrix every forward product
        uses; callers must not modify it)."""
        return self._T

    @property
    def nnz(self) -> int:
        """Number of stored non-zeros of ``T``."""
        return int(self.matrix.nnz)

    def operator_norm(self, n_iter: int = 30, seed: int = 0) -> float:
        """``‖T‖₂``: exact (largest singular value via scipy) for small matrices, else power iteration."""
        if min(self.matrix.shape) <= 2:
            return float(np.linalg.norm(self.matrix.toarray(), 2))
        try:
            return float(svds(self.matrix, k=1, return_singular_vectors=False, tol=1e-4, random_state=seed)[0])
        except Exception:  # noqa: BLE001 - ARPACK failure: fall back to the generic power iteration
            return super().operator_norm(n_iter, seed)

    def __repr__(self) -> str:
        return (
            f"SparseRayTransform({self.geometry.kind}, projector={self.projector!r}, "
            f"image_shape={self.image_shape}, measurement_shape={self.measurement_shape}, nnz={self.nnz}, "
            f"device={self.device}, dtype={self.dtype})"
        )


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

    geometry_kinds = ("parallel3d",)
    devices = ("cpu", "cuda")
    dtypes = (torch.float32, torch.float64)
    exact_adjoint = True

    def __init__(
        self,
        volume: VolumeGeometry,
        angles,
        det_count: int,
        det_spacing: float,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        slice_operator: SparseRayTransform | None = None,
    ):
        if not isinstance(volume, VolumeGeometry) or volume.ndim != 3:
            raise ValueError(f"SlicewiseParallelRayTransform: volume must be a 3D VolumeGeometry, got {volume!r}")
        D, H, W = volume.shape
        cx, cy, _ = volume.center
        angles = np.asarray(angles, dtype=np.float64).reshape(-1)
        if angles.size == 0:
            raise ValueError("SlicewiseParallelRayTransform: no projection angles")
        if slice_operator is None:
            geom2 = ProjectionGeometry("parallel", (int(det_count),), angles=angles, det_spacing=float(det_spacing))
            slice_operator = SparseRayTransform(
                VolumeGeometry((H, W), volume.voxel_size, (cx, cy)), geom2, device=device, dtype=dtype
            )
        self.slice_operator = slice_operator
        self.volume = volume
        self.det_spacing = float(det_spacing)
        n_det = int(slice_operator.measurement_shape[1])
        self.geometry = ProjectionGeometry(
            "parallel3d", (D, n_det), angles=slice_operator.angles, det_spacing=(volume.voxel_size, self.det_spacing)
        )
        self.image_shape = (D, H, W)
        self.measurement_shape = (slice_operator.n_angles, D, n_det)
        self.angles = slice_operator.angles
        self.device = slice_operator.device
        self.dtype = slice_operator.dtype

    @classmethod
    def from_geometry(
        cls,
        volume: VolumeGeometry,
        geometry: ProjectionGeometry,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> SlicewiseParallelRayTransform:
        """From an ASTRA ``parallel3d`` geometry whose detector rows are the volume's slices.

        Raises ``ValueError`` naming what does not fit: another kind, a row count other than ``D``, or a row pitch
        other than the voxel size (rows must coincide with slices for ``T₃ = I_D ⊗ T₂``).
        """
        if geometry.kind != "parallel3d":
            raise ValueError(
                f"SlicewiseParallelRayTransform: needs a 'parallel3d' geometry (rays perpendicular to "
                f"z), got {geometry.kind!r}; cone beam needs backend 'astra_cuda'"
            )
        rows, cols = geometry.det_shape
        row_pitch = float(np.atleast_1d(np.asarray(geometry.det_spacing, dtype=np.float64))[0])
        if rows != volume.shape[0] or abs(row_pitch - volume.voxel_size) > 1e-9 * volume.voxel_size:
            raise ValueError(
                f"SlicewiseParallelRayTransform: detector rows ({rows}, pitch {row_pitch} mm) must coincide with the "
                f"volume's slices ({volume.shape[0]}, voxel {volume.voxel_size} mm)"
            )
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
    def subset(self, angle_indices: Sequence[int]) -> SlicewiseParallelRayTransform:
        """The operator for ``angle_indices`` (the 2D operator's row blocks; no ASTRA call)."""
        sub = self.slice_operator.subset(angle_indices)
        return SlicewiseParallelRayTransform(
            self.volume, sub.angles, sub.measurement_shape[1], self.det_spacing, slice_operator=sub
        )

    def to(self, device: torch.device | str) -> SlicewiseParallelRayTransform:
        """A copy on ``device`` (the 2D matrices are moved, not rebuilt)."""
        moved = self.slice_operator.to(device)
        if moved is self.slice_operator:
            return self
        return SlicewiseParallelRayTransform(
            self.volume, moved.angles, moved.measurement_shape[1], self.det_spacing, slice_operator=moved
        )

    def __repr__(self) -> str:
        return (
            f"SlicewiseParallelRayTransform(image_shape={self.image_shape}, measurement_shape="
            f"{self.measurement_shape}, nnz per slice={self.slice_operator.nnz}, device={self.device})"
        )
