"""Networks: the DIP U-Net (2D/3D) and its presets."""

from ctuq.models.unet import PRESETS, UNet, UNetConfig, build_unet, count_parameters, make_net_input

__all__ = ["UNet", "UNetConfig", "PRESETS", "build_unet", "make_net_input", "count_parameters"]
