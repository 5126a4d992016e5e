"""MC-dropout prediction (ctuq.reconstruct.mc_dropout): dropout active and everything else in eval behaviour,
shapes and units, seeded reproducibility independent of batching, clear errors, and the dropout-DIP fit."""

import numpy as np
import pytest
import torch
from torch import nn

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.models import build_unet, make_net_input
from ctuq.operators import SparseRayTransform
from ctuq.reconstruct import fit_mc_dropout_dip, mc_dropout_predict
from ctuq.reconstruct.mc_dropout import dropout_layers, pass_seed

SHAPE = (16, 16)


class Expose(nn.Module):
    """Wraps a layer so all its output channels come out as one image ``(B, 1, C, rest)``, as the predictor needs."""

    def __init__(self, *layers):
        super().__init__()
        self.body = nn.Sequential(*layers)

    def forward(self, x):
        y = self.body(x)
        return y.reshape(x.shape[0], 1, y.shape[1], -1)


@pytest.fixture(scope="module")
def dropout_unet():
    torch.manual_seed(0)
    return build_unet("tiny", dropout=0.05)


@pytest.fixture(scope="module")
def net_input():
    return make_net_input(SHAPE, seed=1)


def test_dropout_is_active_and_outputs_have_image_shapes_and_units(dropout_unet, net_input):
    scale = 14.0
    pred = mc_dropout_predict(dropout_unet, net_input, 12, scale=scale, seed=0, batch=5, progress=False)
    assert pred.passes.shape == (12, *SHAPE) and pred.passes.dtype == torch.float32
    assert pred.mean.shape == SHAPE and pred.std.shape == SHAPE
    # every pass differs from every other one: dropout is on (11 conv blocks at p = 0.05)
    flat = pred.passes.reshape(12, -1)
    assert torch.cdist(flat, flat).add(torch.eye(12)).min() > 0
    torch.testing.assert_close(pred.mean, pred.passes.double().mean(0).float())
    torch.testing.assert_close(pred.std, pred.passes.double().std(0, correction=1).float())
    # image units: the passes are the network's output divided by scale
    again = mc_dropout_predict(dropout_unet, net_input, 12, scale=1.0, seed=0, batch=5, progress=False)
    torch.testing.assert_close(pred.passes * scale, again.passes, rtol=1e-6, atol=1e-7)
    assert bool((pred.std > 0).all())  # channel dropout in every conv block reaches every pixel
    assert pred.rates == [0.05] * len(dropout_layers(dropout_unet)) and len(pred.rates) > 0
    assert pred.time_s > 0


def test_seeded_passes_reproduce_and_seeds_differ(dropout_unet, net_input):
    a = mc_dropout_predict(dropout_unet, net_input, 6, seed=3, progress=False)
    b = mc_dropout_predict(dropout_unet, net_input, 6, seed=3, progress=False)
    c = mc_dropout_predict(dropout_unet, net_input, 6, seed=4, progress=False)
    assert torch.equal(a.passes, b.passes)
    assert not torch.allclose(a.passes, c.passes)
    assert pass_seed(3, 0) != pass_seed(3, 1) and pass_seed(3, 1) != pass_seed(4, 0)


def test_batched_and_sequential_passes_agree(dropout_unet, net_input):
    # Pass j's masks come from its own generator, so the batch size changes only float round-off of the convs
    # (~1e-6 relative to the image); a different mask would change pixels by about the pass std (~1e-2 here).
    seq = mc_dropout_predict(dropout_unet, net_input, 7, seed=11, batch=1, progress=False)
    bat = mc_dropout_predict(dropout_unet, net_input, 7, seed=11, batch=3, progress=False)  # 3 + 3 + 1
    tol = 1e-4 * float(seq.passes.abs().max())
    assert tol < 0.01 * float(seq.std.mean())
    torch.testing.assert_close(seq.passes, bat.passes, rtol=0, atol=tol)
    first = mc_dropout_predict(dropout_unet, net_input, 3, seed=11, batch=3, progress=False)
    torch.testing.assert_close(first.passes, seq.passes[:3], rtol=0, atol=tol)  # a prefix of the same stream


def test_only_dropout_runs_in_train_behaviour_and_modes_are_restored():
    """BatchNorm must use its running statistics (eval) while dropout samples; nothing is updated."""
    C, p = 400, 0.25
    model = Expose(nn.BatchNorm2d(C), nn.Dropout2d(p))
    bn = model.body[0]
    with torch.no_grad():
        bn.running_mean.fill_(1.0)
        bn.running_var.fill_(4.0 - bn.eps)
    model.train()
    x = torch.full((1, C, 3, 3), 5.0)
    pred = mc_dropout_predict(model, x, 50, seed=0, batch=16, progress=False)
    # with the running statistics the normalised value is (5 − 1)/2 = 2; batch statistics would give 0
    vals = torch.unique(pred.passes)
    torch.testing.assert_close(vals, torch.tensor([0.0, 2.0 / (1 - p)]))
    assert all(m.training for m in model.modules())
    torch.testing.assert_close(bn.running_mean, torch.ones(C))
    assert int(bn.num_batches_tracked) == 0


def test_mask_distribution_matches_torch_dropout():
    """Channel dropout zeroes whole channels with probability p; element dropout zeroes single elements."""
    C, p, n = 1000, 0.3, 20
    x = torch.ones((1, C, 2, 2))
    chan = mc_dropout_predict(Expose(nn.Dropout2d(p)), x, n, seed=0, batch=n, progress=False).passes  # (n, C, 4)
    assert torch.all((chan == 0).all(-1) | (chan != 0).all(-1))  # one value per channel
    torch.testing.assert_close(torch.unique(chan), torch.tensor([0.0, 1 / (1 - p)]))
    frac = float((chan[..., 0] == 0).float().mean())
    # n·C = 20 000 Bernoulli(0.3) draws: std of the fraction 0.0032; 5 sigma
    assert abs(frac - p) < 0.017
    elem = mc_dropout_predict(Expose(nn.Dropout(p)), x, n, seed=0, batch=n, progress=False).passes
    mixed = ((elem == 0).any(-1) & (elem != 0).any(-1)).float().mean()
    # P(a channel's 4 elements are neither all kept nor all dropped) = 1 − 0.7⁴ − 0.3⁴ = 0.752
    assert abs(float(mixed) - 0.752) < 0.03
    torch.testing.assert_close(float((elem == 0).float().mean()), p, atol=0.01, rtol=0)


def test_clear_errors(net_input):
    with pytest.raises(ValueError, match="no dropout layer"):
        mc_dropout_predict(build_unet("tiny"), net_input, 4, progress=False)
    with pytest.raises(ValueError, match="no dropout layer"):
        mc_dropout_predict(
            nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.Dropout2d(0.0)), net_input, 4, progress=False
        )
    with pytest.raises(ValueError, match="'1' is AlphaDropout"):  # named by its module path
        mc_dropout_predict(
            nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.AlphaDropout(0.1)), net_input, 4, progress=False
        )
    model = build_unet("tiny", dropout=0.1)
    with pytest.raises(ValueError, match="n_passes"):
        mc_dropout_predict(model, net_input, 1, progress=False)
    with pytest.raises(ValueError, match="batch"):
        mc_dropout_predict(model, net_input, 4, batch=0, progress=False)
    with pytest.raises(ValueError, match=r"net_input must be \(1, C"):
        mc_dropout_predict(model, net_input.expand(2, -1, -1, -1), 4, progress=False)
    with pytest.raises(ValueError, match="expected"):  # two output channels are not an image
        mc_dropout_predict(nn.Sequential(nn.Conv2d(1, 2, 1), nn.Dropout2d(0.1)), net_input, 4, progress=False)


def test_fit_mc_dropout_dip_fits_a_seeded_dropout_network():
    vol = VolumeGeometry(SHAPE, 1.0)
    geom = ProjectionGeometry("parallel", (24,), angles=np.linspace(0, np.pi, 12, endpoint=False), det_spacing=1.0)
    op = SparseRayTransform(vol, geom)
    yy, xx = np.mgrid[:16, :16] / 16 - 0.5
    x_true = torch.as_tensor(0.2 * ((xx**2 + yy**2) < 0.1), dtype=torch.float32)
    y = op(x_true)
    kw = dict(preset="tiny", dropout=0.05, iterations=30, lr=3e-3, scale=5.0, seed=2, progress=False)
    model, res = fit_mc_dropout_dip(op, y, **kw)
    layers = dropout_layers(model)
    assert layers and all(isinstance(m, nn.Dropout2d) and m.p == 0.05 for _, m in layers)
    assert res.reconstruction.shape == SHAPE and res.loss_history[-1] < res.loss_history[0]
    model2, res2 = fit_mc_dropout_dip(op, y, **kw)
    for k, v in res.best_state_dict.items():
        assert torch.equal(v, res2.best_state_dict[k]), k
    pred = mc_dropout_predict(model, res.net_input, 8, scale=5.0, progress=False)
    # the MC mean stays close to the dropout-off reconstruction at p = 0.05
    assert float((pred.mean - res.reconstruction).abs().mean()) < 0.5 * float(res.reconstruction.abs().mean())
    with pytest.raises(ValueError, match="dropout rate"):
        fit_mc_dropout_dip(op, y, preset="tiny", dropout=0.0, iterations=1)


@pytest.mark.gpu
def test_cuda_passes_reproduce_and_do_not_depend_on_batching(dropout_unet, net_input):
    model = build_unet("tiny", dropout=0.05).cuda()
    model.load_state_dict(dropout_unet.state_dict())
    a = mc_dropout_predict(model, net_input, 9, seed=5, batch=1, progress=False)
    b = mc_dropout_predict(model, net_input, 9, seed=5, batch=4, progress=False)
    assert a.passes.device.type == "cpu"
    torch.testing.assert_close(a.passes, b.passes, rtol=1e-4, atol=1e-5)
    assert torch.cdist(a.passes.reshape(9, -1), a.passes.reshape(9, -1)).add(torch.eye(9)).min() > 0
