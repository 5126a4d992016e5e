"""``ctuq fetch walnut N`` against a local HTTP server (127.0.0.1, started here) that imitates Zenodo's records API
and serves a small walnut-layout archive built from the ``tiny`` simulated scan. Nothing leaves the machine."""

import hashlib
import http.server
import io
import json
import re
import shutil
import socket
import threading
import zipfile
from collections import namedtuple
from pathlib import Path

import pytest

from ctuq.cli import main
from ctuq.data import fetch as fetch_mod
from ctuq.data.fetch import ChecksumError, FetchError, fetch_walnut, resolve_walnut, unpack_walnut
from ctuq.data.walnut import WalnutScan


def _zip_folder(folder: Path, top: str) -> bytes:
    """The folder as a zip whose members lie under ``top/`` (as the data set packs ``WalnutN/``)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                zf.write(p, f"{top}/{p.relative_to(folder).as_posix()}")
    return buf.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):
    """GET with ``Range: bytes=a-`` / ``bytes=a-b`` (206, 416), records JSON, redirects, error statuses and one dropped
    transfer."""

    def log_message(self, *args):  # keep the test output clean
        pass

    def do_GET(self):
        st = self.server.state
        st["log"].append((self.path, self.headers.get("Range")))
        if self.path in st["status"]:
            self.send_error(st["status"][self.path])
            return
        if self.path in st["redirects"]:
            self.send_response(302)
            self.send_header("Location", st["redirects"][self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path in st["json"]:
            body = json.dumps(st["json"][self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path in st["pages"]:
            body = b"<html>record page</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path not in st["files"]:
            self.send_error(404, "no such record")
            return
        data = st["files"][self.path]
        start, stop = 0, len(data)
        rng = self.headers.get("Range")
        if rng and st["ranges"]:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng)
            start = int(m.group(1))
            stop = int(m.group(2)) + 1 if m.group(2) else len(data)
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(stop - start))
        self.end_headers()
        body = data[start:stop]
        if st["drop_after"] is not None:  # announce everything, send k bytes, hang up (once)
            k, st["drop_after"] = st["drop_after"], None
            self.wfile.write(body[:k])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(body)


Server = namedtuple("Server", "url state")


@pytest.fixture
def server():
    """A Zenodo-like server on 127.0.0.1 (a free port) in a thread; ``state`` is what it serves and its request log."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.state = {
        "json": {},
        "files": {},
        "redirects": {},
        "status": {},
        "pages": set(),
        "log": [],
        "drop_after": None,
        "ranges": True,
    }
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield Server(f"http://127.0.0.1:{httpd.server_address[1]}", httpd.state)
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def _publish(srv: Server, record: int, name: str, data: bytes, *, md5: str | None = None) -> str:
    """Put ``data`` on the server as file ``name`` of ``record`` with Zenodo's JSON (legacy ``files`` list)."""
    path = f"/api/records/{record}/files/{name}/content"
    srv.state["files"][path] = data
    srv.state["json"][f"/api/records/{record}"] = {
        "id": record,
        "files": [
            {
                "key": name,
                "size": len(data),
                "checksum": f"md5:{md5 or hashlib.md5(data).hexdigest()}",
                "links": {"self": srv.url + path},
            }
        ],
    }
    return path


@pytest.fixture(scope="module")
def walnut1_zip(tmp_path_factory, tiny_scan):
    return _zip_folder(tiny_scan, "Walnut1")


def _same_tree(a: Path, b: Path) -> None:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def _file_requests(srv: Server) -> list:
    return [(p, r) for p, r in srv.state["log"] if p.endswith("/content")]


def test_fetch_downloads_verifies_and_unpacks(server, walnut1_zip, tiny_scan, tmp_path):
    _publish(server, 2686726, "Walnut1.zip", walnut1_zip)  # the table's version record of walnuts 1-8
    res = fetch_walnut(1, tmp_path, base=server.url, progress=False)
    assert res["folder"] == tmp_path / "Walnut1" and res["downloaded"] and res["bytes"] == len(walnut1_zip)
    assert res["archive"].md5 == hashlib.md5(walnut1_zip).hexdigest() and res["archive"].record == 2686726
    _same_tree(tiny_scan, tmp_path / "Walnut1")
    WalnutScan(tmp_path / "Walnut1", orbit=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Walnut1"]  # archive, .part and unpack folder gone
    # a second run finds the folder and downloads nothing
    n_requests = len(server.state["log"])
    again = fetch_walnut(1, tmp_path, base=server.url, progress=False)
    assert again["archive"] is None and not again["downloaded"] and len(server.state["log"]) == n_requests


def test_interrupted_download_resumes_in_the_next_run(server, walnut1_zip, tiny_scan, tmp_path, monkeypatch, capsys):
    _publish(server, 2686726, "Walnut1.zip", walnut1_zip)
    k = len(walnut1_zip) // 3
    server.state["drop_after"] = k
    monkeypatch.setenv("CTUQ_ZENODO_URL", server.url)  # the environment variable, as a user would set it
    argv = ["fetch", "walnut", "1", "--dest", str(tmp_path), "--retries", "0", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Walnut1.zip.part is kept" in err and f"after {k} of" in err
    part = tmp_path / "Walnut1.zip.part"
    assert part.read_bytes() == walnut1_zip[:k] and not (tmp_path / "Walnut1").exists()

    assert main(argv) == 0
    assert _file_requests(server)[-1][1] == f"bytes={k}-"  # only the rest was asked for
    assert "ctuq reconstruct --data" in capsys.readouterr().err
    _same_tree(tiny_scan, tmp_path / "Walnut1")
    assert not part.exists() and not (tmp_path / "Walnut1.zip").exists()


def test_dropped_connection_is_resumed_within_one_run(server, walnut1_zip, tiny_scan, tmp_path):
    _publish(server, 2686726, "Walnut1.zip", walnut1_zip)
    server.state["drop_after"] = 1000
    waits = []
    res = fetch_walnut(1, tmp_path, base=server.url, progress=False, retries=2, wait=waits.append, keep_archive=True)
    assert [r for _, r in _file_requests(server)] == [None, "bytes=1000-"] and waits == [1.0]
    assert (tmp_path / "Walnut1.zip").read_bytes() == walnut1_zip and res["downloaded"]
    _same_tree(tiny_scan, tmp_path / "Walnut1")


def test_server_without_range_support_restarts_the_file(server, walnut1_zip, tiny_scan, tmp_path):
    _publish(server, 2686726, "Walnut1.zip", walnut1_zip)
    server.state["ranges"] = False
    (tmp_path / "Walnut1.zip.part").write_bytes(b"x" * 500)  # an earlier run's bytes, which the server ignores
    fetch_walnut(1, tmp_path, base=server.url, progress=False)
    assert _file_requests(server) == [(_file_requests(server)[0][0], "bytes=500-")]
    _same_tree(tiny_scan, tmp_path / "Walnut1")


def test_complete_part_file_is_verified_without_downloading(server, walnut1_zip, tmp_path):
    _publish(server, 2686726, "Walnut1.zip", walnut1_zip)
    (tmp_path / "Walnut1.zip.part").write_bytes(walnut1_zip)
    fetch_walnut(1, tmp_path, base=server.url, progress=False)
    assert _file_requests(server) == [] and (tmp_path / "Walnut1").is_dir()


def test_checksum_mismatch_is_refused_and_removed(server, walnut1_zip, tmp_path, capsys):
    _publish(server, 2686726, "Walnut1.zip", walnut1_zip, md5="0" * 32)
    with pytest.raises(ChecksumError, match=r"Walnut1\.zip\.part: md5 [0-9a-f]{32} does not match 0{32}"):
        fetch_walnut(1, tmp_path, base=server.url, progress=False)
    assert list(tmp_path.iterdir()) == []
    rc = main(["fetch", "walnut", "1", "--dest", str(tmp_path), "--base-url", server.url, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "does not match" in err


def test_wrong_size_is_refused(server, walnut1_zip, tmp_path):
    _publish(server, 2686726, "Walnut1.zip", walnut1_zip)
    server.state["json"]["/api/records/2686726"]["files"][0]["size"] = len(walnut1_zip) - 10
    with pytest.raises(ChecksumError, match="bytes downloaded but record 2686726 says"):
        fetch_walnut(1, tmp_path, base=server.url, progress=False)
    assert list(tmp_path.iterdir()) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_is_one_line_and_exit_2(tmp_path, capsys):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there: connection refused
    rc = main(["fetch", "walnut", "5", "--dest", str(tmp_path), "--base-url", url])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"ctuq fetch: {url}/api/records/2686726: cannot connect (")
    assert "check the network connection" in err and "--base-url" in err
    assert list(tmp_path.iterdir()) == []


def test_concept_record_resolved_through_its_page(server, tiny_scan, tmp_path):
    data = _zip_folder(tiny_scan, "Walnut9")
    # walnuts 9-16: only the concept id 2686970 is in the table; the API answers 404 for it, its page redirects
    _publish(server, 2686971, "Walnut9.zip", data)
    server.state["redirects"]["/records/2686970"] = "/records/2686971"
    server.state["pages"].add("/records/2686971")
    remote = resolve_walnut(9, base=server.url)
    assert remote.record == 2686971 and remote.size == len(data) and remote.name == "Walnut9.zip"
    res = fetch_walnut(9, tmp_path, base=server.url, progress=False)
    _same_tree(tiny_scan, res["folder"])
    assert res["folder"] == tmp_path / "Walnut9"


def test_concept_record_served_by_the_api(server, tiny_scan):
    _publish(server, 2688111, "Walnut40.zip", _zip_folder(tiny_scan, "Walnut40"))
    assert resolve_walnut(40, base=server.url).record == 2688111


def test_invenio_files_entries_and_explicit_record(server, walnut1_zip):
    path = "/api/records/77/files/Walnut2.zip/content"
    server.state["files"][path] = walnut1_zip
    server.state["json"]["/api/records/77"] = {
        "id": "77",
        "files": {"entries": {"Walnut2.zip": {"size": 5, "checksum": "md5:" + "A" * 32}}},
    }
    remote = resolve_walnut(2, base=server.url, record=77)
    assert remote.url == server.url + path and remote.md5 == "a" * 32 and remote.size == 5 and remote.record == 77


@pytest.mark.parametrize(
    "n, kwargs, message",
    [
        (43, {}, "there is no walnut 43"),
        (0, {}, "there is no walnut 0"),
        ("3", {}, "must be an integer"),
        (3, {"base": "ftp://example.org"}, "--base-url: 'ftp://example.org' is not an http"),
        (3, {"retries": -1}, "--retries: must be ≥ 0"),
        (3, {"timeout": 0.0}, "--timeout: must be a positive number of seconds"),
    ],
)
def test_bad_arguments(n, kwargs, message, tmp_path):
    with pytest.raises(FetchError, match=re.escape(message)):
        fetch_walnut(n, tmp_path, progress=False, **kwargs)


def test_record_errors(server, walnut1_zip, tmp_path):
    # no record at all: the 404 names the URL and the data set's DOI
    with pytest.raises(FetchError, match=r"/api/records/2687386: HTTP 404 .*doi.org/10\.5281/zenodo\.2687386"):
        resolve_walnut(20, base=server.url, record=2687386)
    # a concept id whose page does not redirect to a version
    server.state["pages"].add("/records/2686970")
    with pytest.raises(FetchError, match=r"/records/2686970: does not lead to a version record .*--record"):
        resolve_walnut(10, base=server.url)
    # a busy server says so, and its error is not taken for a missing record
    server.state["status"]["/api/records/2687634"] = 503
    with pytest.raises(FetchError, match=r"/api/records/2687634: HTTP 503 .*try again later"):
        resolve_walnut(30, base=server.url)
    # a record without the walnut's archive lists what it has
    _publish(server, 2686726, "Walnut2.zip", walnut1_zip)
    with pytest.raises(FetchError, match=r"record 2686726 has no file Walnut1\.zip \(it has: Walnut2\.zip\)"):
        resolve_walnut(1, base=server.url)
    # a checksum that is not md5
    server.state["json"]["/api/records/2686726"]["files"][0].update(key="Walnut1.zip", checksum="sha256:abc")
    with pytest.raises(FetchError, match="gives no md5 checksum for Walnut1.zip"):
        resolve_walnut(1, base=server.url)
    # the API answers something that is not JSON
    server.state["json"].pop("/api/records/2686726")
    server.state["files"]["/api/records/2686726"] = b"<html>"
    with pytest.raises(FetchError, match="metadata is not JSON"):
        resolve_walnut(1, base=server.url)


def test_dest_errors(server, walnut1_zip, tiny_scan, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(FetchError, match="--dest is a file"):
        fetch_walnut(1, afile, base=server.url, progress=False)
    broken = tmp_path / "d" / "Walnut1"
    broken.mkdir(parents=True)
    with pytest.raises(FetchError, match="exists but is not a complete walnut folder"):
        fetch_walnut(1, tmp_path / "d", base=server.url, progress=False)


def test_full_disk_is_refused_before_downloading(server, walnut1_zip, tmp_path, monkeypatch):
    _publish(server, 2686726, "Walnut1.zip", walnut1_zip)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(fetch_mod.shutil, "disk_usage", lambda p: usage._replace(free=100))
    with pytest.raises(FetchError, match=r"needs 0\.00 GB but the disk has 0\.00 GB free; free some space"):
        fetch_walnut(1, tmp_path, base=server.url, progress=False)
    assert _file_requests(server) == []


def _zip(members: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


@pytest.mark.parametrize(
    "members, message",
    [
        ({"Walnut1/../evil.txt": b"x"}, "would be written outside the target folder"),
        ({"/etc/evil": b"x"}, "would be written outside the target folder"),
        ({"Walnut1/readme.txt": b"x"}, "holds no Projections/tubeV1|2|3 folder"),
        ({"Walnut1/Projections/tubeV2/scan_000000.tif": b"x"}, "not a readable walnut scan"),
    ],
)
def test_unpack_refuses_bad_archives(members, message, tmp_path):
    archive = tmp_path / "Walnut1.zip"
    archive.write_bytes(_zip(members))
    with pytest.raises(FetchError, match=re.escape(message)):
        unpack_walnut(archive, tmp_path / "Walnut1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Walnut1.zip"]  # nothing half-unpacked left


def test_unpack_damaged_zip_and_archive_without_top_folder(tiny_scan, tmp_path):
    bad = tmp_path / "Walnut1.zip"
    bad.write_bytes(b"PK not really a zip")
    with pytest.raises(FetchError, match="not a readable zip archive"):
        unpack_walnut(bad, tmp_path / "Walnut1")
    flat = tmp_path / "flat.zip"  # members at the root, no Walnut1/ folder
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for p in sorted(tiny_scan.rglob("*")):
            if p.is_file():
                zf.write(p, p.relative_to(tiny_scan).as_posix())
    flat.write_bytes(buf.getvalue())
    _same_tree(tiny_scan, unpack_walnut(flat, tmp_path / "out" / "Walnut1"))
    with pytest.raises(FetchError, match="already exists"):
        unpack_walnut(flat, tmp_path / "out" / "Walnut1")


def test_verified_archive_from_an_earlier_run_is_reused(server, walnut1_zip, tmp_path):
    _publish(server, 2686726, "Walnut1.zip", walnut1_zip)
    (tmp_path / "Walnut1.zip").write_bytes(walnut1_zip)  # e.g. unpacking failed last time
    res = fetch_walnut(1, tmp_path, base=server.url, progress=False)
    assert not res["downloaded"] and _file_requests(server) == [] and res["folder"].is_dir()
    # a damaged archive of the right size is replaced by a fresh download
    shutil.rmtree(res["folder"])
    (tmp_path / "Walnut1.zip").write_bytes(b"\0" * len(walnut1_zip))
    res = fetch_walnut(1, tmp_path, base=server.url, progress=False)
    assert res["downloaded"] and len(_file_requests(server)) == 1
