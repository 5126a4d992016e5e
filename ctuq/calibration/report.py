"""What a user reads from the held-out check: a one-line verdict, a short table, ``heldout.json`` and the figure
(``heldout_calibration.png``: held-out coverage against level, with ``std × k``, and the z-score histogram)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np

from ctuq import figures
from ctuq.registry import CALIBRATIONS

if TYPE_CHECKING:  # annotations only
    from ctuq.calibration.rows import HeldoutRows
from ctuq.utils import atomic_write_json

__all__ = ["HeldoutCheck", "assess", "verdict", "table", "write_report"]

_HEADLINE = ("0.5", "0.9", "0.95")
_TAIL_Z = 3.0
_TAIL_EXPECTED = 2.0 * (1.0 - NormalDist().cdf(_TAIL_Z))  # 0.27 % of a Gaussian lies beyond 3 std
_TAIL_NOTE = 3.0  # a tail this many times heavier than a Gaussian's is worth a clause
_NOISE_WORDS = {"per_ray": "per-ray photon noise", "homoscedastic": "one noise variance"}


@dataclasses.dataclass(frozen=True)
class HeldoutCheck:
    """The held-out check of a run as an object (``Run.check()``): the numbers and the sentence.

    Attributes
    ----------
    report : dict
        The check's statistics (``heldout.json``: coverage per level, z-scores, log-likelihoods, each calibration
        method's fit on these rows).
    calibration : dict or None
        What the run shipped (its ``metrics.json["uq"]["calibration"]``: the method and its parameters).
    """

    report: dict
    calibration: dict | None = None

    @property
    def call(self) -> str:
        """``"too narrow"``, ``"about right"`` or ``"too wide"`` (:func:`assess`)."""
        return assess(self.report, self.calibration)["call"]

    @property
    def coverage(self) -> dict[str, float]:
        """Held-out coverage of the shipped error bars' 50/90/95 % intervals (keys ``"0.5"``, ``"0.9"``,
        ``"0.95"``)."""
        return assess(self.report, self.calibration)["coverage"]

    @property
    def n_angles(self) -> int:
        """Held-out angles checked."""
        return int(self.report["n_angles"])

    @property
    def verdict(self) -> str:
        """The one-paragraph verdict (:func:`verdict`)."""
        return verdict(self.report, self.calibration)

    def table(self) -> str:
        """The short text table (:func:`table`)."""
        return table(self.report, self.calibration)

    def __str__(self) -> str:
        return self.verdict


def _tolerance(q: float, n_groups: int) -> float:
    """How far a held-out coverage may stray from ``q`` by chance: two binomial s.e. with one effective sample per
    held-out angle (the rows of one angle share the reconstruction's errors), at least 0.01."""
    return max(0.01, 2.0 * math.sqrt(q * (1.0 - q) / max(int(n_groups), 1)))


def _shipped(report: dict, calibration: dict | None) -> tuple[dict, str]:
    """``(coverage at 0.5/0.9/0.95, what it is of)``: the held-out coverage of the error bars the run ships, i.e. with
    its calibration method applied where the check scored that method on these rows (the method's
    ``heldout_report_key`` in the report), else the posterior's own."""
    mode = (calibration or {}).get("mode")
    key = CALIBRATIONS[mode].heldout_report_key if mode in CALIBRATIONS else None
    scored = (report.get(key) or {}).get("coverage_headline") if key else None
    if scored is not None:
        return scored, "calibrated"
    return report["coverage_headline"], "posterior"


def assess(report: dict, calibration: dict | None = None) -> dict:
    """The verdict's numbers (JSON-ready): ``coverage`` (held-out coverage at 0.5/0.9/0.95 of the error bars the run
    ships, :func:`_shipped`), ``tolerance`` per level, ``call`` (``"too narrow"``, ``"too wide"`` or ``"about
    right"``: at least two of the three levels outside their tolerance on the same side, else about right),
    ``factor_90`` (what the held-out predictive std would have to be multiplied by for the 90 % intervals to cover 90 %
    of these rows: the 0.9 quantile of ``|z|`` over 1.645; ``None`` when about right), ``tail`` (fraction of rows
    beyond 3 std, and the Gaussian's) and what the coverage is of."""
    coverage, of = _shipped(report, calibration)
    n_groups = int(report["n_groups"])
    tol = {q: _tolerance(float(q), n_groups) for q in _HEADLINE}
    low = sum(coverage[q] < float(q) - tol[q] for q in _HEADLINE)
    high = sum(coverage[q] > float(q) + tol[q] for q in _HEADLINE)
    call = "too narrow" if low >= 2 else "too wide" if high >= 2 else "about right"
    factor = None
    if call != "about right":
        factor = _factor_at_90(report, coverage, of)
    return {
        "call": call,
        "coverage": {q: float(coverage[q]) for q in _HEADLINE},
        "coverage_of": of,
        "tolerance": tol,
        "factor_90": factor,
        "tail": {"beyond_3_std": float(report["z"]["frac_abs_gt_3"]), "gaussian": _TAIL_EXPECTED},
    }


def _factor_at_90(report: dict, coverage: dict, of: str) -> float:
    """The factor on the held-out predictive std that makes the 90 % intervals cover 90 %: for the posterior, the
    0.9 quantile of ``|z|`` over 1.645 (``z.abs_quantile_0.9``); for calibrated error bars, whose rows the report
    scores at 50/90/95 % only, the level whose intervals would cover 90 % interpolated on those three, over 1.645."""
    nd = NormalDist()
    if of == "posterior":
        return float(report["z"]["abs_quantile_0.9"]) / nd.inv_cdf(0.95)
    levels = [0.0, *(float(q) for q in _HEADLINE), 1.0]
    cov = [0.0, *(float(coverage[q]) for q in _HEADLINE), 1.0]
    q = float(np.interp(0.9, cov, levels))
    return float(nd.inv_cdf(0.5 * (1.0 + min(q, 0.999))) / nd.inv_cdf(0.95))


def verdict(report: dict, calibration: dict | None = None) -> str:
    """What the check says, in plain words and without contradicting its own numbers: what was checked (held-out
    angles, noise model), whether the error bars look too narrow, about right or too wide there (:func:`assess`), by
    how much, and what the run did about it (``calibration``: the run's ``metrics.json["uq"]["calibration"]``,
    ``mode`` and its parameters). The statistics behind it (the image std's scale ``k``, the image share of the
    predictive variance, the noise refit) are in ``heldout.json``."""
    a = assess(report, calibration)
    cov = a["coverage"]
    noise = _NOISE_WORDS.get(str(report.get("noise_model")), str(report.get("noise_model", "")))
    look = a["call"]
    if look == "about right" and abs(cov["0.9"] - 0.9) > 0.03:  # a visible gap that this many angles cannot resolve
        look += f" within what {report['n_angles']} angles can tell (±{100 * a['tolerance']['0.9']:.0f} % at 90 %)"
    head = f"held-out check on {report['n_angles']} unused angles ({noise}): the error bars look {look}"
    whose = "the posterior's" if a["coverage_of"] == "posterior" else "the calibrated"
    numbers = (
        f"{whose} 50/90/95 % intervals cover {100 * cov['0.5']:.0f}/{100 * cov['0.9']:.0f}/{100 * cov['0.95']:.0f} %"
        " of the held-out measurements"
    )
    if a["call"] == "too narrow":
        numbers += f"; they would need to be ×{a['factor_90']:.2f} wider"
    elif a["call"] == "too wide":
        numbers += f"; they could be ×{a['factor_90']:.2f} as wide"
    tail = a["tail"]
    if tail["beyond_3_std"] > _TAIL_NOTE * tail["gaussian"]:
        of = "" if a["coverage_of"] == "posterior" else " of the posterior"
        numbers += (
            f"; {100 * tail['beyond_3_std']:.1f} % lie beyond 3 std{of} ({100 * tail['gaussian']:.1f} % expected): "
            f"some rays see larger errors than the std map says"
        )
    return f"{head}: {numbers}. {_action(calibration, a['call'])}"


def _action(calibration: dict | None, call: str) -> str:
    """What the run did about it, in one sentence: the chosen method's own
    (:meth:`~ctuq.calibration.CalibrationMethod.verdict_action`)."""
    mode = (calibration or {}).get("mode")
    if mode is None:
        return "Details: heldout.json."
    if mode in CALIBRATIONS:
        return CALIBRATIONS[mode].verdict_action(calibration, call)
    return f"std.tif is recalibrated by uq.calibration = {mode}; details: heldout.json."


def table(report: dict, calibration: dict | None = None) -> str:
    """The check as a short text table: what was checked, the held-out coverage at 50/90/95 % of the posterior and
    of the error bars the run ships, and the 3-std tail (``ctuq uq RUN --check`` prints it above the verdict)."""
    a = assess(report, calibration)
    noise = _NOISE_WORDS.get(str(report.get("noise_model")), str(report.get("noise_model", "")))
    posterior = report["coverage_headline"]
    shipped = a["coverage_of"] != "posterior"
    lines = [
        f"held-out check: {report['n_angles']} unused angles ({report['n_rows']} measurements), "
        f"{report['n_used_angles']} used; {report['n_samples']} posterior samples; {noise}",
        f"{'interval':>10} {'covers':>10}" + (f" {'with the calibration':>22}" if shipped else ""),
        *(
            f"{100 * float(q):>8.0f} % {posterior[q]:>10.3f}" + (f" {a['coverage'][q]:>22.3f}" if shipped else "")
            for q in _HEADLINE
        ),
        f"beyond 3 std of the posterior: {100 * a['tail']['beyond_3_std']:.2f} % "
        f"({100 * a['tail']['gaussian']:.2f} % for a Gaussian)",
        "every statistic (the image std's scale k, the noise refit, the bias τ, log-likelihoods): heldout.json",
    ]
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
