"""Networks: the DIP U-Net (2D/3D) and its presets; the one versioned model file format (:mod:`.model_file`)."""

from ctuq.models.model_file import (
    MODEL_FILE_FORMAT,
    MODEL_FILE_VERSION,
    ModelFile,
    ModelFileError,
    read_model_file,
    write_model_file,
)
from ctuq.models.unet import PRESETS, UNet, UNetConfig, build_unet, count_parameters, make_net_input

__all__ = [
    "UNet",
    "UNetConfig",
    "PRESETS",
    "build_unet",
    "make_net_input",
    "count_parameters",
    "ModelFile",
    "ModelFileError",
    "read_model_file",
    "write_model_file",
    "MODEL_FILE_FORMAT",
    "MODEL_FILE_VERSION",
]
