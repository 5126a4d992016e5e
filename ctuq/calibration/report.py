"""What a user reads from the held-out check: a one-line verdict, a short table, ``heldout.json`` and the figure
(``heldout_calibration.png``: held-out coverage against level, with ``std × k``, and the z-score histogram)."""

from __future__ import annotations

from pathlib import Path
from statistics import NormalDist

import numpy as np

from ctuq import figures
from ctuq.calibration.check import HeldoutRows
from ctuq.utils import atomic_write_json

__all__ = ["verdict", "table", "write_report"]

_LOW_IMAGE_FRACTION = 0.5  # below it the verdict warns that k is dominated by the noise model


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


def write_report(rows: HeldoutRows, *, json_path: Path | None = None, figure_path: Path | None = None) -> None:
    """Write the scored ``rows``' report to ``json_path`` (atomically) and its figure to ``figure_path`` (coverage
    of the held-out rows against level, also with the image std × ``k``, and the z histogram); either may be
    ``None``."""
    rep = rows.report
    if json_path is not None:
        atomic_write_json(json_path, rep)
    if figure_path is not None:
        k = rep["scale"]["k"]
        z = np.abs(rows.residual) / np.sqrt(k * k * rows.variance + rows.noise_variance)
        nd = NormalDist()
        rec = [float(np.mean(z <= nd.inv_cdf(0.5 * (1.0 + q)))) for q in rep["levels"]]
        figures.plot_heldout_calibration(
            figure_path,
            rep["levels"],
            rep["coverage"],
            rep["z"]["histogram"]["edges"],
            rep["z"]["histogram"]["density"],
            recalibrated=(rep["levels"], rec, k),
            title=f"held-out check: {rep['n_angles']} unused angles",
        )
