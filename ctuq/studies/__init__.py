"""Studies: scripted comparisons that run ctuq's methods over a grid of settings and tabulate the results.

A *study* in ctuq is a resumable experiment driven by a thin command-line script in ``scripts/``: it takes one
scan, a list of settings (e.g. angle counts) and a set of methods, writes everything into one study folder
(``OUT/study.json`` with the options, per setting ``OUT/angles_<N>/`` with the fitted networks and per method a
``metrics.json`` + ``result.pt``, then tables and figures), and skips on a rerun whatever an earlier run
finished. A rerun with options that change the numbers is refused, so a folder always holds one study.

This package holds the reusable machinery, so that a new study (e.g. an experimental-design study) is its own
module of methods and tables on top of the shared pieces:

* :mod:`ctuq.studies.common`: what every study needs: the study-folder check (:func:`study_fingerprint`,
  :func:`check_study_folder`), :class:`StudyError`, :class:`Log`, :func:`read_json`, scan preparation
  (:func:`prepare_scan`, :func:`angular_subsampling`), :func:`exact_decision`, the DIP fit or reload
  (:func:`fit_or_load_dip`, stored through :mod:`ctuq.models.model_file`) and the per-method bookkeeping
  (:func:`method_done`, :func:`finish_method`).
* :mod:`ctuq.studies.walnut`: the walnut uncertainty study (linearised DIP inference against MC dropout) behind
  ``scripts/walnut_study.py``.
"""

from ctuq.studies.common import (
    NEUTRAL_OPTIONS,
    Log,
    StudyError,
    angular_subsampling,
    check_study_folder,
    exact_decision,
    finish_method,
    fit_or_load_dip,
    method_done,
    prepare_scan,
    read_json,
    setting_dir,
    study_fingerprint,
)

__all__ = [
    "NEUTRAL_OPTIONS",
    "Log",
    "StudyError",
    "angular_subsampling",
    "check_study_folder",
    "exact_decision",
    "finish_method",
    "fit_or_load_dip",
    "method_done",
    "prepare_scan",
    "read_json",
    "setting_dir",
    "study_fingerprint",
]
