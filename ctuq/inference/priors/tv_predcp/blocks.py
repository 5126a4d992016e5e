"""The blocks of the TV-PredCP prior and the geometry of a 3×3 filter: which weights share hyperparameters
(:func:`block_layout`), the distances between a filter's taps, the Matérn-½ factor over them and the forward
differences behind the total variation (``docs/tv_predcp.md``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from ctuq.inference.priors.base import PriorError

__all__ = [
    "ASSEMBLE_LIMIT",
    "PriorBlock",
    "block_layout",
    "default_block_name",
    "tap_distances",
    "matern12_cholesky",
    "anisotropic_tv",
    "LENGTHSCALE_MIN",
    "LENGTHSCALE_MAX",
    "MATERN",
    "NORMAL",
]

ASSEMBLE_LIMIT = 50_000_000  # entries of Ψ₀ (400 MB in float64 while assembling) up to which the fit assembles it

LENGTHSCALE_MIN = 1e-2
LENGTHSCALE_MAX = 1e2
JITTER = 1e-6  # added to the Matérn correlation's diagonal: keeps the Cholesky factor of the rank-one ℓ → ∞ limit
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
    return torch.linalg.cholesky(torch.exp(-dist / ell) + JITTER * eye)


def anisotropic_tv(images: torch.Tensor, image_shape: Sequence[int]) -> torch.Tensor:
    """Forward differences ``D x`` ``(B, m)`` of flat images ``(B, prod(image_shape))`` along every axis of
    ``image_shape`` (the anisotropic TV is ``|D x|.sum(1)``)."""
    shape = tuple(int(s) for s in image_shape)
    x = images.reshape(images.shape[0], *shape)
    return torch.cat([torch.diff(x, dim=ax + 1).reshape(images.shape[0], -1) for ax in range(len(shape))], dim=1)
