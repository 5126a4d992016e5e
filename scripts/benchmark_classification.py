"""Benchmark: all-weights linearised Laplace with ctuq against MAP and laplace-torch 0.3, on offline data.

What it reproduces: the tables of docs/classification.md §2 (each names its command) and the earlier rows of
docs/notebook/classification.md (§2.1 sweep, rows before the ridge, §A with ``hessian_at="network"``).

For each data set (scikit-learn digits; MNIST-1D from its offline generator) and model (MLP ~9k weights; CNN with batch
norm ~31-34k weights; ``wide_cnn``, the same with twice the channels, 117k / 129k weights) it trains the MAP network
(``--recipe bench``: Adam lr 1e-3, no weight decay; ``--recipe issue``: Adam lr 1e-2, weight decay 1e-4; 200 epochs,
seed 0; cached in ``--out``), then evaluates side by side

* MAP;
* ctuq, all weights, g-prior, sampled EM (CG solver, ``--em-steps`` damped EM steps with ``--em-samples`` posterior
  samples each), with the softmax Hessians at the network (``hessian_at="network"``, the published shortcut) and
  at the linearised model's mode (``"linear_mode"``, the default), then ``--samples`` posterior samples for
  prediction (MC — also with the first 64 samples, ``mc64`` — and probit links);
* ctuq linear mode, exact EM: dense exact solver, EM to ``|Δa|/a < 1e-4``, where ``Ψ₀`` fits memory (``--exact``);
* ctuq linear mode, last layer only (exact EM);
* ctuq linear mode with ``a`` by grid search on validation data (post-hoc calibration: a third of the test split,
  stratified; these rows, and MAP and the linear-mode sampled EM beside them, are scored on the other two thirds);
* the default with the held-out guard (``--methods guard``: ``optimize_prior(val_loader=...)`` on the same
  validation third, scored on the other two);
* ELLA (``--methods ella``: ``approximation="ella"`` with ``--ella-landmarks`` and ``--ella-rank``, ``B`` at the
  network as in the paper: the exact EM in ``K`` dimensions on the whole test split, then the held-out guard and
  the grid search on the validation third, scored on the other two; the same grid with an isotropic prior, the
  prior laplace-torch uses; laplace-torch's ELLA with the same M and K beside them, its grid on the same third,
  scored on the whole split and on the other two thirds);
* laplace-torch 0.3 if importable: last-layer KFAC, all-weights diag, all-weights KFAC, all-weights full GGN, each
  with ``optimize_prior_precision(method="marglik")`` and probit / MC predictives, each in a subprocess limited to
  ``--lt-timeout`` seconds;

on the test set (NLL, accuracy, ECE with 15 bins, Brier, κ-tuple joint log-likelihood κ = 1…10 with dyadic sampling,
wall time of fit + prior optimisation + posterior samples, of the test split's logit deviations (``predict``), the
process's peak resident memory so far) and along input corruptions (digits: rotation, noise, blur; MNIST-1D: noise,
blur, translation; NLL and ECE). For the exact-tractable cases it also reports the fidelity of the sampled method to
the exact one (ratio of the prior precisions, symmetrised KL between the two MC predictives), and for the digits MLP
the acceptance gates of issue 27. Prints markdown tables; writes ``results_<recipe>.json`` (per data set and model; a
later run on the same cached network adds its methods' rows and replaces those it repeats) and one reliability-diagram
figure per data set and model (``--figures``).

    python scripts/benchmark_classification.py                       # everything (long on 2 CPU cores)
    python scripts/benchmark_classification.py --datasets digits --models mlp [--recipe issue]
    python scripts/benchmark_classification.py --datasets mnist1d --models cnn --exact none --no-laplace-torch \
        --dtype float32 --dense-features always           # the CNN through an assembled Ψ₀ (5.4 GB)
    python scripts/benchmark_classification.py --datasets digits --models wide_cnn --methods linear guard \
        --exact none --no-laplace-torch --dtype float32 --dense-features always  # 117k weights: J 5.9 GB, 7.7 GB peak
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

from ctuq.classify import GPRIOR_FLOOR, LinearizedLaplace  # noqa: E402
from ctuq.classify.predictive import link_probabilities  # noqa: E402
from ctuq.metrics import paired_bootstrap, reliability_diagram  # noqa: E402
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
    validation_split,
)
from ctuq.utils import atomic_path, atomic_torch_save, tune_malloc  # noqa: E402

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
def run_map(model, d, shifts, idx=None, name="MAP"):
    """MAP rows on the test set (or its rows ``idx``) and the shifted sets."""
    sel = slice(None) if idx is None else idx
    with torch.no_grad():
        probs = torch.softmax(model(d["Xt"][sel]).double(), -1)
        rows = {"test": metric_row(probs, d["yt"][sel])}
        for kind, sev, X in shifts:
            p = torch.softmax(model(X[sel]).double(), -1)
            rows[f"{kind}={sev}"] = metric_row(p, d["yt"][sel], kappas=[1])
    return {"method": name, "link": "-", "rows": rows, "time_s": 0.0, "a": None, "probs": probs}


def make_laplace(
    model, args, exact: bool, log=None, hessian_at="linear_mode", weights="all", a0=1.0, ella=False, prior="gprior"
) -> LinearizedLaplace:
    """ctuq's Laplace as benchmarked (the g-prior with ``--gprior-floor``, or another diagonal ``prior`` with its
    defaults): the dense exact solver, or CG with the rank-``--rank`` Nyström preconditioner; softmax Hessians
    ``hessian_at``; ``ella``: ELLA's subspace (``--ella-landmarks``, ``--ella-rank``), the posterior exact in it."""
    extra = dict(approximation="ella", landmarks=args.ella_landmarks, rank=args.ella_rank) if ella else {}
    return LinearizedLaplace(
        model,
        prior=prior,
        weights=weights,
        hessian_at=hessian_at,
        prior_precision=a0,
        solver="exact" if exact else "cg",
        prior_options={"floor": args.gprior_floor} if prior == "gprior" else None,
        seed=args.seed,
        solver_options={} if exact else {"rank": args.rank, "adaptive_rank": args.adaptive_rank},
        dtype=getattr(torch, args.dtype),
        # ELLA needs M rows of Ψ₀ and K products, never all of it: assembling it (always) only costs memory, and on
        # the wide CNN it left too little for the next route (5.5 GiB against a 5.4 GiB budget)
        dense_features="auto" if ella else args.dense_features,
        log=log,
        **extra,
    )


def cached_model(path: Path, model, train):
    """``(model, seconds)``: the weights cached at ``path`` (``seconds`` None), else ``train(model)`` saved there."""
    if path.exists():
        model.load_state_dict(torch.load(path, weights_only=True))
        return model.eval(), None
    model, seconds = train(model)
    atomic_torch_save(path, model.state_dict())
    return model, seconds


def peak_rss_gb() -> float:
    """The process's peak resident memory so far (GB; Linux reports KiB): a high-water mark, so a method's own peak
    only where it is the first heavy one of the run (``--methods linear`` alone for the default's)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def ctuq_rows(la, name, d, shifts, args, times, idx=None, mc64=False):
    """Rows (MC, optionally MC with the first 64 samples, probit) of a fitted ``la`` on the test set (or its rows
    ``idx``) and the shifted sets; ``times``: ``(total, fit, prior optimisation)`` seconds."""
    sel = slice(None) if idx is None else idx
    key = (la.prior_precision, args.samples, args.seed)
    # the whole test split's deviations of this object at this a, kept on it (freed with it): rows idx of them
    # instead of a recomputation (minutes on a CNN)
    cached = getattr(la, "_bench_deviations", None)
    if cached is not None and cached[0] == key:
        f, Z = cached[1][0][sel], cached[1][1][:, sel]
        shifted = [(label, fs[sel], Zs[:, sel]) for label, fs, Zs in cached[2]]
        t_predict = cached[3]
    else:
        t0 = time.perf_counter()
        f, Z = la.logit_deviations(d["Xt"][sel], args.samples, seed=args.seed)
        t_predict = time.perf_counter() - t0
        shifted = [
            (f"{kind}={sev}", *la.logit_deviations(X[sel], args.samples, seed=args.seed)) for kind, sev, X in shifts
        ]
        if idx is None:  # ~0.15 GB for a CNN's 14 sets of 256 samples
            la._bench_deviations = (key, (f, Z), shifted, t_predict)
    links = [("mc", args.samples), ("probit", args.samples)] + ([("mc", 64)] if mc64 and args.samples > 64 else [])
    out = []
    for link, k in links:
        rows = {"test": metric_row(link_probabilities(f, Z[:k], link), d["yt"][sel], f[None] + Z[:k])}
        for sname, fs, Zs in shifted:
            rows[sname] = metric_row(link_probabilities(fs, Zs[:k], link), d["yt"][sel], kappas=[1])
        trace = la.em_trace
        out.append(
            {
                "method": name,
                "link": link if k == args.samples else f"{link}{k}",
                "rows": rows,
                "time_s": times[0],
                "fit_s": times[1],
                "em_s": times[2],
                "predict_s": t_predict,  # the test split's deviations (all rows' samples), not the shifted sets'
                "a": la.prior_precision,
                "em_steps": len(trace),
                "gamma": trace[-1]["gamma"] if trace else None,
                "hessian_ratio": la.hessian_ratio,
                "overfit_fraction": la.overfit_fraction,
                "mode_kl": la.mode_kl,
                "a_trace": [r["a_new"] for r in trace],
                "solver": la.posterior.solver_name,
                "peak_rss_gb": peak_rss_gb(),
                "probs": link_probabilities(f, Z[:k], link),
            }
        )
    return out


def run_ctuq(
    model,
    d,
    shifts,
    args,
    exact: bool,
    hessian_at="linear_mode",
    weights="all",
    name=None,
    a0=1.0,
    ella=False,
    prior="gprior",
):
    """Fit, EM (sampled or exact) from ``a = a0`` and the rows of one ctuq variant; returns ``(rows, la)``."""
    name = name or f"ctuq {hessian_at.replace('_', '-')} {'exact' if exact else 'sampled'} EM"
    t0, c0 = time.perf_counter(), time.process_time()
    la = make_laplace(
        model,
        args,
        exact,
        log=lambda m: print(f"    {m}", flush=True),
        hessian_at=hessian_at,
        weights=weights,
        a0=a0,
        ella=ella,
        prior=prior,
    )
    la.fit(loader(d["X"], d["y"]))
    t_fit = time.perf_counter() - t0
    print(f"  {name}: fit (linearisation, g-prior, mode, solver set-up) {t_fit:.1f} s", flush=True)
    if exact:
        la.optimize_prior("exact", max_steps=args.exact_steps, tol=1e-4)
    else:
        la.optimize_prior("sampled_em", max_steps=args.em_steps, n_samples=args.em_samples, tol=0.0)
    t_em = time.perf_counter() - t0 - t_fit
    cpu = time.process_time() - c0
    print(f"  {name}: CPU time of fit + prior optimisation {cpu:.1f} s ({torch.get_num_threads()} threads)", flush=True)
    print(
        f"  {name}: prior optimisation {t_em:.1f} s, a = {la.prior_precision:.4g}, "
        f"a trace {[round(r['a_new'], 4) for r in la.em_trace]}, γ = {la.em_trace[-1]['gamma']:.4g}, "
        f"tr B ratio {la.hessian_ratio:.3g}, training labels the network fits and the mode does not "
        f"{la.overfit_fraction:.2%} (KL {la.mode_kl:.3g} nats)",
        flush=True,
    )
    la.posterior_samples(args.samples, args.seed)  # the prediction samples belong to the timed part
    t_total = time.perf_counter() - t0
    mc64 = not exact and weights == "all" and not ella
    return ctuq_rows(la, name, d, shifts, args, (t_total, t_fit, t_em), mc64=mc64), la


def run_gridsearch(la, d, shifts, args, val_idx, eval_idx, name="ctuq linear-mode gridsearch", t_fit=0.0):
    """Grid search of ``a`` (post-hoc calibration) on the validation rows ``val_idx`` of the test split, starting
    from a fitted ``la`` (``t_fit`` seconds, added to the row's time); rows ``name`` on ``eval_idx``."""
    t0 = time.perf_counter()
    out = la.optimize_prior(
        "gridsearch",
        val_loader=loader(d["Xt"][val_idx], d["yt"][val_idx]),
        link="probit",
        samples=args.grid_samples,
        grid=args.grid,
    )
    t = time.perf_counter() - t0
    print(f"  gridsearch: a = {out['a']:.4g} (validation NLL {out['nll']:.4f}), {t:.1f} s", flush=True)
    rows = ctuq_rows(la, name, d, shifts, args, (t_fit + t, 0.0, t), idx=eval_idx)
    for r in rows:
        r["grid"] = out["trace"]
    return rows


def run_guard(
    la, d, shifts, args, val_idx, eval_idx, t_default, name="ctuq default + held-out guard", method="sampled_em"
):
    """The held-out guard (``optimize_prior(method, val_loader=...)`` after the EM of ``method`` of a fitted ``la``,
    the default's sampled EM unless given): the validation rows ``val_idx`` of the test split; rows ``name`` on
    ``eval_idx``. ``t_default``: the seconds of the fit and EM, to which the guard's are added."""
    t0 = time.perf_counter()
    la.optimize_prior(
        method,
        max_steps=0,  # the EM has run: only the guard
        val_loader=loader(d["Xt"][val_idx], d["yt"][val_idx]),
        link="probit",
        samples=args.grid_samples,
    )
    g = la.guard
    t = time.perf_counter() - t0
    steps = ", ".join(f"{r['a']:.4g}: {r['nll']:.4f}" for r in g["trace"])
    print(
        f"  held-out guard: a {g['a_em']:.4g} -> {g['a']:.4g} (validation NLL, probit: {steps}; the network's "
        f"{g['network_nll']:.4f}), {t:.1f} s",
        flush=True,
    )
    rows = ctuq_rows(la, name, d, shifts, args, (t_default + t, 0.0, t), idx=eval_idx)
    for r in rows:
        r["guard"] = g
    return rows


def _lt_worker(queue, state, d, shifts, subset, structure, args):
    torch.set_num_threads(args.threads)
    try:
        from laplace import ELLA, Laplace

        model = make_model(args.model_kind, args.dataset_name)
        model.load_state_dict(state)
        model.eval()
        t0 = time.perf_counter()
        if structure == "ella":  # the same M and K as ctuq's; its prior by grid search on the validation rows
            la = ELLA(model, "classification", subsample_size=args.ella_landmarks, n_eigenvalues=args.ella_rank)
            la.fit(loader(d["X"], d["y"]))
            val = loader(d["Xt"][args.val_idx], d["yt"][args.val_idx])
            la.optimize_prior_precision(
                pred_type="gp",
                method="gridsearch",
                val_loader=val,
                log_prior_prec_min=-2,
                log_prior_prec_max=6,
                grid_size=25,
            )
            pred = "gp"
        else:
            la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure)
            la.fit(loader(d["X"], d["y"]))
            la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
            pred = "glm"
        g = torch.Generator().manual_seed(args.seed)
        logits = la.functional_samples(d["Xt"], pred_type=pred, n_samples=args.samples, generator=g).detach()
        t_total = time.perf_counter() - t0
        res = []
        a = float(torch.as_tensor(la.prior_precision).mean())
        for link in ("probit", "mc"):
            probs = la(d["Xt"], pred_type=pred, link_approx=link, n_samples=args.samples).detach().double()
            shifted = {
                f"{kind}={sev}": la(X, pred_type=pred, link_approx=link, n_samples=args.samples).detach().double()
                for kind, sev, X in shifts
            }
            rows = {"test": metric_row(probs, d["yt"], logits)}
            rows.update({label: metric_row(p, d["yt"], kappas=[1]) for label, p in shifted.items()})
            res.append(
                {
                    "method": f"laplace-torch {subset} {structure}",
                    "link": link,
                    "rows": rows,
                    "time_s": t_total,
                    "a": a,
                    "probs": probs,
                }
            )
            if structure == "ella":  # its grid saw the validation third: scored on the other two, as ctuq's are
                idx = args.eval_idx  # rows of the same predictions, as ctuq's subset rows are
                sub = {"test": metric_row(probs[idx], d["yt"][idx], logits[:, idx])}
                sub.update({label: metric_row(p[idx], d["yt"][idx], kappas=[1]) for label, p in shifted.items()})
                name = f"laplace-torch {subset} {structure} (test subset)"
                res.append({"method": name, "link": link, "rows": sub, "time_s": t_total, "a": a, "probs": probs[idx]})
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
    """Test metrics of the sampled posterior with ``a`` fixed at multiples of the EM's value (same object; with
    ``hessian_at="linear_mode"`` the mode and ``B`` follow ``a``; the samples are redrawn at each ``a``). Restores
    ``a`` afterwards."""
    a0 = la.posterior.a
    gamma = la.em_trace[-1].get("gamma") if la.em_trace else None
    print(f"  a sweep (EM: a = {a0:.4g}, γ = {gamma if gamma is None else f'{gamma:.4g}'} of d = {la.n_params}):")
    try:
        for mult in args.a_multiples:
            la.set_prior_precision(a0 * mult)
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
        la.set_prior_precision(a0)


def marglik_training(model, d, args):
    """Online type-II maximum likelihood: ``--marglik-rounds`` times, fit the sampled linearised Laplace (g-prior,
    EM as in :func:`run_ctuq`) and continue the MAP training (warm start, ``--marglik-epochs`` epochs) with the
    evidence-optimal prior ``v_j ~ N(0, s_j²/a)`` as its regulariser (precision ``a/s_j²``; none where ``s_j = 0``,
    a weight that no training logit depends on). Then the network is, up to the Adam iterate, the mode of the
    posterior whose evidence picked ``a``, instead of an unregularised fit. Returns the model and the seconds taken."""
    t0 = time.perf_counter()
    for k in range(args.marglik_rounds):
        la = make_laplace(model, args, exact=False, hessian_at="network")  # as measured on 2026-11-24
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


def paired_with_map(title, entries, labels, eval_idx, seed):
    """Each row's NLL and ECE minus MAP's on the same test images, with paired-bootstrap 95 % intervals (2,000
    resamples, ``seed``): stored as ``entry["vs_map"]`` and printed, with each row's mean top-class confidence minus
    its accuracy (negative: under-confident; a predictive wider than a calibrated network's is). Rows on the test
    subset pair with "MAP (test subset)", the others with "MAP"."""
    maps = {len(e["probs"]): e for e in entries if e["method"] in ("MAP", "MAP (test subset)") and "probs" in e}
    ys = {len(labels): labels, len(eval_idx): labels[eval_idx]}
    print(f"\ndifferences from MAP on the same images, paired bootstrap ({title}; negative: better than MAP)\n")
    print(
        "| method | link | images | ΔNLL [95 % interval] | P(NLL below MAP's) | ΔECE [95 % interval] | P(ECE below) "
        "| confidence − accuracy (MAP's) | images less confident than MAP |"
    )
    print("|---|---|---|---|---|---|---|---|---|")

    def gap(probs, y):
        conf, pred = probs.max(1)
        return float(conf.mean() - (pred == y).double().mean())

    for e in entries:
        ref = maps.get(len(e.get("probs", ())))
        if ref is None or ref is e or "probs" not in e:
            continue
        y = ys[len(e["probs"])]
        e["vs_map"] = b = paired_bootstrap(e["probs"], ref["probs"], y, seed=seed)
        b["confidence_gap"], b["confidence_gap_map"] = gap(e["probs"], y), gap(ref["probs"], y)
        # the share of images whose top-class probability (MAP's top class) this row lowers
        top = ref["probs"].argmax(1, keepdim=True)
        b["less_confident"] = float((e["probs"].gather(1, top) < ref["probs"].gather(1, top)).double().mean())
        cells = [
            f"{b[m]['difference']:+.4f} [{b[m]['interval_95'][0]:+.4f}, {b[m]['interval_95'][1]:+.4f}] | "
            f"{b[m]['p_better']:.2f}"
            for m in ("nll", "ece")
        ]
        print(
            f"| {e['method']} | {e['link']} | {b['n']} | {cells[0]} | {cells[1]} | {b['confidence_gap']:+.4f} "
            f"({b['confidence_gap_map']:+.4f}) | {b['less_confident']:.1%} |"
        )


def print_tables(title, entries, shifts):
    print(f"\n### {title}\n")
    print(
        "| method | link | a | NLL | acc | ECE | Brier | JLL κ=1 | κ=2 | κ=5 | κ=10 | time (s) | predict (s) "
        "| peak RSS (GB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e in entries:
        if "error" in e:
            print(f"| {e['method']} | — | — | {e['error']} | | | | | | | | | | |")
            continue
        r = e["rows"]["test"]
        j = r["joint_ll"]
        print(
            f"| {e['method']} | {e['link']} | {fmt(e['a'], 3) if e['a'] is not None else '—'} | {fmt(r['nll'])} | "
            f"{fmt(r['accuracy'])} | {fmt(r['ece'])} | {fmt(r['brier'])} | {fmt(j[1])} | {fmt(j[2])} | {fmt(j[5])} | "
            f"{fmt(j[10])} | {fmt(e['time_s'], 1)} | {fmt(e['predict_s'], 1) if e.get('predict_s') else '—'} | "
            f"{fmt(e['peak_rss_gb'], 2) if e.get('peak_rss_gb') else '—'} |"
        )
    keys = [f"{k}={s}" for k, s, _ in shifts]
    for metric in ("nll", "ece") if keys else ():
        print(f"\n{metric.upper()} under shift ({title})\n")
        print("| method | link | " + " | ".join(keys) + " |")
        print("|---|---|" + "---|" * len(keys))
        for e in entries:
            if "error" not in e and all(k in e["rows"] for k in keys):
                print(f"| {e['method']} | {e['link']} | " + " | ".join(fmt(e["rows"][k][metric]) for k in keys) + " |")


def plot_reliability(path: Path, title: str, curves: dict, labels) -> Path:
    """One reliability diagram (15 bins, top-class confidence) per method in ``curves`` ``{name: probs}``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.0 * len(curves), 3.1), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(curves), squeeze=False)[0]
    for ax, (name, probs) in zip(axes, curves.items()):
        r = reliability_diagram(probs, labels)
        centres = 0.5 * (r["edges"][1:] + r["edges"][:-1])
        ok = r["count"] > 0
        ax.bar(centres[ok], r["accuracy"][ok], width=1 / 15, edgecolor="k", alpha=0.7)
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.plot(r["confidence"][ok], r["accuracy"][ok], "o", ms=3, color="C3")
        ax.set(
            title=f"{name}\nECE {expected_calibration_error(probs, labels):.3f}, NLL {nll(probs, labels):.3f}",
            xlabel="confidence",
            ylabel="accuracy",
            xlim=(0, 1),
            ylim=(0, 1),
        )
        ax.title.set_fontsize(8)
    fig.suptitle(title, fontsize=9)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=80)
    return path


def gates(entries, fidelity, recipe) -> list[str]:
    """Issue 27's acceptance gates for the digits MLP (all weights, g-prior, EM-chosen ``a``, network mean), each
    ``met`` / ``MISSED`` with its numbers."""
    by = {(e["method"], e["link"]): e for e in entries if "error" not in e}
    m = by[("MAP", "-")]["rows"]
    lin = {
        k: by[("ctuq linear-mode sampled EM", k)]
        for k in ("probit", "mc", "mc64")
        if ("ctuq linear-mode sampled EM", k) in by
    }
    out = []

    def gate(name, ok, detail):
        out.append(f"{'met   ' if ok else 'MISSED'} {name}: {detail}")

    mp, mj = m["test"]["nll"], m["test"]["joint_ll"]
    pr, mc = lin["probit"]["rows"], lin["mc"]["rows"]
    if recipe == "bench":
        gate("probit NLL <= MAP", pr["test"]["nll"] <= mp, f"{pr['test']['nll']:.4f} vs {mp:.4f}")
        gate("MC (256) NLL <= 1.05 MAP", mc["test"]["nll"] <= 1.05 * mp, f"{mc['test']['nll']:.4f} vs {1.05 * mp:.4f}")
        if "mc64" in lin:
            v = lin["mc64"]["rows"]["test"]["nll"]
            gate("MC (64) NLL <= 1.10 MAP", v <= 1.10 * mp, f"{v:.4f} vs {1.10 * mp:.4f}")
        for link in ("probit", "mc"):
            v = lin[link]["rows"]["test"]["ece"]
            gate(f"ECE ({link}) <= 0.03", v <= 0.03, f"{v:.4f}")
        j = mc["test"]["joint_ll"]
        for k in (2, 5, 10):
            gate(f"joint LL κ={k} ahead of MAP", j[k] > mj[k], f"{j[k]:.4f} vs {mj[k]:.4f}")
        gate("joint LL κ=1 within 0.01 of MAP", j[1] >= mj[1] - 0.01, f"{j[1]:.4f} vs {mj[1]:.4f}")
    else:
        me = m["test"]["ece"]
        gate("probit NLL <= 1.05 MAP", pr["test"]["nll"] <= 1.05 * mp, f"{pr['test']['nll']:.4f} vs {1.05 * mp:.4f}")
        gate("MC (256) NLL <= 1.10 MAP", mc["test"]["nll"] <= 1.10 * mp, f"{mc['test']['nll']:.4f} vs {1.10 * mp:.4f}")
        for link in ("probit", "mc"):
            v = lin[link]["rows"]["test"]["ece"]
            gate(f"ECE ({link}) <= MAP + 0.01", v <= me + 0.01, f"{v:.4f} vs {me + 0.01:.4f}")
        for link in ("probit", "mc"):
            rows = lin[link]["rows"]
            shifts = [k for k in rows if k != "test"]
            bad = [
                f"{k} {metric} {rows[k][metric]:.3f} > {m[k][metric]:.3f}"
                for k in shifts
                for metric in ("nll", "ece")
                if rows[k][metric] > m[k][metric]
            ]
            gate(f"corruptions ({link}): NLL and ECE <= MAP at every severity", not bad, "; ".join(bad) or "all")
    if fidelity:
        r = fidelity["a_ratio"]
        gate("sampled EM's a within 5 % of exact EM's", abs(r - 1) <= 0.05, f"ratio {r:.4f}")
    t = lin["mc"]["fit_s"] + lin["mc"]["em_s"]
    gate("fit + prior optimisation < 60 s", t < 60, f"{t:.1f} s (load average {os.getloadavg()[0]:.1f})")
    for (name, link), e in by.items():
        if name.startswith("laplace-torch") and ("all" in name or "last_layer kron" in name):
            v, w = e["rows"]["test"], lin["mc"]["rows"]["test"]
            best = min(pr["test"]["nll"], mc["test"]["nll"])
            ahead = best < v["nll"] and all(w["joint_ll"][k] > v["joint_ll"][k] for k in (1, 2, 5, 10))
            gate(f"ahead of {name} ({link}) on NLL and joint LL", ahead, f"NLL {best:.4f} vs {v['nll']:.4f}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument(
        "--out", default="runs/classification", help="folder for cached MAP networks and results_<recipe>.json"
    )
    ap.add_argument("--figures", default=None, help="folder for the reliability diagrams (default: --out)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument(
        "--recipe",
        choices=["bench", "issue"],
        default="bench",
        help="MAP training: bench = Adam lr 1e-3, no weight decay; issue = Adam lr 1e-2, weight decay 1e-4",
    )
    ap.add_argument("--samples", type=int, default=256, help="prediction samples")
    ap.add_argument(
        "--grid-samples",
        type=int,
        default=64,
        help="posterior samples per grid point (gridsearch) and per step of the held-out guard (guard)",
    )
    ap.add_argument(
        "--grid",
        type=float,
        nargs="+",
        default=None,
        help="prior precisions of the grid search (default: ctuq.classify.DEFAULT_GRID, 1e-2 … 1e6, 25 values)",
    )
    ap.add_argument(
        "--gprior-floor",
        type=float,
        default=GPRIOR_FLOOR,
        help=f"ctuq: the g-prior's ridge δ (LinearizedLaplace(prior_options={{'floor': δ}}); default {GPRIOR_FLOOR}, "
        "0: plain g-prior)",
    )
    ap.add_argument("--em-steps", type=int, default=5)
    ap.add_argument("--em-samples", type=int, default=16)
    ap.add_argument("--exact-steps", type=int, default=30, help="step limit of the exact EM (tol 1e-4)")
    ap.add_argument(
        "--exact-start",
        choices=["sampled", "one"],
        default="sampled",
        help="initial a of the exact EM: the sampled EM's a (default; fewer d×d eigendecompositions) or 1",
    )
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
    ap.add_argument(
        "--methods",
        nargs="+",
        default=["network", "linear", "last_layer", "gridsearch"],
        choices=["network", "linear", "last_layer", "gridsearch", "guard", "ella"],
        help="ctuq rows besides the exact EM: network-Hessian sampled EM, linear-mode sampled EM (the default), last "
        "layer, grid search, the default with the held-out guard (validation: a third of the test split, rows on the "
        "rest), ELLA",
    )
    ap.add_argument(
        "--shifts", action=argparse.BooleanOptionalAction, default=True, help="evaluate the corrupted test sets"
    )
    ap.add_argument("--laplace-torch", dest="lt", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--lt-variants",
        nargs="+",
        metavar="SUBSET:STRUCTURE",
        help="laplace-torch variants to run (default: "
        + " ".join(f"{a}:{b}" for a, b in LT_VARIANTS)
        + ", and all:ella with --methods ella)",
    )
    ap.add_argument("--ella-landmarks", type=int, default=1000, help="ELLA's M (--methods ella; laplace-torch's too)")
    ap.add_argument("--ella-rank", type=int, default=20, help="ELLA's K (--methods ella; laplace-torch's too)")
    ap.add_argument("--lt-timeout", type=float, default=600.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64", help="precision of ctuq's posterior")
    ap.add_argument(
        "--dense-features",
        choices=values(DenseChoice),
        default="auto",
        help="ctuq: assemble Ψ₀ from per-example Jacobians for every solver (always; then CG's products "
        "are GEMMs), only for the exact EM (auto), or never; ELLA's rows always take auto (M rows, K products)",
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
        help="also evaluate the linear-mode sampled posterior with a fixed at these multiples of the EM's a "
        "(test NLL, accuracy, ECE, mean logit std): is the evidence optimum the predictive optimum?",
    )
    args = ap.parse_args(argv)
    if args.marglik_rounds < 0 or args.marglik_epochs < 1:
        ap.error(
            f"--marglik-rounds must be >= 0 and --marglik-epochs >= 1, got {args.marglik_rounds} and "
            f"{args.marglik_epochs}"
        )
    known = [f"{a}:{b}" for a, b in [*LT_VARIANTS, ("all", "ella")]]
    bad = [v for v in args.lt_variants or [] if v not in known]
    if bad:
        ap.error(f"--lt-variants {' '.join(bad)}: each must be one of {', '.join(known)}")
    if not 1 <= args.ella_rank <= args.ella_landmarks:
        ap.error(f"--ella-rank {args.ella_rank} must be in [1, --ella-landmarks {args.ella_landmarks}]")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("CTUQ_NO_PROGRESS", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figures = Path(args.figures) if args.figures else out
    figures.mkdir(parents=True, exist_ok=True)
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
    results_path = out / f"results_{args.recipe}.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for ds in args.datasets:
        d = load_dataset(ds, seed=args.seed)
        shifts = shift_sets(ds, d["Xt"]) if args.shifts else []
        val_idx, eval_idx = validation_split(d["yt"], seed=args.seed)
        for kind in args.models:
            key = f"{ds}/{kind}"
            model = make_model(kind, ds, seed=args.seed)
            wd = f"_wd{args.weight_decay:g}" if args.weight_decay else ""
            tag = "_issue" if args.recipe == "issue" else ""
            cache = out / f"{ds}_{kind}_seed{args.seed}_ep{args.epochs}{wd}{tag}.pt"
            lr, adam_wd = (1e-2, 1e-4) if args.recipe == "issue" else (1e-3, 0.0)
            model, t_train = cached_model(
                cache,
                model,
                lambda m: train_map(
                    m,
                    d["X"],
                    d["y"],
                    epochs=args.epochs,
                    lr=lr,
                    seed=args.seed,
                    weight_decay=args.weight_decay,
                    adam_weight_decay=adam_wd,
                ),
            )
            if args.marglik_rounds:
                ml = out / f"{cache.stem}_marglik{args.marglik_rounds}x{args.marglik_epochs}.pt"
                model, _ = cached_model(ml, model, lambda m: marglik_training(m, d, args))
            n, C = d["X"].shape[0], 10
            print(
                f"\n{key} (recipe {args.recipe}): d = {count_parameters(model)}, n = {n}, n·C = {n * C}, MAP training "
                f"{'cached' if t_train is None else f'{t_train:.0f} s'}; load average {os.getloadavg()}",
                flush=True,
            )
            entries = [run_map(model, d, shifts)]
            lin_rows = la_s = None
            if "network" in args.methods:
                entries += run_ctuq(model, d, shifts, args, exact=False, hessian_at="network")[0]
                print_tables(f"{key} (recipe {args.recipe}, so far)", entries, shifts)
            if "linear" in args.methods:
                lin_rows, la_s = run_ctuq(model, d, shifts, args, exact=False)
                entries += lin_rows
                print_tables(f"{key} (recipe {args.recipe}, so far)", entries, shifts)
                if key == "digits/mlp":
                    print("\nacceptance gates (so far):\n  " + "\n  ".join(gates(entries, None, args.recipe)))
                if args.a_multiples:
                    a_sweep(la_s, d, args)
            fidelity = None
            if "last_layer" in args.methods:
                gc.collect()
                name = "ctuq last-layer linear-mode exact EM"
                entries += run_ctuq(model, d, shifts, args, exact=True, weights="last_layer", name=name)[0]
                print_tables(f"{key} (recipe {args.recipe}, so far)", entries, shifts)
            if "ella" in args.methods:
                # the paper's ELLA: B at the network (with B at the linear mode, the tangent model of K directions
                # cannot fit the labels, its B is large and the predictive stays at MAP's: docs/classification.md);
                # the exact EM in K dimensions, then the held-out guard and, from there, the grid search on the
                # validation third: rows on the other two
                gc.collect()
                name = f"ctuq ELLA (M {args.ella_landmarks}, K {args.ella_rank}) network-B exact EM"
                rows, la_e = run_ctuq(model, d, shifts, args, exact=True, hessian_at="network", name=name, ella=True)
                entries += rows
                if "guard" not in args.methods and "gridsearch" not in args.methods:
                    entries.append(run_map(model, d, shifts, idx=eval_idx, name="MAP (test subset)"))
                t_e = rows[0]["time_s"]
                guard = name.replace("exact EM", "exact EM + held-out guard (test subset)")
                entries += run_guard(la_e, d, shifts, args, val_idx, eval_idx, t_e, name=guard, method="exact")
                grid = name.replace("exact EM", "gridsearch (test subset)")
                entries += run_gridsearch(la_e, d, shifts, args, val_idx, eval_idx, name=grid, t_fit=t_e)
                la_e = None
                # laplace-torch's prior shape (isotropic, no g-prior scales), its a by the same grid
                gc.collect()
                iso = name.replace("network-B exact EM", "isotropic prior, network-B exact EM")
                rows_i, la_i = run_ctuq(
                    model, d, shifts, args, exact=True, hessian_at="network", name=iso, ella=True, prior="isotropic"
                )
                entries += rows_i  # its exact EM's rows (whole test split), computed by run_ctuq anyway
                grid = iso.replace("exact EM", "gridsearch (test subset)")
                t_i = rows_i[0]["time_s"]
                entries += run_gridsearch(la_i, d, shifts, args, val_idx, eval_idx, name=grid, t_fit=t_i)
                la_i = None
                print_tables(f"{key} (recipe {args.recipe}, so far)", entries, shifts)
            if "gridsearch" in args.methods or "guard" in args.methods:
                gc.collect()
                if la_s is None:
                    lin_rows, la_s = run_ctuq(model, d, shifts, args, exact=False)
                sub = [run_map(model, d, shifts, idx=eval_idx, name="MAP (test subset)")]
                sub += [
                    dict(e, method="ctuq linear-mode sampled EM (test subset)")
                    for e in ctuq_rows(la_s, "", d, shifts, args, (0.0, 0.0, 0.0), idx=eval_idx)
                ]
                if "guard" in args.methods:  # before the grid search, which moves a
                    sub += run_guard(la_s, d, shifts, args, val_idx, eval_idx, lin_rows[0]["time_s"])
                if "gridsearch" in args.methods:
                    sub += run_gridsearch(la_s, d, shifts, args, val_idx, eval_idx)
                entries += sub
                print_tables(f"{key} (recipe {args.recipe}, so far)", entries, shifts)
            la_s = None
            gc.collect()
            if have_lt:
                state = {k: v.clone() for k, v in model.state_dict().items()}
                args.model_kind, args.dataset_name = kind, ds
                args.val_idx, args.eval_idx = val_idx, eval_idx
                variants = LT_VARIANTS + ([("all", "ella")] if "ella" in args.methods else [])
                if args.lt_variants:
                    variants = [tuple(v.split(":", 1)) for v in args.lt_variants]
                for subset, structure in variants:
                    got = run_laplace_torch(state, d, shifts, subset, structure, args)
                    entries += got if isinstance(got, list) else [got]
                    e = got[0] if isinstance(got, list) else got
                    msg = e["error"] if "error" in e else f"{e['time_s']:.1f} s, a = {e['a']:.4g}"
                    print(f"  laplace-torch {subset} {structure}: {msg}", flush=True)
            if args.exact == "all" or (args.exact == "auto" and kind == "mlp"):
                gc.collect()
                # started at the sampled EM's a (the same fixed point; each exact step is a d×d eigendecomposition)
                print_tables(f"{key} (recipe {args.recipe}, before the exact EM)", entries, shifts)
                if key == "digits/mlp" and lin_rows is not None:
                    print(
                        "\nacceptance gates (before the exact EM):\n  " + "\n  ".join(gates(entries, None, args.recipe))
                    )
                a0 = lin_rows[0]["a"] if lin_rows is not None and args.exact_start == "sampled" else 1.0
                exact, la_e = run_ctuq(model, d, shifts, args, exact=True, a0=a0)
                entries += exact
                if lin_rows is not None:
                    ref = la_e.predict(d["Xt"], link="mc", samples=1024, seed=args.seed + 1)
                    fidelity = {
                        "a_sampled": lin_rows[0]["a"],
                        "a_exact": exact[0]["a"],
                        "a_ratio": lin_rows[0]["a"] / exact[0]["a"],
                        "symkl_sampled_vs_exact1024": sym_kl(lin_rows[0]["probs"], ref),
                        "symkl_exact_vs_exact1024": sym_kl(exact[0]["probs"], ref),
                        "em_steps_exact": exact[0]["em_steps"],
                    }
                    print(f"  fidelity {fidelity}", flush=True)
                la_e = None
            print_tables(f"{key} (recipe {args.recipe})", entries, shifts)
            paired_with_map(f"{key}, recipe {args.recipe}", entries, d["yt"], eval_idx, args.seed)
            curves = {
                f"{e['method'].replace('ctuq ', '')} ({e['link']})": e["probs"]
                for e in entries
                if "probs" in e
                and "subset" not in e["method"]
                and e["link"] in ("-", "probit", "mc")
                and ("linear-mode sampled" in e["method"] or "network" in e["method"] or e["method"] == "MAP")
            }
            fig = plot_reliability(
                figures / f"reliability_{ds}_{kind}_{args.recipe}.png", f"{key}, recipe {args.recipe}", curves, d["yt"]
            )
            print(f"\nreliability diagrams: {fig}")
            if fidelity:
                print(f"\nfidelity ({key}): " + ", ".join(f"{k} = {v:.4g}" for k, v in fidelity.items()))
            if key == "digits/mlp" and lin_rows is not None:
                print(f"\nacceptance gates of issue 27 ({key}, recipe {args.recipe}):")
                for line in gates(entries, fidelity, args.recipe):
                    print(f"  {line}")
            for e in entries:
                e.pop("probs", None)
            # rows of an earlier run on the same network (same cached weights) whose method this run did not repeat
            # stay: `--methods ella` after `--methods linear guard` adds to the table instead of replacing it
            network = {"cache": cache.name, "marglik": args.marglik_rounds, "d": count_parameters(model), "n": n}
            old = results.get(key, {})
            fresh = {(e["method"], e.get("link")) for e in entries}
            kept = [e for e in old.get("entries", []) if (e.get("method"), e.get("link")) not in fresh]
            if old.get("network") != network:
                kept = []
            results[key] = {
                "entries": kept + entries,
                "fidelity": fidelity or (old.get("fidelity") if kept else None),
                "network": network,
                "d": network["d"],
                "n": n,
            }
            with atomic_path(results_path) as tmp:
                Path(tmp).write_text(json.dumps(results, indent=1, default=float))
    print(f"\nload average at the end {os.getloadavg()}; results in {results_path}")


if __name__ == "__main__":
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    main()
