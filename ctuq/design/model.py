"""``DesignModel``: the linear-Gaussian model one design step works on.

Candidates are the angles of one ray transform ``op`` (``n`` angles × ``k`` detector pixels, angle-major rows);
the image prior is ``x = L (s ⊙ w)``, ``w ~ N(0, a⁻¹ I)`` with a factor ``L`` from :mod:`ctuq.design.factors`
(or a :class:`ctuq.linearize.LinearizedNetwork`), so ``K = L diag(s)² Lᵀ / a``; the noise is ``N(0, σ² I)`` in the
units of the measurements the model is given in (scaled data units for the DIP).

The features of any set of candidate blocks are the core's :class:`ctuq.inference.LinearizedFeatures`
``Ψ = T_B L diag(s)`` with ``T_B = op.subset(B)`` as output map, so the posterior object, the sampler and the
g-prior of :mod:`ctuq.inference` (and its :mod:`~ctuq.inference.priors`) apply unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ctuq.design.factors import (
    BlockRowStore,
    DenseFactor,
    IdentityFactor,
    MaternFactor,
    block_rows,
    kernel_apply,
    project_rows,
)
from ctuq.inference import LinearizedFeatures, ScaledFeatures

__all__ = ["DesignModel"]


@dataclasses.dataclass
class DesignModel:
    """Candidates, prior factor and hyperparameters of a design (module docstring).

    Attributes
    ----------
    op : RayTransform
        All candidate angles (``n_candidates`` blocks of ``k`` rows); needs ``subset`` (sparse backend).
    factor : object
        ``L`` (``jvp``/``vjp`` on rows, ``d``, ``d_out``).
    scales : torch.Tensor
        ``s`` ``(d,)`` (the weight prior's for the DIP, ``design.weight_prior``: the g-prior by default; ones
        otherwise).
    a, sigma2 : float
        Prior precision and noise variance.
    image_prior : str
        Which image prior built it (``isotropic``, ``matern``, ``dip``; ``design.prior``), for records
        (``kind`` in :meth:`summary`).
    info : dict
        What the builder chose (lengthscale, evidence, how ``a`` was set, ...), plain values.
    image_scale : float
        Images ``L(s ⊙ w)`` are in units of ``image_scale ×`` the scan's image units (the DIP scale).
    row_store : BlockRowStore, optional
        Keeps the projected rows ``T^β L`` of the blocks asked for (a network factor through VJPs; shared by the
        copies :meth:`with_updates` makes, so a g-prior refresh reuses them). Whoever builds the model owns it
        and replaces it when ``L`` changes.
    """

    op: object
    factor: object
    scales: torch.Tensor
    a: float
    sigma2: float
    image_prior: str = "custom"
    info: dict = dataclasses.field(default_factory=dict)
    image_scale: float = 1.0
    row_store: BlockRowStore | None = None

    def __post_init__(self):
        self.scales = self.scales.detach().to(self.factor.device, self.factor.dtype)
        if tuple(self.scales.shape) != (self.factor.d,):
            raise ValueError(f"DesignModel: scales must have shape ({self.factor.d},), got {tuple(self.scales.shape)}")
        self._cache: dict[tuple, object] = {}

    # ------------------------------------------------------------------------------------------ sizes
    @property
    def n_candidates(self) -> int:
        """Candidate angles (blocks) of :attr:`op`."""
        return int(self.op.n_angles)

    @property
    def k(self) -> int:
        """Rows (detector pixels) per candidate."""
        return int(self.op.c // self.op.n_angles)

    @property
    def c(self) -> int:
        """Rows of all candidates (``n_candidates · k``)."""
        return int(self.op.c)

    @property
    def d(self) -> int:
        """Weights of the factor ``L`` (columns of ``Ψ``)."""
        return int(self.factor.d)

    @property
    def d_x(self) -> int:
        """Pixels of the image."""
        return int(self.op.d_x)

    def rows(self, blocks: Sequence[int]) -> torch.Tensor:
        """Flat row indices of candidate ``blocks`` (in that order)."""
        return block_rows(blocks, self.k)

    def subset(self, blocks: Sequence[int]):
        """``T_B`` for candidate ``blocks`` (cached for the last few sets: a step reuses the chosen set's)."""
        key = tuple(int(b) for b in blocks)
        if key not in self._cache:
            if len(self._cache) > 8:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = self.op.subset(list(key))
        return self._cache[key]

    def with_updates(self, **changes) -> DesignModel:
        """A copy with some fields replaced (``scales``, ``a``, ``sigma2``, ``factor``, ``info``)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------------ products
    def features(self, blocks: Sequence[int] | None = None) -> LinearizedFeatures:
        """``Ψ = T_B L diag(s)`` for candidate ``blocks`` (all when ``None``): the core's feature operator."""
        op = self.op if blocks is None else self.subset(blocks)
        return ScaledFeatures(
            LinearizedFeatures(self.factor, op.forward_flat, op.adjoint_flat, n_outputs=op.c), self.scales
        )

    def kernel(self, X: torch.Tensor) -> torch.Tensor:
        """``K x`` for image rows ``X`` ``(B, d_x)`` → ``(B, d_x)`` (factor dtype)."""
        return kernel_apply(self.factor, self.scales, self.a, X.to(self.factor.device, self.factor.dtype))

    def images(self, W: torch.Tensor) -> torch.Tensor:
        """``L (s ⊙ w)`` for weight rows ``W`` ``(B, d)`` → images ``(B, d_x)`` (model units)."""
        return self.factor.jvp(W.to(self.factor.device, self.factor.dtype) * self.scales)

    def weight_space(self, max_bytes: int = 1 << 30) -> bool:
        """Whether the design keeps the chosen rows ``Ψ_τ`` (``c_t × d``; at most all candidate rows, bounded by
        ``max_bytes``): for an assembled Jacobian always, for a network when they fit; never for the isotropic
        and Matérn factors (their kernel products are cheaper than rows of ``d ≥ d_x`` weights)."""
        if isinstance(self.factor, (IdentityFactor, MaternFactor)):
            return False
        if isinstance(self.factor, DenseFactor):
            return True
        return self.c * self.d * 4 <= max_bytes

    def projected_rows(self, blocks: Sequence[int]) -> torch.Tensor:
        """``T_B L`` ``(c_B, d)`` dense (factor dtype; may be a view of kept rows: not to be written): for an
        assembled Jacobian from the blocks it keeps projected (:meth:`DenseFactor.projected_blocks`), with a
        :attr:`row_store` from it, else :func:`project_rows` (sparse products or VJPs)."""
        if isinstance(self.factor, DenseFactor):
            A = self.factor.projected_blocks(self.op, blocks)
            if A is not None:
                return A
        elif self.row_store is not None:
            return self.row_store.rows(self.factor, self.op, blocks)
        return project_rows(self.factor, self.subset(blocks)).to(self.factor.dtype)

    def weight_rows(self, blocks: Sequence[int]) -> torch.Tensor:
        """``Ψ_B = T_B L diag(s)`` ``(c_B, d)`` dense, in the factor's dtype and device."""
        return self.projected_rows(blocks) * self.scales

    def block_kernel(self, blocks_a: Sequence[int], blocks_b: Sequence[int], chunk: int = 512) -> torch.Tensor:
        """``T_A K T_Bᵀ`` ``(c_A, c_B)`` float64 (CPU).

        Sparse-sparse for the isotropic prior, through ``T L`` rows for dense and network factors, else ``c_B``
        kernel products in chunks.
        """
        unit = bool((self.scales == 1).all())
        if isinstance(self.factor, IdentityFactor) and unit:
            op_a, op_b = self.subset(blocks_a), self.subset(blocks_b)
            return torch.from_numpy((op_a.matrix @ op_b.matrix.T).toarray()) / self.a
        if not isinstance(self.factor, MaternFactor):
            Fa = self.projected_rows(blocks_a).double() * self.scales.double()
            same = list(blocks_a) == list(blocks_b)
            Fb = Fa if same else self.projected_rows(blocks_b).double() * self.scales.double()
            return (Fa @ Fb.T).cpu() / self.a
        op_a, op_b = self.subset(blocks_a), self.subset(blocks_b)
        out = torch.empty((op_a.c, op_b.c), dtype=torch.float64)
        for lo in range(0, op_b.c, chunk):
            hi = min(op_b.c, lo + chunk)
            E = torch.zeros((hi - lo, op_b.c), dtype=op_b.dtype, device=op_b.device)
            E[torch.arange(hi - lo), torch.arange(lo, hi)] = 1.0
            out[:, lo:hi] = op_a.forward_flat(self.kernel(op_b.adjoint_flat(E)).to(op_a.dtype)).double().T.cpu()
        return 0.5 * (out + out.T) if list(blocks_a) == list(blocks_b) else out

    def prior_blocks(self, chunk: int = 8) -> torch.Tensor:
        """Prior blocks ``T^β K T^βᵀ`` of every candidate ``(n, k, k)`` float64 (the exact route's start)."""
        n, k = self.n_candidates, self.k
        out = torch.empty((n, k, k), dtype=torch.float64)
        for lo in range(0, n, chunk):
            idx = list(range(lo, min(n, lo + chunk)))
            if isinstance(self.factor, MaternFactor) or (
                isinstance(self.factor, IdentityFactor) and bool((self.scales == 1).all())
            ):
                full = self.block_kernel(idx, idx)
                for j, i in enumerate(idx):
                    out[i] = full[j * k : (j + 1) * k, j * k : (j + 1) * k]
            else:  # only the diagonal blocks: (T^β L s)(T^β L s)ᵀ / a, batched
                F = (self.projected_rows(idx).double() * self.scales.double()).cpu()
                F = F.reshape(len(idx), k, -1)
                out[lo : lo + len(idx)] = F @ F.mT / self.a
        return out

    def column_sq_norms(self, blocks: Sequence[int], cache: dict | None = None) -> torch.Tensor:
        """``‖(T_B L)_{:,i}‖²`` ``(d,)`` float64 over the rows of ``blocks``: the exact g-prior's sums (``c_B``
        VJPs for a network, a slice of the kept ``T Φ`` for a dense Jacobian).

        ``cache`` (a dict, block → its ``(d,)`` sums, filled here) keeps each block's sums across calls. It is valid
        while ``L`` stays the same — the caller owns it and empties it when ``L`` changes — and lets a refresh
        after ``t`` acquisitions project only the blocks acquired since the last one instead of all chosen blocks
        (the ``small`` U-Net: one VJP per row). The sums are added block by block in the order of ``blocks``.
        """
        blocks = [int(b) for b in blocks]
        cache = {} if cache is None else cache
        missing = list(dict.fromkeys(b for b in blocks if b not in cache))
        for lo in range(0, len(missing), 8):
            part = missing[lo : lo + 8]
            sq = self.projected_rows(part).double().pow(2).reshape(len(part), self.k, self.d).sum(1).cpu()
            cache.update(zip(part, sq))
        out = torch.zeros(self.d, dtype=torch.float64)
        for b in blocks:
            out += cache[b]
        return out

    def summary(self) -> dict:
        """Plain numbers for design.json."""
        s = self.scales
        return {
            "kind": self.image_prior,
            "n_candidates": self.n_candidates,
            "k": self.k,
            "d": self.d,
            "d_x": self.d_x,
            "a": float(self.a),
            "sigma2": float(self.sigma2),
            "image_scale": float(self.image_scale),
            "zero_scales": int((s == 0).sum()),
            **{k: v for k, v in self.info.items() if isinstance(v, (int, float, str, bool, type(None)))},
        }
