"""Image-space prior factors ``L`` of the design priors: ``x = L (s ⊙ w)``, ``w ~ N(0, a⁻¹ I)``, so
``K = L diag(s)² Lᵀ / a`` (``d_x × d_x``).

A factor has the interface of :class:`ctuq.linearize.LinearizedNetwork` that the inference core uses
(``d``, ``d_out``, ``dtype``, ``device``, ``jvp(W)`` = ``L W`` on rows ``(B, d) → (B, d_out)``, ``vjp(R)`` = ``Lᵀ R``
on rows ``(B, d_out) → (B, d)``), so :class:`ctuq.inference.LinearizedFeatures` builds the features
``Ψ = T L diag(s)`` of any of them with the ray transform as its output map, and the posterior object, the
sampler and the solvers see one kind of feature operator for every prior:

* :class:`IdentityFactor` — the isotropic prior ``K = I/a`` (``d = d_x``);
* :class:`MaternFactor` — Matérn-½ (exponential) covariance ``k(r) = exp(−r/ℓ)`` over pixel positions, through the
  symmetric square root of its circulant embedding (``d = 4 d_x``, products by FFT);
* :class:`DenseFactor` — an assembled Jacobian ``Φ`` (``d_x × d``) of a small network (the linearised DIP once
  ``d`` JVPs have assembled it: every later product is a GEMM of the core's :class:`ctuq.inference.DenseFeatures`);
* a :class:`ctuq.linearize.LinearizedNetwork` itself (the linearised DIP through JVPs/VJPs; large networks).

Besides ``jvp``/``vjp`` the design needs :func:`kernel_apply` (``K x`` on image rows) and :func:`project_rows`
(``T L`` as a dense ``c_B × d`` matrix for a few rows); both have generic implementations and cheap overrides.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ctuq.inference import DenseFeatures
from ctuq.memory import Budget, memory_budget

__all__ = [
    "IdentityFactor",
    "MaternFactor",
    "DenseFactor",
    "BlockRowStore",
    "kernel_apply",
    "kernel_from_rows",
    "project_rows",
    "sparse_rows",
    "matern_matrix",
    "block_rows",
]


def block_rows(blocks, k: int) -> torch.Tensor:
    """Flat row indices ``(len(blocks)·k,)`` of candidate ``blocks`` (angle-major, ``k`` rows each), in that order."""
    b = torch.as_tensor([int(x) for x in blocks], dtype=torch.long)
    return (b[:, None] * k + torch.arange(k)[None, :]).reshape(-1)


class _Factor:
    """Common bookkeeping: sizes, dtype/device and product counters (like ``LinearizedNetwork``)."""

    d: int
    d_out: int
    output_shape: tuple[int, ...]

    def __init__(self, image_shape, d: int, dtype=torch.float32, device="cpu"):
        self.output_shape = (1, 1, *tuple(int(s) for s in image_shape))
        self.d_out = int(math.prod(image_shape))
        self.d = int(d)
        self.dtype = dtype
        self.device = torch.device(device)
        self.n_jvp = 0
        self.n_vjp = 0

    @property
    def image_shape(self) -> tuple[int, ...]:
        """Shape of the images ``L w``."""
        return tuple(self.output_shape[2:])

    def _rows(self, X: torch.Tensor, width: int, what: str) -> torch.Tensor:
        if X.ndim != 2 or X.shape[1] != width:
            raise ValueError(f"{type(self).__name__}.{what}: expected (batch, {width}), got {tuple(X.shape)}")
        return X.to(self.device, self.dtype)

    def jvp(self, W: torch.Tensor) -> torch.Tensor:
        """``L w`` for rows ``W`` ``(B, d)`` → images ``(B, d_x)``."""
        W = self._rows(W, self.d, "jvp")
        self.n_jvp += W.shape[0]
        return self._jvp(W)

    def vjp(self, R: torch.Tensor) -> torch.Tensor:
        """``Lᵀ r`` for image rows ``R`` ``(B, d_x)`` → ``(B, d)``."""
        R = self._rows(R, self.d_out, "vjp")
        self.n_vjp += R.shape[0]
        return self._vjp(R)


class IdentityFactor(_Factor):
    """``L = I``: the isotropic image prior ``K = I/a`` (one weight per pixel)."""

    def __init__(self, image_shape, dtype=torch.float32, device="cpu"):
        super().__init__(image_shape, math.prod(image_shape), dtype, device)

    def _jvp(self, W):
        return W

    def _vjp(self, R):
        return R


def _torus_distances(shape, grid) -> np.ndarray:
    """Euclidean distances (pixels) on a torus ``grid`` from pixel 0, with wrap-around."""
    axes = [np.minimum(np.arange(g), g - np.arange(g)).astype(np.float64) for g in grid]
    mesh = np.meshgrid(*axes, indexing="ij")
    return np.sqrt(sum(m**2 for m in mesh))


class MaternFactor(_Factor):
    """Matérn-½ prior ``K_ij = exp(−‖p_i − p_j‖/ℓ)`` over pixel centres ``p`` (pixel units) by circulant embedding.

    The image grid ``(H, W)`` is embedded in a torus ``(2H, 2W)``; there the covariance is circulant,
    ``C = F⁻¹ diag(λ) F`` with ``λ = FFT(k(torus distances))`` real and even, and ``C^(1/2) = F⁻¹ diag(√λ) F`` is a
    real symmetric matrix. With ``P`` the crop to the image, ``L = P C^(1/2)`` (``d = 4 d_x`` weights) gives
    ``L Lᵀ = P C Pᵀ`` = the Matérn matrix on the image exactly, as long as ``λ ≥ 0``. That holds for ``ℓ`` up to
    about a quarter of the image side (measured on 32²: no negative eigenvalue for ``ℓ ≤ 8``); for longer
    lengthscales the negative eigenvalues are set to zero (the nearest PSD circulant) and :attr:`clipped` reports
    the fraction of ``Σ|λ|`` removed (32²: 0.35 % at ``ℓ = 16``, 1.6 % at ``ℓ = 32``, 2.2 % at ``ℓ = 64``).

    Parameters
    ----------
    image_shape : (int, int)
        ``(H, W)``.
    lengthscale : float
        ``ℓ`` in pixels (> 0).
    """

    def __init__(self, image_shape, lengthscale: float, dtype=torch.float32, device="cpu"):
        image_shape = tuple(int(s) for s in image_shape)
        if len(image_shape) != 2:
            raise ValueError(f"MaternFactor: a 2D image shape is needed, got {image_shape}")
        if not (lengthscale > 0 and math.isfinite(lengthscale)):
            raise ValueError(f"MaternFactor: lengthscale must be positive, got {lengthscale}")
        self.grid = (2 * image_shape[0], 2 * image_shape[1])
        super().__init__(image_shape, math.prod(self.grid), dtype, device)
        self.lengthscale = float(lengthscale)
        lam = np.fft.rfft2(np.exp(-_torus_distances(image_shape, self.grid) / self.lengthscale)).real
        self.clipped = float(np.abs(np.minimum(lam, 0)).sum() / np.abs(lam).sum())
        lam = np.maximum(lam, 0.0)
        self._lam = torch.as_tensor(lam, dtype=dtype, device=self.device)
        self._sqrt = self._lam.sqrt()

    def _circ(self, X: torch.Tensor, spectrum: torch.Tensor) -> torch.Tensor:
        # X (B, 2H, 2W) real → F⁻¹ diag(spectrum) F X, real (spectrum is even).
        return torch.fft.irfft2(torch.fft.rfft2(X) * spectrum, s=self.grid)

    def _pad(self, R: torch.Tensor) -> torch.Tensor:
        H, W = self.image_shape
        out = torch.zeros((R.shape[0], *self.grid), dtype=R.dtype, device=R.device)
        out[:, :H, :W] = R.reshape(-1, H, W)
        return out

    def _crop(self, X: torch.Tensor) -> torch.Tensor:
        H, W = self.image_shape
        return X[:, :H, :W].reshape(X.shape[0], -1)

    def _jvp(self, W):
        return self._crop(self._circ(W.reshape(-1, *self.grid), self._sqrt))

    def _vjp(self, R):
        return self._circ(self._pad(R), self._sqrt).reshape(R.shape[0], -1)

    def covariance_apply(self, R: torch.Tensor) -> torch.Tensor:
        """``P C Pᵀ r`` for image rows ``(B, d_x)`` (one FFT pair instead of two)."""
        R = self._rows(R, self.d_out, "covariance_apply")
        return self._crop(self._circ(self._pad(R), self._lam))


class DenseFactor(_Factor):
    """``L = Φ`` given as a dense ``(d_x, d)`` matrix (an assembled network Jacobian).

    ``Φ`` is kept in float32 (``d_x·d`` floats; 328 MB for the CPU-demo U-Net at 128²) as the core's dense feature
    operator (:class:`ctuq.inference.DenseFeatures`, :attr:`dense`): every product is its GEMM.
    :meth:`projected_blocks` keeps ``T^β Φ`` of every candidate block it was asked for, so a block is projected
    once however often a design needs its rows.
    """

    def __init__(self, matrix: torch.Tensor, image_shape):
        if matrix.ndim != 2 or matrix.shape[0] != math.prod(image_shape):
            raise ValueError(
                f"DenseFactor: matrix must be (d_x = {math.prod(image_shape)}, d), got {tuple(matrix.shape)}"
            )
        super().__init__(image_shape, matrix.shape[1], matrix.dtype, matrix.device)
        self.dense = DenseFeatures(matrix)
        # (operator, the store of its projected blocks or None when T Φ does not fit)
        self._projection: tuple[object, BlockRowStore | None] | None = None

    @property
    def matrix(self) -> torch.Tensor:
        """``Φ`` ``(d_x, d)``."""
        return self.dense.matrix

    def projected_blocks(self, op, blocks) -> torch.Tensor | None:
        """``T_B Φ`` ``(len(blocks)·k, d)`` for candidate ``blocks`` of the operator ``op`` (``k`` rows per angle).

        A design asks for the rows of the same blocks again and again (the chosen angles at every g-prior refresh,
        each acquired block once more at its step), so each block is projected once — one sparse × dense product
        for all blocks not yet kept — into a :class:`BlockRowStore` with room for every candidate of ``op`` (a
        design of 40 out of 200 angles projects 40). ``None`` when its ``c·d`` floats would not fit the
        :data:`~ctuq.memory.Budget.DESIGN_ROWS` budget; callers then project the rows they need each time.
        """
        if self._projection is None or self._projection[0] is not op:
            store = BlockRowStore.if_fits(op.n_angles, op.c // op.n_angles, self.d, self.dtype, self.device)
            self._projection = (op, store)
        store = self._projection[1]
        return None if store is None else store.rows(self, op, blocks, chunk=None)

    def _jvp(self, W):
        return self.dense.matvec(W)

    def _vjp(self, R):
        return self.dense.rmatvec(R)


class BlockRowStore:
    """Keeps the projected rows ``T^β L`` ``(k, d)`` of up to ``capacity`` candidate blocks while ``L`` stays the same.

    For a network through VJPs (no assembled Jacobian) a row of ``T L`` costs one VJP, and a design with a
    refreshed g-prior asks for the rows of all chosen blocks at every refresh (the measurement covariance
    ``C_τ = T^τ K T^τᵀ + σ²I`` under the new scales); :meth:`DenseFactor.projected_blocks` keeps an assembled
    Jacobian's rows in one with room for every candidate. Blocks are kept in the order they are first asked for, so
    the chosen blocks of a design (pilot first, then each acquired angle) come back as a view of the first slots, not
    a copy. When the store is full, rows of further blocks are projected and returned without being kept.

    Parameters
    ----------
    capacity : int
        Blocks kept at most (the pilot plus the acquisitions of a design); ``capacity·k·d`` floats are reserved
        with ``torch.empty`` (only filled slots take memory).
    k, d : int
        Rows per block and columns (weights).
    dtype, device
        Of the kept rows (the factor's).
    """

    def __init__(self, capacity: int, k: int, d: int, dtype=torch.float32, device="cpu"):
        if capacity < 1:
            raise ValueError(f"BlockRowStore: capacity must be a positive number of blocks, got {capacity}")
        self.k, self.d = int(k), int(d)
        self.buf = torch.empty((int(capacity) * self.k, self.d), dtype=dtype, device=device)
        self.slots: dict[int, int] = {}  # block → its slot
        self.n_projected = 0  # blocks projected through the factor (kept or not): the VJP count / k

    @property
    def capacity(self) -> int:
        """Blocks the store can keep."""
        return self.buf.shape[0] // self.k

    @staticmethod
    def fits(capacity: int, k: int, d: int, element_size: int, device) -> bool:
        """Whether ``capacity·k·d`` numbers of ``element_size`` bytes fit the
        :data:`~ctuq.memory.Budget.DESIGN_ROWS` budget of ``device`` (always, where the free memory is unknown)."""
        budget = memory_budget(Budget.DESIGN_ROWS, device)
        return budget is None or capacity * k * d * element_size <= budget

    @classmethod
    def if_fits(cls, capacity: int, k: int, d: int, dtype=torch.float32, device="cpu") -> BlockRowStore | None:
        """A store of ``capacity`` blocks of ``k × d`` rows, or ``None`` when they would not :meth:`fit <fits>`."""
        size = torch.empty((), dtype=dtype).element_size()
        return cls(capacity, k, d, dtype, device) if cls.fits(capacity, k, d, size, device) else None

    def rows(self, factor, op, blocks, chunk: int | None = 8) -> torch.Tensor:
        """``T_B L`` ``(len(blocks)·k, d)`` for candidate ``blocks`` of ``op``: the blocks not kept yet are projected
        ``chunk`` blocks per batch of VJPs (``None``: all in one product, for an assembled ``L``)."""
        blocks = [int(b) for b in blocks]
        missing = list(dict.fromkeys(b for b in blocks if b not in self.slots))
        chunk = max(1, len(missing)) if chunk is None else chunk
        room = self.capacity - len(self.slots)
        if len(missing) > room:  # they do not all fit: this request keeps nothing new
            extra = {}
            for lo in range(0, len(missing), chunk):
                part = missing[lo : lo + chunk]
                R = project_rows(factor, op.subset(part)).to(self.buf.dtype)
                extra.update(zip(part, R.reshape(len(part), self.k, self.d)))
            self.n_projected += len(missing)
            return torch.cat([extra[b] if b in extra else self._slot_rows(b) for b in blocks])
        for lo in range(0, len(missing), chunk):
            part = missing[lo : lo + chunk]
            first = len(self.slots)
            self.buf[first * self.k : (first + len(part)) * self.k] = project_rows(factor, op.subset(part))
            self.slots.update((b, first + j) for j, b in enumerate(part))
            self.n_projected += len(part)
        idx = [self.slots[b] for b in blocks]
        if idx == list(range(len(idx))):
            return self.buf[: len(idx) * self.k]
        return self.buf[block_rows(idx, self.k).to(self.buf.device)]

    def _slot_rows(self, b: int) -> torch.Tensor:
        i = self.slots[b]
        return self.buf[i * self.k : (i + 1) * self.k]


def sparse_rows(op) -> torch.Tensor:
    """``T`` of a :class:`~ctuq.operators.SparseRayTransform` as a torch CSR tensor ``(c, d_x)`` on its device."""
    return op.csr


def kernel_apply(factor, scales: torch.Tensor, a: float, X: torch.Tensor) -> torch.Tensor:
    """``K x = L diag(s)² Lᵀ x / a`` for image rows ``X`` ``(B, d_x)`` → ``(B, d_x)``.

    One VJP and one JVP per row in general; one FFT pair for a Matérn factor with unit scales; ``X/a`` for the
    identity with unit scales.
    """
    if isinstance(factor, IdentityFactor) and bool((scales == 1).all()):
        return X.to(factor.dtype) / a
    if isinstance(factor, MaternFactor) and bool((scales == 1).all()):
        return factor.covariance_apply(X) / a
    return kernel_from_rows(factor, scales, a, factor.vjp(X))


def kernel_from_rows(factor, scales: torch.Tensor, a: float, R: torch.Tensor) -> torch.Tensor:
    """``K Tᵀ = L diag(s)² Rᵀ / a`` from projected rows ``R = T L`` ``(B, d)`` → image rows ``(B, d_x)``: the second
    half of :func:`kernel_apply` (one JVP per row), for rows already projected (kept by a :class:`BlockRowStore`)."""
    return factor.jvp(R * scales.pow(2)) / a


def project_rows(factor, op) -> torch.Tensor:
    """``T L`` as a dense ``(c, d)`` matrix for the (few-row) operator ``op`` (float32).

    Sparse-first for dense and identity factors (``T`` has ~``√d_x`` non-zeros per row); otherwise ``c`` VJPs.
    """
    T = sparse_rows(op)
    if isinstance(factor, DenseFactor):
        return (T @ factor.matrix).to(factor.dtype)
    if isinstance(factor, IdentityFactor):
        return T.to_dense().to(factor.dtype)
    E = torch.eye(op.c, dtype=op.dtype, device=op.device)
    return factor.vjp(op.adjoint_flat(E))


def matern_matrix(image_shape, lengthscale: float) -> np.ndarray:
    """The dense Matérn-½ matrix ``exp(−‖p_i − p_j‖/ℓ)`` over the pixels of ``image_shape`` (tests; float64)."""
    ii, jj = np.meshgrid(*(np.arange(s) for s in image_shape), indexing="ij")
    p = np.stack([ii.ravel(), jj.ravel()], 1).astype(np.float64)
    dist = np.sqrt(((p[:, None, :] - p[None, :, :]) ** 2).sum(-1))
    return np.exp(-dist / lengthscale)
