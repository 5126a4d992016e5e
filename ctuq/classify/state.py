"""State of a :class:`~ctuq.classify.LinearizedLaplace` as plain values and tensors (``weights_only`` loadable).

Holds the settings, a fingerprint of the model's weights and buffers (a state never silently attaches to another
network), the prior scales, ``a``, the linearised model's mode, the posterior's own state (EM trace and generator,
CG preconditioner; exact decompositions are left out: they are recomputed from the data on :meth:`fit`) and the
cached posterior samples, with which a loaded object predicts without the training data.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["STATE_VERSION", "state_dict", "load_state_dict", "settings", "model_fingerprint"]

STATE_VERSION = 1
_KIND = "ctuq.classify.LinearizedLaplace"
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def model_fingerprint(model, names) -> dict:
    """Names and sizes of the linearised parameters, and float64 sums (and sums of squares) of every floating
    parameter and buffer."""
    params = dict(model.named_parameters())
    tensors = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return {
        "names": list(names),
        "numels": [int(params[n].numel()) for n in names],
        "sum": float(sum(t.detach().double().sum() for t in tensors)),
        "sq": float(sum(t.detach().double().pow(2).sum() for t in tensors)),
    }


def state_dict(la) -> dict:
    """The state of ``la`` (module docstring)."""
    post = la.posterior
    post_state = None
    if post is not None:
        post_state = post.state_dict()
        if post.exact:
            post_state.pop("solver_state", None)  # c×c or derived from Ψ₀: recomputed on fit
    elif la._pending_posterior is not None:
        post_state = la._pending_posterior
    mode = la._mode.w if la._mode is not None else la._mode_w
    return {
        "version": STATE_VERSION,
        "kind": _KIND,
        "settings": {
            "weights": list(la.param_names),
            "prior": la.prior if isinstance(la.prior, str) else "given",
            "linear_model": la.linear_model,
            "gprior_method": la.gprior_method,
            "gprior_probes": la.gprior_probes,
            "hessian_root": la.hessian_root,
            "solver": la.solver,
            "dtype": str(la.dtype).replace("torch.", ""),
            "seed": la.seed,
            "prior_precision": la.a0,
        },
        "model": model_fingerprint(la.model, la.param_names),
        "n_classes": la.n_classes,
        "n_train": la.n_train,
        "a": float(la.prior_precision),
        "scales": None if la.scales is None else la.scales.detach().cpu().double(),
        "mode": None if mode is None else mode.detach().cpu().double(),
        "posterior": post_state,
        "em_trace_before": [dict(r) for r in getattr(la, "_old_trace", [])],
        "samples": None
        if la._samples is None
        else {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in la._samples.items()},
    }


def _check(state) -> dict:
    if not isinstance(state, dict) or state.get("kind") != _KIND:
        got = sorted(state)[:8] if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"LinearizedLaplace.load_state_dict: not a LinearizedLaplace state (got {got})")
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"LinearizedLaplace.load_state_dict: state version {state.get('version')!r}; this ctuq "
            f"reads version {STATE_VERSION}"
        )
    return state


def settings(state: dict) -> dict:
    """Constructor keyword arguments stored in ``state``."""
    s = dict(_check(state)["settings"])
    if s["prior"] == "given":
        s["prior"] = state["scales"]
    s["dtype"] = _DTYPES[s["dtype"]]
    return s


def load_state_dict(la, state: dict) -> None:
    """Restore ``state`` into the unfitted ``la`` (raises ``ValueError`` for another model or settings)."""
    _check(state)
    where = "LinearizedLaplace.load_state_dict"
    if la.posterior is not None:
        raise RuntimeError(f"{where}: call it on an object that was not fitted yet")
    saved, now = state["model"], model_fingerprint(la.model, la.param_names)
    if saved["names"] != now["names"] or saved["numels"] != now["numels"]:
        raise ValueError(
            f"{where}: the state was saved for parameters {saved['names'][:6]}… "
            f"(d={sum(saved['numels'])}); this model linearises {now['names'][:6]}… "
            f"(d={sum(now['numels'])})"
        )
    for key in ("sum", "sq"):
        if abs(saved[key] - now[key]) > 1e-6 * max(1.0, abs(saved[key])):
            raise ValueError(
                f"{where}: the model's weights differ from those the state was computed for "
                f"(weight {key} {now[key]:.8g} vs {saved[key]:.8g})"
            )
    for key in ("linear_model", "hessian_root", "dtype"):
        mine = str(la.dtype).replace("torch.", "") if key == "dtype" else getattr(la, key)
        if state["settings"][key] != mine:
            raise ValueError(f"{where}: the state has {key}={state['settings'][key]!r}, this object {mine!r}")
    la.n_classes, la.n_train = state["n_classes"], state["n_train"]
    la._pending_a = float(state["a"])
    la.scales = None if state["scales"] is None else state["scales"].double()
    la._mode_w = None if state["mode"] is None else state["mode"].double()
    la._pending_posterior = state["posterior"]
    la._old_trace = [dict(r) for r in state.get("em_trace_before", [])]
    la._samples = None if state["samples"] is None else dict(state["samples"])
    la._model = copy.deepcopy(la.model).to(la.dtype)
