"""The bundled guest's built ELF files do what fixtures/guest/expected.json and its README claim:
link addresses, symbols, which builds carry CFI, frame pointers (the guest booted:
tests/e2e/test_guest_boot.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from guestelf import EXPECTED, KERNEL_BOUNDARY, elf_sections, elf_symbols
from guestvm import BUILD_ROOT, section

# ---- the ELF files ------------------------------------------------------------------------


def test_build_fixtures_is_idempotent(guest_build: None) -> None:
    outputs = [p for v in EXPECTED["variants"] for p in (BUILD_ROOT / v).rglob("*.elf")]
    before = {p: p.stat().st_mtime_ns for p in outputs}
    subprocess.run([BUILD_ROOT.parent.parent / "scripts" / "build-fixtures"], check=True)
    assert {p: p.stat().st_mtime_ns for p in outputs} == before
    assert len(outputs) == len(EXPECTED["variants"]) * (1 + len(EXPECTED["programs"]))


@pytest.mark.parametrize("variant", EXPECTED["variants"])
def test_kernel_is_linked_in_the_higher_half_with_its_workload_symbols(
    variant: str, guest_build: None
) -> None:
    kernel = BUILD_ROOT / variant / "kernel.elf"
    sections = elf_sections(kernel)
    assert sections[".text"][0] >= KERNEL_BOUNDARY
    assert ".debug_info" in sections  # built with -g
    symbols = elf_symbols(kernel)
    wanted = [*EXPECTED["syscall_path"], *EXPECTED["interrupt_path"], EXPECTED["progress_symbol"]]
    for thread in EXPECTED["kernel_threads"].values():
        wanted += list(thread["shares"])
    missing = [name for name in wanted if name not in symbols]
    assert not missing
    assert all(symbols[name] >= KERNEL_BOUNDARY for name in wanted)


@pytest.mark.parametrize("variant", EXPECTED["variants"])
def test_user_programs_share_one_link_address(variant: str, guest_build: None) -> None:
    base = int(EXPECTED["user_link_address"], 16)
    for program, spec in EXPECTED["programs"].items():
        path = BUILD_ROOT / variant / "user" / f"{program}.elf"
        with path.open("rb") as f:
            elf = ELFFile(f)
            loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            assert min(s["p_vaddr"] for s in loads) == base
        user = elf_symbols(path)
        kernel = elf_symbols(BUILD_ROOT / variant / "kernel.elf")
        names = {*spec["shares"], *(name for stack in spec["stacks"] for name in stack)}
        for name in names:  # each documented function is user code or kernel code, by address
            if name in user:
                assert user[name] < KERNEL_BOUNDARY
            else:
                assert kernel[name] >= KERNEL_BOUNDARY


def test_only_the_cfi_build_has_eh_frame(guest_build: None) -> None:
    for program in EXPECTED["programs"]:
        cfi = elf_sections(BUILD_ROOT / "cfi" / "user" / f"{program}.elf")
        fp = elf_sections(BUILD_ROOT / "fp" / "user" / f"{program}.elf")
        assert ".eh_frame" in cfi and ".eh_frame_hdr" in cfi
        assert ".eh_frame" not in fp and ".debug_frame" in fp
    assert elf_sections(BUILD_ROOT / "cfi" / "kernel.elf")[".eh_frame"][1] > 0
    assert ".eh_frame" not in elf_sections(BUILD_ROOT / "fp" / "kernel.elf")


def fde_ranges(path: Path) -> list[tuple[int, int]]:
    from elftools.dwarf.callframe import FDE

    with path.open("rb") as f:
        elf = ELFFile(f)
        dwarf = elf.get_dwarf_info()
        entries = dwarf.EH_CFI_entries() if dwarf.has_EH_CFI() else dwarf.CFI_entries()
        return [
            (e.header["initial_location"], e.header["initial_location"] + e.header["address_range"])
            for e in entries
            if isinstance(e, FDE)
        ]


@pytest.mark.parametrize("variant", EXPECTED["variants"])
def test_no_cfi_functions_have_no_fde_and_others_do(variant: str, guest_build: None) -> None:
    for program, names in EXPECTED["no_cfi"].items():
        path = BUILD_ROOT / variant / "user" / f"{program}.elf"
        symbols = elf_symbols(path)
        ranges = fde_ranges(path)

        def covered(addr: int, ranges: list[tuple[int, int]] = ranges) -> bool:
            return any(lo <= addr < hi for lo, hi in ranges)

        assert not any(covered(symbols[name]) for name in names)
        assert covered(symbols["main"]) and covered(symbols["_start"])


@pytest.mark.parametrize("variant", EXPECTED["variants"])
def test_frameless_leaves_do_not_push_rbp(variant: str, guest_build: None) -> None:
    """The frame-pointer trap: these leaves run with the caller's rbp even in the fp build."""
    import capstone

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    for owner, names in EXPECTED["frameless_leaf"].items():
        path = BUILD_ROOT / variant / ("kernel.elf" if owner == "kernel" else f"user/{owner}.elf")
        with path.open("rb") as f:
            elf = ELFFile(f)
            text = section(elf, ".text")
            code, base = text.data(), text["sh_addr"]
            symtab = section(elf, ".symtab")
            for name in names:
                sym = symtab.get_symbol_by_name(name)[0]
                body = code[sym["st_value"] - base : sym["st_value"] - base + sym["st_size"]]
                insns = [f"{i.mnemonic} {i.op_str}" for i in md.disasm(body, sym["st_value"])]
                assert insns and insns[-1].startswith("ret")
                assert not any("rbp" in insn or "rsp" in insn for insn in insns), insns


# Hand-written assembly functions (entry.S, leaf.S, start.S, spin_mix.S): they follow no
# compiler frame discipline; every other function is C.
ASM_FUNCTIONS = {
    "isr_common",
    "entry_syscall",
    "switch_to",
    "task_start_user",
    "kthread_start",
    "checksum_leaf",
    "_start",
    "spin_mix",
}


def function_prologues(path: Path) -> dict[str, list[str]]:
    """Function name -> its first four instructions."""
    import capstone

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    with path.open("rb") as f:
        elf = ELFFile(f)
        text = section(elf, ".text")
        code, base = text.data(), text["sh_addr"]
        out = {}
        for sym in section(elf, ".symtab").iter_symbols():
            if sym["st_info"]["type"] != "STT_FUNC" or sym["st_size"] == 0:
                continue
            body = code[sym["st_value"] - base : sym["st_value"] - base + sym["st_size"]]
            insns = [f"{i.mnemonic} {i.op_str}" for i in md.disasm(body, sym["st_value"])]
            out[sym.name] = insns[:4]
        return out


@pytest.mark.parametrize("variant", EXPECTED["variants"])
def test_frame_pointer_discipline(variant: str, guest_build: None) -> None:
    """fp: every C function, leaves included, links a frame; cfi: none does."""
    elfs = [BUILD_ROOT / variant / "kernel.elf", *(BUILD_ROOT / variant / "user").glob("*.elf")]
    checked = 0
    for path in elfs:
        for name, head in function_prologues(path).items():
            if name in ASM_FUNCTIONS or name.startswith("isr_"):  # isr_N: the vector stubs
                continue
            links = bool(head) and head[0] == "push rbp" and "mov rbp, rsp" in head
            assert links == (variant == "fp"), (path.name, name, head)
            checked += 1
    assert checked > 40
    assert {"compute_leaf", "sys_user_work"} <= set(
        function_prologues(BUILD_ROOT / variant / "kernel.elf")
    ) | set(function_prologues(BUILD_ROOT / variant / "user" / "sys.elf"))
