"""Acceptance: a solver defined here and registered in one line is available through ``LinearizedPosterior``, the
config (``uq.solver``) and the ``ctuq uq`` command, and passes the solver contract."""

import json
import shutil

import numpy as np
import pytest
import torch
from tiny import sets

from ctuq.cli import main
from ctuq.config import ConfigError, UQConfig, check_section, load_config
from ctuq.inference import (
    GaussianLikelihood,
    LinearizedPosterior,
    Solver,
    SolveStats,
    assemble_kernel,
    check_hyper,
    check_rhs,
    relative_residual,
    solver_choices,
)
from ctuq.registry import SOLVERS
from ctuq.testing import SolverContract, contract_problem


class ToyCholesky(Solver):
    """Dense Cholesky of ``C = K̄/a + σ²I`` from the assembled kernel (``c`` VJPs once)."""

    name = "toy_cholesky"
    summary = "dense Cholesky of C from the assembled K̄ (a test solver)"

    def __init__(self, features, *, jitter: float = 0.0):
        super().__init__(features)
        self.jitter = float(jitter)
        self._K = None

    def setup(self, a, sigma2):
        if self._K is None:
            self._K = assemble_kernel(self.features)

    def state_dict(self):
        return None if self._K is None else {"K": self._K.cpu()}

    def load_state_dict(self, state):
        if state is not None:
            self._K = state["K"].to(self.features.device)

    def solve(self, rhs, a, sigma2, *, x0=None):
        rhs = check_rhs(rhs, self.features, "ToyCholesky.solve")
        a_f, s2_f = check_hyper(a, sigma2, "ToyCholesky.solve")
        self.setup(a_f, s2_f)
        C = self._K / a_f + (s2_f + self.jitter) * torch.eye(self._K.shape[0], dtype=torch.float64)
        b = rhs.double()
        X = torch.cholesky_solve(b.T, torch.linalg.cholesky(C)).T
        k = rhs.shape[0]
        rel = relative_residual(X @ C - b, torch.linalg.vector_norm(b, dim=1))
        stats = SolveStats(torch.zeros(k, dtype=torch.long), rel, torch.ones(k, dtype=torch.bool), 0, "cholesky")
        return X.to(rhs.dtype), stats


@pytest.fixture(autouse=True, scope="module")
def toy_registered():
    SOLVERS.register(ToyCholesky)  # the one registry line
    yield
    SOLVERS.unregister("toy_cholesky")


class TestToyCholeskyContract(SolverContract):
    registry_name = "toy_cholesky"


def test_the_posterior_builds_it_by_name():
    feats, Psi, y = contract_problem()
    post = LinearizedPosterior(
        feats,
        y,
        prior="isotropic",
        likelihood=GaussianLikelihood(0.5),
        a=2.0,
        solver="toy_cholesky",
        solver_options={"toy_cholesky": {"jitter": 0.0}},
    ).setup()
    assert isinstance(post.solver, ToyCholesky) and post.solver_name == "toy_cholesky"
    P, yy = Psi.numpy(), y.numpy()
    w_ref = np.linalg.solve(P.T @ P / 0.5 + 2.0 * np.eye(P.shape[1]), P.T @ yy / 0.5)
    np.testing.assert_allclose(post.mean().numpy(), w_ref, rtol=1e-9, atol=1e-12)
    post.fit(max_steps=2, n_samples=8)  # sampled EM through it
    with pytest.raises(ValueError, match=r"unknown toy_cholesky option\(s\) \['tol'\]"):
        LinearizedPosterior(feats, y, solver="toy_cholesky", solver_options={"toy_cholesky": {"tol": 1.0}})


def test_the_config_reads_the_registry_when_it_validates():
    assert "toy_cholesky" in solver_choices()
    cfg = load_config(None, ["uq.solver=toy_cholesky", "uq.toy_cholesky.jitter=1e-9"])
    assert cfg.uq.solver == "toy_cholesky" and cfg.uq.toy_cholesky.jitter == 1e-9  # its options: a config section
    check_section(UQConfig(solver="toy_cholesky"), "uq")
    with pytest.raises(ConfigError, match=r"uq.solver must be one of \[.*'toy_cholesky'\], got 'toy_qr'"):
        load_config(None, ["uq.solver=toy_qr"])
    with pytest.raises(ConfigError, match=r"uq.toy_cholesky.jitter must be a number, got 'big'"):
        load_config(None, ["uq.toy_cholesky.jitter=big"])


# ------------------------------------------------------------------------------------------------ the command
@pytest.mark.slow
def test_the_uq_command_runs_it(tiny_run_none, tmp_path):
    run = shutil.copytree(tiny_run_none, tmp_path / "run")
    toy = ("uq.solver=toy_cholesky", "uq.toy_cholesky.jitter=0.0", "uq.samples=8", "uq.sample_chunk=8")
    cheap = ("uq.em_steps=1", "uq.em_samples=2", "uq.gprior.method=stochastic", "uq.gprior.probes=8")
    assert main(["uq", str(run), *sets(*toy, *cheap), "--no-progress"]) == 0
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["uq"]["solver"] == metrics["uq"]["stats"]["route"] == "toy_cholesky"
    assert metrics["uq"]["n_samples"] == 8
    assert metrics["config"]["uq"]["solver"] == "toy_cholesky"
    assert metrics["config"]["uq"]["toy_cholesky"] == {"jitter": 0.0}
