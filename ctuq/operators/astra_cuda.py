"""Matrix-free ray transform on the GPU with ASTRA's CUDA projectors, on torch CUDA tensors (no host round trip).

ASTRA 2.5's ``astra.experimental.direct_FP3D(projector_id, vol, proj)`` / ``direct_BP3D`` accept any DLPack
object (numpy arrays or torch tensors; CUDA tensors are wrapped in place through ``__dlpack__``) that is
float32, C-contiguous (a row pitch is allowed on the GPU) and shaped exactly like the geometry: volumes
``(slices, rows, cols) = (n_z, n_y, n_x)``, projections ``(det_rows, n_angles, det_cols)``. The projector
(``astra.create_projector('cuda3d', proj_geom, vol_geom)``) is created once and kept alive: ODL's per-call path,
which rebuilds everything, costs ~20× a direct call. ASTRA's 3D volumes follow ctuq's coordinate convention
(array index increases with its coordinate, :mod:`ctuq.geometry`), so vectors are passed unchanged.

Three uses, one class (:class:`AstraCudaRayTransform`):

* **3D** — ``(D, H, W)`` volume, ``cone_vec``/``parallel3d_vec`` (or ``cone``/``parallel3d``) geometry;
  measurement ``(n_angles, n_rows, n_cols)``. ASTRA's ``(rows, angles, cols)`` layout is transposed on the GPU.
  A batch is projected volume by volume (a cone beam cannot see a stack of volumes at once).
* **2D parallel beams, batched** — a batch of ``B`` slices is *one* 3D volume ``(B, H, W)`` (voxel ``h``) seen by
  a ``parallel3d_vec`` geometry whose rays are horizontal and whose detector row ``b`` lies at the height of
  slice ``b`` (``v = (0, 0, h)``): one ASTRA call per batch, and ASTRA's ``(rows, angles, cols)`` output *is*
  the angle-major ``(B, n_angles, n_det)`` batch. Projectors are cached per batch size (LRU, ``max_projectors``).
* **2D fan beams, and one-slice cone beams** (:meth:`AstraCudaRayTransform.cone_slice`) — a fan cannot be
  stacked (one source does not see every slice in-plane), so slices are projected one by one as a one-voxel-thick
  slab ``(1, H, W)`` through a one-row ``cone_vec`` detector (source and row in the slice plane for a fan beam:
  the exact fan-beam projection).

Units: line integrals in mm of an image in mm⁻¹, as the sparse backend. Since ASTRA 2.0 the CUDA forward
projection returns world-unit line integrals and the CUDA back-projection is scaled as its approximate transpose
(ODL's ``astra_cuda_bp_scaling_factor`` for ASTRA ≥ 1.9.9 only adds its own space weightings), so no rescaling
is applied. ASTRA's BP is voxel-driven and not the exact transpose of its ray-driven FP: ⟨Tx, y⟩ and ⟨x, Tᵀy⟩
agree to about 1–2 % for smooth x, y (``tests/operators/test_astra_cuda.py`` measures it). ASTRA's *cone* BP weights
voxels by the 3D ray density (∝ 1/depth²), which is wrong for a one-row detector (a single sheet of rays
through a slab), so the fan/cone-slice modes use a pixel-driven torch back-projection with the in-plane density
weights (:func:`ctuq.operators.fbp.slab_adjoint_backprojection`) as ``Tᵀ``; on the CPU it matches the exact
transpose of ASTRA's ``line_fanflat`` matrix to ~10⁻⁴ in ⟨x, Tᵀy⟩.

ASTRA caveat: in ASTRA 2.5 ``direct_FP3D``/``direct_BP3D`` build, but do not raise, the error of a failed
projection; shapes, dtype and contiguity are therefore validated here before every call.

The module imports without CUDA; constructing the operator without a CUDA device (or with an ASTRA that cannot
use it) raises a clear ``RuntimeError`` — calling ASTRA's CUDA code without a GPU crashes the process.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import astra
import astra.experimental  # registers direct_FP3D/direct_BP3D (imports without CUDA; calls need it)
import numpy as np
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators.base import RayTransform
from ctuq.operators.fbp import DetectorViews, grid_points, slab_adjoint_backprojection

__all__ = ["AstraCudaRayTransform", "cuda_available"]

# ASTRA projectors and its global GPU selection are not thread-safe.
_LOCK = threading.Lock()
_ASTRA_GPU: list[int | None] = [None]


def cuda_available() -> bool:
    """Whether torch sees a CUDA device *and* ASTRA can use CUDA (both are needed by this backend)."""
    if not torch.cuda.is_available():
        return False
    return bool(astra.use_cuda())


def _require_cuda(device: torch.device | str, where: str) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(
            f"{where}: the ASTRA CUDA backend needs a CUDA device, got {device}; ASTRA has no 3D projectors on the "
            "CPU (for a 2D slice on the CPU use SparseRayTransform, backend 'sparse')"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{where}: torch sees no CUDA device (torch.cuda.is_available() is False); the ASTRA CUDA backend is "
            "GPU-only (for a 2D slice on the CPU use SparseRayTransform, backend 'sparse')"
        )
    index = torch.cuda.current_device() if device.index is None else int(device.index)
    if not 0 <= index < torch.cuda.device_count():
        raise RuntimeError(f"{where}: CUDA device {index} does not exist ({torch.cuda.device_count()} visible)")
    if not astra.use_cuda():
        raise RuntimeError(
            f"{where}: ASTRA cannot use CUDA (astra.use_cuda() is False): the PyPI wheel needs the CUDA 12 runtime "
            "libraries libcudart.so.12 and libcufft.so.11 on LD_LIBRARY_PATH and a working driver"
        )
    return torch.device("cuda", index)


def _lift_2d_vectors(geometry: ProjectionGeometry, v_step: float) -> np.ndarray:
    """2D ``parallel_vec``/``fanflat_vec`` vectors ``(A, 6)`` → 3D ``(A, 12)`` in the plane ``z = 0`` with the
    detector's row step ``(0, 0, v_step)``."""
    vec = geometry.to_vectors().vectors
    out = np.zeros((vec.shape[0], 12))
    out[:, 0:2], out[:, 3:5], out[:, 6:8] = vec[:, 0:2], vec[:, 2:4], vec[:, 4:6]
    out[:, 11] = v_step
    return out


class AstraCudaRayTransform(RayTransform):
    """``T`` with ASTRA's CUDA projectors (GPU only): 3D volumes, batched 2D parallel/fan slices, cone slices.

    Parameters
    ----------
    volume : VolumeGeometry
        ``(D, H, W)`` (3D) or ``(H, W)`` (2D) grid of cubic voxels (mm).
    geometry : ProjectionGeometry
        3D: ``cone_vec``, ``parallel3d_vec``, ``cone`` or ``parallel3d``; 2D: ``parallel``, ``parallel_vec``,
        ``fanflat`` or ``fanflat_vec`` (mm).
    device : torch.device or str
        A CUDA device.
    max_projectors : int
        2D parallel beams: how many per-batch-size projectors to keep (least recently used are deleted).

    Attributes
    ----------
    image_shape, measurement_shape : tuple[int, ...]
        ``volume.shape``; ``geometry.measurement_shape`` (angle-major).
    mode : str
        ``'3d'``, ``'parallel2d'``, ``'fan2d'`` or ``'cone_slice'``.
    slab_z : float or None
        Height (mm) of the slice of a :meth:`cone_slice` operator, else ``None``.
    """

    geometry_kinds = (
        "parallel",
        "parallel_vec",
        "fanflat",
        "fanflat_vec",
        "cone_vec",
        "parallel3d_vec",
        "cone",
        "parallel3d",
    )
    devices = ("cuda",)
    dtypes = (torch.float32,)
    exact_adjoint = False  # ASTRA's voxel-driven BP is the transpose of its ray-driven FP to ~1–3 % only
    auto_ndims = (3,)

    @classmethod
    def available(cls) -> bool:
        """:func:`cuda_available`: torch sees a CUDA device and ASTRA can use CUDA."""
        return cuda_available()

    @classmethod
    def from_geometry(
        cls,
        volume: VolumeGeometry,
        geometry: ProjectionGeometry,
        *,
        device: torch.device | str = "cuda",
        dtype: torch.dtype = torch.float32,
    ) -> AstraCudaRayTransform:
        """The ``astra_cuda`` backend's operator (float32 whatever ``dtype`` says); ``RuntimeError`` on a CPU
        device before ASTRA is touched (calling ASTRA's CUDA code without a GPU crashes the process)."""
        device = torch.device(device)
        if device.type != "cuda":
            raise RuntimeError(
                f"make_ray_transform: backend 'astra_cuda' ({volume.ndim}D) needs a CUDA device, got {device}; "
                "ASTRA has no 3D projectors on the CPU (use a 2D slice with backend 'sparse' there)"
            )
        return cls(volume, geometry, device=device)

    def __init__(
        self,
        volume: VolumeGeometry,
        geometry: ProjectionGeometry,
        *,
        device: torch.device | str = "cuda",
        max_projectors: int = 4,
    ):
        where = "AstraCudaRayTransform"
        self._projectors: collections.OrderedDict = collections.OrderedDict()
        self._closed = False
        if not isinstance(volume, VolumeGeometry) or not isinstance(geometry, ProjectionGeometry):
            raise TypeError(
                f"{where}: needs a VolumeGeometry and a ProjectionGeometry, got "
                f"{type(volume).__name__}, {type(geometry).__name__}"
            )
        if volume.ndim != geometry.ndim:
            raise ValueError(
                f"{where}: {volume.ndim}D volume {volume.shape} with a {geometry.ndim}D geometry "
                f"{geometry.kind!r} (for one slice of a cone beam use AstraCudaRayTransform.cone_slice)"
            )
        if volume.ndim == 3:
            mode = "3d"
        elif geometry.is_parallel:
            mode = "parallel2d"
        else:
            mode = "fan2d"
        self._setup(volume, geometry, mode, None, device, int(max_projectors))

    @classmethod
    def cone_slice(
        cls,
        volume2d: VolumeGeometry,
        z: float,
        geometry: ProjectionGeometry,
        *,
        device: torch.device | str = "cuda",
    ) -> AstraCudaRayTransform:
        """The exact cone-beam sub-geometry of one slice: 3D rays from the true source through a one-voxel-thick
        slab at height ``z`` to the true detector pixels of a single detector row.

        Parameters
        ----------
        volume2d : VolumeGeometry
            2D grid ``(H, W)`` (mm); the slab is one voxel (``volume2d.voxel_size``) thick, centred at ``z``.
        z : float
            Height of the slice centre (mm).
        geometry : ProjectionGeometry
            ``cone_vec`` (or ``cone``) with ``det_shape (1, n_cols)`` — the caller places the row through the slice.
        device : torch.device or str
            A CUDA device.

        Returns
        -------
        AstraCudaRayTransform
            ``image_shape (H, W)``, ``measurement_shape (n_angles, n_cols)``.
        """
        where = "AstraCudaRayTransform.cone_slice"
        if not isinstance(volume2d, VolumeGeometry) or volume2d.ndim != 2:
            raise ValueError(f"{where}: volume2d must be a 2D VolumeGeometry (H, W), got {volume2d!r}")
        if not isinstance(geometry, ProjectionGeometry) or geometry.kind not in ("cone_vec", "cone"):
            kind = getattr(geometry, "kind", type(geometry).__name__)
            raise ValueError(f"{where}: geometry must be a one-row 'cone_vec' (or 'cone') geometry, got {kind!r}")
        if geometry.det_shape[0] != 1:
            raise ValueError(
                f"{where}: geometry.det_shape must be (1, n_cols) (one detector row through the slice), "
                f"got {geometry.det_shape}"
            )
        z = float(z)
        if not np.isfinite(z):
            raise ValueError(f"{where}: z must be finite (mm), got {z}")
        self = cls.__new__(cls)
        self._projectors = collections.OrderedDict()
        self._closed = False
        self._setup(volume2d, geometry, "cone_slice", z, device, 1)
        return self

    # ------------------------------------------------------------------ construction
    def _setup(self, volume, geometry, mode, z, device, max_projectors):
        self.device = _require_cuda(device, "AstraCudaRayTransform")
        self.dtype = torch.float32
        self.volume = volume
        self.geometry = geometry
        self.mode = mode
        self.slab_z = z
        self.angles = geometry.angles
        self.image_shape = tuple(volume.shape)
        self.max_projectors = max(1, max_projectors)
        if mode == "cone_slice":
            self.measurement_shape = (geometry.n_angles, geometry.det_shape[1])
        else:
            self.measurement_shape = tuple(geometry.measurement_shape)
        h = volume.voxel_size
        if mode == "3d":
            self._vec_geometry = geometry.to_vectors()
        elif mode == "parallel2d":
            self._vec_geometry = ProjectionGeometry(
                "parallel3d_vec", (1, geometry.det_shape[0]), vectors=_lift_2d_vectors(geometry, h)
            )
        else:
            if mode == "fan2d":
                slab_geometry = ProjectionGeometry(
                    "cone_vec", (1, geometry.det_shape[0]), vectors=_lift_2d_vectors(geometry, h)
                )
                slab_z = 0.0
            else:
                slab_geometry, slab_z = geometry.to_vectors(), z
            self._vec_geometry = slab_geometry
            self._slab_z = slab_z
            cx, cy = volume.center
            self._slab_volume = VolumeGeometry((1, *volume.shape), h, (cx, cy, slab_z))
            # Geometry of the torch back-projection, computed once on the device.
            self._views = DetectorViews(slab_geometry, self.device)
            self._points = grid_points(volume, self.device, slab_z)

    def _projector(self, n_slices: int = 1) -> int:
        """The persistent ASTRA projector for this operator (2D parallel: for a batch of ``n_slices``)."""
        key = n_slices if self.mode == "parallel2d" else 0
        pid = self._projectors.get(key)
        if pid is not None:
            self._projectors.move_to_end(key)
            return pid
        if self.mode == "3d":
            vol_geom, proj_geom = self.volume.to_astra(), self._vec_geometry.to_astra()
        elif self.mode == "parallel2d":
            h = self.volume.voxel_size
            cx, cy = self.volume.center
            stack = VolumeGeometry((n_slices, *self.volume.shape), h, (cx, cy, 0.0))
            # Detector row b at the height of slice b: the lifted vectors have v = (0, 0, h) and z = 0 centres.
            geo = ProjectionGeometry(
                "parallel3d_vec", (n_slices, self.measurement_shape[1]), vectors=self._vec_geometry.vectors
            )
            vol_geom, proj_geom = stack.to_astra(), geo.to_astra()
        else:
            vol_geom, proj_geom = self._slab_volume.to_astra(), self._vec_geometry.to_astra()
        with _LOCK:
            pid = astra.create_projector("cuda3d", proj_geom, vol_geom)
        self._projectors[key] = pid
        while len(self._projectors) > self.max_projectors:
            _, old = self._projectors.popitem(last=False)
            with _LOCK:
                astra.projector3d.delete(old)
        return pid

    # ------------------------------------------------------------------ ASTRA calls
    def _call(self, direction: str, pid: int, vol: torch.Tensor, proj: torch.Tensor) -> None:
        """One ``direct_FP3D``/``direct_BP3D`` on CUDA tensors (validated: ASTRA does not raise on failure)."""
        for name, t in (("volume", vol), ("projections", proj)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device != self.device:
                raise RuntimeError(
                    f"internal: {name} buffer must be contiguous float32 on {self.device}, got "
                    f"{t.dtype}, contiguous={t.is_contiguous()}, {t.device}"
                )
        # ASTRA runs on its own streams; make the producer of the input visible to it first.
        torch.cuda.current_stream(self.device).synchronize()
        # torch exports a CUDA tensor through DLPack only while its device is the current one.
        with _LOCK, torch.cuda.device(self.device):
            if _ASTRA_GPU[0] != self.device.index:
                astra.set_gpu_index(self.device.index)
                _ASTRA_GPU[0] = self.device.index
            if direction == "FP":
                astra.experimental.direct_FP3D(pid, vol, proj)
            else:
                astra.experimental.direct_BP3D(pid, vol, proj)

    def _check_input(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("AstraCudaRayTransform: the operator was closed")
        if t.device != self.device:
            raise ValueError(f"AstraCudaRayTransform lives on {self.device}, but the {what} is on {t.device}")
        return t.detach().to(torch.float32).contiguous()

    def _forward_raw(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_input(x, "image")
        b = x.shape[0]
        if self.mode == "parallel2d":
            out = torch.zeros((b, *self.measurement_shape), dtype=torch.float32, device=self.device)
            self._call("FP", self._projector(b), x, out)
            return out
        if self.mode == "3d":
            n_angles, n_rows, n_cols = self.measurement_shape
            out = torch.empty((b, n_angles, n_rows, n_cols), dtype=torch.float32, device=self.device)
            buf = torch.empty((n_rows, n_angles, n_cols), dtype=torch.float32, device=self.device)
            pid = self._projector()
            for i in range(b):
                buf.zero_()
                self._call("FP", pid, x[i], buf)
                out[i] = buf.permute(1, 0, 2)
            return out
        # fan2d / cone_slice: slice by slice through the one-row slab projector; (1, A, n) is ASTRA's layout.
        out = torch.zeros((b, *self.measurement_shape), dtype=torch.float32, device=self.device)
        pid = self._projector()
        for i in range(b):
            self._call("FP", pid, x[i : i + 1], out[i : i + 1])
        return out

    def _adjoint_raw(self, y: torch.Tensor) -> torch.Tensor:
        y = self._check_input(y, "sinogram")
        b = y.shape[0]
        if self.mode == "parallel2d":
            out = torch.zeros((b, *self.image_shape), dtype=torch.float32, device=self.device)
            self._call("BP", self._projector(b), out, y)
            return out
        if self.mode == "3d":
            out = torch.zeros((b, *self.image_shape), dtype=torch.float32, device=self.device)
            pid = self._projector()
            for i in range(b):
                self._call("BP", pid, out[i], y[i].permute(1, 0, 2).contiguous())
            return out
        n_angles, n_cols = self.measurement_shape
        x = slab_adjoint_backprojection(
            self.volume,
            self._slab_z,
            self._vec_geometry,
            y.reshape(b, n_angles, 1, n_cols),
            views=self._views,
            points=self._points,
        )
        return x.reshape(b, *self.image_shape)

    # ------------------------------------------------------------------ views
    def subset(self, angle_indices: Sequence[int]) -> AstraCudaRayTransform:
        """The operator for ``angle_indices`` (in that order): a new geometry and new projectors."""
        geometry = self.geometry.subset(angle_indices)  # validates the indices
        if self.mode == "cone_slice":
            return AstraCudaRayTransform.cone_slice(self.volume, self.slab_z, geometry, device=self.device)
        return AstraCudaRayTransform(self.volume, geometry, device=self.device, max_projectors=self.max_projectors)

    def to(self, device: torch.device | str) -> AstraCudaRayTransform:
        """The same operator on another CUDA device (``'cpu'`` raises: use the sparse backend for 2D there)."""
        device = torch.device(device)
        if device.type != "cuda":
            raise RuntimeError(
                f"AstraCudaRayTransform.to({str(device)!r}): the ASTRA CUDA backend is GPU-only; for a 2D slice on "
                "the CPU build SparseRayTransform(volume, geometry) (make_ray_transform(..., backend='sparse'))"
            )
        index = torch.cuda.current_device() if device.index is None and torch.cuda.is_available() else device.index
        if index == self.device.index:
            return self
        if self.mode == "cone_slice":
            return AstraCudaRayTransform.cone_slice(self.volume, self.slab_z, self.geometry, device=device)
        return AstraCudaRayTransform(self.volume, self.geometry, device=device, max_projectors=self.max_projectors)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Delete the ASTRA projectors now (also done when the operator is garbage-collected)."""
        projectors = getattr(self, "_projectors", None)
        if projectors:
            try:
                with _LOCK:
                    for pid in projectors.values():
                        astra.projector3d.delete(pid)
            except Exception:  # noqa: BLE001 - interpreter shutdown: ASTRA may already be gone
                pass
            projectors.clear()
        self._closed = True

    def __enter__(self) -> AstraCudaRayTransform:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    def __repr__(self) -> str:
        z = f", z={self.slab_z:g}" if self.slab_z is not None else ""
        return (
            f"AstraCudaRayTransform({self.mode}, {self.geometry.kind}{z}, image_shape={self.image_shape}, "
            f"measurement_shape={self.measurement_shape}, device={self.device})"
        )
