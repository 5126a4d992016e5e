"""ctuq.linearize: JVP/VJP of a network at fixed weights against an assembled Jacobian (float64)."""

import numpy as np
import pytest
import torch
from torch import nn

from ctuq.linearize import (
    LinearizedNetwork,
    MemoryBudgetError,
    count_linearized_weights,
    default_linearized_parameters,
    eval_mode,
)
from ctuq.models import build_unet, make_net_input


def _tiny_unet():
    torch.manual_seed(0)
    model = build_unet("tiny").double()
    # Random (non-default) GroupNorm affine parameters and biases, so the fixed parameters matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("weight") or "norm" in name or p.ndim == 1:
                p.normal_(0.0, 0.3)
    return model, make_net_input((8, 8), seed=1).double()


class _Classifier(nn.Module):
    """Conv → GroupNorm → Dropout → Linear: logits (n, C) for a batch of n images."""

    def __init__(self, n_classes=3):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4 * 5 * 5, n_classes)

    def forward(self, x):
        h = self.drop(torch.relu(self.norm(self.conv(x))))
        return self.fc(h.flatten(1))


def _jacobian(net: LinearizedNetwork) -> torch.Tensor:
    """Assembled Φ (d_out × d) by reverse-mode autograd, independent of torch.func."""
    names = net.param_names
    params = dict(net.model.named_parameters())
    base = {n: p.detach().clone() for n, p in params.items()}

    def g(flat):
        tensors = dict(base)
        tensors.update(net.unflatten(flat))
        return torch.func.functional_call(net.model, tensors, (net.net_input,)).reshape(-1)

    modes = [(m, m.training) for m in net.model.modules()]
    net.model.eval()
    try:
        return torch.autograd.functional.jacobian(g, net.params(), vectorize=True)
    finally:
        for m, flag in modes:
            m.training = flag
        assert names == net.param_names


@pytest.fixture(scope="module")
def unet_case():
    model, x = _tiny_unet()
    net = LinearizedNetwork(model, x)
    return model, x, net, _jacobian(net)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["linearize", "recompute"])
def test_products_match_assembled_jacobian(unet_case, mode):
    model, x, net, J = unet_case
    net.reset_counters()
    if mode == "recompute":
        net = LinearizedNetwork(model, x, mode=mode)
    assert net.mode == mode
    gen = torch.Generator().manual_seed(0)
    U = torch.randn(5, net.d, generator=gen, dtype=torch.float64)
    R = torch.randn(4, net.d_out, generator=gen, dtype=torch.float64)
    assert J.shape == (net.d_out, net.d) == (64, 5008)
    torch.testing.assert_close(net.jvp(U), U @ J.T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(net.vjp(R), R @ J, rtol=1e-10, atol=1e-12)
    assert net.counters() == {"jvp": 5, "vjp": 4}
    net.reset_counters()
    assert net.n_jvp == net.n_vjp == 0


@pytest.mark.slow
def test_jvp_basis_gives_scaled_jacobian_columns_across_parameter_boundaries(unet_case):
    """``jvp_basis``: the columns ``start … stop − 1`` of the reverse-mode Jacobian times ``values``, over a range
    that spans several parameter tensors (per-tensor tangents, untraced), counted as JVPs; equal to the general
    :meth:`jvp` of the same scaled unit rows; the features' ``columns`` (which uses it) match unit-vector
    matvecs; a bad range or values shape is refused."""
    from ctuq.inference import FeatureOperator, LinearizedFeatures, ScaledFeatures

    model, x, _, J = unet_case
    net = LinearizedNetwork(model, x, mode="recompute", chunk_size=7)
    bounds = np.cumsum(net._numels)
    start, stop = int(bounds[0]) - 5, int(bounds[2]) + 3  # ends inside the first and fourth tensors
    values = torch.linspace(0.5, 2.0, stop - start, dtype=torch.float64)
    got = net.jvp_basis(start, stop, values)
    torch.testing.assert_close(got, (J[:, start:stop] * values).T, rtol=1e-10, atol=1e-12)
    assert net.counters() == {"jvp": stop - start, "vjp": 0}
    E = torch.zeros(stop - start, net.d, dtype=torch.float64)
    E[torch.arange(stop - start), torch.arange(start, stop)] = values
    torch.testing.assert_close(got, net.jvp(E), rtol=1e-12, atol=1e-14)
    scales = torch.rand(net.d, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.5
    base = LinearizedFeatures(
        net,
        output_map=lambda X: 2.0 * X[:, ::2],
        output_adjoint=lambda R: torch.zeros(R.shape[0], net.d_out, dtype=R.dtype).index_copy_(
            1, torch.arange(0, net.d_out, 2), 2.0 * R
        ),
    )
    feats = ScaledFeatures(base, scales)  # its columns come from the base's JVP basis
    torch.testing.assert_close(feats.columns(10, 40), FeatureOperator.columns(feats, 10, 40), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(base.columns(10, 40), FeatureOperator.columns(base, 10, 40), rtol=1e-12, atol=1e-14)
    for bad in ((5, 3), (-1, 2), (0, net.d + 1)):
        with pytest.raises(ValueError, match="jvp_basis: need 0 <= start <= stop <= d"):
            net.jvp_basis(*bad)
    with pytest.raises(ValueError, match=r"values must have shape \(3,\)"):
        net.jvp_basis(0, 3, torch.ones(4))


def test_output_and_params_are_the_model_at_fixed_weights(unet_case):
    model, x, net, _ = unet_case
    with torch.no_grad():
        torch.testing.assert_close(net.output(), model.eval()(x).reshape(-1))
    names = model.conv_weight_names()
    assert net.param_names == names
    params = dict(model.named_parameters())
    torch.testing.assert_close(net.params(), torch.cat([params[n].detach().reshape(-1) for n in names]))
    # A later in-place change of the module does not leak into the linearisation.
    before = net.params()
    with torch.no_grad():
        params[names[0]].add_(1.0)
    try:
        torch.testing.assert_close(net.params(), before)
    finally:
        with torch.no_grad():
            params[names[0]].sub_(1.0)


def test_adjointness(unet_case):
    _, _, net, _ = unet_case
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(3, net.d, generator=gen, dtype=torch.float64)
    r = torch.randn(3, net.d_out, generator=gen, dtype=torch.float64)
    lhs = (net.jvp(u) * r).sum(1)
    rhs = (u * net.vjp(r)).sum(1)
    torch.testing.assert_close(lhs, rhs, rtol=1e-11, atol=0)


def test_chunking_does_not_change_results(unet_case):
    model, x, net, _ = unet_case
    gen = torch.Generator().manual_seed(2)
    U = torch.randn(7, net.d, generator=gen, dtype=torch.float64)
    R = torch.randn(7, net.d_out, generator=gen, dtype=torch.float64)
    assert net.chunk_size is None
    ref_j, ref_v = net.jvp(U), net.vjp(R)  # automatic chunk: all 7 in one vmap call
    try:
        for chunk in (1, 3):
            net.chunk_size = chunk
            assert net.chunk_size_for("jvp") == net.chunk_size_for("vjp") == chunk
            torch.testing.assert_close(net.jvp(U), ref_j, rtol=1e-12, atol=1e-13)
            torch.testing.assert_close(net.vjp(R), ref_v, rtol=1e-12, atol=1e-13)
    finally:
        net.chunk_size = None
    with pytest.raises(ValueError, match="chunk_size"):
        net.chunk_size = 0
    # An explicit budget too small for even one product is refused with the sizes, not run past its promise.
    tight = LinearizedNetwork(model, x, memory_budget=1, mode="recompute")
    with pytest.raises(
        MemoryBudgetError,
        match=r"one JVP of this network \(output \(1, 1, 8, 8\), [0-9,]+ weights\).*budget is 0.00 GiB",
    ):
        tight.chunk_size_for("jvp")


def test_auto_chunk_follows_memory_estimate(unet_case):
    model, x, _, _ = unet_case
    net = LinearizedNetwork(model, x, memory_budget=64 * 1024**2)
    fixed, per_sample = net.estimate_memory("vjp")
    # Per sample at least the cotangent activations (one forward's worth) and the in/out vectors.
    assert per_sample >= 8 * (net.d + net.d_out)
    expected = max(1, min(16, (64 * 1024**2 - fixed) // per_sample))
    assert net.chunk_size_for("vjp") == expected


def test_parameter_selection_default_and_explicit():
    model, x = _tiny_unet()
    default = default_linearized_parameters(model)
    assert default == model.conv_weight_names()
    assert not any(n.endswith("bias") for n in default)
    assert not any(".1.weight" in n for n in default)  # GroupNorm weights are index 1 in each block

    bias = "outc.bias"
    chosen = ["outc.weight", bias, "inc.1.weight"]  # includes a bias and a GroupNorm weight
    net = LinearizedNetwork(model, x, param_names=chosen, mode="recompute")
    assert net.param_names == chosen
    params = dict(model.named_parameters())
    assert net.d == sum(params[n].numel() for n in chosen)
    J = _jacobian(net)
    U = torch.randn(2, net.d, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(net.jvp(U), U @ J.T, rtol=1e-10, atol=1e-12)
    # The output bias shifts every pixel by the same amount: its Jacobian column is all ones.
    bias_index = net.unflatten(torch.arange(net.d, dtype=torch.float64))[bias].long()
    col = net.vjp(torch.eye(net.d_out, dtype=torch.float64))[:, bias_index]
    torch.testing.assert_close(col, torch.ones_like(col))


def test_parameter_selection_errors():
    model, x = _tiny_unet()
    with pytest.raises(ValueError, match=r"unknown parameter name.*outc\.weigth"):
        LinearizedNetwork(model, x, param_names=["outc.weigth"])
    with pytest.raises(ValueError, match="more than once"):
        LinearizedNetwork(model, x, param_names=["outc.weight", "outc.weight"])
    with pytest.raises(ValueError, match="empty"):
        LinearizedNetwork(model, x, param_names=[])
    with pytest.raises(TypeError, match="sequence of names"):
        LinearizedNetwork(model, x, param_names="outc.weight")
    with pytest.raises(ValueError, match="mode"):
        LinearizedNetwork(model, x, mode="fast")
    with pytest.raises(ValueError, match="failed on net_input of shape"):
        LinearizedNetwork(model, torch.zeros(1, 3, 8, 8, dtype=torch.float64))
    net = LinearizedNetwork(model, x, mode="recompute")
    with pytest.raises(ValueError, match=r"U has shape \(2, 7\); expected \(batch, 5008\)"):
        net.jvp(torch.zeros(2, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"R has shape \(64,\); expected \(batch, 64\)"):
        net.vjp(torch.zeros(64, dtype=torch.float64))


def test_classifier_eval_mode_flattening_and_mode_restore():
    torch.manual_seed(0)
    model = _Classifier().double().train()  # train mode: dropout would be active
    model.norm.eval()  # a submodule deliberately in eval mode must stay so
    x = torch.randn(2, 1, 5, 5, dtype=torch.float64)
    net = LinearizedNetwork(model, x)  # mode="linearize": its JVP falls back to jvp for this model
    assert net.param_names == ["conv.weight", "fc.weight"]
    assert tuple(net.output_shape) == (2, 3) and net.d_out == 6
    assert model.training and not model.norm.training and model.drop.training  # modes restored
    with torch.no_grad():
        logits = model.eval()(x)
    model.train()
    model.norm.eval()
    # Logit k of example i sits at i*C + k.
    torch.testing.assert_close(net.output().reshape(2, 3), logits)
    J = _jacobian(net)
    U = torch.randn(3, net.d, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out1, out2 = net.jvp(U), net.jvp(U)
    torch.testing.assert_close(out1, out2, rtol=0, atol=0)  # deterministic: dropout off
    torch.testing.assert_close(out1, U @ J.T, rtol=1e-10, atol=1e-12)
    assert model.training and model.drop.training and not model.norm.training
    # Per example: the Jacobian rows of example 1 are rows 3..5 of Φ.
    R = torch.zeros(1, 6, dtype=torch.float64)
    R[0, 4] = 1.0
    torch.testing.assert_close(net.vjp(R)[0], J[4])


class _InsideFunction(torch.autograd.Function):
    """Runs products inside a custom autograd.Function's forward, as linear_operator's matmuls do."""

    @staticmethod
    def forward(ctx, t, net):
        return net.jvp(t)

    @staticmethod
    def backward(ctx, g):
        return None, None


@pytest.mark.slow
def test_first_jvp_traced_inside_an_autograd_function_is_correct(unet_case):
    # Regression: forward-mode AD is off inside Function.forward, and a linearisation traced there was all zero.
    model, x, _, J = unet_case
    net = LinearizedNetwork(model, x)
    U = torch.randn(2, net.d, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(_InsideFunction.apply(U, net), U @ J.T, rtol=1e-10, atol=1e-12)
    assert net.jvp_impl == "linearize"
    torch.testing.assert_close(net.jvp(U), U @ J.T, rtol=1e-10, atol=1e-12)


def test_a_wrong_trace_is_detected_and_replaced(unet_case, monkeypatch):
    import contextlib

    import ctuq.linearize as lin

    model, x, _, J = unet_case
    # Without re-enabling forward AD, tracing inside the Function yields a zero tangent graph: the check must
    # notice, warn, and fall back to torch.func.jvp.
    monkeypatch.setattr(lin, "_forward_ad_enabled", contextlib.nullcontext)
    net = LinearizedNetwork(model, x)
    U = torch.randn(2, net.d, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    with pytest.warns(RuntimeWarning, match="traced linearisation disagrees with torch.func.jvp"):
        out = _InsideFunction.apply(U, net)
    torch.testing.assert_close(out, U @ J.T, rtol=1e-10, atol=1e-12)
    assert net.jvp_impl == "jvp"


@pytest.mark.slow
def test_float32_matches_float64():
    model64, x64 = _tiny_unet()
    model32 = build_unet("tiny")
    model32.load_state_dict({k: v.float() for k, v in model64.state_dict().items()})
    n64 = LinearizedNetwork(model64, x64, mode="recompute")
    n32 = LinearizedNetwork(model32, x64.float())
    assert n32.dtype == torch.float32
    U = torch.randn(2, n64.d, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    R = torch.randn(2, n64.d_out, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    j32 = n32.jvp(U)  # float64 input is converted to the network's dtype
    assert j32.dtype == torch.float32
    torch.testing.assert_close(j32.double(), n64.jvp(U), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(n32.vjp(R).double(), n64.vjp(R), rtol=1e-4, atol=1e-4)


def test_mixed_dtype_model_is_rejected():
    model, x = _tiny_unet()
    model.outc.float()
    with pytest.raises(TypeError, match=r"outc\.(weight|bias).*convert the whole model"):
        LinearizedNetwork(model, x)


@pytest.mark.gpu
def test_cuda_products_and_measured_chunks():
    model, x = _tiny_unet()
    cpu = LinearizedNetwork(model, x)
    gpu = LinearizedNetwork(model.to("cuda"), x.to("cuda"), memory_budget=256 * 1024**2)
    fixed, per_sample = gpu.estimate_memory("jvp")
    assert per_sample > 0 and fixed >= 0
    assert 1 <= gpu.chunk_size_for("jvp") <= 1024
    U = torch.randn(20, cpu.d, dtype=torch.float64)
    R = torch.randn(20, cpu.d_out, dtype=torch.float64)
    torch.testing.assert_close(gpu.jvp(U.cuda()).cpu(), cpu.jvp(U), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(gpu.vjp(R.cuda()).cpu(), cpu.vjp(R), rtol=1e-9, atol=1e-10)


def test_weight_selection_and_eval_mode_are_public():
    """One home for "which weights are linearised" (count without a LinearizedNetwork) and for the evaluation mode
    every product runs in."""
    model = _Classifier().double().train()
    model.norm.eval()
    x = torch.randn(2, 1, 5, 5, dtype=torch.float64)
    assert (
        count_linearized_weights(model)
        == LinearizedNetwork(model, x).d
        == sum(p.numel() for n, p in model.named_parameters() if n in default_linearized_parameters(model))
    )
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert model.training and model.drop.training and not model.norm.training
