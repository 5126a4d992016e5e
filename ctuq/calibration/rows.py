"""The held-out rows of a check (:class:`HeldoutRows`: the per-row arrays everything fits and scores on) and the rows
on disk (a run folder's ``heldout_rows.npz``), so that ``ctuq uq RUN --check`` and the calibration study rescore a
finished run in seconds.

One ``.npz``: float64 ``residual``, ``variance``, ``noise_variance`` (per row), ``photon_variance`` (when the scan
has counts), ``bias_weight``, int64 ``groups``, ``meta`` (the rows' sizes and provenance as a JSON string), and per
image feature of the calibration methods ``feature_<name>`` (the map) and ``feature_weight_<name>`` (its row
weights). A calibration method whose row weights a file lacks is not fitted on it
(:meth:`~ctuq.calibration.CalibrationMethod.fit` gives ``None``): the rows are scored without it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from ctuq.errors import OutDirError
from ctuq.metrics.heldout import heldout_check
from ctuq.registry import CALIBRATIONS
from ctuq.utils import atomic_path

__all__ = ["HeldoutRows", "write_rows", "read_rows", "ROW_KEYS", "META_KEYS"]

#: The arrays every rows file holds.
ROW_KEYS = ("residual", "variance", "noise_variance", "groups")
#: The :attr:`HeldoutRows.meta` entries saved with them, in this order.
META_KEYS = ("n_samples", "n_angles", "n_used_angles", "noise_model", "command")


@dataclasses.dataclass
class HeldoutRows:
    """The held-out rows of a check, flat per row (sinogram units), and their scores.

    Attributes
    ----------
    residual : np.ndarray
        ``(m,)`` ``y_h − T_h x̂``.
    variance : np.ndarray
        ``(m,)`` the image part ``v_i`` of the predictive variance (from the projected posterior samples).
    noise_variance : float or np.ndarray
        ``σ²``, or ``(m,)`` per row (per-ray noise).
    groups : np.ndarray
        ``(m,)`` int: the scan's geometry row of each row's angle (the block labels of the bootstrap).
    photon_variance : np.ndarray or None
        ``(m,)`` each row's measurement variance from the scan's photon statistics; ``None`` without counts.
    bias_weight : np.ndarray or None
        ``(m,)`` ``w_i = Σ_j T_ij² M_j`` of the object mask ``M`` (:func:`ctuq.calibration.maps.bias_weight`);
        ``None``: the rows carry none, and the bias model is not fitted on them.
    meta : dict
        Sizes and provenance: ``n_samples``, ``n_angles``, ``n_used_angles``, ``noise_model``, ``command``.
    report : dict
        The scores (:meth:`score`); empty until scored.
    features : dict
        Image maps the registered calibration methods fit on (name → ``(H, W)`` float64, ≥ 0:
        :meth:`~ctuq.calibration.CalibrationMethod.image_features`).
    feature_weights : dict
        Their held-out row weights (name → ``(m,)`` float64, mm²: ``Σ_j T_ij² f_j``, as :attr:`bias_weight` is of the
        object mask).
    n_bootstrap : int
        Block-bootstrap replicates (angles resampled) of every fit on these rows: the check's statistics and the
        standard errors a calibration method reports (:meth:`~ctuq.calibration.CalibrationMethod.fit`); 0: none.
    seed : int
        Seeds those bootstraps (the check's seed, ``run seed + 1`` in a run).
    """

    residual: np.ndarray
    variance: np.ndarray
    noise_variance: float | np.ndarray
    groups: np.ndarray
    photon_variance: np.ndarray | None = None
    bias_weight: np.ndarray | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    report: dict = dataclasses.field(default_factory=dict)
    features: dict = dataclasses.field(default_factory=dict)
    feature_weights: dict = dataclasses.field(default_factory=dict)
    n_bootstrap: int = 200
    seed: int = 0
    _records: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __setattr__(self, name, value):
        # the methods' records (check_record) hold for these arrays and bootstrap settings only: a new value of either
        # drops them (the report and meta do not enter a fit)
        super().__setattr__(name, value)
        if name not in ("report", "meta", "_records"):
            super().__setattr__("_records", {})

    def check_record(self, method) -> dict | None:
        """``method.check_record(self)`` (a :class:`~ctuq.calibration.CalibrationMethod` class), computed once per
        method for these rows: the check's report entry and the method's :meth:`~ctuq.calibration.CalibrationMethod.
        fit` share one bootstrap. Kept until an array or bootstrap setting of the rows is replaced."""
        if method.name not in self._records:
            self._records[method.name] = method.check_record(self)
        return self._records[method.name]

    def score(self, *, n_bootstrap: int | None = None, seed: int | None = None) -> dict:
        """Score the rows into :attr:`report` and return it: the posterior's own statistics and diagnostics
        (:func:`ctuq.metrics.heldout.heldout_check`), then, per registered calibration method that has one, its
        entry (:meth:`~ctuq.calibration.CalibrationMethod.check_record` under its ``heldout_report_key``: the
        global ``k`` as ``scale``, the bias model as ``bias``), then :attr:`meta`. ``n_bootstrap`` and ``seed``,
        when given, become the rows' own (:attr:`n_bootstrap`, :attr:`seed`): the methods fitted on the rows
        afterwards bootstrap as the check did."""
        if n_bootstrap is not None:
            self.n_bootstrap = int(n_bootstrap)
        if seed is not None:
            self.seed = int(seed)
        report = heldout_check(
            self.residual,
            np.zeros_like(self.residual),
            variance=self.variance,
            noise_variance=self.noise_variance,
            photon_variance=self.photon_variance,
            groups=self.groups,
            n_bootstrap=self.n_bootstrap,
            seed=self.seed,
        )
        for method in CALIBRATIONS.values():
            if method.heldout_report_key is not None:
                record = self.check_record(method)
                if record is not None:
                    report[method.heldout_report_key] = record
        report.update(self.meta)
        self.report = report
        return report

    @classmethod
    def concat(cls, parts) -> HeldoutRows:
        """The rows of ``parts`` (a non-empty sequence of :class:`HeldoutRows`) one after another, unscored, with the
        first part's bootstrap settings; the optional arrays (photon variances, bias and feature weights) are kept
        where every part has them."""
        parts = list(parts)
        if not parts:
            raise ValueError("HeldoutRows.concat: no rows to join")

        def joined(get):
            got = [get(p) for p in parts]
            return None if any(g is None for g in got) else np.concatenate([np.asarray(g, np.float64) for g in got])

        sizes = [p.residual.size for p in parts]
        noise = [np.broadcast_to(np.asarray(p.noise_variance, np.float64), (n,)) for p, n in zip(parts, sizes)]
        names = set.intersection(*(set(p.feature_weights) for p in parts))
        return cls(
            residual=np.concatenate([np.asarray(p.residual, np.float64) for p in parts]),
            variance=np.concatenate([np.asarray(p.variance, np.float64) for p in parts]),
            noise_variance=np.concatenate(noise),
            groups=np.concatenate([np.asarray(p.groups) for p in parts]),
            photon_variance=joined(lambda p: p.photon_variance),
            bias_weight=joined(lambda p: p.bias_weight),
            meta=dict(parts[0].meta),
            features=dict(parts[0].features) if names else {},
            feature_weights={k: joined(lambda p, k=k: p.feature_weights[k]) for k in sorted(names)},
            n_bootstrap=parts[0].n_bootstrap,
            seed=parts[0].seed,
        )

    def take(self, index) -> HeldoutRows:
        """The rows ``index`` (integer array or boolean mask over the rows), unscored: a copy."""
        idx = np.asarray(index)

        def pick(a):
            return None if a is None else np.asarray(a)[idx]

        noise = self.noise_variance if np.ndim(self.noise_variance) == 0 else pick(self.noise_variance)
        return dataclasses.replace(
            self,
            residual=pick(self.residual),
            variance=pick(self.variance),
            noise_variance=noise,
            groups=pick(self.groups),
            photon_variance=pick(self.photon_variance),
            bias_weight=pick(self.bias_weight),
            feature_weights={k: pick(v) for k, v in self.feature_weights.items()},
            meta=dict(self.meta),
            report={},
        )


def write_rows(path: Path, rows: HeldoutRows) -> None:
    """Write ``rows`` (arrays and :data:`META_KEYS` of its meta) to ``path`` atomically."""
    arrays = {
        "residual": np.asarray(rows.residual, np.float64),
        "variance": np.asarray(rows.variance, np.float64),
        "noise_variance": np.broadcast_to(np.asarray(rows.noise_variance, np.float64), rows.residual.shape),
        "groups": np.asarray(rows.groups, np.int64),
        "meta": np.asarray(json.dumps({k: rows.meta[k] for k in META_KEYS if k in rows.meta})),
    }
    if rows.photon_variance is not None:
        arrays["photon_variance"] = np.asarray(rows.photon_variance, np.float64)
    if rows.bias_weight is not None:
        arrays["bias_weight"] = np.asarray(rows.bias_weight, np.float64)
    for name, image in rows.features.items():
        arrays[f"feature_{name}"] = np.asarray(image, np.float64)
        arrays[f"feature_weight_{name}"] = np.asarray(rows.feature_weights[name], np.float64)
    with atomic_path(Path(path)) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, **arrays)


def read_rows(path: Path) -> HeldoutRows | None:
    """The rows saved at ``path`` (unscored, :attr:`HeldoutRows.meta` from the file), or ``None`` when there is no
    such file (a scan without unused angles, a run without the uncertainty phase).
    :class:`~ctuq.errors.OutDirError` naming the file when it is unreadable, lacks an array or holds bias weights
    that are not one per row."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(str(arrays["meta"])) if "meta" in arrays else None
    except (OSError, ValueError, EOFError) as exc:
        raise OutDirError(f"{path}: unreadable held-out rows ({type(exc).__name__}: {exc})") from None
    missing = [k for k in (*ROW_KEYS, "meta") if k not in arrays]
    if missing or not isinstance(meta, dict):
        raise OutDirError(f"{path}: not a held-out rows file (no {', '.join(missing or ['meta dict'])})")
    weight = arrays.get("bias_weight")
    if weight is not None and weight.shape != arrays["residual"].shape:
        raise OutDirError(
            f"{path}: bias_weight has shape {weight.shape}, the residual {arrays['residual'].shape} (one per row)"
        )
    names = [k.removeprefix("feature_weight_") for k in arrays if k.startswith("feature_weight_")]
    for name in names:
        if f"feature_{name}" not in arrays or arrays[f"feature_weight_{name}"].shape != arrays["residual"].shape:
            raise OutDirError(f"{path}: feature {name!r} lacks its map or has not one weight per row")
    return HeldoutRows(
        arrays["residual"],
        arrays["variance"],
        arrays["noise_variance"],
        arrays["groups"],
        arrays.get("photon_variance"),
        weight,
        meta,
        features={name: arrays[f"feature_{name}"] for name in names},
        feature_weights={name: arrays[f"feature_weight_{name}"] for name in names},
    )
