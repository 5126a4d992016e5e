"""The TV-PredCP block prior: a Matérn-½ covariance over the taps of every 3×3 convolution filter, one lengthscale and
one variance per block, with the total-variation predictive-complexity hyperprior on the lengthscales.

Method (Antorán, Barbano, Leuschner, Hernández-Lobato, Jin, "Uncertainty estimation for computed tomography with a
linearised deep image prior", TMLR 2023; Barbano's thesis §7.2.3 / §7.3.1, Algorithm 5).

The weights ``v`` (``d``, the linearised parameters in their flattening order) are split into *blocks*
(:func:`block_layout`): by default one block per top-level network block (``inc``, ``down.0``, ``up.1``, ...: the
module path up to its first list index) and kind of weight. A block of 3×3 weights (``(c_out, c_in, 3, 3)``) has a
Matérn-½ prior over the nine taps of each filter, independently per filter::

    v_f ~ N(0, a⁻¹ σ²_b K(ℓ_b)),     K(ℓ)_pq = exp(−‖x_p − x_q‖ / ℓ)     (x_p: tap positions on the 3×3 grid),

and every other weight (1×1 convolutions, linear layers) a normal prior ``N(0, a⁻¹ σ²_b)`` with the block's own
variance. ``a`` is the posterior's global prior precision, which the EM keeps learning on top.

In the core a prior is the map from standard weights to network weights: ``v = L w`` with ``w ~ N(0, a⁻¹ I)`` and
``L = blockdiag(σ_b chol K(ℓ_b) per filter, σ_b I)``, so the features are ``Ψ = Ψ₀ L``
(:class:`~ctuq.inference.block_features.BlockFeatures`); the g-prior is the diagonal case ``L = diag(s)``. Every
solver, the Matheron sampler, the EM and the checkpoints therefore work unchanged on the block prior.
:meth:`TVPredCPPrior.apply` and :meth:`TVPredCPPrior.apply_t` are ``L`` and ``Lᵀ`` on rows, differentiable in the
hyperparameters.

Hyperparameters ``θ = (log ℓ_b, log σ²_b)`` are set by type-II MAP, run by the posterior before its solver is set up
(:func:`ctuq.inference.prior_fit.fit_block_prior`): the linearised model's log marginal likelihood plus, for every
Matérn block, the TV-PredCP log hyperprior on ``t_b = log ℓ_b``. Its complexity measure is the expected total
variation of the prior image samples of the block alone,

    κ_b(θ) = E[TV(Φ v_b)],   v_b ~ N(0, a⁻¹ σ²_b (I ⊗ K(ℓ_b)))  (other blocks' weights zero),

with an exponential prior of rate ``λ`` on ``κ_b`` mapped to ``t_b`` by the change of variables::

    log p(t_b) = log λ − λ κ_b + log |∂κ_b / ∂t_b|.

``κ_b`` is a sum of Gaussian absolute values: with the anisotropic TV ``TV(x) = Σ_i |(D x)_i|`` (``D``: forward
differences along every image axis) and ``x`` Gaussian, ``E|(Dx)_i| = √(2/π) √V_i`` exactly, ``V_i = Var (Dx)_i``.
Because the prior acts on every filter through the same ``9 × 9`` matrix, ``V_i = σ²_b/a · tr(K(ℓ_b) G_{b,i})`` with
the *tap Gram matrix* ``G_{b,i} = Σ_f g_{i,f} g_{i,f}ᵀ`` (``g_{i,f}``: the gradient of difference ``i`` with respect to
the nine taps of filter ``f``), which does not depend on the hyperparameters. :func:`tap_grams` estimates it once,
without bias, from ``9 n`` JVPs per block (one normal number per filter, placed at each tap in turn), and
:func:`expected_tv` makes ``κ_b`` a smooth closed form of ``(ℓ_b, σ²_b)``: ``∂κ_b/∂t_b``, the hyperprior and its
gradient come from autograd at no Jacobian cost in every step. (Reparametrised samples ``x = Φ L(θ) ξ`` instead give
derivatives of ``κ`` whose variance, tried first, was ~100 % per step at 8 samples; the sign-pattern surrogate of
``TV`` misses the curvature of ``|·|`` in the second derivative.) The variances have flat priors: the hyperprior is a
density on the lengthscales, which depends on ``σ_b`` through ``κ_b ∝ σ_b``, and the MAP objective includes that
dependence.

The lengthscales are kept in ``[LENGTHSCALE_MIN, LENGTHSCALE_MAX]`` (tap spacing 1): below, ``K`` is the identity
to machine precision, above, it is the all-ones matrix (rank one; a jitter of ``1e-6`` keeps its Cholesky factor).

Nothing here is CT: the image shape and the map ``Φ`` from weights to network outputs are passed in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from ctuq.errors import CTUQError
from ctuq.options import PriorFitOptimizer, values
from ctuq.priors.registry import register_block_prior

__all__ = [
    "PriorError",
    "PriorBlock",
    "TVPredCPPrior",
    "block_layout",
    "default_block_name",
    "tap_distances",
    "matern12_cholesky",
    "tv_predcp_terms",
    "tap_grams",
    "expected_tv",
    "anisotropic_tv",
    "LENGTHSCALE_MIN",
    "LENGTHSCALE_MAX",
]

LENGTHSCALE_MIN = 1e-2
LENGTHSCALE_MAX = 1e2
_JITTER = 1e-6
_STATE_VERSION = 2  # 2: the L-BFGS fit (optimizer, tol, max_step, convergence)
OPTIMIZERS = values(PriorFitOptimizer)
MATERN = "matern"
NORMAL = "normal"


class PriorError(CTUQError):
    """A weight prior cannot be built or fitted as asked (no 3×3 convolutions, a non-positive hyperparameter, a
    stored state of another network); the message names the option or parameter at fault (one line)."""


@dataclasses.dataclass(frozen=True)
class PriorBlock:
    """One block of weights sharing hyperparameters.

    Attributes
    ----------
    name : str
        Block key (e.g. ``"down.0"``), unique together with ``kind``.
    kind : {"matern", "normal"}
        Matérn-½ over the taps of 3×3 filters, or independent normal weights.
    segments : tuple of (start, stop)
        The flat ranges of ``v`` (whole parameter tensors) in the block.
    params : tuple of str
        The parameter names of the segments.
    """

    name: str
    kind: str
    segments: tuple[tuple[int, int], ...]
    params: tuple[str, ...]

    @property
    def n_weights(self) -> int:
        """Number of weights in the block."""
        return sum(hi - lo for lo, hi in self.segments)

    @property
    def taps(self) -> int:
        """Weights per filter: 9 (Matérn) or 1 (normal)."""
        return 9 if self.kind == MATERN else 1


def default_block_name(name: str) -> str:
    """Block key of a parameter: its module path up to the first list index (``"down.0.conv1.0.weight"`` →
    ``"down.0"``, ``"inc.0.weight"`` → ``"inc.0"``, ``"outc.weight"`` → ``"outc"``): the blocks of a U-Net."""
    parts = name.split(".")[:-1] or [name]
    for i in range(1, len(parts)):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts)


def block_layout(
    param_shapes: Mapping[str, Sequence[int]], block_of: Callable[[str], str] | None = None
) -> list[PriorBlock]:
    """The prior blocks of weights ``v`` flattened in the order of ``param_shapes`` (name → shape, the linearised
    parameters in order): 4-D parameters with 3×3 trailing dimensions are Matérn weights, all others normal;
    parameters with the same ``block_of(name)`` (default :func:`default_block_name`) and kind share a block. Blocks
    come in order of first appearance. Raises :class:`PriorError` when there is no 3×3 convolution."""
    block_of = block_of or default_block_name
    found: dict[tuple[str, str], tuple[list, list]] = {}
    offset = 0
    for name, shape in param_shapes.items():
        shape = tuple(int(s) for s in shape)
        n = math.prod(shape)
        kind = MATERN if len(shape) == 4 and shape[-2:] == (3, 3) else NORMAL
        segs, names = found.setdefault((str(block_of(name)), kind), ([], []))
        segs.append((offset, offset + n))
        names.append(name)
        offset += n
    blocks = [PriorBlock(k, kind, tuple(s), tuple(p)) for (k, kind), (s, p) in found.items()]
    if not any(b.kind == MATERN for b in blocks):
        listed = ", ".join(f"{n} {tuple(s)}" for n, s in list(param_shapes.items())[:6])
        raise PriorError(
            f"uq.prior = tv_predcp: the network has no 3×3 convolution weights to put a Matérn block prior on "
            f"(linearised parameters: {listed or 'none'}); use uq.prior=gprior"
        )
    return blocks


def tap_distances(size: int = 3, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``(size², size²)`` Euclidean distances between the tap positions of a ``size × size`` filter (row-major taps,
    unit spacing), the order of a flattened convolution weight's last two dimensions."""
    ij = torch.cartesian_prod(torch.arange(size, dtype=dtype), torch.arange(size, dtype=dtype))
    return torch.cdist(ij, ij)


def matern12_cholesky(log_lengthscale: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
    """Cholesky factors ``(B, 9, 9)`` of the Matérn-½ correlations ``exp(−D/ℓ) + 10⁻⁶ I`` for log-lengthscales
    ``(B,)`` (differentiable); ``dist`` ``(9, 9)`` from :func:`tap_distances`."""
    ell = log_lengthscale.exp()[:, None, None]
    eye = torch.eye(dist.shape[0], dtype=dist.dtype, device=dist.device)
    return torch.linalg.cholesky(torch.exp(-dist / ell) + _JITTER * eye)


def anisotropic_tv(images: torch.Tensor, image_shape: Sequence[int]) -> torch.Tensor:
    """Forward differences ``D x`` ``(B, m)`` of flat images ``(B, prod(image_shape))`` along every axis of
    ``image_shape`` (the anisotropic TV is ``|D x|.sum(1)``)."""
    shape = tuple(int(s) for s in image_shape)
    x = images.reshape(images.shape[0], *shape)
    return torch.cat([torch.diff(x, dim=ax + 1).reshape(images.shape[0], -1) for ax in range(len(shape))], dim=1)


def _check_positive(value, what: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise PriorError(f"{what} must be a positive number, got {value!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise PriorError(f"{what} must be positive and finite, got {value!r}")
    return v


class TVPredCPPrior:
    """The TV-PredCP block prior over the weights of a network (module docstring).

    Parameters
    ----------
    param_shapes : mapping str → shape
        The linearised parameters in flattening order (``LinearizedNetwork.param_names`` with their shapes).
    image_shape : sequence of int
        Shape of one network output (the image) for the TV; ``prod(image_shape)`` must be the output size.
    rate : float
        ``λ`` of the exponential hyperprior on the expected TV ``κ_b`` (per unit of TV of the network output).
    lengthscale, variance : float
        Initial ``ℓ_b`` (tap spacings) and ``σ²_b`` of every block.
    steps : int
        Most steps of the type-II MAP; it stops earlier once converged (0: keep the initial hyperparameters).
    lr : float
        Adam step size on the log-hyperparameters (``optimizer="adam"``).
    optimizer : {"lbfgs", "adam"}
        The type-II MAP's optimiser (:func:`ctuq.inference.prior_fit.fit_block_prior`): MacKay warm start then
        projected L-BFGS (default), or Adam with MacKay's global-scale updates every step (the first method).
    tol : float
        Convergence tolerance: the fit stops once every log-hyperparameter changed by at most ``tol`` in each of
        the last three steps.
    max_step : float
        Largest change of a log-hyperparameter in one L-BFGS step.
    probes : int
        Hutchinson probes of the log-determinant gradient per step.
    tv_samples : int
        Samples per Matérn block of its tap Gram matrices (:func:`tap_grams`; ``9 ×`` as many JVPs, once per fit).
    precond_rank : int
        Rank of the Nyström preconditioner of the fit's CG solves (rebuilt every ``precond_every`` steps).
    precond_every : int
        Steps between preconditioner rebuilds.
    cg_tol, cg_max_iter
        Relative tolerance and iteration cap of those solves.
    block_of : callable, optional
        Parameter name → block key (default :func:`default_block_name`).

    Attributes
    ----------
    blocks : list of PriorBlock
    log_lengthscale : torch.Tensor
        ``(n_matern,)`` float64, one per Matérn block in :attr:`blocks` order.
    log_variance : torch.Tensor
        ``(n_blocks,)`` float64.
    trace : list of dict
        One record per fit step (:func:`ctuq.inference.prior_fit.fit_block_prior`).
    convergence : dict
        The fit's convergence check (``converged``, ``criterion``, ``max_change``, ``tolerance``, ``steps``,
        ``evaluations``, ``optimizer``); empty before a fit.
    fitted : bool
        The hyperparameters are final (fitted, given, or loaded): the posterior does not fit again.
    """

    name = "tv_predcp"

    def __init__(
        self,
        param_shapes: Mapping[str, Sequence[int]],
        *,
        image_shape: Sequence[int],
        rate: float = 1.0,
        lengthscale: float = 1.0,
        variance: float = 1.0,
        steps: int = 100,
        lr: float = 0.1,
        optimizer: str = "lbfgs",
        tol: float = 1e-2,
        max_step: float = 1.0,
        probes: int = 8,
        tv_samples: int = 32,
        precond_rank: int = 400,
        precond_every: int = 10,
        cg_tol: float = 1e-3,
        cg_max_iter: int = 300,
        block_of: Callable[[str], str] | None = None,
    ):
        self.rate = _check_positive(rate, "uq.tv_predcp.scale (the TV-PredCP rate λ)")
        ell = _check_positive(lengthscale, "uq.tv_predcp.lengthscale")
        if not LENGTHSCALE_MIN <= ell <= LENGTHSCALE_MAX:
            raise PriorError(
                f"uq.tv_predcp.lengthscale must lie in [{LENGTHSCALE_MIN:g}, {LENGTHSCALE_MAX:g}] tap spacings, "
                f"got {ell}"
            )
        var = _check_positive(variance, "uq.tv_predcp.variance")
        for value, what in ((steps, "steps"), (probes, "probes"), (tv_samples, "tv_samples")):
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if what == "steps" else 1):
                raise PriorError(f"uq.tv_predcp.{what} must be an int >= {0 if what == 'steps' else 1}, got {value!r}")
        for value, what in (
            (precond_rank, "precond_rank"),
            (precond_every, "precond_every"),
            (cg_max_iter, "cg_max_iter"),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PriorError(f"TVPredCPPrior: {what} must be a positive int, got {value!r}")
        self.lr = _check_positive(lr, "uq.tv_predcp.lr")
        self.tol = _check_positive(tol, "uq.tv_predcp.tol")
        self.max_step = _check_positive(max_step, "uq.tv_predcp.max_step")
        if optimizer not in OPTIMIZERS:
            raise PriorError(f"uq.tv_predcp.optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
        self.optimizer = str(optimizer)
        self.cg_tol = _check_positive(cg_tol, "TVPredCPPrior: cg_tol")
        self.image_shape = tuple(int(s) for s in image_shape)
        if not self.image_shape or min(self.image_shape) < 2:
            raise PriorError(f"TVPredCPPrior: image_shape must have every side >= 2 for a TV, got {self.image_shape}")
        self.param_shapes = {str(k): tuple(int(s) for s in v) for k, v in param_shapes.items()}
        self.blocks = block_layout(self.param_shapes, block_of)
        self.d = sum(b.n_weights for b in self.blocks)
        self.steps, self.probes, self.tv_samples = int(steps), int(probes), int(tv_samples)
        self.precond_rank, self.precond_every, self.cg_max_iter = (
            int(precond_rank),
            int(precond_every),
            int(cg_max_iter),
        )
        self.matern = [i for i, b in enumerate(self.blocks) if b.kind == MATERN]
        self.log_lengthscale = torch.full((len(self.matern),), math.log(ell), dtype=torch.float64)
        self.log_variance = torch.full((len(self.blocks),), math.log(var), dtype=torch.float64)
        self.dist = tap_distances(3)
        self.trace: list[dict] = []
        self.convergence: dict = {}
        self.fitted = int(steps) == 0
        # (start, stop, block index) of every segment in flat order: L is applied segment by segment
        self._pieces = sorted((lo, hi, i) for i, b in enumerate(self.blocks) for lo, hi in b.segments)

    # ------------------------------------------------------------------------------------------ hyperparameters
    @property
    def n_hyper(self) -> int:
        """Number of prior hyperparameters (``n_matern`` lengthscales + ``n_blocks`` variances)."""
        return len(self.matern) + len(self.blocks)

    def theta(self) -> torch.Tensor:
        """``(log ℓ_b over Matérn blocks, log σ²_b over all blocks)`` ``(n_hyper,)`` float64 (a copy)."""
        return torch.cat([self.log_lengthscale, self.log_variance]).clone()

    def set_theta(self, theta: torch.Tensor) -> None:
        """Set the hyperparameters from a :meth:`theta` vector; lengthscales are clipped to their range."""
        theta = theta.detach().to(torch.float64).reshape(-1)
        if theta.numel() != self.n_hyper or not torch.isfinite(theta).all():
            raise PriorError(
                f"TVPredCPPrior: hyperparameters must be {self.n_hyper} finite numbers, got {theta.numel()}"
            )
        m = len(self.matern)
        self.log_lengthscale = theta[:m].clamp(math.log(LENGTHSCALE_MIN), math.log(LENGTHSCALE_MAX)).clone()
        self.log_variance = theta[m:].clone()

    def split(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log ℓ (n_matern,), log σ² (n_blocks,))`` views of a :meth:`theta` vector."""
        m = len(self.matern)
        return theta[:m], theta[m:]

    def factors(self, theta: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Per block its factor: ``σ_b chol K(ℓ_b)`` ``(9, 9)`` (Matérn) or ``σ_b`` ``(1, 1)`` (normal), float64,
        differentiable in ``theta`` (default: the current hyperparameters)."""
        theta = self.theta() if theta is None else theta
        log_ell, log_var = self.split(theta)
        sd = (0.5 * log_var).exp()
        chol = matern12_cholesky(log_ell, self.dist.to(theta.device)) if len(self.matern) else None
        out: list[torch.Tensor] = []
        j = 0
        for i, b in enumerate(self.blocks):
            if b.kind == MATERN:
                out.append(sd[i] * chol[j])
                j += 1
            else:
                out.append(sd[i].reshape(1, 1))
        return out

    # ------------------------------------------------------------------------------------------ L and Lᵀ
    def _map(self, W: torch.Tensor, factors: list[torch.Tensor] | None, transpose: bool) -> torch.Tensor:
        if W.ndim != 2 or W.shape[1] != self.d:
            raise ValueError(f"TVPredCPPrior: rows must be (B, {self.d}), got {tuple(W.shape)}")
        factors = self.factors() if factors is None else factors
        B = W.shape[0]
        parts = []
        for lo, hi, i in self._pieces:
            F = factors[i].to(W.dtype if not factors[i].requires_grad else factors[i].dtype)
            seg = W[:, lo:hi].to(F.dtype)
            t = F.shape[0]
            # a row of filters times Fᵀ is L w; times F is Lᵀ r
            parts.append((seg.reshape(B, -1, t) @ (F if transpose else F.mT)).reshape(B, hi - lo))
        return torch.cat(parts, dim=1)

    def apply(self, W: torch.Tensor, factors: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``L w`` for rows ``W`` ``(B, d)``: standard weights → network weights (``W``'s dtype unless ``factors``
        require grad, then float64)."""
        return self._map(W, factors, transpose=False)

    def apply_t(self, R: torch.Tensor, factors: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``Lᵀ r`` for rows ``R`` ``(B, d)`` (network-weight gradients → standard-weight gradients)."""
        return self._map(R, factors, transpose=True)

    def block_rows(self, index: int, xi: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        """Rows ``(B, d)`` that are zero outside block ``index`` and ``factor`` applied to the filters of ``xi``
        ``(B, n_weights of the block)`` inside it (prior samples of one block)."""
        b = self.blocks[index]
        out = torch.zeros((xi.shape[0], self.d), dtype=xi.dtype, device=xi.device)
        t, pos = factor.shape[0], 0
        for lo, hi in b.segments:
            n = hi - lo
            seg = xi[:, pos : pos + n].reshape(xi.shape[0], -1, t) @ factor.to(xi.dtype).mT
            out[:, lo:hi] = seg.reshape(xi.shape[0], n)
            pos += n
        return out

    # ------------------------------------------------------------------------------------------ state
    def settings(self) -> dict:
        """The settings that change the fitted numbers (checked when a stored state is loaded)."""
        return {
            "rate": self.rate,
            "steps": self.steps,
            "lr": self.lr,
            "optimizer": self.optimizer,
            "tol": self.tol,
            "max_step": self.max_step,
            "probes": self.probes,
            "tv_samples": self.tv_samples,
            "image_shape": list(self.image_shape),
            "blocks": [f"{b.name}:{b.kind}:{b.n_weights}" for b in self.blocks],
        }

    def state_dict(self) -> dict:
        """Hyperparameters, fit trace and settings (plain tensors and values; ``weights_only``-loadable)."""
        return {
            "name": self.name,
            "version": _STATE_VERSION,
            "log_lengthscale": self.log_lengthscale.clone(),
            "log_variance": self.log_variance.clone(),
            "fitted": bool(self.fitted),
            "trace": [dict(r) for r in self.trace],
            "convergence": dict(self.convergence),
            "settings": self.settings(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output of the same network and settings (:class:`PriorError` otherwise)."""
        if not isinstance(state, dict) or state.get("name") != self.name or state.get("version") != _STATE_VERSION:
            got = (state.get("name"), state.get("version")) if isinstance(state, dict) else type(state).__name__
            raise PriorError(f"not a {self.name} prior state of version {_STATE_VERSION} (got {got!r})")
        saved, now = state.get("settings", {}), self.settings()
        diff = sorted(k for k in now if saved.get(k) != now[k])
        if diff:
            raise PriorError(
                f"the stored {self.name} prior was fitted with other settings ({', '.join(diff)}: "
                f"{[saved.get(k) for k in diff]} vs {[now[k] for k in diff]}); start the inference afresh"
            )
        self.set_theta(torch.cat([state["log_lengthscale"], state["log_variance"]]))
        self.fitted = bool(state["fitted"])
        self.trace = [dict(r) for r in state["trace"]]
        self.convergence = dict(state.get("convergence", {}))

    def summary(self) -> dict:
        """Per block: kind, weights, lengthscale (Matérn), variance; and the fit's steps."""
        ell = self.log_lengthscale.exp().tolist()
        var = self.log_variance.exp().tolist()
        blocks = {}
        j = 0
        for i, b in enumerate(self.blocks):
            rec = {"kind": b.kind, "weights": b.n_weights, "variance": var[i]}
            if b.kind == MATERN:
                rec["lengthscale"] = ell[j]
                j += 1
            blocks[b.name if b.kind == MATERN else f"{b.name} (normal)"] = rec
        return {
            "prior": self.name,
            "rate": self.rate,
            "fit_steps": len(self.trace),
            "convergence": dict(self.convergence),
            "blocks": blocks,
        }

    def __repr__(self) -> str:
        return f"TVPredCPPrior(d={self.d}, blocks={len(self.blocks)} ({len(self.matern)} Matérn), rate={self.rate:.3g})"


register_block_prior(TVPredCPPrior)


def tap_grams(
    prior: TVPredCPPrior,
    image_map: Callable[[torch.Tensor], torch.Tensor],
    *,
    n_samples: int,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    chunk: int = 8,
) -> list[torch.Tensor]:
    """Per Matérn block ``b`` the tap Gram matrices ``Ĝ_b`` ``(m, 9, 9)`` float64 of the TV differences (module
    docstring of :func:`expected_tv`): unbiased estimates of ``G_{b,i} = Σ_f g_{i,f} g_{i,f}ᵀ``, where
    ``g_{i,f} ∈ R⁹`` is the gradient of difference ``i`` of the output with respect to the taps of filter ``f``.

    With one standard normal ``η_f`` per filter, ``z_p = D Φ (η placed at tap p of every filter)`` (9 JVPs) has
    ``E[z_p z_q] = G_pq``; ``Ĝ`` averages ``z zᵀ`` over ``n_samples`` draws of ``η`` (``9 n`` rows through
    ``image_map`` per block, ``9 chunk`` rows per call, drawn from ``generator`` (CPU) in float64). ``Ĝ`` does not
    depend on the hyperparameters, so a fit computes it once.
    """
    grams = []
    for i in prior.matern:
        b = prior.blocks[i]
        n_filters = b.n_weights // 9
        G = None
        for start in range(0, n_samples, chunk):
            k = min(chunk, n_samples - start)
            eta = torch.randn((k, n_filters), generator=generator, dtype=torch.float64)
            rows = torch.zeros((k, 9, prior.d), dtype=torch.float64)
            pos = 0
            for lo, hi in b.segments:
                nf = (hi - lo) // 9
                view = rows[:, :, lo:hi].view(k, 9, nf, 9)
                for p in range(9):
                    view[:, p, :, p] = eta[:, pos : pos + nf]
                pos += nf
            with torch.no_grad():
                X = image_map(rows.reshape(k * 9, prior.d).to(device=device, dtype=dtype)).double().cpu()
            Z = anisotropic_tv(X, prior.image_shape).reshape(k, 9, -1)  # (k, 9 taps, m)
            part = torch.einsum("kpi,kqi->ipq", Z, Z)
            G = part if G is None else G + part
        grams.append(G / n_samples)
    return grams


def expected_tv(
    gram: torch.Tensor, log_lengthscale: torch.Tensor, log_variance: torch.Tensor, a: float
) -> torch.Tensor:
    """``κ = E[TV(Φ v)] = √(2/π) Σ_i √V_i`` for one Matérn block's weights ``v ~ N(0, a⁻¹ σ² (I ⊗ K(ℓ)))`` and
    the anisotropic TV, with ``V_i = σ²/a · tr(K(ℓ) G_i)`` from the tap Gram matrices ``gram`` ``(m, 9, 9)``
    (:func:`tap_grams`); differentiable (any order) in the 0-dim ``log_lengthscale`` and ``log_variance``.

    Exact for the exact ``G`` (``E|N(0, V)| = √(2V/π)``); with :func:`tap_grams`' estimate the only bias is
    Jensen's in the square root, of relative order ``1/n``.
    """
    K = torch.exp(-tap_distances(3) / log_lengthscale.exp()) + _JITTER * torch.eye(9, dtype=torch.float64)
    V = log_variance.exp() / a * torch.einsum("pq,ipq->i", K, gram)
    V = V[V > 1e-300]
    return math.sqrt(2.0 / math.pi) * V.sqrt().sum()


def tv_predcp_terms(
    prior: TVPredCPPrior, grams: list[torch.Tensor], *, a: float
) -> tuple[float, torch.Tensor, list[dict]]:
    """The TV-PredCP log hyperprior ``Σ_b [log λ − λ κ_b + log |∂κ_b/∂t_b|]`` at the prior's current
    hyperparameters, its gradient in ``θ`` (:meth:`TVPredCPPrior.theta` order, ``(n_hyper,)`` float64; it depends on
    ``t_b = log ℓ_b`` and, through ``κ_b ∝ σ_b``, on ``log σ²_b``), and per Matérn block ``κ_b`` and
    ``∂κ_b/∂t_b``. ``grams``: :func:`tap_grams` of the prior; ``a``: the global prior precision (samples have
    covariance ``a⁻¹ L Lᵀ``). No Jacobian products: ``κ_b`` is a closed form of ``Ĝ_b``.
    """
    lam = prior.rate
    theta = prior.theta().requires_grad_(True)
    log_ell, log_var = prior.split(theta)
    total = torch.zeros((), dtype=torch.float64)
    details = []
    for j, i in enumerate(prior.matern):
        kappa = expected_tv(grams[j], log_ell[j], log_var[i], a)
        (k1,) = torch.autograd.grad(kappa, theta, create_graph=True)
        dk = k1[j]
        kv, dv = float(kappa.detach()), float(dk.detach())
        if not (kv > 0 and dv != 0 and math.isfinite(dv)):
            raise FloatingPointError(
                f"TV-PredCP: block {prior.blocks[i].name!r} has expected TV {kv:.3g} with derivative {dv:.3g} in "
                f"log ℓ; the hyperprior is undefined (does the block influence the output?)"
            )
        total = total + math.log(lam) - lam * kappa + dk.abs().log()
        details.append({"block": prior.blocks[i].name, "kappa": kv, "dkappa_dlog_ell": dv})
    (grad,) = torch.autograd.grad(total, theta)
    return float(total.detach()), grad.detach(), details
