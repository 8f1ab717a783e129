"""The debuginfod client (qmpprof/elf/debuginfod.py) against small HTTP servers of the test's
own: the cache's place and use, a file fetched whole, 404s, a server that does not answer, a
transfer broken off; and the build-id read from the note section a vmlinux keeps it in. A
stripped program of --user-dir gets its lines and symbols from the debug file fetched by its
build-id, as the unstripped one has them (``UserFiles``). The real server (elfutils'
debuginfod) is tests/e2e/test_debuginfod_e2e.py's."""

from __future__ import annotations

import contextlib
import http.server
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from qmpprof.elf import debuginfod
from qmpprof.elf.image import ElfImage, gnu_build_id
from qmpprof.guest.userfiles import UserFiles

ID = "764949bbe8b7a9241512fbf3b0d66d0ba34686a8"
BODY = b"\x7fELF debug file" * 1000
INLINE_C = Path(__file__).parents[1] / "data" / "unwind" / "inline.c"


class _Handler(http.server.BaseHTTPRequestHandler):
    files: ClassVar[dict[str, bytes]] = {}
    short = False  # claim more bytes than are sent

    def do_GET(self) -> None:
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body) + (10 if self.short else 0)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("Handler", (_Handler,), {"files": {}, "short": False})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("DEBUGINFOD_URLS", "DEBUGINFOD_TIMEOUT", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DEBUGINFOD_CACHE_PATH", str(tmp_path / "cache"))
    monkeypatch.setattr(debuginfod, "_quiet", {})  # no server left alone by an earlier test
    return tmp_path / "cache"


def test_the_cache_is_where_elfutils_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEBUGINFOD_CACHE_PATH")
    monkeypatch.setenv("HOME", "/home/u")
    assert debuginfod.cache_dir() == Path("/home/u/.cache/debuginfod_client")
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert debuginfod.cache_dir() == Path("/x/debuginfod_client")
    monkeypatch.setenv("DEBUGINFOD_CACHE_PATH", "/c")
    assert debuginfod.cache_dir() == Path("/c")


def test_no_servers_no_request_and_no_note() -> None:
    assert debuginfod.debuginfo(ID, "the kernel") == debuginfod.Fetched(None)


def test_fetched_whole_into_the_cache_then_taken_from_it(
    server: tuple[str, type[_Handler]], environment: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, handler = server
    handler.files[f"/buildid/{ID}/debuginfo"] = BODY
    monkeypatch.setenv("DEBUGINFOD_URLS", f"http://127.0.0.1:1 {url}/")  # the first refuses
    found = debuginfod.debuginfo(ID.upper(), "the kernel")
    assert found.path == environment / ID / "debuginfo" and found.path.read_bytes() == BODY
    handler.files.clear()
    assert debuginfod.debuginfo(ID, "the kernel").path == found.path  # no server asked
    assert [p.name for p in (environment / ID).iterdir()] == ["debuginfo"]


def test_404_and_a_transfer_broken_off_give_one_note_and_no_file(
    server: tuple[str, type[_Handler]], environment: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, handler = server
    monkeypatch.setenv("DEBUGINFOD_URLS", url)
    found = debuginfod.debuginfo(ID, "the kernel")
    assert found == debuginfod.Fetched(
        None, f"debuginfod: no debug file for the kernel ({ID}): {url}: 404 Not Found"
    )
    handler.files[f"/buildid/{ID}/debuginfo"] = BODY
    handler.short = True
    found = debuginfod.debuginfo(ID, "the kernel")
    assert found.path is None and found.note is not None and url in found.note
    assert not (environment / ID / "debuginfo").exists()
    assert not list((environment / ID).iterdir())  # no partial file left


def test_a_server_that_does_not_answer_is_given_up_after_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("DEBUGINFOD_URLS", url)
        monkeypatch.setenv("DEBUGINFOD_TIMEOUT", "0.3")
        found = debuginfod.debuginfo(ID, "the kernel")
    assert found.path is None
    assert found.note == (
        f"debuginfod: no debug file for the kernel ({ID}): {url}: no answer within 0.3 s "
        "(DEBUGINFOD_TIMEOUT)"
    )


def test_a_server_that_did_not_answer_is_not_asked_again_for_the_next_files(
    monkeypatch: pytest.MonkeyPatch, server: tuple[str, type[_Handler]]
) -> None:
    """Its timeout is paid once, not once a file; the next server is still asked each time."""
    empty, _ = server
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("DEBUGINFOD_URLS", f"{url} {empty}")
        monkeypatch.setenv("DEBUGINFOD_TIMEOUT", "0.3")
        first = debuginfod.debuginfo(ID, "the kernel")
        second = debuginfod.debuginfo(ID.replace("7", "8"), "a module")
        silent.setblocking(False)
        connections = []  # waiting in the backlog, never answered: one per time asked
        with contextlib.suppress(BlockingIOError):
            while True:
                connections.append(silent.accept()[0])
        for connection in connections:
            connection.close()
    assert first.note is not None and second.note is not None
    assert f"{url}: no answer within 0.3 s (DEBUGINFOD_TIMEOUT)" in first.note
    assert f"{url}: no answer within 0.3 s before: not asked again" in second.note
    assert f"{empty}: 404" in second.note
    assert len(connections) == 1  # asked for the first file only


@pytest.mark.parametrize("bad", ["", "zz", "../../etc"])
def test_a_build_id_that_is_no_hex_is_not_asked_for(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEBUGINFOD_URLS", "http://127.0.0.1:1")
    assert debuginfod.debuginfo(bad, "x").note == "debuginfod: x has no usable build-id"


def test_timeout_values_that_are_no_seconds_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    for text in ("nan", "-1", "inf", "soon"):
        monkeypatch.setenv("DEBUGINFOD_TIMEOUT", text)
        assert debuginfod.timeout() == debuginfod.DEFAULT_TIMEOUT


def note(name: bytes, kind: int, desc: bytes) -> bytes:
    def pad(b: bytes) -> bytes:
        return b + b"\0" * (-len(b) % 4)

    return len(name).to_bytes(4, "little") + len(desc).to_bytes(4, "little") + \
        kind.to_bytes(4, "little") + pad(name) + pad(desc)  # fmt: skip


def test_thegnu_build_id_among_other_notes() -> None:
    """A vmlinux's .notes: Xen's notes first, then GNU's build-id (type 3)."""
    xen = note(b"Xen\0", 3, b"\x01\x02\x03")  # type 3 too, but not GNU's
    gnu = note(b"GNU\0", 3, bytes.fromhex(ID))
    assert gnu_build_id(xen + note(b"GNU\0", 1, b"abcd") + gnu) == ID
    assert gnu_build_id(xen) is None
    assert gnu_build_id(gnu[:-4]) is None  # cut short


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A program with DWARF and a build-id (gcc's, as Debian's packages are built)."""
    out = tmp_path_factory.mktemp("program") / "inline"
    subprocess.run(
        ["gcc", "-O2", "-g", "-Wl,--build-id", "-o", str(out), str(INLINE_C)], check=True
    )
    return out


def stripped_into(program: Path, folder: Path) -> Path:
    """``program`` stripped of its DWARF and symbol table, in ``folder`` (a --user-dir)."""
    folder.mkdir()
    subprocess.run(["strip", "--strip-all", "-o", str(folder / program.name), str(program)],
                   check=True)  # fmt: skip
    return folder / program.name


def test_a_stripped_user_file_gets_lines_and_symbols_from_its_debug_file(
    program: Path,
    server: tuple[str, type[_Handler]],
    environment: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    full = ElfImage.load(program)
    assert full.build_id is not None and full.lines is not None
    debug = tmp_path / "inline.debug"
    subprocess.run(["objcopy", "--only-keep-debug", str(program), str(debug)], check=True)
    url, handler = server
    handler.files[f"/buildid/{full.build_id}/debuginfo"] = debug.read_bytes()
    monkeypatch.setenv("DEBUGINFOD_URLS", url)
    stripped = stripped_into(program, tmp_path / "root")
    told: list[str] = []
    assert UserFiles(tmp_path / "root", tell=told.append).candidates("inline")[0].lines is None
    assert not (environment / full.build_id).exists()  # no lines asked: nothing fetched
    (image,) = UserFiles(tmp_path / "root", lines=True, tell=told.append).candidates("inline")
    assert told == [] and image.path == str(stripped)
    assert (environment / full.build_id / "debuginfo").read_bytes() == debug.read_bytes()
    assert image.lines is not None
    assert image.symbols.items() == full.symbols.items()
    pcs = range(full.text_addr, full.text_addr + full.text_size)
    assert [image.lines.frames(pc) for pc in pcs] == [full.lines.frames(pc) for pc in pcs]


def test_a_user_file_whose_debug_file_no_server_has_is_told_once_and_used_without(
    program: Path,
    server: tuple[str, type[_Handler]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    url, _handler = server
    monkeypatch.setenv("DEBUGINFOD_URLS", url)
    stripped = stripped_into(program, tmp_path / "root")
    told: list[str] = []
    files = UserFiles(tmp_path / "root", lines=True, tell=told.append)
    (image,) = files.candidates("inline")
    assert image.lines is None
    build_id = image.build_id
    assert told == [f"debuginfod: no debug file for {stripped} ({build_id}): {url}: 404 Not Found"]
    assert files.candidates("inline") == [image] and len(told) == 1  # read once
