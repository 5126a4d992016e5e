"""Calibration of a std map on measurements the reconstruction did not use: the held-out check and the methods that
recalibrate the map from it (``uq.calibration``).

Modules
-------
:mod:`.base`
    :class:`CalibrationMethod` (fit on held-out rows, apply to a std map and to sample moments, report) and
    :func:`resolve_calibration` (what ``auto`` means for a run).
:mod:`.none`, :mod:`.heldout`, :mod:`.bias`, :mod:`.spatial`
    The built-in methods, one each: :class:`NoCalibration` (the posterior's map), :class:`HeldoutScale` (std × the
    global scale ``k``), :class:`BiasModel` (``sqrt(std² + τ² M)``, a bias of std ``τ`` inside the object mask ``M``),
    :class:`SpatialBias` (a bias shaped by the object, the edges and the disagreement with TV/FBP).
:mod:`.check`
    :func:`run_heldout_check` (posterior samples projected onto the held-out rows ``T_h``) and :class:`HeldoutRows`
    (the per-row arrays, scored by :func:`ctuq.metrics.heldout.heldout_check`).
:mod:`.rows`, :mod:`.report`
    The rows on disk (``heldout_rows.npz``); the verdict, the table, ``heldout.json`` and the figure.

Every method is registered by name in :data:`ctuq.registry.CALIBRATIONS` (importing this package registers the
built-in ones, in the order above); a new one is one module with ``@CALIBRATIONS.register`` on its class, and passes
:class:`ctuq.testing.CalibrationContract`. The package is CT-free apart from the operator it projects onto
(anything with ``forward_flat``, ``c``, ``image_shape``) and knows no config key or run folder: the uncertainty
phase (:mod:`ctuq.pipeline.uq_phase`) and the calibration study (:mod:`ctuq.studies.calibration`) drive it.
"""

# isort: off
# the registration order of the built-in methods (CALIBRATIONS, metrics.json, the calibration figure): none, heldout,
# bias, spatial
from ctuq.calibration.base import AUTO, NONE, CalibrationMethod, resolve_calibration
from ctuq.calibration.none import NoCalibration
from ctuq.calibration.heldout import HeldoutScale, joint_ll_at_scale, scaled_moments
from ctuq.calibration.bias import BiasModel, bias_weight, biased_moments, object_mask
from ctuq.calibration.spatial import SpatialBias

# isort: on
from ctuq.calibration.check import (
    HELDOUT_SAMPLES,
    HeldoutRows,
    add_bias_weights,
    add_features,
    method_features,
    run_heldout_check,
)
from ctuq.calibration.report import table, verdict, write_report
from ctuq.calibration.rows import read_rows, write_rows

__all__ = [
    "AUTO",
    "NONE",
    "CalibrationMethod",
    "resolve_calibration",
    "NoCalibration",
    "HeldoutScale",
    "BiasModel",
    "SpatialBias",
    "scaled_moments",
    "biased_moments",
    "joint_ll_at_scale",
    "object_mask",
    "bias_weight",
    "HELDOUT_SAMPLES",
    "HeldoutRows",
    "run_heldout_check",
    "add_bias_weights",
    "add_features",
    "method_features",
    "verdict",
    "table",
    "write_report",
    "read_rows",
    "write_rows",
]
