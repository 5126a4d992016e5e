"""Calibration of a std map on measurements the reconstruction did not use: the held-out check and the methods that
recalibrate the map from it (``uq.calibration``, ``design.calibration``).

Modules
-------
:mod:`.base`
    :class:`CalibrationMethod` (fit on held-out rows, their row variances, apply to a std map and to sample moments,
    report) and :func:`resolve_calibration` (what ``auto`` means for a run).
:mod:`.none`, :mod:`.heldout`, :mod:`.bias`, :mod:`.spatial`
    The built-in methods, one each: :class:`NoCalibration` (the posterior's map), :class:`HeldoutScale` (std × the
    global scale ``k``), :class:`BiasModel` (``sqrt(std² + τ² M)``, a bias of std ``τ`` inside the object mask ``M``),
    :class:`SpatialBias` (a bias shaped by the object, the edges and the disagreement with TV/FBP).
:mod:`.likelihood`
    :func:`fit_linear_variance`: the maximum-likelihood fit of a variance linear in non-negative parameters that the
    parametric methods share.
:mod:`.maps`
    The image-space helpers: :func:`object_mask`, :func:`bias_weight` (row weights ``Σ_j T_ij² f_j`` of a map),
    :func:`scaled_moments`, :func:`biased_moments`, :func:`moments_with_sums`.
:mod:`.rows`
    :class:`HeldoutRows` (the per-row arrays, scored by :meth:`HeldoutRows.score`) and the rows on disk
    (``heldout_rows.npz``).
:mod:`.check`, :mod:`.report`
    :func:`run_heldout_check` (posterior samples projected onto the held-out rows ``T_h``); the verdict, the table,
    ``heldout.json`` and the figure.

Every method is registered by name in :data:`ctuq.registry.CALIBRATIONS` (importing this package registers the
built-in ones, in the order above); a new one is one module with ``@CALIBRATIONS.register`` on its class, and passes
:class:`ctuq.testing.CalibrationContract`. The package is CT-free apart from the operator it projects onto
(anything with ``forward_flat``, ``c``, ``image_shape``) and knows no config key or run folder: the uncertainty
phase (:mod:`ctuq.pipeline.uq_phase`), the calibration study (:mod:`ctuq.studies.calibration`) and the design's
forecast (:mod:`ctuq.design.forecast`) drive it.
"""

# isort: off
# the registration order of the built-in methods (CALIBRATIONS, metrics.json, the calibration figure): none, heldout,
# bias, spatial
from ctuq.calibration.base import AUTO, NONE, CalibrationMethod, SideScore, resolve_calibration
from ctuq.calibration.none import NoCalibration
from ctuq.calibration.heldout import HeldoutScale, joint_ll_at_scale
from ctuq.calibration.bias import BiasModel, fit_bias_variance
from ctuq.calibration.spatial import SpatialBias

# isort: on
from ctuq.calibration.check import HELDOUT_SAMPLES, method_features, run_heldout_check
from ctuq.calibration.likelihood import fit_linear_variance
from ctuq.calibration.maps import bias_weight, biased_moments, moments_with_sums, object_mask, scaled_moments
from ctuq.calibration.report import HeldoutCheck, table, verdict, write_report
from ctuq.calibration.rows import HeldoutRows, read_rows, write_rows

__all__ = [
    "HeldoutCheck",
    "AUTO",
    "NONE",
    "CalibrationMethod",
    "SideScore",
    "resolve_calibration",
    "NoCalibration",
    "HeldoutScale",
    "BiasModel",
    "SpatialBias",
    "fit_linear_variance",
    "fit_bias_variance",
    "scaled_moments",
    "biased_moments",
    "moments_with_sums",
    "joint_ll_at_scale",
    "object_mask",
    "bias_weight",
    "HELDOUT_SAMPLES",
    "HeldoutRows",
    "run_heldout_check",
    "method_features",
    "verdict",
    "table",
    "write_report",
    "read_rows",
    "write_rows",
]
