"""ctuq.metrics.image, the one home of PSNR and SSIM: the torch PSNR equals skimage's, the DIP's per-iteration
formula is the same, and bad input is refused."""

import math

import numpy as np
import pytest
import torch
from skimage.metrics import peak_signal_noise_ratio

from ctuq.metrics import image_metrics, psnr, psnr_from_mse


def _pair(shape=(17, 23), seed=0):
    rng = np.random.default_rng(seed)
    gt = rng.random(shape).astype(np.float32)
    return gt + 0.05 * rng.standard_normal(shape).astype(np.float32), gt


@pytest.mark.parametrize("shape", [(17, 23), (9, 11, 13)])
def test_psnr_is_skimages_definition(shape):
    x, gt = _pair(shape)
    data_range = float(gt.astype(np.float64).max() - gt.astype(np.float64).min())
    ref = peak_signal_noise_ratio(gt.astype(np.float64), x.astype(np.float64), data_range=data_range)
    assert psnr(torch.from_numpy(x), torch.from_numpy(gt)) == pytest.approx(ref, rel=1e-12)
    assert image_metrics(x, gt)["psnr"] == pytest.approx(ref, rel=1e-12)
    mse = float(np.mean((x.astype(np.float64) - gt) ** 2))
    assert psnr_from_mse(mse, data_range) == pytest.approx(ref, rel=1e-12)
    assert psnr(torch.from_numpy(x), torch.from_numpy(gt), data_range=2.0) == pytest.approx(
        10 * math.log10(4.0 / mse), rel=1e-12
    )


def test_perfect_match_and_bad_input():
    x, gt = _pair()
    t = torch.from_numpy(gt)
    assert psnr(t, t) == math.inf and psnr_from_mse(0.0, 1.0) == math.inf
    with np.errstate(divide="ignore"):  # skimage divides by the zero error (its +inf becomes None)
        m = image_metrics(gt, gt)
    assert m["psnr"] is None and m["ssim"] == pytest.approx(1.0)
    assert 0.0 < image_metrics(torch.from_numpy(x), t)["ssim"] < 1.0
    with pytest.raises(ValueError, match=r"psnr: image shape \(17, 22\) != ground-truth shape \(17, 23\)"):
        psnr(t[:, :-1], t)
    with pytest.raises(ValueError, match="image_metrics: reconstruction shape"):
        image_metrics(x[:, :-1], gt)
    with pytest.raises(ValueError, match="constant"):
        image_metrics(x, np.ones_like(gt))
