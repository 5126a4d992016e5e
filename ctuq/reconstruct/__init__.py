"""Reconstruction: the deep image prior (:mod:`.dip`), classical baselines (:mod:`.classical`: FBP from
:mod:`ctuq.operators`, TV with ODL's PDHG) and optional pretraining (:mod:`.pretrain`)."""

from ctuq.reconstruct.classical import tv_reconstruction
from ctuq.reconstruct.dip import DIPResult, fit_dip, load_checkpoint, psnr, tv_anisotropic

__all__ = ["DIPResult", "fit_dip", "load_checkpoint", "psnr", "tv_anisotropic", "tv_reconstruction"]
