"""The linearised-DIP design prior: ``K = Φ diag(s)² Φᵀ / a`` around a DIP fitted on the pilot.

* ``Φ`` (``d_x × d``) is the Jacobian of the fitted U-Net (linearised as :func:`ctuq.pipeline.ct_model.ct_features`
  does). For small networks it is assembled once with ``min(d, d_x)`` products (``d`` JVPs or ``d_x`` VJPs,
  :func:`ctuq.inference.assemble_features`) and every later product is a GEMM
  (:class:`~ctuq.design.factors.DenseFactor`); otherwise the design uses JVPs/VJPs directly (``dense="auto"``
  assembles when that costs fewer products than the per-step products of the whole design and ``d_x·d`` floats
  fit the :data:`~ctuq.memory.Budget.DESIGN_DENSE` budget, a quarter of the free memory); the rows ``T^β Φ`` of
  the chosen angles are then kept once projected (:class:`~ctuq.design.factors.BlockRowStore`, when the design's
  rows fit the :data:`~ctuq.memory.Budget.DESIGN_ROWS` budget, a quarter of the free memory), because every
  refresh below needs them all.
* ``s``: the scales of the weight prior ``design.weight_prior`` (a diagonal prior of :data:`ctuq.registry.PRIORS`,
  made by name with the options of its section ``design.<name>``) on the *chosen* rows ``Ψ₀ = T^(t) Φ``
  (:meth:`ctuq.inference.priors.DiagonalPrior.compute_scales`). The default, the g-prior, is exact,
  ``s_i = ‖(T^(t) Φ)_{:,i}‖⁻¹``, from the column norms the design keeps block by block
  (:meth:`DesignModel.column_sq_norms`, handed to the prior as :attr:`~ctuq.inference.priors.PriorProblem.column_norms`;
  for a network without the assembled Jacobian and ``design.gprior.method = stochastic``, by probes). They are
  refreshed every ``refresh_every`` acquired angles together with ``a`` — this is what makes the prior adaptive:
  ``Φ`` and ``s`` depend on the data.
* ``a``: by the energy rule (default for the DIP; :func:`ctuq.design.priors.energy_precision` with
  ``tr(T K̄ Tᵀ)`` from :meth:`~ctuq.inference.priors.DiagonalPrior.kernel_trace`: the g-prior's is the number of
  non-zero scales) or by exact EM on the chosen rows.
* targets ``ỹ = scale·y + T(Φṽ − g(ṽ))`` (the DIP's offset, as in :func:`ctuq.pipeline.ct_model.ct_posterior`),
  ``σ²`` in scaled units (default: the DIP's mean squared residual on the pilot).
* optional retraining every ``retrain_every`` angles: the DIP is fitted further on the pilot plus the acquired
  angles (warm start, :func:`ctuq.reconstruct.dip.fit_dip`), re-linearised and re-assembled.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ctuq.config.engine import to_dict
from ctuq.design.factors import BlockRowStore, DenseFactor
from ctuq.design.model import DesignModel
from ctuq.design.priors import energy_precision, fit_precision
from ctuq.errors import CheckpointMismatch
from ctuq.inference import LinearizedFeatures, assemble_features
from ctuq.inference.priors import PriorProblem
from ctuq.linearize import LinearizedNetwork, count_linearized_weights
from ctuq.memory import Budget, memory_budget
from ctuq.options import DenseFeatures as DenseChoice
from ctuq.options import DesignPriorKind, DesignPriorScale
from ctuq.reconstruct.dip import fit_dip
from ctuq.registry import PRIORS
from ctuq.utils import atomic_torch_save

__all__ = ["DIPPrior", "DIPTracker", "weight_prior_of"]


class DIPPrior:
    """Builds, refreshes and (optionally) retrains the linearised-DIP :class:`DesignModel`.

    Parameters
    ----------
    model : nn.Module
        The DIP U-Net fitted on the pilot (its weights are ``ṽ``; not modified — retraining works on a copy).
    net_input : torch.Tensor
        Its fixed input ``(1, C, H, W)``.
    op : RayTransform
        All candidate angles.
    y : torch.Tensor
        ``(n_candidates, k)`` measurements at every candidate (data units); only the rows of chosen angles are
        read (the pilot's at the start, an acquired angle's after it is acquired).
    scale : float
        The DIP's data/image scale.
    sigma2 : float, optional
        Noise variance in scaled units; default the DIP's mean squared residual on the pilot.
    settings : DesignConfig
        ``refresh_every``, ``retrain_every``, ``retrain_iterations``, ``retrain_lr``, ``prior_scale``,
        ``weight_prior`` and its section (``design.gprior``, ...), ``dense``.
    dip_settings : DIPConfig, optional
        Learning rate (unless ``settings.retrain_lr``), TV weight and clipping of retraining.
    work_dir : path, optional
        Where retrained weights are stored (``retrain_<n>.pt``) so that a resumed design restores them.
    """

    def __init__(
        self,
        model,
        net_input,
        op,
        y,
        scale: float,
        *,
        settings,
        sigma2: float | None = None,
        dip_settings=None,
        work_dir=None,
        seed: int = 0,
        progress: bool = False,
        log: Callable[[str], None] | None = None,
    ):
        self.net_model = model
        self.net_input = net_input
        self.op, self.y, self.scale = op, y, float(scale)
        self.settings, self.dip = settings, dip_settings
        self.sigma2_given = sigma2
        self.work_dir = Path(work_dir) if work_dir is not None else None
        self.seed, self.progress = int(seed), progress
        self.say = log or (lambda _m: None)
        self.factor = None
        self.delta = None
        self._sq_norms: dict[int, torch.Tensor] = {}  # block → its g-prior sums under the current Φ
        self._rows = None  # BlockRowStore of the current Φ (network through VJPs)
        self._n_blocks = 0  # pilot + acquisitions of the design: the blocks a store must hold
        self.timings: dict[str, float] = {"linearize_s": 0.0}
        self.n_retrains = 0
        self.prior_name, self.prior_options = weight_prior_of(settings)

    def weight_prior(self, features):
        """A fresh weight prior ``design.weight_prior`` with its options, on the unscaled features ``features``
        (``Ψ₀``, the chosen rows): a :class:`~ctuq.inference.priors.DiagonalPrior` whose scales are computed once."""
        return PRIORS[self.prior_name].create(features, **self.prior_options)

    # ------------------------------------------------------------------------------------------ linearisation
    def _linearize(self, n_steps: int, n_blocks: int) -> None:
        """Linearise the current network (``Φ``, ``g(ṽ)``, the offset) and assemble ``Φ`` when ``design.dense``
        says so; a network through VJPs gets a store for the rows of up to ``n_blocks`` blocks."""
        t0 = time.perf_counter()
        self._sq_norms, self._rows = {}, None  # a new Φ
        d, d_x = count_linearized_weights(self.net_model), self.op.d_x
        k = self.op.c // self.op.n_angles
        dense = {DenseChoice.ALWAYS: True, DenseChoice.NEVER: False}.get(self.settings.dense, DenseChoice.AUTO)
        if dense == DenseChoice.AUTO:
            # per step: k VJPs (Ψ_β) + k JVPs (T̄ L H) on the weight-space route
            dense = d * d_x * 4 <= memory_budget(Budget.DESIGN_DENSE, self.op.device) and min(d, d_x) <= 2 * k * max(
                1, n_steps
            )
        # Tracing the JVP (mode "linearize") costs seconds once and pays off only over many JVPs: a design through
        # JVPs. Assembling Φ needs one (the offset): its columns come from per-parameter JVPs (jvp_basis), untraced.
        jvps = 1 if dense else n_steps * k + 3 * self.settings.samples
        net = LinearizedNetwork(
            self.net_model, self.net_input.to(self.op.device), mode="linearize" if jvps >= 2000 else "recompute"
        )
        with torch.no_grad():
            self.g0 = net.output()
            self.delta = net.jvp(net.params()[None])[0] - self.g0  # Φṽ − g(ṽ), scaled image units
        if dense:
            self.say(f"assembling the Jacobian Φ ({net.d_out} × {net.d}) with {net.d} JVPs")
            # d JVPs or d_x VJPs, whichever is fewer (a product costs about the same at 16² as at 128²)
            Phi = assemble_features(LinearizedFeatures(net), by="auto", progress=self.progress)
            self.factor = DenseFactor(Phi.to(torch.float32), self.op.image_shape)
            del Phi
        else:
            self.factor = net
            # every g-prior refresh needs T^τ Φ of all chosen angles (C_τ and the scales): one VJP per row, kept
            # once projected when the design's rows fit in a quarter of the free memory (3.0 GB for 'small')
            self._rows = BlockRowStore.if_fits(n_blocks, k, net.d, net.dtype, self.op.device)
        self.timings["linearize_s"] += time.perf_counter() - t0

    def targets(self, blocks) -> torch.Tensor:
        """``ỹ`` on the rows of candidate ``blocks`` (scaled units, flat)."""
        op = self.op.subset(list(blocks))
        y = self.y[list(blocks)].reshape(1, -1).to(self.op.device, self.op.dtype) * self.scale
        return (y + op.forward_flat(self.delta[None].to(op.dtype)))[0].double()

    def _residual_sigma2(self, blocks) -> float:
        op = self.op.subset(list(blocks))
        y = self.y[list(blocks)].reshape(1, -1).to(self.op.device, self.op.dtype) * self.scale
        r = op.forward_flat(self.g0[None].to(op.dtype)) - y
        return float(r.double().pow(2).mean())

    # ------------------------------------------------------------------------------------------ models
    def build(self, chosen, n_steps: int = 1) -> DesignModel:
        """Linearise (first call), then the model with the weight prior's scales and ``a`` of the ``chosen``
        angles."""
        self._n_blocks = max(self._n_blocks, len(list(chosen)) + int(n_steps))
        if self.factor is None:
            self._linearize(n_steps, self._n_blocks)
        if self.sigma2_given is None:
            self.sigma2_given = self._residual_sigma2(chosen)
            if not self.sigma2_given > 0:
                raise FloatingPointError(
                    "the DIP fits the pilot exactly (zero residual); give the noise variance (design.noise_variance)"
                )
        base = DesignModel(
            self.op,
            self.factor,
            torch.ones(self.factor.d),
            a=1.0,
            sigma2=self.sigma2_given,
            image_prior=DesignPriorKind.DIP.value,
            image_scale=self.scale,
            row_store=self._rows,
        )
        self._base = base
        return self._scaled(base, chosen)

    def center(self, chosen=None) -> torch.Tensor:
        """The image the current linearisation is centred on, ``g(ṽ)`` of the (possibly retrained) DIP, flat
        ``(d_x,)`` float64 on the CPU, mm⁻¹ (after :meth:`build`; ``chosen`` is not needed: the retraining knows
        its angles)."""
        if self.factor is None:
            raise RuntimeError("DIPPrior.center: call build() first")
        return (self.g0.detach().double().cpu() / self.scale).reshape(-1)

    def model_for(self, chosen) -> DesignModel:
        """The model of the current network with the prior's scales and ``a`` of the candidate blocks ``chosen`` (after
        :meth:`build`): what a design that had chosen them would use, e.g. an equidistant set of that size for
        the forecast of equidistant acquisition (:mod:`ctuq.design.forecast`)."""
        if self.factor is None:
            raise RuntimeError("DIPPrior.model_for: call build() first")
        return self._scaled(self._base, chosen)

    def _scaled(self, base: DesignModel, chosen) -> DesignModel:
        chosen = list(chosen)
        y_t = self.targets(chosen)
        feats = base.features(chosen)  # Ψ₀ = T^(t) Φ (the base model's scales are ones)
        problem = PriorProblem(
            feats,
            y_t,
            a=float(base.a),
            sigma2=float(base.sigma2),
            seed=self.seed,
            # exact column norms block by block, kept while Φ stays (free once Φ is assembled)
            column_norms=lambda: base.column_sq_norms(chosen, cache=self._sq_norms),
            column_norms_free=isinstance(self.factor, DenseFactor),
        )
        prior = self.weight_prior(feats)
        s = prior.compute_scales(problem).to(self.factor.dtype)
        model = base.with_updates(scales=s, info={"n_chosen": len(chosen), "nonzero_scales": int((s > 0).sum())})
        if self.settings.prior_scale == DesignPriorScale.EM:
            a, s2, ev = fit_precision(model, chosen, y_t, learn_noise=False)
            return model.with_updates(
                a=a, info={**model.info, "prior_scale": DesignPriorScale.EM.value, "log_evidence": ev}
            )
        # auto and energy: the energy rule (the authors' g-prior scale), with the prior's tr(T K̄ Tᵀ)
        a, clipped = energy_precision(prior.kernel_trace(s, problem), y_t, model.sigma2)
        return model.with_updates(
            a=a, info={**model.info, "prior_scale": DesignPriorScale.ENERGY.value, "energy_clipped": clipped}
        )

    # ------------------------------------------------------------------------------------------ updates
    def updater(self, engine, n_acquired: int, chosen, replay: bool) -> DesignModel | None:
        """The design loop's hook: retrain every ``retrain_every``, else refresh every ``refresh_every`` angles."""
        st = self.settings
        if st.retrain_every and n_acquired % st.retrain_every == 0:
            self._retrain(list(chosen), n_acquired, replay)
            self.factor = None
            return self.build(chosen)
        if st.refresh_every and n_acquired % st.refresh_every == 0:
            return self._scaled(engine.model.with_updates(scales=torch.ones(self.factor.d)), chosen)
        return None

    def _retrain(self, chosen, n_acquired: int, replay: bool) -> None:
        path = self.work_dir / f"retrain_{n_acquired:03d}.pt" if self.work_dir is not None else None
        model = copy.deepcopy(self.net_model)
        if path is not None and path.is_file():
            try:
                model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: refused with the file named
                reason = " ".join(str(exc).split())[:200]
                raise CheckpointMismatch(
                    f"{path}: not the weights of this design's retrained DIP ({type(exc).__name__}: {reason}); "
                    f"delete it to retrain"
                ) from exc
            self.say(f"restored the DIP retrained after {n_acquired} angles from {path}")
        else:
            if replay:
                self.say(f"retraining after {n_acquired} angles again (no stored weights in {path})")
            dc = self.dip
            res = fit_dip(
                self.op.subset(chosen),
                self.y[chosen].to(self.op.device),
                model=model,
                net_input=self.net_input,
                iterations=int(self.settings.retrain_iterations),
                # design.retrain_lr when set (the angle-selection study retrains at its warm-start rate), else dip.lr
                lr=self.settings.retrain_lr or (dc.lr if dc else 1e-3),
                tv_weight=dc.tv_weight if dc else 1e-4,
                clip_grad_norm=dc.clip_grad_norm if dc else 1.0,
                scale=self.scale,
                seed=self.seed + n_acquired,
                device=self.op.device,
                progress=self.progress,
            )
            model.load_state_dict(res.best_state_dict)
            if path is not None:
                atomic_torch_save(path, {k: v.detach().cpu() for k, v in model.state_dict().items()})
        self.net_model = model.eval()
        self.n_retrains += 1


def weight_prior_of(settings) -> tuple[str, dict]:
    """``(name, options)`` of the linearised DIP's weight prior from the design settings: ``design.weight_prior``
    and the values of its section ``design.<name>`` (none for a prior without options). One line naming
    ``design.weight_prior`` for a prior that is not diagonal (the design keeps scales ``s``)."""
    name = str(settings.weight_prior)
    if name not in PRIORS or not PRIORS[name].diagonal:
        valid = [n for n in PRIORS.names() if PRIORS[n].diagonal]
        raise ValueError(f"design.weight_prior must be a diagonal weight prior ({', '.join(valid)}), got {name!r}")
    sections = dict(settings.prior_sections.items())
    options = to_dict(sections[name]) if name in sections else {}
    PRIORS[name].check_option_names(options)
    return name, options


class DIPTracker:
    """The reconstruction a user would have after each acquisition, for the online check of
    :mod:`ctuq.design.forecast`: a copy of the pilot DIP warm-started on the chosen angles for ``iterations`` Adam
    steps whenever the chosen angles changed (the prior's linearisation is left alone).

    The linearised update of the pilot DIP by the new angles (the design posterior's predictive mean) does not
    generalise to unseen angles (notebook/experimental_design.md, "How many angles"): scored against it, every new
    angle looks worse than the DIP the user will reconstruct. :meth:`center` is the image the next angle is
    predicted from.
    """

    def __init__(self, prior: DIPPrior, iterations: int):
        self.prior, self.iterations = prior, int(iterations)
        self.model = copy.deepcopy(prior.net_model)
        self._chosen: tuple[int, ...] | None = None
        self._image: torch.Tensor | None = None

    def center(self, chosen) -> torch.Tensor:
        """``(d_x,)`` float64 CPU, mm⁻¹: the tracked DIP after training on ``chosen`` (the pilot DIP itself for the
        pilot)."""
        chosen = tuple(int(b) for b in chosen)
        if chosen == self._chosen:
            return self._image
        p, dc = self.prior, self.prior.dip
        if self._chosen is None and self._image is None:
            self._chosen, self._image = chosen, p.center()  # the pilot DIP: nothing new to fit
            return self._image
        res = fit_dip(
            p.op.subset(list(chosen)),
            p.y[list(chosen)].to(p.op.device),
            model=self.model,
            net_input=p.net_input,
            iterations=self.iterations,
            lr=dc.lr if dc else 1e-3,
            tv_weight=dc.tv_weight if dc else 1e-4,
            clip_grad_norm=dc.clip_grad_norm if dc else 1.0,
            scale=p.scale,
            seed=p.seed + len(chosen),
            device=p.op.device,
            progress=False,
        )
        self.model.load_state_dict(res.final_state_dict)  # warm start of the next fit: where this one ended
        self._chosen = chosen
        self._image = res.reconstruction.detach().double().cpu().reshape(-1)
        return self._image
