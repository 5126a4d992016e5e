"""Shared pieces of the inference benchmarks (``benchmark_inference.py``, ``benchmark_solvers.py``,
``benchmark_cg.py``): the synthetic problem, its command-line options and table printing.

The synthetic problem stands in for a CT problem whose cost is that of the inference: a U-Net from
``ctuq.models.build_unet`` (preset ``tiny``/``small``/``walnut``, random weights) at ``--size``² with its fixed noise
input, and a sparse linear map ``T`` (``c × size²``) in place of the ray transform. ``--map lines`` (default)
samples parallel-beam lines through the image at nearest pixels (``c = angles × detectors`` with ``--detectors``
bins; about ``1.2·size`` pixels per row, like a real ray transform); ``--map random`` puts the same number of
non-zeros at random positions. The targets ``ỹ`` are drawn from the linear model itself (``--target prior``:
``ỹ = Ψ w + ε``, ``w ~ N(0, I/a_true)``, ``ε ~ N(0, noise_std²)``), so that EM settles near ``a_true`` and the CG
iteration counts reflect that regime (they grow as ``a`` falls: ``C = K̄/a + σ²I`` then has more eigenvalues above
``σ²`` than a rank-``r`` preconditioner captures); ``--target network`` uses ``T g(ṽ) + ε`` of the untrained
network instead (EM then drives ``a`` far down: a hard, unrealistic regime).
"""

from __future__ import annotations

import argparse
import math
import warnings

import numpy as np
import torch

from ctuq.inference import LinearizedFeatures, ScaledFeatures, gprior_scales
from ctuq.linearize import LinearizedNetwork
from ctuq.models import build_unet, make_net_input


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that wall times cover it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------- synthetic T
def line_matrix(size: int, n_angles: int, n_det: int, kind: str = "lines", seed: int = 0) -> torch.Tensor:
    """Sparse ``(n_angles·n_det, size²)`` float32 COO matrix: parallel-beam lines or random positions.

    Lines: angle ``θ_a`` uniform in [0, π), detector offsets spanning 1.2× the image width, points every half
    pixel along each line, nearest-pixel weights of 0.5 (pixel units), duplicates summed. Rows are angle-major.
    """
    n = size
    thetas = np.linspace(0, np.pi, n_angles, endpoint=False)
    offsets = (np.arange(n_det) - (n_det - 1) / 2) * (1.2 * n / n_det)
    half = 0.75 * n
    steps = np.arange(-half, half, 0.5)
    rows, cols = [], []
    for a, th in enumerate(thetas):
        d, p = np.array([np.cos(th), np.sin(th)]), np.array([-np.sin(th), np.cos(th)])
        pts = offsets[:, None, None] * p + steps[None, :, None] * d  # (n_det, steps, 2), centre at 0
        ix = np.floor(pts[..., 0] + n / 2).astype(np.int64)
        iy = np.floor(pts[..., 1] + n / 2).astype(np.int64)
        inside = (ix >= 0) & (ix < n) & (iy >= 0) & (iy < n)
        det = np.broadcast_to(np.arange(n_det)[:, None], ix.shape)
        rows.append((a * n_det + det)[inside])
        cols.append((iy * n + ix)[inside])
    r = np.concatenate(rows)
    c = np.concatenate(cols)
    if kind == "random":
        rng = np.random.default_rng(seed)
        c = rng.integers(0, n * n, size=c.size)
    elif kind != "lines":
        raise ValueError(f"line_matrix: kind must be 'lines' or 'random', got {kind!r}")
    vals = np.full(r.size, 0.5, dtype=np.float32)
    T = torch.sparse_coo_tensor(
        torch.from_numpy(np.stack([r, c])), torch.from_numpy(vals), (n_angles * n_det, n * n), check_invariants=True
    )
    return T.coalesce()


class SparseMap:
    """``L(X) = X Tᵀ`` and ``Lᵀ(R) = R T`` on rows, with CSR copies of ``T`` and ``Tᵀ`` on ``device``."""

    def __init__(self, T_coo: torch.Tensor, device: torch.device):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            self.T = T_coo.to_sparse_csr().to(device)
            self.Tt = T_coo.t().coalesce().to_sparse_csr().to(device)
        self.c, self.d_x = T_coo.shape

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return (self.T @ X.T).T

    def adjoint(self, R: torch.Tensor) -> torch.Tensor:
        return (self.Tt @ R.T).T


# ----------------------------------------------------------------------------------------------- problem
def build_problem(args, device: torch.device):
    """``(model, net input, T)`` of the synthetic problem: a random-weight U-Net and a :class:`SparseMap`."""
    torch.manual_seed(args.seed)
    model = build_unet(args.preset).to(device)
    x = make_net_input((args.size, args.size), seed=args.seed).to(device)
    n_det = args.detectors
    if args.c % n_det:
        raise SystemExit(f"--c {args.c} must be a multiple of --detectors {n_det} (angles × detectors)")
    T = SparseMap(line_matrix(args.size, args.c // n_det, n_det, args.map, args.seed), device)
    return model, x, T


def make_targets(args, feats, net, T, device) -> torch.Tensor:
    """``ỹ``: a draw from the linear model's prior predictive at ``--a-true`` (1 JVP), or ``T g(ṽ)`` + noise."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    eps = args.noise_std * torch.randn(T.c, generator=gen).to(device)
    if args.target == "prior":
        w = torch.randn(1, feats.n_features, generator=gen).to(device) / math.sqrt(args.a_true)
        return feats.matvec(w)[0] + eps
    with torch.no_grad():
        return T.forward(net.output()[None])[0] + eps


def gprior_features(args, net: LinearizedNetwork, T: SparseMap, device: torch.device, progress: bool = False):
    """``(Ψ = T Φ diag(s), s)``: the g-prior scales ``s`` (``--gprior``, ``--gprior-probes``) and the scaled
    features of the synthetic problem."""
    s = gprior_scales(
        lambda R: net.vjp(T.adjoint(R)),
        T.c,
        method=args.gprior,
        n_probes=args.gprior_probes,
        n_features=net.d,
        seed=args.seed,
        device=device,
        progress=progress,
    )
    return ScaledFeatures(LinearizedFeatures(net, T.forward, T.adjoint, n_outputs=T.c), s), s


def add_problem_arguments(ap: argparse.ArgumentParser, preset: str = "small") -> None:
    """The options of the synthetic problem and of the run environment, shared by every benchmark."""
    g = ap.add_argument_group("synthetic problem")
    g.add_argument("--preset", default=preset, choices=("tiny", "small", "walnut"))
    g.add_argument("--size", type=int, default=128, help="image size (pixels per side)")
    g.add_argument("--c", type=int, default=7680, help="number of measurements (angles × detectors)")
    g.add_argument("--detectors", type=int, default=128, help="detector bins per angle")
    g.add_argument("--map", default="lines", choices=("lines", "random"), help="structure of the sparse map T")
    g.add_argument("--gprior", default="stochastic", choices=("exact", "stochastic", "isotropic"))
    g.add_argument("--gprior-probes", type=int, default=256)
    g.add_argument("--a0", type=float, default=1.0, help="initial prior precision")
    g.add_argument("--sigma2", type=float, default=1.0, help="noise variance")
    g.add_argument("--noise-std", type=float, default=1.0, help="std of the synthetic measurement noise")
    g.add_argument(
        "--target",
        default="prior",
        choices=("prior", "network"),
        help="ỹ = Ψw + ε with w ~ N(0, I/a_true) (prior), or T g(ṽ) + ε for the untrained network",
    )
    g.add_argument(
        "--a-true", type=float, default=1.0, help="prior precision of the synthetic weights (--target prior)"
    )
    g.add_argument("--chunk-size", type=int, default=None, help="vmap chunk size (default: automatic)")
    g.add_argument("--mode", default="linearize", choices=("linearize", "recompute"))
    g = ap.add_argument_group("environment")
    g.add_argument("--device", default="cpu")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--seed", type=int, default=0)


def apply_threads(args) -> None:
    """``--threads``: the torch CPU thread count (left alone without it)."""
    if args.threads:
        torch.set_num_threads(args.threads)


def print_table(head, rows) -> None:
    """Print ``rows`` under ``head``, left-aligned columns, a dashed rule under the header."""
    cells = [tuple(map(str, head))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for j, r in enumerate(cells):
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
