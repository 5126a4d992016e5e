import pytest
import torch
from torch import nn

from ctuq.models import PRESETS, UNet, build_unet, count_parameters, make_net_input


def test_walnut_preset_has_published_size():
    model = build_unet("walnut")
    n = count_parameters(model)
    # Published: 6 scales x 128 channels, skip [0,0,0,0,4,4], "about 3M parameters".
    assert 2.8e6 < n < 3.2e6, n
    assert model.config.channels == (128,) * 6
    assert model.config.skip_channels == (0, 0, 0, 0, 4, 4)
    assert sum(isinstance(m, nn.GroupNorm) for m in model.modules()) > 0
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def test_small_preset_is_small():
    n = count_parameters(build_unet("small"))
    assert 50_000 <= n <= 150_000, n


@pytest.mark.parametrize("shape", [(32, 32), (33, 27), (17, 16)])
def test_forward_shapes_2d(shape):
    model = build_unet("tiny")
    out = model(torch.randn(2, 1, *shape))
    assert out.shape == (2, 1, *shape)


def test_forward_shapes_3d_and_sigmoid():
    model = build_unet("tiny", ndim=3, sigmoid=True)
    out = model(torch.randn(1, 1, 9, 12, 8))
    assert out.shape == (1, 1, 9, 12, 8)
    assert out.min() > 0 and out.max() < 1
    assert any(isinstance(m, nn.Conv3d) for m in model.modules())


def test_skip_channels_follow_published_convention():
    # skip_channels[i] feeds the up block from scale i to i-1; [0, 0, 4] => only the coarsest up block has one.
    model = UNet(channels=(8, 8, 8), skip_channels=(0, 0, 4))
    assert model.up[0].skip is not None and model.up[0].skip[0].out_channels == 4
    assert model.up[1].skip is None
    model2 = UNet(channels=(8, 8, 8), skip_channels=(0, 3, 0))
    assert model2.up[0].skip is None and model2.up[1].skip[0].out_channels == 3


def test_skip_is_used_in_forward():
    torch.manual_seed(0)
    model = UNet(channels=(4, 4), skip_channels=(0, 2))
    x = torch.randn(1, 1, 8, 8)
    out = model(x)
    out.sum().backward()
    assert model.up[0].skip[0].weight.grad.abs().sum() > 0


def test_conv_weight_names_are_exactly_the_conv_weights():
    model = build_unet("tiny")
    names = model.conv_weight_names()
    params = dict(model.named_parameters())
    assert names and all(n in params and n.endswith("weight") for n in names)
    assert all(params[n].ndim == 4 for n in names)
    others = [n for n in params if n not in names]
    # biases and GroupNorm affine parameters stay separate
    assert others and all(params[n].ndim == 1 for n in others)
    assert count_parameters(model, conv_weights_only=True) == sum(params[n].numel() for n in names)


def test_dropout_only_when_requested():
    assert not any(isinstance(m, nn.Dropout2d) for m in build_unet("tiny").modules())
    torch.manual_seed(0)
    model = build_unet("tiny", dropout=0.3)
    n_conv = sum(isinstance(m, nn.Conv2d) for m in model.modules()) - 1  # no dropout after the 1x1 output conv
    assert sum(isinstance(m, nn.Dropout2d) for m in model.modules()) == n_conv
    x = torch.randn(1, 1, 16, 16)
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))


def test_net_input_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = make_net_input((16, 12), seed=5)
    assert torch.equal(torch.get_rng_state(), before)
    assert a.shape == (1, 1, 16, 12) and a.dtype == torch.float32
    assert torch.equal(a, make_net_input((16, 12), seed=5))
    assert not torch.equal(a, make_net_input((16, 12), seed=6))
    assert abs(float(a.std()) - 0.1) < 0.03  # 192 samples of N(0, 0.1²)


def test_functional_jvp_through_unet():
    # The linearised inference differentiates the network w.r.t. its weights with torch.func.
    from torch.func import functional_call, jvp

    torch.manual_seed(0)
    model = build_unet("tiny").double()  # float64: central differences below are then accurate to ~1e-6
    x = make_net_input((16, 16)).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    tangent = {k: torch.randn_like(v) for k, v in params.items()}
    _, out_dot = jvp(lambda p: functional_call(model, p, (x,)), (params,), (tangent,))
    eps = 1e-5
    plus = functional_call(model, {k: params[k] + eps * tangent[k] for k in params}, (x,))
    minus = functional_call(model, {k: params[k] - eps * tangent[k] for k in params}, (x,))
    fd = (plus - minus) / (2 * eps)
    assert torch.allclose(out_dot, fd, rtol=1e-4, atol=1e-6 * float(fd.abs().max()))


def test_from_config_round_trip():
    model = build_unet("tiny", dropout=0.1)
    clone = UNet.from_config(model.config.to_dict())
    clone.load_state_dict(model.state_dict())
    assert clone.config == model.config


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(channels=(8, 8), skip_channels=(0,)), "skip_channels has 1 entries"),
        (dict(channels=(8, 0), skip_channels=(0, 0)), "positive"),
        (dict(ndim=4), "ndim"),
        (dict(dropout=1.5), "dropout"),
    ],
)
def test_bad_construction_is_clear(kwargs, match):
    with pytest.raises(ValueError, match=match):
        UNet(**kwargs)


def test_bad_preset_and_inputs_are_clear():
    with pytest.raises(ValueError, match="valid presets"):
        build_unet("huge")
    model = build_unet("tiny")
    with pytest.raises(ValueError, match="expected"):
        model(torch.randn(1, 2, 16, 16))
    with pytest.raises(ValueError, match="too small"):
        model(torch.randn(1, 1, 3, 16))
    assert set(PRESETS) >= {"walnut", "small", "tiny"}
