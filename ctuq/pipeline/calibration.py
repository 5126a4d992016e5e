"""The held-out calibration check of a CT run, and the recalibration of its std map (``uq.calibration``).

A run uses every ``data.angular_subsampling``-th angle of its scan; the scan's other angles are measurements the
reconstruction never saw. Read with the same slice, detector columns, image grid and backend as the run's own
sinogram (:func:`heldout_data`), they give the held-out operator ``T_h`` and sinogram ``y_h``, and
:func:`run_heldout_check` compares them with the posterior predictive ``N(T_h x̂, T_h Σ T_hᵀ + σ² I)``
(:func:`ctuq.metrics.heldout.heldout_check`): ``x̂`` the DIP reconstruction, ``Σ`` from posterior image samples
(the first ``n_samples`` of the run's own prediction samples: same seed), ``σ²`` the run's (learned) noise variance.
Units: the posterior lives in the DIP's scaled units; samples are divided by ``scale`` and ``σ²`` by ``scale²``,
so the check is in the units of the sinogram (line integrals).

Its ``k`` is the factor on the image std that explains the held-out rows best; ``uq.calibration: heldout`` writes
``std.tif = k × std`` (``std_uncalibrated.tif`` keeps the posterior's) and scores both against a ground truth.
Its bias model keeps the posterior and adds a white bias of std ``τ`` inside the object mask ``M``
(:func:`object_mask`, :func:`bias_weight`); ``uq.calibration: bias`` writes ``std.tif = sqrt(std² + τ² M)``
(:func:`bias_variance`).

The per-row arrays (``heldout_rows.npz``, :func:`write_heldout`) are everything the statistic needs, so ``ctuq uq
RUN --check`` rescores them (:func:`read_heldout_rows`, :func:`score_rows`) instead of rebuilding the posterior.

Not done: when a scan has no unused angles (``data.angular_subsampling = 1``), a K-fold over the used angles
would need one DIP refit per fold (the DIP has seen every used angle, so its residual there is not held out; the
exact solver's block downdate would predict a fold with the linear model's mean, not the DIP's, see
docs/calibration.md); the check is skipped with a one-line reason. Volumes (3D cone beam) are skipped too.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import NormalDist

import numpy as np
import scipy.sparse as sp
import tifffile
import torch
from scipy import ndimage

from ctuq import figures
from ctuq.config import Config
from ctuq.data.formats import open_scan
from ctuq.errors import CTUQError, OutDirError
from ctuq.geometry import ProjectionGeometry
from ctuq.metrics.heldout import heldout_check
from ctuq.operators import make_ray_transform
from ctuq.operators.astra_cuda import AstraCudaRayTransform
from ctuq.options import Backend
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.scan import data_path
from ctuq.pipeline.uq import UQRun
from ctuq.utils import atomic_path, atomic_write_json

__all__ = [
    "HELDOUT_SAMPLES",
    "HeldoutData",
    "HeldoutResult",
    "heldout_data",
    "run_heldout_check",
    "score_rows",
    "write_heldout",
    "read_heldout_rows",
    "verdict",
    "table",
    "require_finished_uq_run",
    "fitted_posterior",
    "raise_no_heldout",
    "object_mask",
    "bias_weight",
    "bias_variance",
    "read_heldout_rows_with_bias",
]

HELDOUT_SAMPLES = 256
_LOW_IMAGE_FRACTION = 0.5  # below it the verdict warns that k is dominated by the noise model
"""Posterior samples of the check: enough for ``k`` to ±1 % on the demo (its bootstrap s.e. is larger)."""
# the object of the bias model (docs/calibration.md, "τ alone"): x̂ smoothed by 1 px above 10 % of its maximum;
# measured with these values on 24 runs, not tuned
_MASK_FRACTION = 0.1
_MASK_SMOOTH_PX = 1.0
_BIAS_PROBES = 64  # Rademacher probes of diag(T M Tᵀ) for operators without an assembled matrix


@dataclasses.dataclass
class HeldoutData:
    """The scan's angles a run did not use.

    Attributes
    ----------
    op : RayTransform
        ``T_h`` on the run's image grid, measurement shape ``(n_angles, n_cols)``.
    y : torch.Tensor
        ``(n_angles, n_cols)`` held-out sinogram (line integrals), on ``op.device``.
    geometry_rows : np.ndarray
        ``(n_angles,)`` the scan's geometry rows held out (the block labels of the bootstrap).
    n_used : int
        Angles the run used.
    relative_variances : np.ndarray or None
        ``(n_angles · n_cols,)`` float64 per-ray noise variances of the held-out rows relative to the mean variance
        of the rows the run used (the normalisation of ``uq.noise = per_ray``, so ``σ² d_h`` is their noise
        variance in the posterior's units); ``None`` when the scan holds no photon counts.
    photon_variances : np.ndarray or None
        ``(n_angles · n_cols,)`` float64 absolute photon-noise variances of the held-out rows (sinogram units², from
        the scan's counts, flats and darks); ``None`` when the scan holds no photon counts.
    """

    op: object
    y: torch.Tensor
    geometry_rows: np.ndarray
    n_used: int
    relative_variances: np.ndarray | None = None
    photon_variances: np.ndarray | None = None

    @property
    def n_angles(self) -> int:
        """Held-out angles."""
        return int(len(self.geometry_rows))


@dataclasses.dataclass
class HeldoutResult:
    """:func:`run_heldout_check`'s output: ``report`` (JSON-ready, :func:`ctuq.metrics.heldout.heldout_check`'s
    dict plus sizes, seconds and the command) and the flat per-row arrays it came from (sinogram units):
    ``residual`` ``y_h − T_h x̂``, ``variance`` ``v_i``, ``noise_variance`` ``σ²`` (per row with per-ray noise),
    ``groups`` (geometry row), ``photon_variance`` (per row from the scan's counts, or ``None``), ``bias_weight``
    (``w_i = Σ_j T_ij² M_j`` of the object mask, :func:`bias_weight`, or ``None`` for rows saved before it)."""

    report: dict
    residual: np.ndarray
    variance: np.ndarray
    noise_variance: float | np.ndarray
    groups: np.ndarray
    photon_variance: np.ndarray | None = None
    bias_weight: np.ndarray | None = None

    @property
    def k(self) -> float:
        """The recalibration scale of the image std."""
        return float(self.report["scale"]["k"])

    @property
    def bias(self) -> dict | None:
        """The bias model's fit (:func:`ctuq.metrics.heldout.fit_bias_variance`: ``tau`` in mm⁻¹ per pixel, its
        s.e.), or ``None`` for rows without ``bias_weight``."""
        return self.report.get("bias")


def heldout_data(cfg: Config, device: torch.device, *, progress: bool = False) -> tuple[HeldoutData | None, str]:
    """The held-out angles of the scan ``cfg.data`` names, read like the run's own (:func:`ctuq.pipeline.scan.
    load_scan`): same slice, orbit, detector subsampling, image grid, backend and device.

    Returns ``(data, "")``, or ``(None, reason)`` with a one-line reason when there is nothing to hold out (every
    angle used, a volume).
    """
    dc = cfg.data
    if dc.ndim != 2:
        return None, "the held-out check is implemented for 2D slices only (data.ndim = 3)"
    if dc.angular_subsampling == 1:
        return None, (
            "the scan has no unused angles (data.angular_subsampling = 1); a K-fold over the used angles is not "
            "done: it needs one DIP refit per fold"
        )
    path = data_path(cfg)
    fmt, scan = open_scan(path, dc.orbit)  # any registered format (walnut folder, scan.yaml, NXtomo)
    used, _files = scan.angle_plan(dc.angular_subsampling)
    every = fmt.read_slice(
        scan,
        slice_index=dc.slice_index,
        angular_subsampling=1,
        detector_subsampling=dc.detector_subsampling,
        image_shape=None if dc.image_shape is None else tuple(dc.image_shape),
        progress=progress,
    )
    rows = np.asarray(every.meta["geometry_rows"])
    held = ~np.isin(rows, used)
    if not held.any():
        return None, f"{path}: every angle of the scan is used by the run"
    if dc.backend == Backend.ASTRA_CUDA:
        cone = every.slice_cone_geometry
        geom = ProjectionGeometry(cone.kind, cone.det_shape, vectors=cone.vectors[held])
        op = AstraCudaRayTransform.cone_slice(every.volume, float(every.meta["z_mm"]), geom, device=device)
    else:
        fan = every.geometry
        geom = ProjectionGeometry(fan.kind, fan.det_shape, vectors=fan.vectors[held])
        op = make_ray_transform(every.volume, geom, backend=dc.backend, device=device)
    y = every.y[torch.from_numpy(held)].to(device)
    rel = photon = None
    if every.variances is not None:
        # per_ray normalises the used rows' variances to mean 1 (pipeline.uq.relative_variances): the held-out rows
        # take the same normaliser, so σ² d_h is their noise variance in the fitted posterior's units
        var = every.variances.detach().to("cpu", torch.float64)
        photon = var[torch.from_numpy(held)].reshape(-1).numpy()
        rel = photon / float(var[torch.from_numpy(~held)].mean())
    data = HeldoutData(
        op=op, y=y, geometry_rows=rows[held], n_used=len(used), relative_variances=rel, photon_variances=photon
    )
    return data, ""


def object_mask(image: torch.Tensor | np.ndarray) -> np.ndarray:
    """The object of the bias model: ``image`` ``(H, W)`` (mm⁻¹) smoothed by a Gaussian of 1 px, above 10 % of its
    maximum. Returns ``(H, W)`` float64 0/1."""
    x = image.detach().to("cpu", torch.float64).numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    smooth = ndimage.gaussian_filter(np.asarray(x, np.float64), _MASK_SMOOTH_PX)
    return (smooth > _MASK_FRACTION * smooth.max()).astype(np.float64)


def bias_weight(op, mask: np.ndarray, *, seed: int = 0) -> np.ndarray:
    """``w_i = Σ_j T_ij² M_j`` ``(op.c,)`` float64 (mm²): the variance of held-out row ``i`` per unit ``τ²`` of a
    bias independent from pixel to pixel inside ``mask`` (``op.image_shape``). Exact from the assembled matrix of
    the sparse backend; otherwise the mean of ``(T(√M ⊙ ξ))²`` over 64 Rademacher probes ``ξ`` (unbiased)."""
    m = torch.as_tensor(np.asarray(mask, np.float64).reshape(-1))
    csr = getattr(op, "csr", None)
    if isinstance(csr, torch.Tensor):
        squared = sp.csr_matrix(
            (
                csr.values().detach().to("cpu", torch.float64).pow(2).numpy(),
                csr.col_indices().cpu().numpy(),
                csr.crow_indices().cpu().numpy(),
            ),
            shape=tuple(csr.shape),
        )
        return np.asarray(squared @ m.numpy(), np.float64)
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros(op.c, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(_BIAS_PROBES):
            xi = (torch.randint(0, 2, m.shape, generator=gen) * 2 - 1).to(torch.float64) * m.sqrt()
            total += op.forward_flat(xi.reshape(1, -1).to(op.device, op.dtype))[0].double().cpu().pow(2)
    return (total / _BIAS_PROBES).numpy()


def bias_variance(reconstruction: torch.Tensor | np.ndarray, tau: float) -> tuple[np.ndarray, float]:
    """``τ² M`` (``reconstruction``'s shape ``(H, W)``, float64, mm⁻²): the pixel variance the bias model adds to
    the posterior's (``uq.calibration = bias``: ``std.tif = sqrt(std² + τ² M)``), with ``M`` the
    :func:`object_mask` of the reconstruction (mm⁻¹) the held-out check used; and ``M``'s fraction of the pixels."""
    mask = object_mask(reconstruction)
    return (float(tau) ** 2) * mask, float(mask.mean())


def read_heldout_rows_with_bias(
    run_dir: Path, cfg: Config, device: torch.device, *, seed: int
) -> tuple[HeldoutResult, dict] | None:
    """:func:`read_heldout_rows`, with the ``bias_weight`` of rows saved before the bias model computed from the
    run's scan (:func:`heldout_data`: the held-out operator of ``cfg``) and the object mask of its
    ``reconstruction.tif`` (:func:`bias_weight`, ``seed`` the check's: ``run seed + 1``), and saved back into
    ``heldout_rows.npz`` atomically (rows and sizes unchanged). ``None`` when the folder has no rows.
    :class:`~ctuq.errors.CTUQError` when the scan has no held-out angles any more or they do not match the rows."""
    saved = read_heldout_rows(run_dir)
    if saved is None or saved[0].bias_weight is not None:
        return saved
    rows, meta = saved
    run_dir = Path(run_dir)
    held, reason = heldout_data(cfg, device, progress=False)
    if held is None:
        raise CTUQError(f"{run_dir / rf.HELDOUT_ROWS_NAME}: no bias weights for the saved rows: {reason}")
    if held.op.c != rows.residual.size:
        raise OutDirError(
            f"{run_dir / rf.HELDOUT_ROWS_NAME}: {rows.residual.size} saved rows, but the scan of config.yaml holds "
            f"{held.op.c} held-out rows; rerun `ctuq uq {run_dir}`"
        )
    reconstruction = tifffile.imread(run_dir / rf.RECONSTRUCTION_NAME).astype(np.float64)
    weight = bias_weight(held.op, object_mask(reconstruction.reshape(held.op.image_shape)), seed=seed)
    rows = dataclasses.replace(rows, report=dict(meta), bias_weight=weight)
    write_heldout(run_dir, rows, json_file=False, figure=False)
    rows.report = {}
    return rows, meta


def run_heldout_check(
    posterior,
    reconstruction: torch.Tensor,
    scale: float,
    held: HeldoutData,
    *,
    n_samples: int = HELDOUT_SAMPLES,
    chunk_size: int = 64,
    seed: int = 0,
    n_bootstrap: int = 200,
    command: str | None = None,
    per_ray: bool = False,
) -> HeldoutResult:
    """The held-out check of a fitted CT posterior (module docstring).

    Parameters
    ----------
    posterior : LinearizedPosterior
        Fitted; its ``sample_outputs`` yields zero-mean image samples ``(B, d_x)`` in scaled units and its
        ``sigma2`` is in scaled units².
    reconstruction : torch.Tensor
        ``held.op.image_shape`` predictive mean ``x̂`` (mm⁻¹).
    scale : float
        The DIP scale.
    held : HeldoutData
    n_samples, chunk_size, seed : int
        Posterior samples (``seed``: the prediction's own, ``run seed + 1``, so these are the std map's first
        samples).
    n_bootstrap : int
        Block-bootstrap replicates of ``k`` (angles resampled).
    command : str, optional
        The command that reproduces the check, recorded in the report.
    per_ray : bool
        The posterior was fitted with ``uq.noise = per_ray``: the held-out rows' noise variance is ``σ² d_h``
        (``held.relative_variances``) instead of one ``σ²``.
    """
    t0 = time.perf_counter()
    op = held.op
    with torch.no_grad():
        x = reconstruction.reshape(1, -1).to(op.device, op.dtype)
        mean = op.forward_flat(x)[0].double().cpu()
        sum_sq = torch.zeros(op.c, dtype=torch.float64)
        k = 0
        for _i, images, _ps in posterior.sample_outputs(n_samples, chunk_size=chunk_size, seed=seed):
            proj = op.forward_flat((images / scale).to(op.device, op.dtype)).double().cpu()
            sum_sq += proj.pow(2).sum(0)
            k += proj.shape[0]
    variance = (sum_sq / k).numpy()
    sigma2 = float(posterior.sigma2) / scale**2
    if per_ray:
        if held.relative_variances is None:
            raise ValueError("run_heldout_check: per_ray needs the held-out rows' variances (the scan has no counts)")
        sigma2 = sigma2 * held.relative_variances
    groups = np.repeat(held.geometry_rows, op.c // held.n_angles)
    y = held.y.reshape(-1).double().cpu().numpy()
    weight = bias_weight(op, object_mask(reconstruction.reshape(op.image_shape)), seed=seed)
    result = HeldoutResult({}, y - mean.numpy(), variance, sigma2, groups, held.photon_variances, weight)
    meta = {"n_samples": int(k), "n_angles": held.n_angles, "n_used_angles": int(held.n_used)}
    meta["noise_model"] = "per_ray" if per_ray else "homoscedastic"
    if command is not None:
        meta["command"] = command
    result.report = score_rows(result, meta, n_bootstrap=n_bootstrap, seed=seed)
    result.report["seconds"] = time.perf_counter() - t0
    return result


def score_rows(rows: HeldoutResult, meta: dict, *, n_bootstrap: int = 200, seed: int = 0) -> dict:
    """The check's report (:func:`ctuq.metrics.heldout.heldout_check`) of the per-row arrays of ``rows``, with the
    sizes and provenance of ``meta`` (``n_samples``, ``n_angles``, ``n_used_angles``, ``noise_model``, ``command``)
    added. The rows are everything the check needs: ``ctuq uq RUN --check`` rescores a run's saved rows
    (:func:`read_heldout_rows`) without rebuilding its posterior."""
    report = heldout_check(
        rows.residual,
        np.zeros_like(rows.residual),
        variance=rows.variance,
        noise_variance=rows.noise_variance,
        photon_variance=rows.photon_variance,
        bias_weight=rows.bias_weight,
        groups=rows.groups,
        n_bootstrap=n_bootstrap,
        seed=seed,
    )
    report.update(meta)
    return report


def verdict(report: dict) -> str:
    """One line a user reads the check from: too narrow / too wide / consistent, by how much, on how much data."""
    sc = report["scale"]
    k = sc["k"]
    se = sc["se_bootstrap"] if sc.get("se_bootstrap") is not None else sc["se_curvature"]
    where = f"(coverage@0.9 {report['coverage_headline']['0.9']:.2f} on {report['n_angles']} held-out angles)"
    if sc["at_bound"]:
        return (
            f"held-out check: the held-out rows do not constrain the image std (k at the search bound, "
            f"image-variance fraction {report['image_variance_fraction']:.3f}) {where}"
        )
    if abs(k - 1.0) <= max(2.0 * se, 0.05):
        return f"held-out check: std map consistent with the held-out angles, k = {k:.2f} ± {se:.2f} {where}"
    side = "too narrow" if k > 1 else "too wide"
    frac = report["image_variance_fraction"]
    if frac < _LOW_IMAGE_FRACTION:
        # measured on the demo scan: with the image part at 15 % of the predictive variance, a noise model that is
        # slightly off moves k far more than the std map's own error; and the rows see line integrals of the error,
        # whose calibration is not the pixels' (docs/calibration.md)
        return (
            f"held-out check: line integrals through the std map {side} by ×{k:.2f} ± {se:.2f} {where}, but the "
            f"image part is only {100 * frac:.0f} % of the held-out predictive variance and k is not the pixels' "
            f"scale; do not rescale on it alone (docs/calibration.md)"
        )
    return (
        f"held-out check: std map {side} by ×{k:.2f} ± {se:.2f} {where}; rerun with "
        f"--set uq.calibration=heldout to rescale"
    )


def table(report: dict) -> str:
    """A short text table of the check (nominal vs held-out coverage, z summary, LL, image-variance fraction)."""
    cov = report["coverage_headline"]
    rec = report["scale"]["coverage_headline"]
    z = report["z"]
    lines = [
        f"held-out angles {report['n_angles']} (rows {report['n_rows']}), used angles {report['n_used_angles']}, "
        f"{report['n_samples']} posterior samples",
        f"{'nominal':>10} {'coverage':>10} {'with std×k':>11}",
        *(f"{q:>10} {cov[q]:>10.3f} {rec[q]:>11.3f}" for q in ("0.5", "0.9", "0.95")),
        f"z: mean {z['mean']:.3f}, std {z['std']:.3f}, |z| > 3: {z['frac_abs_gt_3']:.4f}",
        f"held-out LL per row {report['log_likelihood']:.3f} (σ² alone {report['log_likelihood_noise_only']:.3f}, "
        f"std×k {report['scale']['log_likelihood']:.3f}); image-variance fraction "
        f"{report['image_variance_fraction']:.3f}",
        f"k = {report['scale']['k']:.3f} (s.e. bootstrap over angles "
        f"{report['scale']['se_bootstrap'] if report['scale']['se_bootstrap'] is not None else float('nan'):.3f}, "
        f"curvature {report['scale']['se_curvature']:.3f})",
    ]
    joint = report.get("scale_with_noise")
    if joint is not None:
        lines.append(
            f"with σ² refit on the held-out rows too: k = {joint['k']:.3f}, noise std × {joint['noise_scale']:.3f} "
            f"(LL per row {joint['log_likelihood']:.3f})"
        )
    top = report.get("scale_image_rows")
    if top is not None:
        lines.append(
            f"on the {100 * top['fraction']:.0f} % of rows with the largest image part (its fraction "
            f"{top['image_variance_fraction']:.3f}): k = {top['k']:.3f}"
        )
    bias = report.get("bias")
    if bias is not None:
        lines.append(
            "no room for a bias inside the object (τ = 0): the posterior's std as it is"
            if bias["zero"]
            else f"bias inside the object, posterior kept (k = 1): τ = {bias['tau']:.3g} mm⁻¹ per pixel "
            f"(coverage@0.9 {bias['coverage_headline']['0.9']:.3f}, LL per row {bias['log_likelihood']:.3f})"
        )
    photon = report.get("scale_photon")
    if photon is not None:
        lines.append(
            f"with the photon-statistics noise instead of σ²: k = {photon['k']:.3f} (image fraction "
            f"{photon['image_variance_fraction']:.3f})"
        )
    return "\n".join(lines)


_ROW_KEYS = ("residual", "variance", "noise_variance", "groups")
_META_KEYS = ("n_samples", "n_angles", "n_used_angles", "noise_model", "command")


def write_heldout(
    out_dir: Path, result: HeldoutResult, *, json_file: bool = True, figure: bool = True, rows: bool = True
) -> None:
    """Write ``heldout.json`` (with ``json_file``), ``heldout_calibration.png`` (with ``figure``) and the per-row
    arrays ``heldout_rows.npz`` (with ``rows``: float64 ``residual``, ``variance``, ``noise_variance`` per row,
    ``photon_variance`` when the scan has counts, ``bias_weight``, int ``groups``, and the report's sizes as a JSON
    string)
    atomically."""
    rep = result.report
    if json_file:
        atomic_write_json(out_dir / rf.HELDOUT_NAME, rep)
    if rows:
        arrays = {
            "residual": np.asarray(result.residual, np.float64),
            "variance": np.asarray(result.variance, np.float64),
            "noise_variance": np.broadcast_to(np.asarray(result.noise_variance, np.float64), result.residual.shape),
            "groups": np.asarray(result.groups, np.int64),
            "meta": np.asarray(json.dumps({k: rep[k] for k in _META_KEYS if k in rep})),
        }
        if result.photon_variance is not None:
            arrays["photon_variance"] = np.asarray(result.photon_variance, np.float64)
        if result.bias_weight is not None:
            arrays["bias_weight"] = np.asarray(result.bias_weight, np.float64)
        with atomic_path(out_dir / rf.HELDOUT_ROWS_NAME) as tmp, open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
    if figure:
        k = rep["scale"]["k"]
        z = np.abs(result.residual) / np.sqrt(k * k * result.variance + result.noise_variance)
        nd = NormalDist()
        rec = [float(np.mean(z <= nd.inv_cdf(0.5 * (1.0 + q)))) for q in rep["levels"]]
        figures.plot_heldout_calibration(
            out_dir / rf.HELDOUT_FIGURE,
            rep["levels"],
            rep["coverage"],
            rep["z"]["histogram"]["edges"],
            rep["z"]["histogram"]["density"],
            recalibrated=(rep["levels"], rec, k),
            title=f"held-out check: {rep['n_angles']} unused angles",
        )


def read_heldout_rows(run_dir: Path) -> tuple[HeldoutResult, dict] | None:
    """The held-out rows a run saved (``heldout_rows.npz``, :func:`write_heldout`) and their sizes (``meta``), or
    ``None`` when the folder has none (a run made before the file existed, or a scan without unused angles).
    :class:`~ctuq.errors.OutDirError` naming the file when it is unreadable or lacks an array."""
    path = Path(run_dir) / rf.HELDOUT_ROWS_NAME
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(str(arrays["meta"])) if "meta" in arrays else None
    except (OSError, ValueError, EOFError) as exc:
        raise OutDirError(f"{path}: unreadable held-out rows ({type(exc).__name__}: {exc})") from None
    missing = [k for k in (*_ROW_KEYS, "meta") if k not in arrays]
    if missing or not isinstance(meta, dict):
        raise OutDirError(f"{path}: not a held-out rows file (no {', '.join(missing or ['meta dict'])})")
    weight = arrays.get("bias_weight")
    if weight is not None and weight.shape != arrays["residual"].shape:
        raise OutDirError(
            f"{path}: bias_weight has shape {weight.shape}, the residual {arrays['residual'].shape} (one per row)"
        )
    rows = HeldoutResult(
        {},
        arrays["residual"],
        arrays["variance"],
        arrays["noise_variance"],
        arrays["groups"],
        arrays.get("photon_variance"),
        arrays.get("bias_weight"),  # absent from rows saved before the bias model
    )
    return rows, meta


def require_finished_uq_run(run_dir: Path) -> None:
    """Refuse ``--check`` on a folder that is not a finished run with the uncertainty phase (one-line
    :class:`~ctuq.errors.OutDirError` naming the folder and the missing file)."""
    if not (run_dir / rf.METRICS_NAME).is_file():
        raise OutDirError(
            f"RUN_DIR {run_dir}: not a finished run (no {rf.METRICS_NAME}); finish it with `ctuq reconstruct "
            f"--resume --out {run_dir}` first"
        )
    if not (run_dir / rf.STD_NAME).is_file():
        raise OutDirError(
            f"RUN_DIR {run_dir}: the run has no uncertainty phase (no {rf.STD_NAME}); run `ctuq uq {run_dir}` first"
        )


def fitted_posterior(state, *, log: Callable[[str], None] | None = None):
    """The fitted posterior of the finished run in ``state.out_dir`` without touching its files: the inference
    checkpoint (``uq_state.pt``) is copied into a temporary folder and resumed there (no EM step is repeated);
    without one the set-up and EM run afresh. ``state`` holds the loaded scan and the restored DIP. Returns the
    :class:`ctuq.pipeline.uq.UQRun` after :meth:`~ctuq.pipeline.uq.UQRun.fit`."""
    with tempfile.TemporaryDirectory(prefix="ctuq-check-") as tmp:
        saved = state.out_dir / rf.UQ_STATE_NAME
        if saved.is_file():
            shutil.copy2(saved, Path(tmp) / rf.UQ_STATE_NAME)
        elif log is not None:
            log(f"no {rf.UQ_STATE_NAME} in {state.out_dir}: setting up and fitting the posterior afresh")
        run = UQRun(
            state.model,
            state.net_input,
            state.op,
            state.y,
            scale=state.cfg.dip.scale,
            settings=state.cfg.uq,
            seed=state.cfg.seed,
            work_dir=tmp,
            resume=saved.is_file(),
            progress=state.progress,
            log=log,
            # uq.noise = per_ray whitens with the scan's per-measurement variances: without them it refuses
            variances=state.data.variances if state.data is not None else None,
        )
        run.set_up().fit()
    return run


def raise_no_heldout(run_dir: Path, reason: str) -> None:
    """``--check`` on a run whose scan has nothing to hold out: a one-line user error."""
    raise CTUQError(f"RUN_DIR {run_dir}: no held-out check: {reason}")
