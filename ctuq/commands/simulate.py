"""``ctuq simulate``: write a simulated cone-beam scan of a synthetic walnut in the walnut data set's layout (or, with
``--layout``, as a scan.yaml with .npy / TIFF arrays or as NXtomo, the same scan in each: docs/data_formats.md).

The output folder looks like a ``Walnut{id}`` folder of Der Sarkissian et al. (2019) — ``Projections/tubeV{o}/``
with raw uint16 projections, dark, flats and the corrected ``cone_vec`` geometry, and ``Reconstructions/`` with
the ground-truth slices — plus ``ctuq_simulation.json`` recording every parameter and the phantom. Every
``ctuq`` loader reads it like the real data. Presets size the scan; options override single values.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ctuq.commands import command_parser
from ctuq.data.presets import SCAN_PRESETS
from ctuq.log import run_log
from ctuq.options import PhantomKind, values
from ctuq.pipeline.run_folder import LOG_NAME
from ctuq.registry import lazy_module

pipeline_simulate = lazy_module("ctuq.pipeline.simulate")  # the work: imported when a run starts, not for --help

#: The layouts of the built-in scan formats (tests/data/test_formats.py checks them against the registry); a
#: format registered later adds its own, which --layout accepts too.
BUILT_IN_LAYOUTS = ("walnut", "yaml-npy", "yaml-tiff", "nxtomo")

__all__ = ["add_parser", "run"]

_log = logging.getLogger(__name__)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``ctuq simulate`` with ``subparsers``; returns its parser."""
    presets = "\n".join(f"  {name:8s} {info['help']}" for name, info in SCAN_PRESETS.items())
    p = command_parser(
        subparsers,
        "simulate",
        __doc__,
        "  ctuq simulate --out my_scan                       # the 'bundled' preset (~20 s, ~1.8 MB)\n"
        "  ctuq simulate --preset bundled --out data/Walnut1 --overwrite   # regenerate the bundled scan\n"
        "  ctuq simulate --preset tiny --no-noise --out /tmp/exact          # noise-free, for checks\n"
        "  ctuq simulate --preset bundled --seed 3 --projections 481 --out scans/w3  # other nut, 480 angles\n"
        "  ctuq simulate --preset walnut --out scans/full    # the real sizes: ~12 CPU hours, ~5 GB\n"
        "  ctuq simulate --phantom textured --seed 2 --out scans/t2   # textured object instead of a walnut\n"
        "  ctuq simulate --layout yaml-npy --out scans/y      # scans/y/scan.yaml + .npy counts, flats, darks\n"
        "  ctuq simulate --preset tiny --no-corrections --layout walnut yaml-npy yaml-tiff nxtomo --out scans/all\n"
        "\n"
        "Load the result with ctuq.data.load_data(PATH, ...) or `ctuq reconstruct --data PATH` (PATH: the walnut\n"
        "folder, the scan.yaml, or the .nxs file).\n",
        extra="\n\npresets:\n" + presets,
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (new or empty)")
    # No argparse choices: a bad value is the one-line error of the pipeline, naming the valid layouts.
    p.add_argument(
        "--layout",
        nargs="+",
        default=[BUILT_IN_LAYOUTS[0]],
        metavar="LAYOUT",
        help=f"file layout(s) of the scan, among {', '.join(BUILT_IN_LAYOUTS)} (default walnut) and those of scan "
        "formats registered in ctuq.registry.DATA_FORMATS: the walnut data set's folder; scan.yaml with .npy arrays "
        "or TIFF stacks; NXtomo (scan.nxs; needs --no-corrections). Several layouts write the same counts and "
        "geometry into DIR/<layout>/ each (docs/data_formats.md)",
    )
    p.add_argument("--preset", choices=sorted(SCAN_PRESETS), default="bundled", help="size preset (default: bundled)")
    # No argparse choices: a bad value is then the one-line `ctuq simulate: --phantom ...` error of the pipeline.
    p.add_argument(
        "--phantom",
        default=PhantomKind.WALNUT.value,
        metavar="|".join(values(PhantomKind)),
        help="object to scan: the ellipsoid walnut (exact line integrals; default), a textured z-invariant "
        "phantom (multi-scale texture, organs, trabecular bone; line integrals through a fine voxel image with "
        "sub-rays) or a laminate (parallel plates along one seeded direction; exact line integrals)",
    )
    g = p.add_argument_group("scan (override the preset)")
    g.add_argument(
        "--projections",
        type=int,
        metavar="N",
        dest="n_projections",
        help="projection files per orbit; N−1 distinct angles over 360°, the last repeats the first",
    )
    g.add_argument("--det-rows", type=int, metavar="R", help="detector rows")
    g.add_argument("--det-cols", type=int, metavar="C", help="detector columns")
    g.add_argument("--pixel-size", type=float, metavar="MM", help="detector column pitch (mm)")
    g.add_argument("--row-pixel-size", type=float, metavar="MM", help="detector row pitch (mm; default: --pixel-size)")
    g.add_argument("--source-origin", type=float, metavar="MM", help="source–rotation-axis distance (mm)")
    g.add_argument("--source-detector", type=float, metavar="MM", help="source–detector distance (mm)")
    g.add_argument(
        "--orbits",
        type=int,
        nargs="+",
        choices=(1, 2, 3),
        metavar="O",
        help="orbits to simulate among 1 2 3 (2: source in z = 0; 1/3: above/below)",
    )
    g.add_argument("--orbit-height", type=float, metavar="MM", help="source height of orbits 1 (+) and 3 (−) (mm)")
    g.add_argument(
        "--no-corrections", action="store_true", help="ideal circular geometry (no per-orbit detector tilt/offset)"
    )
    g.add_argument("--supersampling", type=int, metavar="S", help="sub-rays per detector pixel and axis")
    g = p.add_argument_group("ground truth")
    g.add_argument("--gt-shape", type=int, nargs=3, metavar=("NZ", "NY", "NX"), help="ground-truth volume shape")
    g.add_argument("--gt-voxel-size", type=float, metavar="MM", help="ground-truth voxel size (mm)")
    g.add_argument("--gt-supersampling", type=int, metavar="S", help="samples per voxel and axis")
    g = p.add_argument_group("counts and noise")
    g.add_argument("--flat-counts", type=float, metavar="I0", help="mean flat-field counts per pixel")
    g.add_argument("--dark-counts", type=float, metavar="D", help="mean dark offset (counts)")
    g.add_argument("--read-noise", type=float, metavar="SIGMA", help="Gaussian read noise (counts)")
    g.add_argument("--no-noise", action="store_true", help="exact counts (only rounded to integers)")
    g.add_argument("--no-compress", action="store_true", help="uncompressed TIFFs (default: lossless zlib)")
    g.add_argument("--seed", type=int, help="seed of the phantom, detector patterns and noise (default 0)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a scan previously simulated into --out (only its scan files are removed)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``ctuq simulate`` for parsed ``args`` (:func:`ctuq.pipeline.simulate.simulate`); user errors propagate
    to :func:`ctuq.cli.main`."""
    overrides = {
        key: getattr(args, key)
        for key in (
            "n_projections",
            "det_rows",
            "det_cols",
            "pixel_size",
            "row_pixel_size",
            "source_origin",
            "source_detector",
            "orbit_height",
            "supersampling",
            "gt_voxel_size",
            "gt_supersampling",
            "flat_counts",
            "dark_counts",
            "read_noise",
            "seed",
        )
    }
    if args.orbits:
        overrides["orbits"] = tuple(args.orbits)
    if args.gt_shape:
        overrides["gt_shape"] = tuple(args.gt_shape)
    if args.no_corrections:
        overrides["corrections"] = False
    if args.no_noise:
        overrides["noise"] = False
    if args.no_compress:
        overrides["compress"] = False
    # deferred: the simulator refuses a non-empty folder, so the log is written once the scan is
    with run_log(Path(args.out) / LOG_NAME, deferred=True):
        res = pipeline_simulate.simulate(
            args.out,
            args.preset,
            overrides=overrides,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            phantom=args.phantom,
            layouts=tuple(args.layout),
        )
        params = res["params"]
        _log.info(
            f"wrote {res['out']} ({' + '.join(res['layouts'])} layout, {args.phantom} phantom, "
            f"{params.n_projections - 1} angles × orbits {list(params.orbits)}"
            + (" (+ the walnut layout's closing projection at the first angle)" if "walnut" in res["layouts"] else "")
            + ", "
            f"detector {params.det_rows}×{params.det_cols}, ground truth {list(params.gt_shape)} at "
            f"{params.gt_voxel_size} mm; {res['bytes'] / 1e6:.1f} MB) in {res['time_s']:.1f} s"
        )
    return 0
