"""Streaming sample statistics (ctuq.metrics.SampleMoments, uq_summary_from_moments) against uq_summary."""

import numpy as np
import pytest
import torch
from memory_utils import peak_cpu_bytes

from ctuq import metrics as M

RTOL = 1e-9  # float64 sums formed in another order; nothing else may differ


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _flat(d, prefix=""):
    """Summary dict → {dotted key: leaf value} (lists indexed), so two summaries compare leaf by leaf."""
    out = {}
    for key, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{key}."))
        elif isinstance(v, list):
            out.update({f"{prefix}{key}[{i}]": x for i, x in enumerate(v)})
        else:
            out[prefix + key] = v
    return out


def _assert_same_summary(a, b, rtol=RTOL):
    fa, fb = _flat(a), _flat(b)
    assert list(fa) == list(fb)
    assert list(a["joint_ll"]) == list(b["joint_ll"])
    for key in fa:
        if isinstance(fa[key], float):
            assert fb[key] == pytest.approx(fa[key], rel=rtol, abs=0), key
        else:
            assert fb[key] == fa[key], key


def _stream(samples, chunk, roi=None, patch_sizes=range(1, 11), **kw):
    acc = M.SampleMoments(tuple(samples.shape[1:]), roi, patch_sizes, **kw)
    for i in range(0, samples.shape[0], chunk):
        acc.update(samples[i : i + chunk])
    return acc


# ------------------------------------------------------------------------------ agreement with uq_summary
@pytest.mark.parametrize("roi", ["inner_square", None])
@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_summary_from_moments_equals_uq_summary(roi, chunk):
    k, H, W = 40, 36, 30
    s = 0.3 * _rand(k, H, W, seed=1)
    xt, mu = _rand(H, W, seed=2), _rand(H, W, seed=3)
    ref = M.uq_summary(xt, mu, s, roi)
    acc = _stream(s, chunk, roi)
    assert acc.n_samples == k
    got = M.uq_summary_from_moments(xt, mu, acc)
    _assert_same_summary(ref, got)
    assert got["n_samples"] == k and got["centering"] == "none"
    assert list(got["joint_ll"]) == [str(p) for p in range(1, 11)]


@pytest.mark.parametrize("shape", [(37, 23), (41, 29)])
def test_odd_image_sizes_where_patches_do_not_tile(shape):
    # neither the image nor the inner square is a multiple of most patch sizes: border patches are dropped
    k = 25
    s = 0.2 * _rand(k, *shape, seed=4, dtype=torch.float32)  # float32 input is converted the same way
    xt, mu = _rand(*shape, seed=5), _rand(*shape, seed=6)
    for roi in ("inner_square", None):
        ref = M.uq_summary(xt, mu, s, roi)
        _assert_same_summary(ref, M.uq_summary_from_moments(xt, mu, _stream(s, 7, roi)))


def test_correlated_samples_with_a_known_covariance():
    # samples x_j = L z_j with Σ = L Lᵀ a squared-exponential field, so patches carry real off-diagonals
    n, k = 14, 200
    yy, xx = np.mgrid[:n, :n]
    pts = np.stack([yy.ravel(), xx.ravel()], 1).astype(float)
    cov = np.exp(-0.5 * ((pts[:, None] - pts[None]) ** 2).sum(-1) / 2.0**2) + 1e-6 * np.eye(n * n)
    chol = torch.from_numpy(np.linalg.cholesky(cov))
    s = (_rand(k, n * n, seed=7) @ chol.T).reshape(k, n, n)
    mu = _rand(n, n, seed=8)
    xt = mu + (chol @ _rand(n * n, seed=9)).reshape(n, n)
    for roi in ("inner_square", None):
        sizes = range(1, 7) if roi else range(1, 11)
        ref = M.uq_summary(xt, mu, s, roi, patch_sizes=sizes)
        for chunk in (1, 7, k):
            got = M.uq_summary_from_moments(xt, mu, _stream(s, chunk, roi, sizes))
            _assert_same_summary(ref, got)
    # the accumulated sums are the plain second moments
    acc = _stream(s, 13, None, [2])
    x = s[:, :2, :2].reshape(k, 4)
    torch.testing.assert_close(acc.state_dict()["patch_sums"]["2"][0], x.T @ x, rtol=1e-12, atol=0)


def test_mask_roi_explicit_eta_levels_and_volumes():
    k, H, W = 30, 21, 19
    s, xt, mu = 0.4 * _rand(k, H, W, seed=10), _rand(H, W, seed=11), _rand(H, W, seed=12)
    mask = torch.ones(H, W, dtype=torch.bool)
    mask[:5, :7] = False
    mask[15:, 12:] = False
    kw = dict(eta=1e-3, levels=[0.1, 0.5, 0.99])
    ref = M.uq_summary(xt, mu, s, mask, patch_sizes=[1, 2, 3, 5], **kw)
    acc = _stream(s, 7, mask, [1, 2, 3, 5])
    assert acc.n_pixels == int(mask.sum())
    _assert_same_summary(ref, M.uq_summary_from_moments(xt, mu, acc, **kw))
    # volumes: 2D p×p patches in each slice, as in the in-memory estimator
    D = 3
    v, vt, vm = 0.4 * _rand(k, D, 13, 11, seed=13), _rand(D, 13, 11, seed=14), _rand(D, 13, 11, seed=15)
    for roi in (None, (slice(0, 3), slice(1, 12), slice(2, 11))):
        ref = M.uq_summary(vt, vm, v, roi, patch_sizes=[1, 2, 4])
        _assert_same_summary(ref, M.uq_summary_from_moments(vt, vm, _stream(v, 7, roi, [1, 2, 4])))


def test_std_and_variance_match_the_in_memory_functions():
    s = 0.3 * _rand(33, 17, 15, seed=16)
    acc = _stream(s, 5, "inner_square", [1, 2])
    torch.testing.assert_close(acc.variance(), M.pixelwise_variance(s), rtol=1e-12, atol=0)
    torch.testing.assert_close(acc.std(0.01), M.pixelwise_std(s, 0.01), rtol=1e-12, atol=0)
    assert acc.variance().shape == (17, 15) and acc.variance().dtype == torch.float64


@pytest.mark.gpu
def test_cuda_chunks_and_a_cuda_accumulator_match_cpu():
    k, H, W = 48, 40, 40
    s = _rand(k, H, W, seed=31, dtype=torch.float32)
    mu = _rand(H, W, seed=32)
    xt = mu + _rand(H, W, seed=33)
    ref = M.uq_summary(xt, mu, s, "inner_square", patch_sizes=[1, 2, 5])
    on_cpu = _stream(s.cuda(), 16, "inner_square", [1, 2, 5])  # CUDA chunks into a CPU accumulator
    on_gpu = _stream(s.cuda(), 16, "inner_square", [1, 2, 5], device="cuda")
    _assert_same_summary(ref, M.uq_summary_from_moments(xt, mu, on_cpu))
    _assert_same_summary(ref, M.uq_summary_from_moments(xt, mu, on_gpu))
    assert on_gpu.std().is_cuda
    merged = M.SampleMoments((H, W), "inner_square", [1, 2, 5]).merge(on_gpu)  # a CUDA shard into a CPU one
    assert merged.device.type == "cpu" and merged.n_samples == k
    _assert_same_state(merged, on_cpu)
    restored = M.SampleMoments((H, W), "inner_square", [1, 2, 5]).load_state_dict(on_gpu.state_dict())
    _assert_same_summary(M.uq_summary_from_moments(xt, mu, on_gpu), M.uq_summary_from_moments(xt, mu, restored))


# ---------------------------------------------------------------------------------- streaming algebra
def _assert_same_state(a, b, rtol=1e-12):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["n_samples"] == sb["n_samples"]
    torch.testing.assert_close(sa["sum_sq"], sb["sum_sq"], rtol=rtol, atol=0)
    assert list(sa["patch_sums"]) == list(sb["patch_sums"])
    for p in sa["patch_sums"]:
        torch.testing.assert_close(sa["patch_sums"][p], sb["patch_sums"][p], rtol=rtol, atol=1e-15)


def test_chunk_order_does_not_matter():
    k, H, W = 42, 19, 23
    s, xt, mu = 0.3 * _rand(k, H, W, seed=17), _rand(H, W, seed=18), _rand(H, W, seed=19)
    forward = _stream(s, 6, "inner_square", [1, 2, 3])
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(0))
    shuffled = M.SampleMoments((H, W), "inner_square", [1, 2, 3])
    for i in reversed(range(0, k, 5)):  # other chunk sizes, reversed order, permuted samples
        shuffled.update(s[perm][i : i + 5])
    _assert_same_state(forward, shuffled)
    _assert_same_summary(M.uq_summary_from_moments(xt, mu, forward), M.uq_summary_from_moments(xt, mu, shuffled))


def test_merge_equals_one_accumulator_over_all_samples():
    k, H, W = 40, 24, 20
    s, xt, mu = 0.3 * _rand(k, H, W, seed=20), _rand(H, W, seed=21), _rand(H, W, seed=22)
    whole = _stream(s, 8, "inner_square")
    a, b = _stream(s[:13], 4, "inner_square"), _stream(s[13:], 9, "inner_square")
    assert a.merge(b) is a
    assert a.n_samples == k and b.n_samples == k - 13
    _assert_same_state(whole, a)
    _assert_same_summary(M.uq_summary_from_moments(xt, mu, whole), M.uq_summary_from_moments(xt, mu, a))
    with pytest.raises(ValueError, match="patch sizes mismatch"):
        a.merge(M.SampleMoments((H, W), "inner_square", [1, 2]))


def test_state_dict_round_trip_through_torch_save(tmp_path):
    k, H, W = 20, 18, 16
    s, xt, mu = 0.3 * _rand(k, H, W, seed=23), _rand(H, W, seed=24), _rand(H, W, seed=25)
    mask = torch.ones(H, W, dtype=torch.bool)
    mask[0, :] = False
    for roi in ("inner_square", mask):
        acc = _stream(s[:12], 5, roi, [1, 2, 4])
        torch.save(acc.state_dict(), tmp_path / "moments.pt")
        state = torch.load(tmp_path / "moments.pt", weights_only=True)
        assert isinstance(state["version"], int)
        restored = M.SampleMoments((H, W), roi, [1, 2, 4]).load_state_dict(state)
        assert restored.n_samples == 12
        _assert_same_state(acc, restored, rtol=0)
        # a resumed run goes on exactly where the checkpoint left off
        acc.update(s[12:])
        restored.update(s[12:])
        _assert_same_state(acc, restored, rtol=0)
        assert M.uq_summary_from_moments(xt, mu, acc) == M.uq_summary_from_moments(xt, mu, restored)


def test_loading_a_state_for_another_configuration_raises():
    acc = _stream(_rand(5, 16, 16, seed=26), 5, "inner_square", [1, 2])
    state = acc.state_dict()
    cases = [
        (M.SampleMoments((16, 17), "inner_square", [1, 2]), "image shape mismatch"),
        (M.SampleMoments((16, 16), None, [1, 2]), "ROI bounding box mismatch"),
        (M.SampleMoments((16, 16), "inner_square", [1, 2, 3]), "patch sizes mismatch"),
        (M.SampleMoments((16, 16), "inner_square", [1, 2], dtype=torch.float32), "dtype mismatch"),
    ]
    masked = torch.zeros(16, 16, dtype=torch.bool)
    masked[M.inner_square_roi((16, 16))] = True
    masked[3, 3] = False
    cases.append((M.SampleMoments((16, 16), masked, [1, 2]), "ROI mismatch"))
    for other, message in cases:
        before = other.state_dict()["sum_sq"].clone()
        with pytest.raises(ValueError, match=message):
            other.load_state_dict(state)
        assert other.n_samples == 0 and torch.equal(other.state_dict()["sum_sq"], before)
    with pytest.raises(ValueError, match="version"):
        M.SampleMoments((16, 16), "inner_square", [1, 2]).load_state_dict({**state, "version": 99})


def test_bad_input_is_refused_with_a_clear_error():
    acc = M.SampleMoments((8, 8), None, [1, 2])
    with pytest.raises(ValueError, match=r"chunk must have shape \(B, 8, 8\)"):
        acc.update(torch.zeros(8, 8))
    bad = torch.zeros(2, 8, 8)
    bad[1, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        acc.update(bad)
    assert acc.n_samples == 0 and not bool(acc.state_dict()["sum_sq"].any())  # nothing half-added
    acc.update(torch.zeros(0, 8, 8))
    assert acc.n_samples == 0
    with pytest.raises(ValueError, match="holds no sample"):
        M.uq_summary_from_moments(torch.zeros(8, 8), torch.zeros(8, 8), acc)
    with pytest.raises(ValueError, match="no sample"):
        acc.variance()
    acc.update(_rand(3, 8, 8, seed=27))
    with pytest.raises(ValueError, match="x_true has shape"):
        M.uq_summary_from_moments(torch.zeros(8, 9), torch.zeros(8, 9), acc)
    with pytest.raises(ValueError, match="cannot be streamed"):
        M.SampleMoments((8, 8), centering="empirical")
    with pytest.raises(ValueError, match="subtract the predictive mean"):
        M.SampleMoments((8, 8), centering="mean")
    with pytest.raises(ValueError, match=r"image_shape must be \(H, W\) or \(D, H, W\).*\(4, 8, 8, 8\)"):
        M.SampleMoments((4, 8, 8, 8))
    with pytest.raises(ValueError, match="no complete 9×9 patch"):
        M.SampleMoments((8, 8), None, [1, 9])


# ---------------------------------------------------------------------------------------------- memory
def _pixels_times_sum_p2(n=64, sizes=range(1, 11)):
    return n * n * sum(p * p for p in sizes)


def test_buffers_do_not_grow_with_the_number_of_samples():
    n = 64
    acc = M.SampleMoments((n, n))  # whole image, p = 1…10
    acc.update(_rand(16, n, n, seed=28))
    shapes = {key: tuple(t.shape) for key, t in acc.state_dict()["patch_sums"].items()}
    numel = acc.buffer_numel
    gen = torch.Generator().manual_seed(29)
    for _ in range(1024 // 64):
        acc.update(torch.randn(64, n, n, generator=gen, dtype=torch.float64))
    assert acc.n_samples == 16 + 1024
    assert acc.buffer_numel == numel
    assert {key: tuple(t.shape) for key, t in acc.state_dict()["patch_sums"].items()} == shapes
    state = acc.state_dict()
    assert numel == state["sum_sq"].numel() + sum(t.numel() for t in state["patch_sums"].values())
    assert numel < 1.1 * _pixels_times_sum_p2(n)


def test_peak_cpu_bytes_sees_a_big_allocation():
    nbytes = 1024 * 64 * 64 * 8
    peak = peak_cpu_bytes(lambda: torch.zeros(1024, 64, 64, dtype=torch.float64))
    assert peak >= 32 * 2**20
    assert peak < 2 * nbytes  # and nothing absurd


def test_streaming_1024_samples_keeps_the_peak_far_below_holding_them():
    n, k, chunk = 64, 1024, 64
    all_samples_bytes = k * n * n * 8
    acc = M.SampleMoments((n, n))  # its buffers (≈ 12 MB for p = 1…10) exist before; the test is the stream

    def stream():
        gen = torch.Generator().manual_seed(30)
        for _ in range(k // chunk):
            acc.update(torch.randn(chunk, n, n, generator=gen, dtype=torch.float64))

    peak = peak_cpu_bytes(stream)
    assert acc.n_samples == k
    assert 0 < peak < all_samples_bytes / 4


@pytest.mark.parametrize("shape", [(12, 14), (3, 10, 11)])
def test_memory_bytes_is_what_an_accumulator_holds(shape):
    from ctuq.metrics import inner_square_roi

    for roi in (None, inner_square_roi(shape)):
        m = M.SampleMoments(shape, roi=roi, patch_sizes=[1, 2, 3], dtype=torch.float32)
        held = m._sum_sq.numel() * 4 + sum(t.numel() * 4 for t in m._patch_sums.values())
        assert M.SampleMoments.memory_bytes(shape, roi=roi, patch_sizes=[1, 2, 3], dtype=torch.float32) == held
