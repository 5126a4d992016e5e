"""Benchmark: ELLA's approximation error against the exact linearised predictive, as its rank K and landmarks M grow.

What it reproduces: the K × M tables of docs/classification.md (ELLA, issue 46).

For one benchmark network (``--dataset``, ``--model``, MAP trained with ``scripts/benchmark_classification.py``'s
recipes and cached under the same name in ``--out``) it builds the linearised model with the softmax Hessians at the
network (``hessian_at="network"``, the paper's), the g-prior scales (ridge δ = 1) and a fixed prior precision ``--a``,
then compares, on the test inputs, the logit covariance of ELLA's posterior in ``K`` dimensions (the basis of
``ctuq.inference.nystrom_basis`` from ``M`` landmark rows, seed 0) with the exact one of all ``d`` weights. The exact
covariance is computed in the primal (``d × d``) where ``d ≤ n·C`` and otherwise in the dual (``n·C × n·C``, so it
fits memory for the CNNs too):

    Σ_logits(x) = G(x) Σ G(x)ᵀ,  Σ = (ΨᵀΨ + a I)⁻¹ = (I − Ψᵀ (ΨΨᵀ + a I)⁻¹ Ψ) / a,

with ``Ψ = Ψ₀ diag(s)`` the scaled training features and ``G(x) = J(x) diag(s)``; ELLA's is
``G V (VᵀΨᵀΨV + a I)⁻¹ Vᵀ Gᵀ``. Both are centred per input (``P Σ P``, ``P = I − 11ᵀ/C``: a uniform shift of all
logits changes no probability). Printed per (K, M): the mean relative error of the centred logit variances, the
fraction of the exact centred variance ELLA keeps (mean over inputs of the trace ratio), and the probit NLL of both
predictives on the test set.

    python scripts/benchmark_ella.py --dataset digits --model mlp --a 156
    python scripts/benchmark_ella.py --dataset digits --model cnn --a 43251 --ranks 5 10 20 50 100 \
        --landmarks 500 1000 2000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ctuq.classify import LinearizedLaplace  # noqa: E402
from ctuq.classify.jacobians import assemble_jacobian  # noqa: E402
from ctuq.inference import DenseFeatures, nystrom_basis  # noqa: E402
from ctuq.metrics.classification import nll  # noqa: E402
from ctuq.studies.classification import DATASETS, MODELS, load_dataset, make_model, train_map  # noqa: E402
from ctuq.utils import atomic_torch_save  # noqa: E402


def network(args, d):
    """The MAP network of ``scripts/benchmark_classification.py`` (its cache file name and recipe)."""
    model = make_model(args.model, args.dataset, seed=args.seed)
    tag = "_issue" if args.recipe == "issue" else ""
    path = Path(args.out) / f"{args.dataset}_{args.model}_seed{args.seed}_ep{args.epochs}{tag}.pt"
    if path.exists():
        model.load_state_dict(torch.load(path, weights_only=True))
        return model.eval(), path
    lr, adam_wd = (1e-2, 1e-4) if args.recipe == "issue" else (1e-3, 0.0)
    model, _ = train_map(model, d["X"], d["y"], epochs=args.epochs, lr=lr, seed=args.seed, adam_weight_decay=adam_wd)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(path, model.state_dict())
    return model, path


def centred(cov: torch.Tensor) -> torch.Tensor:
    """``P Σ P`` per input, ``cov`` ``(N, C, C)``."""
    C = cov.shape[-1]
    P = torch.eye(C, dtype=cov.dtype) - 1.0 / C
    return P @ cov @ P


def per_input(G: torch.Tensor, H: torch.Tensor, C: int) -> torch.Tensor:
    """``(N, C, C)`` blocks ``G_i H_iᵀ`` of rows ``G``, ``H`` ``(N·C, ·)``."""
    return torch.einsum("nad,nbd->nab", G.reshape(-1, C, G.shape[1]), H.reshape(-1, C, H.shape[1]))


def probit_nll(f: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> float:
    return nll(torch.softmax(f / torch.sqrt(1.0 + torch.pi / 8.0 * var), -1), y)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dataset", default="digits", choices=DATASETS)
    ap.add_argument("--model", default="mlp", choices=MODELS)
    ap.add_argument("--recipe", choices=["bench", "issue"], default="bench")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/classification", help="folder of the cached MAP networks")
    ap.add_argument("--a", type=float, default=100.0, help="the g-prior's precision a (the benchmark's EM value)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[5, 10, 20, 50, 100, 200])
    ap.add_argument("--landmarks", type=int, nargs="+", default=[250, 500, 1000, 2000, 4000])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not (args.a > 0) or min(args.ranks) < 1 or min(args.landmarks) < 1:
        ap.error(f"--a must be > 0 and --ranks, --landmarks >= 1, got {args.a}, {args.ranks}, {args.landmarks}")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("CTUQ_NO_PROGRESS", "1")
    d = load_dataset(args.dataset, seed=args.seed)
    model, path = network(args, d)
    t0 = time.perf_counter()
    la = LinearizedLaplace(
        model, hessian_at="network", prior_precision=args.a, solver="cg", dense_features="always", seed=args.seed
    )
    la.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(d["X"], d["y"]), batch_size=256))
    s = la.scales
    Psi = la.posterior.features.to_dense().double() * s  # Ψ = Ψ₀ diag(s), (n·C, d)
    la = None  # the exact route's posterior is not needed past its features
    G = assemble_jacobian(model.double(), d["Xt"].double(), [n for n, _ in model.named_parameters()]).double() * s
    C = 10
    c, dim = Psi.shape
    print(
        f"{args.dataset}/{args.model} ({path.name}): d = {dim}, n·C = {c}, test inputs {d['Xt'].shape[0]}, a = "
        f"{args.a:g}; Ψ and G(x): {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    t0 = time.perf_counter()
    if dim <= c:  # primal: Σ = L⁻ᵀL⁻¹ with L Lᵀ = ΨᵀΨ + a I (d × d)
        A = Psi.T @ Psi
        A.diagonal().add_(args.a)
        R = torch.linalg.solve_triangular(torch.linalg.cholesky(A), G.T, upper=False)  # L⁻¹ Gᵀ, (d, N·C)
        A = None
        exact = centred(per_input(R.T, R.T, C))
    else:  # dual (module docstring): n·C × n·C
        K = Psi @ Psi.T
        K.diagonal().add_(args.a)
        L = torch.linalg.cholesky(K)
        K = None
        R = torch.linalg.solve_triangular(L, Psi @ G.T, upper=False)  # L⁻¹ Ψ Gᵀ, (n·C, N·C)
        L = None
        exact = centred((per_input(G, G, C) - per_input(R.T, R.T, C)) / args.a)
    R = None
    ex_var = exact.diagonal(dim1=1, dim2=2)
    with torch.no_grad():
        f = model(d["Xt"].double()).double()
    side = "primal" if dim <= c else "dual"
    exact_nll = probit_nll(f, ex_var, d["yt"])
    print(f"exact covariance ({side}): {time.perf_counter() - t0:.1f} s; probit NLL {exact_nll:.4f}", flush=True)
    rows = {}
    for m in args.landmarks:
        for k in args.ranks:
            if k > min(m, c):
                continue
            t0 = time.perf_counter()
            try:
                b = nystrom_basis(DenseFeatures(Psi), min(m, c), k, seed=args.seed)
            except ValueError as exc:
                print(f"  M {m}, K {k}: {exc}")
                continue
            Phi = Psi @ b.V
            A = Phi.T @ Phi
            A.diagonal().add_(args.a)
            GV = G @ b.V
            var = centred(per_input(GV, torch.linalg.solve(A, GV.T).T, C)).diagonal(dim1=1, dim2=2)
            err = float(((var - ex_var).abs() / ex_var.clamp_min(1e-300)).mean())
            kept = float((var.sum(1) / ex_var.sum(1)).mean())
            rows[(k, m)] = (err, kept, probit_nll(f, var, d["yt"]))
            print(
                f"  M {m}, K {k}: variance error {err:.3f}, variance kept {kept:.3f}, probit NLL {rows[(k, m)][2]:.4f}"
                f" ({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
    ms = [m for m in args.landmarks if any((k, m) in rows for k in args.ranks)]
    for title, i, digits in (("mean relative error of the centred logit variances", 0, 3), ("probit NLL", 2, 4)):
        print(f"\n{title} ({args.dataset}/{args.model}, a = {args.a:g}; rows K, columns M)\n")
        print("| K | " + " | ".join(f"M {m}" for m in ms) + " |")
        print("|---|" + "---|" * len(ms))
        for k in args.ranks:
            cells = [f"{rows[(k, m)][i]:.{digits}f}" if (k, m) in rows else "—" for m in ms]
            print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
