"""riscv64 Linux's exception entry and exit code as the walk needs it
(``unwind.savedregs.SavedRegsEntry``), read from the kernel's own symbols, BTF and code.

``handle_exception`` (arch/riscv/kernel/entry.S) swaps tp with sscratch, then takes the kernel
stack, lowers sp by the size of ``struct pt_regs`` and stores the interrupted registers there
(general register n at ``pt_regs`` + 8n: ``ra`` at 8 .. ``t6`` at 248, ``epc`` in x0's place,
then ``status``), then calls the handler with sp at that frame, adding no frame record; the
way back, ``ret_from_exception``, loads them again, sp last, then ``sret``. So:

- from its start to its first write of sp, the interrupted registers are the CPU's, the pc in
  ``sepc`` (the exception link register);
- from the instruction after its last store to sp-relative memory up to its end, and in
  ``ret_from_exception`` up to its load of sp, ``pt_regs`` is whole at sp;
- after that load (the ``sret``), the registers are restored, the pc in ``sepc`` again.

The status's SPP bit (8, the privileged ISA's sstatus) is set when the exception came from
S-mode, the kernel. What the code does not show in this shape (no such symbol, a frame its
stores do not fill as BTF lays ``pt_regs`` out) is said in one line, and the walk stops at the
entry. Checked on trixie's riscv64 6.12.
"""

from __future__ import annotations

from qmpprof.arch.riscv64code import SP, instructions, is_call
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.linux.riscv64.ptregs import SPP, pt_regs
from qmpprof.unwind.savedregs import SavedRegsEntry

SEPC = 0x1000 + 0x141  # sepc, CSR 0x141, at 4096 + its number (the psABI's DWARF numbering)
_COUNT = 32  # x0..x31: x0's slot holds epc


def entry_code(kernel: LinuxKernel) -> SavedRegsEntry | str | None:
    """The kernel's exception code; None without ``handle_exception`` (no such code to
    describe), or one line saying why its BTF or code does not describe it."""
    image, symbols = kernel.image, kernel.image.symbols
    entry, back = symbols.address_of("handle_exception"), symbols.address_of("ret_from_exception")
    if entry is None:
        return None
    offsets = None if kernel.btf is None else pt_regs(kernel.btf)
    extents = [symbols.extent(at) for at in (entry, back) if at is not None]
    code = image.text_bytes
    if offsets is None or len(extents) != 2 or code is None:
        return "no pt_regs in this kernel's BTF: kernel stacks end at an exception's entry"
    text = image.text_addr
    (start, end), (back_start, back_end) = (e for e in extents if e is not None)
    found = _entry_shape(code, text, start, end, offsets)
    if isinstance(found, str):
        return _unknown(found)
    live_end, saved_start = found
    load = _sp_load(code, text, back_start, back_end, offsets["sp"])
    if load is None:
        return _unknown("ret_from_exception loads no sp from pt_regs")
    return SavedRegsEntry(
        entry=((start, end), (back_start, back_end)),
        live=((start, live_end), (load, back_end)),
        saved=((saved_start, end), (back_start, load)),
        regs=offsets["epc"],
        count=_COUNT,
        pc=offsets["epc"],
        status=offsets["status"],
        from_kernel=SPP,
        link=SEPC,
        link_name="sepc",
    )


def _unknown(why: str) -> str:
    return (
        f"this kernel's exception entry code is in no shape qmpprof knows ({why}):"
        " kernel stacks end at an exception's entry"
    )


def _entry_shape(
    code: bytes, text: int, start: int, end: int, offsets: dict[str, int]
) -> tuple[int, int] | str:
    """Where in ``handle_exception`` sp is first written (the CPU's registers live before it),
    and where ``pt_regs`` is whole: after the last store to sp-relative memory before its first
    call, once the stores covered the members the walk reads."""
    first_write, last_store, stored = None, None, set()
    for at, size, (kind, rd, rs1, imm) in instructions(code, text, start, end):
        if is_call(kind, rd):
            break
        if kind == "sd" and rs1 == SP and first_write is not None:
            last_store = at + size
            stored.add(imm)
        elif rd == SP and kind in ("addi", "ld", "write") and first_write is None:
            first_write = at
    if first_write is None or last_store is None:
        return "handle_exception builds no frame at sp before its call"
    if not set(offsets.values()) <= stored:
        return "handle_exception's stores do not fill pt_regs as BTF lays it out"
    return first_write, last_store


def _sp_load(code: bytes, text: int, start: int, end: int, sp_offset: int) -> int | None:
    """The end of ``ret_from_exception``'s ``ld sp, <pt_regs.sp>(sp)``: pt_regs whole until
    then."""
    for at, size, found in instructions(code, text, start, end):
        if found == ("ld", SP, SP, sp_offset):
            return at + size
    return None
