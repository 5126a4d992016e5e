#!/usr/bin/env python
"""Time the ray-transform backends: forward / adjoint per call and throughput (images/s) per batch size.

What it measures for the docs: the ray transform's share of the inference cost floor in DESIGN.md §5 (a batched
sparse product per sample, next to the network's Jacobian products); the guide's "Test" section (docs/guide.md)
lists it with the benchmarks.

Setting: the walnut sparse 2D scan (DESIGN.md §4) — fan beam, 60 angles over 360°, 128 detector columns of
0.1496 × 6 mm, source–origin 66 mm, source–detector 199 mm — on a 128² and a 501² grid over the same 50.1 mm field
of view. Backends: the sparse matrix (CPU; CUDA when available) and ASTRA CUDA (when available: batched 2D
fan beam, and a 3D cone-beam volume with a 128-row detector). ``--fbp`` adds the torch FBP per batch.

Timing: one warm-up call, then ``--repeats`` calls, each bracketed by CUDA synchronisation on the GPU; the table
shows the median (and the minimum in the throughput column's basis). Other processes on the machine make CPU
timings noisy: repeat a run before trusting a difference.

Examples::

    python scripts/benchmark_operators.py                       # CPU (and GPU if present), defaults
    python scripts/benchmark_operators.py --device cpu --sizes 128 --batches 1 8 --repeats 10
    python scripts/benchmark_operators.py --device cuda --cone-size 256
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import SparseRayTransform
from ctuq.operators.fbp import fbp
from ctuq.utils import tune_malloc

FOV_MM = 50.1  # the walnut ground truth: 501 voxels of 0.1 mm
SOURCE_ORIGIN, SOURCE_DETECTOR = 66.0, 199.0
DET_PIXEL, DET_COLS, N_ANGLES = 0.1496 * 6, 128, 60


def walnut_fan_geometry(n_angles: int = N_ANGLES) -> ProjectionGeometry:
    """The sparse 2D walnut geometry as ``fanflat_vec`` (counter-clockwise source orbit, flat detector)."""
    rows = []
    for b in np.linspace(0, 2 * math.pi, n_angles, endpoint=False):
        e, p = np.array([math.cos(b), math.sin(b)]), np.array([-math.sin(b), math.cos(b)])
        s = SOURCE_ORIGIN * e
        rows.append(np.concatenate([s, s - SOURCE_DETECTOR * e, DET_PIXEL * p]))
    return ProjectionGeometry("fanflat_vec", (DET_COLS,), vectors=np.array(rows))


def walnut_cone_geometry(n_rows: int, n_angles: int = N_ANGLES) -> ProjectionGeometry:
    """A circular cone-beam orbit with walnut distances and ``n_rows × 128`` detector pixels of 0.8976 mm."""
    rows = []
    for b in np.linspace(0, 2 * math.pi, n_angles, endpoint=False):
        e, p = np.array([math.cos(b), math.sin(b), 0.0]), np.array([-math.sin(b), math.cos(b), 0.0])
        s = SOURCE_ORIGIN * e
        rows.append(np.concatenate([s, s - SOURCE_DETECTOR * e, DET_PIXEL * p, [0.0, 0.0, DET_PIXEL]]))
    return ProjectionGeometry("cone_vec", (n_rows, DET_COLS), vectors=np.array(rows))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, arg, device: torch.device, repeats: int) -> list[float]:
    """Seconds per call of ``fn(arg)``: one warm-up call, then ``repeats`` synchronised calls."""
    with torch.no_grad():
        fn(arg)
        _sync(device)
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            fn(arg)
            _sync(device)
            times.append(time.perf_counter() - t0)
    return times


def bench_operator(rows, label, op, batches, repeats, fbp_too):
    device = op.device
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        try:
            x = torch.rand((b, *op.image_shape), generator=gen).to(device)
            y = torch.rand((b, *op.measurement_shape), generator=gen).to(device)
            tf = time_calls(op.forward, x, device, repeats)
            ta = time_calls(op.adjoint, y, device, repeats)
            row = dict(
                label,
                batch=b,
                fwd_ms=1e3 * statistics.median(tf),
                adj_ms=1e3 * statistics.median(ta),
                fwd_ips=b / statistics.median(tf),
                adj_ips=b / statistics.median(ta),
                fwd_min_ms=1e3 * min(tf),
                adj_min_ms=1e3 * min(ta),
            )
            if fbp_too:
                tb = time_calls(lambda t: fbp(op, t), y, device, max(1, repeats // 2))
                row["fbp_ms"] = 1e3 * statistics.median(tb)
            rows.append(row)
            print_row(row, fbp_too)
        except (RuntimeError, MemoryError) as exc:  # e.g. out of memory at a large batch: report, go on
            print(
                f"  {label['device']:<6} {label['backend']:<11} {label['size']:>5} {b:>6}  failed: {exc}",
                file=sys.stderr,
            )
        finally:
            x = y = None
            if device.type == "cuda":
                torch.cuda.empty_cache()


HEADER = (
    f"  {'device':<6} {'backend':<11} {'size':>5} {'batch':>6} {'fwd ms/call':>12} {'adj ms/call':>12} "
    f"{'fwd img/s':>10} {'adj img/s':>10} {'fwd min ms':>11} {'adj min ms':>11}"
)


def print_row(r, fbp_too):
    line = (
        f"  {r['device']:<6} {r['backend']:<11} {r['size']:>5} {r['batch']:>6} {r['fwd_ms']:>12.3f} "
        f"{r['adj_ms']:>12.3f} {r['fwd_ips']:>10.1f} {r['adj_ips']:>10.1f} {r['fwd_min_ms']:>11.3f} "
        f"{r['adj_min_ms']:>11.3f}"
    )
    if fbp_too:
        line += f" {r.get('fbp_ms', float('nan')):>10.1f}"
    print(line, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 501], help="image sizes n (n×n, 50.1 mm FOV)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128], help="batch sizes")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CPU, plus CUDA when available"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (after one warm-up)")
    parser.add_argument(
        "--cone-size",
        type=int,
        default=128,
        help="GPU only: n for the n³ cone-beam volume (n detector rows); 0 skips it",
    )
    parser.add_argument("--cone-batches", type=int, nargs="+", default=[1, 4], help="batch sizes of the 3D case")
    parser.add_argument("--fbp", action="store_true", help="also time the torch FBP of each batch")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice; on a busy machine 1 can be faster)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    if args.repeats < 1 or min(args.batches) < 1 or min(args.sizes) < 2:
        parser.error("--repeats, --batches must be positive and --sizes at least 2")

    devices = []
    if args.device in ("auto", "cpu"):
        devices.append(torch.device("cpu"))
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")
        devices.append(torch.device("cuda"))
    astra_cuda = False
    if any(d.type == "cuda" for d in devices):
        from ctuq.operators.astra_cuda import cuda_available

        astra_cuda = cuda_available()

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
        + (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
        + f"; fan beam {N_ANGLES} angles × {DET_COLS} columns, median of {args.repeats} calls"
    )
    geometry = walnut_fan_geometry()
    rows = []
    print(HEADER + (f" {'fbp ms':>10}" if args.fbp else ""))
    for n in args.sizes:
        volume = VolumeGeometry((n, n), FOV_MM / n)
        t0 = time.perf_counter()
        sparse_cpu = SparseRayTransform(volume, geometry)
        setup = time.perf_counter() - t0
        print(f"  (sparse {n}²: assembled in {setup:.1f} s, nnz {sparse_cpu.nnz / 1e6:.2f} M)", flush=True)
        for device in devices:
            op = sparse_cpu if device.type == "cpu" else sparse_cpu.to(device)
            bench_operator(
                rows, dict(device=device.type, backend="sparse", size=n), op, args.batches, args.repeats, args.fbp
            )
            if device.type == "cuda" and astra_cuda:
                from ctuq.operators.astra_cuda import AstraCudaRayTransform

                astra_op = AstraCudaRayTransform(volume, geometry, device=device)
                bench_operator(
                    rows,
                    dict(device="cuda", backend="astra_cuda", size=n),
                    astra_op,
                    args.batches,
                    args.repeats,
                    args.fbp,
                )
                astra_op.close()
        del sparse_cpu
    if astra_cuda and args.cone_size > 0:
        from ctuq.operators.astra_cuda import AstraCudaRayTransform

        n = args.cone_size
        volume = VolumeGeometry((n, n, n), FOV_MM / n)
        op3 = AstraCudaRayTransform(volume, walnut_cone_geometry(n), device="cuda")
        print(f"  (3D cone beam: {n}³ volume, {N_ANGLES} angles × {n} × {DET_COLS} detector)")
        bench_operator(
            rows, dict(device="cuda", backend="astra_3d", size=n), op3, args.cone_batches, args.repeats, args.fbp
        )
        op3.close()
    elif any(d.type == "cuda" for d in devices) and not astra_cuda:
        print("  (ASTRA CUDA unavailable: astra_cuda rows and the 3D cone-beam case skipped)")
    return 0


if __name__ == "__main__":
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    sys.exit(main())
