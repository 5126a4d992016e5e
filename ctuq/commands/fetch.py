"""``ctuq fetch walnut N``: download walnut N (1–42) of the Der Sarkissian et al. (2019) cone-beam data set from its
Zenodo record into ``DEST/WalnutN``, resuming an interrupted download and checking the record's md5.

The archive (a few GB) is downloaded to ``DEST/WalnutN.zip.part`` (kept when the connection drops: run the command
again to resume), verified, unpacked and checked as a walnut folder; then ``ctuq reconstruct --data DEST/WalnutN``
reads it. ``--base-url`` or ``$CTUQ_ZENODO_URL`` points the download at another server (a mirror).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ctuq.commands import command_parser
from ctuq.data.walnut_records import BASE_URL_ENV, DEFAULT_BASE_URL, N_WALNUTS, WALNUT_RECORDS
from ctuq.registry import lazy_module

fetch = lazy_module("ctuq.data.fetch")  # the downloader: imported when a fetch starts, not for --help

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``ctuq fetch`` with ``subparsers``; returns its parser."""
    records = "\n".join(
        f"  walnuts {r.first:2d}–{r.last:2d}  {r.doi_url}" + (f"  (version record {r.version})" if r.version else "")
        for r in WALNUT_RECORDS
    )
    p = command_parser(
        subparsers,
        "fetch",
        __doc__,
        "  ctuq fetch walnut 1 --dest /data          # -> /data/Walnut1 (run again to resume if interrupted)\n"
        "  ctuq reconstruct --config walnut_2d_60 --data /data/Walnut1 --device cuda\n"
        f"  {BASE_URL_ENV}=https://mirror.example ctuq fetch walnut 9   # another server with Zenodo's API\n",
        extra="\n\nrecords:\n" + records,
    )
    p.add_argument("dataset", choices=("walnut",), help="the data set (walnut: Der Sarkissian et al. 2019)")
    p.add_argument("number", type=int, metavar="N", help=f"walnut number, 1–{N_WALNUTS}")
    p.add_argument("--dest", default=".", metavar="DIR", help="folder to put WalnutN into (default: current folder)")
    p.add_argument(
        "--base-url",
        metavar="URL",
        help=f"server with Zenodo's records API (default: ${BASE_URL_ENV}, else {DEFAULT_BASE_URL})",
    )
    p.add_argument("--record", type=int, metavar="ID", help="read this Zenodo record id instead of the table's")
    p.add_argument("--keep-archive", action="store_true", help="keep WalnutN.zip after unpacking it")
    p.add_argument(
        "--retries", type=int, default=3, metavar="K", help="resume up to K times when the connection drops (default 3)"
    )
    p.add_argument(
        "--timeout", type=float, default=60.0, metavar="S", help="seconds to wait for an answer (default 60)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``ctuq fetch`` for parsed ``args`` (:func:`ctuq.data.fetch.fetch_walnut`); user errors propagate to
    :func:`ctuq.cli.main`."""
    dest = Path(args.dest)
    # the folders this fetch creates: dest and any missing parent
    created = [p for p in (dest, *dest.parents) if not p.exists()]
    try:
        res = fetch.fetch_walnut(
            args.number,
            dest,
            base=args.base_url,
            record=args.record,
            keep_archive=args.keep_archive,
            retries=args.retries,
            timeout=args.timeout,
            progress=not args.no_progress,
        )
    except BaseException:
        # a fetch that failed before it wrote anything (offline, a bad record) leaves no empty --dest behind; a
        # partial download stays for the next attempt to resume
        for folder in created:  # deepest first
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise
    folder = res["folder"]
    if res["archive"] is None:
        what = "already there (nothing downloaded)"
    else:
        rec = res["archive"]
        verb = "downloaded" if res["downloaded"] else "unpacked the verified archive already in --dest"
        size_mb = res["bytes"] / 1e6
        what = f"{verb} {rec.name} ({size_mb:.1f} MB, md5 {rec.md5}, record {rec.record}) in {res['time_s']:.1f} s"
    print(f"ctuq fetch: {folder}: {what}; use it with `ctuq reconstruct --data {folder}`", file=sys.stderr)
    return 0
