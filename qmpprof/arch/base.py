"""The instruction-set seam: what the rest of qmpprof needs to know of one instruction set.

An instruction set names its registers by DWARF number (its psABI's), has a word size, splits
the address space between kernel and user, lays out the frames the CPU pushes on a trap, says
what a plausible return address is, and may analyse a function's prologue when code has no CFI.
QEMU prints a target's registers in its own formats (the monitor's ``info registers`` text, the
gdbstub's ``g`` packet): a ``RegisterFormats`` of the target's family turns them into the model's
``Registers``, in the DWARF numbers of the instruction set the vCPU was running; what every
family reads alike (a ``g`` reply's bytes, the blocks of ``info registers``, the registers the
walk cannot start without) is read here once.

Each instruction set is one module of this package, registered in ``qmpprof.arch``; nothing
outside this package names one (docs/layering.md).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from qmpprof.errors import TransportError
from qmpprof.model import Registers

_CPU = re.compile(r"^CPU#(\d+)", re.MULTILINE)  # a vCPU's part of `info registers`

ReadWord = Callable[[int], int | None]  # a stack word at an address, None: not readable


@dataclass(frozen=True, slots=True)
class PrologueRule:
    """At a pc with no CFI, the CFA (the caller's stack pointer) is ``sp + cfa_offset``; the
    return address is saved at ``CFA + ra_offset`` (None: one word below the CFA, where a call
    pushed it), or is still in register ``ra_register`` when that is set (a link register,
    before the function saves it or after it loads it back); the caller's frame pointer is saved
    at ``CFA + fp_offset`` when that is set, else the frame pointer is unchanged."""

    cfa_offset: int
    fp_offset: int | None = None
    ra_offset: int | None = None
    ra_register: int | None = None


@dataclass(frozen=True, slots=True)
class ReturnRule:
    """Where a function's return address is, found by following its code to its ``ret``: at
    ``ra_offset`` from the stack pointer the frame had at the scan's start (``from_fp``: from its
    frame pointer, after a ``leave``). The caller's frame pointer is saved at ``fp_offset`` from
    the same base when that is set (popped on the way), else it is the frame's own. ``entry``:
    found from this function start (``return_from_entry``), which a direct call returning there
    must call. ``trap``: the code ends in a return from a trap (x86's ``iret``): at
    ``ra_offset`` lies the frame the CPU pushed (``trap_return``), the pc interrupted code's."""

    from_fp: bool
    ra_offset: int
    fp_offset: int | None = None
    entry: int | None = None
    trap: bool = False


@dataclass(frozen=True, slots=True)
class PathToCall:
    """Straight-line code from a pc to a direct call (a trap entry caught before it calls its
    handler, say): ``depth`` bytes pushed on the way; ``saved``: each pushed word whose value is
    a register's as it is at the pc (its offset from the stack pointer at the pc, the register's
    DWARF number); ``addresses``: each pushed word that holds a stack address (its offset, and
    the address's offset from the same stack pointer: ``push esp`` pushes its own word's end);
    ``held``: each register that holds a stack address at the call (its DWARF number, and the
    address's offset from that stack pointer: ``mov rdi, rsp`` before the call); ``written``:
    the registers the way writes (DWARF numbers: any other holds its value at the pc)."""

    depth: int
    saved: tuple[tuple[int, int], ...] = ()
    addresses: tuple[tuple[int, int], ...] = ()
    held: tuple[tuple[int, int], ...] = ()
    written: frozenset[int] = frozenset()


class InstructionSet(Protocol):
    """One instruction set, as the walker, the sampler and the guest OSes need it."""

    @property
    def name(self) -> str:
        """The registry's name (``x86_64``): ``Registers.isa`` holds it."""
        ...

    @property
    def address_size(self) -> int:
        """Bytes of an address and of a stack word."""
        ...

    @property
    def pc(self) -> int:
        """DWARF number of the program counter (the return-address column)."""
        ...

    @property
    def sp(self) -> int: ...

    @property
    def fp(self) -> int: ...

    @property
    def names(self) -> tuple[str, ...]:
        """Each DWARF number's register name, up to ``pc``."""
        ...

    @property
    def elf_machine(self) -> tuple[int, int]:
        """The ELF ``e_machine`` and class (32, 64) of its code."""
        ...

    @property
    def frame_record(self) -> tuple[int, int, int]:
        """Where a frame record lies from the frame pointer: the offsets of the caller's frame
        pointer, of the return address, and the caller's stack pointer's."""
        ...

    @property
    def kernel_boundary(self) -> int:
        """The default split: code at or above it is the kernel's."""
        ...

    @property
    def shared_from(self) -> int:
        """Addresses at or above this look the same in every address space (the kernel's)."""
        ...

    @property
    def mask(self) -> int:
        """All address bits set: address arithmetic wraps at this width."""
        ...

    @property
    def same_level_trap_saves_sp(self) -> bool:
        """Whether a trap taken in kernel code saves the interrupted stack pointer in the trap
        frame; False: that stack went on where the frame's stack-pointer slot is."""
        ...

    @property
    def space_register(self) -> str:
        """What the instruction set calls the page-table root (``cr3``): the name a process
        known only by its address space goes by."""
        ...

    @property
    def translation_registers(self) -> tuple[str, ...]:
        """The system registers (as QEMU's gdbstub names them) whose values ``translated``
        needs; empty when none."""
        ...

    @property
    def user_space_end(self) -> int | None:
        """Where user space ends as the translation settings put it; None where the page
        tables' levels decide (x86_64: walked by ``linux.running.pagetables``)."""
        ...

    def translated(self, values: Mapping[str, int]) -> InstructionSet:
        """This instruction set under the guest's translation settings (``values`` of
        ``translation_registers`` read from it); itself when they change nothing."""
        ...

    def return_address(self, value: int) -> int | None:
        """The code address a saved return address stands for (bits the CPU adds to it, such
        as a pointer-authentication code, taken off), None when no code can be there."""
        ...

    def trap_frame_sp(self, after_pc: int, read: ReadWord) -> int | None:
        """The interrupted user stack pointer of the frame the CPU pushed on a trap from user
        mode, whose pc slot ends at ``after_pc``; None when what follows is not such a frame."""
        ...

    def trap_return(self, slot: int, read: ReadWord) -> tuple[int, int] | None:
        """The interrupted pc and stack pointer of the frame the CPU pushed on a trap, its pc
        at ``slot``, as a return from the trap takes them; None when that is not such a frame
        (a read that fails included)."""
        ...

    def prologue(
        self,
        code: bytes,
        code_addr: int,
        pc: int,
        func_start: int | None,
        func_end: int | None = None,
    ) -> PrologueRule | None:
        """How to find the caller at link address ``pc`` in ``code`` (at ``code_addr``) by
        analysing the function's instructions (``func_start``..``func_end``: its symbol's
        extent, as far as known); None: no answer (frame pointers then)."""
        ...

    def return_scan(self, code: bytes, code_addr: int, pc: int) -> ReturnRule | None:
        """Where the return address is for a frame at link address ``pc`` in ``code`` with no
        CFI and no symbol, found by following the instructions from ``pc`` to a return; None:
        code it cannot model (see ``x86code.ReturnScanner``)."""
        ...

    def return_from_entry(
        self, code: bytes, code_addr: int, pc: int, starts: Sequence[int], *, caller: bool
    ) -> ReturnRule | None:
        """Where the return address is for a frame at ``pc`` in a function that may never
        return: found from one of ``starts`` (``function_starts``) by a path reaching ``pc``
        (``caller``: ``pc`` is a return address, never its own function's start)."""
        ...

    def function_starts(self, code: bytes, code_addr: int, data: Sequence[bytes]) -> list[int]:
        """Where functions of ``code`` may start (sorted), guessed from the code and the file's
        data sections ``data``."""
        ...

    def is_call_before(self, code: bytes, ra: int) -> bool:
        """Whether ``code`` (the bytes right before ``ra``) ends in a call instruction."""
        ...

    def prepare(self) -> None:
        """Build what ``prologue`` needs (a disassembler) before the first pause."""
        ...

    def same_code(self, file: bytes, running: bytes) -> bool:
        """Whether ``running`` (code read in the guest) is ``file``'s code, the instruction
        set's equivalent forms of one instruction taken as the same."""
        ...

    def call_before(self, code: bytes, ra: int) -> int | None:
        """The target of the direct call that returns to ``ra`` (``code``: the bytes right
        before ``ra``), None when no direct call ends there."""
        ...

    def path_to_call(self, code: bytes, code_addr: int, pc: int, target: int) -> PathToCall | None:
        """What the code at link address ``pc`` in ``code`` pushes on its straight way (direct
        jumps followed) to a direct call of ``target``; None when it goes anywhere else first,
        moves the stack pointer other than by pushes, or is code this cannot model."""
        ...

    def branches(self, code: bytes, addr: int) -> list[tuple[int, int | None]]:
        """(address after, target) of every jump in ``code`` at ``addr`` (target None: an
        indirect one); calls are not jumps."""
        ...

    def lone_jump(self, code: bytes, addr: int) -> tuple[int, int] | None:
        """(address after, target) of the jump that ``code`` (a function, from its start at
        ``addr``) begins with: landing pads and no-ops, then an unconditional direct jump
        (arm64's ``memset``: ``bti c; b __pi_memset_generic``); None when it begins otherwise.
        What follows the jump is not reached from the start."""
        ...


class FrameRecordsOnly:
    """What an instruction set that the walk crosses by prologues and frame records alone has
    nothing for (aarch64, riscv64): its CPU pushes no frame on a trap (it keeps the interrupted
    pc in a register, ELR or sepc, and the kernel saves the rest itself), qmpprof follows none of
    its code to a return or to a call (its trap entries build no frame by pushes), and its few
    instructions that matter are decoded by hand."""

    __slots__ = ()

    def trap_frame_sp(self, after_pc: int, read: ReadWord) -> int | None:
        return None

    def trap_return(self, slot: int, read: ReadWord) -> tuple[int, int] | None:
        return None

    def return_scan(self, code: bytes, code_addr: int, pc: int) -> ReturnRule | None:
        return None

    def return_from_entry(
        self, code: bytes, code_addr: int, pc: int, starts: Sequence[int], *, caller: bool
    ) -> ReturnRule | None:
        return None

    def function_starts(self, code: bytes, code_addr: int, data: Sequence[bytes]) -> list[int]:
        return []

    def path_to_call(self, code: bytes, code_addr: int, pc: int, target: int) -> PathToCall | None:
        return None

    def prepare(self) -> None:
        return None


class RegisterFormats(Protocol):
    """How QEMU prints one target family's registers."""

    # Registers the gdbstub's ``g`` lacks and a sample needs, read with it (``p``), by the
    # names the target description gives them.
    extra: tuple[str, ...]

    def from_monitor(self, text: str) -> list[Registers]:
        """Every vCPU's registers from ``info registers`` text (one block per vCPU)."""
        ...

    def from_gdb(
        self, cpu: int, payload: bytes, extra: Mapping[str, int] | None = None
    ) -> Registers:
        """One vCPU's registers from a gdbstub ``g`` reply (hex text), and the values of
        ``extra`` that read."""
        ...


def per_cpu(text: str, block: Callable[[int, str], Registers]) -> list[Registers]:
    """QEMU's ``info registers`` text for every vCPU cut at each ``CPU#N`` header, each part
    read by ``block(N, part)``, whatever the target."""
    starts = list(_CPU.finditer(text))
    if not starts:
        raise TransportError(f"not 'info registers' output: {text.strip()[:60]!r}")
    blocks = []
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        blocks.append(block(int(match.group(1)), text[match.end() : end]))
    return blocks


def frame_registers(
    isa: InstructionSet,
    cpu: int,
    gprs: dict[int, int],
    *,
    user: bool,
    space: int,
    special: dict[str, int],
    halted: bool = False,
) -> Registers:
    """The model's registers of a vCPU running ``isa``, from its registers by DWARF number;
    TransportError naming the first of its pc, stack and frame pointer that is missing."""
    missing = [isa.names[n] for n in (isa.pc, isa.sp, isa.fp) if n not in gprs]
    if missing:
        raise TransportError(f"register {missing[0]} missing")
    return Registers(
        cpu=cpu,
        isa=isa.name,
        pc=gprs[isa.pc],
        sp=gprs[isa.sp],
        fp=gprs[isa.fp],
        user=user,
        space=space,
        halted=halted,
        gprs=gprs,
        special=special,
    )


def gdb_reply(payload: bytes) -> bytes:
    """The bytes of a gdbstub ``g`` reply (hex text)."""
    try:
        return bytes.fromhex(payload.decode("ascii"))
    except ValueError as err:
        raise TransportError(f"malformed register packet from the gdbstub: {err}") from err


def core_registers(raw: bytes, layout: struct.Struct, isa: str) -> tuple[int, ...]:
    """The registers ``layout`` (``isa``'s core registers) puts at the start of a ``g`` reply's
    bytes, whatever follows them; TransportError for a reply too short to hold them."""
    if len(raw) < layout.size:
        raise TransportError(
            f"register packet of {len(raw)} bytes, expected at least {layout.size} ({isa})"
        )
    return layout.unpack_from(raw)
