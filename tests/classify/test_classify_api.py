"""ctuq.classify front end: batch-norm / group-norm networks, weight subsets, bad input with clear errors, the
save/load round trip (weights_only loading; tampered files refused) and the grid search of the prior precision."""

import pytest
import torch
from torch import nn

from ctuq.classify import GPRIOR_FLOOR, ClassifierStateError, LinearizedLaplace
from ctuq.classify.state import state_checksum
from ctuq.errors import format_user_error, is_user_error

# the fixtures' networks train for a few dozen steps on ~24 points: a single borderline label that the linearised
# mode gives to another class is above the over-fitting check's 1 %; these tests do not exercise that check
pytestmark = pytest.mark.filterwarnings("ignore::ctuq.classify.mode.OverfitWarning")


def _blobs(n, shape, n_classes, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % n_classes
    centres = torch.randn(n_classes, *shape, generator=g)
    return centres[y] + 0.7 * torch.randn(n, *shape, generator=g), y


def _loader(X, y, batch=16):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=batch)


class SmallCNN(nn.Module):
    def __init__(self, norm="batch"):
        super().__init__()
        layer = (lambda c: nn.BatchNorm2d(c)) if norm == "batch" else (lambda c: nn.GroupNorm(2, c))
        self.body = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            layer(4),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3),
            layer(4),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x))


def _train(model, X, y, steps=60):
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    return model


@pytest.fixture(scope="module")
def cnn_data():
    torch.manual_seed(0)
    X, y = _blobs(40, (1, 6, 6), 3, seed=2)
    return X[:30], y[:30], X[30:], y[30:]


@pytest.mark.parametrize("norm", ["batch", "group"])
def test_normalised_networks_are_linearised_in_eval_mode(cnn_data, norm):
    X, y, Xt, yt = cnn_data
    model = _train(SmallCNN(norm), X, y)
    model.train()  # left in train mode by the user: the linearisation still uses eval mode (running statistics)
    kw = {"solver": "cg", "solver_options": {"rank": 10}, "seed": 0}
    net = LinearizedLaplace(model, hessian_at="network", **kw).fit(_loader(X, y))
    assert model.training and all(m.training for m in model.modules())  # modes restored
    names = [n for n, _ in model.named_parameters()]
    assert net.param_names == names and any("1.weight" in n for n in names)  # norm parameters included ("all")
    # per-example Jacobians (g-prior) agree with the full-batch products: examples are independent in eval mode
    P0 = net.posterior.base.to_dense()
    s = net.scales
    norms = P0.pow(2).sum(0)
    expected = 1.0 / (norms + GPRIOR_FLOOR * norms[s > 0].median()).sqrt()  # the g-prior's default ridge
    torch.testing.assert_close(expected[s > 0], s[s > 0], rtol=1e-8, atol=0)
    # the default evaluates B at the linear model's mode (features rebuilt) but keeps the network's g-prior scales
    la = LinearizedLaplace(model, hessian_at="linear_mode", **kw).fit(_loader(X, y))
    assert model.training
    torch.testing.assert_close(la.scales, s, rtol=0, atol=0)
    la.optimize_prior("sampled_em", max_steps=2, n_samples=8)
    assert len(la.em_trace) == 2 and la.prior_precision > 0
    p = la.predict(Xt, samples=16)
    assert p.shape == (10, 3) and torch.allclose(p.sum(1), torch.ones(10, dtype=torch.float64))
    with torch.no_grad():
        model.eval()
        f = model(Xt).double()
    torch.testing.assert_close(la.predict_logits(Xt, n_samples=4)[0], f, rtol=1e-5, atol=1e-5)  # mean = network


def test_last_layer_and_named_subsets(cnn_data):
    X, y, Xt, _ = cnn_data
    model = _train(SmallCNN(), X, y, steps=20)
    la = LinearizedLaplace(model, weights="last_layer", solver="exact").fit(_loader(X, y))
    assert la.param_names == ["head.weight", "head.bias"] and la.n_params == 51
    la.optimize_prior("exact", max_steps=20)
    assert la.log_evidence() < 0 and la.predict(Xt, link="probit").shape == (10, 3)
    la2 = LinearizedLaplace(model, weights=["body.0.weight", "head.weight"], solver="exact").fit(_loader(X, y))
    assert la2.n_params == 36 + 48
    with pytest.raises(ValueError, match=r"unknown parameter name\(s\) \['head.wieght'\].*head.weight"):
        LinearizedLaplace(model, weights=["head.wieght"])


def test_auto_features_are_assembled_for_weight_sharing_networks_only(cnn_data):
    """``dense_features="auto"`` with an iterative solver: ``Ψ₀`` assembled when a forward pass costs ``≥ 2·C·d`` flops
    per example (the CNN: every filter weight used at every position), Jacobian products for an MLP (each weight
    used once); counting the flops runs the copy in eval mode, leaving a train-mode model's batch-norm statistics
    and modes as they were."""
    from ctuq.classify.build import assembly_pays, forward_flops_per_example
    from ctuq.classify.jacobians import DenseJacobian
    from ctuq.linearize import LinearizedNetwork

    X, y, _, _ = cnn_data
    assert forward_flops_per_example(nn.Linear(4, 3), torch.randn(5, 4)) == 2 * 4 * 3  # one multiply-add per weight
    cnn = SmallCNN("batch").train()
    before = {k: v.clone() for k, v in cnn.state_dict().items()}
    flops = forward_flops_per_example(cnn, X)
    assert cnn.training and all(torch.equal(before[k], v) for k, v in cnn.state_dict().items())
    d = sum(p.numel() for p in cnn.parameters())
    assert flops > 2 * 3 * d and assembly_pays(flops, 3, d) and not assembly_pays(2.0 * d, 3, d)
    said = []
    la = LinearizedLaplace(cnn, solver="cg", solver_options={"rank": 5}, log=said.append).fit(_loader(X, y))
    assert isinstance(la.posterior.base.network, DenseJacobian) and any("Ψ₀ assembled" in m for m in said)
    mlp = nn.Sequential(nn.Linear(36, 8), nn.Tanh(), nn.Linear(8, 3))
    la = LinearizedLaplace(mlp, solver="cg", solver_options={"rank": 5}).fit(_loader(X.flatten(1), y))
    assert isinstance(la.posterior.base.network, LinearizedNetwork)


# ------------------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    X, y = _blobs(24, (4,), 3, seed=1)
    model = _train(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), X, y, steps=30)
    return model, X, y


class Squeeze(nn.Module):
    def forward(self, x):
        return self.lin(x)[:, 0]

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)


def test_bad_input_gets_clear_errors(mlp):
    model, X, y = mlp
    with pytest.raises(
        ValueError, match=r"logits of shape \(N, C\) with C >= 2 classes; for 24 inputs it returned \(24,\)"
    ):
        LinearizedLaplace(Squeeze()).fit(_loader(X, y))
    bad = y.clone()
    bad[3] = 5
    with pytest.raises(ValueError, match=r"labels must lie in 0..2 \(the model returns 3 logits\), got labels in 0..5"):
        LinearizedLaplace(model).fit(_loader(X, bad))
    with pytest.raises(ValueError, match="yielded no examples"):
        LinearizedLaplace(model).fit([])
    with pytest.raises(ValueError, match="integer class indices"):
        LinearizedLaplace(model).fit(_loader(X, y.float()))
    with pytest.raises(ValueError, match=r"expected \(inputs, labels\)"):
        LinearizedLaplace(model).fit([X])
    with pytest.raises(ValueError, match="the model failed on inputs of shape"):
        LinearizedLaplace(model).fit(_loader(X[:, :3], y))
    with pytest.raises(ValueError, match="weights must be one of"):
        LinearizedLaplace(model, weights="first_layer")
    with pytest.raises(ValueError, match="prior_precision must be positive"):
        LinearizedLaplace(model, prior_precision=0.0)
    with pytest.raises(ValueError, match="solver must be one of"):
        LinearizedLaplace(model, solver="magic")
    for floor in (-0.5, float("nan"), float("inf")):  # the g-prior's own check, when the fit makes it
        with pytest.raises(ValueError, match=r"floor must be finite and >= 0, got"):
            LinearizedLaplace(model, prior_options={"floor": floor}).fit(_loader(X, y))
    with pytest.raises(ValueError, match=r"prior_options \['steps'\] are not options of the 'gprior' prior"):
        LinearizedLaplace(model, prior_options={"steps": 3})
    with pytest.raises(ValueError, match=r"prior must be a diagonal prior \(gprior, isotropic"):
        LinearizedLaplace(model, prior="tv_predcp")  # a block prior gives no scales
    with pytest.raises(ValueError, match="do not apply to given scales"):
        LinearizedLaplace(model, prior=torch.ones(3), prior_options={"floor": 0.0})
    la = LinearizedLaplace(model, solver="exact")
    with pytest.raises(RuntimeError, match=r"call fit\(train_loader\) first"):
        la.predict(X)
    la.fit(_loader(X, y))
    with pytest.raises(ValueError, match="link must be one of"):
        la.predict(X, link="laplace")
    with pytest.raises(ValueError, match="method must be one of"):
        la.optimize_prior("gradient")
    with pytest.raises(ValueError, match="the model failed on inputs"):
        la.predict(X[:, :2])
    with pytest.raises(ValueError, match="positive int"):
        la.predict(X, samples=0)
    cg = LinearizedLaplace(model, solver="cg", solver_options={"rank": 10}).fit(_loader(X, y))
    with pytest.raises(ValueError, match="log_evidence needs an exact solver"):
        cg.log_evidence()


# ------------------------------------------------------------------------------------------ save / load
def test_state_round_trip_with_weights_only_loading(mlp, tmp_path):
    model, X, y = mlp
    la = LinearizedLaplace(model, solver="cg", solver_options={"rank": 20}, seed=3, prior_options={"floor": 0.25})
    la.fit(_loader(X, y)).optimize_prior("sampled_em", max_steps=2)
    probs = la.predict(X, samples=32, seed=5)
    torch.save(la.state_dict(), tmp_path / "la.pt")
    state = torch.load(tmp_path / "la.pt", weights_only=True)
    loaded = LinearizedLaplace.from_state_dict(model, state)
    assert loaded.prior_precision == la.prior_precision and loaded.em_trace == la.em_trace
    assert loaded.prior_options == {"floor": 0.25}  # the g-prior's ridge is a setting of the state
    # the stored posterior samples predict without the training data
    torch.testing.assert_close(loaded.predict(X, samples=32, seed=5), probs)
    # fit() resumes: no g-prior work, the same EM continues exactly as the uninterrupted object does
    assert loaded.overfit_fraction is None and loaded.mode_kl is None  # no training logits before fit()
    loaded.fit(_loader(X, y))
    torch.testing.assert_close(loaded.scales, la.scales)
    assert loaded.overfit_fraction == la.overfit_fraction
    assert loaded.mode_kl == pytest.approx(la.mode_kl, rel=1e-6)
    loaded.optimize_prior("sampled_em", max_steps=2)
    la.optimize_prior("sampled_em", max_steps=2)
    assert [r["a_new"] for r in loaded.em_trace] == pytest.approx([r["a_new"] for r in la.em_trace], rel=1e-6)
    # another network, or other weights, is refused
    other = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    with pytest.raises(ValueError, match="was saved for parameters"):
        LinearizedLaplace(other).load_state_dict(state)
    changed = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    with pytest.raises(ValueError, match="weights differ"):
        LinearizedLaplace(changed).load_state_dict(state)
    with pytest.raises(ValueError, match="not a LinearizedLaplace state"):
        LinearizedLaplace(model).load_state_dict({"version": 1})


# ------------------------------------------------------------------------------------------ held-out guard
def test_the_heldout_guard_keeps_the_widest_prior_that_matches_the_network(mlp, tmp_path):
    """Validation data on which the network is right (its own training inputs): the EM's width costs NLL there, so the
    guard raises ``a`` by √10 per step until the predictive's validation NLL is within the tolerance of the network's,
    and not one step further; each recorded NLL is that of a fresh object set to the recorded ``a``. With an infinite
    tolerance the EM's ``a`` stands. The record survives save/load."""
    model, X, y = mlp
    kw = {"solver": "exact", "seed": 1}
    val = _loader(X, y)
    la = LinearizedLaplace(model, **kw).fit(_loader(X, y))
    em = la.optimize_prior("exact", max_steps=10, val_loader=val, link="probit", samples=16, tolerance=0.01)
    g = la.guard
    assert g["a_em"] == em.a and g["a"] == la.prior_precision and len(g["trace"]) >= 2, g
    assert [r["a"] for r in g["trace"]] == pytest.approx([em.a * 10 ** (k / 2) for k in range(len(g["trace"]))])
    limit = (1 + 0.01) * g["network_nll"]
    assert all(r["nll"] > limit for r in g["trace"][:-1]) and g["trace"][-1]["nll"] <= limit, g
    with torch.no_grad():
        net = float(-torch.log_softmax(model(X).double(), 1)[torch.arange(len(y)), y].mean())
    assert g["network_nll"] == pytest.approx(net, rel=1e-6)  # the float32 network's logits
    for r in g["trace"]:
        other = LinearizedLaplace(model, **kw).fit(_loader(X, y)).set_prior_precision(r["a"])
        p = other.predict(X, link="probit", samples=16, seed=1)
        assert r["nll"] == pytest.approx(float(-p[torch.arange(len(y)), y].log().mean()), rel=1e-4)
    again = LinearizedLaplace.load(model, la.save(tmp_path / "guarded.pt"))
    assert again.guard == g and again.prior_precision == la.prior_precision
    loose = LinearizedLaplace(model, **kw).fit(_loader(X, y))
    em2 = loose.optimize_prior("exact", max_steps=10, val_loader=val, tolerance=1e9)
    assert loose.prior_precision == em2.a == em.a and len(loose.guard["trace"]) == 1


def test_the_heldout_guard_warns_when_no_prior_reaches_the_network(mlp, monkeypatch):
    """A zero tolerance on data the network fits cannot be met by any positive width: after ``GUARD_STEPS`` steps
    the guard warns and leaves ``a`` at the last one."""
    import ctuq.classify.prior_fit as prior_fit
    from ctuq.classify import GuardWarning

    model, X, y = mlp
    monkeypatch.setattr(prior_fit, "GUARD_STEPS", 2)
    la = LinearizedLaplace(model, solver="exact", seed=1).fit(_loader(X, y))
    with pytest.warns(GuardWarning, match="the held-out guard raised a to"):
        em = la.optimize_prior("exact", max_steps=10, val_loader=_loader(X, y), tolerance=0.0)
    assert len(la.guard["trace"]) == 3 and la.prior_precision == pytest.approx(em.a * 10.0)


def test_the_heldout_guard_refuses_bad_settings_before_the_em(mlp):
    model, X, y = mlp
    la = LinearizedLaplace(model, solver="exact").fit(_loader(X, y))
    val = _loader(X[:6], y[:6])
    for kwargs, message in [
        (dict(tolerance=-0.1), "tolerance must be >= 0 and finite"),
        (dict(link="laplace"), "link must be one of"),
        (dict(samples=0), "samples must be a positive int"),
    ]:
        with pytest.raises(ValueError, match=message):
            la.optimize_prior("exact", val_loader=val, **kwargs)
    with pytest.raises(ValueError, match=r"labels must lie in 0..2"):
        la.optimize_prior("exact", val_loader=_loader(X[:6], y[:6] + 3))
    assert la.em_trace == [] and la.guard is None  # nothing ran


# ------------------------------------------------------------------------------------------ grid search
def test_gridsearch_picks_the_lowest_validation_nll(mlp):
    """Every grid value is scored by the predictive's validation NLL (same posterior samples seed); the chosen ``a``
    is the arg-min, and the object is left at it (its predictive equals a fresh one set to that ``a``)."""
    model, X, y = mlp
    Xv, yv = _blobs(30, (4,), 3, seed=7)
    kw = {"solver": "exact", "seed": 1}
    la = LinearizedLaplace(model, **kw).fit(_loader(X, y))
    grid = [0.03, 0.3, 3.0, 30.0, 300.0]
    out = la.optimize_prior("gridsearch", val_loader=_loader(Xv, yv), link="mc", grid=grid, samples=32)
    nlls = []
    for a in grid:  # an independent evaluation of each grid point on a fresh object
        other = LinearizedLaplace(model, **kw).fit(_loader(X, y)).set_prior_precision(a)
        p = other.predict(Xv, link="mc", samples=32, seed=1)
        nlls.append(float(-p[torch.arange(30), yv].log().mean()))
    assert [r["a"] for r in out["trace"]] == grid
    # the modes are warm-started along the grid there and from the trained weights here: equal to L-BFGS's gtol
    assert [r["nll"] for r in out["trace"]] == pytest.approx(nlls, rel=1e-4)
    best = grid[min(range(len(grid)), key=nlls.__getitem__)]
    assert out["a"] == best == la.prior_precision and la.gridsearch_trace == out["trace"]
    assert len(set(nlls)) == len(grid)  # the NLL depends on a: the arg-min is a real choice
    torch.testing.assert_close(
        la.predict(Xv, link="mc", samples=32, seed=1),
        LinearizedLaplace(model, **kw).fit(_loader(X, y)).set_prior_precision(best).predict(Xv, "mc", 32, seed=1),
        rtol=1e-4,
        atol=1e-6,
    )


def test_gridsearch_bad_input(mlp):
    model, X, y = mlp
    la = LinearizedLaplace(model, solver="exact").fit(_loader(X, y))
    val = _loader(X[:6], y[:6])
    with pytest.raises(ValueError, match="needs val_loader="):
        la.optimize_prior("gridsearch")
    with pytest.raises(ValueError, match="grid must hold at least one positive finite precision"):
        la.optimize_prior("gridsearch", val_loader=val, grid=[1.0, -2.0])
    with pytest.raises(ValueError, match="grid must hold at least one positive finite precision"):
        la.optimize_prior("gridsearch", val_loader=val, grid=[])
    with pytest.raises(ValueError, match="grid must be a sequence of prior precisions"):
        la.optimize_prior("gridsearch", val_loader=val, grid="wide")
    with pytest.raises(ValueError, match="link must be one of"):
        la.optimize_prior("gridsearch", val_loader=val, link="laplace")
    with pytest.raises(ValueError, match="samples must be a positive int"):
        la.optimize_prior("gridsearch", val_loader=val, samples=0)
    with pytest.raises(ValueError, match=r"labels must lie in 0..2"):
        la.optimize_prior("gridsearch", val_loader=_loader(X[:6], y[:6] + 3), grid=[1.0])
    with pytest.raises(ValueError, match="yielded no examples"):
        la.optimize_prior("gridsearch", val_loader=[], grid=[1.0])
    with pytest.raises(ValueError, match="grid belongs to method='gridsearch'"):
        la.optimize_prior("exact", grid=[1.0])
    with pytest.raises(ValueError, match="hessian_at must be one of"):
        LinearizedLaplace(model, hessian_at="map")
    with pytest.raises(ValueError, match="a must be positive and finite"):
        la.set_prior_precision(float("nan"))


# ------------------------------------------------------------------------------------------ state files
class DropoutMLP(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 3))


def _same(a, b):
    """Bitwise equality of two states (dicts, lists, tensors with dtype and shape, floats by their bits)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, z) for x, z in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and (a == b or (a != a and b != b))


def test_linear_mode_state_round_trips_bitwise_and_tampered_files_are_refused(tmp_path):
    """A dropout network (linearised in eval mode) with B at the linear mode, after EM and a grid search: the state
    (hessian_at, the curvature diagnostic, the grid trace, samples) survives save/load bitwise; the loaded object
    predicts at once and resumes the EM exactly; an edited, truncated or foreign file is refused in one line."""
    torch.manual_seed(0)
    X, y = _blobs(24, (4,), 3, seed=1)
    model = _train(DropoutMLP(), X, y, steps=40)
    model.train()
    kw = {
        "solver": "cg",
        "solver_options": {"rank": 20},
        "seed": 3,
        "dense_features": "always",
        "hessian_at": "linear_mode",
    }
    la = LinearizedLaplace(model, **kw).fit(_loader(X, y))
    la.optimize_prior("sampled_em", max_steps=2, n_samples=8)
    la.optimize_prior("gridsearch", val_loader=_loader(X, y), grid=[0.5, 5.0], samples=8)
    la.optimize_prior("sampled_em", max_steps=1, n_samples=8)
    probs = la.predict(X, samples=16, seed=5)
    assert model.training  # the user's modes are left alone
    path = la.save(tmp_path / "la.pt")
    state = la.state_dict()
    assert state["settings"]["hessian_at"] == "linear_mode" and state["hessian"]["trace_mode"] > 0
    loaded = LinearizedLaplace.load(model, path)
    assert _same(loaded.state_dict(), state)
    assert loaded.hessian_ratio == la.hessian_ratio and loaded.gridsearch_trace == la.gridsearch_trace
    torch.testing.assert_close(loaded.predict(X, samples=16, seed=5), probs)
    loaded.fit(_loader(X, y))
    loaded.optimize_prior("sampled_em", max_steps=2, n_samples=8)
    la.optimize_prior("sampled_em", max_steps=2, n_samples=8)
    # the same random draws; the refitted mode agrees to L-BFGS's tolerance, which CG (rtol 1e-3) and the secant
    # step carry into the fifth digit of a at most
    assert [r["a_new"] for r in loaded.em_trace] == pytest.approx([r["a_new"] for r in la.em_trace], rel=1e-4)
    # tampering: one edited number, a truncated file, a foreign file, another version, another network
    edited = dict(state, scales=state["scales"] * 1.01)
    torch.save(edited, tmp_path / "edited.pt")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[:500])
    torch.save({"weights": torch.zeros(3)}, tmp_path / "foreign.pt")
    older = dict(state, version=2)
    torch.save(dict(older, checksum=state_checksum(older)), tmp_path / "older.pt")
    for name, match in (
        ("edited.pt", "modified after it was written"),
        ("truncated.pt", "not a readable torch file"),
        ("foreign.pt", "not a LinearizedLaplace state"),
        ("older.pt", "state version 2; this ctuq reads version 5"),
    ):
        with pytest.raises(ClassifierStateError, match=match) as info:
            LinearizedLaplace.load(model, tmp_path / name)
        msg = format_user_error(info.value)
        assert str(tmp_path / name) in msg and "\n" not in msg and is_user_error(info.value)
    with pytest.raises(ClassifierStateError, match=r"la\.pt: .*weights differ"):
        LinearizedLaplace.load(DropoutMLP(), path)
    with pytest.raises(ClassifierStateError, match="hessian_at='linear_mode', this object 'network'"):
        LinearizedLaplace(model, hessian_at="network").load_state_dict(state)
    with pytest.raises(FileNotFoundError, match="no such LinearizedLaplace state file"):
        LinearizedLaplace.load(model, tmp_path / "missing.pt")
