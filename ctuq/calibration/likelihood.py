"""The maximum-likelihood fit the parametric calibration methods share: a predictive variance linear in non-negative
parameters,

    r_i ~ N(0, var_i),   var_i = base_i + Σ_k θ_k A_ik,   θ ≥ 0,

over held-out rows ``i`` (``r``: the residuals ``y_h − T_h x̂``; ``base`` and the columns ``A`` from the rows'
arrays). Each method is one choice of ``base`` and ``A``:

* ``heldout`` (:class:`~ctuq.calibration.HeldoutScale`): ``base = σ²``, ``A = [v]``, ``θ = k²``;
* ``bias`` (:class:`~ctuq.calibration.BiasModel`): ``base = v + σ²``, ``A = [w]`` (the object mask's row weights),
  ``θ = τ²``;
* ``spatial`` (:class:`~ctuq.calibration.SpatialBias`): ``base = v + σ²``, ``A = [v, W_1, …]`` (the posterior's
  widening and the image features' row weights).

One column is fitted as :func:`ctuq.metrics.heldout.fit_variance_scale` fits ``k``: a global grid on ``log θ``, then
bisection on the derivative's sign, with the block bootstrap over the rows' groups (angles) for its standard error;
several columns by L-BFGS-B with the bounds ``θ ≥ 0``, each column scaled to the mean of ``base`` so the search is
scale free. Both are kept exactly as the methods ran them before they shared this module (same arithmetic, same
seeds), so a method's numbers do not depend on which route it took to get here.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.optimize

from ctuq.metrics.heldout import fit_variance_scale

__all__ = ["fit_linear_variance"]

_LOG_2PI = math.log(2.0 * math.pi)


def fit_linear_variance(
    residual, base, columns, *, groups=None, n_bootstrap: int = 0, seed: int = 0
) -> tuple[np.ndarray, dict]:
    """Maximum-likelihood ``θ ≥ 0`` of ``var_i = base_i + Σ_k θ_k A_ik`` (module docstring).

    Parameters
    ----------
    residual : ``(m,)``
        ``r_i`` (measurement units).
    base : float or ``(m,)``
        The variance every row has whatever ``θ`` (measurement units²), > 0.
    columns : ``(m, p)``
        ``A_ik ≥ 0`` (measurement units² per unit of ``θ_k``); ``p ≥ 1``.
    groups : ``(m,)`` ints, optional
        Block labels of the bootstrap (the rows' angles); ``None``: every row its own block.
    n_bootstrap : int
        Block-bootstrap replicates of a one-column fit (0: none); a fit of several columns takes none.
    seed : int
        Seeds the bootstrap (numpy ``default_rng``).

    Returns
    -------
    theta : np.ndarray
        ``(p,)`` float64, ≥ 0.
    details : dict
        One column: :func:`~ctuq.metrics.heldout.fit_variance_scale`'s dict with ``k = sqrt(θ)`` (its standard
        errors, bootstrap interval, ``at_bound`` and per-row ``log_likelihood``); several: ``converged`` (L-BFGS-B's
        success), ``n_iterations`` and ``log_likelihood`` (per row, nats, at ``θ``).

    Raises
    ------
    ValueError
        ``columns`` not ``(m, p)`` with ``p ≥ 1``; a bootstrap asked of several columns; bad rows (as
        :func:`~ctuq.metrics.heldout.fit_variance_scale` names them).
    """
    cols = np.asarray(columns, np.float64)
    r = np.asarray(residual, np.float64)
    if cols.ndim != 2 or cols.shape[0] != r.size or cols.shape[1] < 1:
        raise ValueError(f"fit_linear_variance: columns must be ({r.size}, p ≥ 1), got {cols.shape}")
    if cols.shape[1] == 1:
        fit = fit_variance_scale(r, cols[:, 0], base, groups=groups, n_bootstrap=n_bootstrap, seed=seed)
        return np.array([fit["k"] ** 2]), fit
    if n_bootstrap:
        raise ValueError(f"fit_linear_variance: no bootstrap for {cols.shape[1]} columns (n_bootstrap must be 0)")
    r2 = r**2
    b = np.broadcast_to(np.asarray(base, np.float64), r2.shape)
    # columns in units of the predictive variance they would carry alone: the search is scale free
    scale = np.array([b.mean() / max(float(c.mean()), 1e-300) for c in cols.T])
    A = cols * scale[None, :]

    def nll(u):
        s = b + A @ u
        return 0.5 * float(np.sum(np.log(s) + r2 / s)), 0.5 * (A.T @ (1.0 / s - r2 / s**2))

    res = scipy.optimize.minimize(
        nll, np.zeros(A.shape[1]), jac=True, method="L-BFGS-B", bounds=[(0.0, None)] * A.shape[1]
    )
    theta = res.x * scale
    var = b + cols @ theta
    ll = float(np.mean(-0.5 * (_LOG_2PI + np.log(var) + r2 / var)))
    return theta, {"converged": bool(res.success), "n_iterations": int(res.nit), "log_likelihood": ll}
