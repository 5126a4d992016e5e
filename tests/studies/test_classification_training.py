"""MAP training of the classification study (`ctuq.studies.classification.train_map`) with per-weight precisions,
which `scripts/benchmark_classification.py --marglik-rounds` uses to train under the g-prior the EM chose."""

import pytest
import torch
from torch import nn

from ctuq.models import count_parameters
from ctuq.studies.classification import make_model, shifted_inputs, train_map, validation_split


def _data_and_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(48, 5, generator=g)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()
    torch.manual_seed(seed)
    return X, y, nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_uniform_precision_tensor_equals_the_scalar_weight_decay():
    X, y, m1 = _data_and_model()
    _, _, m2 = _data_and_model()
    d = _flat(m1).numel()
    train_map(m1, X, y, epochs=3, batch_size=16, weight_decay=7.0)
    train_map(m2, X, y, epochs=3, batch_size=16, weight_decay=torch.full((d,), 7.0))
    # same objective, the penalty summed in another order: float32 round-off only (Adam steps are ~1e-3)
    torch.testing.assert_close(_flat(m1), _flat(m2), rtol=0, atol=1e-5)


def test_per_weight_precision_shrinks_only_the_weights_it_names():
    X, y, free = _data_and_model()
    _, _, held = _data_and_model()
    start = _flat(free).clone()
    d = start.numel()
    lam = torch.zeros(d)
    first = free[0].weight.numel()  # the first layer's weight matrix comes first in parameters()
    lam[:first] = 1e5
    train_map(free, X, y, epochs=20, batch_size=16, lr=0.02)
    train_map(held, X, y, epochs=20, batch_size=16, lr=0.02, weight_decay=lam)
    v_free, v_held = _flat(free), _flat(held)
    # the held weights end near 0 (Adam hovers within a few lr of the minimum); the unpenalised run keeps its scale
    assert v_held[:first].norm() < 0.2 * v_free[:first].norm()
    assert v_held[:first].abs().max() < 0.1
    # the weights without a precision are not pulled to 0
    last = free[2].weight.numel()
    assert v_held[-last - 3 : -3].norm() > 0.5 * start[-last - 3 : -3].norm()


def test_precision_of_the_wrong_shape_is_refused():
    X, y, model = _data_and_model()
    d = _flat(model).numel()
    with pytest.raises(ValueError, match=rf"shape \({d},\).*got shape \({d - 1},\)"):
        train_map(model, X, y, epochs=1, weight_decay=torch.ones(d - 1))


def test_issue_recipe_adam_weight_decay_shrinks_the_weights():
    X, y, plain = _data_and_model()
    _, _, decayed = _data_and_model()
    train_map(plain, X, y, epochs=10, batch_size=16, lr=1e-2)
    train_map(decayed, X, y, epochs=10, batch_size=16, lr=1e-2, adam_weight_decay=1.0)
    assert _flat(decayed).norm() < _flat(plain).norm()


def test_corruptions_and_the_validation_split():
    g = torch.Generator().manual_seed(0)
    images, signals = torch.rand(5, 1, 8, 8, generator=g), torch.randn(4, 1, 40, generator=g)
    blurred = shifted_inputs("digits", images, "blur", 1.0)
    assert blurred.shape == images.shape and not torch.allclose(blurred, images)
    # a blur mixes pixels within an image, never across the batch: one image alone gives the same result
    torch.testing.assert_close(shifted_inputs("digits", images[2:3], "blur", 1.0), blurred[2:3])
    assert shifted_inputs("mnist1d", signals, "blur", 2.0).shape == signals.shape
    torch.testing.assert_close(shifted_inputs("mnist1d", signals, "translation", 8), torch.roll(signals, 8, -1))
    with pytest.raises(ValueError, match="unknown shift 'warp'"):
        shifted_inputs("digits", images, "warp", 1.0)
    y = torch.arange(30) % 3
    val, rest = validation_split(y, fraction=1 / 3, seed=0)
    assert sorted(val.tolist() + rest.tolist()) == list(range(30))  # disjoint, covering
    assert torch.bincount(y[val]).tolist() == [3, 3, 3]  # stratified
    assert torch.equal(val, validation_split(y, fraction=1 / 3, seed=0)[0])  # seeded


@pytest.mark.parametrize(
    ("dataset", "shape", "weights"), [("digits", (1, 8, 8), 117_066), ("mnist1d", (1, 40), 129_290)]
)
def test_the_wide_cnn_has_over_100k_weights_and_ten_logits(dataset, shape, weights):
    """The benchmark's third network (issues 46/49 ask for a batch-norm CNN of at least ~100k weights)."""
    model = make_model("wide_cnn", dataset)
    assert count_parameters(model) == weights
    assert any(isinstance(m, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)) for m in model.modules())
    assert model.eval()(torch.zeros(3, *shape)).shape == (3, 10)
    with pytest.raises(ValueError, match=r"unknown model 'vit'; valid: \['mlp', 'cnn', 'wide_cnn'\]"):
        make_model("vit", dataset)


def test_benchmark_pairs_each_row_with_the_map_row_on_the_same_images(capsys):
    # scripts/benchmark_classification.py: rows on the whole test split pair with "MAP", rows on the validation
    # split's other part with "MAP (test subset)"; the stored differences are paired_bootstrap's
    from tiny import load_script

    from ctuq.metrics import paired_bootstrap

    script = load_script("benchmark_classification")
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (30,), generator=g)
    eval_idx = torch.arange(10, 30)
    p = [torch.softmax(torch.randn(30, 3, generator=g, dtype=torch.float64), 1) for _ in range(3)]
    entries = [
        {"method": "MAP", "link": "-", "probs": p[0]},
        {"method": "MAP (test subset)", "link": "-", "probs": p[0][eval_idx]},
        {"method": "whole", "link": "mc", "probs": p[1]},
        {"method": "subset", "link": "probit", "probs": p[2][eval_idx]},
        {"method": "failed", "error": "killed"},
    ]
    script.paired_with_map("t", entries, labels, eval_idx, seed=4)
    whole, subset = entries[2]["vs_map"], entries[3]["vs_map"]
    assert {k: whole[k] for k in ("nll", "ece")} == {
        k: paired_bootstrap(p[1], p[0], labels, seed=4)[k] for k in ("nll", "ece")
    }
    ref = paired_bootstrap(p[2][eval_idx], p[0][eval_idx], labels[eval_idx], seed=4)
    assert subset["nll"] == ref["nll"] and subset["ece"] == ref["ece"] and subset["n"] == 20
    conf, pred = p[2][eval_idx].max(1)
    assert subset["confidence_gap"] == pytest.approx(float(conf.mean() - (pred == labels[eval_idx]).double().mean()))
    top = p[0][eval_idx].argmax(1)
    lowered = p[2][eval_idx][torch.arange(20), top] < p[0][eval_idx][torch.arange(20), top]
    assert subset["less_confident"] == pytest.approx(float(lowered.double().mean()))
    assert all("vs_map" not in e for e in (entries[0], entries[1], entries[4]))
    table = capsys.readouterr().out
    assert "| whole | mc | 30 |" in table and "| subset | probit | 20 |" in table
