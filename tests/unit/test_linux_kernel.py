"""A Linux kernel loaded for a run from the files in /boot: Debian's 6.12 bzImage as found there
(scripts/fetch-linux), its kallsyms, ORC and BTF, and its Module at a KASLR slide
(``qmpprof.linux.running.image``)."""

from __future__ import annotations

from pathlib import Path

import linuxkernel
import pytest

from qmpprof.arch.x86 import X86_64
from qmpprof.errors import ElfError, KernelImageError, SymbolMapError
from qmpprof.guest.base import KernelFile
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.running.image import kernel_module
from qmpprof.linux.running.linuxos import LINUX
from qmpprof.linux.x86_64.orcstep import OrcStep
from qmpprof.linux.x86_64.orctables import RETPOLINE_THUNK, unaliased
from qmpprof.linux.x86_64.running import X86_64 as X86_64_LINUX
from qmpprof.linux.x86_64.running import target_kind
from qmpprof.unwind.tailcall import TargetKind

SLIDE = 0x1E00_0000  # a multiple of 2 MiB, as KASLR moves the kernel


@pytest.fixture(scope="module")
def kernel(linux_dir: Path) -> LinuxKernel:
    return LinuxKernel.load(linux_dir / "vmlinuz")


def test_the_bzimage_from_boot_has_all_a_run_needs(kernel: LinuxKernel) -> None:
    assert kernel.missing == ()
    assert kernel.tables is not None and kernel.btf is not None
    low, high = kernel.span
    assert low == kernel.image.text_addr == kernel.symbols.address_of("_text")
    assert low < kernel.symbols.address_of("schedule") < high  # type: ignore[operator]
    # Its per-CPU section is linked at 0: not part of the kernel's range.
    assert low >= 0xFFFF_8000_0000_0000
    assert kernel.functions.lookup(kernel.symbols.address_of("schedule") + 1) == ("schedule", 1)  # type: ignore[operator]


def test_the_module_at_a_slide_unwinds_by_orc_and_names_slid_addresses(
    kernel: LinuxKernel,
) -> None:
    module = kernel_module(kernel, SLIDE, X86_64, X86_64_LINUX)
    low, high = kernel.span
    assert (module.start, module.end, module.bias) == (low + SLIDE, high + SLIDE, SLIDE)
    assert module.kernel and module.name == "vmlinux"
    (step,) = module.steps
    assert isinstance(step, OrcStep) and step.bias == SLIDE
    schedule = kernel.address("schedule", SLIDE)
    assert schedule is not None and module.symbols is not None
    assert module.symbols.lookup(schedule - module.bias) == ("schedule", 0)
    assert kernel.address("__per_cpu_offset") is not None  # a data symbol (KALLSYMS_ALL)


def test_thunks_are_marked_on_61_only(kernel: LinuxKernel) -> None:
    """6.1 brackets its retpoline thunks with __indirect_thunk_start/_end (their ORC reads as
    an end of stack there); 6.12 has neither the symbols nor the need."""
    assert kernel.thunks is None
    (step,) = kernel_module(kernel, SLIDE, X86_64, X86_64_LINUX).steps
    assert isinstance(step, OrcStep) and step.code.thunks is None
    old = LinuxKernel.load(linuxkernel.linux_dir("6.1") / "vmlinuz")
    thunk = old.symbols.address_of("__x86_indirect_thunk_r11")
    assert old.thunks is not None and thunk is not None
    assert old.thunks[0] < thunk < old.thunks[1]
    (step,) = kernel_module(old, SLIDE, X86_64, X86_64_LINUX).steps
    assert isinstance(step, OrcStep) and step.code.thunks == old.thunks


@pytest.mark.parametrize("series", linuxkernel.SERIES)
def test_the_thunks_as_functions_name_them_are_known_as_thunks(series: str) -> None:
    """The name a function lookup gives a thunk is the one kallsyms lists first at its address:
    on 7.x (6.16 on) its startup-code alias, __pi___x86_indirect_thunk_rax; the unwinder's
    retpoline rule and the tail-call search know it as a thunk all the same."""
    kernel = LinuxKernel.load(linuxkernel.linux_dir(series) / "vmlinuz")
    thunk = kernel.symbols.address_of("__x86_indirect_thunk_rax")
    ret = kernel.symbols.address_of("__x86_return_thunk")
    assert thunk is not None and ret is not None
    thunk_name, ret_name = kernel.functions.lookup(thunk)[0], kernel.functions.lookup(ret)[0]
    if series == "7":
        assert (thunk_name, ret_name) == (
            "__pi___x86_indirect_thunk_rax",
            "__pi___x86_return_thunk",
        )
    assert target_kind(thunk_name) is TargetKind.INDIRECT
    assert target_kind(ret_name) is TargetKind.RETURN
    assert unaliased(thunk_name).startswith(RETPOLINE_THUNK)


def test_a_kallsyms_file_from_a_kaslr_boot_is_moved_back_to_link_addresses(
    kernel: LinuxKernel, linux_dir: Path, tmp_path: Path
) -> None:
    text = kernel.symbols.address_of("_text")
    schedule = kernel.symbols.address_of("schedule")
    assert text is not None and schedule is not None
    lines = [
        f"{text + SLIDE:016x} T _text",
        f"{schedule + SLIDE:016x} T schedule",
        f"{0x351C0:016x} D pcpu_hot",  # per-CPU: an offset, not moved
        f"{0xFFFF_FFFF_C000_1000:016x} t hot_read\t[qmpprof_hot]",  # a module: not moved
    ]
    path = tmp_path / "kallsyms"
    path.write_text("\n".join(lines) + "\n")
    loaded = LinuxKernel.load(linux_dir / "vmlinuz", kallsyms=path)
    assert loaded.symbols.address_of("schedule") == schedule
    assert loaded.kallsyms_slide == SLIDE  # the boot's, taken where the guest says nothing
    assert kernel.kallsyms_slide is None
    assert loaded.symbols.address_of("pcpu_hot") == 0x351C0
    assert loaded.symbols.address_of("hot_read", "qmpprof_hot") == 0xFFFF_FFFF_C000_1000
    without_text = tmp_path / "no-text"
    without_text.write_text(lines[1] + "\n")
    with pytest.raises(SymbolMapError, match="no _text or _stext symbol"):
        LinuxKernel.load(linux_dir / "vmlinuz", kallsyms=without_text)


def test_what_is_not_a_linux_kernel_is_one_error(tmp_path: Path) -> None:
    from guestvm import BUILD_ROOT, build_fixtures

    build_fixtures()
    ours = BUILD_ROOT / "cfi" / "kernel.elf"
    assert not LINUX.recognises(KernelFile.open(ours))
    with pytest.raises(KernelImageError, match="not a Linux kernel"):
        LinuxKernel.load(ours)
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x7fELF" + bytes(100))
    with pytest.raises(ElfError):
        KernelFile.open(garbage)
    with pytest.raises(ElfError):
        LinuxKernel.load(garbage)
    with pytest.raises(ElfError, match="No such file"):
        LinuxKernel.load(tmp_path / "missing")


def test_a_folder_stands_for_the_one_image_it_holds(linux_dir: Path, tmp_path: Path) -> None:
    # Where Debian's newest packages put the image: /usr/lib/modules/RELEASE/vmlinuz.
    release = tmp_path / "usr" / "lib" / "modules" / "7.2.13+deb14-amd64"
    release.mkdir(parents=True)
    (release / "vmlinuz").symlink_to(linux_dir / "vmlinuz")
    (release / "modules.dep").write_text("")
    opened = KernelFile.open(release)
    assert opened.path == release / "vmlinuz" and LINUX.recognises(opened)
    # /boot holds several: the error names them, and the folder with none says what it looked for.
    boot = tmp_path / "boot"
    boot.mkdir()
    for name in ("vmlinuz-6.1.0-40-amd64", "vmlinuz-6.12.57+deb13-amd64", "config-6.1.0-40-amd64"):
        (boot / name).write_bytes(b"")
    with pytest.raises(KernelImageError, match=r"name one of its images \(vmlinuz-6.1.0-40-amd64"):
        KernelFile.open(boot)
    with pytest.raises(KernelImageError, match="a folder with none of vmlinuz"):
        KernelFile.open(tmp_path / "usr")


def test_a_bzimage_is_recognised_from_its_header(linux_dir: Path) -> None:
    assert LINUX.recognises(KernelFile.open(linux_dir / "vmlinuz"))


def test_a_second_load_comes_from_the_cache_and_equals_the_first(
    linux_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qmpprof.linux import bzimage, cache, kallsyms

    monkeypatch.setenv("QMPPROF_CACHE_DIR", str(tmp_path / "cache"))
    first = LinuxKernel.load(linux_dir / "vmlinuz")
    (folder,) = (tmp_path / "cache").glob("linux-*")
    assert {p.name for p in folder.iterdir()} == {"vmlinux", "symbols.bin", "index.bin"}

    def not_again(*args: object) -> None:
        raise AssertionError("computed again despite the cache")

    monkeypatch.setattr(bzimage, "vmlinux_bytes", not_again)
    monkeypatch.setattr(kallsyms, "read_kallsyms", not_again)
    monkeypatch.setattr("qmpprof.linux.x86_64.kernelfile.vmlinux_bytes", not_again)
    monkeypatch.setattr("qmpprof.linux.kernel.read_kallsyms", not_again)
    second = LinuxKernel.load(linux_dir / "vmlinuz")
    assert second.symbols.addrs == first.symbols.addrs
    assert second.symbols.names == first.symbols.names
    assert second.symbols.types == first.symbols.types
    assert second.image.build_id == first.image.build_id
    # A damaged cache is ignored, and rebuilt.
    (folder / "symbols.bin").write_bytes(b"\x05\x00\x00\x00junk")
    assert cache.load_symbols(folder.name.removeprefix("linux-")) is None
    monkeypatch.undo()
    monkeypatch.setenv("QMPPROF_CACHE_DIR", str(tmp_path / "cache"))
    third = LinuxKernel.load(linux_dir / "vmlinuz")
    assert third.symbols.names == first.symbols.names


def test_an_unwritable_cache_is_no_error(
    linux_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("QMPPROF_CACHE_DIR", str(blocker / "cache"))
    assert LinuxKernel.load(linux_dir / "vmlinuz").missing == ()
