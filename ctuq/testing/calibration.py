"""The calibration-method contract (:class:`CalibrationContract`, its checks in its docstring), its case type
(:class:`CalibrationCase`) and held-out rows drawn with a known answer (:func:`synthetic_heldout_rows`)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from ctuq.calibration import CalibrationMethod, HeldoutRows, object_mask
from ctuq.metrics import SampleMoments
from ctuq.registry import CALIBRATIONS

__all__ = ["CalibrationCase", "CalibrationContract", "synthetic_heldout_rows"]


def synthetic_heldout_rows(
    *, k: float = 1.0, tau: float = 0.0, m: int = 40000, n_groups: int = 400, seed: int = 0
) -> HeldoutRows:
    """Held-out rows drawn from a predictive whose answer is known (unscored :class:`~ctuq.calibration.HeldoutRows`):
    residuals ``r_i ~ N(0, k² v_i + τ² w_i + σ²)`` with image variances ``v_i ~ U(1e-4, 3e-4)``, bias weights ``w_i``
    ``U(5, 15)`` on half the rows and 0 on the others (an object mask), ``σ² = 6e-4`` (an image share of about 0.2,
    as a CT check's), ``n_groups`` equal blocks (angles). ``k`` is the scale the std map needs, ``τ`` the bias std
    inside the object."""
    rng = np.random.default_rng(seed)
    v = rng.uniform(0.5, 1.5, m) * 2e-4
    w = np.where(rng.random(m) < 0.5, rng.uniform(5.0, 15.0, m), 0.0)
    s2 = np.full(m, 6e-4)
    r = rng.normal(0.0, np.sqrt(k * k * v + tau * tau * w + s2))
    groups = np.repeat(np.arange(n_groups), -(-m // n_groups))[:m]
    meta = {"n_samples": 256, "n_angles": n_groups, "n_used_angles": n_groups, "noise_model": "homoscedastic"}
    return HeldoutRows(r, v, s2, groups, bias_weight=w, meta=meta)


@dataclasses.dataclass
class CalibrationCase:
    """One calibration method under test: its class, held-out ``rows`` with a known answer (their bootstrap set to
    the contract's :attr:`~CalibrationContract.n_bootstrap` and scored), the ``reconstruction`` ``(H, W)`` (mm⁻¹)
    whose std map it recalibrates, the ``truth`` (:meth:`~ctuq.calibration.CalibrationMethod.report` entries the fit
    must recover) and the relative ``tolerance`` of that recovery (state it from the rows' standard error). The
    rows' ``features`` (else the method's :meth:`~ctuq.calibration.CalibrationMethod.image_features` of the
    reconstruction) are the maps of its row-space check."""

    method: type[CalibrationMethod]
    rows: HeldoutRows
    reconstruction: np.ndarray
    truth: dict = dataclasses.field(default_factory=dict)
    tolerance: float = 0.1


class CalibrationContract:
    """The calibration-method contract: a subclass gives :meth:`make_case`; the checks are

    * the class facts (a registered name, a summary, report keys) and ``None`` from :meth:`fit` without rows for a
      method that changes the map;
    * the fit recovers the case's known answer within its tolerance, from the rows' arrays (an emptied report
      changes nothing); its entry in the check's report, if it has one, is JSON and sits under its
      ``heldout_report_key``;
    * :meth:`row_variance` and :meth:`apply_std` describe the same model: on a tiny problem with an explicit
      held-out matrix ``T_h`` and a posterior with independent pixels of std ``s``, rows with image variances
      ``(T_h∘T_h) s²``, bias weights ``(T_h∘T_h) M`` and feature weights ``(T_h∘T_h) f`` have ``row_variance − σ² =
      (T_h∘T_h) apply_std(s)²`` (1e-10 relative);
    * :meth:`apply_std` keeps the type (torch, numpy), shape and dtype, leaves its input alone, gives the same
      numbers from torch and numpy, and :meth:`apply_moments` agrees with it: the std of the applied moments is the
      applied std (1e-12 relative), the input moments unchanged;
    * the report is JSON-serialisable with keys :attr:`report_keys` (and so is the unfitted report), the label and
      the log line are one line each;
    * the state round trip (:meth:`~ctuq.calibration.CalibrationMethod.from_state` of the state) gives the same
      report and the same map, bitwise.
    """

    n_bootstrap: int = 0
    patch_sizes: tuple[int, ...] = (1, 2, 4)

    def make_case(self) -> CalibrationCase:
        """A :class:`CalibrationCase` (override)."""
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def fitted(cls):
        case = cls().make_case()
        case.rows.score(n_bootstrap=cls.n_bootstrap, seed=0)
        return case, case.method.fit(case.rows, case.reconstruction)

    @staticmethod
    def _std(shape, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.2) * 1e-3

    def test_class_facts(self, fitted):
        case, method = fitted
        cls = case.method
        assert cls.name and cls.summary and cls.report_keys
        assert CALIBRATIONS[cls.name] is cls
        assert isinstance(method, cls)
        if cls.changes_std:
            assert cls.fit(None, case.reconstruction) is None
            assert cls.summary_name() and set(cls.summary_fields) <= set(cls.report_keys)
            assert set(cls.parameters) <= set(cls.report_keys)

    def test_fit_recovers_the_known_answer(self, fitted):
        case, method = fitted
        rep = method.report()
        for key, value in case.truth.items():
            assert rep[key] == pytest.approx(value, rel=case.tolerance), (key, rep[key], value)
        # the method fits itself from the rows' arrays: the check's report is not what it reads
        blind = dataclasses.replace(case.rows, report={})
        assert case.method.fit(blind, case.reconstruction).report() == rep
        record = case.method.check_record(case.rows)
        if record is not None:
            assert case.method.heldout_report_key and case.rows.report[case.method.heldout_report_key] == record
            assert json.loads(json.dumps(record)) == record

    def test_row_variance_and_apply_std_describe_the_same_model(self, fitted):
        case, method = fitted
        shape = np.shape(case.reconstruction)
        rng = np.random.default_rng(5)
        m, d = 60, int(np.prod(shape))
        # a held-out matrix of a few rays: each row sees about a tenth of the pixels, with weights of either sign
        t2 = (rng.normal(size=(m, d)) * (rng.random((m, d)) < 0.1)) ** 2
        s = self._std(shape, seed=3).numpy()
        features = case.rows.features or case.method.image_features(np.asarray(case.reconstruction, np.float64))
        mask = object_mask(case.reconstruction)
        noise = np.linspace(0.5, 1.5, m) * 1e-7
        rows = HeldoutRows(
            rng.normal(size=m),
            t2 @ (s**2).ravel(),
            noise,
            np.arange(m) // 6,
            bias_weight=t2 @ mask.ravel(),
            features=features,
            feature_weights={name: t2 @ np.asarray(f, np.float64).ravel() for name, f in features.items()},
        )
        got = np.asarray(method.row_variance(rows), np.float64)
        assert got.shape == (m,) and got.dtype == np.float64
        want = t2 @ (np.asarray(method.apply_std(s), np.float64) ** 2).ravel()
        np.testing.assert_allclose(got - noise, want, rtol=1e-10, atol=0)

    def test_apply_std_keeps_type_dtype_and_input(self, fitted):
        case, method = fitted
        shape = np.shape(case.reconstruction)
        std = self._std(shape)
        for x in (std, std.float(), std.numpy(), std.float().numpy()):
            before = x.clone() if isinstance(x, torch.Tensor) else x.copy()
            out = method.apply_std(x)
            assert type(out) is type(x) and tuple(out.shape) == shape and out.dtype == x.dtype
            assert torch.equal(x, before) if isinstance(x, torch.Tensor) else np.array_equal(x, before)
            assert np.all(np.isfinite(np.asarray(out))) and np.all(np.asarray(out) >= 0)
        assert np.array_equal(method.apply_std(std).numpy(), method.apply_std(std.numpy()))

    def test_apply_moments_agrees_with_apply_std(self, fitted):
        case, method = fitted
        shape = np.shape(case.reconstruction)
        g = torch.Generator().manual_seed(1)
        moments = SampleMoments(shape, patch_sizes=self.patch_sizes)
        moments.update(torch.randn(40, *shape, generator=g, dtype=torch.float64) * self._std(shape))
        before = moments.state_dict()
        out = method.apply_moments(moments)
        assert out.n_samples == moments.n_samples and out.image_shape == moments.image_shape
        torch.testing.assert_close(out.std(), method.apply_std(moments.std()), rtol=1e-12, atol=0)
        after = moments.state_dict()
        assert torch.equal(after["sum_sq"], before["sum_sq"])
        assert all(torch.equal(after["patch_sums"][p], t) for p, t in before["patch_sums"].items())

    def test_report_label_and_log_line(self, fitted):
        case, method = fitted
        rep = method.report()
        assert tuple(rep) == case.method.report_keys
        assert json.loads(json.dumps(rep)) == rep
        assert tuple(case.method.unfitted_report()) == case.method.report_keys
        assert json.loads(json.dumps(method.summary_record())) == method.summary_record()
        for text in (method.label(), method.label(applied=False), method.log_line()):
            assert isinstance(text, str) and text and "\n" not in text
        if case.method.changes_std:
            assert method.label(applied=False) != method.label()

    def test_state_round_trip(self, fitted):
        case, method = fitted
        again = case.method.from_state(method.state_dict())
        assert again.report() == method.report()
        std = self._std(np.shape(case.reconstruction), seed=2)
        assert torch.equal(again.apply_std(std), method.apply_std(std))
