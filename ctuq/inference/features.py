"""Feature operators ``Ψ`` (``c × d``) of the Gaussian linear model ``ỹ = Ψ w + ε`` (DESIGN.md §1).

The inference core sees Ψ only through batched products on rows:

* ``matvec(W)``: ``W`` ``(B, d)`` → ``Ψ W`` as ``(B, c)`` (one JVP per row for a network),
* ``rmatvec(R)``: ``R`` ``(B, c)`` → ``Ψᵀ R`` as ``(B, d)`` (one VJP per row).

Both run in the operator's dtype and device (inputs are converted) and count rows in ``n_matvec`` /
``n_rmatvec``. Implementations:

* :class:`LinearizedFeatures`: ``Ψ₀ = L ∘ Φ`` from a :class:`ctuq.linearize.LinearizedNetwork` (Φ) and a linear
  output map ``L`` with its adjoint, given as callables on rows. CT passes the ray transform (``L = T``, ``c``
  measurements); classification passes ``B^(1/2)``; ``L = None`` is the identity.
* :class:`DenseFeatures`: an explicit ``(c, d)`` matrix, for tests and small problems.
* Compositions: :class:`ScaledFeatures` (``Ψ = Ψ₀ diag(s)``: the prior scales ``s``, whose one owner it is),
  :class:`RowScaledFeatures` (``Ψ = diag(r) Ψ₀``: the whitening of a diagonal noise covariance),
  :meth:`FeatureOperator.restrict` (rows subset, :class:`RowSubsetFeatures`) and :func:`stack_features` (rows
  appended, :class:`StackedFeatures`) — experimental design conditions on subsets of angles and adds new ones.

Every implementation passes the feature contract of :mod:`ctuq.testing` (``FeatureContract``: adjointness,
row restriction, stacking, product counters).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch

from ctuq.utils import as_rows

__all__ = [
    "FeatureOperator",
    "DenseFeatures",
    "LinearizedFeatures",
    "ScaledFeatures",
    "RowScaledFeatures",
    "RowSubsetFeatures",
    "StackedFeatures",
    "stack_features",
]


def _unit_rows(
    start: int, stop: int, n: int, dtype: torch.dtype, device, values: torch.Tensor | None = None
) -> torch.Tensor:
    """``(stop − start, n)`` rows ``e_start … e_(stop−1)``, times ``values`` ``(stop − start,)`` when given."""
    E = torch.zeros((stop - start, n), dtype=dtype, device=device)
    E[torch.arange(stop - start), torch.arange(start, stop)] = 1.0 if values is None else values.to(E)
    return E


class FeatureOperator(abc.ABC):
    """Abstract ``Ψ`` (``n_outputs × n_features`` = ``c × d``) used through batched row products.

    Subclasses implement :meth:`_matvec` and :meth:`_rmatvec` on ``(B, d)`` / ``(B, c)`` tensors already in
    the operator's dtype and device; the public methods check shapes and count products.

    Attributes
    ----------
    n_features : int
        ``d``, the number of (scaled) weights ``w``.
    n_outputs : int
        ``c``, the number of targets (measurements, or logits for classification).
    dtype, device
        Where and in which precision the products run.
    n_matvec, n_rmatvec : int
        Rows multiplied by ``Ψ`` / ``Ψᵀ`` so far.
    """

    n_features: int
    n_outputs: int
    dtype: torch.dtype
    device: torch.device

    def __init__(self) -> None:
        self.n_matvec = 0
        self.n_rmatvec = 0

    @abc.abstractmethod
    def _matvec(self, W: torch.Tensor) -> torch.Tensor:
        """``(B, d)`` → ``(B, c)``."""

    @abc.abstractmethod
    def _rmatvec(self, R: torch.Tensor) -> torch.Tensor:
        """``(B, c)`` → ``(B, d)``."""

    def _rows(self, X: torch.Tensor, width: int, what: str, method: str) -> torch.Tensor:
        return as_rows(X, width, f"{type(self).__name__}.{method}", what, device=self.device, dtype=self.dtype)

    def matvec(self, W: torch.Tensor) -> torch.Tensor:
        """``Ψ w`` for each row of ``W`` ``(B, d)`` → ``(B, c)``. Counts ``B`` in :attr:`n_matvec`."""
        W = self._rows(W, self.n_features, "W", "matvec")
        out = self._matvec(W)
        self.n_matvec += W.shape[0]
        return out

    def rmatvec(self, R: torch.Tensor) -> torch.Tensor:
        """``Ψᵀ r`` for each row of ``R`` ``(B, c)`` → ``(B, d)``. Counts ``B`` in :attr:`n_rmatvec`."""
        R = self._rows(R, self.n_outputs, "R", "rmatvec")
        out = self._rmatvec(R)
        self.n_rmatvec += R.shape[0]
        return out

    def columns(self, start: int, stop: int, values: torch.Tensor | None = None) -> torch.Tensor:
        """Columns ``start … stop − 1`` of ``Ψ`` as rows ``(stop − start, c)``: ``Ψ e_j`` for those unit vectors,
        each times ``values[j − start]`` when ``values`` ``(stop − start,)`` is given (counted as matvecs).
        Subclasses with a cheaper way (:class:`LinearizedFeatures`) override it."""
        return self.matvec(_unit_rows(start, stop, self.n_features, self.dtype, self.device, values))

    def row_range(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start … stop − 1`` of ``Ψ`` ``(stop − start, d)``: ``Ψᵀ e_j`` for those unit vectors (counted as
        rmatvecs; the counterpart of :meth:`columns`)."""
        return self.rmatvec(_unit_rows(start, stop, self.n_outputs, self.dtype, self.device))

    def reset_counters(self) -> None:
        """Zero :attr:`n_matvec` and :attr:`n_rmatvec`."""
        self.n_matvec = 0
        self.n_rmatvec = 0

    def counters(self) -> dict[str, int]:
        """``{"matvec": n_matvec, "rmatvec": n_rmatvec}``."""
        return {"matvec": self.n_matvec, "rmatvec": self.n_rmatvec}

    def restrict(self, rows) -> FeatureOperator:
        """``Ψ[rows]`` (rows: a 1-D integer index or a boolean mask over the ``c`` outputs; no duplicates)."""
        return RowSubsetFeatures(self, rows)

    def to_dense(self, chunk_size: int = 256) -> torch.Tensor:
        """Assemble ``Ψ`` ``(c, d)`` with ``c`` rmatvecs (rows ``Ψᵀ e_j``). Only for small problems and tests."""
        c = self.n_outputs
        out = torch.empty((c, self.n_features), dtype=self.dtype, device=self.device)
        for start in range(0, c, chunk_size):
            stop = min(c, start + chunk_size)
            out[start:stop] = self.row_range(start, stop)
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n_outputs={self.n_outputs}, n_features={self.n_features}, "
            f"dtype={self.dtype}, device={self.device})"
        )


class DenseFeatures(FeatureOperator):
    """``Ψ`` given as an explicit matrix ``(c, d)`` (tests, small problems, classification with few logits).

    Parameters
    ----------
    matrix : torch.Tensor
        ``(c, d)`` float32/float64; its dtype and device are the operator's.
    """

    def __init__(self, matrix: torch.Tensor):
        super().__init__()
        if not isinstance(matrix, torch.Tensor) or matrix.ndim != 2:
            raise ValueError(
                f"DenseFeatures: matrix must be a 2-D tensor (c, d), got "
                f"{tuple(matrix.shape) if isinstance(matrix, torch.Tensor) else type(matrix).__name__}"
            )
        if matrix.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"DenseFeatures: matrix must be float32 or float64, got {matrix.dtype}")
        self.matrix = matrix
        self.n_outputs, self.n_features = (int(s) for s in matrix.shape)
        self.dtype = matrix.dtype
        self.device = matrix.device

    def _matvec(self, W: torch.Tensor) -> torch.Tensor:
        return W @ self.matrix.T

    def _rmatvec(self, R: torch.Tensor) -> torch.Tensor:
        return R @ self.matrix

    def to_dense(self, chunk_size: int = 256) -> torch.Tensor:
        """The matrix itself (no products counted)."""
        return self.matrix

    def restrict(self, rows) -> DenseFeatures:
        """``Ψ[rows]`` as a dense matrix (no products)."""
        return DenseFeatures(self.matrix[_check_rows(rows, self.n_outputs, "DenseFeatures.restrict").to(self.device)])


class LinearizedFeatures(FeatureOperator):
    """``Ψ₀ = L Φ``: features of a linearised network under unscaled weights ``u = v − ṽ``.

    Prior scales are not part of it: ``Ψ = Ψ₀ diag(s)`` is :class:`ScaledFeatures` (which the posterior builds).

    Parameters
    ----------
    network : LinearizedNetwork
        Gives ``Φ`` (``d_out × d``) through ``jvp``/``vjp``; its JVP/VJP counters count the cost.
    output_map, output_adjoint : callable, optional
        ``L``: ``(B, d_out)`` → ``(B, c)`` and ``Lᵀ``: ``(B, c)`` → ``(B, d_out)`` (e.g. a ray transform's
        ``forward_flat`` / ``adjoint_flat``). Both or neither; neither means ``L = I`` and ``c = d_out``.
    n_outputs : int, optional
        ``c``; found by applying ``L`` to one zero row when omitted.
    """

    def __init__(
        self,
        network,
        output_map: Callable[[torch.Tensor], torch.Tensor] | None = None,
        output_adjoint: Callable[[torch.Tensor], torch.Tensor] | None = None,
        n_outputs: int | None = None,
    ):
        super().__init__()
        if isinstance(output_map, torch.Tensor):
            raise TypeError(
                "LinearizedFeatures(network, output_map, output_adjoint, n_outputs) takes no prior "
                "scales: apply them with ScaledFeatures(LinearizedFeatures(...), scales)"
            )
        if (output_map is None) != (output_adjoint is None):
            raise ValueError("LinearizedFeatures: give both output_map (L) and output_adjoint (Lᵀ), or neither")
        self.network = network
        self.dtype = network.dtype
        self.device = network.device
        self.n_features = int(network.d)
        self._L = output_map
        self._Lt = output_adjoint
        if output_map is None:
            c = int(network.d_out)
            if n_outputs is not None and int(n_outputs) != c:
                raise ValueError(f"LinearizedFeatures: n_outputs={n_outputs} but L = I gives c = d_out = {c}")
        else:
            if n_outputs is None:
                probe = output_map(torch.zeros((1, network.d_out), dtype=self.dtype, device=self.device))
                if not isinstance(probe, torch.Tensor) or probe.ndim != 2 or probe.shape[0] != 1:
                    raise ValueError(
                        "LinearizedFeatures: output_map must map (B, d_out) to (B, c); for a (1, "
                        f"{network.d_out}) input it returned "
                        f"{tuple(probe.shape) if isinstance(probe, torch.Tensor) else type(probe).__name__}"
                    )
                n_outputs = int(probe.shape[1])
            c = int(n_outputs)
        self.n_outputs = c

    def _apply_map(self, fn, X: torch.Tensor, cols: int, name: str) -> torch.Tensor:
        """``fn(X)`` checked to be ``(X.shape[0], cols)`` (a user map's error names it), in this dtype."""
        if fn is None:
            return X
        Y = fn(X)
        if not isinstance(Y, torch.Tensor) or tuple(Y.shape) != (X.shape[0], cols):
            raise ValueError(
                f"LinearizedFeatures: {name} returned "
                f"{tuple(Y.shape) if isinstance(Y, torch.Tensor) else type(Y).__name__} for input "
                f"{tuple(X.shape)}; expected ({X.shape[0]}, {cols})"
            )
        return Y.to(self.dtype)

    def _apply_L(self, X: torch.Tensor) -> torch.Tensor:
        return self._apply_map(self._L, X, self.n_outputs, "output_map")

    def _apply_Lt(self, R: torch.Tensor) -> torch.Tensor:
        return self._apply_map(self._Lt, R, self.network.d_out, "output_adjoint")

    def _matvec(self, W: torch.Tensor) -> torch.Tensor:
        return self._apply_L(self.network.jvp(W))

    def _rmatvec(self, R: torch.Tensor) -> torch.Tensor:
        return self.network.vjp(self._apply_Lt(R))

    def columns(self, start: int, stop: int, values: torch.Tensor | None = None) -> torch.Tensor:
        """Columns ``start … stop − 1`` of ``Ψ₀`` (times ``values``) as rows ``(stop − start, c)``: ``L`` of the
        network's :meth:`~ctuq.linearize.LinearizedNetwork.jvp_basis` (one parameter tensor's tangent at a time)
        when it has one, else unit-vector matvecs. Counts ``stop − start`` matvecs."""
        basis = getattr(self.network, "jvp_basis", None)
        if basis is None:
            return super().columns(start, stop, values)
        out = self._apply_L(basis(start, stop, values))
        self.n_matvec += stop - start
        return out

    def network_matvec(self, W: torch.Tensor) -> torch.Tensor:
        """``Φ w`` for rows ``W`` ``(B, d)`` → ``(B, d_out)``: network-output (image-space) samples.

        This is how weight samples become image samples: the posterior maps scaled samples ``ζ`` through
        ``Φ(s ⊙ ζ)``. One JVP per row (counted by the network, not by :attr:`n_matvec`).
        """
        W = self._rows(W, self.n_features, "W", "network_matvec")
        return self.network.jvp(W)


# ------------------------------------------------------------------------------------------ composition
def _check_rows(rows, c: int, where: str) -> torch.Tensor:
    idx = torch.as_tensor(rows)
    if idx.dtype == torch.bool:
        if tuple(idx.shape) != (c,):
            raise ValueError(f"{where}: a boolean row mask must have shape ({c},), got {tuple(idx.shape)}")
        idx = idx.nonzero().reshape(-1)
    if idx.ndim != 1 or idx.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        raise ValueError(
            f"{where}: rows must be a 1-D integer index or a boolean mask, got {tuple(idx.shape)} {idx.dtype}"
        )
    idx = idx.long()
    if idx.numel() == 0:
        raise ValueError(f"{where}: rows is empty (a linear model needs at least one target)")
    if int(idx.min()) < 0 or int(idx.max()) >= c:
        raise ValueError(f"{where}: row indices must lie in 0..{c - 1}, got {int(idx.min())}..{int(idx.max())}")
    if idx.unique().numel() != idx.numel():
        raise ValueError(f"{where}: rows contain duplicates (each measurement may enter the model once)")
    return idx


class ScaledFeatures(FeatureOperator):
    """``Ψ = Ψ₀ diag(s)``: prior scales ``s`` ``(d,)`` applied to the weights of a base operator ``Ψ₀``.

    The one owner of prior scales among the feature operators. The posterior
    (:class:`~ctuq.inference.posterior.LinearizedPosterior`) keeps the unscaled ``Ψ₀`` (e.g. ``T Φ`` for CT) and
    applies the g-prior scales here, so scales can be refreshed or kept when rows are restricted or added.
    Products cost what ``Ψ₀``'s cost; both operators count them.
    """

    def __init__(self, base: FeatureOperator, scales: torch.Tensor):
        super().__init__()
        if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (base.n_features,):
            got = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__
            raise ValueError(f"ScaledFeatures: scales must have shape ({base.n_features},), got {got}")
        if not torch.isfinite(scales).all():
            raise ValueError("ScaledFeatures: scales contain NaN or Inf")
        self.base = base
        self.n_features, self.n_outputs = base.n_features, base.n_outputs
        self.dtype, self.device = base.dtype, base.device
        self.scales = scales.detach().to(device=self.device, dtype=self.dtype)

    def _matvec(self, W: torch.Tensor) -> torch.Tensor:
        return self.base.matvec(W * self.scales)

    def _rmatvec(self, R: torch.Tensor) -> torch.Tensor:
        return self.base.rmatvec(R) * self.scales

    def columns(self, start: int, stop: int, values: torch.Tensor | None = None) -> torch.Tensor:
        """The base's columns ``start … stop − 1`` times their scales (and ``values``): the base's cheaper column
        route (e.g. :meth:`LinearizedFeatures.columns`) serves the scaled operator too. Counts ``stop − start``
        matvecs."""
        s = self.scales[start:stop]
        out = self.base.columns(start, stop, s if values is None else s * values.to(s))
        self.n_matvec += stop - start
        return out


class RowScaledFeatures(FeatureOperator):
    """``Ψ = diag(r) Ψ₀``: every row ``i`` of a base operator times ``r_i`` (``r`` ``(c,)``, finite, > 0).

    The whitening of a diagonal noise covariance ``σ² D``
    (:class:`~ctuq.inference.likelihoods.DiagonalGaussianLikelihood`): with ``r = D^(−1/2)`` the model
    ``D^(−1/2) ỹ = D^(−1/2) Ψ₀ w + ε'`` has ``ε' ~ N(0, σ² I)``, so every solver, the sampler and the EM work
    unchanged on these rows. Products cost what ``Ψ₀``'s cost; both operators count them.
    A factor ``r_i = 1`` leaves its row bitwise unchanged (multiplication by 1 is exact).
    """

    def __init__(self, base: FeatureOperator, row_scales: torch.Tensor):
        super().__init__()
        if not isinstance(row_scales, torch.Tensor) or tuple(row_scales.shape) != (base.n_outputs,):
            got = tuple(row_scales.shape) if isinstance(row_scales, torch.Tensor) else type(row_scales).__name__
            raise ValueError(f"RowScaledFeatures: row_scales must have shape ({base.n_outputs},), got {got}")
        if not (torch.isfinite(row_scales).all() and (row_scales > 0).all()):
            raise ValueError("RowScaledFeatures: row_scales must be finite and positive")
        self.base = base
        self.n_features, self.n_outputs = base.n_features, base.n_outputs
        self.dtype, self.device = base.dtype, base.device
        self.row_scales = row_scales.detach().to(device=self.device, dtype=self.dtype)

    def _matvec(self, W: torch.Tensor) -> torch.Tensor:
        return self.base.matvec(W) * self.row_scales

    def _rmatvec(self, R: torch.Tensor) -> torch.Tensor:
        return self.base.rmatvec(R * self.row_scales)

    def columns(self, start: int, stop: int, values: torch.Tensor | None = None) -> torch.Tensor:
        """The base's columns ``start … stop − 1`` (times ``values``) with their rows scaled: the base's cheaper
        column route serves this operator too. Counts ``stop − start`` matvecs."""
        out = self.base.columns(start, stop, values) * self.row_scales
        self.n_matvec += stop - start
        return out

    def restrict(self, rows) -> RowScaledFeatures:
        """``(diag(r) Ψ₀)[rows] = diag(r[rows]) Ψ₀[rows]``."""
        idx = _check_rows(rows, self.n_outputs, "RowScaledFeatures.restrict").to(self.device)
        return RowScaledFeatures(self.base.restrict(idx), self.row_scales[idx])


class RowSubsetFeatures(FeatureOperator):
    """Rows ``rows`` of ``Ψ`` (a subset of the measurements): ``Ψ[rows]`` (``len(rows) × d``).

    Each product still costs one product of the full operator (a network JVP/VJP does not get cheaper with fewer
    measurements); what shrinks is the measurement space the solvers work in. Experimental design uses this to
    condition on the acquired angles only.
    """

    def __init__(self, base: FeatureOperator, rows):
        super().__init__()
        self.base = base
        self.rows = _check_rows(rows, base.n_outputs, "FeatureOperator.restrict").to(base.device)
        self.n_features, self.n_outputs = base.n_features, int(self.rows.numel())
        self.dtype, self.device = base.dtype, base.device

    def _matvec(self, W: torch.Tensor) -> torch.Tensor:
        return self.base.matvec(W)[:, self.rows]

    def _rmatvec(self, R: torch.Tensor) -> torch.Tensor:
        full = torch.zeros((R.shape[0], self.base.n_outputs), dtype=self.dtype, device=self.device)
        full[:, self.rows] = R
        return self.base.rmatvec(full)


class StackedFeatures(FeatureOperator):
    """Row blocks ``[Ψ₁; Ψ₂; …]`` over the same weights (``Σ cᵢ × d``): measurements appended to a model.

    ``matvec`` concatenates the blocks' outputs, ``rmatvec`` sums their adjoints of the matching row slices.
    """

    def __init__(self, blocks: list[FeatureOperator]):
        super().__init__()
        blocks = list(blocks)
        if not blocks:
            raise ValueError("stack_features: give at least one feature operator")
        d = blocks[0].n_features
        for i, b in enumerate(blocks):
            if b.n_features != d:
                raise ValueError(f"stack_features: block {i} has {b.n_features} features, block 0 has {d}")
            if b.device != blocks[0].device or b.dtype != blocks[0].dtype:
                raise ValueError(
                    f"stack_features: block {i} is {b.dtype} on {b.device}, block 0 is "
                    f"{blocks[0].dtype} on {blocks[0].device}"
                )
        self.blocks = blocks
        self.offsets = [0]
        for b in blocks:
            self.offsets.append(self.offsets[-1] + b.n_outputs)
        self.n_features, self.n_outputs = d, self.offsets[-1]
        self.dtype, self.device = blocks[0].dtype, blocks[0].device

    def _matvec(self, W: torch.Tensor) -> torch.Tensor:
        return torch.cat([b.matvec(W) for b in self.blocks], dim=1)

    def _rmatvec(self, R: torch.Tensor) -> torch.Tensor:
        out = None
        for b, lo, hi in zip(self.blocks, self.offsets, self.offsets[1:]):
            part = b.rmatvec(R[:, lo:hi])
            out = part if out is None else out + part
        return out


def stack_features(blocks: list[FeatureOperator]) -> FeatureOperator:
    """``[Ψ₁; Ψ₂; …]`` (rows appended); dense blocks stay one dense matrix."""
    blocks = list(blocks)
    if blocks and all(isinstance(b, DenseFeatures) for b in blocks):
        StackedFeatures(blocks)  # same checks as the general case
        return DenseFeatures(torch.cat([b.matrix for b in blocks], dim=0))
    return StackedFeatures(blocks)
