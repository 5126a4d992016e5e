"""Download a walnut of the Der Sarkissian et al. (2019) cone-beam data set from its public Zenodo records
(``ctuq fetch walnut N``) and unpack it into the walnut layout :mod:`ctuq.data.walnut` reads.

The data set ("A cone-beam X-ray computed tomography data collection designed for machine learning", Scientific
Data 6, 215, 2019) lies in six Zenodo records, one archive ``Walnut{N}.zip`` per walnut (a few GB each). The
record of each walnut range is the DOI the authors publish (their reconstruction code's README,
``cicwi/WalnutReconstructionCodes``): these are *concept* records, which Zenodo resolves to the newest version.
Where the version record is confirmed (walnuts 1–8: ``zenodo.2686726``, cited as "Samples 1-8") it is asked for
first; :data:`WALNUT_RECORDS` is the one table of them.

Steps (:func:`fetch_walnut`):

1. the record's metadata ``{base}/api/records/{id}`` (JSON): the file's size, its ``md5`` as Zenodo publishes
   it (``"checksum": "md5:…"``) and its download link. A concept id that the API does not resolve (it answers
   404 for some) is resolved through the record page ``{base}/records/{concept}``, which redirects to the newest
   version;
2. the archive into ``DEST/Walnut{N}.zip.part``, resumed with an HTTP ``Range`` request from the bytes already
   there (across runs, and up to ``retries`` times within one run when the connection drops), then checked
   against the size and md5 and renamed to ``DEST/Walnut{N}.zip``. A checksum mismatch removes the partial file;
3. unpacked into a hidden folder beside the target (members that would land outside it are refused), checked
   with :class:`ctuq.data.walnut.WalnutScan` for every ``Projections/tubeV*`` orbit, and renamed to
   ``DEST/Walnut{N}``; the archive is then removed unless ``keep_archive``.

``base_url`` (default ``$CTUQ_ZENODO_URL``, else ``https://zenodo.org``) points everything at another server: a
mirror, or the tests' local one. Every failure is a :class:`FetchError` (a :class:`ctuq.errors.CTUQError`) whose
one-line message names the URL or file and what to do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from ctuq import __version__
from ctuq.data.walnut import WalnutFormatError, WalnutScan
from ctuq.data.walnut_records import BASE_URL_ENV, DEFAULT_BASE_URL, N_WALNUTS, WALNUT_RECORDS, WalnutRecord
from ctuq.errors import CTUQError
from ctuq.utils import progress as _progress_bar

__all__ = [
    "ChecksumError",
    "FetchError",
    "RemoteFile",
    "base_url",
    "download",
    "fetch_walnut",
    "resolve_walnut",
    "unpack_walnut",
    "walnut_record",
]

ARCHIVE_PATTERN = "Walnut{}.zip"
FOLDER_PATTERN = "Walnut{}"
PART_SUFFIX = ".part"
_CHUNK = 1 << 20  # bytes per read: large enough for full speed, small enough for a smooth progress bar
_RECORD_IN_URL = re.compile(r"/records?/(\d+)(?:[/?#]|$)")


class FetchError(CTUQError):
    """A download cannot be done: no connection, an HTTP error, a record without the file, a full disk, a damaged
    archive. The message names the URL or file and what to do (one line)."""


class ChecksumError(FetchError):
    """A downloaded file's size or md5 differs from the record's; the partial file has been removed."""


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """A file of a record: ``name``, download ``url``, ``size`` (bytes, or ``None`` when the record omits it),
    ``md5`` (32 lowercase hex digits) and the ``record`` id (a version) it came from."""

    name: str
    url: str
    size: int | None
    md5: str
    record: int


def walnut_record(n: int) -> WalnutRecord:
    """The :class:`WalnutRecord` that holds walnut ``n`` (1 … 42); :class:`FetchError` for another number."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise FetchError(f"walnut: the walnut number must be an integer 1–{N_WALNUTS}, got {n!r}")
    for rec in WALNUT_RECORDS:
        if rec.first <= n <= rec.last:
            return rec
    raise FetchError(f"walnut: there is no walnut {n} in the data set; walnuts are numbered 1–{N_WALNUTS}")


def base_url(url: str | None = None) -> str:
    """``url``, else ``$CTUQ_ZENODO_URL``, else ``https://zenodo.org``; without a trailing slash.
    :class:`FetchError` unless it is an ``http(s)://host…`` URL."""
    chosen = url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL
    parts = urllib.parse.urlsplit(chosen)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        where = "--base-url" if url else f"${BASE_URL_ENV}"
        raise FetchError(f"{where}: {chosen!r} is not an http:// or https:// URL")
    return chosen.rstrip("/")


# --------------------------------------------------------------------------------------------- HTTP
def _network_hint() -> str:
    return (
        f"check the network connection (and proxy settings: $https_proxy), or point ${BASE_URL_ENV} / --base-url "
        f"at a reachable mirror"
    )


def _open(url: str, *, headers: dict | None = None, timeout: float = 60.0):
    """``urlopen`` of a GET request; connection failures become a one-line :class:`FetchError`. HTTP errors are
    raised as ``urllib.error.HTTPError`` for the caller to word (404 and 416 mean different things per call)."""
    req = urllib.request.Request(url, headers={"User-Agent": f"ctuq/{__version__}", **(headers or {})})
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError:
        raise
    except urllib.error.URLError as exc:
        reason = exc.reason
        text = reason.strerror if isinstance(reason, OSError) and reason.strerror else str(reason)
        raise FetchError(f"{url}: cannot connect ({text}); {_network_hint()}") from exc
    except TimeoutError as exc:
        raise FetchError(f"{url}: no answer within {timeout:g} s; {_network_hint()}") from exc
    except (http.client.HTTPException, ConnectionError) as exc:
        raise FetchError(f"{url}: the connection failed ({type(exc).__name__}: {exc}); {_network_hint()}") from exc


def _http_error(url: str, exc: urllib.error.HTTPError, what: str) -> FetchError:
    later = "; the server is busy or down, try again later" if exc.code == 429 or exc.code >= 500 else ""
    return FetchError(f"{url}: HTTP {exc.code} {exc.reason} while {what}{later}")


def _get_json(url: str, timeout: float) -> dict:
    with _open(url, headers={"Accept": "application/json"}, timeout=timeout) as resp:
        raw = resp.read()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FetchError(f"{url}: the record's metadata is not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise FetchError(f"{url}: the record's metadata is not a JSON object")
    return data


def _record_files(data: dict) -> list[dict]:
    """The file entries of a Zenodo record's JSON: the legacy list ``files: [...]`` or InvenioRDM's
    ``files: {"entries": {name: {...}}}``."""
    files = data.get("files")
    if isinstance(files, dict):
        entries = files.get("entries") or {}
        files = [dict(v, key=v.get("key", k)) for k, v in entries.items()] if isinstance(entries, dict) else entries
    return [f for f in files or [] if isinstance(f, dict)]


def _remote_file(data: dict, record: int, name: str, base: str, meta_url: str) -> RemoteFile:
    files = _record_files(data)
    for f in files:
        if (f.get("key") or f.get("filename")) != name:
            continue
        checksum = str(f.get("checksum") or "")
        algo, _, digest = checksum.rpartition(":")
        if algo.lower() not in ("", "md5") or not re.fullmatch(r"[0-9a-fA-F]{32}", digest):
            raise FetchError(f"{meta_url}: the record gives no md5 checksum for {name} (got {checksum!r})")
        links = f.get("links") if isinstance(f.get("links"), dict) else {}
        url = links.get("self") or links.get("content") or f"{base}/api/records/{record}/files/{name}/content"
        size = f.get("size", f.get("filesize"))
        return RemoteFile(
            name=name,
            url=str(url),
            size=int(size) if isinstance(size, (int, float)) and size >= 0 else None,
            md5=digest.lower(),
            record=record,
        )
    have = ", ".join(sorted(str(f.get("key") or f.get("filename")) for f in files)) or "none"
    raise FetchError(f"{meta_url}: record {record} has no file {name} (it has: {have})")


def _resolve_concept(base: str, concept: int, timeout: float) -> int:
    """The version record a concept id's record page redirects to (Zenodo: ``/records/{concept}`` → newest)."""
    page = f"{base}/records/{concept}"
    try:
        with _open(page, timeout=timeout) as resp:
            final = resp.geturl()
    except urllib.error.HTTPError as exc:
        raise _http_error(page, exc, f"resolving concept record {concept} to its newest version") from exc
    m = _RECORD_IN_URL.search(urllib.parse.urlsplit(final).path)
    if not m or int(m.group(1)) == concept:
        raise FetchError(
            f"{page}: does not lead to a version record (ended at {final}); give the record id of the version that "
            f"holds the walnut with --record"
        )
    return int(m.group(1))


def resolve_walnut(n: int, *, base: str | None = None, record: int | None = None, timeout: float = 60.0) -> RemoteFile:
    """Where to download walnut ``n`` from and what it must hash to, read from the record's metadata now.

    Parameters
    ----------
    n : int
        Walnut number, 1 … 42.
    base : str, optional
        Server root (:func:`base_url`: default ``$CTUQ_ZENODO_URL`` or ``https://zenodo.org``).
    record : int, optional
        A Zenodo record id to read instead of the table's (e.g. a specific version).
    timeout : float
        Seconds to wait for each answer.

    Returns
    -------
    RemoteFile
        ``Walnut{n}.zip``'s URL, size (bytes), md5 and record id. :class:`FetchError` when the server cannot be
        reached, the record is missing or lacks the file.
    """
    rec = walnut_record(n)
    base = base_url(base)
    name = ARCHIVE_PATTERN.format(n)
    if record is not None:
        candidates = [int(record)]
    else:
        candidates = [rec.version] if rec.version is not None else []
        candidates.append(rec.concept)
    last: FetchError | None = None
    for rid in candidates:
        meta_url = f"{base}/api/records/{rid}"
        try:
            data = _get_json(meta_url, timeout)
        except urllib.error.HTTPError as exc:
            last = _http_error(meta_url, exc, f"reading the metadata of record {rid}")
            if exc.code != 404:
                raise last from exc
            if rid == rec.concept and record is None:
                version = _resolve_concept(base, rid, timeout)
                meta_url = f"{base}/api/records/{version}"
                try:
                    data = _get_json(meta_url, timeout)
                except urllib.error.HTTPError as exc2:
                    raise _http_error(meta_url, exc2, f"reading the metadata of record {version}") from exc2
                return _remote_file(data, version, name, base, meta_url)
            continue
        got = data.get("id", data.get("recid", rid))
        try:
            got = int(got)
        except (TypeError, ValueError):
            got = rid
        return _remote_file(data, got, name, base, meta_url)
    assert last is not None  # the loop ran at least once and every try ended in a 404
    raise FetchError(f"{last}; the data set's records are listed at {rec.doi_url}")


# --------------------------------------------------------------------------------------------- download
def _md5_of(path: Path, upto: int | None = None) -> Any:
    h = hashlib.md5()
    left = path.stat().st_size if upto is None else upto
    with open(path, "rb") as fh:
        while left > 0:
            block = fh.read(min(_CHUNK, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h


def _content_range_start(value: str | None) -> int | None:
    m = re.match(r"\s*bytes\s+(\d+)-\d+/(?:\d+|\*)\s*$", value or "")
    return int(m.group(1)) if m else None


def _check_free_space(folder: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if need > free:
        raise FetchError(
            f"{folder}: {what} needs {need / 1e9:.2f} GB but the disk has {free / 1e9:.2f} GB free; free some space "
            f"or choose another --dest"
        )


def _verify(path: Path, remote: RemoteFile, digest: str, size: int) -> None:
    if remote.size is not None and size != remote.size:
        path.unlink(missing_ok=True)
        raise ChecksumError(
            f"{path}: {size} bytes downloaded but record {remote.record} says {remote.name} has {remote.size}; the "
            f"partial file was removed, run the command again"
        )
    if digest != remote.md5:
        path.unlink(missing_ok=True)
        raise ChecksumError(
            f"{path}: md5 {digest} does not match {remote.md5} of {remote.name} in record {remote.record}; the "
            f"download is damaged and was removed, run the command again"
        )


def download(
    remote: RemoteFile,
    target: str | os.PathLike,
    *,
    retries: int = 3,
    timeout: float = 60.0,
    progress: bool = True,
    wait: Callable[[float], None] = time.sleep,
) -> Path:
    """Download ``remote`` to ``target`` through ``target.part``, resuming, and verify its size and md5.

    The bytes already in ``target.part`` (an earlier, interrupted run) are kept and the rest is asked for with
    ``Range: bytes=K-``; a server that answers the whole file (200) restarts it. A connection that drops is
    resumed the same way up to ``retries`` times (waiting 1, 2, 4 … s); after that the ``.part`` file stays for
    the next run and :class:`FetchError` says so. On success the file is renamed to ``target`` (returned); a
    size or md5 mismatch removes the partial file and raises :class:`ChecksumError`.
    """
    target = Path(target)
    part = target.with_name(target.name + PART_SUFFIX)
    target.parent.mkdir(parents=True, exist_ok=True)
    attempt = 0
    bar = None
    try:
        while True:
            have = _resumable_bytes(part, remote, target)
            if remote.size is not None and have == remote.size:
                return _accept_part(part, target, remote, have)
            headers = {"Range": f"bytes={have}-"} if have else {}
            try:
                resp = _open(remote.url, headers=headers, timeout=timeout)
            except urllib.error.HTTPError as exc:
                if exc.code == 416 and have:  # nothing after `have`: the part file may be complete
                    return _accept_part(part, target, remote, have)
                raise _http_error(remote.url, exc, f"downloading {remote.name}") from exc
            with resp:
                start, end, h = _answered_range(resp, remote, part, have)
                if bar is None:
                    bar = _bytes_bar(remote, end, progress)
                bar.n = start
                bar.refresh()
                got, dropped = _write_body(resp, part, start, h, bar)
            short = end is not None and got < end
            if dropped is not None or short:
                attempt += 1
                if attempt > retries:
                    why = f" ({type(dropped).__name__})" if dropped is not None else ""
                    raise FetchError(
                        f"{remote.url}: the download stopped after {got} of "
                        f"{remote.size if remote.size is not None else '?'} bytes{why}; {part} is kept, run the "
                        f"command again to resume"
                    ) from dropped
                wait(min(2.0 ** (attempt - 1), 30.0))
                continue
            _verify(part, remote, h.hexdigest(), got)
            os.replace(part, target)
            return target
    finally:
        if bar is not None:
            bar.close()


def _resumable_bytes(part: Path, remote: RemoteFile, target: Path) -> int:
    """The bytes of ``part`` an earlier run left to resume from (0 when it is longer than the file: not ours,
    removed), after checking that the disk holds the rest."""
    have = part.stat().st_size if part.exists() else 0
    if remote.size is not None and have > remote.size:
        part.unlink()  # longer than the file: not ours, start again
        have = 0
    if remote.size is not None:
        _check_free_space(target.parent, remote.size - have, f"the rest of {remote.name}")
    return have


def _accept_part(part: Path, target: Path, remote: RemoteFile, have: int) -> Path:
    """Verify the complete ``part`` file (``have`` bytes) and rename it to ``target``."""
    digest = _md5_of(part).hexdigest()
    _verify(part, remote, digest, have)
    os.replace(part, target)
    return target


def _answered_range(resp, remote: RemoteFile, part: Path, have: int):
    """Where the server's answer starts (``have`` for a resumed range, 0 for the whole file), where it should end
    (its announced length, else the record's size) and the md5 of ``part``'s bytes before the start;
    :class:`FetchError` for a range the part file cannot continue."""
    start = _content_range_start(resp.headers.get("Content-Range")) if resp.status == 206 else 0
    if start is None or start > have:
        raise FetchError(
            f"{remote.url}: the server answered the range request with "
            f"{resp.headers.get('Content-Range')!r}; delete {part} and run the command again"
        )
    h = _md5_of(part, upto=start) if start else hashlib.md5()
    length = resp.headers.get("Content-Length")
    # http.client ends a body cut short by the server as if it were complete: compare with what was
    # announced (the record's size where the server sends no length)
    end = start + int(length) if length and length.isdigit() else remote.size
    return start, end, h


def _bytes_bar(remote: RemoteFile, end: int | None, progress: bool):
    """The download's progress bar in bytes (total: the record's size, else the announced end)."""
    total = remote.size
    if total is None:
        total = end
    return _progress_bar(
        total=total,
        desc=remote.name,
        disable=None if progress else True,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
    )


def _write_body(resp, part: Path, start: int, h, bar) -> tuple[int, BaseException | None]:
    """Write the response body into ``part`` from byte ``start`` (truncating what follows), hashing it into ``h``:
    the bytes the part file then holds and the network error that cut the body short (``None``)."""
    got, dropped = start, None
    with open(part, "r+b" if start else "wb") as fh:
        fh.seek(start)
        fh.truncate()  # a server that restarts (200) or resumes earlier overwrites the rest
        while True:
            try:
                block = resp.read(_CHUNK)
            except (http.client.HTTPException, OSError) as exc:  # reading a socket: the network
                dropped = exc
                break
            if not block:
                break
            try:
                fh.write(block)
            except OSError as exc:
                raise FetchError(
                    f"{part}: cannot write ({exc.strerror or exc}); {part} is kept, free some space and "
                    f"run the command again to resume"
                ) from exc
            h.update(block)
            got += len(block)
            bar.update(len(block))
        fh.flush()
        os.fsync(fh.fileno())
    return got, dropped


# --------------------------------------------------------------------------------------------- unpack
def _members(zf: zipfile.ZipFile, archive: Path, folder_name: str) -> tuple[list[zipfile.ZipInfo], str]:
    """The archive's members and the prefix to strip (``Walnut{N}/`` when everything lies under it). Refuses
    absolute paths and ``..`` (a member must not land outside the target folder)."""
    infos = zf.infolist()
    if not infos:
        raise FetchError(f"{archive}: the archive is empty")
    for info in infos:
        p = PurePosixPath(info.filename)
        if p.is_absolute() or ".." in p.parts or "\\" in info.filename or re.match(r"^[A-Za-z]:", info.filename):
            raise FetchError(f"{archive}: member {info.filename!r} would be written outside the target folder")
    prefix = folder_name + "/"
    if all(i.filename.startswith(prefix) or i.filename == folder_name for i in infos):
        return infos, prefix
    return infos, ""


def unpack_walnut(archive: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """Unpack ``archive`` (``Walnut{N}.zip``) to ``folder`` (``…/Walnut{N}``) and check it is a walnut folder.

    The archive's top folder ``Walnut{N}/`` (as the data set packs it) becomes ``folder``; an archive without it
    is unpacked as is. Everything is written to a hidden folder beside ``folder`` first, every
    ``Projections/tubeV*`` orbit is opened with :class:`WalnutScan` (layout, geometry rows, TIFF headers), and only
    then renamed to ``folder``. :class:`FetchError` (damaged archive, full disk, not a walnut folder).
    """
    archive, folder = Path(archive), Path(folder)
    if folder.exists():
        raise FetchError(f"{folder}: already exists; remove it to unpack {archive.name} again")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FetchError(f"{folder.parent}: cannot create the folder ({exc.strerror or exc})") from exc
    tmp = folder.with_name(f".{folder.name}.unpack")
    if tmp.exists():
        shutil.rmtree(tmp)  # a previous unpack that did not finish
    try:
        try:
            zf = zipfile.ZipFile(archive)
        except (zipfile.BadZipFile, OSError) as exc:
            raise FetchError(f"{archive}: not a readable zip archive ({exc}); remove it and run again") from exc
        with zf:
            infos, prefix = _members(zf, archive, folder.name)
            _check_free_space(folder.parent, sum(i.file_size for i in infos), f"unpacking {archive.name}")
            tmp.mkdir(parents=True)
            for info in infos:
                rel = info.filename[len(prefix) :] if prefix else info.filename
                if not rel or rel.endswith("/"):
                    (tmp / rel).mkdir(parents=True, exist_ok=True)
                    continue
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                try:
                    with zf.open(info) as src, open(dest, "wb") as out:
                        shutil.copyfileobj(src, out, _CHUNK)
                except (zipfile.BadZipFile, zlib.error) as exc:
                    raise FetchError(f"{archive}: member {info.filename} is damaged ({exc})") from exc
                except OSError as exc:
                    raise FetchError(f"{dest}: cannot write ({exc.strerror or exc}) while unpacking {archive}") from exc
        orbits = (
            sorted(p.name for p in (tmp / "Projections").glob("tubeV[123]")) if (tmp / "Projections").is_dir() else []
        )
        if not orbits:
            raise FetchError(f"{archive}: the archive holds no Projections/tubeV1|2|3 folder; it is not a walnut scan")
        for name in orbits:
            try:
                WalnutScan(tmp, orbit=int(name[-1]))
            except WalnutFormatError as exc:
                raise FetchError(f"{archive}: unpacked, but not a readable walnut scan: {exc}") from exc
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


# --------------------------------------------------------------------------------------------- all steps
def fetch_walnut(
    n: int,
    dest: str | os.PathLike = ".",
    *,
    base: str | None = None,
    record: int | None = None,
    keep_archive: bool = False,
    retries: int = 3,
    timeout: float = 60.0,
    progress: bool = True,
    wait: Callable[[float], None] = time.sleep,
) -> dict:
    """Download walnut ``n`` into ``dest/Walnut{n}`` (module docstring: metadata, resumable download, md5,
    unpack, layout check).

    A ``dest/Walnut{n}`` that is already a walnut folder is left as it is (nothing is downloaded); a verified
    ``dest/Walnut{n}.zip`` from an earlier run is unpacked without downloading it again.

    Returns
    -------
    dict
        ``folder`` (Path), ``archive`` (the remote file, :class:`RemoteFile` or ``None`` when nothing was needed),
        ``downloaded`` (bool), ``bytes`` (archive size), ``time_s``.
    """
    t0 = time.perf_counter()
    walnut_record(n)
    if retries < 0:
        raise FetchError(f"--retries: must be ≥ 0, got {retries}")
    if not timeout > 0:
        raise FetchError(f"--timeout: must be a positive number of seconds, got {timeout}")
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise FetchError(f"{dest}: --dest is a file, not a folder")
    folder = dest / FOLDER_PATTERN.format(n)
    if folder.exists():
        try:
            WalnutScan(folder, orbit=_first_orbit(folder))
        except (WalnutFormatError, ValueError) as exc:
            raise FetchError(
                f"{folder}: exists but is not a complete walnut folder ({exc}); remove it and run again"
            ) from exc
        return {"folder": folder, "archive": None, "downloaded": False, "bytes": 0, "time_s": time.perf_counter() - t0}
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FetchError(f"{dest}: cannot create the --dest folder ({exc.strerror or exc})") from exc
    remote = resolve_walnut(n, base=base, record=record, timeout=timeout)
    archive = dest / remote.name
    downloaded = False
    if archive.is_file() and archive.stat().st_size == (remote.size or archive.stat().st_size):
        if _md5_of(archive).hexdigest() != remote.md5:
            archive.unlink()  # stale or damaged: download again
    elif archive.exists():
        archive.unlink()
    if not archive.is_file():
        download(remote, archive, retries=retries, timeout=timeout, progress=progress, wait=wait)
        downloaded = True
    unpack_walnut(archive, folder)
    size = archive.stat().st_size
    if not keep_archive:
        archive.unlink()
    return {
        "folder": folder,
        "archive": remote,
        "downloaded": downloaded,
        "bytes": size,
        "time_s": time.perf_counter() - t0,
    }


def _first_orbit(folder: Path) -> int:
    """Orbit 2 when the folder has it (the published 2D slices'), else the first ``tubeV*`` found, else 2."""
    present = sorted(int(p.name[-1]) for p in (folder / "Projections").glob("tubeV[123]"))
    return 2 if 2 in present or not present else present[0]
