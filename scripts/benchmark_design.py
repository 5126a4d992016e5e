#!/usr/bin/env python
"""Benchmark of one greedy design after the pilot DIP fit: set-up, per-step cost and its growth, total.

What it reproduces: the cost tables of docs/experimental_design.md §6 ("Costs": the `tiny` design with
``--priors dip``, the isotropic and Matérn-½ totals with the plain command, the `small` U-Net with
``--preset small --priors dip --criterion ese``; the history of those figures: docs/notebook/experimental_design.md).

The setting of the published study by default: one 128² rectangles image, 200 candidate angles × 183 detector
pixels (parallel beam), a 5-angle pilot, 35 acquisitions, noise 5 % of mean |Tx|, the CPU-demo U-Net (preset
``tiny``) fitted on the pilot. For each prior the table gives: the linearisation (DIP: the Jacobian assembled with
d JVPs when ``dense`` is chosen), the prior's hyperparameters, the reset on the pilot (bordered Cholesky, samples),
the 35 steps (mean, first 5, last 5: the growth with the number of chosen angles), the prior updates (DIP: g-prior
and ``a`` refreshed every 5 angles), and the total after the DIP fit — wall time, and the process CPU time divided
by the thread count (the wall time on an idle machine; the two differ when other jobs share the cores).

    python scripts/benchmark_design.py                                  # dip (eig), isotropic, matern; m = 1000
    python scripts/benchmark_design.py --priors dip --samples 3000 1000 300 --criterion ese
    python scripts/benchmark_design.py --device cuda --preset walnut --samples 3000   # GPU: walnut-size U-Net
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

from ctuq.config import DesignConfig
from ctuq.data.rectangles import parallel_geometry, rectangles_image
from ctuq.design import DesignEngine, auto_route, equidistant_indices, greedy_design
from ctuq.design.dip_prior import DIPPrior
from ctuq.design.priors import isotropic_model, matern_model
from ctuq.models import build_unet, count_parameters, make_net_input
from ctuq.operators import SparseRayTransform
from ctuq.reconstruct.dip import fit_dip
from ctuq.utils import tune_malloc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--candidates", type=int, default=200)
    p.add_argument("--pilot", type=int, default=5)
    p.add_argument("--acquire", type=int, default=35)
    p.add_argument("--samples", type=int, nargs="+", default=[1000])
    p.add_argument(
        "--priors", nargs="+", default=["dip", "isotropic", "matern"], choices=("dip", "isotropic", "matern")
    )
    p.add_argument("--criterion", default="eig", choices=("eig", "ese", "diag_eig"))
    p.add_argument("--route", default="auto", choices=("auto", "exact", "sampled"))
    p.add_argument("--refresh-every", type=int, default=5)
    p.add_argument("--dense", default="auto", choices=("auto", "always", "never"))
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dip-iterations", type=int, default=1000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("CTUQ_NO_PROGRESS", "1")

    dev = torch.device(args.device)
    img, _ = rectangles_image(np.random.default_rng(args.seed), args.size)
    x = torch.from_numpy(img).to(dev)
    vol, geo = parallel_geometry(args.size, np.arange(args.candidates) * math.pi / args.candidates)
    op = SparseRayTransform(vol, geo, device=dev)
    y0 = op(x)
    sigma = 0.05 * float(y0.abs().mean())
    y = y0 + sigma * torch.randn(y0.shape, generator=torch.Generator().manual_seed(1)).to(y0)
    pilot = equidistant_indices(args.candidates, args.pilot).tolist()
    torch.manual_seed(args.seed)
    net = build_unet(args.preset, ndim=2).to(dev)
    ni = make_net_input((args.size, args.size), seed=args.seed)
    t0 = time.perf_counter()
    fit_dip(
        op.subset(pilot),
        y[pilot],
        model=net,
        net_input=ni,
        iterations=args.dip_iterations,
        lr=3e-3,
        tv_weight=1e-4,
        scale=1.0,
        progress=False,
        device=dev,
    )
    fit_s = time.perf_counter() - t0
    threads = torch.get_num_threads()
    print(
        f"# {args.size}² image, {args.candidates} candidates × {op.measurement_shape[1]} detector pixels, pilot "
        f"{args.pilot}, {args.acquire} steps, U-Net {args.preset} (d = "
        f"{count_parameters(net, conv_weights_only=True)}), device {dev}, {threads} threads; pilot DIP fit "
        f"{fit_s:.1f} s (not in the totals); glibc malloc tuned: {'yes' if tune_malloc() else 'no'}\n"
    )
    cols = [
        "prior",
        "criterion",
        "route",
        "m",
        "linearise s",
        "prior s",
        "reset s",
        "step s (mean)",
        "first 5",
        "last 5",
        "updates s",
        "total s",
        "CPU s / threads",
    ]
    print("| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|")
    for prior in args.priors:
        for m in args.samples if prior == "dip" or args.route == "sampled" else args.samples[:1]:
            c0, t0 = time.process_time(), time.perf_counter()
            lin = 0.0
            updater = None
            if prior == "dip":
                ds = DesignConfig(refresh_every=args.refresh_every, dense=args.dense)
                dp = DIPPrior(net, ni, op, y, 1.0, settings=ds, sigma2=sigma**2)
                model = dp.build(pilot, n_steps=args.acquire)
                lin, updater = dp.timings["linearize_s"], dp.updater
            elif prior == "isotropic":
                model = isotropic_model(op, pilot, y[pilot].reshape(-1).double(), sigma**2)
            else:
                model = matern_model(op, pilot, y[pilot].reshape(-1).double(), sigma**2)
            route = (
                auto_route(model, updater is not None and args.refresh_every > 0)
                if args.route == "auto"
                else args.route
            )
            prior_s = time.perf_counter() - t0 - lin
            eng = DesignEngine(model, route=route, n_samples=m, seed=args.seed)
            res = greedy_design(
                eng,
                pilot,
                args.acquire,
                criterion=args.criterion,
                jitter=0.01,
                updater=updater,
                angles_deg=np.arange(args.candidates) * 180.0 / args.candidates,
                progress=False,
            )
            total = time.perf_counter() - t0
            cpu = (time.process_time() - c0) / threads
            st = [s["time_s"] for s in res.steps]
            row = [
                prior,
                args.criterion,
                route,
                m if route == "sampled" else "–",
                f"{lin:.1f}",
                f"{prior_s:.1f}",
                f"{res.timings['setup_s']:.2f}",
                f"{np.mean(st):.3f}",
                f"{np.mean(st[:5]):.3f}",
                f"{np.mean(st[-5:]):.3f}",
                f"{res.timings['updates_s']:.1f}",
                f"{total:.1f}",
                f"{cpu:.1f}",
            ]
            print("| " + " | ".join(map(str, row)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    sys.exit(main())
