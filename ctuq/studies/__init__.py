"""Studies: scripted comparisons that run ctuq's methods over a grid of settings and tabulate the results.

A *study* in ctuq is a resumable experiment driven by a thin command-line script in ``scripts/``: it takes one
scan, a list of settings (e.g. angle counts) and a set of methods, and writes everything into one study folder:
``OUT/study.json`` with its options (one frozen dataclass, :mod:`ctuq.studies.study_options`), the run folders of
its fits and inferences (made by the public API, :func:`ctuq.reconstruct` / :func:`ctuq.uncertainty` with
``resume=True, reuse=True``, so a rerun loads what finished and continues what was interrupted), then tables and
figures. A rerun with options that change the numbers is refused, so a folder always holds one study.

This package holds the reusable machinery, so that a new study (e.g. an experimental-design study) is its own
module of methods and tables on top of the shared pieces:

* :mod:`ctuq.studies.common`: what every study needs: the study-folder check (:func:`study_fingerprint`,
  :func:`check_study_folder`), :class:`StudyError`, :class:`Log`, :func:`read_json`, scan preparation
  (:func:`prepare_scan`, :func:`angular_subsampling`) and :func:`exact_decision`.
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
    "prepare_scan",
    "read_json",
    "setting_dir",
    "study_fingerprint",
]
