"""Linearised Laplace on scikit-learn's digits in one minute: train (or load) a small classifier, put ctuq's
all-weights linearised Laplace on it, and compare it with the network's own (MAP) predictions.

    python scripts/classify_digits.py                    # MLP (~9k weights); figures in runs/classify_digits/
    python scripts/classify_digits.py --model cnn        # CNN with batch norm (~31k weights)

Prints a table (test NLL, accuracy, ECE, Brier, joint log-likelihood of κ-tuples) and writes two figures:
``reliability.png`` (reliability diagrams, 15 bins) and ``shift.png`` (NLL and ECE on rotated and noised digits
against the severity of the shift). Needs scikit-learn (``pip install 'ctuq[bench]'``); no downloads.

The library calls it makes, for a model and a DataLoader of your own::

    la = LinearizedLaplace(model, prior="gprior")       # all weights, g-prior
    la.fit(train_loader)
    la.optimize_prior(method="sampled_em")              # MacKay EM for the prior precision
    probs = la.predict(x, link="probit", samples=64)
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
from ctuq.classify.predictive import link_probabilities  # noqa: E402
from ctuq.metrics import reliability_diagram  # noqa: E402
from ctuq.studies.classification import SHIFTS, load_dataset, make_model, metric_row, shifted_inputs, train_map  # noqa: E402
from ctuq.utils import atomic_path, tune_malloc  # noqa: E402


def _figure(ncols, width=4.2, height=3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _save(fig, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return path


def plot_reliability(path, curves: dict, labels) -> Path:
    fig, axes = _figure(len(curves))
    for ax, (name, probs) in zip(axes, curves.items()):
        d = reliability_diagram(probs, labels)
        centres = 0.5 * (d["edges"][1:] + d["edges"][:-1])
        ok = d["count"] > 0
        ax.bar(centres[ok], d["accuracy"][ok], width=1 / 15, edgecolor="k", alpha=0.7, label="accuracy")
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
        ax.plot(d["confidence"][ok], d["accuracy"][ok], "o", ms=3, color="C3", label="mean confidence")
        ax.set(title=name, xlabel="confidence (top class)", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1))
        ax.legend(fontsize=7, loc="upper left")
    return _save(fig, path)


def plot_shift(path, table: dict, shifts: dict) -> Path:
    kinds = list(shifts)
    fig, axes = _figure(2 * len(kinds))
    for i, kind in enumerate(kinds):
        for j, metric in enumerate(("nll", "ece")):
            ax = axes[2 * i + j]
            for name, rows in table.items():
                ax.plot(shifts[kind], [rows[(kind, s)][metric] for s in shifts[kind]], "o-", ms=3, label=name)
            unit = {"rotation": "degrees", "noise": "noise std", "blur": "Gaussian σ, pixels"}.get(kind, "severity")
            ax.set(title=f"{metric.upper()} vs {kind}", xlabel=f"{kind} ({unit})", ylabel=metric.upper())
            ax.legend(fontsize=7)
    return _save(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    ap.add_argument("--out", default="runs/classify_digits")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d = load_dataset("digits", seed=args.seed)
    model = make_model(args.model, "digits", seed=args.seed)
    cache = out / f"digits_{args.model}_seed{args.seed}_ep{args.epochs}.pt"
    if cache.exists():
        model.load_state_dict(torch.load(cache, weights_only=True))
        model.eval()
        print(f"loaded the trained {args.model} from {cache}")
    else:
        model, secs = train_map(model, d["X"], d["y"], epochs=args.epochs, seed=args.seed)
        torch.save(model.state_dict(), cache)
        print(f"trained the {args.model} ({sum(p.numel() for p in model.parameters())} weights) in {secs:.0f} s")

    t0 = time.perf_counter()
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(d["X"], d["y"]), batch_size=128)
    la = LinearizedLaplace(model, prior="gprior", seed=args.seed, solver="cg").fit(train)
    la.optimize_prior(method="sampled_em", max_steps=5, n_samples=16, tol=0.0)
    f, Z = la.logit_deviations(d["Xt"], args.samples, seed=args.seed)
    secs = time.perf_counter() - t0
    print(
        f"linearised Laplace (d = {la.n_params}, solver {la.posterior.solver_name}): a = {la.prior_precision:.4g} "
        f"after {len(la.em_trace)} EM steps, {secs:.1f} s in all; training labels the network fits and the "
        f"linearised model's mode does not: {la.overfit_fraction:.2%} (an OverfitWarning above 1 %)"
    )

    with torch.no_grad():
        map_probs = torch.softmax(model(d["Xt"]).double(), -1)
    methods = {
        "MAP": (map_probs, None),
        "ctuq MC": (link_probabilities(f, Z, "mc"), f[None] + Z),
        "ctuq probit": (link_probabilities(f, Z, "probit"), f[None] + Z),
    }
    print("\n| method | NLL | accuracy | ECE | Brier | joint LL κ=1 | κ=10 |\n|---|---|---|---|---|---|---|")
    for name, (p, logits) in methods.items():
        r = metric_row(p, d["yt"], logits, kappas=[1, 10], seed=args.seed)
        print(
            f"| {name} | {r['nll']:.3f} | {r['accuracy']:.3f} | {r['ece']:.3f} | {r['brier']:.3f} | "
            f"{r['joint_ll'][1]:.3f} | {r['joint_ll'][10]:.3f} |"
        )

    shifts = SHIFTS["digits"]
    table = {name: {} for name in methods}
    for kind, severities in shifts.items():
        for sev in severities:
            X = shifted_inputs("digits", d["Xt"], kind, sev, seed=17)
            fs, Zs = la.logit_deviations(X, args.samples, seed=args.seed)
            with torch.no_grad():
                pm = torch.softmax(model(X).double(), -1)
            for name, p in (
                ("MAP", pm),
                ("ctuq MC", link_probabilities(fs, Zs, "mc")),
                ("ctuq probit", link_probabilities(fs, Zs, "probit")),
            ):
                table[name][(kind, sev)] = metric_row(p, d["yt"], kappas=[1])
    print(
        "\nNLL under shift: "
        + "; ".join(
            f"{kind} {sev}: " + ", ".join(f"{n} {table[n][(kind, sev)]['nll']:.2f}" for n in table)
            for kind in shifts
            for sev in shifts[kind][1::2]
        )
    )
    p1 = plot_reliability(out / "reliability.png", {n: p for n, (p, _) in methods.items()}, d["yt"])
    p2 = plot_shift(out / "shift.png", table, shifts)
    print(f"\nfigures: {p1}, {p2}")


if __name__ == "__main__":
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    main()
