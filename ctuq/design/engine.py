"""The sequential-design engine: condition on chosen angles block by block and score every remaining candidate.

Notation (``docs/experimental_design.md``): candidates ``β = 0 … n−1`` with operator blocks ``T^β`` of ``k`` rows;
the chosen blocks ``τ`` (pilot first); the prior ``K = L diag(s)² Lᵀ / a`` of a
:class:`~ctuq.design.model.DesignModel`; the measurement covariance of the chosen rows ``C_τ = T^τ K T^τᵀ + σ² I``.

One acquisition of ``β`` (``2k`` kernel products ``K x``, sparse projections, and dense work independent of how
many angles were chosen, apart from the triangular solves with ``C_τ``):

    Z = K T^βᵀ,   V = C_τ⁻¹ T^τ Z,   X = T̄ (Z − K T^τᵀ V)        (X = Cov(y_all, y_β | y_τ), c̄ × k)
    S = X_β + σ² I                                                (posterior block of β plus noise)
    C_{τ∪β} = [[C_τ, T^τ Z], [Zᵀ T^τᵀ, T^β Z + σ² I]]            (bordered Cholesky update, not refactorised)

and then, by route:

* ``exact``: every candidate block is downdated, ``M_i ← M_i − X_i S⁻¹ X_iᵀ`` (starting from the prior blocks
  ``T^i K T^iᵀ``): exact posterior blocks at every step.
* ``sampled``: ``m`` posterior weight samples are drawn by the core Matheron sampler
  (:func:`ctuq.inference.sample_chunks`, solving with :class:`BorderedCholesky`) and pushed through ``T̄ L``;
  each acquisition then conditions them on the new block by the same rule, ``Y ← Y + (ε_β − Y_β) S⁻¹ Xᵀ`` with
  fresh noise ``ε_β ~ N(0, σ² I)``: the samples stay exact draws of the pathwise-conditioned pseudo-measurements
  ``y_j = T̄(x_j − K T^(t)ᵀ C_t⁻¹(ε_j + T^(t) x_j))`` (same ``x_j``, ``ε_j``), and ``M̂_β = (1/m) Σ_j y_jβ y_jβᵀ``.

Both routes use exact cross-covariances; they differ only in how the candidate blocks are kept.
"""

from __future__ import annotations

import torch

from ctuq.design.bordered import BorderedCholesky, lower_gram
from ctuq.design.criteria import criteria_from_blocks, criteria_from_samples
from ctuq.design.factors import DenseFactor, IdentityFactor, kernel_from_rows
from ctuq.inference import DenseFeatures, sample_chunks
from ctuq.inference.sampler import chunk_generator
from ctuq.options import DesignRoute

__all__ = ["BorderedCholesky", "DesignEngine", "auto_route"]  # BorderedCholesky: from .bordered


def auto_route(model, refreshed: bool) -> str:
    """``"exact"`` when the prior blocks of all candidates are cheap (sparse products for the isotropic prior,
    sparse × dense for an assembled Jacobian) and the prior does not change during the design; else ``"sampled"``.

    A refreshed prior would redo the prior blocks of all candidates and re-condition them on every chosen angle at
    every change; a network through VJPs needs one VJP per candidate row for them, a Matérn factor one FFT pair
    (36 600 for the published study), against ``m`` for the samples.
    """
    cheap = isinstance(model.factor, (IdentityFactor, DenseFactor))
    return DesignRoute.EXACT.value if cheap and not refreshed else DesignRoute.SAMPLED.value


class DesignEngine:
    """Posterior candidate blocks (exactly or from samples) under a growing set of chosen angles.

    Two equivalent ways to get ``X = Cov(y_all, y_β | y_τ)``, chosen per model (:meth:`DesignModel.weight_space`):

    * *weight space* (an assembled Jacobian, or a small network): the chosen rows ``Ψ_τ = T^τ L diag(s)``
      (``c_t × d``) are kept, ``Ψ_β`` comes from ``T^β L`` (sparse × dense, or ``k`` VJPs), and
      ``X = T̄ L (s ⊙ H)`` with ``H = a⁻¹(Ψ_β − (C_τ⁻¹ Ψ_τ Ψ_βᵀ/a)ᵀ Ψ_τ)``: one ``L`` product per row of ``β``;
    * *image space* (isotropic, Matérn, large networks): ``Z = K T^βᵀ``, ``X = T̄ (Z − K T^τᵀ C_τ⁻¹ T^τ Z)``: two
      kernel products per row.

    Parameters
    ----------
    model : DesignModel
        Candidates, prior factor, scales, ``a`` and ``σ²``.
    route : {"exact", "sampled"}
        How candidate blocks are kept (module docstring).
    n_samples : int
        ``m`` (sampled route).
    seed : int
        Seeds the samples (one stream per reset) and the noise of every acquisition (one stream per step).
    sample_chunk : int
        Samples drawn together by the core sampler.
    """

    def __init__(self, model, route: str = "sampled", n_samples: int = 1000, seed: int = 0, sample_chunk: int = 256):
        if route not in (DesignRoute.EXACT, DesignRoute.SAMPLED):
            raise ValueError(f"DesignEngine: route must be 'exact' or 'sampled', got {route!r}")
        self.model, self.route, self.m = model, route, int(n_samples)
        self.seed, self.sample_chunk = int(seed), int(sample_chunk)
        self.chosen: list[int] = []
        self.n_resets = 0
        self.M: torch.Tensor | None = None
        self.Y: torch.Tensor | None = None
        self.F: torch.Tensor | None = None  # Ψ_τ rows (weight space), a view of _Fbuf
        self._Fbuf: torch.Tensor | None = None
        self.chol: BorderedCholesky | None = None

    # ------------------------------------------------------------------------------------------ state
    def reset(self, chosen, model=None) -> None:
        """Condition on the candidate blocks ``chosen`` from scratch (optionally with a new ``model``)."""
        if model is not None:
            self.model = model
        mdl = self.model
        chosen = [int(b) for b in chosen]
        self.chol = BorderedCholesky(mdl.a, mdl.sigma2)
        self.weight_space = mdl.weight_space()
        self.chosen, self.F, self._Fbuf = [], None, None
        if self.route == DesignRoute.EXACT:
            self.M = mdl.prior_blocks()
            for b in chosen:
                self._condition(b, None)
        else:
            if self.weight_space:
                self._rows_append(mdl.weight_rows(chosen))
                self.chol.reset(lower_gram(self.F, mdl.a, mdl.sigma2), block=mdl.k, lower=True)
            elif mdl.row_store is not None:
                # the chosen rows are kept (a network through VJPs): the weight-space route's half-flop Gram in
                # their dtype (for 'small', 40 angles: 30 s against 91-95 s for the float64 product of block_kernel)
                self.chol.reset(lower_gram(mdl.weight_rows(chosen), mdl.a, mdl.sigma2), block=mdl.k, lower=True)
            else:
                eye = mdl.sigma2 * torch.eye(len(chosen) * mdl.k, dtype=torch.float64)
                self.chol.reset(mdl.block_kernel(chosen, chosen) + eye, block=mdl.k)
            self.chosen = chosen
            # drawn when first needed: a prior refreshed after the last acquisition (for a std map) is never scored
            self.Y, self._draw_seed = None, self.chunk_seed()
        self.n_resets += 1

    def chunk_seed(self) -> int:
        """Seed of the samples drawn after the current reset (one stream per reset)."""
        return self.seed * 1000 + self.n_resets

    def _bound(self):
        feats = DenseFeatures(self.F) if self.weight_space and self.F is not None else self.model.features(self.chosen)
        return self.chol.bind(feats)

    def prepare(self) -> None:
        """Draw the samples of the sampled route now (else at their first use)."""
        if self.route == DesignRoute.SAMPLED:
            self.samples()

    def samples(self) -> torch.Tensor:
        """The ``m`` pseudo-measurement samples ``(m, n_cand, k)`` of the sampled route (drawn at first use after a
        reset, from that reset's seed)."""
        if self.Y is None:
            self.Y = self._draw(self.m, self._draw_seed)
        return self.Y

    def _draw(self, n: int, seed: int) -> torch.Tensor:
        """``n`` posterior pseudo-measurement samples ``(n, n_cand, k)`` via the core sampler."""
        mdl = self.model
        chol = self._bound()
        out = torch.empty((n, mdl.c), dtype=torch.float32)
        for i, ps in sample_chunks(chol.features, chol, mdl.a, mdl.sigma2, n, chunk_size=self.sample_chunk, seed=seed):
            with torch.no_grad():
                x = mdl.images(ps.weights)
                lo = i * self.sample_chunk
                out[lo : lo + x.shape[0]] = mdl.op.forward_flat(x.to(mdl.op.dtype)).float().cpu()
        return out.reshape(n, mdl.n_candidates, mdl.k)

    def posterior_variance(self, n: int = 256, seed: int = 0) -> torch.Tensor:
        """Pixelwise posterior variance ``(d_x,)`` float64 of the image given the chosen angles, from ``n``
        core-sampler draws (the model's image units squared)."""
        mdl = self.model
        chol = self._bound()
        moment = torch.zeros(mdl.d_x, dtype=torch.float64)
        for _, ps in sample_chunks(chol.features, chol, mdl.a, mdl.sigma2, n, chunk_size=self.sample_chunk, seed=seed):
            with torch.no_grad():
                moment += mdl.images(ps.weights).double().pow(2).sum(0).cpu()
        return moment / n

    def posterior_std(self, n: int = 256, seed: int = 0) -> torch.Tensor:
        """Pixelwise posterior std ``(d_x,)`` of the image given the chosen angles, from ``n`` core-sampler draws
        (in the model's image units)."""
        return self.posterior_variance(n, seed).sqrt().float()

    def predictive_variance(self, blocks) -> torch.Tensor:
        """The image part of the predictive variance of the rows of candidate ``blocks`` given the chosen angles,
        ``diag(T^β K_{x|τ} T^βᵀ)`` ``(len(blocks), k)`` float64 (model units²; add ``σ²`` for a measurement):
        exact on the exact route, the mean square of the ``m`` pseudo-measurement samples on the sampled one."""
        idx = [int(b) for b in blocks]
        if self.route == DesignRoute.EXACT:
            return torch.diagonal(self.M[idx], dim1=-2, dim2=-1).clone()
        return self.samples()[:, idx, :].double().pow(2).mean(0)

    def conditional_mean(self, prior_mean: torch.Tensor, targets: torch.Tensor, blocks=None) -> torch.Tensor:
        """The predictive mean of the rows of candidate ``blocks`` (default: all) given the measurements of the
        chosen angles: ``μ = m + T̄ K T^τᵀ C_τ⁻¹ (ỹ_τ − m_τ)`` ``(len(blocks), k)`` float64 (model units).

        ``prior_mean`` ``(n_candidates, k)`` is ``T̄ x̂`` of the image the uncertainty is centred on (the pilot
        reconstruction: the Gaussian is a correction around it, as the posterior of ``ctuq uq`` is), ``targets``
        ``(len(chosen), k)`` the measurements of the chosen angles in :attr:`chosen` order, both in the model's
        (scaled) units. Exact for every route: one solve with ``C_τ``, one ``K`` product and one projection.
        """
        mdl = self.model
        m = prior_mean.double().cpu().reshape(mdl.n_candidates, mdl.k)
        idx = list(range(mdl.n_candidates)) if blocks is None else [int(b) for b in blocks]
        if not self.chosen:
            return m[idx].clone()
        r = targets.double().cpu().reshape(-1) - m[self.chosen].reshape(-1)
        v = self.chol.solve_rows(r[None])[0]  # C_τ⁻¹ (ỹ_τ − m_τ)
        feats = self._bound().features  # Ψ_τ = T^τ L diag(s)
        w = feats.rmatvec(v[None].to(feats.device, feats.dtype)) / mdl.a  # (1, d): Ψ_τᵀ v / a
        op = mdl.op if blocks is None else mdl.subset(idx)
        with torch.no_grad():
            x = mdl.images(w)  # K T^τᵀ v = L diag(s) Ψ_τᵀ v / a
            proj = op.forward_flat(x.to(op.dtype)).double().cpu()
        return m[idx] + proj.reshape(len(idx), mdl.k)

    # ------------------------------------------------------------------------------------------ steps
    def acquire(self, beta: int, step: int) -> None:
        """Condition on candidate ``beta`` (noise for the sampled route from stream ``step``)."""
        if beta in self.chosen:
            raise ValueError(f"DesignEngine.acquire: candidate {beta} is already chosen")
        eps = None
        if self.route == DesignRoute.SAMPLED:
            gen = chunk_generator(self.seed + 7919, step)
            eps = torch.randn((self.m, self.model.k), generator=gen, dtype=torch.float64) * self.model.sigma2**0.5
        self._condition(int(beta), eps)

    def _rows_append(self, Fb: torch.Tensor) -> None:
        """Append ``Ψ_β`` to the kept rows (capacity doubles: no copy of all rows per step)."""
        n = 0 if self.F is None else self.F.shape[0]
        if self._Fbuf is None or self._Fbuf.shape[0] < n + Fb.shape[0]:
            buf = torch.empty(
                (max(2 * (n + Fb.shape[0]), 8 * Fb.shape[0]), Fb.shape[1]), dtype=Fb.dtype, device=Fb.device
            )
            if n:
                buf[:n] = self.F
            self._Fbuf = buf
        self._Fbuf[n : n + Fb.shape[0]] = Fb
        self.F = self._Fbuf[: n + Fb.shape[0]]

    def _cross_weight(self, beta: int):
        """Weight space: ``(X (k, c̄), B = C[τ, β] (c_t, k), D = C[β, β] − σ²I (k, k), L⁻¹B)``."""
        mdl = self.model
        Fb = mdl.weight_rows([beta])  # Ψ_β (k, d)
        D = (Fb @ Fb.T).double().cpu() / mdl.a
        H = Fb / mdl.a
        B = Zf = None
        if self.chosen:
            B = (self.F @ Fb.T).double().cpu() / mdl.a  # (c_t, k) = T^τ K T^βᵀ
            Zf = self.chol.forward(B)
            V = self.chol.backward(Zf).T.to(device=self.F.device, dtype=self.F.dtype)  # (k, c_t): C_τ⁻¹ B, rows
            H = H - (V @ self.F) / mdl.a
        X = mdl.op.forward_flat(mdl.images(H).to(mdl.op.dtype)).cpu()
        self._rows_append(Fb)
        return X, B, D, Zf

    def _cross_image(self, beta: int):
        """Image space: ``(X, B, D)`` as :meth:`_cross_weight` from kernel products."""
        mdl, k = self.model, self.model.k
        op_b = mdl.subset([beta])
        if mdl.row_store is not None:
            # the VJPs of T^β L go through the store, so a later g-prior refresh finds β's rows kept instead of
            # projecting them again
            Z = kernel_from_rows(mdl.factor, mdl.scales, mdl.a, mdl.projected_rows([beta]))
        else:
            Z = mdl.kernel(op_b.adjoint_flat(torch.eye(k, dtype=op_b.dtype, device=op_b.device)))  # K T^βᵀ rows
        D = op_b.forward_flat(Z.to(op_b.dtype)).double().cpu()
        W, B, Zf = Z, None, None
        if self.chosen:
            op_t = mdl.subset(self.chosen)
            B = op_t.forward_flat(Z.to(op_t.dtype)).double().cpu().T  # (c_t, k) = T^τ K T^βᵀ
            Zf = self.chol.forward(B)
            V = self.chol.backward(Zf).T  # (k, c_t): C_τ⁻¹ B, rows
            W = Z - mdl.kernel(op_t.adjoint_flat(V.to(device=op_t.device, dtype=op_t.dtype)))
        return mdl.op.forward_flat(W.to(mdl.op.dtype)).cpu(), B, D, Zf

    def _condition(self, beta: int, eps: torch.Tensor | None) -> None:
        mdl, k = self.model, self.model.k
        # drawn before β joins the kept rows and factor
        Y = self.samples() if self.route == DesignRoute.SAMPLED else None
        X, B, D, Zf = self._cross_weight(beta) if self.weight_space else self._cross_image(beta)
        Xb = X.reshape(k, mdl.n_candidates, k)  # [p, i, q] = Cov(y_β,p ; y_i,q | τ), float32 or float64
        S = Xb[:, beta, :].double()
        S = 0.5 * (S + S.T) + mdl.sigma2 * torch.eye(k, dtype=torch.float64)
        Ls = torch.linalg.cholesky(S)
        if self.route == DesignRoute.EXACT:
            G = torch.linalg.solve_triangular(Ls, Xb.double().permute(1, 0, 2), upper=False)  # Ls⁻¹ Cov(y_β, y_i)
            self.M -= G.mT @ G
        else:
            R = eps - Y[:, beta, :].double()  # (m, k)
            coef = torch.cholesky_solve(R.T, Ls).T  # (ε − y_β) S⁻¹
            Y.view(self.m, -1).addmm_(coef.to(Y.dtype), X.to(Y.dtype))  # in place, no (m, c̄) temp
        self.chol.append(
            B if B is not None else torch.zeros((0, k), dtype=torch.float64),
            D + mdl.sigma2 * torch.eye(k, dtype=torch.float64),
            forwarded=Zf,
        )
        self.chosen.append(beta)

    def criteria(self, criterion: str, jitter: float) -> tuple[torch.Tensor, float]:
        """Criterion values ``(n,)`` (float64; chosen candidates get ``-inf``) and the jitter ``η``."""
        left = torch.ones(self.model.n_candidates, dtype=torch.bool)
        left[self.chosen] = False
        if self.route == DesignRoute.EXACT:
            got, eta = criteria_from_blocks(self.M[left], self.model.sigma2, criterion, jitter)
        else:
            got, eta = criteria_from_samples(
                self.samples(), self.model.sigma2, criterion, jitter, index=left.nonzero()[:, 0]
            )
        vals = torch.full((self.model.n_candidates,), -float("inf"), dtype=torch.float64)
        vals[left] = got
        return vals, eta
