"""The TV-PredCP block prior's model (:class:`TVPredCPModel`; registered with its fit as
:class:`~.prior.TVPredCPPrior`, ``tv_predcp``): its options, the map ``L`` from standard weights to network weights
and its transpose, its hyperparameters, state, summary and figure.
The method: the package docstring (:mod:`ctuq.inference.priors.tv_predcp`) and ``docs/tv_predcp.md``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from ctuq.inference.features import FeatureOperator
from ctuq.inference.priors.base import PriorCost, PriorError, WeightPrior
from ctuq.inference.priors.tv_predcp.blocks import (
    ASSEMBLE_LIMIT,
    LENGTHSCALE_MAX,
    LENGTHSCALE_MIN,
    MATERN,
    anisotropic_tv,
    block_layout,
    matern12_cholesky,
    tap_distances,
)
from ctuq.inference.priors.tv_predcp.figure import plot_prior_trace
from ctuq.options import PriorFitOptimizer, option, values

__all__ = ["TVPredCPModel"]

_STATE_VERSION = 2  # 2: the L-BFGS fit (optimizer, tol, max_step, convergence)
OPTIMIZERS = values(PriorFitOptimizer)


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


class TVPredCPModel(WeightPrior):
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
    label = "TV-PredCP prior"
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
        ell, var = self._take_options(options, rate, precond_every, cg_tol, cg_max_iter)
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

    def _take_options(self, options: dict, rate, precond_every, cg_tol, cg_max_iter) -> tuple[float, float]:
        """Check the options (:attr:`Options` fields) and the constructor's fit settings and set them; returns the
        initial ``(lengthscale, variance)``."""
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
        return ell, var

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
    ) -> TVPredCPModel:
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
    def setup_cost(self, n_outputs: int, n_features: int, *, assembled: bool) -> PriorCost:
        """The products of a fit that do not depend on how long it runs (none once fitted): the tap Gram matrices
        (``9·tv_samples`` JVPs of ``Φ`` per Matérn block) and, unless the solver assembles ``Ψ₀``, the fit's own
        assembly (``min(c, d)`` products, up to ``ASSEMBLE_LIMIT`` entries) or else the start's 64 probes. The
        gradient solves (``1 + probes`` right-hand sides per step) are not counted."""
        if self.fitted:
            return PriorCost()
        grams = 9 * self.tv_samples * len(self.matern)
        if assembled:
            return PriorCost(jvp=grams)
        if n_outputs * n_features > ASSEMBLE_LIMIT:
            return PriorCost(jvp=grams, vjp=64)
        by_columns = n_features <= n_outputs  # assemble_features(by="auto"): the fewer products
        return PriorCost(jvp=grams + (n_features if by_columns else 0), vjp=0 if by_columns else n_outputs)

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
