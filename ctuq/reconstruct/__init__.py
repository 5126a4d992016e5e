"""Reconstruction: the deep image prior (:mod:`.dip`), classical baselines (:mod:`.classical`: FBP from
:mod:`ctuq.operators`, TV with ODL's PDHG), optional pretraining (:mod:`.pretrain`) and the MC-dropout DIP
baseline (:mod:`.mc_dropout`). PSNR/SSIM live in :mod:`ctuq.metrics.image`."""

from ctuq.reconstruct.classical import tv_reconstruction
from ctuq.reconstruct.dip import DIPResult, fit_dip, load_checkpoint, tv_anisotropic
from ctuq.reconstruct.mc_dropout import MCDropoutPrediction, fit_mc_dropout_dip, mc_dropout_predict

__all__ = [
    "DIPResult",
    "fit_dip",
    "load_checkpoint",
    "tv_anisotropic",
    "tv_reconstruction",
    "MCDropoutPrediction",
    "fit_mc_dropout_dip",
    "mc_dropout_predict",
]
