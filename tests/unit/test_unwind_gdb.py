"""End to end on real processes: stop a gcc-built program under gdb, take its registers and
stack memory, unwind and symbolize with qmpprof, and compare with gdb's own backtrace."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from qmpprof.arch.x86 import X86_64
from qmpprof.arch.x86regs import x86_registers
from qmpprof.elf.image import ElfImage
from qmpprof.model import Stack, StopReason
from qmpprof.pagecache import PAGE, PageCache
from qmpprof.unwind.chain import AddressSpace, Module, RawStack, Unwinder, Via

DATA = Path(__file__).parents[1] / "data" / "unwind"


def snapshot(binary: Path, location: str, caller: str = "") -> dict[str, object]:
    out = binary.with_suffix(".snap")
    env = os.environ | {"SNAP_BREAK": location, "SNAP_CALLER": caller, "SNAP_OUT": str(out)}
    subprocess.run(
        ["gdb", "-batch", "-nx", "-x", str(DATA / "gdb_snapshot.py"), str(binary)],
        env=env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    snap: dict[str, object] = json.loads(Path(f"{out}.json").read_text())
    snap["stack"] = Path(f"{out}.stack").read_bytes()
    return snap


def replay(binary: Path, snap: dict[str, object]) -> tuple[RawStack, Stack]:
    """Unwind and symbolize the snapshot's registers over its stack memory."""
    image = ElfImage.load(binary)
    main_link = image.symbols.address_of("main")
    assert main_link is not None
    bias = int(str(snap["main"])) - main_link  # PIE: where the program was loaded
    space = AddressSpace([Module.from_image(image, kernel=False, bias=bias)])
    cache = PageCache()
    stack = snap["stack"]
    start = int(str(snap["stack_start"]))
    assert isinstance(stack, bytes)
    for off in range(0, len(stack), PAGE):
        cache.pages[start + off] = stack[off : off + PAGE]
    regs = snap["regs"]
    assert isinstance(regs, dict)
    registers = x86_registers(0, regs, cpl=3, cr3=0)
    unwinder = Unwinder(X86_64)
    raw = unwinder.unwind(registers, cache, space)
    return raw, unwinder.resolve(raw, space)


def unwind_snapshot(binary: Path, snap: dict[str, object]) -> tuple[list[str | None], list[Via]]:
    raw, stack = replay(binary, snap)
    return [frame.symbol for frame in stack.frames], list(raw.via)


def gdb_names(snap: dict[str, object]) -> list[str]:
    frames = snap["frames"]
    assert isinstance(frames, list)
    return [str(name) for _pc, name in frames]


def build(tmp: Path, *flags: str, strip_cfi: bool = False) -> Path:
    out = tmp / "work"
    subprocess.run(["gcc", *flags, "-o", str(out), str(DATA / "work.c")], check=True)
    if strip_cfi:  # force the frame-pointer and prologue fallbacks
        subprocess.run(
            ["objcopy", "--remove-section=.eh_frame", "--remove-section=.eh_frame_hdr", str(out)],
            check=True,
        )
    return out


@pytest.mark.parametrize(
    ("flags", "location", "caller"),
    [
        (("-O2", "-fomit-frame-pointer"), "*uw_leaf", "uw_many_saved"),
        (("-O2", "-fomit-frame-pointer"), "*uw_leaf", "uw_with_alloca"),  # caller's CFA is on rbp
        (("-O2", "-static"), "*uw_leaf", "uw_with_alloca"),
        (("-O0",), "*uw_with_alloca+40", ""),  # CFI inside a frame-pointer function body
    ],
)
def test_cfi_unwind_matches_gdb(
    tmp_path: Path, flags: tuple[str, ...], location: str, caller: str
) -> None:
    binary = build(tmp_path, *flags)
    snap = snapshot(binary, location, caller)
    expected = gdb_names(snap)
    assert expected[-1] == "main" and len(expected) >= 5
    names, via = unwind_snapshot(binary, snap)
    assert names[: len(expected)] == expected
    assert set(via[1 : len(expected)]) == {Via.CFI}


@pytest.mark.parametrize(
    ("location", "first_step"),
    [
        ("*uw_leaf", Via.PROLOGUE),  # first instruction, before push rbp
        ("*uw_leaf+1", Via.PROLOGUE),  # between push rbp and mov rbp, rsp
        ("uw_leaf", Via.SCAN),  # after the prologue: the code followed to its return
    ],
)
def test_frame_pointer_and_prologue_unwind_match_gdb(
    tmp_path: Path, location: str, first_step: Via
) -> None:
    binary = build(tmp_path, "-O0", "-fno-omit-frame-pointer", strip_cfi=True)
    assert ElfImage.load(binary).cfi is None
    snap = snapshot(binary, location)
    expected = gdb_names(snap)
    assert expected[-1] == "main" and len(expected) >= 5
    names, via = unwind_snapshot(binary, snap)
    assert names[: len(expected)] == expected
    assert via[1] is first_step
    # With no CFI, the code followed to its return comes before frame pointers (its answer is
    # checked against a call site; a frame pointer's is not); frame pointers take what it
    # cannot model. Either way, the frames are gdb's.
    assert set(via[2 : len(expected)]) <= {Via.SCAN, Via.FRAME_POINTER}


def test_outermost_frame_of_a_static_binary_ends_cleanly(tmp_path: Path) -> None:
    binary = build(tmp_path, "-O2", "-static")
    raw, stack = replay(binary, snapshot(binary, "*uw_leaf", "uw_many_saved"))
    assert stack.frames[-1].symbol == "_start"  # glibc's _start marks the return address undefined
    assert raw.stop is StopReason.END
