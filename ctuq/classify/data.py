"""Input checks for the classification front end: data loaders, labels, model outputs, the weight subset.

Every error names the function that raised it, what was wrong and what was expected, so that a user who passes a
regression model, one-hot labels or an exhausted iterator learns it from the message.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ctuq.linearize import eval_mode
from ctuq.options import WeightSubset, values
from ctuq.utils import progress as _progress

__all__ = ["collect_inputs", "collect_loader", "check_logits", "check_labels", "resolve_weights", "eval_logits"]


def _as_tensor(x, what: str, where: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x)
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise TypeError(f"{where}: {what} must be a tensor (or convertible to one), got {type(x).__name__}") from exc


def collect_loader(
    loader: Iterable, *, where: str = "LinearizedLaplace.fit", progress: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the ``(x, y)`` batches of ``loader`` into ``X`` ``(n, ...)`` and integer labels ``y`` ``(n,)``.

    Accepts any iterable of pairs (a ``torch.utils.data.DataLoader``, a list of tuples). Raises ``ValueError`` for
    an empty loader, batches that are not ``(inputs, labels)`` pairs, mismatched lengths or input shapes, and labels
    that are not integer class indices (one-hot or float labels included).
    """
    xs, ys = [], []
    try:
        iterator = iter(loader)
    except TypeError as exc:
        raise TypeError(
            f"{where}: expected an iterable of (inputs, labels) batches such as a DataLoader, got "
            f"{type(loader).__name__}"
        ) from exc
    for i, batch in enumerate(_progress(iterator, desc="collect data", disable=not progress)):
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise ValueError(
                f"{where}: batch {i} is a {type(batch).__name__}"
                f"{'' if not isinstance(batch, (tuple, list)) else f' of length {len(batch)}'}; "
                f"expected (inputs, labels)"
            )
        x = _as_tensor(batch[0], f"the inputs of batch {i}", where)
        y = _as_tensor(batch[1], f"the labels of batch {i}", where)
        if x.ndim == 0 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"{where}: batch {i} has inputs {tuple(x.shape)} and labels {tuple(y.shape)}; expected "
                f"inputs (B, ...) and integer class labels (B,)"
            )
        if xs and x.shape[1:] != xs[0].shape[1:]:
            raise ValueError(
                f"{where}: batch {i} has inputs of shape {tuple(x.shape[1:])} per example, batch 0 had "
                f"{tuple(xs[0].shape[1:])}"
            )
        xs.append(x)
        ys.append(y)
    if not xs or sum(x.shape[0] for x in xs) == 0:
        raise ValueError(f"{where}: the data loader yielded no examples (is it empty or already exhausted?)")
    y = torch.cat(ys)
    if y.dtype.is_floating_point or y.dtype == torch.bool or y.dtype.is_complex:
        raise ValueError(
            f"{where}: labels must be integer class indices (B,), got dtype {y.dtype}; convert one-hot "
            f"labels with labels.argmax(1)"
        )
    return torch.cat(xs), y.long()


def collect_inputs(x, *, where: str) -> torch.Tensor:
    """``x`` as one tensor ``(N, ...)``: a tensor as it is, or the inputs of an iterable of batches (labels are
    ignored)."""
    if isinstance(x, torch.Tensor):
        if x.ndim == 0 or x.shape[0] == 0:
            raise ValueError(f"{where}: inputs must have shape (N, ...) with N >= 1, got {tuple(x.shape)}")
        return x
    parts = []
    for i, batch in enumerate(x):
        parts.append(_as_tensor(batch[0] if isinstance(batch, (tuple, list)) else batch, f"batch {i}", where))
    if not parts or sum(p.shape[0] for p in parts) == 0:
        raise ValueError(f"{where}: no inputs (empty iterable)")
    return torch.cat(parts)


def check_labels(y: torch.Tensor, n_classes: int, *, where: str) -> torch.Tensor:
    """Labels ``(n,)`` checked to lie in ``0 … n_classes − 1``."""
    lo, hi = int(y.min()), int(y.max())
    if lo < 0 or hi >= n_classes:
        raise ValueError(
            f"{where}: labels must lie in 0..{n_classes - 1} (the model returns {n_classes} logits), "
            f"got labels in {lo}..{hi}"
        )
    return y


def check_logits(out, n: int, *, where: str) -> torch.Tensor:
    """A model output checked to be logits ``(n, C)`` with ``C >= 2`` and finite."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{where}: the model must return one logits tensor (N, C), got {type(out).__name__}")
    if out.ndim != 2 or out.shape[0] != n or out.shape[1] < 2:
        raise ValueError(
            f"{where}: the model must return logits of shape (N, C) with C >= 2 classes; for {n} inputs "
            f"it returned {tuple(out.shape)}"
        )
    if not torch.isfinite(out).all():
        raise ValueError(f"{where}: the model returned NaN or Inf logits")
    return out


@torch.no_grad()
def eval_logits(model: nn.Module, X: torch.Tensor, *, batch_size: int = 1024, where: str) -> torch.Tensor:
    """``model(X)`` in eval mode (every submodule's mode restored afterwards), in batches → ``(N, C)``."""
    outs = []
    with eval_mode(model):
        for start in range(0, X.shape[0], batch_size):
            xb = X[start : start + batch_size]
            try:
                out = model(xb)
            except Exception as exc:  # noqa: BLE001 - re-raised with context
                raise ValueError(f"{where}: the model failed on inputs of shape {tuple(xb.shape)}: {exc}") from exc
            outs.append(check_logits(out, xb.shape[0], where=where))
    return torch.cat(outs)


def resolve_weights(model: nn.Module, weights: str | Sequence[str]) -> list[str]:
    """Parameter names for ``weights``: ``"all"`` (every parameter that requires grad, in ``named_parameters``
    order), ``"last_layer"`` (the parameters of the last leaf module that has parameters, in registration order)
    or an explicit list of names (checked by :class:`ctuq.linearize.LinearizedNetwork`)."""
    if isinstance(weights, str):
        if weights == WeightSubset.ALL:
            names = [n for n, p in model.named_parameters() if p.requires_grad]
        elif weights == WeightSubset.LAST_LAYER:
            last = None
            for mod_name, mod in model.named_modules():
                if not list(mod.children()) and any(True for _ in mod.parameters(recurse=False)):
                    last = mod_name
            if last is None:
                raise ValueError("LinearizedLaplace: the model has no module with parameters (weights='last_layer')")
            prefix = f"{last}." if last else ""
            names = [n for n, _ in model.named_parameters() if n.startswith(prefix) and "." not in n[len(prefix) :]]
        else:
            raise ValueError(
                f"LinearizedLaplace: weights must be one of {list(values(WeightSubset))} or a list of "
                f"parameter names, got {weights!r}"
            )
        if not names:
            raise ValueError(f"LinearizedLaplace: weights={weights!r} selects no parameters (all frozen?)")
        return names
    names = list(weights)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"LinearizedLaplace: weights must be 'all', 'last_layer' or a non-empty list of parameter "
            f"names, got {weights!r}"
        )
    valid = [n for n, _ in model.named_parameters()]
    unknown = [n for n in names if n not in valid]
    if unknown:
        hints = {n: difflib.get_close_matches(n, valid, n=3) for n in unknown[:5]}
        raise ValueError(
            f"LinearizedLaplace: unknown parameter name(s) {unknown[:10]} in weights; closest matches: "
            f"{hints}; valid names are those of model.named_parameters()"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"LinearizedLaplace: weights lists a parameter more than once: {names}")
    return names
