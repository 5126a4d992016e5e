"""The toy block-prior problem shared by the TV-PredCP tests: four weight blocks of a made-up U-Net on a 5 × 6
image, a dense 'network' Φ and a ray-transform-like T (imported as ``from tv_toy import ...``, as memory_utils)."""

from __future__ import annotations

import math

import torch

SHAPES = {
    "a.0.weight": (2, 1, 3, 3),
    "a.1.weight": (2, 2, 3, 3),
    "b.0.weight": (1, 2, 3, 3),
    "out.weight": (1, 1, 1, 1),
}
"""Parameter shapes: three 3×3 convolution blocks and a 1×1 output (weights, no biases)."""
IMAGE = (5, 6)
"""Image shape (rows, columns)."""
D_W = 18 + 36 + 18 + 1
"""Number of weights ``d``."""


def toy_problem(c: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Φ (30 × 73), Ψ₀ = TΦ (c × 73), y (c,))`` float64: a dense 'network' Φ, a ray-transform-like random
    ``T`` (``c × 30``) and targets ``y = TΦw + 0.1 ε`` for random weights ``w``, all from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    Phi = torch.randn(math.prod(IMAGE), D_W, generator=g, dtype=torch.float64) / 3
    T = torch.randn(c, math.prod(IMAGE), generator=g, dtype=torch.float64) / 4
    w = torch.randn(D_W, generator=g, dtype=torch.float64) * 0.5
    y = T @ Phi @ w + 0.1 * torch.randn(c, generator=g, dtype=torch.float64)
    return Phi, T @ Phi, y
