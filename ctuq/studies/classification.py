"""Reusable pieces of the classification benchmark and demo (``scripts/benchmark_classification.py``,
``scripts/classify_digits.py``): offline data sets, distribution shifts, the three model families, MAP training and
the metric row of one method.

Data (no downloads): scikit-learn's bundled digits (1797 8×8 images, 70/30 stratified split) and MNIST-1D
generated procedurally by the ``mnist1d`` package's ``make_dataset`` (4000/1000 signals of length 40; its
``get_dataset`` would download, which is never called). scikit-learn and mnist1d are optional (``pip install
ctuq[bench]``); a missing one raises ``ImportError`` naming the package.

Shifts: digits rotated by 0…90° (bilinear, ``scipy.ndimage.rotate``), with added Gaussian pixel noise (σ up to
1 on intensities in [0, 1]) or blurred (Gaussian filter, σ 0.5–1.5 pixels); MNIST-1D with added Gaussian noise (σ up
to 2 on standardised signals), blurred (σ 1–3 samples) or circularly translated (the 1-D counterpart of a rotation:
4–16 of 40 samples).

Validation data for a post-hoc grid search (:func:`validation_split`): a stratified part of the *test* split; the
methods that use it are then evaluated on the rest of the test split only.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from scipy.ndimage import gaussian_filter, gaussian_filter1d, rotate
from torch import nn

from ctuq.metrics import classification_summary

__all__ = [
    "load_dataset",
    "DATASETS",
    "shifted_inputs",
    "SHIFTS",
    "make_model",
    "MODELS",
    "train_map",
    "metric_row",
    "validation_split",
]

DATASETS = ("digits", "mnist1d")
MODELS = ("mlp", "cnn", "wide_cnn")
SHIFTS = {
    "digits": {
        "rotation": [0, 15, 30, 45, 60, 90],
        "noise": [0.0, 0.1, 0.2, 0.4, 0.7, 1.0],
        "blur": [0.5, 1.0, 1.5],
    },
    "mnist1d": {"noise": [0.0, 0.25, 0.5, 1.0, 1.5, 2.0], "blur": [1.0, 2.0, 3.0], "translation": [4, 8, 16]},
}
"""Shift kinds and severities per data set (degrees, noise standard deviations)."""


def load_dataset(name: str, seed: int = 0) -> dict:
    """``{"X", "y", "Xt", "yt", "shape"}``: float32 inputs ``(n, 1, …)`` and int64 labels (module docstring)."""
    if name == "digits":
        try:
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("the digits benchmark needs scikit-learn: pip install 'ctuq[bench]'") from exc
        X, y = load_digits(return_X_y=True)
        Xtr, Xte, ytr, yte = train_test_split(X / 16.0, y, test_size=0.3, random_state=seed, stratify=y)
        shape = (1, 8, 8)
    elif name == "mnist1d":
        try:
            from mnist1d.data import get_dataset_args, make_dataset
        except ImportError as exc:  # pragma: no cover
            raise ImportError(
                "the MNIST-1D benchmark needs the mnist1d package (its offline generator): pip install 'ctuq[bench]'"
            ) from exc
        args = get_dataset_args()
        args.seed = 42 + seed
        d = make_dataset(args)  # procedural; never downloads
        Xtr, Xte, ytr, yte = d["x"], d["x_test"], d["y"], d["y_test"]
        shape = (1, 40)
    else:
        raise ValueError(f"unknown data set {name!r}; valid: {list(DATASETS)}")
    f = lambda a: torch.tensor(np.asarray(a), dtype=torch.float32).reshape(-1, *shape)  # noqa: E731
    return {"X": f(Xtr), "y": torch.tensor(ytr).long(), "Xt": f(Xte), "yt": torch.tensor(yte).long(), "shape": shape}


def shifted_inputs(name: str, X: torch.Tensor, kind: str, severity: float, seed: int = 0) -> torch.Tensor:
    """Test inputs ``X`` under one shift (module docstring)."""
    if kind == "rotation":
        if severity == 0:
            return X.clone()
        imgs = X.numpy()[:, 0]
        out = np.stack([rotate(im, severity, reshape=False, order=1, mode="constant") for im in imgs])
        return torch.tensor(out, dtype=X.dtype)[:, None]
    if kind == "noise":
        g = torch.Generator().manual_seed(seed)
        return X + severity * torch.randn(X.shape, generator=g, dtype=X.dtype)
    if kind == "blur":
        arr = X.numpy()
        if X.ndim == 4:  # (N, 1, H, W) images: blur each image, not across the batch
            out = np.stack([gaussian_filter(im, severity, mode="constant") for im in arr[:, 0]])[:, None]
        else:  # (N, 1, L) signals
            out = gaussian_filter1d(arr, severity, axis=-1, mode="wrap")
        return torch.tensor(out, dtype=X.dtype)
    if kind == "translation":
        return torch.roll(X, shifts=int(severity), dims=-1)
    raise ValueError(f"unknown shift {kind!r}")


def validation_split(y: torch.Tensor, fraction: float = 1 / 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(val_idx, eval_idx)``: a stratified ``fraction`` of the indices of labels ``y`` ``(N,)`` (per class, in a
    seeded random order) and the rest, both sorted."""
    g = torch.Generator().manual_seed(seed)
    val = []
    for c in torch.unique(y):
        idx = (y == c).nonzero().reshape(-1)
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        val.append(idx[: int(round(fraction * idx.numel()))])
    val_idx = torch.cat(val).sort().values
    mask = torch.ones(y.numel(), dtype=torch.bool)
    mask[val_idx] = False
    return val_idx, mask.nonzero().reshape(-1)


class MLP(nn.Sequential):
    """Flatten, then tanh hidden layers."""

    def __init__(self, n_in: int, hidden: tuple[int, ...], n_out: int = 10):
        layers: list[nn.Module] = [nn.Flatten()]
        for h in hidden:
            layers += [nn.Linear(n_in, h), nn.Tanh()]
            n_in = h
        super().__init__(*layers, nn.Linear(n_in, n_out))


def _cnn(dim: int, channels: tuple[int, ...], k: int, pool_out: int, n_out: int = 10) -> nn.Sequential:
    Conv, BN, Pool, APool = (
        (nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.AdaptiveAvgPool2d)
        if dim == 2
        else (nn.Conv1d, nn.BatchNorm1d, nn.MaxPool1d, nn.AdaptiveAvgPool1d)
    )
    layers: list[nn.Module] = []
    c_in = 1
    for i, c in enumerate(channels):
        layers += [Conv(c_in, c, k, padding=k // 2), BN(c), nn.ReLU()]
        if i > 0:
            layers.append(Pool(2))
        c_in = c
    layers += [APool(pool_out), nn.Flatten(), nn.Linear(c_in * pool_out**dim, n_out)]
    return nn.Sequential(*layers)


def make_model(kind: str, dataset: str, seed: int = 0) -> nn.Module:
    """The MLP (~9k weights: digits 64-64-64-10, MNIST-1D 40-80-64-10, tanh), the CNN with batch norm (~31k /
    ~34k weights: 3 conv layers 32-32-64 (2D, 3×3) / 32-64-64 (1D, k = 5), ReLU, max pooling, linear head) or the
    wide CNN, the same with 64-64-128 channels (2D: 117,066 weights) / 64-128-128 (1D: 129,290)."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP(64, (64, 64)) if dataset == "digits" else MLP(40, (80, 64))
    if kind == "cnn":
        return _cnn(2, (32, 32, 64), 3, 2) if dataset == "digits" else _cnn(1, (32, 64, 64), 5, 4)
    if kind == "wide_cnn":
        return _cnn(2, (64, 64, 128), 3, 2) if dataset == "digits" else _cnn(1, (64, 128, 128), 5, 4)
    raise ValueError(f"unknown model {kind!r}; valid: {list(MODELS)}")


def train_map(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int = 200,
    lr: float = 1e-3,
    batch_size: int = 64,
    weight_decay: float | torch.Tensor = 0.0,
    adam_weight_decay: float = 0.0,
    seed: int = 0,
) -> tuple[nn.Module, float]:
    """Adam on the mean cross-entropy plus ``½ Σ_j λ_j v_j² / n``, mini-batches of ``batch_size``; returns the model
    in eval mode and the seconds taken.

    ``weight_decay`` is ``λ``: one number for every weight, or a tensor ``(d,)`` of per-weight precisions in the
    order of ``model.parameters()`` (a Gaussian prior ``v_j ~ N(0, 1/λ_j)``; ``λ_j = a/s_j²`` for the g-prior).
    ``adam_weight_decay``: ``torch.optim.Adam``'s own ``weight_decay`` (``λ v`` added to the gradient of the mean
    loss; issue 27's recipe: ``lr=1e-2``, ``adam_weight_decay=1e-4``). Training continues from the model's current
    weights (warm start)."""
    params = list(model.parameters())
    d = sum(p.numel() for p in params)
    if isinstance(weight_decay, torch.Tensor):
        if tuple(weight_decay.shape) != (d,):
            raise ValueError(
                f"train_map: weight_decay must be a number or a tensor of shape ({d},) (one precision "
                f"per weight), got shape {tuple(weight_decay.shape)}"
            )
        lam = weight_decay.detach().to(params[0].dtype)
    else:
        lam = float(weight_decay)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=float(adam_weight_decay))
    n = X.shape[0]
    t0 = time.perf_counter()
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        for i in range(0, n, batch_size):
            idx = perm[i : i + batch_size]
            if idx.numel() < 2:
                continue  # batch norm needs two examples
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
            if isinstance(lam, torch.Tensor):
                v = torch.cat([p.reshape(-1) for p in params])
                loss = loss + (lam * v * v).sum() / (2 * n)
            elif lam:
                loss = loss + lam / (2 * n) * sum(p.pow(2).sum() for p in params)
            loss.backward()
            opt.step()
    return model.eval(), time.perf_counter() - t0


def metric_row(
    probs: torch.Tensor,
    labels: torch.Tensor,
    logit_samples: torch.Tensor | None = None,
    kappas=range(1, 11),
    seed: int = 0,
) -> dict:
    """NLL, accuracy, ECE (15 bins), Brier and the κ-tuple joint log-likelihoods (from per-sample logits, or from
    ``probs`` alone for a point estimate)."""
    lp = (
        torch.log(probs.double().clamp_min(1e-300))[None]
        if logit_samples is None
        else torch.log_softmax(logit_samples.double(), -1)
    )
    return classification_summary(probs, labels, lp, kappas=kappas, seed=seed)
