"""Uncertainty metrics (ctuq.metrics) against direct scipy computations and known Gaussian fields."""

import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import multivariate_normal, norm, spearmanr

from ctuq import metrics as M


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _reference_joint_ll(x_true, mean, samples, p, eta, valid=None, divisor=None):
    """log N(x_true_patch; mean_patch, Σ̂)/p² averaged over complete non-overlapping patches, with scipy.

    ``samples`` (k, H, W) numpy deviations; Σ̂ built entry by entry from the published formula.
    ``valid(i, j)`` says whether the patch with top-left pixel (i, j) counts (mask ROIs).
    """
    k, H, W = samples.shape
    divisor = k if divisor is None else divisor
    vals = []
    for i in range(0, H - p + 1, p):
        for j in range(0, W - p + 1, p):
            if valid is not None and not valid(i, j):
                continue
            X = samples[:, i : i + p, j : j + p].reshape(k, -1)
            S = X.T @ X
            cov = (S + np.diag(np.diag(S))) / (2 * divisor) + eta * np.eye(p * p)
            mu, x = mean[i : i + p, j : j + p].ravel(), x_true[i : i + p, j : j + p].ravel()
            vals.append(multivariate_normal(mu, cov).logpdf(x) / p**2)
    return float(np.mean(vals))


# ------------------------------------------------------------------------------------------ likelihoods
def test_joint_ll_matches_scipy_on_tiny_example_with_fewer_samples_than_patch_pixels():
    # k = 5 < p² = 9: the plain sample covariance is singular, the stabilised one is not
    k, H, W, eta = 5, 7, 8, 0.01
    s, xt, mu = _rand(k, H, W, seed=1), _rand(H, W, seed=2), _rand(H, W, seed=3)
    got = M.patch_joint_log_likelihood(xt, mu, s, [1, 2, 3], eta=eta)
    assert list(got) == [1, 2, 3]
    for p in (1, 2, 3):
        ref = _reference_joint_ll(xt.numpy(), mu.numpy(), s.numpy(), p, eta)
        assert got[p] == pytest.approx(ref, rel=1e-10, abs=1e-10)


def test_marginal_ll_matches_scipy_and_respects_roi():
    H, W = 9, 6
    xt, mu = _rand(H, W, seed=4), _rand(H, W, seed=5)
    var = 0.1 + _rand(H, W, seed=6) ** 2
    full = norm.logpdf(xt.numpy(), mu.numpy(), np.sqrt(var.numpy()))
    assert M.marginal_log_likelihood(xt, mu, var) == pytest.approx(full.mean(), rel=1e-12)
    assert M.marginal_log_likelihood(xt, mu, var, roi=(slice(2, 7), slice(1, 5))) == pytest.approx(
        full[2:7, 1:5].mean(), rel=1e-12
    )
    mask = np.zeros((H, W), bool)
    mask[[0, 3, 8], [5, 2, 0]] = True
    assert M.marginal_log_likelihood(xt.numpy(), mu.numpy(), var.numpy(), roi=mask) == pytest.approx(
        full[mask].mean(), rel=1e-12
    )
    # scalar variance
    assert M.marginal_log_likelihood(xt, mu, 0.5) == pytest.approx(
        norm.logpdf(xt.numpy(), mu.numpy(), math.sqrt(0.5)).mean(), rel=1e-12
    )


def test_joint_ll_with_p1_equals_marginal_with_the_stabilised_variance():
    k, H, W = 16, 20, 20
    s, xt, mu = 0.3 * _rand(k, H, W, seed=7), _rand(H, W, seed=8), _rand(H, W, seed=9)
    roi = M.inner_square_roi((H, W))
    var = M.pixelwise_variance(s)
    eta = M.DEFAULT_ETA_REL * float(var[roi].mean())  # the documented default: relative to the ROI mean
    joint = M.patch_joint_log_likelihood(xt, mu, s, [1], roi)[1]
    assert joint == pytest.approx(M.marginal_log_likelihood(xt, mu, var + eta, roi), rel=1e-12)
    summary = M.uq_summary(xt, mu, s, roi, patch_sizes=[1, 2])
    assert summary["eta"] == pytest.approx(eta, rel=1e-12)
    assert summary["marginal_ll"] == pytest.approx(summary["joint_ll"]["1"], rel=1e-12)


def _gaussian_field(n, lengthscale, seed):
    """Mean, covariance and Cholesky factor of a heteroscedastic squared-exponential field on n×n pixels."""
    yy, xx = np.mgrid[:n, :n]
    pts = np.stack([yy.ravel(), xx.ravel()], 1).astype(float)
    d2 = ((pts[:, None] - pts[None]) ** 2).sum(-1)
    amp = 0.5 + np.random.default_rng(seed).random(n * n)  # pixel stds 0.5 … 1.5
    cov = amp[:, None] * amp[None] * np.exp(-0.5 * d2 / lengthscale**2) + 1e-6 * np.eye(n * n)
    return np.linalg.cholesky(cov), cov


def test_joint_ll_converges_to_the_population_value_for_a_known_gaussian_field():
    # Σ̂ → Σ_∞ = ½(diag Σ + Σ) + ηI as k → ∞ (the estimator is a shrinkage estimator, not Σ itself), so the
    # target is the joint LL under Σ_∞. Seed 0, k = 20000: over seeds 0–19 the largest deviation for p ≤ 4 was
    # 0.0031 nats/pixel; the tolerance 0.015 is five times that. With k = 20 the median deviation is 0.04 (max
    # 0.2), and scoring under Σ instead of Σ_∞ would be off by 0.4–1.1 nats/pixel for p = 2…4.
    n, k, eta = 12, 20000, 1e-3
    chol, cov = _gaussian_field(n, lengthscale=2.0, seed=0)
    rng = np.random.default_rng(0)
    mean = rng.standard_normal((n, n))
    x_true = mean + (chol @ rng.standard_normal(n * n)).reshape(n, n)
    samples = (rng.standard_normal((k, n * n)) @ chol.T).reshape(k, n, n)
    got = M.patch_joint_log_likelihood(
        torch.from_numpy(x_true), torch.from_numpy(mean), torch.from_numpy(samples).float(), [1, 2, 3, 4], eta=eta
    )
    idx = np.arange(n * n).reshape(n, n)
    for p in (1, 2, 3, 4):
        vals = []
        for i in range(0, n, p):
            for j in range(0, n, p):
                sel = idx[i : i + p, j : j + p].ravel()
                c = cov[np.ix_(sel, sel)]
                c_inf = 0.5 * (c + np.diag(np.diag(c))) + eta * np.eye(p * p)
                vals.append(multivariate_normal(mean.ravel()[sel], c_inf).logpdf(x_true.ravel()[sel]) / p**2)
        assert abs(got[p] - np.mean(vals)) < 0.015, (p, got[p], np.mean(vals))


def test_joint_ll_mask_roi_drops_patches_that_leave_the_mask_and_chunking_does_not_change_results():
    k, H, W, eta = 6, 11, 13, 0.05
    s, xt, mu = _rand(k, H, W, seed=10), _rand(H, W, seed=11), _rand(H, W, seed=12)
    mask = np.zeros((H, W), bool)
    mask[1:10, 2:13] = True
    mask[1:4, 2:6] = False  # an L-shaped region: its bounding box is 1:10 × 2:13
    box = s.numpy()[:, 1:10, 2:13]

    def valid(p):
        return lambda i, j: mask[1 + i : 1 + i + p, 2 + j : 2 + j + p].all()

    big = M.patch_joint_log_likelihood(xt, mu, s, [1, 2, 3], mask, eta=eta)
    tiny = M.patch_joint_log_likelihood(xt, mu, s, [1, 2, 3], torch.from_numpy(mask), eta=eta, chunk_bytes=1)
    for p in (1, 2, 3):
        ref = _reference_joint_ll(xt.numpy()[1:10, 2:13], mu.numpy()[1:10, 2:13], box, p, eta, valid(p))
        assert big[p] == pytest.approx(ref, rel=1e-10)
        assert tiny[p] == pytest.approx(big[p], rel=1e-12)


def test_joint_ll_of_a_volume_averages_its_slices():
    # 2D p×p patches slice by slice; both slices hold the same number of patches, so the volume's value is
    # the mean of the two slice values
    k, D, H, W, eta = 4, 2, 6, 6, 0.02
    s, xt, mu = _rand(k, D, H, W, seed=13), _rand(D, H, W, seed=14), _rand(D, H, W, seed=15)
    vol = M.patch_joint_log_likelihood(xt, mu, s, [1, 2, 3], eta=eta)
    per_slice = [M.patch_joint_log_likelihood(xt[d], mu[d], s[:, d], [1, 2, 3], eta=eta) for d in range(D)]
    for p in (1, 2, 3):
        assert vol[p] == pytest.approx(0.5 * (per_slice[0][p] + per_slice[1][p]), rel=1e-12)


def test_non_zero_mean_samples_are_centred_with_bessel_or_about_the_given_mean():
    k, H, W, eta = 8, 6, 6, 0.01
    dev = _rand(k, H, W, seed=16)
    offset = 5.0 + _rand(H, W, seed=17)  # MC-dropout passes: a mean far from zero
    passes = offset + dev
    xt, mu = _rand(H, W, seed=18), _rand(H, W, seed=19)
    centred = (dev - dev.mean(0)).numpy()
    got = M.patch_joint_log_likelihood(xt, mu, passes, [1, 2], eta=eta, centering="empirical")
    for p in (1, 2):
        assert got[p] == pytest.approx(
            _reference_joint_ll(xt.numpy(), mu.numpy(), centred, p, eta, divisor=k - 1), rel=1e-9
        )
    about = M.patch_joint_log_likelihood(xt, mu, passes, [2], eta=eta, centering="mean")[2]
    assert about == pytest.approx(_reference_joint_ll(xt.numpy(), mu.numpy(), (passes - mu).numpy(), 2, eta), rel=1e-9)
    torch.testing.assert_close(M.pixelwise_std_about(passes), passes.std(0), rtol=1e-10, atol=0)
    torch.testing.assert_close(
        M.pixelwise_std_about(passes, mu), (passes - mu).pow(2).mean(0).sqrt(), rtol=1e-10, atol=0
    )


def test_pixelwise_std_is_the_root_mean_square_plus_jitter_in_the_input_dtype():
    s = _rand(50, 5, 7, seed=20, dtype=torch.float32)
    std = M.pixelwise_std(s, jitter=0.25)
    assert std.dtype == torch.float32 and std.shape == (5, 7)
    ref = np.sqrt((s.double().numpy() ** 2).mean(0) + 0.25)
    np.testing.assert_allclose(std.numpy(), ref, rtol=1e-6)
    # chunking over samples gives the same numbers
    torch.testing.assert_close(M.pixelwise_variance(s, chunk_bytes=1), M.pixelwise_variance(s))


def test_a_singular_patch_covariance_falls_back_to_jitter_with_a_counting_warning():
    # pixel (0, 0) never varies and η = 0, so exactly one of the four 2×2 patches has a singular Σ̂
    s = _rand(10, 4, 4, seed=21)
    s[:, 0, 0] = 0.0
    xt, mu = _rand(4, 4, seed=22), _rand(4, 4, seed=23)
    xt[0, 0] = mu[0, 0]
    with pytest.warns(RuntimeWarning, match=r"1 of 4 2×2 patch covariances were not positive definite"):
        got = M.patch_joint_log_likelihood(xt, mu, s, [2], eta=0.0)
    assert math.isfinite(got[2])


# ------------------------------------------------------------------------------------------ calibration
def test_coverage_of_perfectly_calibrated_data_matches_the_level_within_binomial_tolerance():
    # x_true ~ N(mean, std²) per pixel, n = 40000 pixels, seed 24: the count at level l is
    # Binomial(n, l); tolerance 4 binomial standard deviations (≤ 0.01).
    n = 200
    mean = _rand(n, n, seed=25)
    std = 0.1 + _rand(n, n, seed=26).abs()
    x_true = mean + std * _rand(n, n, seed=24)
    levels, cov = M.coverage(x_true, mean, std)
    np.testing.assert_allclose(levels, np.linspace(0, 1, 21), atol=1e-12)
    tol = 4 * np.sqrt(levels * (1 - levels) / n**2) + 1e-12
    assert np.all(np.abs(cov - levels) <= tol), np.abs(cov - levels) / np.maximum(tol, 1e-12)
    assert cov[0] == 0.0 and cov[-1] == 1.0
    # an over-confident std (halved) covers less: coverage(0.9) = P(|Z| ≤ 0.82) ≈ 0.59
    head = M.headline_coverage(x_true, mean, std / 2)
    assert set(head) == {"0.5", "0.9", "0.95"}
    assert head["0.9"] == pytest.approx(2 * norm.cdf(norm.ppf(0.95) / 2) - 1, abs=0.01)


def test_coverage_treats_zero_std_pixels_as_covered_only_when_exact():
    x_true = torch.tensor([[0.0, 1.0], [2.0, 3.0]], dtype=torch.float64)
    mean = torch.tensor([[0.0, 1.5], [2.0, 3.0]], dtype=torch.float64)
    std = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    _, cov = M.coverage(x_true, mean, std, [0.0, 0.5, 1.0])
    # (0,0): error 0, std 0 → always covered; (0,1): error 0.5, std 0 → only at level 1; others error 0
    np.testing.assert_allclose(cov, [0.75, 0.75, 1.0])


def test_error_std_histogram_counts_every_roi_pixel_on_shared_edges():
    err = torch.tensor([[0.0, 0.1], [0.5, 1.0]])
    std = torch.tensor([[0.2, 0.1], [0.5, 0.9]])
    h = M.error_std_histogram(err, std, bins=4, log=False)
    np.testing.assert_allclose(h.edges, [0, 0.25, 0.5, 0.75, 1.0])
    assert h.counts.shape == (4, 4) and h.counts.sum() == 4
    # rows index |error|, columns std: (err 0.5, std 0.5) → row 2, col 2; (err 1.0, std 0.9) → row 3, col 3
    assert h.counts[2, 2] == 1 and h.counts[3, 3] == 1 and h.counts[0, 0] == 2
    hl = M.error_std_histogram(err, std, bins=8, roi=(slice(0, 2), slice(0, 1)))  # log bins; 0 is clipped in
    assert hl.counts.sum() == 2 and hl.edges[0] > 0
    np.testing.assert_allclose(np.diff(np.log(hl.edges)), np.log(hl.edges[1] / hl.edges[0]), rtol=1e-9)


def test_rank_correlation_matches_scipy_over_the_roi():
    std = _rand(30, 30, seed=27).abs()
    err = (std + 0.3 * _rand(30, 30, seed=28)).abs()
    roi = (slice(5, 25), slice(3, 20))
    ref = spearmanr(std[roi].numpy().ravel(), err[roi].numpy().ravel()).statistic
    assert M.rank_correlation(std, err, roi) == pytest.approx(ref, rel=1e-12)
    assert M.rank_correlation(std, std**2) == pytest.approx(1.0)
    assert math.isnan(M.rank_correlation(torch.ones(4, 4), err[:4, :4]))


def test_uq_summary_is_strict_json_and_consistent_with_the_single_metrics():
    k, H, W = 12, 24, 24
    s, mu = 0.2 * _rand(k, H, W, seed=29), _rand(H, W, seed=30)
    xt = mu + 0.2 * _rand(H, W, seed=31)
    out = M.uq_summary(xt, mu, s, "inner_square", patch_sizes=range(1, 5))
    json.dumps(out, allow_nan=False)
    assert list(out["joint_ll"]) == ["1", "2", "3", "4"]
    roi = M.inner_square_roi((H, W))
    var = M.pixelwise_variance(s).double() + out["eta"]
    assert out["n_pixels"] == (roi[0].stop - roi[0].start) * (roi[1].stop - roi[1].start)
    assert out["n_samples"] == k
    assert out["rmse"] == pytest.approx(float((xt - mu)[roi].pow(2).mean().sqrt()), rel=1e-12)
    assert out["mean_std"] == pytest.approx(float(var[roi].sqrt().mean()), rel=1e-6)
    assert out["coverage"] == pytest.approx(M.headline_coverage(xt, mu, var.sqrt(), roi), abs=1e-12)
    assert out["spearman"] == pytest.approx(M.rank_correlation(var.sqrt(), (xt - mu).abs(), roi), rel=1e-6)
    assert out["joint_ll"]["3"] == pytest.approx(
        M.patch_joint_log_likelihood(xt, mu, s, [3], roi, eta=out["eta"])[3], rel=1e-12
    )
    assert len(out["calibration"]["levels"]) == len(out["calibration"]["coverage"]) == 21


@pytest.mark.gpu
def test_uq_summary_on_cuda_matches_cpu():
    k, H, W = 64, 40, 40
    s, mu = _rand(k, H, W, seed=32, dtype=torch.float32), _rand(H, W, seed=33, dtype=torch.float32)
    xt = mu + _rand(H, W, seed=34, dtype=torch.float32)
    cpu = M.uq_summary(xt, mu, s, "inner_square", patch_sizes=[1, 2, 5])
    gpu = M.uq_summary(xt.cuda(), mu.cuda(), s.cuda(), "inner_square", patch_sizes=[1, 2, 5])
    for key in ("marginal_ll", "mean_std", "rmse", "eta"):
        assert gpu[key] == pytest.approx(cpu[key], rel=1e-9)
    assert gpu["joint_ll"] == pytest.approx(cpu["joint_ll"], rel=1e-9)


# ------------------------------------------------------------------------------------------------- ROI
def test_inner_square_roi_is_the_published_region_and_scales_with_the_grid():
    assert M.inner_square_roi((501, 501)) == (slice(72, 424), slice(72, 424))
    assert M.inner_square_roi((501, 501, 501)) == (slice(72, 424),) * 3
    assert M.inner_square_roi((128, 128)) == (slice(18, 108), slice(18, 108))  # 18.39 → 18, 108.3 → 108
    assert M.inner_square_roi((1002, 501)) == (slice(144, 848), slice(72, 424))
    mask = M.roi_mask("inner_square", (501, 501))
    assert mask.sum() == 352**2 and mask[72, 72] and mask[423, 423] and not mask[71, 200] and not mask[424, 200]
    with pytest.raises(ValueError, match="2 or 3"):
        M.inner_square_roi((501,))


def test_roi_forms_agree():
    H, W = 30, 30
    xt, mu = _rand(H, W, seed=35), _rand(H, W, seed=36)
    var = 0.5 + _rand(H, W, seed=37) ** 2
    sl = M.inner_square_roi((H, W))
    mask = M.roi_mask(sl, (H, W))
    a = M.marginal_log_likelihood(xt, mu, var, "inner_square")
    assert a == M.marginal_log_likelihood(xt, mu, var, sl) == M.marginal_log_likelihood(xt, mu, var, mask)
    assert M.marginal_log_likelihood(xt, mu, var, mask.numpy()) == a
    # strided slices become a mask
    strided = (slice(0, None, 2), slice(1, -1, 3))
    assert M.roi_mask(strided, (H, W)).sum() == 15 * 10
    assert M.marginal_log_likelihood(xt, mu, var, strided) == pytest.approx(
        M.marginal_log_likelihood(xt[::2, 1:-1:3], mu[::2, 1:-1:3], var[::2, 1:-1:3]), rel=1e-12
    )


# ------------------------------------------------------------------------------------------- bad input
def test_bad_shapes_and_values_raise_clear_errors():
    s, xt, mu = _rand(4, 6, 6), _rand(6, 6), _rand(6, 6)
    with pytest.raises(ValueError, match=r"samples must be \(k, H, W\) or \(k, D, H, W\), got shape \(6, 6\)"):
        M.pixelwise_std(xt)
    with pytest.raises(ValueError, match=r"x_true has shape \(5, 6\), expected \(6, 6\)"):
        M.patch_joint_log_likelihood(xt[:5], mu, s, [1])
    with pytest.raises(ValueError, match=r"mean has shape \(6, 7\)"):
        M.uq_summary(xt, torch.zeros(6, 7), s, None, patch_sizes=[1])
    with pytest.raises(ValueError, match=r"roi mask has shape \(5, 5\), the image has shape \(6, 6\)"):
        M.marginal_log_likelihood(xt, mu, 1.0, torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="dtype bool"):
        M.marginal_log_likelihood(xt, mu, 1.0, torch.ones(6, 6))
    with pytest.raises(ValueError, match="one slice per image axis"):
        M.marginal_log_likelihood(xt, mu, 1.0, (slice(1, 4),))
    with pytest.raises(ValueError, match="selects no pixel"):
        M.marginal_log_likelihood(xt, mu, 1.0, (slice(3, 3), slice(None)))
    with pytest.raises(ValueError, match=r"var must be > 0 in the ROI; 36 pixel\(s\)"):
        M.marginal_log_likelihood(xt, mu, 0.0)
    with pytest.raises(ValueError, match="holds no complete 7×7 patch"):
        M.patch_joint_log_likelihood(xt, mu, s, [1, 7])
    with pytest.raises(ValueError, match="patch_sizes"):
        M.patch_joint_log_likelihood(xt, mu, s, [0, 2])
    with pytest.raises(ValueError, match="eta must be finite and ≥ 0"):
        M.patch_joint_log_likelihood(xt, mu, s, [1], eta=-1.0)
    with pytest.raises(ValueError, match="centering must be one of"):
        M.patch_joint_log_likelihood(xt, mu, s, [1], centering="sample")
    with pytest.raises(ValueError, match="zero variance everywhere in the ROI"):
        M.patch_joint_log_likelihood(xt, mu, torch.zeros(4, 6, 6), [1])
    bad = s.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="samples contain NaN or Inf"):
        M.patch_joint_log_likelihood(xt, mu, bad, [1])
    flat = s.clone()
    flat[:, 0, 0] = 0.0
    with pytest.raises(ValueError, match=r"pixel variance \+ η is 0 at 1 ROI pixel"):
        M.uq_summary(xt, mu, flat, None, patch_sizes=[1], eta=0.0)
    with pytest.raises(ValueError, match="levels must be"):
        M.coverage(xt, mu, 1.0, [0.5, 1.5])
    with pytest.raises(ValueError, match=r"std must be ≥ 0; 1 pixel"):
        M.coverage(xt, mu, torch.where(xt > xt.max() - 1e-12, -1.0, 1.0))
