"""Per-measurement variances from the photon statistics (:attr:`ctuq.data.CTData.variances`): the predicted
``Var(−log((p − dark)/(mean(flats) − dark)))`` against the empirical variance of ``y`` over repeated noise
realisations of one simulated scan (same object, geometry and detector patterns; ``noise_seed`` varies), for
subsampled and for binned detector columns, and the checks on bad variances."""

import numpy as np
import pytest
import torch

from ctuq.data import CTData, source, walnut
from ctuq.data.loader import read_slice, read_volume
from ctuq.data.simulate import SimulationParameters, simulate_scan
from ctuq.data.source import log_count_variance
from ctuq.data.walnut import WalnutScan

# repeated simulated scans (~5 s): left out of `make test-fast`
pytestmark = pytest.mark.slow

N_REALISATIONS = 30


def _params(noise_seed: int) -> SimulationParameters:
    """A scan small enough to simulate 30 times in ~20 s: 8 angles, 4 × 48 detector pixels, 32² ground truth; the
    central slice meets the detector at row 3.2, so every measurement interpolates two rows (weights 0.8 / 0.2)."""
    return SimulationParameters.preset(
        "tiny",
        n_projections=9,
        det_cols=48,
        pixel_size=2.4,
        gt_shape=(3, 32, 32),
        gt_voxel_size=1.6,
        supersampling=1,
        gt_supersampling=1,
        noise_seed=noise_seed,
    )


def _single_flat(P, F, read_noise=0.0):
    """The formula with the flat taken as one frame (its terms not halved): a neighbour the check must reject."""
    return log_count_variance(P, F, read_noise) + 0.5 / F


def _no_flat(P, F, read_noise=0.0):
    """Only the projection's Poisson term ``1/P``: another neighbour."""
    return 1.0 / P


@pytest.fixture(scope="module")
def realisations(tmp_path_factory):
    """``{setting: (y (K, 8, n), predicted variances (K, 8, n))}`` over K = 30 noise seeds (100 … 129); the settings
    ``single_flat`` / ``no_flat`` are the subsampled reading with the wrong formulas above."""
    folder = tmp_path_factory.mktemp("noise") / "Walnut1"
    readings = {
        "subsample": ({"detector_subsampling": 1}, source.log_count_variance),
        "bin2": ({"detector_subsampling": 2, "detector_binning": True}, source.log_count_variance),
        "single_flat": ({"detector_subsampling": 1}, _single_flat),
        "no_flat": ({"detector_subsampling": 1}, _no_flat),
    }
    out = {name: ([], []) for name in readings}
    right = source.log_count_variance  # the walnut layout's two flats and one dark (count_variance calls it)
    try:
        for k in range(N_REALISATIONS):
            simulate_scan(folder, _params(100 + k), overwrite=True, progress=False)
            for name, (kw, formula) in readings.items():
                source.log_count_variance = formula
                d = read_slice(WalnutScan(folder), angular_subsampling=1, progress=False, **kw)
                out[name][0].append(d.y.double())
                out[name][1].append(d.variances.double())
    finally:
        source.log_count_variance = right
    return {k: (torch.stack(y), torch.stack(v)) for k, (y, v) in out.items()}


def _ratio(y, v, part=None):
    s2, pred = y.var(dim=0).reshape(-1), v.mean(dim=0).reshape(-1)
    if part is not None:
        s2, pred = s2[part], pred[part]
    return float(s2.sum() / pred.sum())


@pytest.mark.parametrize("setting", ["subsample", "bin2"])
def test_predicted_variance_matches_repeated_scans(realisations, setting):
    """Σ_i s_i² / Σ_i v̄_i (s² the per-ray sample variance over K = 30 realisations, v̄ the mean prediction) within
    6 % of 1, over all rays and over the rays of the lower and the upper half of predicted variance separately (the
    shape, not only the level). One ray's s²/v has relative sd √(2/29) = 26 %; over the 384 (binned: 192) rays
    the ratio's sd is ≈ 1.5 % (2 %) if the rays were independent (the flat and dark frames are shared by a column's
    angles, so somewhat more). Seeds 100 … 129."""
    y, v = realisations[setting]
    assert _ratio(y, v) == pytest.approx(1.0, abs=0.06)
    order = v.mean(dim=0).reshape(-1).argsort()
    half = order.numel() // 2
    for part in (order[:half], order[half:]):
        assert _ratio(y, v, part) == pytest.approx(1.0, abs=0.06)


@pytest.mark.parametrize("setting", ["single_flat", "no_flat"])
def test_the_check_rejects_neighbouring_formulas(realisations, setting):
    """The same realisations judge the flat term: without halving it (one flat frame) or without it, the ratio is
    more than 12 % off 1 (at these counts the flat term is a third of the variance)."""
    y, v = realisations[setting]
    assert abs(_ratio(y, v) - 1.0) > 0.12, _ratio(y, v)


def test_variances_follow_the_counts():
    """Fewer photons (a thicker path) mean a larger variance; read noise adds (1/P² + …) terms."""
    P = np.array([100.0, 1000.0, 10000.0])
    F = np.full(3, 20000.0)
    v = log_count_variance(P, F)
    assert np.all(np.diff(v) < 0)
    np.testing.assert_allclose(v, 1 / P + 0.5 / F + (1 / 12) * (1 / P**2 + 0.5 / F**2 + (1 / P - 1 / F) ** 2))
    assert np.all(log_count_variance(P, F, read_noise=5.0) > v)


def _ctdata(variances):
    y = torch.zeros(3, 4)
    return CTData(op=None, y=y, ground_truth=None, volume=None, geometry=None, meta={}, variances=variances)


@pytest.mark.parametrize(
    "variances, message",
    [
        (torch.ones(4, 3), r"CTData: variances must have the sinogram's shape \(3, 4\), got \(4, 3\)"),
        (torch.tensor([[1.0, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 1]]), r"1 are not \(first at index \(1, 1\): 0.0\)"),
        (torch.full((3, 4), float("nan")), r"12 are not \(first at index \(0, 0\): nan\)"),
        (torch.full((3, 4), -1.0), r"must be finite and positive"),
        (np.ones((3, 4)), r"got ndarray"),
    ],
)
def test_bad_variances_are_named(variances, message):
    with pytest.raises(ValueError, match=message) as info:
        _ctdata(variances)
    assert "\n" not in str(info.value)
    assert _ctdata(None).variances is None


def test_volume_variances_bin_rows_and_columns(tmp_path):
    """A volume's variances (CPU reader): one per measurement, in ``y``'s axis order (angle, row, column); binning
    2 × 2 pixels of one transmission averages their variances as Σ t_j² Var_j / (4 t̄)²."""
    folder = tmp_path / "Walnut1"
    simulate_scan(folder, _params(7), progress=False)
    full = read_volume(WalnutScan(folder), angular_subsampling=4, detector_subsampling=1, progress=False)
    binned = read_volume(
        WalnutScan(folder), angular_subsampling=4, detector_subsampling=2, detector_binning=True, progress=False
    )
    assert full.variances.shape == full.y.shape == (2, 8, 48)
    assert binned.variances.shape == binned.y.shape == (2, 4, 24)
    t = torch.exp(-full.y.double())
    v = full.variances.double()
    tb = t.reshape(2, 4, 2, 24, 2).mean(dim=(2, 4))
    expected = (t * t * v).reshape(2, 4, 2, 24, 2).sum(dim=(2, 4)) / (4 * tb) ** 2
    torch.testing.assert_close(binned.variances.double(), expected, rtol=1e-5, atol=0)
    scan = walnut.WalnutScan(folder)
    P, F = scan.corrected_counts(int(full.meta["projection_files"][0][5:11]), np.arange(8), np.arange(48))
    torch.testing.assert_close(
        full.variances[0].double(), torch.as_tensor(log_count_variance(P, F, scan.read_noise)), rtol=1e-6, atol=0
    )
