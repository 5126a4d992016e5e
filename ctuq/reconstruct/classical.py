"""Classical baselines: filtered back-projection (from :mod:`ctuq.operators`) and TV-regularised
reconstruction solved with ODL's primal-dual hybrid gradient (``odl.solvers.pdhg``).

TV problem (original units, sums over all measurements/pixels)::

    min_x  ½ ‖T x − y‖²  +  λ · TV(x)   [+ indicator(x ≥ 0)]

with isotropic ``TV(x) = Σ_pixels ‖∇x‖₂`` (or anisotropic ``Σ |∂_i x|``) using forward differences on a
grid with unit cell size, so ``λ`` is in units of ``y²`` per unit of ``x``-difference and does not depend on
the pixel size in mm. The ray transform is used through :class:`TorchRayTransformOperator`, an
``odl.Operator`` (ODL's numpy backend on CPU, its PyTorch backend on CUDA so nothing leaves the GPU);
ODL supplies the gradient, the functionals and their proximals.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import odl
import torch

from ctuq.operators.base import RayTransform
from ctuq.utils import progress as _progress_bar

__all__ = ["TorchRayTransformOperator", "odl_spaces", "tv_reconstruction", "TVResult"]


def odl_spaces(op: RayTransform, impl: str | None = None):
    """ODL spaces ``(image_space, data_space)`` for ``op``.

    The image space is a ``uniform_discr`` grid with unit cells (so ODL's L² inner product has weight 1
    and matches the Euclidean one of the torch operator); the data space is ``rn(measurement_shape)``.
    ``impl`` defaults to ``'numpy'`` on CPU and ``'pytorch'`` (on ``op.device``) otherwise: on CPU, ODL 1.0's
    finite differences are ~4× slower on torch tensors (its backend lookup formats tensors), while numpy
    arrays and CPU tensors share memory, so the numpy backend costs nothing extra.
    """
    if impl is None:
        impl = "numpy" if op.device.type == "cpu" else "pytorch"
    kw = {"impl": impl} if impl == "numpy" else {"impl": impl, "device": str(op.device)}
    shape = tuple(op.image_shape)
    image_space = odl.uniform_discr([0.0] * len(shape), [float(s) for s in shape], shape, dtype="float32", **kw)
    data_space = odl.rn(tuple(op.measurement_shape), dtype="float32", **kw)
    return image_space, data_space


def _to_torch(x, device: torch.device) -> torch.Tensor:
    arr = x.asarray() if hasattr(x, "asarray") else x
    return torch.as_tensor(arr, dtype=torch.float32, device=device)


def _to_space(space, t: torch.Tensor):
    return space.element(t.detach().cpu().numpy() if space.impl == "numpy" else t)


class TorchRayTransformOperator(odl.Operator):
    """A :class:`~ctuq.operators.base.RayTransform` as a linear ``odl.Operator`` (and its adjoint): ODL's spaces
    from :func:`odl_spaces`, values computed by the torch operator without autograd."""

    def __init__(self, op: RayTransform, domain=None, range=None, _adjoint_of=None):
        if domain is None or range is None:
            domain, range = odl_spaces(op)
        super().__init__(domain, range, linear=True)
        self.op = op
        self._adjoint_of = _adjoint_of

    def _call(self, x):
        t = _to_torch(x, self.op.device)
        with torch.no_grad():
            out = self.op.adjoint(t) if self._adjoint_of is not None else self.op.forward(t)
        return _to_space(self.range, out)

    @property
    def adjoint(self):
        if self._adjoint_of is not None:
            return self._adjoint_of
        return TorchRayTransformOperator(self.op, self.range, self.domain, _adjoint_of=self)


class TVResult(dict):
    """``dict`` with ``reconstruction`` (``image_shape`` tensor, original units, on ``op.device``),
    ``iterations``, ``time_s``, ``objective`` (final value of the TV objective), ``op_norm``, ``dual`` (PDHG's dual
    variable, an element of ODL's product space: the warm start of a next weight)."""


def tv_reconstruction(
    op: RayTransform,
    y: torch.Tensor,
    *,
    weight: float,
    iterations: int = 300,
    nonnegative: bool = True,
    isotropic: bool = True,
    x0: torch.Tensor | None = None,
    dual=None,
    op_norm: float | None = None,
    progress: bool = True,
    callback: Callable[[int, torch.Tensor], None] | None = None,
) -> TVResult:
    """TV-regularised reconstruction ``argmin ½‖Tx − y‖² + λ TV(x)`` with ODL's PDHG.

    Parameters
    ----------
    op : RayTransform
        ``T``; ``y`` must be on ``op.device``.
    y : torch.Tensor
        Sinogram ``measurement_shape`` (data units).
    weight : float
        ``λ > 0`` (see the module docstring for its units).
    iterations : int
        PDHG iterations.
    nonnegative : bool
        Constrain ``x ≥ 0`` (attenuation is non-negative).
    isotropic : bool
        Isotropic (``‖∇x‖₂`` per pixel) or anisotropic (``|∂_1 x| + |∂_2 x|``) TV.
    x0 : torch.Tensor, optional
        Starting image ``image_shape`` (e.g. the FBP); zeros by default.
    dual : optional
        Starting dual variable: the ``dual`` of an earlier result on the same ``op`` (a warm start along a path of
        weights, :func:`ctuq.reconstruct.heldout.tv_weight_path`); zeros by default.
    op_norm : float, optional
        ``‖T‖`` when already known (the path estimates it once); estimated by power iteration otherwise.
    progress : bool
        Show a tqdm bar.
    callback : callable, optional
        ``callback(iteration, x)`` after each iteration with the current image tensor.

    Returns
    -------
    TVResult
    """
    if not (weight > 0 and math.isfinite(weight)):
        raise ValueError(f"tv_reconstruction: weight must be positive, got {weight}")
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"tv_reconstruction: iterations must be a positive int, got {iterations!r}")
    if tuple(y.shape) != tuple(op.measurement_shape):
        raise ValueError(f"tv_reconstruction: y has shape {tuple(y.shape)}; operator expects {op.measurement_shape}")
    if x0 is not None and tuple(x0.shape) != tuple(op.image_shape):
        raise ValueError(f"tv_reconstruction: x0 has shape {tuple(x0.shape)}; expected {op.image_shape}")

    t0 = time.perf_counter()
    T = TorchRayTransformOperator(op)
    X, Y = T.domain, T.range
    grad = odl.Gradient(X)
    # Balance the two blocks of L = (T, c∇): with c = ‖T‖/‖∇‖ both have the same norm, which PDHG with
    # one step size per side needs to converge in a few hundred iterations (‖T‖ is ~100× ‖∇‖ ≤ √(4·ndim)).
    # The objective is unchanged because the regulariser is weighted by λ/c.
    t_norm = op.operator_norm(n_iter=30) if op_norm is None else float(op_norm)
    grad_norm = 2.0 * math.sqrt(len(op.image_shape))
    c = t_norm / grad_norm if t_norm > 0 else 1.0
    L = odl.BroadcastOperator(T, c * grad)
    data_fit = 0.5 * odl.functionals.L2NormSquared(Y).translated(_to_space(Y, y.to(op.device, torch.float32)))
    reg = odl.functionals.GroupL1Norm(grad.range) if isotropic else odl.functionals.L1Norm(grad.range)
    g = odl.functionals.SeparableSum(data_fit, (weight / c) * reg)
    f = odl.functionals.IndicatorNonnegativity(X) if nonnegative else odl.functionals.ZeroFunctional(X)
    # τσ‖L‖² < 1 guarantees convergence; ‖L‖ ≤ √2·‖T‖ after balancing (1 % margin for the norm estimate).
    tau = sigma = 1.0 / (math.sqrt(2.0) * max(t_norm, 1e-12) * 1.01)

    x = _to_space(X, x0.to(op.device, torch.float32).clone()) if x0 is not None else X.zero()
    bar = _progress_bar(total=iterations, desc="TV (PDHG)", disable=None if progress else True)
    state = {"it": 0}

    def _cb(xk):
        bar.update(1)
        if callback is not None:
            callback(state["it"], _to_torch(xk, op.device))
        state["it"] += 1

    try:
        y_dual = L.range.zero() if dual is None else dual.copy()
        odl.solvers.pdhg(x, f, g, L, niter=iterations, tau=tau, sigma=sigma, y=y_dual, callback=_cb)
    finally:
        bar.close()
    recon = _to_torch(x, op.device).clone()
    with torch.no_grad():
        objective = float(0.5 * (op(recon) - y).pow(2).sum() + weight * float(reg(grad(x))))
    return TVResult(
        reconstruction=recon,
        iterations=iterations,
        time_s=time.perf_counter() - t0,
        objective=objective,
        op_norm=t_norm,
        dual=y_dual,
    )
