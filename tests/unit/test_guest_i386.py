"""The i386 builds of the bundled guest (fixtures/build/i386, and i386-pae with PAE paging): how
they are built (multiboot ELF32 in the higher half, frame pointers) and the proxy that rewrites
the x86_64 gdbstub layout into i386's (booted: tests/e2e/test_guest_i386_boot.py).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from guestelf import I386_BOUNDARY, I386_EXPECTED, I386_VARIANTS, sized_symbols
from guestvm import BUILD_ROOT, build_fixtures, section
from support.gdbi386 import I386_LAYOUT, i386_register, i386_registers


@pytest.fixture(scope="module", params=I386_VARIANTS)
def build(request: pytest.FixtureRequest) -> Path:
    variant: str = request.param
    build_fixtures((variant,))
    return BUILD_ROOT / variant


def _elf_header(path: Path) -> tuple[int, str, int]:
    with path.open("rb") as f:
        elf = ELFFile(f)
        return elf.elfclass, elf["e_machine"], elf["e_entry"]


def test_kernel_is_a_multiboot_elf32_in_the_higher_half(build: Path) -> None:
    kernel = build / "kernel.elf"
    elfclass, machine, entry = _elf_header(kernel)
    assert (elfclass, machine) == (32, "EM_386")
    symbols = sized_symbols(kernel)
    # The loader jumps to e_entry with paging off: the physical address of multiboot_entry.
    assert entry == symbols["multiboot_entry"][0] - I386_BOUNDARY
    head = kernel.read_bytes()[:8192]
    magic = head.find(struct.pack("<I", 0x1BADB002))
    assert magic >= 0 and magic % 4 == 0, "no multiboot header in the first 8 KiB"
    assert sum(struct.unpack_from("<3I", head, magic)) & 0xFFFFFFFF == 0
    wanted = [
        *I386_EXPECTED["syscall_path"],
        *I386_EXPECTED["interrupt_path"],
        *I386_EXPECTED["entry_stubs"],
    ]
    for name in [*wanted, I386_EXPECTED["outermost"]["kernel_thread"], "checksum_leaf"]:
        assert symbols[name][0] >= I386_BOUNDARY, name
    assert symbols[I386_EXPECTED["progress_symbol"]][1] == I386_EXPECTED["progress_symbol_bytes"]
    with kernel.open("rb") as f:
        assert section(ELFFile(f), ".eh_frame").data_size > 0


@pytest.mark.parametrize("program", sorted(I386_EXPECTED["programs"]))
def test_user_programs_are_elf32_at_the_shared_link_address(build: Path, program: str) -> None:
    path = build / "user" / f"{program}.elf"
    elfclass, machine, entry = _elf_header(path)
    assert (elfclass, machine) == (32, "EM_386")
    with path.open("rb") as f:
        elf = ELFFile(f)
        loads = [s["p_vaddr"] for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
        assert min(loads) == int(I386_EXPECTED["user_link_address"], 16)
        assert section(elf, ".eh_frame").data_size > 0
        assert section(elf, ".eh_frame_hdr").data_size > 0
    assert entry == sized_symbols(path)["_start"][0]


def test_c_functions_keep_frame_pointers(build: Path) -> None:
    """Every C function of the workload starts with push %ebp; mov %esp,%ebp (55 89 e5)."""
    handwritten = {n for names in I386_EXPECTED["frameless_leaf"].values() for n in names}
    cases = [
        (
            build / "kernel.elf",
            [*I386_EXPECTED["syscall_path"][1:], "kwork_checksum", "kworker_main"],
        ),
        *(
            (build / "user" / f"{p}.elf", [f for f in spec["shares"] if f not in handwritten])
            for p, spec in I386_EXPECTED["programs"].items()
        ),
    ]
    for path, functions in cases:
        symbols = sized_symbols(path)
        with path.open("rb") as f:
            text = section(ELFFile(f), ".text")
            data, base = text.data(), text["sh_addr"]
        for name in (f for f in functions if f in symbols):  # sys's shares name kernel ones too
            start = symbols[name][0] - base
            assert data[start : start + 3] == b"\x55\x89\xe5", (path.name, name)


def test_proxy_rewrites_the_x86_64_layout_into_i386() -> None:
    """A hand-built 608-byte x86_64 `g` reply: each field a distinct value, so a register taken
    from the wrong offset shows."""
    raw = bytearray(608)
    x86_64_gprs = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp")
    for slot, _ in enumerate(x86_64_gprs):
        struct.pack_into("<Q", raw, 8 * slot, 0x1000 + slot | 0xDEAD << 32)  # high half dropped
    struct.pack_into("<Q", raw, 128, 0xC0100FF0)  # rip
    struct.pack_into("<7I", raw, 136, 0x202, 0x23, 0x1B, 0x1B, 0x1B, 0x1B, 0x1B)  # eflags, cs..gs
    raw[236:246] = bytes(range(1, 11))  # st0
    reply = i386_registers(raw.hex().encode())
    out = bytes.fromhex(reply.decode())
    assert len(out) == sum(bits // 8 for _, bits, _, _ in I386_LAYOUT) == 176
    eax, ecx, edx, ebx, esp, ebp, esi, edi, eip, eflags, cs = struct.unpack_from("<11I", out)
    assert (eax, ebx, ecx, edx, esi, edi, ebp, esp) == tuple(0x1000 + i for i in range(8))
    assert (eip, eflags, cs) == (0xC0100FF0, 0x202, 0x23)
    assert out[64:74] == bytes(range(1, 11))
    assert i386_register(raw.hex().encode(), 8) == b"f00f10c0"  # eip, as a `p` reply
    assert i386_registers(b"E14") == b"E14"
