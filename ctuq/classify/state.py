"""State of a :class:`~ctuq.classify.LinearizedLaplace` as plain values and tensors (``weights_only`` loadable).

Holds the settings, a fingerprint of the model's weights and buffers (a state never silently attaches to another
network), the prior scales, ``a``, the linearised model's mode, the posterior's own state (EM trace and generator, CG
preconditioner; exact decompositions are left out: they are recomputed from the data on :meth:`fit`) and the cached
posterior samples, with which a loaded object predicts without the training data; where the softmax Hessians were
evaluated (``hessian_at``), the curvature diagnostic (mean ``tr B`` at the network and at the linearised model's mode,
the ``a`` of that mode), the grid search's trace, the prior's options (``prior_options``), ELLA's settings and basis
(``approximation``, ``landmarks``, ``rank``, ``V``) and a SHA-256 checksum of everything else (:func:`state_checksum`):
a state edited after it was written is refused with one line (:class:`ClassifierStateError`), as a damaged model file
is. A state of another version is refused the same way (refit to regenerate it).

Files: :func:`save_state` writes a state atomically; :func:`load_state` reads one with ``weights_only=True`` and
names the file in every error.
"""

from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path

import torch

from ctuq.errors import CheckpointMismatch
from ctuq.inference.ella import NystromBasis
from ctuq.utils import atomic_torch_save

__all__ = [
    "STATE_VERSION",
    "ClassifierStateError",
    "state_dict",
    "load_state_dict",
    "settings",
    "model_fingerprint",
    "state_checksum",
    "save_state",
    "load_state",
]

# 4: the approximation (ELLA's settings and basis); 5: the held-out guard's record, ELLA's mode in its K coordinates
STATE_VERSION = 5
_KIND = "ctuq.classify.LinearizedLaplace"
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class ClassifierStateError(CheckpointMismatch):
    """A ``LinearizedLaplace`` state (or its file) is not one, of an unknown version, modified after it was written
    (checksum), or saved for another network or settings; one line naming the file or the setting."""


def _digest(obj, h) -> None:
    """Feed a canonical byte form of ``obj`` (dicts by sorted key; tensors by dtype, shape and bytes; floats
    exactly) to the hash ``h``."""
    if isinstance(obj, dict):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode() + b":")
            _digest(obj[key], h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[" if isinstance(obj, list) else b"(")
        for item in obj:
            _digest(item, h)
            h.update(b",")
        h.update(b"]")
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, float):
        h.update(b"f" + obj.hex().encode())
    else:
        h.update(f"{type(obj).__name__}:{obj!r}".encode())


def state_checksum(state: dict) -> str:
    """SHA-256 (hex) of ``state`` without its ``"checksum"`` entry."""
    h = hashlib.sha256()
    _digest({k: v for k, v in state.items() if k != "checksum"}, h)
    return h.hexdigest()


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
    state = {
        "version": STATE_VERSION,
        "kind": _KIND,
        "settings": {
            "weights": list(la.param_names),
            "prior": la.prior if isinstance(la.prior, str) else "given",
            "prior_options": dict(la.prior_options),
            "linear_model": la.linear_model,
            "hessian_root": la.hessian_root,
            "hessian_at": la.hessian_at,
            "solver": la.solver,
            "dtype": str(la.dtype).replace("torch.", ""),
            "seed": la.seed,
            "prior_precision": la.a0,
            "approximation": la.approximation,
            "landmarks": la.landmarks,
            "rank": la.rank,
        },
        "ella_basis": None
        if la.basis is None
        else {
            "V": la.basis.V.detach().cpu(),
            "eigenvalues": la.basis.eigenvalues.detach().cpu(),
            "rows": la.basis.rows.detach().cpu(),
            "rank_found": int(la.basis.rank_found),
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
        "hessian": {
            "trace_network": la._trace_net,
            "trace_mode": la._trace_mode,
            "a": la._hessian_a,
            "preconditioner_trace": la._precond_trace,
        },
        "gridsearch": [dict(r) for r in la.gridsearch_trace],
        "guard": None if la.guard is None else {**la.guard, "trace": [dict(r) for r in la.guard["trace"]]},
    }
    state["checksum"] = state_checksum(state)
    return state


def _check(state, where: str = "LinearizedLaplace.load_state_dict") -> dict:
    if not isinstance(state, dict) or state.get("kind") != _KIND:
        got = sorted(state, key=str)[:8] if isinstance(state, dict) else type(state).__name__
        raise ClassifierStateError(f"{where}: not a LinearizedLaplace state (got {got})")
    if state.get("version") != STATE_VERSION:
        raise ClassifierStateError(
            f"{where}: state version {state.get('version')!r}; this ctuq reads version {STATE_VERSION} (refit to "
            f"regenerate it)"
        )
    if state.get("checksum") != state_checksum(state):
        raise ClassifierStateError(
            f"{where}: the state was modified after it was written (checksum mismatch); refit, or restore the "
            f"file ctuq wrote"
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
    """Restore ``state`` into the unfitted ``la`` (raises :class:`ClassifierStateError`, a ``ValueError``, for
    another model or settings, or a modified state)."""
    _check(state)
    where = "LinearizedLaplace.load_state_dict"
    if la.posterior is not None:
        raise RuntimeError(f"{where}: call it on an object that was not fitted yet")
    saved, now = state["model"], model_fingerprint(la.model, la.param_names)
    if saved["names"] != now["names"] or saved["numels"] != now["numels"]:
        raise ClassifierStateError(
            f"{where}: the state was saved for parameters {saved['names'][:6]}… "
            f"(d={sum(saved['numels'])}); this model linearises {now['names'][:6]}… "
            f"(d={sum(now['numels'])})"
        )
    for key in ("sum", "sq"):
        if abs(saved[key] - now[key]) > 1e-6 * max(1.0, abs(saved[key])):
            raise ClassifierStateError(
                f"{where}: the model's weights differ from those the state was computed for "
                f"(weight {key} {now[key]:.8g} vs {saved[key]:.8g})"
            )
    stored = state["settings"]
    for key in ("linear_model", "hessian_root", "hessian_at", "dtype", "approximation", "landmarks", "rank"):
        mine = str(la.dtype).replace("torch.", "") if key == "dtype" else getattr(la, key)
        if stored[key] != mine:
            raise ClassifierStateError(f"{where}: the state has {key}={stored[key]!r}, this object {mine!r}")
    la.n_classes, la.n_train = state["n_classes"], state["n_train"]
    la._pending_a = float(state["a"])
    la.scales = None if state["scales"] is None else state["scales"].double()
    la._mode_w = None if state["mode"] is None else state["mode"].double()
    la._pending_posterior = state["posterior"]
    la._old_trace = [dict(r) for r in state["em_trace_before"]]
    la._samples = None if state["samples"] is None else dict(state["samples"])
    hess = state["hessian"]
    la._trace_net, la._trace_mode, la._hessian_a = hess["trace_network"], hess["trace_mode"], hess["a"]
    la._precond_trace = hess["preconditioner_trace"]
    la.gridsearch_trace = [dict(r) for r in state["gridsearch"]]
    guard = state["guard"]
    la.guard = None if guard is None else {**guard, "trace": [dict(r) for r in guard["trace"]]}
    ella = state["ella_basis"]
    la.basis = None if ella is None else NystromBasis(ella["V"], ella["eigenvalues"], ella["rows"], ella["rank_found"])
    la._model = copy.deepcopy(la.model).to(la.dtype)


def save_state(path: str | os.PathLike, state: dict) -> Path:
    """Write ``state`` (:func:`state_dict` output) to ``path`` atomically (a crash leaves no half-written file)."""
    _check(state, "save_state")
    path = Path(path)
    atomic_torch_save(path, state)
    return path


def load_state(path: str | os.PathLike) -> dict:
    """Read a state file written by :func:`save_state` (or ``torch.save(la.state_dict())``) with
    ``weights_only=True``; every error (:class:`ClassifierStateError`, one line) names the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such LinearizedLaplace state file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise ClassifierStateError(
            f"{path}: not a readable torch file ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc
    return _check(state, str(path))
