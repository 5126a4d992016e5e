"""Contract tests shipped with ctuq: one test base class per extensible abstraction, one module per contract.

As linear_operator ships ``LinearOperatorTestCase``, ctuq ships the checks every implementation must pass; a test
module subclasses a contract and gives only a factory (and, where needed, tolerances)::

    from ctuq.testing import FeatureContract, SolverContract

    class TestMySolver(SolverContract):
        registry_name = "my_solver"          # enables the posterior-level checks (needs registration)
        options = {"tol": 1e-12}             # its constructor options

    class TestMyFeatures(FeatureContract):
        def make_features(self):
            return MyFeatures(...), dense_float64_matrix

The contracts, each listing its checks in its module's or its class's docstring: :class:`SolverContract`
(:mod:`ctuq.testing.solver`), :class:`FeatureContract` (:mod:`ctuq.testing.features`), :class:`PriorContract`
(:mod:`ctuq.testing.prior`), :class:`LikelihoodContract` (:mod:`ctuq.testing.likelihood`),
:class:`CalibrationContract` (:mod:`ctuq.testing.calibration`), :class:`ScanFormatContract`
(:mod:`ctuq.testing.scan_format`) and :class:`RayTransformContract` (:mod:`ctuq.testing.ray_transform`);
``ctuq.testing._common`` holds what several of them share (:func:`contract_problem`, the seeded dense problem).

This package imports pytest: it is for test suites, and nothing in ctuq imports it (``tests/test_import_graph.py``
checks that).
"""

from ._common import contract_problem
from .calibration import CalibrationCase, CalibrationContract, synthetic_heldout_rows
from .features import FeatureContract
from .likelihood import LikelihoodCase, LikelihoodContract
from .prior import PriorCase, PriorContract
from .ray_transform import GEOMETRY_KINDS, RayTransformContract, contract_geometries
from .scan_format import Damage, ScanFormatCase, ScanFormatContract, small_scan_content
from .solver import SolverCase, SolverContract

__all__ = [
    "SolverCase",
    "SolverContract",
    "FeatureContract",
    "contract_problem",
    "LikelihoodCase",
    "LikelihoodContract",
    "CalibrationCase",
    "CalibrationContract",
    "synthetic_heldout_rows",
    "PriorCase",
    "PriorContract",
    "GEOMETRY_KINDS",
    "contract_geometries",
    "RayTransformContract",
    "Damage",
    "ScanFormatCase",
    "ScanFormatContract",
    "small_scan_content",
]
