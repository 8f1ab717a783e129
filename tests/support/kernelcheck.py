"""``scripts/check-kernels``: Linux kernel images loaded as a run loads them, each in a Python
process of its own with an empty cache, and what qmpprof's own readers found in each reported
in one row: the symbols and where kallsyms' tables were, the per-CPU area and the current task
pointer, the stack size, the ORC tables and their register numbering, BTF and the layouts read
from it, and the notes a run would print. Nothing here knows a kernel version: every value is
what a reader returned (or the error it raised: a kernel that fails is a row, not a crash).

    python -m support.kernelcheck [--arch amd64|arm64] [--json FILE] [--repeat N] [VMLINUZ ...]
    python -m support.kernelcheck --one VMLINUZ [--load-only]

Without paths: the kernels of the architecture (amd64 unless told) the tests boot
(``fixtures/build/linux``, ``linux-6.1``, ``linux-5.10``, ``linux-7``; arm64:
``linux-arm64-6.1``, ``linux-arm64``, ``linux-arm64-7``) and every one of
it ``scripts/check-kernels`` fetched (``fixtures/build/kernels/<release>/``, arm64's releases
ending in ``-arm64`` or ``-arm64-16k``). An arm64 row
says what the Image reader found (``arm64_image_facts``: the form shipped, the page size its
header names, the link address, relocations, data symbols, the exception model the walk
derived (or why none) and each vector entry's handler shape, known or not), the per-CPU area,
``__per_cpu_offset`` and ``__entry_task`` read in its code beside the kernel's own symbols
(``per_cpu_oracle``: its System.map, else its debug vmlinux) and its own table
(``kerneltable.markdown_arm64``). A kernel's folder says its release, package version
and suite (files ``version``, ``package``, ``suite``). ``--one`` prints one kernel's row as JSON
(what each process runs); ``--load-only`` only its load time. The table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from bisect import bisect_right
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.linux import bannerslide
from qmpprof.linux.aarch64 import kernelimage as arm64image
from qmpprof.linux.aarch64.percpu import entry_task_link, per_cpu_layout
from qmpprof.linux.aarch64.vectors import entry_code, entry_shapes
from qmpprof.linux.bzimage import bzimage_payload, is_bzimage, payload_codec
from qmpprof.linux.kallsyms import check_kallsyms
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.current import locate_current
from qmpprof.linux.running.guest import Layouts
from qmpprof.linux.running.image import kernel_module
from qmpprof.linux.running.platforms import linux_platform
from qmpprof.linux.symbols import KernelSymbols
from qmpprof.linux.x86_64 import orctables as orc
from qmpprof.linux.x86_64.idt import entry_text_symbols
from qmpprof.linux.x86_64.running import X86_64 as X86_64_LINUX
from qmpprof.unwind.entry import EntryCode
from support.kerneltable import markdown, markdown_arm64

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "fixtures" / "build"
# The folders of the booted ones, and the flavours of each architecture's releases.
TESTED = {
    "amd64": ("linux-5.10", "linux-6.1", "linux", "linux-7"),
    "arm64": ("linux-arm64-6.1", "linux-arm64", "linux-arm64-7"),
}
FLAVOURS = {"amd64": ("cloud-amd64", "rt-amd64"), "arm64": ("cloud-arm64", "rt-arm64", "arm64-16k")}
FETCHED = BUILD / "kernels"
TIMEOUT = 600.0  # seconds one kernel's process may take
REPEAT = 3  # loads timed cold, and cached: the best of each is reported
# Symbols a run looks up by name in the image's kallsyms when it attaches to a guest
# (qmpprof/linux/running/guest.py, pagetables.py, vmcoreinfo.py).
# The per-CPU symbols an arm64 kernel's code is read for (linux/aarch64/percpu.py), checked against
# the kernel's own symbols.
ORACLE_SYMBOLS = ("__per_cpu_start", "__per_cpu_offset", "__entry_task")
RUN_SYMBOLS = (
    "init_task",
    "modules",
    "__per_cpu_offset",
    "page_offset_base",
    "__pgtable_l5_enabled",
    "vmcoreinfo_note",
    "task_state_array",  # --off-cpu: the state letters (linux/running/offcpu.py)
)

Row = dict[str, Any]


def load(path: Path) -> tuple[LinuxKernel, Layouts, float]:
    """The kernel and its layouts as a run has them before it touches the guest, and the
    seconds that took (``support.bench.linuxload.phases``: load, module, layouts)."""
    start = time.perf_counter()
    kernel = LinuxKernel.load(path).prepare()
    platform = linux_platform(kernel.image.arch.name)
    assert platform is not None, kernel.image.arch.name
    kernel_module(kernel, 0, kernel.image.arch, platform)
    layouts = Layouts.of(kernel)
    return kernel, layouts, time.perf_counter() - start


def one(path: Path, load_only: bool) -> Row:
    """This process's row for ``path``: its load time and (unless ``load_only``) what was read."""
    row: Row = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            kernel, layouts, seconds = load(path)
            row["load_s"] = round(seconds, 3)
            if not load_only:
                row |= describe(path, kernel, layouts)
        except Exception as err:  # a kernel that fails is a finding: its row says how
            row["error"] = f"{type(err).__name__}: {err}"
    if caught:
        row["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return row


def describe(path: Path, kernel: LinuxKernel, layouts: Layouts) -> Row:
    """What qmpprof's readers found in ``kernel``, one entry each (an error where one raised)."""
    arm64 = kernel.image.arch is AARCH64
    row: Row = {"image": (arm64_image_facts if arm64 else image_facts)(path, kernel)}
    readers: tuple[tuple[str, Callable[[], Row]], ...] = (
        ("kallsyms", lambda: kallsyms_facts(kernel)),
        ("per_cpu", lambda: per_cpu_facts(kernel)),
        ("per_cpu_oracle", lambda: per_cpu_oracle(path, kernel)),
        ("orc", lambda: orc_facts(kernel)),
        ("btf", lambda: btf_facts(kernel, layouts)),
    )
    for key, read in readers:
        try:
            row[key] = read()
        except Exception as err:  # one reader's failure leaves the others'
            row[key] = {"error": f"{type(err).__name__}: {err}"}
    row["notes"] = list(layouts.notes)
    return row


def image_facts(path: Path, kernel: LinuxKernel) -> Row:
    data = path.read_bytes()
    codec = payload_codec(bzimage_payload(data, str(path))) if is_bzimage(data) else "ELF"
    version = orc.kernel_version(kernel.image.section(".rodata") or b"")
    return {
        "codec": codec,
        "vmlinux_bytes": kernel.image.size,
        "banner": None if version is None else f"{version[0]}.{version[1]}",
        "thread_size": kernel.thread_size,
        "entry_text_symbols": len(entry_text_symbols(kernel.symbols)),
        "missing_symbols": [n for n in RUN_SYMBOLS if kernel.symbols.address_of(n) is None],
        "thunks": kernel.thunks is not None,
        "thunk_names": thunk_names(kernel),
    }


def arm64_image_facts(path: Path, kernel: LinuxKernel) -> Row:
    """What the arm64 Image reader found: the form the file holds its Image in, the page size
    its header names, the link address, the relocations applied, the parts' alignment (a slide
    keeps it: ``bannerslide.ALIGN``), the symbols that are not code, whether its exception code
    is the one the walk reads (``linux.running.entry``) and the model it derived."""
    data = path.read_bytes()
    image = arm64image.plain_image(data, str(path))
    symbols = kernel.symbols
    text = {"t", "T", "w", "W"}
    sections = [".text", ".rodata", ".data", ".BTF"]
    starts = [kernel.image.section_addr(name) for name in sections[:3]]
    version = orc.kernel_version(kernel.image.section(".rodata") or b"")
    return {
        "form": arm64image.form(data[:0x300]),
        "file_bytes": len(data),
        "image_bytes": len(image),
        "page_size": arm64image.page_size(image),
        "link": hex(kernel.image.load_range[0]),
        "image_size": kernel.image.load_range[1] - kernel.image.load_range[0],
        "relocations": arm64image.relocations(image),
        "parts_aligned": all(a is not None and a % bannerslide.ALIGN == 0 for a in starts),
        "banner": None if version is None else f"{version[0]}.{version[1]}",
        "data_symbols": sum(kind not in text for kind in symbols.types),
        "thread_size": kernel.thread_size,
        "missing_symbols": [n for n in RUN_SYMBOLS[:2] if symbols.address_of(n) is None],
        **_exception_model(kernel),
    }


def _exception_model(kernel: LinuxKernel) -> Row:
    """Whether the walk reads the kernel's exception code, and the model it derived: where a
    kernel-mode handler's frame record leads (``EntryCode.linked``), or why there is none; and
    each vector entry's handler: whether its shape is one qmpprof knows, and which."""
    entries = [
        {"offset": f"{off:#x}", "known": known, "shape": shape}
        for off, known, shape in entry_shapes(kernel)
    ]
    entry = entry_code(kernel)
    if not isinstance(entry, EntryCode):
        model = entry or "no vector table"
        return {"exception_code": False, "exception_model": model, "exception_entries": entries}
    record = "{x29, pc}" if entry.linked else "zeroed (pt_regs by its address)"
    model = f"pt_regs {entry.frame.size} bytes, record at {entry.frame.record:#x}: {record}"
    return {"exception_code": True, "exception_model": model, "exception_entries": entries}


def thunk_names(kernel: LinuxKernel) -> dict[str, str]:
    """The names a function lookup gives the retpoline and return thunks (where a sample is
    named, and what the unwinder's and the tail-call search's rules see), and what kind of
    code ``target_kind`` takes each for."""
    out = {}
    for name in ("__x86_indirect_thunk_rax", "__x86_return_thunk"):
        addr = kernel.symbols.address_of(name)
        found = None if addr is None else kernel.functions.lookup(addr)
        if found is not None:
            out[found[0]] = X86_64_LINUX.target_kind(found[0]).value
    return out


def kallsyms_facts(kernel: LinuxKernel) -> Row:
    """The symbols as the load decoded them, and the decoding the image checked: where its
    tables are in ``.rodata`` (their order, the alignment all their labels share)."""
    checked = check_kallsyms(kernel.image)
    layout, base = checked.layout, kernel.image.section_addr(".rodata") or 0
    places = {
        "count": layout.num_syms,
        "names": layout.names,
        "markers": layout.markers,
        "tokens": layout.token_table,
        "index": layout.token_index,
        "offsets": layout.offsets,
    }
    if layout.relative_base is not None:
        places["base"] = layout.relative_base
    align = min(4096, *((base + pos) & -(base + pos) or 4096 for pos in places.values()))
    return {
        "symbols": len(kernel.symbols),
        "same_as_load": checked.symbols.addrs == kernel.symbols.addrs,
        "exports_checked": checked.exports,
        "decodings_refused": checked.refused,
        "order": sorted(places, key=places.__getitem__),
        "align": align,
        "offsets": (
            "self-relative"
            if layout.relative_base is None
            else "base, absolute per-CPU"
            if layout.absolute_percpu
            else "base"
        ),
        "wide_lengths": layout.wide_lengths,
    }


def per_cpu_facts(kernel: LinuxKernel) -> Row:
    """Where the per-CPU area is linked and where a run reads the current task pointer."""
    start = kernel.per_cpu_start
    kind = "none" if start is None else "zero-based" if start == 0 else "kernel data"
    row: Row = {"kind": kind, "start": None if start is None else hex(start)}
    try:
        variable, note = locate_current(kernel)
    except KeyError as err:
        row["current"] = None
        row["current_error"] = str(err)
        return row
    row["current"] = {
        "link": hex(variable.link),
        "moves": variable.moves,
        "symbol": symbol_at(kernel.symbols, variable.link),
        "note": note,
    }
    return row


def per_cpu_oracle(path: Path, kernel: LinuxKernel) -> Row:
    """arm64: the per-CPU area, ``__per_cpu_offset`` and ``__entry_task`` as qmpprof reads them
    in the kernel's code (``arm64percpu``, whatever kallsyms name) and as a run takes them
    (kallsyms' first), beside the kernel's own symbols (``own_symbols``: the oracle, never an
    input of qmpprof's); ``differs`` lists each value that is not the oracle's."""
    if kernel.image.arch is not AARCH64:
        return {}
    layout = per_cpu_layout(kernel.image, kernel.symbols) or (None, None)
    entry = entry_task_link(kernel.image, kernel.symbols)
    code = dict(zip(ORACLE_SYMBOLS, (*layout, entry), strict=True))
    try:
        current: int | None = locate_current(kernel)[0].link
    except KeyError:
        current = None
    used = (kernel.per_cpu_start, kernel.per_cpu_offsets, current)
    run = dict(zip(ORACLE_SYMBOLS, used, strict=True))
    source, oracle = own_symbols(path.parent)
    row: Row = {"source": source, "code": _hexes(code), "run": _hexes(run)}
    if oracle is not None:
        row["oracle"] = _hexes(oracle)
        row["differs"] = [
            f"{kind} {name}"
            for kind, found in (("code", code), ("run", run))
            for name in ORACLE_SYMBOLS
            if found[name] != oracle.get(name)
        ]
    return row


def own_symbols(folder: Path) -> tuple[str | None, dict[str, int] | None]:
    """The kernel's own addresses of ``ORACLE_SYMBOLS`` and where they were read: its
    System.map (``scripts/check-kernels`` takes it from the -dbg package; Debian's image
    package ships a stub), else its debug vmlinux's symbol table (``nm``; the tests' kernels:
    ``scripts/fetch-linux-dbg``); (None, None) without either."""
    system_map = folder / "System.map"
    text = system_map.read_text() if system_map.exists() else ""
    source = "System.map"
    if text.count("\n") <= 1 and (folder / "vmlinux-dbg").exists():  # none, or the stub's line
        done = subprocess.run(
            ["nm", "--defined-only", str(folder / "vmlinux-dbg")],
            capture_output=True,
            text=True,
            check=True,
            stdin=subprocess.DEVNULL,
        )
        text, source = done.stdout, "vmlinux-dbg"
    elif text.count("\n") <= 1:
        return None, None
    lines = re.finditer(rf"^([0-9a-f]+) \w ({'|'.join(ORACLE_SYMBOLS)})$", text, re.M)
    return source, {line[2]: int(line[1], 16) for line in lines}


def _hexes(values: Mapping[str, int | None]) -> dict[str, str | None]:
    return {name: None if value is None else hex(value) for name, value in values.items()}


def symbol_at(symbols: KernelSymbols, addr: int) -> str | None:
    """``name+0xoff`` of the kernel symbol at or below ``addr`` (None below the first)."""
    i = bisect_right(symbols.addrs, addr) - 1
    if i < 0:
        return None
    offset = addr - symbols.addrs[i]
    name: str = symbols.names[i]
    return name + (f"+{offset:#x}" if offset else "")


def orc_facts(kernel: LinuxKernel) -> Row:
    """The ORC table, which numbering of its registers the load chose and from what, and
    whether the entries themselves show that numbering (``orc.core_of``)."""
    table = kernel.tables
    if not isinstance(table, orc.OrcTable):
        return {"entries": 0}
    header = kernel.image.section(".orc_header")
    regs = table.regs
    names = {orc.CLASSIC: "classic", orc.RENUMBERED: "renumbered"}
    if header is None:
        source = "no .orc_header"
    elif orc.known_numbering(header) is not None:
        source = "known digest"
    else:
        source = "inferred (digest " + header.hex()[:12] + ")"
    shown = orc.core_of(table, kernel.functions.starts)
    used = (regs.undefined, regs.prev_sp, regs.sp, regs.bp)
    return {
        "entries": len(table),
        "layout": table.layout.value,
        "numbering": names.get(regs, f"other (SP {regs.sp}, BP {regs.bp})"),
        "source": source,
        "entries_agree": None if shown is None else shown == used,
        "entries_show": shown,
    }


def btf_facts(kernel: LinuxKernel, layouts: Layouts) -> Row:
    """BTF's size and per-CPU variables, and each layout a run reads from it."""
    btf = kernel.btf
    if btf is None:
        return {"types": 0}
    try:
        variables = len(btf.datasec(".data..percpu"))
    except KeyError:
        variables = 0
    modules = None
    if layouts.modules is not None:
        try:
            btf.field("module.mem")
            modules = "mem[MOD_TEXT]"
        except KeyError:
            modules = "core_layout"
    vmas = layouts.vmas
    return {
        "types": len(btf),
        "percpu_variables": variables,
        "task": layouts.tasks is not None,
        "comm_len": None if layouts.tasks is None else layouts.tasks.comm_size,
        "module": modules,
        "vma": None if vmas is None else "maple" if vmas.maple else "list",
        "offcpu": _offcpu(layouts),
    }


def _offcpu(layouts: Layouts) -> str:
    """What --off-cpu reads of a task off CPU (the state's width, the saved registers' and
    pt_regs' sizes), or why it cannot."""
    found = layouts.offcpu
    if isinstance(found, str):
        return found
    return f"state {found.state_size} B, {found.switch.describe()}"


def run_one(path: Path, cache: str, load_only: bool) -> Row:
    """``--one`` for ``path`` in a process of its own using ``cache`` as its cache folder."""
    env = os.environ | {"QMPPROF_CACHE_DIR": cache}
    argv = [sys.executable, "-m", "support.kernelcheck", "--one", str(path)]
    try:
        done = subprocess.run(
            argv + (["--load-only"] if load_only else []),
            capture_output=True,
            text=True,
            check=False,
            env=env,
            timeout=TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no answer in {TIMEOUT:.0f} s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit status {done.returncode}: {last}"}
    row: Row = json.loads(done.stdout)
    return row


def check(path: Path, repeat: int = REPEAT) -> Row:
    """``path``'s row: described by a process with an empty cache, then loaded again by
    ``repeat`` - 1 more with an empty cache each (cold) and ``repeat`` with the cache the first
    filled (cached); the best of each, as the host's cores are shared."""
    folder = path.parent
    row: Row = {"path": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)}
    for name in ("version", "package", "suite"):
        found = folder / name
        row[name] = found.read_text().strip() if found.exists() else None
    booted = {(BUILD / d).resolve() for folders in TESTED.values() for d in folders}
    row["booted_by_tests"] = folder.resolve() in booted
    release = row["version"] or ""
    arch = "arm64" if "-arm64" in release else "amd64"
    row["flavour"] = next((f for f in FLAVOURS[arch] if release.endswith("-" + f)), arch)
    with tempfile.TemporaryDirectory(prefix="kernelcheck-") as cache:
        row |= run_one(path, cache, load_only=False)
        cold = [row.pop("load_s", None)]
        if "error" not in row:
            for _ in range(repeat - 1):
                with tempfile.TemporaryDirectory(prefix="kernelcheck-") as empty:
                    cold.append(run_one(path, empty, load_only=True).get("load_s"))
            cached = [run_one(path, cache, load_only=True).get("load_s") for _ in range(repeat)]
            row["load_cached_s"] = _best(cached)
        row["load_cold_s"] = _best(cold)
    return row


def _best(seconds: list[float | None]) -> float | None:
    found = [s for s in seconds if s is not None]
    return min(found) if found else None


def kernels(arch: str = "amd64") -> list[Path]:
    """The tests' kernels of ``arch``, then the fetched ones by release."""
    tested = [BUILD / d / "vmlinuz" for d in TESTED[arch]]
    fetched = sorted(FETCHED.glob("*/vmlinuz"), key=lambda p: _release_key(p.parent.name))
    ours = [p for p in fetched if ("-arm64" in p.parent.name) == (arch == "arm64")]
    return [p for p in tested if p.exists()] + ours


def _release_key(release: str) -> tuple[tuple[int, str], ...]:
    parts = release.replace("+", ".").replace("-", ".").split(".")
    return tuple((int(p), "") if p.isdigit() else (1 << 30, p) for p in parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check-kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="bzImage, Image or vmlinux files")
    parser.add_argument("--arch", choices=sorted(TESTED), default="amd64", help="kernels of")
    parser.add_argument("--json", type=Path, help="write every row (all fields) here")
    parser.add_argument("--repeat", type=int, default=REPEAT, help="loads timed (best taken)")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args.one, args.load_only)))
        return 0
    paths = [p.absolute() for p in args.paths] or kernels(args.arch)
    if not paths:
        print("check-kernels: no kernels (scripts/fetch-linux, check-kernels)", file=sys.stderr)
        return 1
    started = datetime.now(UTC)
    rows = []
    for path in paths:
        print(f"check-kernels: {path}", file=sys.stderr)
        rows.append(check(path, max(1, args.repeat)))
    measured = {
        "started_utc": started.isoformat(timespec="seconds"),
        "repeat": args.repeat,
        "rows": rows,
    }
    print((markdown_arm64 if args.arch == "arm64" else markdown)(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(measured, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
