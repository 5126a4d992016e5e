"""Benchmark: all-weights linearised Laplace with ctuq against MAP and laplace-torch 0.3, on offline data.

For each data set (scikit-learn digits; MNIST-1D from its offline generator) and model (MLP ~9k weights; CNN with
batch norm ~31-34k weights) it trains the MAP network (Adam, 200 epochs, seed 0; cached in ``--out``), then
evaluates side by side

* MAP;
* ctuq, sampled EM: CG solver, ``--em-steps`` MacKay steps with ``--em-samples`` posterior samples each, then
  ``--samples`` posterior samples for prediction (MC and probit links);
* ctuq, exact EM: dense exact solver, EM to ``|Δa|/a < 1e-4``, where ``Ψ₀`` fits memory (``--exact``);
* laplace-torch 0.3 if importable: last-layer KFAC, all-weights diag, all-weights KFAC, all-weights full GGN, each
  with ``optimize_prior_precision(method="marglik")`` and probit / MC predictives, each in a subprocess limited to
  ``--lt-timeout`` seconds;

on the test set (NLL, accuracy, ECE with 15 bins, Brier, κ-tuple joint log-likelihood κ = 1…10 with dyadic
sampling, wall time) and along distribution shifts (rotated / noised digits, noised MNIST-1D; NLL and ECE). For
the exact-tractable cases it also reports the fidelity of the sampled method to the exact one (ratio of the prior
precisions, symmetrised KL between the two MC predictives). Prints markdown tables; writes ``results.json``.

    python scripts/benchmark_classification.py                       # everything (long on 2 CPU cores)
    python scripts/benchmark_classification.py --datasets digits --models mlp
    python scripts/benchmark_classification.py --datasets mnist1d --models cnn --exact none --no-laplace-torch \
        --dtype float32 --dense-features always           # the CNN through an assembled Ψ₀ (5.4 GB)
    python scripts/benchmark_classification.py --datasets digits --models mlp --exact none --no-laplace-torch \
        --a-multiples 1 3 10 30 100 1000 [--weight-decay 10]     # evidence optimum vs predictive optimum
    python scripts/benchmark_classification.py --datasets digits --models mlp --exact none --no-laplace-torch \
        --marglik-rounds 4                # MAP training continued under the prior the EM chose (online marglik)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ctuq.classify import LinearizedLaplace  # noqa: E402
from ctuq.classify.predictive import link_probabilities  # noqa: E402
from ctuq.metrics.classification import accuracy, expected_calibration_error, nll  # noqa: E402
from ctuq.models import count_parameters  # noqa: E402
from ctuq.options import DenseFeatures as DenseChoice  # noqa: E402
from ctuq.options import values  # noqa: E402
from ctuq.studies.classification import (  # noqa: E402
    DATASETS,
    MODELS,
    SHIFTS,
    load_dataset,
    make_model,
    metric_row,
    shifted_inputs,
    train_map,
)
from ctuq.utils import atomic_torch_save, tune_malloc  # noqa: E402

KAPPAS = list(range(1, 11))
LT_VARIANTS = [("last_layer", "kron"), ("all", "diag"), ("all", "kron"), ("all", "full")]


def loader(X, y, batch=128):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=batch)


def shift_sets(name, Xt):
    return [
        (kind, sev, shifted_inputs(name, Xt, kind, sev, seed=17))
        for kind, sevs in SHIFTS[name].items()
        for sev in sevs
        if sev
    ]


def sym_kl(p, q):
    p, q = p.double().clamp_min(1e-300), q.double().clamp_min(1e-300)
    return float(((p - q) * (p.log() - q.log())).sum(1).mean())


# ------------------------------------------------------------------------------------------ methods
def run_map(model, d, shifts):
    with torch.no_grad():
        probs = torch.softmax(model(d["Xt"]).double(), -1)
        rows = {"test": metric_row(probs, d["yt"])}
        for kind, sev, X in shifts:
            p = torch.softmax(model(X).double(), -1)
            rows[f"{kind}={sev}"] = metric_row(p, d["yt"], kappas=[1])
    return {"method": "MAP", "link": "-", "rows": rows, "time_s": 0.0, "a": None}


def make_laplace(model, args, exact: bool, log=None) -> LinearizedLaplace:
    """ctuq's all-weights g-prior Laplace as benchmarked: the dense exact solver, or CG with the rank-``--rank``
    Nyström preconditioner."""
    return LinearizedLaplace(
        model,
        prior="gprior",
        solver="exact" if exact else "cg",
        seed=args.seed,
        solver_options={} if exact else {"rank": args.rank, "adaptive_rank": args.adaptive_rank},
        dtype=getattr(torch, args.dtype),
        dense_features=args.dense_features,
        log=log,
    )


def cached_model(path: Path, model, train):
    """``(model, seconds)``: the weights cached at ``path`` (``seconds`` None), else ``train(model)`` saved there."""
    if path.exists():
        model.load_state_dict(torch.load(path, weights_only=True))
        return model.eval(), None
    model, seconds = train(model)
    atomic_torch_save(path, model.state_dict())
    return model, seconds


def run_ctuq(model, d, shifts, args, exact: bool):
    t0 = time.perf_counter()
    la = make_laplace(model, args, exact, log=lambda m: print(f"    {m}", flush=True))
    la.fit(loader(d["X"], d["y"]))
    t_fit = time.perf_counter() - t0
    print(
        f"  ctuq {'exact' if exact else 'sampled'}: fit (linearisation, g-prior, solver set-up) {t_fit:.1f} s",
        flush=True,
    )  # long runs (the CNNs) otherwise print nothing for many minutes
    if exact:
        la.optimize_prior("exact", max_steps=100, tol=1e-4)
    else:
        la.optimize_prior("sampled_em", max_steps=args.em_steps, n_samples=args.em_samples, tol=0.0)
    t_em = time.perf_counter() - t0 - t_fit
    print(
        f"  ctuq {'exact' if exact else 'sampled'}: prior optimisation {t_em:.1f} s, a = {la.prior_precision:.4g}",
        flush=True,
    )
    f, Z = la.logit_deviations(d["Xt"], args.samples, seed=args.seed)  # draws the posterior samples
    t_total = time.perf_counter() - t0
    shifted = [(f"{kind}={sev}", *la.logit_deviations(X, args.samples, seed=args.seed)) for kind, sev, X in shifts]
    out = []
    for link in ("mc", "probit"):
        rows = {"test": metric_row(link_probabilities(f, Z, link), d["yt"], f[None] + Z)}
        for name, fs, Zs in shifted:
            rows[name] = metric_row(link_probabilities(fs, Zs, link), d["yt"], kappas=[1])
        out.append(
            {
                "method": f"ctuq {'exact EM' if exact else 'sampled EM'}",
                "link": link,
                "rows": rows,
                "time_s": t_total,
                "fit_s": t_fit,
                "em_s": t_em,
                "a": la.prior_precision,
                "em_steps": len(la.em_trace),
                "solver": la.posterior.solver_name,
            }
        )
    return out, la, link_probabilities(f, Z, "mc")


def _lt_worker(queue, state, d, shifts, subset, structure, args):
    torch.set_num_threads(args.threads)
    try:
        from laplace import Laplace

        model = make_model(args.model_kind, args.dataset_name)
        model.load_state_dict(state)
        model.eval()
        t0 = time.perf_counter()
        la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure)
        la.fit(loader(d["X"], d["y"]))
        la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
        g = torch.Generator().manual_seed(args.seed)
        logits = la.functional_samples(d["Xt"], pred_type="glm", n_samples=args.samples, generator=g).detach()
        t_total = time.perf_counter() - t0
        res = []
        for link in ("probit", "mc"):
            probs = la(d["Xt"], pred_type="glm", link_approx=link, n_samples=args.samples).detach().double()
            rows = {"test": metric_row(probs, d["yt"], logits)}
            for kind, sev, X in shifts:
                p = la(X, pred_type="glm", link_approx=link, n_samples=args.samples).detach().double()
                rows[f"{kind}={sev}"] = metric_row(p, d["yt"], kappas=[1])
            res.append(
                {
                    "method": f"laplace-torch {subset} {structure}",
                    "link": link,
                    "rows": rows,
                    "time_s": t_total,
                    "a": float(torch.as_tensor(la.prior_precision).mean()),
                }
            )
        queue.put(res)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def run_laplace_torch(state, d, shifts, subset, structure, args):
    ctx = mp.get_context("spawn")  # fork deadlocks torch's thread pool in the child
    q = ctx.Queue()
    p = ctx.Process(target=_lt_worker, args=(q, state, d, shifts, subset, structure, args))
    t0 = time.perf_counter()
    p.start()
    try:
        got = q.get(timeout=args.lt_timeout)  # read before joining: a child blocks on a full pipe until read
    except Exception:  # noqa: BLE001 - timed out or died without a result
        got = None
    p.join(5)
    if p.is_alive():
        p.terminate()
        p.join()
    if got is None:
        what = f"did not finish in {args.lt_timeout:.0f} s" if p.exitcode in (None, -15) else f"exit code {p.exitcode}"
        return {"method": f"laplace-torch {subset} {structure}", "error": what}
    if isinstance(got, dict):
        return {"method": f"laplace-torch {subset} {structure}", **got, "time_s": time.perf_counter() - t0}
    return got


def a_sweep(la, d, args):
    """Test metrics of the sampled posterior with ``a`` fixed at multiples of the EM's value (same posterior object;
    the samples are redrawn at each ``a``). Restores ``a`` afterwards."""
    a0 = la.posterior.a
    gamma = la.em_trace[-1].get("gamma") if la.em_trace else None
    print(f"  a sweep (EM: a = {a0:.4g}, γ = {gamma if gamma is None else f'{gamma:.4g}'} of d = {la.n_params}):")
    try:
        for mult in args.a_multiples:
            la.posterior.a = a0 * mult
            f, Z = la.logit_deviations(d["Xt"], args.samples, seed=args.seed)
            cells = []
            for link in ("mc", "probit"):
                p = link_probabilities(f, Z, link)
                cells.append(
                    f"{link} NLL {nll(p, d['yt']):.4f} acc {accuracy(p, d['yt']):.4f} "
                    f"ECE {expected_calibration_error(p, d['yt']):.4f}"
                )
            print(
                f"    a = {a0 * mult:10.4g} ({mult:g}× EM): "
                + "; ".join(cells)
                + f"; mean logit std {float(Z.std(0).mean()):.3f}",
                flush=True,
            )
    finally:
        la.posterior.a = a0


def marglik_training(model, d, args):
    """Online type-II maximum likelihood: ``--marglik-rounds`` times, fit the sampled linearised Laplace (g-prior,
    EM as in :func:`run_ctuq`) and continue the MAP training (warm start, ``--marglik-epochs`` epochs) with the
    evidence-optimal prior ``v_j ~ N(0, s_j²/a)`` as its regulariser (precision ``a/s_j²``; none where ``s_j = 0``,
    a weight that no training logit depends on). Then the network is, up to the Adam iterate, the mode of the
    posterior whose evidence picked ``a``, instead of an unregularised fit. Returns the model and the seconds taken."""
    t0 = time.perf_counter()
    for k in range(args.marglik_rounds):
        la = make_laplace(model, args, exact=False)
        la.fit(loader(d["X"], d["y"]))
        la.optimize_prior("sampled_em", max_steps=args.em_steps, n_samples=args.em_samples, tol=0.0)
        a, s = la.prior_precision, la.scales
        lam = torch.where(s > 0, a / s.clamp_min(1e-300) ** 2, torch.zeros_like(s))
        with torch.no_grad():
            train_ce = float(torch.nn.functional.cross_entropy(model(d["X"]), d["y"]))
        print(
            f"  marglik round {k + 1}/{args.marglik_rounds}: training CE {train_ce:.4f}, a = {a:.4g}, "
            f"γ = {la.em_trace[-1].get('gamma', float('nan')):.4g}; {args.marglik_epochs} epochs with that prior",
            flush=True,
        )
        la = None
        model, _ = train_map(
            model, d["X"], d["y"], epochs=args.marglik_epochs, seed=args.seed + k + 1, weight_decay=lam
        )
    return model, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ tables
def fmt(v, nd=3):
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def print_tables(title, entries, shifts):
    print(f"\n### {title}\n")
    print("| method | link | a | NLL | acc | ECE | Brier | JLL κ=1 | κ=2 | κ=5 | κ=10 | time (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e in entries:
        if "error" in e:
            print(f"| {e['method']} | — | — | {e['error']} | | | | | | | | |")
            continue
        r = e["rows"]["test"]
        j = r["joint_ll"]
        print(
            f"| {e['method']} | {e['link']} | {fmt(e['a'], 3) if e['a'] is not None else '—'} | {fmt(r['nll'])} | "
            f"{fmt(r['accuracy'])} | {fmt(r['ece'])} | {fmt(r['brier'])} | {fmt(j[1])} | {fmt(j[2])} | {fmt(j[5])} | "
            f"{fmt(j[10])} | {fmt(e['time_s'], 1)} |"
        )
    keys = [f"{k}={s}" for k, s, _ in shifts]
    for metric in ("nll", "ece"):
        print(f"\n{metric.upper()} under shift ({title})\n")
        print("| method | link | " + " | ".join(keys) + " |")
        print("|---|---|" + "---|" * len(keys))
        for e in entries:
            if "error" not in e:
                print(f"| {e['method']} | {e['link']} | " + " | ".join(fmt(e["rows"][k][metric]) for k in keys) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--out", default="runs/classification", help="folder for cached MAP networks and results.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--samples", type=int, default=64, help="prediction samples")
    ap.add_argument("--em-steps", type=int, default=5)
    ap.add_argument("--em-samples", type=int, default=16)
    ap.add_argument("--rank", type=int, default=400, help="CG preconditioner rank (the cap with --adaptive-rank)")
    ap.add_argument(
        "--adaptive-rank",
        action="store_true",
        help="grow the Nyström preconditioner until λ_r/a < σ² (up to --rank) instead of a fixed rank",
    )
    ap.add_argument(
        "--exact",
        choices=["auto", "all", "none"],
        default="auto",
        help="exact EM: auto = MLPs only (d < c), all = also the CNNs, none",
    )
    ap.add_argument("--laplace-torch", dest="lt", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--lt-timeout", type=float, default=600.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64", help="precision of ctuq's posterior")
    ap.add_argument(
        "--dense-features",
        choices=values(DenseChoice),
        default="auto",
        help="ctuq: assemble Ψ₀ from per-example Jacobians for every solver (always; then CG's products "
        "are GEMMs), only for the exact EM (auto), or never",
    )
    ap.add_argument(
        "--weight-decay",
        type=float,
        default=0.0,
        help="MAP training: weight_decay/2 ‖v‖²/n added to the mean cross-entropy (default 0)",
    )
    ap.add_argument(
        "--marglik-rounds",
        type=int,
        default=0,
        help="continue the MAP training this many times with the prior the sampled EM chose (g-prior "
        "precisions a/s²; online type-II maximum likelihood) before the comparison (default 0)",
    )
    ap.add_argument("--marglik-epochs", type=int, default=100, help="Adam epochs per --marglik-rounds round")
    ap.add_argument(
        "--a-multiples",
        type=float,
        nargs="*",
        default=[],
        help="also evaluate the sampled posterior with a fixed at these multiples of the EM's a "
        "(test NLL, accuracy, ECE, mean logit std): is the evidence optimum the predictive optimum?",
    )
    args = ap.parse_args(argv)
    if args.marglik_rounds < 0 or args.marglik_epochs < 1:
        ap.error(
            f"--marglik-rounds must be >= 0 and --marglik-epochs >= 1, got {args.marglik_rounds} and "
            f"{args.marglik_epochs}"
        )
    torch.set_num_threads(args.threads)
    os.environ.setdefault("CTUQ_NO_PROGRESS", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import laplace  # noqa: F401

        have_lt = args.lt
    except ImportError:
        have_lt = False
        print(
            "laplace-torch is not installed: its rows are skipped (docs/classification.md: installing it beside a "
            "CPU torch)"
        )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()}")
    results = {}
    for ds in args.datasets:
        d = load_dataset(ds, seed=args.seed)
        shifts = shift_sets(ds, d["Xt"])
        for kind in args.models:
            key = f"{ds}/{kind}"
            model = make_model(kind, ds, seed=args.seed)
            wd = f"_wd{args.weight_decay:g}" if args.weight_decay else ""
            cache = out / f"{ds}_{kind}_seed{args.seed}_ep{args.epochs}{wd}.pt"
            model, t_train = cached_model(
                cache,
                model,
                lambda m: train_map(
                    m, d["X"], d["y"], epochs=args.epochs, seed=args.seed, weight_decay=args.weight_decay
                ),
            )
            if args.marglik_rounds:
                ml = out / f"{cache.stem}_marglik{args.marglik_rounds}x{args.marglik_epochs}.pt"
                model, _ = cached_model(ml, model, lambda m: marglik_training(m, d, args))
            n, C = d["X"].shape[0], 10
            print(
                f"\n{key}: d = {count_parameters(model)}, n = {n}, n·C = {n * C}, MAP training "
                f"{'cached' if t_train is None else f'{t_train:.0f} s'}",
                flush=True,
            )
            entries = [run_map(model, d, shifts)]
            sampled, la_s, mc_s = run_ctuq(model, d, shifts, args, exact=False)
            entries += sampled
            print(
                f"  ctuq sampled EM: {sampled[0]['time_s']:.1f} s (fit {sampled[0]['fit_s']:.1f}, EM "
                f"{sampled[0]['em_s']:.1f}), a = {sampled[0]['a']:.4g}",
                flush=True,
            )
            if args.a_multiples:
                a_sweep(la_s, d, args)
            fidelity = None
            if args.exact == "all" or (args.exact == "auto" and kind == "mlp"):
                exact, la_e, mc_e = run_ctuq(model, d, shifts, args, exact=True)
                entries += exact
                ref = la_e.predict(d["Xt"], link="mc", samples=1024, seed=args.seed + 1)
                fidelity = {
                    "a_sampled": sampled[0]["a"],
                    "a_exact": exact[0]["a"],
                    "a_ratio": sampled[0]["a"] / exact[0]["a"],
                    "symkl_sampled_vs_exact1024": sym_kl(mc_s, ref),
                    "symkl_exact64_vs_exact1024": sym_kl(mc_e, ref),
                    "em_steps_exact": exact[0]["em_steps"],
                }
                print(
                    f"  ctuq exact EM: {exact[0]['time_s']:.1f} s, a = {exact[0]['a']:.4g}; fidelity {fidelity}",
                    flush=True,
                )
            la_s = la_e = mc_s = mc_e = None  # free ctuq's posterior (an assembled Ψ₀ takes GBs) before laplace-torch
            gc.collect()
            if have_lt:
                state = {k: v.clone() for k, v in model.state_dict().items()}
                args.model_kind, args.dataset_name = kind, ds
                for subset, structure in LT_VARIANTS:
                    got = run_laplace_torch(state, d, shifts, subset, structure, args)
                    entries += got if isinstance(got, list) else [got]
                    e = got[0] if isinstance(got, list) else got
                    msg = e["error"] if "error" in e else f"{e['time_s']:.1f} s, a = {e['a']:.4g}"
                    print(f"  laplace-torch {subset} {structure}: {msg}", flush=True)
            results[key] = {"entries": entries, "fidelity": fidelity, "d": count_parameters(model), "n": n}
            print_tables(key, entries, shifts)
            if fidelity:
                print(f"\nfidelity ({key}): " + ", ".join(f"{k} = {v:.4g}" for k, v in fidelity.items()))
            (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    print(f"\nload average at the end {os.getloadavg()}; results in {out / 'results.json'}")


if __name__ == "__main__":
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    main()
