"""KernelFile.kernel_boundary: the kernel/user split read from a kernel ELF's own segments."""

from __future__ import annotations

import dataclasses

from guestvm import BUILD_ROOT, build_fixtures

from qmpprof import session
from qmpprof.arch.x86 import I386, X86_64
from qmpprof.guest.base import KernelFile
from qmpprof.sampler import SamplerConfig
from qmpprof.session import RunSpec


def test_a_kernel_linked_low_at_an_offset_starts_at_its_lowest_segment() -> None:
    build_fixtures(("hobby",))
    kernel = KernelFile.open(BUILD_ROOT / "hobby" / "kernel.elf")
    # fixtures/hobby/kernel.ld: linked at 0x80100000, loaded at 1 MiB.
    assert kernel.kernel_boundary(I386.kernel_boundary) == 0x8010_0000


def test_a_kernel_linked_above_the_split_keeps_the_split() -> None:
    build_fixtures(("i386", "cfi"))
    i386 = KernelFile.open(BUILD_ROOT / "i386" / "kernel.elf")
    x86_64 = KernelFile.open(BUILD_ROOT / "cfi" / "kernel.elf")
    assert i386.kernel_boundary(I386.kernel_boundary) == I386.kernel_boundary
    assert x86_64.kernel_boundary(X86_64.kernel_boundary) == X86_64.kernel_boundary


def test_an_identity_mapped_kernel_says_nothing_of_user_space() -> None:
    build_fixtures(("hobby",))
    kernel = KernelFile.open(BUILD_ROOT / "hobby" / "user" / "crunch.elf")
    # A program at 0 is linked where it loads: the stand-in for a kernel mapped 1:1.
    assert kernel.kernel_boundary(I386.kernel_boundary) == I386.kernel_boundary


def test_a_run_splits_where_the_elf_says_unless_told_otherwise() -> None:
    build_fixtures(("hobby",))
    spec = RunSpec(kernel=BUILD_ROOT / "hobby" / "kernel.elf")
    guest = session.load(spec)
    assert session.unwinder(spec, guest).kernel_boundary == 0x8010_0000
    told = dataclasses.replace(spec, sampling=SamplerConfig(kernel_boundary=0xC000_0000))
    assert session.unwinder(told, guest).kernel_boundary == 0xC000_0000
