"""U-Net generator ``g(v)`` for the deep image prior, in 2D (slices) and 3D (volumes).

Architecture (DESIGN.md §7, the published walnut network): an input block at full resolution, ``S − 1``
strided-convolution down blocks, ``S − 1`` up blocks (bilinear/trilinear ×2 upsampling, an optional
skip connection squeezed through a 1×1 convolution, two 3×3 convolutions), and a 1×1 output convolution.
Every 3×3 convolution is followed by GroupNorm and LeakyReLU(0.2), and by channel dropout when
``dropout > 0`` (MC dropout). There is no dense layer, so the network is fully convolutional.

``skip_channels`` follows the published list format: ``skip_channels[i]`` (``i ≥ 1``) is the width of
the skip connection that enters the up block going from scale ``i`` to scale ``i − 1``, i.e. it carries
encoder features of scale ``i − 1``; ``0`` means no skip there. ``skip_channels[0]`` has no connection
to describe and is ignored (kept so the list has one entry per scale, as published). The walnut setting
``[0, 0, 0, 0, 4, 4]`` therefore has skips only from the two coarsest encoder levels below the bottleneck
(1/8 and 1/16 resolution), which keeps fine noise from bypassing the bottleneck.

Parameters are ordinary ``nn.Conv*d``/``nn.GroupNorm`` parameters; the convolution *weights* are what the
linearised model treats as ``v`` (:meth:`UNet.conv_weight_names`), biases and norm affine parameters stay
separate parameters so they can be held fixed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ctuq.options import UNET_PRESETS

__all__ = ["UNet", "UNetConfig", "PRESETS", "build_unet", "make_net_input", "count_parameters"]


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """Everything needed to rebuild a :class:`UNet` (stored in checkpoints).

    ``channels`` and ``skip_channels`` have one entry per scale (see the module docstring).
    """

    in_channels: int = 1
    out_channels: int = 1
    channels: tuple[int, ...] = (32, 32, 32, 32)
    skip_channels: tuple[int, ...] = (0, 4, 4, 4)
    ndim: int = 2
    norm_groups: int = 4
    negative_slope: float = 0.2
    sigmoid: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "channels", tuple(int(c) for c in self.channels))
        object.__setattr__(self, "skip_channels", tuple(int(c) for c in self.skip_channels))
        if self.ndim not in (2, 3):
            raise ValueError(f"UNet: ndim must be 2 or 3, got {self.ndim}")
        if len(self.channels) < 1 or min(self.channels) < 1:
            raise ValueError(f"UNet: channels must be a non-empty list of positive ints, got {list(self.channels)}")
        if len(self.skip_channels) != len(self.channels):
            raise ValueError(
                f"UNet: skip_channels has {len(self.skip_channels)} entries but channels has {len(self.channels)} "
                f"(one per scale): {list(self.skip_channels)} vs {list(self.channels)}"
            )
        if min(self.skip_channels) < 0:
            raise ValueError(f"UNet: skip_channels must be >= 0, got {list(self.skip_channels)}")
        if self.in_channels < 1 or self.out_channels < 1:
            raise ValueError(f"UNet: in_channels/out_channels must be >= 1, got {self.in_channels}/{self.out_channels}")
        if self.norm_groups < 1:
            raise ValueError(f"UNet: norm_groups must be >= 1, got {self.norm_groups}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"UNet: dropout rate must be in [0, 1), got {self.dropout}")

    @property
    def scales(self) -> int:
        return len(self.channels)

    @property
    def min_size(self) -> int:
        """Images must be at least this large along every axis (one pixel at the coarsest scale)."""
        return 2 ** (self.scales - 1)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["channels"] = list(self.channels)
        d["skip_channels"] = list(self.skip_channels)
        return d


# 'walnut': the published 2D walnut network (~3M parameters).
# 'small': the CPU demo network at 128² (~0.1M parameters: fits the 2-minute DIP budget on 2 cores and keeps
#          the linearised inference affordable).
# 'tiny':  unit tests.
PRESETS: dict[str, dict] = UNET_PRESETS  # the table lives with its vocabulary (ctuq.options), where the config reads it


def _groups(channels: int, wanted: int) -> int:
    # GroupNorm needs the group count to divide the channel count; fall back to the largest divisor.
    return math.gcd(channels, wanted)


class _ConvNormAct(nn.Sequential):
    def __init__(self, cfg: UNetConfig, cin: int, cout: int, kernel: int, stride: int = 1):
        conv = (nn.Conv2d if cfg.ndim == 2 else nn.Conv3d)(cin, cout, kernel, stride=stride, padding=kernel // 2)
        layers: list[nn.Module] = [
            conv,
            nn.GroupNorm(_groups(cout, cfg.norm_groups), cout),
            nn.LeakyReLU(cfg.negative_slope),  # not in-place: torch.func transforms of the net stay simple
        ]
        if cfg.dropout > 0:
            layers.append((nn.Dropout2d if cfg.ndim == 2 else nn.Dropout3d)(cfg.dropout))
        super().__init__(*layers)


class _Down(nn.Module):
    def __init__(self, cfg: UNetConfig, cin: int, cout: int):
        super().__init__()
        self.conv1 = _ConvNormAct(cfg, cin, cout, 3, stride=2)
        self.conv2 = _ConvNormAct(cfg, cout, cout, 3)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class _Up(nn.Module):
    def __init__(self, cfg: UNetConfig, cin: int, cout: int, skip_in: int, skip: int):
        super().__init__()
        self.mode = "bilinear" if cfg.ndim == 2 else "trilinear"
        self.skip = _ConvNormAct(cfg, skip_in, skip, 1) if skip > 0 else None
        self.conv1 = _ConvNormAct(cfg, cin + skip, cout, 3)
        self.conv2 = _ConvNormAct(cfg, cout, cout, 3)

    def forward(self, x, encoder_features):
        # Upsample to the encoder level's exact size so odd sizes (e.g. 501) round-trip.
        x = F.interpolate(x, size=encoder_features.shape[2:], mode=self.mode, align_corners=True)
        if self.skip is not None:
            x = torch.cat([x, self.skip(encoder_features)], dim=1)
        return self.conv2(self.conv1(x))


class UNet(nn.Module):
    """Fully convolutional U-Net ``g``: ``(B, in_channels, *spatial)`` → ``(B, out_channels, *spatial)``.

    Parameters
    ----------
    in_channels, out_channels : int
        Channels of the network input (the fixed DIP input) and output (the image).
    channels : sequence of int
        Feature channels per scale, finest first; its length is the number of scales ``S``.
    skip_channels : sequence of int
        Skip-connection widths per scale (published list convention; see the module docstring).
    ndim : {2, 3}
        2 for slices ``(B, C, H, W)``, 3 for volumes ``(B, C, D, H, W)``.
    norm_groups : int
        GroupNorm groups (reduced to a divisor of each layer's channel count).
    sigmoid : bool
        Squash the output into (0, 1).
    dropout : float
        Channel-dropout rate after every 3×3/1×1 convolution block (0 disables; MC dropout uses ~0.05).

    Spatial sizes need not be powers of two: each up block resizes to its encoder level's size.
    """

    def __init__(
        self,
        in_channels: int = 1,
        out_channels: int = 1,
        channels: Sequence[int] = (32, 32, 32, 32),
        skip_channels: Sequence[int] = (0, 4, 4, 4),
        ndim: int = 2,
        norm_groups: int = 4,
        negative_slope: float = 0.2,
        sigmoid: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        cfg = UNetConfig(
            in_channels=in_channels,
            out_channels=out_channels,
            channels=tuple(channels),
            skip_channels=tuple(skip_channels),
            ndim=ndim,
            norm_groups=norm_groups,
            negative_slope=negative_slope,
            sigmoid=sigmoid,
            dropout=dropout,
        )
        self.config = cfg
        ch, sk = cfg.channels, cfg.skip_channels
        self.inc = _ConvNormAct(cfg, cfg.in_channels, ch[0], 3)
        self.down = nn.ModuleList([_Down(cfg, ch[i - 1], ch[i]) for i in range(1, cfg.scales)])
        # up[j] goes from scale S-1-j to S-2-j and merges encoder features of scale S-2-j.
        self.up = nn.ModuleList([_Up(cfg, ch[i], ch[i - 1], ch[i - 1], sk[i]) for i in range(cfg.scales - 1, 0, -1)])
        self.outc = (nn.Conv2d if ndim == 2 else nn.Conv3d)(ch[0], cfg.out_channels, 1)

    @classmethod
    def from_config(cls, cfg: UNetConfig | dict) -> UNet:
        """Rebuild from a :class:`UNetConfig` or its ``to_dict()`` (as stored in checkpoints)."""
        if isinstance(cfg, dict):
            cfg = UNetConfig(**cfg)
        return cls(**dataclasses.asdict(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        want = self.config.ndim + 2
        if x.ndim != want or x.shape[1] != self.config.in_channels:
            raise ValueError(
                f"UNet: input has shape {tuple(x.shape)}; expected (batch, {self.config.in_channels}, "
                f"{'D, ' if self.config.ndim == 3 else ''}H, W)"
            )
        if min(x.shape[2:]) < self.config.min_size:
            raise ValueError(
                f"UNet: spatial size {tuple(x.shape[2:])} is too small for {self.config.scales} scales "
                f"(needs >= {self.config.min_size} along every axis)"
            )
        feats = [self.inc(x)]
        for block in self.down:
            feats.append(block(feats[-1]))
        h = feats[-1]
        for j, block in enumerate(self.up):
            h = block(h, feats[-2 - j])
        out = self.outc(h)
        return torch.sigmoid(out) if self.config.sigmoid else out

    def conv_weight_names(self) -> list[str]:
        """Names (as in ``named_parameters``) of all convolution weights: the linearised parameters ``v``."""
        return [
            f"{mod_name}.weight" if mod_name else "weight"
            for mod_name, mod in self.named_modules()
            if isinstance(mod, (nn.Conv2d, nn.Conv3d))
        ]


def build_unet(
    preset: str | None = "small",
    *,
    channels: Sequence[int] | None = None,
    skip_channels: Sequence[int] | None = None,
    ndim: int = 2,
    **kwargs,
) -> UNet:
    """A :class:`UNet` from a named preset (``'walnut'``, ``'small'``, ``'tiny'``), with optional overrides.

    ``channels``/``skip_channels`` replace the preset's lists; other keyword arguments go to :class:`UNet`.
    With ``preset=None`` both lists must be given.
    """
    if preset is None:
        if channels is None or skip_channels is None:
            raise ValueError("build_unet: without a preset, both channels and skip_channels are required")
        base: dict = {}
    else:
        if preset not in PRESETS:
            raise ValueError(f"build_unet: unknown preset {preset!r}; valid presets: {sorted(PRESETS)}")
        base = dict(PRESETS[preset])
    if channels is not None:
        base["channels"] = tuple(channels)
        if skip_channels is None and len(base.get("skip_channels", ())) != len(base["channels"]):
            raise ValueError(
                f"build_unet: channels has {len(base['channels'])} scales but preset {preset!r} skip_channels "
                f"{list(base.get('skip_channels', ()))} does not; give skip_channels too"
            )
    if skip_channels is not None:
        base["skip_channels"] = tuple(skip_channels)
    return UNet(ndim=ndim, **base, **kwargs)


def make_net_input(shape: Sequence[int], channels: int = 1, seed: int = 0, std: float = 0.1) -> torch.Tensor:
    """The fixed random DIP input ``(1, channels, *shape)`` (float32, CPU), Gaussian with std ``std``.

    Drawn from its own seeded generator so it does not depend on (or disturb) the global RNG state.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise ValueError(f"make_net_input: shape must be 2 or 3 positive ints, got {shape}")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    return std * torch.randn((1, channels, *shape), generator=gen, dtype=torch.float32)


def count_parameters(model: nn.Module, conv_weights_only: bool = False) -> int:
    """Number of trainable parameters of any ``nn.Module`` (the one parameter count of ctuq: U-Nets and
    classifiers alike).

    ``conv_weights_only``: for a :class:`UNet`, count only its convolution weights
    (:meth:`UNet.conv_weight_names`, the linearised ``d``); other models count every trainable parameter.
    """
    if conv_weights_only and isinstance(model, UNet):
        names = set(model.conv_weight_names())
        return int(sum(p.numel() for n, p in model.named_parameters() if n in names))
    return int(sum(p.numel() for p in model.parameters() if p.requires_grad))
