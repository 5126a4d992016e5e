"""The DIP's warm start at an image (ctuq.reconstruct.warm_start.fit_to_image) and its pipeline option
``dip.warm_start = tv``."""

import json

import pytest
import tifffile
import torch
from tiny import NO_FIGURES, tiny_args

from ctuq.cli import main
from ctuq.models import build_unet
from ctuq.pipeline import run_folder as rf
from ctuq.reconstruct.warm_start import fit_to_image


def _target():
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, 32), torch.linspace(-1, 1, 32), indexing="ij")
    return 0.05 * ((xx**2 + yy**2) < 0.6).float() + 0.02 * ((xx - 0.2) ** 2 + yy**2 < 0.05).float()


def test_fit_to_image_copies_the_target_and_is_seeded():
    target = _target()
    net_input = target[None, None] * 14.0
    psnrs, outs = [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = build_unet("tiny", ndim=2)
        psnrs.append(fit_to_image(model, net_input, target, iterations=400, scale=14.0, progress=False))
        with torch.no_grad():
            outs.append(model(net_input)[0, 0] / 14.0)
    # tolerance: 400 Adam steps of the tiny U-Net on a 32² two-disk image reach ~40 dB on this CPU; 30 dB is the
    # floor below which the warm start would visibly change the image it hands over
    assert psnrs[0] > 30.0
    assert torch.equal(outs[0], outs[1]) and psnrs[0] == psnrs[1]
    err = float((outs[0] - target).pow(2).mean())
    span = float(target.max() - target.min())
    assert psnrs[0] == pytest.approx(10 * torch.log10(torch.tensor(span**2 / err)).item(), rel=1e-4)


def test_fit_to_image_rejects_bad_input():
    model, target = build_unet("tiny", ndim=2), _target()
    net_input = target[None, None]
    with pytest.raises(ValueError, match=r"target has shape \(16, 16\)"):
        fit_to_image(model, net_input, target[:16, :16], iterations=1)
    with pytest.raises(ValueError, match="iterations must be"):
        fit_to_image(model, net_input, target, iterations=-1)
    with pytest.raises(ValueError, match="lr must be positive"):
        fit_to_image(model, net_input, target, iterations=1, lr=0.0)
    with pytest.raises(ValueError, match="scale must be positive"):
        fit_to_image(model, net_input, target, iterations=1, scale=-1.0)
    with pytest.raises(FloatingPointError, match="lower lr"):
        fit_to_image(model, net_input * float("nan"), target, iterations=1)


def test_without_the_tv_baseline_the_tv_options_fall_back_with_a_warning(tiny_scan, tmp_path):
    """``tv.enabled = false`` (or a volume) under the demo's TV-based DIP settings: the FBP input, no warm start and
    ``dip.tv_weight``, the three named in one warning."""
    out = tmp_path / "run"
    off = ("dip.warm_start=tv", "model.input=tv", "dip.tv_weight_from_tv=true", "tv.enabled=false", "dip.iterations=2")
    argv = ["reconstruct", "--data", str(tiny_scan), "--out", str(out)]
    assert main([*argv, *tiny_args(*off, *NO_FIGURES, uq=False)]) == 0
    m = json.loads((out / rf.METRICS_NAME).read_text())
    (warning,) = m["warnings"]  # one line for the three settings
    assert warning.startswith("model.input = tv, dip.warm_start = tv, dip.tv_weight_from_tv without the TV baseline")
    assert m["dip"]["tv_weight"] == 1e-4 and "warm_start_psnr_to_tv" not in m["dip"]


def test_warm_start_starts_the_dip_at_the_tv_image(tiny_scan, tmp_path):
    """With the warm start, the DIP's first scored iterate is the network's copy of the TV image, and the kept
    iterate is never worse on the tuning rows than that start (both read from metrics.json)."""
    out = tmp_path / "run"
    warm = ("dip.warm_start=tv", "dip.warm_start_iterations=300", "model.input=tv", "dip.heldout_every=5",
            "dip.tv_weight_from_tv=true")  # fmt: skip
    argv = ["reconstruct", "--data", str(tiny_scan), "--out", str(out)]
    assert main([*argv, *tiny_args(*warm, *NO_FIGURES, uq=False)]) == 0
    m = json.loads((out / rf.METRICS_NAME).read_text())
    dip = m["dip"]
    # tolerance: 300 steps copy the 32² TV image to ~35-45 dB; below 25 dB the start would not be the TV image
    assert dip["warm_start_psnr_to_tv"] > 25.0
    # γ = 2 s λ / c from TV's weight (c = 16 angles × 32 columns)
    assert dip["tv_weight"] == pytest.approx(2 * 14.0 * m["tv"]["weight"] / 512, rel=1e-12)
    # the network's input is the TV image × dip.scale (the model file keeps it)
    tv = torch.as_tensor(tifffile.imread(out / rf.TV_NAME))
    net_input = torch.load(out / rf.MODEL_NAME, weights_only=False)["net_input"]
    assert torch.equal(net_input[0, 0], (tv * 14.0).float())
    trace = dip["heldout_trace"]
    assert trace[0][0] == 0
    assert dip["heldout_error"] <= trace[0][1]
