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
(:func:`fit_block_prior`, below): the linearised model's log marginal likelihood plus, for every
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

Nothing here is CT: the image shape and the map ``Φ`` from weights to network outputs are passed in
(:meth:`TVPredCPPrior.prepare` takes the image shape and the rate ``λ = scale / TV(g(ṽ))`` from the network output).

**The type-II MAP**, with log-determinant gradients by preconditioned CG and Hutchinson probes (thesis Algorithm 5):
with the measurement covariance ``C(θ) = Ψ₀ L Lᵀ Ψ₀ᵀ / a + σ² I`` (``Ψ₀`` whitened where the noise is per-ray) the
objective

    J(θ, σ²) = log N(ỹ; 0, C) + Σ_b log p_TV(t_b),

maximised over ``θ = (log ℓ_b, log σ²_b)`` (and ``log σ²`` when the likelihood learns it) by a MacKay warm start of
the global scale, then projected L-BFGS with one fixed set of Hutchinson probes, until a recorded convergence
criterion holds (:func:`fit_block_prior`; ``docs/tv_predcp.md`` has the measurements behind it). With
``u = C⁻¹ ỹ`` its marginal-likelihood gradient is ``∂ log N = ½ uᵀ ∂C u − ½ tr(C⁻¹ ∂C)``, and for the prior
hyperparameters ``∂C = Ψ₀ ∂(L Lᵀ) Ψ₀ᵀ / a``, so with ``r = Ψ₀ᵀ u`` and Rademacher probes ``z_k``
(``E[z zᵀ] = I``), ``p_k = Ψ₀ᵀ C⁻¹ z_k``, ``q_k = Ψ₀ᵀ z_k``::

    ∂ log N / ∂θ ≈ ∂/∂θ [ ½ ‖Lᵀ r‖² / a − (1/2m) Σ_k (Lᵀ p_k)·(Lᵀ q_k) / a ]   (r, p_k, q_k held fixed),

which autograd evaluates through the ``9 × 9`` factors of ``L`` at no Jacobian cost; ``∂ log N / ∂ log σ² =
½ σ² ‖u‖² − (σ²/2m) Σ_k z_kᵀ C⁻¹ z_k``. A step is one batched CG solve of ``1 + m`` right-hand sides (the core's
:func:`~ctuq.inference.solvers.cg.pcg` with a Nyström preconditioner of ``K̄(θ)``, :func:`~ctuq.inference.solvers.
preconditioners.randomized_eig`, rebuilt every ``precond_every`` gradients because ``K̄`` moves with ``θ``; during
the MacKay warm start its eigenvalues follow the global scale of the variances exactly),
and ``1 + 2m`` VJPs of ``Ψ₀``; the hyperprior costs ``9 n`` JVPs per Matérn block once, for its tap Gram matrices
(:func:`tap_grams`), and nothing per step (:func:`tv_predcp_terms`).
The log-determinant itself is never computed: the trace records the hyperparameters, the data fit ``−½ ỹᵀ C⁻¹ ỹ``,
the log hyperprior and the gradient norm.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from matplotlib.figure import Figure

from ctuq.inference.block_features import BlockFeatures
from ctuq.inference.features import DenseFeatures, FeatureOperator
from ctuq.inference.kernel import KernelOperator, assemble_features, column_sq_norms
from ctuq.inference.priors.base import PriorError, PriorProblem, WeightPrior
from ctuq.inference.solvers.cg import pcg
from ctuq.inference.solvers.preconditioners import LowRankEig, LowRankPreconditioner, randomized_eig
from ctuq.options import PriorFitOptimizer, option, values
from ctuq.registry import PRIORS
from ctuq.utils import atomic_path
from ctuq.utils import progress as _progress_bar

__all__ = [
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
    "fit_block_prior",
    "mll_gradient",
    "block_gprior_variances",
    "variance_floor",
    "plot_prior_trace",
    "CONVERGENCE_PATIENCE",
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


def _check_int(value, what: str, kind: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise PriorError(f"{what} must be {kind}, got {value!r}")
    return int(value)


def _image_shape(shape: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(int(s) for s in shape)
    if not out or min(out) < 2:
        raise PriorError(f"TVPredCPPrior: {what} must have every side >= 2 for a TV, got {out}")
    return out


@PRIORS.register
class TVPredCPPrior(WeightPrior):
    """The TV-PredCP block prior over the weights of a network (module docstring).

    Parameters
    ----------
    param_shapes : mapping str → shape
        The linearised parameters in flattening order (``LinearizedNetwork.param_names`` with their shapes).
    image_shape : sequence of int, optional
        Shape of one network output (the image) for the TV; ``prod(image_shape)`` must be the output size. Set by
        :meth:`prepare` when not given here.
    rate : float
        ``λ`` of the exponential hyperprior on the expected TV ``κ_b`` (per unit of TV of the network output);
        :meth:`prepare` sets it to ``scale / TV(output)``.
    precond_every : int
        Steps between rebuilds of the fit's preconditioner.
    cg_tol, cg_max_iter
        Relative tolerance and iteration cap of the fit's CG solves.
    block_of : callable, optional
        Parameter name → block key (default :func:`default_block_name`).
    **options
        The fields of :class:`TVPredCPPrior.Options` (the ``uq.tv_predcp`` section; the type-II MAP's are
        :func:`fit_block_prior`'s).

    Attributes
    ----------
    blocks : list of PriorBlock
    log_lengthscale : torch.Tensor
        ``(n_matern,)`` float64, one per Matérn block in :attr:`blocks` order.
    log_variance : torch.Tensor
        ``(n_blocks,)`` float64.
    trace : list of dict
        One record per fit step (:func:`fit_block_prior`).
    convergence : dict
        The fit's convergence check (``converged``, ``criterion``, ``max_change``, ``tolerance``, ``steps``,
        ``evaluations``, ``optimizer``); empty before a fit.
    fitted : bool
        The hyperparameters are final (fitted, given, or loaded): the posterior does not fit again.
    image_map : callable or None
        Rows of network weights ``(B, d)`` → network outputs ``(B, prod(image_shape))`` (``Φ``, for the
        hyperprior's tap Gram matrices): given to :meth:`create` / :meth:`attach`, default the features'
        ``network_matvec``.
    output_tv : float or None
        The anisotropic TV of the output :meth:`prepare` saw (``rate = scale / output_tv``).
    """

    name = "tv_predcp"
    summary_key = "prior"
    # docs/calibration.md: its posterior is too narrow everywhere, so one held-out scale k beats the bias model
    auto_calibration = "heldout"
    TRACE_FIGURE = "tv_predcp_trace.png"
    """File name of the fit's trace figure (:meth:`figures`)."""

    @dataclasses.dataclass
    class Options:
        """The TV-PredCP block prior (``uq.prior = tv_predcp``; ``docs/tv_predcp.md``): its hyperprior rate, initial
        hyperparameters and the type-II MAP that fits them."""

        scale: float = option(
            1.0,
            gt=0.0,
            help="rate λ of the exponential hyperprior on a block's expected sample TV, in units of "
            "1/TV(reconstruction)",
        )
        steps: int = option(
            100,
            ge=0,
            help="most steps of the type-II MAP; it stops earlier once converged (0: keep the initial values)",
        )
        optimizer: str = option(
            "lbfgs",
            choices=values(PriorFitOptimizer),
            help="type-II MAP optimiser: MacKay warm start + projected L-BFGS, or Adam + MacKay every step",
        )
        tol: float = option(
            1e-2, gt=0.0, help="converged when no log-hyperparameter changed by more than this in each of 3 steps"
        )
        max_step: float = option(1.0, gt=0.0, help="largest change of a log-hyperparameter in one L-BFGS step")
        lr: float = option(0.1, gt=0.0, help="Adam step size on the log-hyperparameters (optimizer=adam)")
        probes: int = option(
            8, ge=1, help="Hutchinson probes of the log-determinant gradient (one set for the whole fit)"
        )
        tv_samples: int = option(
            32, ge=1, help="samples per block (9 JVPs each, once) of the tap Gram matrices behind the expected TV"
        )
        lengthscale: float = option(1.0, gt=0.0, help="initial Matérn-½ lengthscale of every 3×3 block (tap spacings)")
        variance: float = option(1.0, gt=0.0, help="initial variance σ²_b of every block (× 1/a)")
        precond_rank: int = option(400, ge=1, help="Nyström preconditioner rank of the fit's CG solves")

    def __init__(
        self,
        param_shapes: Mapping[str, Sequence[int]],
        *,
        image_shape: Sequence[int] | None = None,
        rate: float = 1.0,
        precond_every: int = 10,
        cg_tol: float = 1e-3,
        cg_max_iter: int = 300,
        block_of: Callable[[str], str] | None = None,
        **options,
    ):
        fields = [f.name for f in dataclasses.fields(self.Options)]
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise PriorError(f"TVPredCPPrior: unknown option(s) {unknown}; its options: {', '.join(fields)}")
        opts = self.Options(**options)
        self.scale = _check_positive(opts.scale, "uq.tv_predcp.scale")
        self.rate = _check_positive(rate, "uq.tv_predcp.scale (the TV-PredCP rate λ)")
        ell = _check_positive(opts.lengthscale, "uq.tv_predcp.lengthscale")
        if not LENGTHSCALE_MIN <= ell <= LENGTHSCALE_MAX:
            raise PriorError(
                f"uq.tv_predcp.lengthscale must lie in [{LENGTHSCALE_MIN:g}, {LENGTHSCALE_MAX:g}] tap spacings, "
                f"got {ell}"
            )
        var = _check_positive(opts.variance, "uq.tv_predcp.variance")
        self.steps, self.probes, self.tv_samples = (
            _check_int(getattr(opts, k), f"uq.tv_predcp.{k}", f"an int >= {low}", low)
            for k, low in (("steps", 0), ("probes", 1), ("tv_samples", 1))
        )
        self.precond_rank, self.precond_every, self.cg_max_iter = (
            _check_int(value, what, "a positive int", 1)
            for value, what in (
                (opts.precond_rank, "uq.tv_predcp.precond_rank"),
                (precond_every, "TVPredCPPrior: precond_every"),
                (cg_max_iter, "TVPredCPPrior: cg_max_iter"),
            )
        )
        self.lr = _check_positive(opts.lr, "uq.tv_predcp.lr")
        self.tol = _check_positive(opts.tol, "uq.tv_predcp.tol")
        self.max_step = _check_positive(opts.max_step, "uq.tv_predcp.max_step")
        if opts.optimizer not in OPTIMIZERS:
            raise PriorError(f"uq.tv_predcp.optimizer must be one of {', '.join(OPTIMIZERS)}, got {opts.optimizer!r}")
        self.optimizer = str(opts.optimizer)
        self.cg_tol = _check_positive(cg_tol, "TVPredCPPrior: cg_tol")
        self.image_shape = None if image_shape is None else _image_shape(image_shape, "image_shape")
        self.param_shapes = {str(k): tuple(int(s) for s in v) for k, v in param_shapes.items()}
        self.blocks = block_layout(self.param_shapes, block_of)
        self.d = sum(b.n_weights for b in self.blocks)
        self.matern = [i for i, b in enumerate(self.blocks) if b.kind == MATERN]
        self.log_lengthscale = torch.full((len(self.matern),), math.log(ell), dtype=torch.float64)
        self.log_variance = torch.full((len(self.blocks),), math.log(var), dtype=torch.float64)
        self.dist = tap_distances(3)
        self.trace: list[dict] = []
        self.convergence: dict = {}
        self.fitted = self.steps == 0
        self.image_map: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.output_tv: float | None = None
        # (start, stop, block index) of every segment in flat order: L is applied segment by segment
        self._pieces = sorted((lo, hi, i) for i, b in enumerate(self.blocks) for lo, hi in b.segments)

    # ------------------------------------------------------------------------------------------ making
    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The constructor's options, the :attr:`Options` fields and ``image_map`` (:meth:`create`)."""
        return super().option_names() | {"image_map"}

    @classmethod
    def create(
        cls,
        features: FeatureOperator,
        *,
        param_shapes: Mapping[str, Sequence[int]] | None = None,
        image_map: Callable[[torch.Tensor], torch.Tensor] | None = None,
        **options,
    ) -> TVPredCPPrior:
        """The prior over the weights of ``features.network`` (a :class:`~ctuq.inference.LinearizedFeatures`), or of
        the given ``param_shapes``; ``image_map`` defaults to ``features.network_matvec``; ``options`` are the
        constructor's."""
        cls.check_option_names(options)
        if param_shapes is None:
            net = getattr(features, "network", None)
            if net is None:
                raise ValueError(
                    f"LinearizedPosterior: prior {cls.name!r} needs prior_options['param_shapes'] (these features "
                    f"have no network to read the parameter shapes from)"
                )
            param_shapes = {n: tuple(t.shape) for n, t in net.unflatten(net.params()).items()}
        prior = cls(param_shapes, **options)
        prior.attach(features, image_map=image_map)
        return prior

    def attach(
        self, features: FeatureOperator, *, image_map: Callable[[torch.Tensor], torch.Tensor] | None = None, **options
    ) -> None:
        """Check ``d`` against the features and take the image map ``Φ`` of the fit: ``image_map``, else the one
        already set, else ``features.network_matvec`` (a prior still to be fitted needs one)."""
        super().attach(features, **options)
        if image_map is not None:
            self.image_map = image_map
        elif self.image_map is None:
            self.image_map = getattr(features, "network_matvec", None)
        if self.image_map is None and not self.fitted:
            raise ValueError(
                f"LinearizedPosterior: fitting the {self.name} prior needs prior_options['image_map'] (network "
                f"weights → outputs); these features have no network_matvec"
            )

    def prepare(self, *, output: torch.Tensor, output_shape: Sequence[int]) -> None:
        """``image_shape ← output_shape`` and ``rate ← scale / TV(output)``: ``uq.tv_predcp.scale`` is in units of
        the anisotropic TV of the network output ``g(ṽ)`` (flat ``(prod(output_shape),)``; CT: the reconstruction),
        so the hyperprior does not depend on the image's units or size. Call it before :meth:`setup`."""
        shape = _image_shape(output_shape, "the output shape")
        if output.numel() != math.prod(shape):
            raise PriorError(
                f"TVPredCPPrior.prepare: the output has {output.numel()} values, not the {math.prod(shape)} of an "
                f"image of shape {shape}"
            )
        tv = float(anisotropic_tv(output.reshape(1, -1).double(), shape).abs().sum())
        if not tv > 0:
            raise PriorError(
                "uq.prior = tv_predcp: the reconstruction is constant (zero TV), so uq.tv_predcp.scale has no unit"
            )
        self.image_shape = shape
        self.rate = _check_positive(self.scale / tv, "uq.tv_predcp.scale (the TV-PredCP rate λ)")
        self.output_tv = tv

    # ------------------------------------------------------------------------------------------ fit
    def fit(self, problem: PriorProblem) -> float:
        """Type-II MAP of the hyperparameters (:func:`fit_block_prior`) on the whitened ``Ψ₀`` (the assembled one
        when there is one); returns ``σ²`` (learned with ``problem.learn_noise``)."""
        if self.image_map is None:
            raise ValueError(f"{type(self).__name__}.fit: no image_map (network weights → outputs) was given")
        if self.image_shape is None:
            raise PriorError(
                "TVPredCPPrior.fit: no image shape; give image_shape, or prepare(output=..., output_shape=...) first"
            )
        # an assembled Ψ₀ serves the fit's many products in the features' dtype (float32 is twice as fast; the
        # fit's CG stops at rtol 1e-3 anyway)
        base = problem.features if problem.dense is None else DenseFeatures(problem.dense.to(problem.features.dtype))
        problem.say(f"{self.name} prior: type-II MAP of {self.n_hyper} hyperparameters ({self.steps} steps)")
        return fit_block_prior(
            self,
            base,
            problem.targets,
            a=problem.a,
            sigma2=problem.sigma2,
            image_map=self.image_map,
            learn_noise=problem.learn_noise,
            seed=problem.seed,
            progress=problem.progress,
            log=problem.log,
        )

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
            "image_shape": None if self.image_shape is None else list(self.image_shape),
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
        """The rate, per block its kind, weights, lengthscale (Matérn) and variance; the fit's steps, convergence
        check and trace (:func:`fit_block_prior` records); ``tv_reconstruction``, the output TV of :meth:`prepare`
        (``None`` without)."""
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
            "tv_reconstruction": self.output_tv,
            "trace": [dict(r) for r in self.trace],
        }

    def figures(self, out_dir: str | Path) -> list[Path]:
        """The fit's trace (:func:`plot_prior_trace`) as :attr:`TRACE_FIGURE` in ``out_dir``, once there is one."""
        if not self.trace:
            return []
        return [plot_prior_trace(Path(out_dir) / self.TRACE_FIGURE, self.trace)]

    def __repr__(self) -> str:
        return f"TVPredCPPrior(d={self.d}, blocks={len(self.blocks)} ({len(self.matern)} Matérn), rate={self.rate:.3g})"


# ---------------------------------------------------------------------------------------------- the hyperprior
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


# ---------------------------------------------------------------------------------------------- the type-II MAP
def _rademacher(m: int, c: int, generator: torch.Generator, dtype, device) -> torch.Tensor:
    z = torch.randint(0, 2, (m, c), generator=generator, dtype=torch.int8)
    return (2 * z - 1).to(device=device, dtype=dtype)


def mll_gradient(
    prior: TVPredCPPrior,
    base: FeatureOperator,
    targets: torch.Tensor,
    *,
    a: float,
    sigma2: float,
    n_probes: int,
    generator: torch.Generator | None = None,
    probes: torch.Tensor | None = None,
    learn_noise: bool = False,
    preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rtol: float = 1e-3,
    max_iter: int = 300,
) -> tuple[torch.Tensor, dict]:
    """Stochastic gradient of ``log N(ỹ; 0, C(θ))`` (module docstring) at the prior's current hyperparameters.

    Returns ``(g, info)``: ``g`` ``(n_hyper [+ 1],)`` float64 in :meth:`TVPredCPPrior.theta` order, then
    ``∂/∂ log σ²`` when ``learn_noise``; ``info``: ``data_fit`` (``−½ ỹᵀC⁻¹ỹ``), MacKay's ``gamma``
    (``c − σ² tr C⁻¹``), ``weight_norm_sq`` (``‖w*‖²``) and ``residual_norm_sq`` (``‖ỹ − Ψw*‖²``),
    ``cg_max_iterations``, ``cg_max_residual``. ``base``: the (whitened) ``Ψ₀``; ``targets`` ``(c,)``; the
    Rademacher probes ``probes`` ``(n_probes, c)`` when given (the fit keeps one set for all its steps: a
    deterministic gradient field), else drawn from ``generator`` (CPU).
    """
    c = base.n_outputs
    F = BlockFeatures(base, prior)
    y = targets.to(device=base.device, dtype=base.dtype)
    if probes is None:
        if generator is None:
            raise ValueError("mll_gradient: give probes or a generator to draw them from")
        Z = _rademacher(n_probes, c, generator, base.dtype, base.device)
    else:
        if tuple(probes.shape) != (n_probes, c):
            raise ValueError(f"mll_gradient: probes must be ({n_probes}, {c}), got {tuple(probes.shape)}")
        Z = probes.to(device=base.device, dtype=base.dtype)

    def matmul(X: torch.Tensor) -> torch.Tensor:
        return F.matvec(F.rmatvec(X)) / a + sigma2 * X

    V, stats = pcg(
        matmul, torch.cat([y[None], Z]), preconditioner=preconditioner, rtol=rtol, max_iter=max_iter, warn=False
    )
    U, Vz = V[0], V[1:]
    G = base.rmatvec(torch.cat([U[None], Vz, Z])).double()
    r, P, Q = G[0:1], G[1 : 1 + n_probes], G[1 + n_probes :]
    theta = prior.theta().requires_grad_(True)
    factors = prior.factors(theta)
    fit = 0.5 * prior.apply_t(r, factors).pow(2).sum() / a
    trace = 0.5 * (prior.apply_t(P, factors) * prior.apply_t(Q, factors)).sum() / (n_probes * a)
    (g,) = torch.autograd.grad(fit - trace, theta)
    g = g.detach()
    u = U.double()
    if learn_noise:
        g_noise = 0.5 * sigma2 * float(u @ u) - 0.5 * sigma2 * float((Z.double() * Vz.double()).sum()) / n_probes
        g = torch.cat([g, torch.tensor([g_noise], dtype=torch.float64)])
    info = {
        "data_fit": -0.5 * float(u @ y.double()),
        # for MacKay's updates: γ = c − σ² tr C⁻¹, ‖w*‖² = ‖Lᵀ Ψ₀ᵀ u‖²/a², ‖ỹ − Ψw*‖² = σ⁴‖u‖²
        "gamma": c - sigma2 * float((Z.double() * Vz.double()).sum()) / n_probes,
        "weight_norm_sq": float(prior.apply_t(r).pow(2).sum()) / a**2,
        "residual_norm_sq": sigma2**2 * float(u @ u),
        "cg_max_iterations": stats.max_iterations,
        "cg_max_residual": float(stats.relative_residual.max()),
    }
    return g, info


def block_gprior_variances(prior: TVPredCPPrior, base: FeatureOperator, *, seed: int = 0, probes: int = 64):
    """Initial variances ``σ²_b = 1 / mean_{i∈b} ‖Ψ₀[:, i]‖²`` ``(n_blocks,)`` float64: the g-prior averaged over each
    block (every weight's prior variance in units of its effect on the data). Exact column norms for dense ``Ψ₀``,
    else ``probes`` Rademacher probes (:func:`~ctuq.inference.kernel.column_sq_norms`, ``probes`` VJPs)."""
    if isinstance(base, DenseFeatures):
        sq = base.matrix.double().pow(2).sum(0)
    else:
        sq = column_sq_norms(
            base.rmatvec,
            base.n_outputs,
            method="stochastic",
            n_probes=probes,
            seed=seed,
            dtype=base.dtype,
            device=base.device,
        )
    sq = sq.double().cpu()
    out = []
    for b in prior.blocks:
        mean = float(torch.cat([sq[lo:hi] for lo, hi in b.segments]).mean())
        out.append(1.0 / mean if mean > 0 else 1.0)
    return torch.tensor(out, dtype=torch.float64)


class _GradientOracle:
    """``∂J/∂x`` of the MAP objective at ``x = (θ[, log σ²])`` (module docstring) with one fixed set of Hutchinson
    probes, the tap Gram matrices and a Nyström preconditioner rebuilt every ``precond_every`` evaluations; also
    what the MacKay updates and the trace need (``info``, the log hyperprior, ``κ_b``)."""

    def __init__(self, prior, base, targets, *, a, grams, probes, learn_noise, seed):
        self.prior, self.base, self.targets, self.a = prior, base, targets, a
        self.grams, self.probes, self.learn_noise, self.seed = grams, probes, learn_noise, int(seed)
        self.features = BlockFeatures(base, prior)
        self.rank = min(prior.precond_rank, base.n_outputs)
        self.evaluations = 0
        self.exact_fallbacks = 0
        self.eig = None
        self.since = 1.0  # global variance factor applied since the last rebuild: K̄ scales by it exactly

    def __call__(self, theta: torch.Tensor, sigma2: float):
        prior = self.prior
        prior.set_theta(theta)
        fresh = self.evaluations % prior.precond_every == 0
        if fresh:
            self._rebuild()
        self.evaluations += 1
        g, info = self._gradient(sigma2)
        if info["cg_max_residual"] > CG_FAILURE * prior.cg_tol and not fresh:
            # a preconditioner built for hyperparameters far from these can stall or derail CG (measured: rank 100
            # on the 64² walnut, residuals 10³ after a block variance grew ×1000): rebuild it here and solve again
            self._rebuild()
            g, info = self._gradient(sigma2)
        if info["cg_max_residual"] > CG_FAILURE * prior.cg_tol and self.base.n_outputs <= EXACT_FALLBACK_ROWS:
            # a fresh low-rank preconditioner that still fails leaves too much of K̄'s spectrum above σ² (measured:
            # per-ray 64² scans at 60 angles, rank 400 and 1000, CG at its cap from step ~35): with few rows, C⁻¹
            # itself by a dense Cholesky preconditions exactly, at the cost of c products of K̄ per gradient
            g, info = self._gradient(sigma2, preconditioner=self._exact_inverse(sigma2))
            self.exact_fallbacks += 1
        if info["cg_max_residual"] > CG_FAILURE * prior.cg_tol:
            raise FloatingPointError(
                f"TV-PredCP fit: CG did not converge (relative residual {info['cg_max_residual']:.3g} after "
                f"{info['cg_max_iterations']} iterations, tolerance {prior.cg_tol:g})"
            )
        hp, g_hp, details = tv_predcp_terms(prior, self.grams, a=self.a)
        g[: prior.n_hyper] += g_hp
        if not torch.isfinite(g).all():
            raise FloatingPointError(f"TV-PredCP fit: the gradient is not finite at θ = {theta.tolist()}")
        return g, info, hp, details

    def _rebuild(self) -> None:
        self.eig = randomized_eig(KernelOperator(features=self.features), self.rank, seed=self.seed + self.evaluations)
        self.since = 1.0

    def _exact_inverse(self, sigma2: float) -> Callable[[torch.Tensor], torch.Tensor]:
        """``R ↦ C⁻¹ R`` for rows ``R`` ``(k, c)``, ``C = K̄/a + σ²I`` assembled from ``c`` products of ``K̄`` (unit
        rows) and factored by Cholesky in float64."""
        base = self.base
        eye = torch.eye(base.n_outputs, dtype=base.dtype, device=base.device)
        K = self.features.matvec(self.features.rmatvec(eye)).double()
        C = 0.5 * (K + K.T) / self.a + sigma2 * torch.eye(base.n_outputs, dtype=torch.float64, device=base.device)
        factor = torch.linalg.cholesky(C)

        def apply(R: torch.Tensor) -> torch.Tensor:
            return torch.cholesky_solve(R.double().T, factor).T.to(R.dtype)

        return apply

    def _gradient(self, sigma2: float, preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None):
        prior = self.prior
        if preconditioner is None:
            eig = LowRankEig(self.eig.U, self.eig.eigenvalues * self.since, self.eig.n_products, self.eig.method)
            preconditioner = LowRankPreconditioner(eig).inverse(self.a, sigma2)
        return mll_gradient(
            prior,
            self.base,
            self.targets,
            a=self.a,
            sigma2=sigma2,
            n_probes=prior.probes,
            probes=self.probes,
            learn_noise=self.learn_noise,
            preconditioner=preconditioner,
            rtol=prior.cg_tol,
            max_iter=prior.cg_max_iter,
        )


def _two_loop(g: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """L-BFGS direction ``H g`` (``H``: the inverse-Hessian estimate of ``−J`` from ``pairs`` ``(s, y)``, with
    ``y = −Δ∂J``), an ascent direction of ``J`` (Nocedal & Wright, Algorithm 7.4)."""
    q = g.clone()
    alphas = []
    for s_, y_ in reversed(pairs):
        rho = 1.0 / float(y_ @ s_)
        al = rho * float(s_ @ q)
        q -= al * y_
        alphas.append((rho, al))
    s_, y_ = pairs[-1]
    q *= float(s_ @ y_) / float(y_ @ y_)
    for (s_, y_), (rho, al) in zip(pairs, reversed(alphas)):
        q += (al - rho * float(y_ @ q)) * s_
    return q


def fit_block_prior(
    prior: TVPredCPPrior,
    base: FeatureOperator,
    targets: torch.Tensor,
    *,
    a: float,
    sigma2: float,
    image_map: Callable[[torch.Tensor], torch.Tensor],
    learn_noise: bool = False,
    seed: int = 0,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    callback: Callable[[dict], None] | None = None,
) -> float:
    """Type-II MAP of ``prior``'s hyperparameters (module docstring); sets them, appends one record per step to
    ``prior.trace``, sets ``prior.convergence``, marks the prior fitted and returns the final ``σ²``.

    The variances start at ``prior``'s initial variance times :func:`block_gprior_variances`. One set of
    ``prior.probes`` Rademacher probes serves every step, so the gradient is a deterministic function of the
    hyperparameters (fresh probes make it a random one whose noise keeps the iterates moving). Then, for
    ``prior.optimizer``:

    * ``"lbfgs"`` (default): (1) a MacKay warm start: steps that move only the *global* scale of the variances
      (all ``σ²_b`` by one factor) and, with ``learn_noise``, ``σ²`` by the updates the EM uses (``γ = c − σ² tr
      C⁻¹`` by Hutchinson, ``‖w*‖² = ‖Lᵀ Ψ₀ᵀ u‖²/a²``, variances × ``a γ⁻¹ ‖w*‖²``, ``σ² ← σ⁴‖u‖²/(c − γ)``),
      until both change by less than 10 % (at most 10 steps): the evidence's global scale is often orders of
      magnitude from any initial guess; (2) projected L-BFGS on ``x = (log ℓ_b, log σ²_b[, log σ²])`` in the box
      ``log ℓ_b ∈ [log LENGTHSCALE_MIN, log LENGTHSCALE_MAX]``, ``σ²_b ≥`` :func:`variance_floor` (below it a block
      changes ``log det C`` by less than 1; the 1×1 skip blocks' evidence optimum is at ``σ²_b → 0``),
      steps capped at ``prior.max_step`` per coordinate, a line search on the directional derivative only (no
      log-determinant value is computed): a step is halved (secant) while ``∂J`` along it turned to below ``−0.9``
      times its initial value.
    * ``"adam"``: the first method: every step an Adam step (size ``prior.lr``) on ``θ`` plus the MacKay updates.

    Convergence (:attr:`TVPredCPPrior.convergence`): every log-hyperparameter (and ``log σ²``) changed by at most
    ``prior.tol`` in each of the last ``CONVERGENCE_PATIENCE`` steps (relative changes below ``tol``); the fit
    stops there, or after ``prior.steps`` steps (then ``converged`` is false).

    ``base``: the (whitened) unscaled features ``Ψ₀`` (``c × d``, dense or matrix-free; a matrix-free one with
    ``c·d ≤ ASSEMBLE_LIMIT`` is assembled for the fit, ``min(c, d)`` products); ``targets``: ``ỹ``
    ``(c,)`` (whitened alike); ``a``: the global prior precision (held fixed; the variances carry the scale);
    ``image_map``: rows of network weights ``(B, d)`` → network outputs ``(B, prod(prior.image_shape))`` (``Φ``);
    ``seed``: probes, tap-Gram samples and preconditioner sketches. ``callback(record)`` after every step.
    Record keys: ``step``, ``phase`` (``"mackay"``, ``"lbfgs"`` or ``"adam"``), ``lengthscale`` / ``variance``
    (lists, :attr:`TVPredCPPrior.blocks` order of Matérn / all blocks), ``sigma2``, ``data_fit``,
    ``log_hyperprior``, ``kappa`` (per Matérn block), ``gamma``, ``mackay_scale``, ``grad_norm`` (of the free
    coordinates), ``max_change`` (largest change of a log-hyperparameter in the step), ``evaluations`` (gradients
    computed in the step), ``cg_max_iterations``, ``cg_max_residual``, ``time_s``.
    """
    say = log or (lambda _m: None)
    gen = torch.Generator().manual_seed(int(seed))
    c = base.n_outputs
    start = len(prior.trace)
    if not isinstance(base, DenseFeatures) and c * base.n_features <= ASSEMBLE_LIMIT:
        # a fit takes ~100 gradients of 1 + probes CG solves (~10 iterations each) plus preconditioner sketches:
        # far more products than the min(c, d) that assemble Ψ₀ once
        t0 = time.perf_counter()
        base = DenseFeatures(assemble_features(base, by="auto").to(base.dtype))
        say(f"TV-PredCP: Ψ₀ ({c} × {base.n_features}) assembled for the fit: {time.perf_counter() - t0:.1f} s")
    g_var = block_gprior_variances(prior, base, seed=seed)
    if start == 0:
        theta = prior.theta()
        theta[len(prior.matern) :] += g_var.log()
        prior.set_theta(theta)
    t0 = time.perf_counter()
    grams = tap_grams(prior, image_map, n_samples=prior.tv_samples, generator=gen, dtype=base.dtype, device=base.device)
    say(
        f"TV-PredCP: tap Gram matrices of {len(grams)} blocks from {9 * prior.tv_samples} JVPs each: "
        f"{time.perf_counter() - t0:.1f} s"
    )
    probes = _rademacher(prior.probes, c, gen, base.dtype, base.device)
    oracle = _GradientOracle(prior, base, targets, a=a, grams=grams, probes=probes, learn_noise=learn_noise, seed=seed)
    run = _fit_adam if prior.optimizer == "adam" else _fit_lbfgs
    bar = _progress_bar(total=prior.steps, desc="TV-PredCP fit", disable=not progress)
    state = {"last_log": -10}

    def emit(record: dict) -> None:
        record["step"] = len(prior.trace)
        prior.trace.append(record)
        bar.update(1)
        if callback is not None:
            callback(record)
        k = record["step"]
        if k - state["last_log"] >= 10 or k == 0:
            state["last_log"] = k
            say(
                f"TV-PredCP step {k} ({record['phase']}): ℓ {', '.join(f'{v:.3g}' for v in record['lengthscale'])}; "
                f"σ²_b {', '.join(f'{v:.3g}' for v in record['variance'])}; σ² {record['sigma2']:.4g}; −½ỹᵀC⁻¹ỹ "
                f"{record['data_fit']:.5g}; log p_TV {record['log_hyperprior']:.4g}; γ {record['gamma']:.4g}; "
                f"max |Δ log| {record['max_change']:.2g}; CG ≤ {record['cg_max_iterations']} it."
            )

    try:
        s2 = run(prior, oracle, a=a, sigma2=float(sigma2), c=c, learn_noise=learn_noise, g_var=g_var, emit=emit)
    except FloatingPointError as exc:
        raise PriorError(
            f"uq.tv_predcp: the type-II MAP failed after {len(prior.trace) - start} steps: {exc}; a larger "
            f"uq.tv_predcp.precond_rank (now {prior.precond_rank}) makes its CG solves converge"
        ) from exc
    finally:
        bar.close()
    trace = prior.trace[start:]
    conv = _convergence(trace, prior.tol)
    conv.update(
        steps=len(trace),
        evaluations=oracle.evaluations,
        optimizer=prior.optimizer,
        # gradients solved again with the dense C⁻¹ after the low-rank preconditioner failed (EXACT_FALLBACK_ROWS)
        exact_fallbacks=oracle.exact_fallbacks,
    )
    prior.convergence = conv
    say(
        f"TV-PredCP fit {'converged' if conv['converged'] else 'did NOT converge'} after {len(trace)} steps "
        f"({oracle.evaluations} gradients): largest change of a log-hyperparameter over the last "
        f"{CONVERGENCE_PATIENCE} steps {'n/a' if conv['max_change'] is None else format(conv['max_change'], '.2g')} "
        f"(tolerance {prior.tol:g})"
    )
    prior.fitted = True
    return s2


CONVERGENCE_PATIENCE = 3  # steps in a row whose changes must all be below the tolerance


def _convergence(trace: list[dict], tol: float) -> dict:
    """``converged`` when each of the last :data:`CONVERGENCE_PATIENCE` records changed every log-hyperparameter
    by at most ``tol``; ``max_change`` is the largest such change over those records (``None`` if too few)."""
    last = [r["max_change"] for r in trace[-CONVERGENCE_PATIENCE:]]
    worst = max(last) if len(last) == CONVERGENCE_PATIENCE else None
    return {
        "converged": worst is not None and worst <= tol,
        "criterion": f"max |Δ log hyperparameter| <= {tol:g} in each of the last {CONVERGENCE_PATIENCE} steps",
        "max_change": worst,
        "tolerance": tol,
    }


def variance_floor(prior: TVPredCPPrior, g_var: torch.Tensor, *, a: float, sigma2: float) -> torch.Tensor:
    """Lower bounds ``(n_blocks,)`` float64 of ``log σ²_b``: the variance at which block ``b`` adds
    ``VARIANCE_FLOOR σ²`` (``σ²``) to the trace of ``C`` (its ``tr Ψ₀_b Ψ₀_bᵀ σ²_b / a``, with independent taps), so
    that it changes ``log det C`` by at most 1. The evidence of the U-Net's 1×1 skip blocks has its optimum at
    ``σ²_b → 0``, which a log-parametrised fit approaches without end (and slowly: the gradient vanishes with
    ``σ²_b``); at the floor the coordinate stops. Measured on a 32² walnut case: the exact MAP objective at the
    floor is 0.09 nats below the one at ``σ²_b → 0`` (0.009 at a 10× lower floor, which left the 64² fit still
    walking down after 100 steps), well inside the 4-nat bias of 8 fixed Hutchinson probes.
    ``g_var``: :func:`block_gprior_variances` (``1 / mean ‖Ψ₀[:, i]‖²`` per block)."""
    n = torch.tensor([float(b.n_weights) for b in prior.blocks], dtype=torch.float64)
    return torch.log(VARIANCE_FLOOR * a * sigma2 * g_var / n)


def _record(prior, info, hp, details, s2, g, phase, scale, change, evaluations, t0) -> dict:
    return {
        "phase": phase,
        "lengthscale": prior.log_lengthscale.exp().tolist(),
        "variance": prior.log_variance.exp().tolist(),
        "sigma2": s2,
        "data_fit": info["data_fit"],
        "log_hyperprior": hp,
        "kappa": [dd["kappa"] for dd in details],
        "gamma": info["gamma"],
        "mackay_scale": scale,
        "grad_norm": float(g.norm()),
        "max_change": change,
        "evaluations": evaluations,
        "cg_max_iterations": info["cg_max_iterations"],
        "cg_max_residual": info["cg_max_residual"],
        "time_s": time.perf_counter() - t0,
    }


def _mackay(info: dict, *, a: float, c: int, s2: float, learn_noise: bool) -> tuple[float, float]:
    """MacKay's factor on all variances and the new ``σ²`` (``(1, σ²)`` where ``γ`` is not a usable estimate)."""
    gamma, wnorm = info["gamma"], info["weight_norm_sq"]
    if not (0 < gamma < c and wnorm > 0):
        return 1.0, s2
    return a / (gamma / wnorm), (info["residual_norm_sq"] / (c - gamma) if learn_noise else s2)


def _fit_lbfgs(prior, oracle, *, a, sigma2, c, learn_noise, g_var, emit) -> float:
    m, n = len(prior.matern), prior.n_hyper
    s2 = sigma2
    steps = 0
    # (1) MacKay warm start of the global scale and σ²
    for _ in range(min(MACKAY_WARMUP, prior.steps)):
        t0 = time.perf_counter()
        theta = prior.theta()
        g, info, hp, details = oracle(theta, s2)
        scale, s2_new = _mackay(info, a=a, c=c, s2=s2, learn_noise=learn_noise)
        theta[m:] += math.log(scale)
        oracle.since *= scale
        change = max(abs(math.log(scale)), abs(math.log(s2_new / s2)))
        prior.set_theta(theta)
        emit(_record(prior, info, hp, details, s2_new, g[:n], "mackay", scale, change, 1, t0))
        s2 = s2_new
        steps += 1
        if change < 0.1:
            break
    # (2) projected L-BFGS on x = (θ[, log σ²])
    f64 = torch.float64
    lo = torch.cat(
        [torch.full((m,), math.log(LENGTHSCALE_MIN), dtype=f64), variance_floor(prior, g_var, a=a, sigma2=s2)]
    )
    hi = torch.cat([torch.full((m,), math.log(LENGTHSCALE_MAX), dtype=f64), torch.full((n - m,), math.inf, dtype=f64)])
    if learn_noise:
        lo, hi = torch.cat([lo, torch.tensor([-math.inf])]), torch.cat([hi, torch.tensor([math.inf])])

    def split(x):
        return x[:n], (math.exp(float(x[n])) if learn_noise else s2)

    x = prior.theta()
    x[m:] = torch.maximum(x[m:], lo[m:n])
    if learn_noise:
        x = torch.cat([x, torch.tensor([math.log(s2)], dtype=torch.float64)])
    theta, s2 = split(x)
    g, info, hp, details = oracle(theta, s2)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    while steps < prior.steps:
        t0 = time.perf_counter()
        free = ~(((x <= lo) & (g < 0)) | ((x >= hi) & (g > 0)))
        gf = torch.where(free, g, torch.zeros_like(g))
        if float(gf.abs().max()) == 0.0:
            break  # every coordinate at a bound it is pushed against: a stationary point of the box problem
        p = _two_loop(gf, pairs) if pairs else _gradient_step(gf)
        p = torch.where(free, p, torch.zeros_like(p))
        if float(gf @ p) <= 0:  # the curvature pairs do not give an ascent direction: restart
            pairs.clear()
            p = _gradient_step(gf)
        p *= min(1.0, prior.max_step / float(p.abs().max()))
        found, evaluations, alpha = _line_search(oracle, split, x, g, p, lo, hi)
        if found is None and pairs:
            # the curvature pairs can point far off once the objective's curvature has changed (a block variance
            # moved by orders of magnitude): forget them and take a short gradient step, as at the start, before
            # giving up (measured: a per-ray 64² walnut fit stopped here at step 36 with 10 pairs)
            pairs.clear()
            p = _gradient_step(gf)
            found, more, alpha = _line_search(oracle, split, x, g, p, lo, hi)
            evaluations += more
        if found is None:
            prior.set_theta(x[:n])
            raise FloatingPointError(
                f"TV-PredCP fit step {steps}: no step along the L-BFGS direction or the gradient gave a finite "
                f"gradient that does not overshoot (last step size {alpha:.3g})"
            )
        x_new, g_new, info_new, hp_new, details_new = found
        s_vec, y_vec = x_new - x, -(g_new - g)
        if float(s_vec @ y_vec) > 1e-10 * float(s_vec.norm() * y_vec.norm()):
            pairs.append((s_vec, y_vec))
            del pairs[:-LBFGS_MEMORY]
        x, g, info, hp, details = x_new, g_new, info_new, hp_new, details_new
        theta, s2 = split(x)
        prior.set_theta(theta)
        gfree = torch.where(~(((x <= lo) & (g < 0)) | ((x >= hi) & (g > 0))), g, torch.zeros_like(g))
        emit(_record(prior, info, hp, details, s2, gfree, "lbfgs", 1.0, float(s_vec.abs().max()), evaluations, t0))
        steps += 1
        recent = prior.trace[-CONVERGENCE_PATIENCE:]
        if all(r["phase"] == "lbfgs" for r in recent) and _convergence(recent, prior.tol)["converged"]:
            break
    return s2


def _gradient_step(gf: torch.Tensor) -> torch.Tensor:
    """The short steepest-ascent step along the projected gradient ``gf`` (zero on coordinates held at a bound) that
    starts and restarts L-BFGS: its largest coordinate change is :data:`LBFGS_FIRST_STEP` log units."""
    return gf * (LBFGS_FIRST_STEP / float(gf.abs().max()))


def _line_search(oracle, split, x, g, p, lo, hi):
    """Backtracking along the ascent direction ``p`` from ``x`` (gradient ``g``) inside the box ``[lo, hi]``: the first
    step whose gradient is finite and has not turned below ``−0.9×`` the initial directional derivative.
    Returns ``(found, evaluations, alpha)`` with ``found = (x_new, g_new, info, hp, details)``, or ``None`` when
    :data:`LINE_SEARCH_TRIES` steps all failed."""
    alpha = 1.0
    for tries in range(1, LINE_SEARCH_TRIES + 1):
        x_new = torch.minimum(torch.maximum(x + alpha * p, lo), hi)
        theta_new, s2_new = split(x_new)
        try:
            g_new, info_new, hp_new, details_new = oracle(theta_new, s2_new)
        except (FloatingPointError, torch.linalg.LinAlgError):
            alpha *= 0.25
            continue
        dx = x_new - x
        d0, d1 = float(g @ dx), float(g_new @ dx)
        if d1 >= -0.9 * d0:
            return (x_new, g_new, info_new, hp_new, details_new), tries, alpha
        alpha *= min(0.5, max(0.1, d0 / (d0 - d1)))  # secant zero of ∂J along the step
    return None, LINE_SEARCH_TRIES, alpha


def _fit_adam(prior, oracle, *, a, sigma2, c, learn_noise, g_var, emit) -> float:
    m = len(prior.matern)
    x = prior.theta()
    s2 = sigma2
    # Adam (Kingma & Ba, default betas) written out: torch.optim's first use imports torch._dynamo, measured 20 s
    # on the 2-core CI machine, longer than a small fit itself.
    m1, m2 = torch.zeros_like(x), torch.zeros_like(x)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for step in range(prior.steps):
        t0 = time.perf_counter()
        g, info, hp, details = oracle(x, s2)
        g = g[: prior.n_hyper]
        k = step + 1
        m1 = beta1 * m1 + (1 - beta1) * g
        m2 = beta2 * m2 + (1 - beta2) * g * g
        old = x.clone()
        x = x + prior.lr * (m1 / (1 - beta1**k)) / ((m2 / (1 - beta2**k)).sqrt() + eps)  # ascent: J is maximised
        scale, s2_new = _mackay(info, a=a, c=c, s2=s2, learn_noise=learn_noise)
        x[m:] += math.log(scale)
        oracle.since *= scale
        prior.set_theta(x)
        x = prior.theta()  # lengthscales clipped to their range
        change = max(float((x - old).abs().max()), abs(math.log(s2_new / s2)))
        s2 = s2_new
        emit(_record(prior, info, hp, details, s2, g, "adam", scale, change, 1, t0))
        if _convergence(prior.trace, prior.tol)["converged"]:
            break
    return s2


CG_FAILURE = 10.0  # a gradient whose CG residual ends above this × cg_tol is refused (after one rebuild)
ASSEMBLE_LIMIT = 50_000_000  # entries of Ψ₀ (400 MB in float64 while assembling) up to which the fit assembles it
VARIANCE_FLOOR = 1.0  # a block's largest negligible share of tr C, in units of σ² (variance_floor)
MACKAY_WARMUP = 10  # at most this many global-scale steps before L-BFGS
LBFGS_MEMORY = 10  # curvature pairs kept
LBFGS_FIRST_STEP = 0.1  # largest coordinate change of the first (gradient) step, in log units
LINE_SEARCH_TRIES = 6
# rows of C up to which a gradient whose CG failed with a fresh low-rank preconditioner is solved again with C⁻¹
# itself (a dense c × c Cholesky: 128 MB and ~c²·d flops at c = 4096)
EXACT_FALLBACK_ROWS = 8192


# ---------------------------------------------------------------------------------------------- the trace figure
def plot_prior_trace(path: str | Path, trace: list[dict], dpi: int = 120) -> Path:
    """The type-II MAP trace (:func:`fit_block_prior` records) against step: lengthscales ``ℓ_b``, variances
    ``σ²_b`` (log axes), ``σ²``, the data fit ``−½ỹᵀC⁻¹ỹ`` and the log hyperprior, as a PNG written atomically.
    Returns ``path``.

    Drawn with matplotlib's ``Figure`` directly (as :mod:`ctuq.figures` does) rather than through
    :mod:`ctuq.figures`, whose import pulls the metrics package into the inference core."""
    path = Path(path)
    steps = [r["step"] for r in trace]
    panels = [
        ("lengthscale", "lengthscales ℓ_b", True),
        ("variance", "variances σ²_b", True),
        ("sigma2", "noise σ²", True),
        ("data_fit", "−½ ỹᵀC⁻¹ỹ", False),
        ("log_hyperprior", "log p_TV(ℓ)", False),
    ]
    fig = Figure(figsize=(3.2 * len(panels), 3.0), dpi=dpi, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (key, label, log) in zip(axes, panels):
        ax.plot(steps, [r[key] for r in trace], lw=1)
        if log:
            ax.set_yscale("log")
        ax.set(title=label, xlabel="step")
        ax.grid(alpha=0.3)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=fig.dpi)
    return path
