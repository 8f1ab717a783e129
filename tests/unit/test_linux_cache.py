"""The cache of Linux kernel loads (qmpprof/linux/cache.py) on Debian's kernels: a load from the
cache equals a load from nothing (symbols, function names, ORC lookups, BTF layouts) and
computes nothing again; a damaged, truncated or other-version entry is ignored and rebuilt; a
cache that cannot be written is no error."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
from array import array
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import linuxkernel
import pytest

from qmpprof.arch.x86 import X86_64
from qmpprof.linux import btf as btf_module
from qmpprof.linux import cache, kernel
from qmpprof.linux.btf import Btf, BtfIndex, Kind
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.image import kernel_module
from qmpprof.linux.running.modules import ModuleLayout
from qmpprof.linux.running.tasks import TaskLayout
from qmpprof.linux.running.vma import VmaLayout
from qmpprof.linux.symbols import KernelSymbols
from qmpprof.linux.x86_64.orctables import OrcTable
from qmpprof.linux.x86_64.running import X86_64 as X86_64_LINUX

SLIDE = 0x1E00_0000
FILES = ("vmlinux", "symbols.bin", "index.bin")
NAMED = (Kind.STRUCT, Kind.UNION, Kind.TYPEDEF, Kind.DATASEC)


def layout(make: Callable[[Btf], object], btf: Btf | None) -> object:
    assert btf is not None
    try:
        return make(btf)
    except KeyError as err:  # a kernel without the struct: the same answer both ways
        return f"KeyError {err}"


def orc_lookup(orc: OrcTable, pc: int) -> object:
    try:
        return orc.lookup(pc)
    except ValueError as err:  # an entry no kernel writes: the same answer both ways
        return f"ValueError {err}"


def snapshot(kernel: LinuxKernel) -> dict[str, object]:
    """Everything a run takes from a loaded kernel, in comparable form."""
    orc, btf, image = kernel.tables, kernel.btf, kernel.image
    assert isinstance(orc, OrcTable) and btf is not None
    low, high = kernel.span
    pcs = range(low, min(high, low + (48 << 20)), 997)  # every 997th byte of the code
    module = kernel_module(kernel, SLIDE, X86_64, X86_64_LINUX)
    return {
        "symbols": (kernel.symbols.addrs, kernel.symbols.types, kernel.symbols.names),
        "modules": kernel.symbols.modules,
        "functions": kernel.functions.items(),
        "function lookups": [kernel.functions.lookup(pc) for pc in pcs],
        "orc": (orc.base, orc.end, orc.layout, list(orc.offsets), len(orc)),
        "orc lookups": [orc_lookup(orc, pc) for pc in pcs],
        "btf": (len(btf), list(btf.index.starts), btf.index.kinds),
        "btf names": {kind: btf._names_of(kind) for kind in NAMED},
        "layouts": [layout(m, btf) for m in (TaskLayout.from_btf, ModuleLayout.from_btf)]
        + [layout(VmaLayout.from_btf, btf)],
        "image": (image.path, image.build_id, image.text_addr, image.size, image.code_ranges()),
        "span": kernel.span,
        "missing": kernel.missing,
        "module": (module.mapping, module.name, [type(s).__name__ for s in module.steps]),
    }


def vmlinuz(series: str) -> Path:
    return linuxkernel.linux_dir(series) / "vmlinuz"


def computes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every costly step of a load made to fail: a load that passes came from the cache."""

    def not_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("computed again despite the cache")

    monkeypatch.setattr(kernel, "hashlib", SimpleNamespace(sha256=not_again))  # nor hashed
    monkeypatch.setattr("qmpprof.linux.x86_64.kernelfile.vmlinux_bytes", not_again)
    monkeypatch.setattr("qmpprof.linux.kernel.read_kallsyms", not_again)
    monkeypatch.setattr(OrcTable, "from_image", not_again)
    monkeypatch.setattr(Btf, "_build_index", not_again)
    monkeypatch.setattr(btf_module, "re", SimpleNamespace(finditer=not_again, escape=re.escape))
    monkeypatch.setattr(KernelSymbols, "text_picks", not_again)


Cold = tuple[str, Path, dict[str, object]]
_COLD: dict[str, Cold] = {}


def cold_load(series: str, tmp_path_factory: pytest.TempPathFactory) -> Cold:
    """A series, a cache folder its cold load filled, and that load's snapshot (once)."""
    if series not in _COLD:
        folder = tmp_path_factory.mktemp(f"cache-{series}")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("QMPPROF_CACHE_DIR", str(folder))
            kernel = LinuxKernel.load(vmlinuz(series))
        (entry,) = folder.glob("linux-*")
        assert sorted(p.name for p in entry.iterdir()) == sorted(FILES)
        assert [p.name for p in folder.iterdir() if p != entry] == ["keys"]
        _COLD[series] = (series, folder, snapshot(kernel))
    return _COLD[series]


@pytest.fixture(params=["6.12", "6.1", "5.10"])
def cold(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Cold:
    """Each kernel's cold load."""
    return cold_load(request.param, tmp_path_factory)


@pytest.fixture
def cold_612(tmp_path_factory: pytest.TempPathFactory) -> Cold:
    """The 6.12 kernel's cold load: enough for the cache's own checks."""
    return cold_load("6.12", tmp_path_factory)


def fill(cold: Cold, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of a cold load's cache made the cache of this test; its entry. The files are
    links to the cold load's (a vmlinux is tens of MiB): the cache replaces a file whole, and
    the damage below writes a new file in its place, so the cold load's stay as they were."""
    shutil.copytree(cold[1], tmp_path / "cache", copy_function=os.link)
    monkeypatch.setenv("QMPPROF_CACHE_DIR", str(tmp_path / "cache"))
    (entry,) = (tmp_path / "cache").glob("linux-*")
    return entry


def test_a_cached_load_equals_a_cold_one_and_computes_nothing(
    cold: Cold, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    series = cold[0]
    fill(cold, tmp_path, monkeypatch)
    computes_nothing(monkeypatch)
    kernel = LinuxKernel.load(vmlinuz(series))
    assert isinstance(kernel.image._data, mmap.mmap)  # the cached vmlinux, mapped not read
    assert snapshot(kernel) == cold[2]


def replace_file(path: Path, data: bytes) -> None:
    """A new file at ``path`` (not the shared one a link of ``fill`` points to)."""
    path.unlink()
    path.write_bytes(data)


def damage_junk(path: Path) -> None:
    replace_file(path, b"\x05\x00\x00\x00junk")


def damage_truncate(path: Path) -> None:
    data = path.read_bytes()
    replace_file(path, data[: len(data) // 2])


def damage_version(path: Path) -> None:
    """Another version's header (the vmlinux: its ELF header overwritten instead)."""
    data = bytearray(path.read_bytes())
    if path.name == "vmlinux":
        data[:64] = bytes(64)
    else:
        size = int.from_bytes(data[:4], "little")
        head = json.loads(data[4 : 4 + size])
        head["version"] = cache.VERSION + 1
        text = json.dumps(head).encode().ljust(size)  # same length: only the version differs
        data[4 : 4 + size] = text[:size]
    replace_file(path, bytes(data))


def damage_missing(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize(
    "damage",
    [damage_junk, damage_truncate, damage_version, damage_missing],
    ids=lambda f: f.__name__,
)
def test_a_damaged_entry_is_ignored_and_rebuilt(
    cold_612: Cold,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    damage: Callable[[Path], None],
) -> None:
    series, _, expected = cold_612
    entry = fill(cold_612, tmp_path, monkeypatch)
    damage(entry / name)
    assert snapshot(LinuxKernel.load(vmlinuz(series))) == expected
    with monkeypatch.context() as patch:
        computes_nothing(patch)
        assert snapshot(LinuxKernel.load(vmlinuz(series))) == expected  # rebuilt: cached again


def unknown_kind(index: BtfIndex) -> BtfIndex:
    return BtfIndex(index.starts, index.kinds[:-1] + b"\x20", index.names)


def shifted(index: BtfIndex) -> BtfIndex:
    starts = array("I", [0, *(s + 4 for s in index.starts[1:])])
    return BtfIndex(starts, index.kinds, index.names)


def one_short(index: BtfIndex) -> BtfIndex:
    return BtfIndex(index.starts[:-1], index.kinds, index.names)


def misnamed(index: BtfIndex) -> BtfIndex:
    """task_struct's name said to be a union's id."""
    union = next(iter(index.names[Kind.UNION].values()))
    return BtfIndex(
        index.starts, index.kinds, {**index.names, Kind.STRUCT: {b"task_struct": union}}
    )


@pytest.mark.parametrize(
    "wrong", [unknown_kind, shifted, one_short, misnamed], ids=lambda f: f.__name__
)
def test_an_index_that_does_not_fit_the_image_is_rebuilt(
    cold_612: Cold,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    wrong: Callable[[BtfIndex], BtfIndex],
) -> None:
    """An index of the right version and sizes whose BTF and ORC parts are another image's."""
    series, _, expected = cold_612
    entry = fill(cold_612, tmp_path, monkeypatch)
    key = entry.name.removeprefix("linux-")
    index = cache.load_index(key)
    assert index is not None and index.orc is not None and index.btf is not None
    wrong_btf = wrong(index.btf)
    wrong_orc = cache.OrcIndex(index.orc.base + 4, index.orc.end, "signal", index.orc.offsets)
    cache.store(key, None, None, cache.KernelIndex(index.vmlinux_size, None, wrong_orc, wrong_btf))
    assert snapshot(LinuxKernel.load(vmlinuz(series))) == expected
    with monkeypatch.context() as patch:
        computes_nothing(patch)
        assert snapshot(LinuxKernel.load(vmlinuz(series))) == expected


def test_an_unwritable_cache_is_no_error(
    cold: Cold, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    series, _, expected = cold
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("QMPPROF_CACHE_DIR", str(blocker / "cache"))
    assert snapshot(LinuxKernel.load(vmlinuz(series))) == expected
    assert blocker.read_text() == "not a directory"


def test_a_file_changed_in_place_is_hashed_again(
    cold_612: Cold, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The remembered key of a path is not trusted once the file changed, even with its size
    and modification time as they were (one byte of its DOS header changed)."""
    fill(cold_612, tmp_path, monkeypatch)
    copy = tmp_path / "vmlinuz"
    data = bytearray(vmlinuz("6.12").read_bytes())
    copy.write_bytes(data)
    LinuxKernel.load(copy)
    assert cache.remembered_key(copy, copy.stat()) == hashlib.sha256(data).hexdigest()
    before = copy.stat()
    data[0x10] ^= 0x20  # a byte of the DOS header that unpacking never reads
    copy.write_bytes(data)
    os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert copy.stat().st_size == before.st_size
    assert cache.remembered_key(copy, copy.stat()) is None
    changed = LinuxKernel.load(copy)
    assert cache.remembered_key(copy, copy.stat()) == hashlib.sha256(data).hexdigest()
    assert len(list((tmp_path / "cache").glob("linux-*"))) == 2  # its own entry
    assert changed.symbols.names == cold_612[2]["symbols"][2]  # type: ignore[index]


def test_a_vmlinux_file_is_mapped_and_not_copied(
    linux_vmlinux_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vmlinux ELF given as it is: the cache keeps its kallsyms and index, not a copy of it,
    and a second load maps the file itself."""
    monkeypatch.setenv("QMPPROF_CACHE_DIR", str(tmp_path / "cache"))
    cold = snapshot(LinuxKernel.load(linux_vmlinux_path))
    (entry,) = (tmp_path / "cache").glob("linux-*")
    assert sorted(p.name for p in entry.iterdir()) == ["index.bin", "symbols.bin"]
    with monkeypatch.context() as patch:
        computes_nothing(patch)
        kernel = LinuxKernel.load(linux_vmlinux_path)
    assert isinstance(kernel.image._data, mmap.mmap)
    assert snapshot(kernel) == cold
