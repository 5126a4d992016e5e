"""The calibration-method abstraction: what every recalibration of a std map is, and the ``auto`` rule.

A calibration method (a value of ``uq.calibration`` and of ``design.calibration``) is one :class:`CalibrationMethod`
subclass, registered by name in :data:`ctuq.registry.CALIBRATIONS`. It owns its whole model: it fits itself on the
arrays of a run's held-out rows and its reconstruction (:meth:`~CalibrationMethod.fit`; the parametric ones by the
shared maximum likelihood of :mod:`ctuq.calibration.likelihood`), gives the predictive variance it implies for
held-out rows (:meth:`~CalibrationMethod.row_variance`), applies itself to a std map and to the streamed sample
moments (so that the recalibrated map is scored with every statistic of the posterior's own, joint log-likelihoods
included), and reports itself (its entry in the held-out check's report, ``metrics.json["uq"]["calibration"]``, its
curve's label in ``calibration.png``, its log line, its sentence in the check's verdict).

The uncertainty phase applies the method ``uq.calibration`` names and scores every other registered one beside it
(``metrics.json["uq"][<its summary_key>]``); the calibration study scores each from the same objects; ``ctuq
design`` fits the one ``design.calibration`` names on unseen rows of the design (:mod:`ctuq.design.forecast`). A new
method is one module and one registry line (its ``name`` then is a valid ``uq.calibration`` and
``design.calibration``); its shipped contract is :class:`ctuq.testing.CalibrationContract`.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar

from ctuq.registry import CALIBRATIONS

if TYPE_CHECKING:  # annotations only
    from ctuq.calibration.rows import HeldoutRows
    from ctuq.metrics import SampleMoments

__all__ = ["CalibrationMethod", "SideScore", "AUTO", "NONE", "resolve_calibration"]

#: The ``uq.calibration`` value that picks a method per run (:func:`resolve_calibration`; a reserved registry name).
AUTO = "auto"
#: The identity (:class:`~ctuq.calibration.none.NoCalibration`): what ``auto`` means without a held-out check.
NONE = "none"


@dataclasses.dataclass(frozen=True)
class SideScore:
    """How the calibration study (:mod:`ctuq.studies.calibration`) scores a method's map beside the posterior's own
    on the runs that applied none: the method fitted on the run's held-out rows, its map scored against the ground
    truth under ``key`` (``score_run``'s entry and its summary over scans), and a table in ``results.md``.

    Attributes
    ----------
    key : str
        The scores' key (``"bias"`` for the bias model).
    title : str
        The heading of its ``results.md`` table.
    note : str
        The line under the heading (what the map is).
    columns : dict
        Each of the method's :attr:`~CalibrationMethod.parameters` → ``(symbol, unit)`` of its table columns (how
        many scans have it > 0, its mean ± s.e.).
    """

    key: str
    title: str
    note: str
    columns: dict[str, tuple[str, str]]


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
        The entry of the held-out check's report that this method writes (:meth:`check_record`: its fit on the
        check's own rows, with its ``coverage_headline``, which the verdict reports for a run that applied it);
        ``None``: it writes none.
    study_default : bool
        Scored by the calibration study unless ``--calibrations`` says otherwise (``False`` for an option whose
        study is run on request).
    side_score : SideScore or None
        How the calibration study scores this method's map beside the posterior's on the runs that applied none;
        ``None``: it does not.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    changes_std: ClassVar[bool] = True
    report_keys: ClassVar[tuple[str, ...]] = ()
    summary_key: ClassVar[str] = ""
    summary_fields: ClassVar[tuple[str, ...]] = ()
    parameters: ClassVar[tuple[str, ...]] = ()
    heldout_report_key: ClassVar[str | None] = None
    study_default: ClassVar[bool] = True
    side_score: ClassVar[SideScore | None] = None

    # ------------------------------------------------------------------------------------------ fitting
    @classmethod
    @abc.abstractmethod
    def fit(cls, rows: HeldoutRows | None, reconstruction) -> CalibrationMethod | None:
        """The method fitted on the arrays of the held-out ``rows`` (scored or not; ``None``: the run had no held-out
        check) and the ``reconstruction`` ``image_shape`` (mm⁻¹, torch or numpy) whose std map it will
        recalibrate; standard errors by the rows' own bootstrap (``rows.n_bootstrap`` replicates of their
        ``groups``, seeded by ``rows.seed``). ``None`` when the rows are missing or do not carry what it needs
        (e.g. the bias model on rows without bias weights)."""

    @classmethod
    def check_record(cls, rows: HeldoutRows) -> dict | None:
        """This method's entry in the held-out check's report of ``rows`` (under :attr:`heldout_report_key`;
        ``heldout.json``): its fit on the rows (with the rows' bootstrap) as plain JSON values, with, where it can,
        the ``coverage_headline`` of the rows under its map (what the verdict reports for a run that applied it).
        Default: none."""
        return None

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

    @abc.abstractmethod
    def row_variance(self, rows: HeldoutRows):
        """The recalibrated predictive variance ``(m,)`` float64 of each of ``rows`` (measurement units²): what the
        method's map implies for unseen measurements, e.g. ``k² v_i + σ²_i`` for the scale. It describes the same
        model as :meth:`apply_std`: for a posterior with independent pixels of std ``s``, ``row_variance(rows) −
        σ²_i = Σ_j T_ij² apply_std(s)_j²`` (the contract checks it). Used to score a row with a calibration fitted
        before it was seen (the design's prequential check, :mod:`ctuq.design.forecast`)."""

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

    @classmethod
    def verdict_action(cls, calibration: dict, call: str) -> str:
        """What a run that chose this method did about its held-out check, one sentence for the verdict
        (:func:`ctuq.calibration.report.verdict`): ``calibration`` is the run's ``metrics.json["uq"]
        ["calibration"]`` (``mode`` and this method's report keys), ``call`` the check's ``"too narrow"``, ``"too
        wide"`` or ``"about right"``."""
        return f"std.tif is recalibrated by uq.calibration = {cls.name}; details: heldout.json."

    @classmethod
    def predicted_rms(cls, report: dict, rms_std: float) -> float:
        """The RMS of this method's std map inside the object mask (mm⁻¹) from the posterior's there, ``rms_std``,
        and a fit's :meth:`report` (e.g. a design's recorded forecast fits: the stop-rule study). Only for methods
        whose map's mean variance inside the mask follows from those two; ``NotImplementedError`` otherwise."""
        raise NotImplementedError(
            f"calibration method {cls.name!r} cannot predict the RMS error inside the object from its report"
        )

    def side_parameters(self) -> dict[str, Any]:
        """The :attr:`parameters` of :meth:`report` recorded with this method's :attr:`side_score`."""
        rep = self.report()
        return {key: rep[key] for key in self.parameters}

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
