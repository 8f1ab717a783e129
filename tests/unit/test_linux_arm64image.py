"""An arm64 kernel Image read as the ELF of its memory image at its link address: the header,
the EFI stub's PE sections, the relocations applied (the link address from their addends),
BTF by its header; bookworm's arm64 6.1 and 6.12 Images as shipped, loaded as a LinuxKernel
(kallsyms decoded by content), and Images built by hand for what must be refused. The forms
other distributions ship (Image.gz and the like, EFI zboot) are made here from Images by their
documented layouts (Debian ships neither: no real one is at hand) and must read as the plain
Image does."""

from __future__ import annotations

import gzip
import itertools
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from aarch64vm import SERIES, image
from elftools.elf.elffile import ELFFile
from fakes import FakeTransport
from kernelpack import PACK, ZBOOT_NAMES, ZBOOT_PAYLOAD_AT, zboot

from qmpprof.arch.aarch64 import AARCH64
from qmpprof.elf.image import ElfImage
from qmpprof.errors import KernelImageError, NoKernelRunningError
from qmpprof.linux import bannerslide
from qmpprof.linux.aarch64 import kernelimage as arm64image
from qmpprof.linux.aarch64 import relr as arm64relr
from qmpprof.linux.aarch64.cpucontext import CpuContext
from qmpprof.linux.aarch64.kernelimage import elf_of_image, is_arm64_image, is_arm64_kernel
from qmpprof.linux.aarch64.running import AARCH64 as AARCH64_LINUX
from qmpprof.linux.aarch64.running import slide_by_trampoline, slide_by_vectors
from qmpprof.linux.aarch64.trampoline import swapper_offset
from qmpprof.linux.kernel import LinuxKernel, looks_like_linux
from qmpprof.linux.running.guest import Layouts
from qmpprof.linux.running.offcpu import OffCpuLayout
from qmpprof.linux.taskstates import task_state_array
from qmpprof.model import Registers
from qmpprof.pagecache import PAGE, page_of

pytestmark = pytest.mark.linux

# Measured on the packages fetched here: where each is linked (KIMAGE_VADDR: 48-bit kernel
# VAs in 6.1, 52 in 6.12) and how many symbols its kallsyms hold.
LINKED = {"6.1": (0xFFFF_8000_0800_0000, 50_336), "6.12": (0xFFFF_8000_8000_0000, 151_594)}
# task_struct.thread.cpu_context, where a task off CPU keeps its registers (BTF)
CPU_CONTEXT = {"6.1": 3008, "6.12": 3024}


@pytest.mark.parametrize("series", sorted(LINKED))
def test_bookworm_images_load_at_their_link_address(series: str) -> None:
    link, count = LINKED[series]
    kernel = LinuxKernel.load(image(series))
    assert kernel.image.arch is AARCH64
    assert kernel.image.load_range[0] == link
    assert len(kernel.symbols) == count
    # The PE .text starts at _stext, 64 KiB past _text: the head (header, EFI entry) before.
    assert kernel.symbols.address_of("_stext") == link + 0x10000
    assert kernel.image.text_addr == link
    assert kernel.span[0] == link
    assert kernel.btf is not None and kernel.btf.find("task_struct") is not None
    assert kernel.tables is None and not any("ORC" in line for line in kernel.missing)
    # kallsyms_relative_base was patched by the relocations: every symbol is in the image
    # (6.12's data symbols too, up to _end: the header's image_size).
    end = kernel.image.load_range[1]
    assert all(link <= addr <= end for addr in kernel.symbols.addrs)
    assert kernel.symbols.address_of("_end") in (None, end)
    # --off-cpu reads a task's registers from its cpu_context (no inactive_task_frame here)
    offcpu = Layouts.of(kernel).offcpu
    assert isinstance(offcpu, OffCpuLayout) and isinstance(offcpu.switch, CpuContext)
    assert offcpu.switch.saved == (CPU_CONTEXT[series], 104)
    assert (offcpu.switch.fp, offcpu.switch.sp, offcpu.switch.pc) == (80, 88, 96)
    # init_task and THREAD_SIZE from the boot code, task_state_array by its content: 6.1's
    # kallsyms name none of them, 6.12's name the same addresses (its init_stack's size).
    init_task, array, size = kernel.off_cpu_addresses()
    booted = kernel.boot_task
    assert booted is not None and size == booted.thread_size == 0x4000
    assert init_task == booted.init_task and array == task_state_array(kernel.image)
    if series == "6.12":
        assert init_task == kernel.symbols.address_of("init_task")
        assert array == kernel.symbols.address_of("task_state_array")
        assert kernel.thread_size == 0x4000
    else:
        assert kernel.symbols.address_of("init_task") is None and kernel.thread_size is None
        assert (init_task, array) == (0xFFFF_8000_09CC_8DC0, 0xFFFF_8000_08D4_48D8)


def test_the_banner_is_in_the_read_only_data() -> None:
    kernel = LinuxKernel.load(image("6.1"))
    found = bannerslide.banner(kernel.image)
    assert found is not None
    addr, text = found
    assert text.startswith(b"Linux version 6.1.0-") and text.endswith(b"\n")
    assert kernel.image.section_addr(".rodata") is not None
    assert kernel.span[0] < addr < kernel.span[1]


def test_slide_candidates_keep_the_pc_in_the_image() -> None:
    span = (0xFFFF_8000_0800_0000, 0xFFFF_8000_0820_0000)  # 2 MiB: 32 steps of 64 KiB
    pc = 0xFFFF_A735_9381_0C80
    slides = bannerslide.candidates(pc, span)
    assert len(slides) == 32
    assert all(span[0] <= pc - s < span[1] for s in slides)
    assert all(s % bannerslide.ALIGN == 0 for s in slides)
    assert 0 in bannerslide.candidates(span[0] + 0x100, span)  # nokaslr: slide 0 is one


def tiny_image(relocs: list[tuple[int, int]], link: int = 0xFFFF_8000_0800_0000) -> bytes:
    """A 64 KiB Image: the header, a PE header with one .text section, ``relocs``
    (place, value) as R_AARCH64_RELATIVE entries at 0x4000."""
    data = bytearray(0x10000)
    struct.pack_into("<IIQQQ", data, 0, 0, 0, 0, len(data), 0xA)
    data[0x38:0x40] = b"ARM\x64" + struct.pack("<I", 0x40)
    data[0x40:0x44] = b"PE\0\0"
    struct.pack_into("<H", data, 0x46, 1)  # one section
    struct.pack_into("<H", data, 0x54, 0)  # no optional header
    struct.pack_into("<8sIIII", data, 0x58, b".text", 0xF000, 0x1000, 0xF000, 0x1000)
    for i, (place, value) in enumerate(relocs):
        struct.pack_into("<QQQ", data, 0x4000 + 24 * i, link + place, 1027, link + value)
    return bytes(data)


def test_a_hand_made_image_is_relocated() -> None:
    relocs = [(0x8000 + 8 * i, 0x1000 + i) for i in range(1000)] + [(0x9F00, 0)]
    elf = ElfImage.from_bytes("tiny", elf_of_image(tiny_image(relocs), "tiny"))
    assert elf.load_range == (0xFFFF_8000_0800_0000, 0xFFFF_8000_0801_0000)
    rodata = elf.section(".rodata")
    assert rodata is not None
    word = struct.unpack_from("<Q", rodata, 0x8008 - 0x1000)[0]
    assert word == 0xFFFF_8000_0800_1001  # place 0x8008 holds its value at the link address
    assert elf.section(".BTF") is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x7fELF" + bytes(100), "not an arm64 Image"),
        (tiny_image([]), "no relocation table"),
        (tiny_image([(0x8000 + 8 * i, 0x1000) for i in range(999)] + [(0x20000, 0)]), "outside"),
    ],
)
def test_what_is_not_an_arm64_image_is_one_clear_error(data: bytes, message: str) -> None:
    assert is_arm64_image(data) == (message != "not an arm64 Image")
    with pytest.raises(KernelImageError, match=message):
        elf_of_image(data, "bad")


def small_image() -> bytes:
    relocs = [(0x8000 + 8 * i, 0x1000 + i) for i in range(1000)] + [(0x9F00, 0)]
    return tiny_image(relocs)


@pytest.mark.parametrize("codec", sorted(ZBOOT_NAMES))
def test_zboot_and_compressed_images_read_as_the_plain_one(codec: str) -> None:
    plain = small_image()
    want = elf_of_image(plain, "Image")
    for packed in (zboot(plain, codec), PACK[codec](plain)):
        assert is_arm64_kernel(packed[:0x300]) and looks_like_linux(packed[:0x300], None)
        elf = ElfImage.from_bytes("packed", elf_of_image(packed, "packed"))
        assert elf.load_range == (0xFFFF_8000_0800_0000, 0xFFFF_8000_0801_0000)
        rodata = elf.section(".rodata")
        assert rodata is not None
        assert struct.unpack_from("<Q", rodata, 0x8008 - 0x1000)[0] == 0xFFFF_8000_0800_1001
    assert elf_of_image(PACK[codec](plain), "Image.x") == want  # the same bytes exactly
    assert arm64image.form(zboot(plain, codec)) == f"zboot ({ZBOOT_NAMES[codec]})"
    assert arm64image.form(PACK[codec](plain)) == f"{codec}-compressed Image"
    assert arm64image.form(plain) == "Image"


def test_the_page_size_is_the_headers() -> None:
    plain = bytearray(small_image())
    assert arm64image.page_size(bytes(plain)) == 4 << 10  # tiny_image's flags: 0xA
    for bits, size in ((2, 16 << 10), (3, 64 << 10), (0, None)):
        struct.pack_into("<Q", plain, 24, bits << 1)
        assert arm64image.page_size(bytes(plain)) == size
    assert arm64image.page_size(image("6.1").read_bytes()[:64]) == 4 << 10


def truncated_zboot() -> bytes:
    data = bytearray(zboot(small_image()))
    struct.pack_into("<I", data, 12, len(data))  # a payload longer than the file
    return bytes(data)


def damaged_zboot() -> bytes:
    data = bytearray(zboot(small_image()))
    data[ZBOOT_PAYLOAD_AT + 20 : ZBOOT_PAYLOAD_AT + 60] = b"\xff" * 40
    return bytes(data)


def lzo_zboot() -> bytes:
    """A zboot image of lzo (a codec qmpprof does not read): its payload starts with lzo's magic."""
    data = bytearray(zboot(small_image(), name="lzo"))
    data[ZBOOT_PAYLOAD_AT : ZBOOT_PAYLOAD_AT + 4] = b"\x89LZO"
    return bytes(data)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (truncated_zboot, "zboot payload runs past the end of the file"),
        (lambda: zboot(small_image(), name="lzo"), r"zboot header says 'lzo', its payload is gzip"),
        (lambda: zboot(small_image(), name="brotli"), "zboot header says 'brotli'"),
        (lzo_zboot, r"zboot payload \(lzo\) is lzo-compressed, which is not read"),
        (lambda: zboot(small_image())[:-0x400], "zboot payload runs past the end of the file"),
        (damaged_zboot, "gzip payload does not unpack"),
        (lambda: gzip.compress(b"\x7fELF" + bytes(200)), "compressed file unpacks to something"),
        (lambda: zboot(bytes(64) + bytes(8)), "zboot payload unpacks to something other"),
        (lambda: b"\x89LZO" + bytes(64), "compressed Image is lzo-compressed, which is not read"),
        (lambda: b"MZ\0\0zimg" + bytes(200), "zboot payload runs past the end"),
    ],
)
def test_a_damaged_zboot_or_compressed_image_is_one_clear_error(
    make: Callable[[], bytes], message: str
) -> None:
    with pytest.raises(KernelImageError, match=message):
        elf_of_image(make(), "bad")


@pytest.fixture(scope="module")
def packed_61(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Bookworm's arm64 6.1 Image as Image.gz and as an EFI zboot image of zstd."""
    plain = image("6.1").read_bytes()
    folder = tmp_path_factory.mktemp("arm64-forms")
    paths = {"Image.gz": folder / "Image.gz", "zboot": folder / "vmlinuz.efi"}
    paths["Image.gz"].write_bytes(PACK["gzip"](plain))
    paths["zboot"].write_bytes(zboot(plain, "zstd"))
    return paths


@pytest.mark.parametrize("form", ["Image.gz", "zboot"])
def test_bookworm_61_packed_loads_as_shipped_and_from_the_cache(
    form: str, packed_61: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = LinuxKernel.load(image("6.1"))
    kernel = LinuxKernel.load(packed_61[form])
    assert kernel.image.load_range[0] == plain.image.load_range[0] == LINKED["6.1"][0]
    assert kernel.symbols.addrs == plain.symbols.addrs
    assert kernel.symbols.names == plain.symbols.names
    assert kernel.btf is not None and kernel.btf.find("task_struct") is not None
    # A second load maps what the first unpacked: nothing is made again.
    monkeypatch.setattr("qmpprof.linux.aarch64.kernelfile.elf_of_image", not_again)
    again = LinuxKernel.load(packed_61[form])
    assert again.symbols.addrs == plain.symbols.addrs


def not_again(data: bytes, path: str) -> bytes:
    raise AssertionError(f"{path} was unpacked again")


@pytest.mark.parametrize("series", sorted(LINKED))
def test_module_layout_from_arm64_btf_has_no_orc(series: str) -> None:
    """An arm64 module keeps no ORC tables (its mod_arch_specific has none): the layout reads
    without them, where it failed on their absence."""
    layout = Layouts.of(LinuxKernel.load(image(series))).modules
    assert layout is not None and layout.orc is None
    assert layout.text_size > layout.text_base > 0


def relr_image(link: int = 0xFFFF_8000_0800_0000) -> bytes:
    """tiny_image with no RELA entries but a RELR run at 0x4000 (the gABI's SHT_RELR: a place,
    then bitmaps of the 63 words after it): 1 + 16 * 63 places from 0x8000, each holding its
    value already (RELR has no addend), one of them 0, and a 17th bitmap of no place."""
    data = bytearray(tiny_image([]))
    words = [link + 0x8000] + [(1 << 64) - 1] * 16 + [1]
    struct.pack_into(f"<{len(words)}Q", data, 0x4000, *words)
    for i in range(1 + 16 * 63):
        struct.pack_into("<Q", data, 0x8000 + 8 * i, link + 0x1000 + i if i != 5 else 0)
    return bytes(data)


def test_an_image_with_relr_relocations_is_placed_by_them() -> None:
    places = arm64relr.relr_places(relr_image())
    assert len(places) == 1 + 16 * 63
    assert places[:2] == [0xFFFF_8000_0800_8000, 0xFFFF_8000_0800_8008]
    assert arm64image.relocations(relr_image()) == ("RELR", 1 + 16 * 63)
    elf = ElfImage.from_bytes("relr", elf_of_image(relr_image(), "relr"))
    assert elf.load_range == (0xFFFF_8000_0800_0000, 0xFFFF_8000_0801_0000)
    rodata = elf.section(".rodata")
    assert rodata is not None  # the values are the file's: nothing was patched
    assert struct.unpack_from("<Q", rodata, 0x8008 - 0x1000)[0] == 0xFFFF_8000_0800_1001


def test_relr_places_that_fit_no_link_address_are_one_clear_error() -> None:
    data = bytearray(relr_image())
    struct.pack_into("<Q", data, 0x8010, 0x1234)  # a place holding no address in the image
    with pytest.raises(KernelImageError, match="RELR relocations fit 0 link addresses"):
        elf_of_image(bytes(data), "bad")


def test_a_huge_image_size_does_not_make_the_relr_search_long() -> None:
    data = bytearray(relr_image())
    struct.pack_into("<Q", data, 16, 1 << 63)  # image_size
    struct.pack_into("<Q", data, 0x8010, 0x1234)
    with pytest.raises(KernelImageError, match="fit 0 link addresses"):
        elf_of_image(bytes(data), "bad")


class VectorBase(FakeTransport):
    """vCPUs at EL0 whose VBAR_EL1 is ``vbar`` (None: a transport without system registers),
    the kernel's memory ``pages`` seen through them."""

    def __init__(self, vbar: int | None, pages: dict[int, bytes]) -> None:
        user = Registers(0, "aarch64", 0x40_1000, 0x7FFF_F000, 0, True, 0)
        super().__init__({0: user, 1: replace(user, cpu=1)}, pages)
        self.vbar = vbar

    async def system_registers(self, cpu: int, names: Sequence[str]) -> dict[str, int]:
        self.calls.append(f"system_registers:{cpu}")
        return {} if self.vbar is None else {"VBAR_EL1": self.vbar}


async def test_the_slide_of_a_guest_paused_at_el0_comes_from_its_vector_base() -> None:
    # Issue 35: every vCPU at EL0, no pc in the kernel to find the banner from. VBAR_EL1 holds
    # where the kernel put ``vectors`` in every mode; the banner there confirms it.
    kernel = LinuxKernel.load(image("6.12"))
    vectors = kernel.symbols.address_of("vectors")
    found = bannerslide.banner(kernel.image)
    assert vectors is not None and found is not None
    link, text = found
    slide = 0x3A3A_C120_0000
    pages = {}
    for page in range(page_of(link + slide), link + slide + len(text), PAGE):
        data = bytearray(PAGE)
        for at in range(max(page, link + slide), min(page + PAGE, link + slide + len(text))):
            data[at - page] = text[at - link - slide]
        pages[page] = bytes(data)
    guest = VectorBase(vectors + slide, pages)
    assert await AARCH64_LINUX.slide(guest, kernel, AARCH64, guest) == slide
    assert guest.calls.count("system_registers:0") == 1 and "registers:0" not in guest.calls
    # A vCPU at EL0 that sees no kernel (E0PD, KPTI: nothing reads): the vector base alone.
    unseen = VectorBase(vectors + slide, {})
    assert await slide_by_vectors(unseen, unseen, kernel, AARCH64) == slide
    # Another banner there, a base no slide gives (KPTI's trampoline alias), no register.
    other_banner = {page: data.replace(b"Linux", b"Linus") for page, data in pages.items()}
    for other in (
        VectorBase(vectors + slide, other_banner),
        VectorBase(0xFFFF_FFFF_FFFF_0800, pages),
        VectorBase(None, pages),
    ):
        assert await slide_by_vectors(other, other, kernel, AARCH64) is None


def _dbg_symbols(path: Path, names: Sequence[str]) -> dict[str, int]:
    """``names``' values in a -dbg vmlinux's symbol table, read raw (pyelftools' symbol
    objects take seconds over its 200,000 symbols)."""
    with path.open("rb") as f:
        elf = ELFFile(f)
        table = elf.get_section_by_name(".symtab")
        strings = elf.get_section(table["sh_link"]).data()
        entries = table.data()
    at = {
        m.start(): name
        for name in names
        for m in re.finditer(re.escape(name.encode()) + b"\0", strings)
    }
    found = {}
    for name_at, _, _, _, value, _ in struct.iter_unpack("<IBBHQQ", entries):
        if name_at in at:
            found[at[name_at]] = value
    return found


@pytest.mark.parametrize("series", sorted(SERIES))
def test_the_trampolines_tables_lie_below_the_kernels_by_what_its_code_adds(series: str) -> None:
    """KPTI's trampoline moves TTBR1_EL1 from its tables to the kernel's by an immediate read
    from the Image's code (``trampoline``): the distance from ``tramp_pg_dir`` to
    ``swapper_pg_dir`` in the -dbg vmlinux (whose symbols the Image's kallsyms lack)."""
    tables = _dbg_symbols(SERIES[series] / "vmlinux-dbg", ("tramp_pg_dir", "swapper_pg_dir"))
    code = LinuxKernel.load(image(series)).image.text_bytes
    assert swapper_offset(code) == tables["swapper_pg_dir"] - tables["tramp_pg_dir"]


class Trampoline(VectorBase):
    """vCPUs at EL0 under KPTI: VBAR_EL1 the trampoline's vectors at ``alias``, TTBR1_EL1 its
    tables, which map the code of ``pages`` (physical) from ``alias`` up, and two pages above
    them the kernel's, which map its data (the last page) too; tables built in physical memory."""

    ROOT = 0x4000_0000  # the trampoline's top-level table; the kernel's two pages above

    def __init__(self, alias: int, pages: list[bytes]) -> None:
        super().__init__(alias, {})
        for root, mapped in ((self.ROOT, len(pages) - 1), (self.ROOT + 0x2000, len(pages))):
            tables = [root + 0x10_0000 * level for level in range(4)]
            for level, (table, below) in enumerate(itertools.pairwise(tables)):
                entry = bytearray(PAGE)
                index = (alias >> (39 - 9 * level)) & 511
                entry[8 * index : 8 * index + 8] = (below | 0b11).to_bytes(8, "little")
                self.physical[table] = bytes(entry)
            last = bytearray(PAGE)
            for i, data in enumerate(pages[:mapped]):
                index = ((alias >> 12) & 511) + i
                at = 0x5000_0000 + i * PAGE
                last[8 * index : 8 * index + 8] = (at | 0b11).to_bytes(8, "little")
                self.physical[at] = data
            self.physical[tables[3]] = bytes(last)

    async def system_registers(self, cpu: int, names: Sequence[str]) -> dict[str, int]:
        self.calls.append(f"system_registers:{cpu}")
        ttbr1 = 0x0043 << 48 | self.ROOT  # a user ASID (odd) on the trampoline's table
        return {"VBAR_EL1": self.vbar or 0, "TTBR1_EL1": ttbr1, "TCR_EL1": 16 | 16 << 16}


async def test_the_slide_of_a_kpti_guest_paused_at_el0_comes_from_its_trampoline() -> None:
    """VBAR_EL1 holds the trampoline's vectors (no slide gives it): their entry loads the
    kernel's ``vectors`` from a literal, relocated at boot (6.1's own trampoline code here,
    where the -dbg vmlinux puts ``tramp_vectors``)."""
    kernel = LinuxKernel.load(image("6.1"))
    vectors = kernel.symbols.address_of("vectors")
    (start,) = _dbg_symbols(SERIES["6.1"] / "vmlinux-dbg", ("tramp_vectors",)).values()
    assert vectors is not None
    at = start - kernel.image.text_addr
    pages = [kernel.image.text_bytes[at + i * PAGE : at + (i + 1) * PAGE] for i in range(4)]
    slide, alias = 0x51F8_FAE0_0000, 0xFFFF_FFFF_FE60_0000
    literal = bytearray(pages[3])  # .entry.tramp.rodata: the link address, then relocated
    assert int.from_bytes(literal[:8], "little") == vectors
    literal[:8] = (vectors + slide).to_bytes(8, "little")
    guest = Trampoline(alias, [*pages[:3], bytes(literal)])
    assert await slide_by_vectors(guest, guest, kernel, AARCH64) is None
    assert await AARCH64_LINUX.slide(guest, kernel, AARCH64, guest) == slide
    # A literal no slide gives, or vectors whose tables do not map them: not from here.
    literal[:8] = (vectors + slide + 8).to_bytes(8, "little")
    odd = Trampoline(alias, [*pages[:3], bytes(literal)])
    assert await slide_by_trampoline(odd, odd, kernel, AARCH64) is None
    away = Trampoline(alias, [*pages[:3], bytes(literal)])
    away.vbar = alias + 0x10_0000
    assert await slide_by_trampoline(away, away, kernel, AARCH64) is None


async def test_with_no_vcpu_in_the_kernel_and_no_register_a_given_slide_is_asked_for() -> None:
    """Over QMP (no system registers) with every vCPU at EL0 nothing in the guest gives the
    slide: with --kallsyms (``kallsyms_slide``) the search ends at once, for the caller to take
    that one (``LinuxGuest.attach``, which says so)."""
    kernel = replace(LinuxKernel.load(image("6.12")), kallsyms_slide=0x3A3A_C120_0000)
    guest = VectorBase(None, {})
    with pytest.raises(NoKernelRunningError, match="no vCPU runs in the kernel"):
        await AARCH64_LINUX.slide(guest, kernel, AARCH64, guest)
    assert guest.calls.count("registers:0") == 1  # one look, no waiting for a vCPU in the kernel


async def test_a_paused_guest_with_no_vcpu_in_the_kernel_fails_at_once() -> None:
    """Paused with every vCPU at EL0 (its user's pause, a debugger's), no vCPU will enter the
    kernel: no waiting for one (``slide.WAIT``), the one clear error at once."""
    kernel = LinuxKernel.load(image("6.12"))
    guest = VectorBase(None, {})
    guest.running = False
    with pytest.raises(NoKernelRunningError, match="no vCPU runs in the kernel"):
        await AARCH64_LINUX.slide(guest, kernel, AARCH64, guest)
    assert guest.calls.count("registers:0") == 1
