"""The kernel file checked against the running guest's code (``guest/kernelcheck.py``) and
firmware samples told apart (``guest/firmware.py``), over fakes: guest memory made of one build
of the bundled guest's kernel (fixtures/guest), the file of the same build or of the other one
(fp and cfi: one source, other code), a kernel linked low built here, and register sets as the
CPU gives them (paging on or off, kernel or user mode)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from fakes import FakeTransport, x86
from guestvm import BUILD_ROOT
from test_sampler import kernel_cpu, make

from qmpprof.arch.x86 import X86_64
from qmpprof.cli import main
from qmpprof.elf.image import ElfImage
from qmpprof.errors import KernelMismatchError
from qmpprof.guest.cr3 import Cr3Identifier
from qmpprof.guest.firmware import FIRMWARE_SPACE, Firmware
from qmpprof.guest.kernelcheck import AGREE, PLACE, KernelCheck
from qmpprof.guest.programs import ProgramIndex
from qmpprof.memory import Reader
from qmpprof.model import FIRMWARE, Frame, Mode, Registers, Sample, Stack
from qmpprof.naming import Naming
from qmpprof.output import native, render, write_profile
from qmpprof.output.svg import colour
from qmpprof.pagecache import PageCache
from qmpprof.profile import Profile

PAGING = 1 << 31  # CR0.PG


@pytest.fixture
def cfi(guest_build: None) -> ElfImage:
    return ElfImage.load(BUILD_ROOT / "cfi" / "kernel.elf")


@pytest.fixture
def fp(guest_build: None) -> ElfImage:
    return ElfImage.load(BUILD_ROOT / "fp" / "kernel.elf")


def running(image: ElfImage, patched: Sequence[int] = (), *, loaded: bool = False) -> Reader:
    """Guest memory holding ``image``'s code at its link addresses (``loaded``: at its load
    addresses, paging off), the bytes at ``patched`` changed (what a kernel patching itself at
    boot does); nothing else reads."""
    load = image.physical(image.text_addr)
    assert load is not None
    moved = image.text_addr - load if loaded else 0  # one move for all the code, as here

    async def read(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for addr, size in ranges:
            code = image.code_at(addr + moved, size)
            if code is not None and addr in patched:
                code = bytes(b ^ 0xFF for b in code)
            out.append(code)
        return out

    return read


def pages_of(image: ElfImage) -> dict[int, bytes]:
    """The pages of guest memory holding ``image``'s code, for the transport fakes."""
    pages: dict[int, bytes] = {}
    for lo, hi in image.code_ranges():
        code = image.code_at(lo, hi - lo) or b""
        for addr in range(lo & ~0xFFF, hi, 0x1000):
            page = bytearray(pages.get(addr, bytes(0x1000)))
            start, end = max(lo, addr), min(hi, addr + 0x1000)
            page[start - addr : end - addr] = code[start - lo : end - lo]
            pages[addr] = bytes(page)
    return pages


async def nothing(ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
    return [None] * len(ranges)


def in_kernel(pc: int) -> Registers:
    return x86(0, pc, 0, cpl=0, cr0=PAGING)


def text_pc(image: ElfImage) -> int:
    return image.text_addr + image.text_size // 3


async def test_the_file_the_guest_runs_passes(cfi: ElfImage) -> None:
    check = KernelCheck(cfi, X86_64)
    assert await check.check(running(cfi), in_kernel(text_pc(cfi)))
    assert check.done


async def test_the_other_build_of_the_same_kernel_is_a_mismatch(
    cfi: ElfImage, fp: ElfImage
) -> None:
    assert cfi.text_addr == fp.text_addr  # linked alike: only the code tells them apart
    check = KernelCheck(fp, X86_64)
    with pytest.raises(KernelMismatchError, match=r"code differs from the guest's at \d+ of"):
        await check.check(running(cfi), in_kernel(text_pc(cfi)))
    assert not check.done


async def test_a_few_patched_places_pass_and_more_do_not(cfi: ElfImage) -> None:
    pc = text_pc(cfi)
    places = KernelCheck(cfi, X86_64).places([pc])
    # The most places a boot may patch and still pass: under (1 - AGREE) of them.
    allowed = int(len(places) * (1 - AGREE))
    assert allowed >= 1
    assert await KernelCheck(cfi, X86_64).check(running(cfi, places[:allowed]), in_kernel(pc))
    with pytest.raises(KernelMismatchError, match=f"at {allowed + 1} of {len(places)} places"):
        await KernelCheck(cfi, X86_64).check(running(cfi, places[: allowed + 1]), in_kernel(pc))


async def test_unreadable_code_decides_nothing_in_user_mode(cfi: ElfImage) -> None:
    check = KernelCheck(cfi, X86_64)
    user = x86(0, 0x401000, 0, cpl=3, cr0=PAGING)
    assert check.runs_kernel(user)  # a kernel started that user code
    assert not await check.check(nothing, user)  # a kernel may unmap itself in user mode
    assert not check.done


async def test_a_kernel_running_where_the_file_has_no_code_is_a_mismatch(cfi: ElfImage) -> None:
    elsewhere = in_kernel(X86_64.kernel_boundary + 0x100_0000)
    check = KernelCheck(cfi, X86_64)
    assert check.runs_kernel(elsewhere)
    with pytest.raises(KernelMismatchError, match=r"none of .* code reads in the guest"):
        await check.check(nothing, elsewhere)


def test_the_check_waits_for_a_kernel_to_run(cfi: ElfImage) -> None:
    check = KernelCheck(cfi, X86_64)
    assert not check.runs_kernel(x86(0, 0xFFF0, 0, long_mode=False, cr0=0x60000010))  # reset
    assert not check.runs_kernel(x86(0, 0x7C00, 0, long_mode=False, cr0=0x11))  # a loader
    assert not check.runs_kernel(in_kernel(0x8000))  # paging on, low: a firmware's trampoline
    assert check.runs_kernel(in_kernel(text_pc(cfi)))
    # The kernel's own first instructions, where its code is loaded (p_paddr 1 MiB here),
    # paging off or identity-mapped: the kernel runs.
    assert cfi.physical(cfi.text_addr) == 0x100000
    assert check.runs_kernel(x86(0, 0x100040, 0, long_mode=False, cr0=0x11))
    assert check.runs_kernel(in_kernel(0x101000))


async def test_a_kernel_at_its_load_address_is_checked_there(cfi: ElfImage, fp: ElfImage) -> None:
    # A boot sampled in the kernel's first instructions, before paging (what a recorded boot
    # sees): the places are read at their load addresses, and the other build is told apart.
    pc = cfi.physical(text_pc(cfi))
    assert pc is not None
    early = x86(0, pc, 0, long_mode=False, cr0=0x11)
    assert await KernelCheck(cfi, X86_64).check(running(cfi, loaded=True), early)
    assert not await KernelCheck(cfi, X86_64).check(running(cfi), early)  # not there: undecided
    with pytest.raises(KernelMismatchError, match=r"code differs from the guest's at \d+ of"):
        await KernelCheck(fp, X86_64).check(running(cfi, loaded=True), early)


def test_the_places_lie_in_the_files_code(cfi: ElfImage) -> None:
    pc = text_pc(cfi)
    places = KernelCheck(cfi, X86_64).places([pc])
    assert pc in places and len(places) > 3
    for at in places:
        assert any(lo <= at and at + PLACE <= hi for lo, hi in cfi.code_ranges())


LOW_KERNEL = """
        .text
        .globl _start
_start: .fill 4096, 1, 0x90
        hlt
"""


@pytest.fixture
def low_kernel(tmp_path: Path) -> ElfImage:
    """A kernel linked at 1 MiB (identity-mapped), as some hobby kernels are."""
    if shutil.which("as") is None or shutil.which("ld") is None:
        pytest.fail("binutils (as, ld) are needed: run scripts/setup")
    (tmp_path / "low.S").write_text(LOW_KERNEL)
    subprocess.run(["as", "--64", str(tmp_path / "low.S"), "-o", str(tmp_path / "low.o")],
                   check=True)  # fmt: skip
    elf = tmp_path / "low.elf"
    subprocess.run(["ld", "-Ttext=0x100000", "-e", "_start", "-o", str(elf),
                    str(tmp_path / "low.o")], check=True)  # fmt: skip
    return ElfImage.load(elf)


async def test_a_kernel_linked_low_is_checked_where_it_is_linked(low_kernel: ElfImage) -> None:
    check = KernelCheck(low_kernel, X86_64)
    places = check.places([0x100800])
    assert places and all(0x100000 <= at < 0x101001 for at in places)
    assert check.runs_kernel(in_kernel(0x100800))  # in its code, below the kernel half
    assert await check.check(running(low_kernel), in_kernel(0x100800))


async def test_attach_checks_while_the_guest_runs_and_waits_when_paused(cfi: ElfImage) -> None:
    pc = text_pc(cfi)
    pages = pages_of(cfi)
    check = KernelCheck(cfi, X86_64)
    await check.attach(FakeTransport({0: x86(0, 0xFFF0, 0, long_mode=False)}, running=False))
    assert not check.done  # at the reset vector, paused: later, at a sample
    await check.attach(FakeTransport({0: in_kernel(pc)}, pages))
    assert check.done


async def test_a_mismatch_at_a_sample_ends_the_run_and_resumes_the_guest(
    cfi: ElfImage, fp: ElfImage
) -> None:
    # The sampler's own fakes, with the guest's kernel made of the cfi build's code.
    r0, pages = kernel_cpu()
    pages.update(pages_of(cfi))
    at_text = x86(0, text_pc(cfi), r0.sp, r0.fp, cpl=0, cr0=PAGING)
    transport = FakeTransport({0: at_text}, pages)
    guest = Cr3Identifier([], ProgramIndex([]), X86_64, kernel_file=fp)
    sampler = make(transport, identifier=guest)  # type: ignore[arg-type]
    with pytest.raises(KernelMismatchError):
        await sampler.run()
    assert transport.calls[-1] == "cont" and transport.running
    assert len(sampler.profile) == 0  # nothing kept of it


def test_firmware_is_untranslated_code_outside_the_runs_files(cfi: ElfImage) -> None:
    firmware = Firmware.of(cfi, X86_64)
    (physical,) = [r for r in cfi.physical_ranges if r[0] <= 0x100000 < r[1]]
    assert firmware.runs(x86(0, 0xFFF0, 0, long_mode=False, cr0=0x60000010))  # real mode
    assert firmware.runs(x86(0, 0x7FA9E20, 0, long_mode=False, cr0=0x11))  # SeaBIOS, 32-bit
    # The kernel's own first instructions, at its physical load address, paging still off.
    assert not firmware.runs(x86(0, physical[0] + 0x40, 0, long_mode=False, cr0=0x11))
    assert not firmware.runs(in_kernel(0x7FA9E20))  # paging on: the guest's own
    assert not firmware.runs(x86(0, 0xFFF0, 0))  # the registers do not say: not firmware
    # Without --kernel, any untranslated code is the firmware's.
    assert Firmware.of(None, X86_64).runs(x86(0, 0x100040, 0, long_mode=False, cr0=0x11))


async def test_a_firmware_sample_is_one_whole_frame_named_firmware(cfi: ElfImage) -> None:
    from qmpprof.unwind.chain import Unwinder

    guest = Cr3Identifier([], ProgramIndex([]), X86_64, kernel_file=cfi)
    reset = x86(0, 0xFFF0, 0, long_mode=False, cr0=0x60000010)
    transport = FakeTransport({0: reset}, running=False)
    identity = await guest.identify(transport, reset, PageCache())
    assert identity.process is None and identity.space is FIRMWARE_SPACE
    assert identity.registers is not None
    walker = Unwinder(X86_64)
    stack = walker.resolve(walker.unwind(identity.registers, PageCache(), FIRMWARE_SPACE),
                           FIRMWARE_SPACE)  # fmt: skip
    assert [(f.pc, f.module) for f in stack.frames] == [(0xFFF0, FIRMWARE)]
    assert not stack.truncated
    assert transport.calls == []  # nothing read: not the guest's code


def firmware_profile() -> Profile:
    """Two firmware samples (reset vector, SeaBIOS) and a kernel one."""
    profile = Profile(interval_ms=1.0)
    for t, pc in enumerate((0xFFF0, 0xF1234)):
        stack = Stack((Frame(pc, False, module=FIRMWARE),))
        profile.add(Sample(t * 1e-3, 0, Mode.USER, False, 0, stack))
    kernel = Stack((Frame(0xFFFFFFFF80100010, True, "kmain"),))
    profile.add(Sample(2e-3, 0, Mode.KERNEL, False, 0x1000, kernel))
    return profile


FIRMWARE_COUNTS = {("[firmware]",): 2, ("kernel", "kmain_[k]"): 1}


@pytest.mark.parametrize("fmt", ["qmpprof", "pprof"])
def test_firmware_stays_firmware_in_every_output_and_saved_profile(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = firmware_profile()
    assert profile.named_counts(Naming()) == FIRMWARE_COUNTS
    assert "[firmware] 2\n" in render(profile, "folded").decode()
    addressed = profile.named_counts(Naming(show_addresses=True))
    assert addressed[("[firmware] @0xfff0",)] == addressed[("[firmware] @0xf1234",)] == 1
    speedscope = json.loads(render(profile, "speedscope"))
    assert "[firmware]" in [frame["name"] for frame in speedscope["shared"]["frames"]]
    svg = render(profile, "svg").decode()
    assert f'fill="{colour("[firmware]", "firmware")}"' in svg  # its own colour family
    assert svg.count(">firmware</text>") == 1  # and a swatch of the legend
    assert ">firmware</text>" not in render(Profile(), "svg").decode()  # only where it ran
    # Saved, read back, rendered again by report.
    saved = tmp_path / ("run.qmpprof" if fmt == "qmpprof" else "run.pb.gz")
    write_profile(profile, saved)
    again = native.load(saved)  # either: report reads both
    assert again.named_counts(Naming()) == FIRMWARE_COUNTS
    folded_out = tmp_path / "again.folded"
    assert main(["report", str(saved), "-o", str(folded_out)]) == 0
    assert "[firmware] 2\n" in folded_out.read_text()
    capsys.readouterr()
