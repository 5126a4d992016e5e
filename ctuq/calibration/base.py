"""The calibration-method abstraction: what every recalibration of a std map is, and the ``auto`` rule.

A calibration method (a value of ``uq.calibration``) is one :class:`CalibrationMethod` subclass, registered by name
in :data:`ctuq.registry.CALIBRATIONS`. It fits itself on a run's scored held-out rows and its reconstruction
(:meth:`~CalibrationMethod.fit`), applies itself to a std map and to the streamed sample moments (so that the
recalibrated map is scored with every statistic of the posterior's own, joint log-likelihoods included), and reports
itself (``metrics.json["uq"]["calibration"]``, its curve's label in ``calibration.png``, its log line).

The uncertainty phase applies the method ``uq.calibration`` names and scores every other registered one beside it
(``metrics.json["uq"][<its summary_key>]``); the calibration study scores each from the same objects. A new method
is one module and one registry line (its ``name`` then is a valid ``uq.calibration``); its shipped contract is
:class:`ctuq.testing.CalibrationContract`.
"""

from __future__ import annotations

import abc
import copy
import math
from typing import TYPE_CHECKING, Any, ClassVar

from ctuq.registry import CALIBRATIONS

if TYPE_CHECKING:  # annotations only: check.py imports the registered methods' modules
    from ctuq.calibration.check import HeldoutRows
    from ctuq.metrics import SampleMoments

__all__ = ["CalibrationMethod", "AUTO", "NONE", "resolve_calibration", "moments_with_sums"]

#: The ``uq.calibration`` value that picks a method per run (:func:`resolve_calibration`; a reserved registry name).
AUTO = "auto"
#: The identity (:class:`~ctuq.calibration.none.NoCalibration`): what ``auto`` means without a held-out check.
NONE = "none"


class CalibrationMethod(abc.ABC):
    """One recalibration of a std map, fitted on held-out measurements (module docstring).

    Class attributes
    ----------------
    name : str
        Registry name: the ``uq.calibration`` value.
    summary : str
        One line for documentation and messages.
    changes_std : bool
        ``False`` only for the identity (``none``): it is never "applied" (no ``std_uncalibrated.tif``) nor scored
        beside another method.
    report_keys : tuple of str
        The keys of :meth:`report`, in order: also what ``metrics.json`` records (as ``None``) when the method was
        chosen but the run had no held-out rows to fit it on. Every built-in method records ``k``, the global scale
        (``None`` unless ``heldout``), the key ``metrics.json`` has always had.
    summary_key : str
        The ``metrics.json["uq"]`` key of this method's scores when another method is applied (default
        ``summary_<name>``).
    summary_fields : tuple of str
        The :meth:`report` entries recorded beside those scores.
    parameters : tuple of str
        The :meth:`report` entries that identify a fit (not its standard errors): recorded scores are reused for
        this fit only when these agree (:meth:`recorded_joint_ll`).
    heldout_report_key : str or None
        The entry of the held-out check's report that scores this method on the check's own rows (its
        ``coverage_headline``: what the verdict reports for a run that applied it); ``None``: not scored there.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    changes_std: ClassVar[bool] = True
    report_keys: ClassVar[tuple[str, ...]] = ()
    summary_key: ClassVar[str] = ""
    summary_fields: ClassVar[tuple[str, ...]] = ()
    parameters: ClassVar[tuple[str, ...]] = ()
    heldout_report_key: ClassVar[str | None] = None

    # ------------------------------------------------------------------------------------------ fitting
    @classmethod
    @abc.abstractmethod
    def fit(cls, rows: HeldoutRows | None, reconstruction) -> CalibrationMethod | None:
        """The method fitted on the held-out ``rows`` (scored: ``rows.report`` is the check's report; ``None``: the
        run had no held-out check) and the ``reconstruction`` ``image_shape`` (mm⁻¹, torch or numpy) whose std map
        it will recalibrate; ``None`` when the rows are missing or do not carry what it needs (e.g. the bias model
        on rows saved without bias weights)."""

    @classmethod
    def image_features(cls, reconstruction, companions: dict | None = None) -> dict:
        """The image maps (name → ``(H, W)`` float64, ≥ 0) whose held-out row weights ``Σ_j T_ij² f_j`` this method
        needs to fit itself (:attr:`HeldoutRows.features <ctuq.calibration.HeldoutRows.features>`): the check
        computes them for every registered method, where the held-out operator is at hand. ``reconstruction`` is
        ``x̂`` (mm⁻¹); ``companions`` the run's other reconstructions by name (``"fbp"``, ``"tv"``) where it has
        them. Default: none."""
        return {}

    # ------------------------------------------------------------------------------------------ applying
    @abc.abstractmethod
    def apply_std(self, std):
        """The recalibrated std map (mm⁻¹) of the posterior's ``std`` (the reconstruction's shape; torch tensor or
        numpy array, any float dtype): same type, shape and dtype; ``std`` itself is not modified."""

    @abc.abstractmethod
    def apply_moments(self, moments: SampleMoments) -> SampleMoments:
        """The sample moments of the recalibrated posterior (:class:`ctuq.metrics.SampleMoments`, mm⁻²; a copy, or
        ``moments`` itself when nothing changes): their :meth:`~ctuq.metrics.SampleMoments.std` is
        :meth:`apply_std` of ``moments.std()``."""

    def row_variance(self, rows: HeldoutRows):
        """The recalibrated predictive variance ``(m,)`` float64 of each of ``rows`` (measurement units²): what the
        method's map implies for unseen measurements, e.g. ``k² v_i + σ²_i`` for the scale. Used to score a row
        with a calibration fitted before it was seen (the design's prequential check, :mod:`ctuq.design.forecast`).
        """
        raise NotImplementedError(f"calibration method {self.name!r} does not give row variances")

    # ------------------------------------------------------------------------------------------ reporting
    @abc.abstractmethod
    def report(self) -> dict[str, Any]:
        """The fitted parameters as plain JSON values, keys :attr:`report_keys` in order (``metrics.json["uq"]
        ["calibration"]`` after ``mode`` and ``setting``)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """What the recalibrated map is, in a few symbols (``"std × 1.23"``): the calibration figure's label."""

    @classmethod
    def unfitted_report(cls) -> dict[str, Any]:
        """:attr:`report_keys` all ``None``: the record of a method chosen for a run without held-out rows."""
        return dict.fromkeys(cls.report_keys)

    @classmethod
    def summary_name(cls) -> str:
        """:attr:`summary_key`, or ``summary_<name>``."""
        return cls.summary_key or f"summary_{cls.name}"

    def summary_record(self) -> dict[str, Any]:
        """The :attr:`summary_fields` of :meth:`report`, recorded beside this method's scores."""
        rep = self.report()
        return {key: rep[key] for key in self.summary_fields}

    def label(self, applied: bool = True) -> str:
        """The calibration figure's label of this map: :meth:`describe`, marked ``(not applied)`` when it is only
        scored beside the applied one."""
        return self.describe() if applied else f"{self.describe()} (not applied)"

    def log_line(self) -> str:
        """The line the uncertainty phase logs when it applies this method."""
        return f"uq.calibration = {self.name}: std.tif = {self.describe()}"

    def recorded_joint_ll(self, uq: dict, posterior_ll: float | None, patch: str) -> float | None:
        """The joint log-likelihood (nats/pixel, ``patch``×``patch`` patches) of this method's map, from the scores
        a finished run recorded (``uq``: its ``metrics.json["uq"]``) without its moments: those recorded under
        :meth:`summary_name` (or ``summary``, when the run applied this method), if they were made with this fit
        (its :attr:`parameters` equal to rel. 1e-9); else ``None``. ``posterior_ll`` (the posterior's own) serves
        methods that derive theirs from it."""
        recorded, params = recorded_scores(self, uq)
        if recorded is None:
            return None
        mine = self.report()
        if not all(_same(params.get(key), mine[key]) for key in self.parameters):
            return None
        return (recorded.get("joint_ll") or {}).get(patch)

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``{"name", **report()}`` and whatever else the method stores (e.g. a mask), as plain values and arrays."""
        return {"name": self.name, **self.report()}

    @classmethod
    @abc.abstractmethod
    def from_state(cls, state: dict[str, Any]) -> CalibrationMethod:
        """The method of a :meth:`state_dict`: the same report and the same map, bitwise."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.report().items())})"


CALIBRATIONS.set_base(CalibrationMethod)


def recorded_scores(method: CalibrationMethod, uq: dict) -> tuple[dict | None, dict]:
    """``(scores, parameters)`` a run recorded for ``method``'s map: its summary beside another applied method, or
    the run's own summary and calibration record when it applied this one."""
    beside = uq.get(method.summary_name())
    if beside:
        return beside, beside
    cal = uq.get("calibration") or {}
    if cal.get("mode") == method.name and uq.get("summary"):
        return uq["summary"], cal
    return None, {}


def _same(recorded, fitted) -> bool:
    """A recorded parameter value is the fitted one (numbers to 1e-9 relative; a missing one never is)."""
    if isinstance(recorded, (int, float)) and isinstance(fitted, (int, float)):
        return math.isclose(float(recorded), float(fitted), rel_tol=1e-9, abs_tol=0.0)
    return recorded is not None and recorded == fitted


def moments_with_sums(moments: SampleMoments, new, **state) -> SampleMoments:
    """A copy of ``moments`` whose second-moment sums are ``new(sum, key)`` (``key``: ``"sum_sq"`` or a patch size;
    the recalibrated posterior's), with the other ``state`` entries replaced; ``moments`` is left unchanged."""
    sd = moments.state_dict()
    sums = {"sum_sq": new(sd["sum_sq"], "sum_sq"), "patch_sums": {p: new(t, p) for p, t in sd["patch_sums"].items()}}
    return copy.deepcopy(moments).load_state_dict({**sd, **state, **sums})


def resolve_calibration(setting: str, checked: bool, preferred: str) -> str:
    """The calibration method a run applies: ``setting`` (``uq.calibration``) itself, except ``auto`` (the
    default), which is ``none`` without a held-out check (``checked``: the scan has unused angles) and otherwise
    ``preferred``, the method the run's weight prior asks for (its ``auto_calibration``: the bias model for the
    g-prior). ``ValueError`` naming the valid values for an unknown one."""
    setting = str(setting)
    if setting != AUTO and setting not in CALIBRATIONS:
        raise ValueError(f"uq.calibration must be one of {list(CALIBRATIONS.choices())}, got {setting!r}")
    if setting != AUTO:
        return setting
    if not checked:
        return NONE
    if preferred not in CALIBRATIONS:
        raise ValueError(f"resolve_calibration: the preferred method {preferred!r} is not registered")
    return preferred
