"""riscv64: qemu-system-riscv64's register formats read into the model's Registers (the monitor's
``info registers -a`` text of a 2-vCPU guest both in S-mode, and vCPU 1's gdbstub ``g`` reply
taken as it entered handle_exception from user mode, captured from QEMU 7.2 on trixie's riscv64
6.12 into tests/data/hmp/riscv64-linux-*), satp's modes, instructions decoded and the prologue and
epilogue analysis on code of that kernel's -dbg vmlinux and of trixie's riscv64 liblzma, and the
frame-record walk over a hand-made chain."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from test_unwind_chain import memory

from qmpprof import arch
from qmpprof.arch.base import PrologueRule
from qmpprof.arch.riscv64 import RISCV64, va_bits
from qmpprof.arch.riscv64regs import RiscV64Formats, riscv64_registers
from qmpprof.errors import TransportError
from qmpprof.model import StopReason
from qmpprof.unwind.chain import AddressSpace, Unwinder, Via

DATA = Path(__file__).parents[1] / "data" / "hmp"
FORMATS = RiscV64Formats()
RA = 1
SV57 = 0xA001_9000_0008_38A5  # vCPU 0's satp in the capture: mode 10

# Code of trixie's linux-image-6.12.117+deb13-riscv64-dbg vmlinux (.text, by its .symtab):
# vfs_read's first 0x4c bytes and its epilogue at +0xd2, memchr whole, __pi_strlen's first 0x18.
VFS_READ = 0xFFFF_FFFF_8031_79D6
VFS_READ_CODE = bytes.fromhex(
    "0100010001000100357122e9cefc06ed4ae100115c4503378257233ce4fa014793f917006389092a"
    "1397e7026357072a17370f010347a7f626e5d2f8d6f4daf085472a8a2e8bb284b68ae21711eb1737"
    "0f010347d7f485479a1719c38547be1763ec9704858f63e96705a6865686d285014597e0ffffe780"
    "60602a8935e1b7f7ff7f63f39700be8403370a011c6fd5cbd6862686da85528582972a8963472005"
    "8567929703b70792050723b0e792aa64467aa67a067b31a0aa64467aa67a067b4959033784fb8337"
    "8257b98f0147639c0720ea604a64e6794a850a690d618280"
)
MEMCHR = 0xFFFF_FFFF_80A5_AFCE
MEMCHR_CODE = bytes.fromhex(
    "411122e006e400082a9693f5f50f630bc50083470500130715006386b7003a85e319c5fe0145a260026441018280"
)
MEMSET = 0xFFFF_FFFF_80A6_5468
# Debian's 6.12 riscv64 __memset (arch/riscv/lib/memset.S, 0xfc bytes): branches, then a
# computed jump (auipc; jr a5) into a run of 32 sd, looped back to: never a write to sp or ra.
MEMSET_CODE = bytes.fromhex(
    "aa8293360601f5e293867200e19a638a5600338756402380b2008502e3edd2fe198e93f5f50f93968500d58d9396"
    "0501d58d93960502d58d137786ffb386e2001377870f11cf3307e04013070710b382e240970700009387e7000583"
    "ba97828723b0b20023b4b20023b8b20023bcb20023b0b20223b4b20223b8b20223bcb20223b0b20423b4b20423b8"
    "b20423bcb20423b0b20623b4b20623b8b20623bcb20623b0b20823b4b20823b8b20823bcb20823b0b20a23b4b20a"
    "23b8b20a23bcb20a23b0b20c23b4b20c23b8b20c23bcb20c23b0b20e23b4b20e23b8b20e23bcb20e93820210e3ee"
    "d2f61d8a01cab386c2002380b2008502e3edd2fe8280"
)
STRLEN = 0xFFFF_FFFF_80A6_56A0
STRLEN_CODE = bytes.fromhex("130000002a8383420300638402000503ddbf3305a3408280")
# liblzma.so.5.8.1 (trixie's liblzma5, riscv64), lzma_code's first 0x1e bytes at 0x3fca: built
# without frame pointers, it saves s0 and then uses it (``mv s0, a0``).
LZMA_CODE = 0x3FCA
LZMA_CODE_CODE = bytes.fromhex("5d71106126fc9744020083b484fda2e086e49c603ef481472a84ae8641c2")


def capture(name: str) -> str:
    with open(DATA / name, encoding="ascii", newline="") as f:
        return f.read()


def test_monitor_text_gives_every_vcpu() -> None:
    cpu0, cpu1 = FORMATS.from_monitor(capture("riscv64-linux-smode.txt"))
    assert (cpu0.cpu, cpu0.isa, cpu0.user) == (0, "riscv64", False)
    assert (cpu0.pc, cpu0.sp, cpu0.fp) == (
        0xFFFF_FFFF_8026_0F20, 0xFF20_0000_002A_BC20, 0xFF20_0000_002A_BC30,
    )  # fmt: skip
    assert cpu0.gprs[RA] == 0xFFFF_FFFF_8026_5466
    assert cpu0.gprs[0] == 0 and len(cpu0.gprs) == 33
    assert cpu0.special["satp"] == SV57 and cpu0.special["sscratch"] == 0
    assert cpu0.space == 0x8_38A5 << 12  # satp's root page number, the ASID left out
    assert (cpu1.cpu, cpu1.pc, cpu1.user) == (1, 0xFFFF_FFFF_80A8_1240, False)
    assert cpu1.special["stvec"] == cpu1.pc  # stopped at the trap vector's first instruction


def test_monitor_text_of_user_code() -> None:
    text = capture("riscv64-linux-smode.txt").replace(
        " pc       ffffffff80260f20", " pc       00007fffb55e723e"
    )
    assert FORMATS.from_monitor(text)[0].user


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Error: no CPU", "not 'info registers' output"),
        ("CPU#0\r\n pc       ffffffff80001000\r\n x2/sp    ff20000000001000\r\n", "x8 missing"),
        ("CPU#0\r\n x2/sp    ff20000000001000 x8/s0    0000000000000000\r\n", "pc missing"),
    ],
)
def test_bad_monitor_text_is_one_clear_error(text: str, message: str) -> None:
    with pytest.raises(TransportError, match=message):
        FORMATS.from_monitor(text)


def test_gdb_reply_in_the_core_layout() -> None:
    # At handle_exception's first instruction the registers are still user code's: sp, tp, s0.
    regs = FORMATS.from_gdb(1, capture("riscv64-linux-trap-cpu1.g").encode())
    assert (regs.pc, regs.sp, regs.fp) == (0xFFFF_FFFF_80A8_1240, 0x7FFF_D1ED_B390, 0x2F0D_EA71)
    assert regs.gprs[RA] == 0x5_06F8 and regs.gprs[4] == 0x2F0D_D760
    assert not regs.user and regs.space == 0 and regs.special == {}


def test_gdb_reply_built_by_hand() -> None:
    words = [n * 0x100 for n in range(32)] + [0x1_0000]
    regs = FORMATS.from_gdb(0, struct.pack("<33Q", *words).hex().encode())
    assert (regs.pc, regs.sp, regs.fp, regs.user) == (0x1_0000, 0x200, 0x800, True)


def test_the_privilege_mode_read_with_g_says_the_mode() -> None:
    # priv (QEMU's gdbstub, read beside g): 0 user, 1 supervisor, 3 machine. OpenSBI runs at
    # physical addresses in the lower half: by the pc alone it would be user code.
    words = [n * 0x100 for n in range(32)] + [0x8000_0408]
    payload = struct.pack("<33Q", *words).hex().encode()
    assert FORMATS.extra == ("priv", "mstatus", "mepc", "sscratch")
    supervisor = FORMATS.from_gdb(0, payload, {"priv": 1})
    assert not supervisor.user and supervisor.special.get("paging", 1)  # a kernel linked low
    firmware = FORMATS.from_gdb(0, payload, {"priv": 3, "mstatus": 0x1800, "mepc": 0x10_0000})
    assert not firmware.user and firmware.special["paging"] == 0
    assert "user_pc" not in firmware.special  # entered from M-mode (MPP 3): no user code
    entered = {"priv": 3, "mstatus": 0x0000_000A_0000_0080, "mepc": 0x2A_AAAB_1234}  # MPP 0
    from_user = FORMATS.from_gdb(0, payload, entered)
    assert from_user.special["user_pc"] == 0x2A_AAAB_1234 and from_user.special["paging"] == 0
    from_kernel = FORMATS.from_gdb(0, payload, {**entered, "mstatus": 0x0A_0000_0880})  # MPP 1
    assert "user_pc" not in from_kernel.special
    assert FORMATS.from_gdb(0, payload, {"priv": 0}).user


@pytest.mark.parametrize(
    ("payload", "message"),
    [(b"zz", "malformed"), (b"00" * 100, "100 bytes, expected at least 264")],
)
def test_bad_gdb_reply_is_one_clear_error(payload: bytes, message: str) -> None:
    with pytest.raises(TransportError, match=message):
        FORMATS.from_gdb(0, payload)


def test_registered_by_elf_machine_qemu_target_and_gdb_architecture() -> None:
    assert arch.by_elf(243, 64) is RISCV64
    assert arch.by_name("riscv64") is RISCV64
    assert isinstance(arch.formats("riscv64"), RiscV64Formats)
    assert isinstance(arch.formats("riscv:rv64"), RiscV64Formats)


def test_satp_modes_set_the_halves() -> None:
    assert [va_bits(mode << 60) for mode in (0, 8, 9, 10, 11)] == [None, 39, 48, 57, None]
    sv57 = RISCV64.translated({"satp": SV57})
    assert sv57.user_space_end == 1 << 56
    sv39 = RISCV64.translated({"satp": 8 << 60})
    assert sv39.user_space_end == 1 << 38
    assert sv39.return_address(0xFFFF_FFFF_8026_5466) == 0xFFFF_FFFF_8026_5466
    assert sv39.return_address(0x3F_FFFF_F000) == 0x3F_FFFF_F000
    assert sv39.return_address(0x40_0000_0000) is None  # past Sv39's lower half
    assert sv57.return_address(0x40_0000_0000) == 0x40_0000_0000
    # Bare (mode 0) or no satp: the widest bounds, as unknown.
    assert RISCV64.translated({"satp": 0x8_38A5}) is RISCV64 is RISCV64.translated({})
    assert RISCV64.user_space_end is None
    assert RISCV64.return_address(1 << 60) is None and RISCV64.return_address(1 << 64) is None


def test_kernel_half_and_no_cpu_trap_frame() -> None:
    assert RISCV64.kernel_boundary == RISCV64.shared_from == 1 << 63
    assert RISCV64.trap_frame_sp(0xFFFF_FFFF_8000_1000, lambda _: 0) is None
    # Words x86 would take for a trap frame (pc, cs, flags, sp all 2): a return is through
    # registers here.
    assert RISCV64.trap_return(0xFFFF_FFFF_8000_1000, lambda _: 2) is None
    assert RISCV64.frame_record == (-16, -8, 0)


@pytest.mark.parametrize(
    ("pc", "rule"),
    [
        (VFS_READ, PrologueRule(0, ra_register=RA)),  # ftrace's c.nops
        (VFS_READ + 8, PrologueRule(0, ra_register=RA)),  # at c.addi16sp sp, -160
        (VFS_READ + 0xA, PrologueRule(160, ra_register=RA)),
        (VFS_READ + 0xC, PrologueRule(160, fp_offset=-16, ra_register=RA)),  # s0 stored
        (VFS_READ + 0x10, PrologueRule(160, fp_offset=-16, ra_offset=-8)),  # ra stored
        (VFS_READ + 0x12, PrologueRule(160, fp_offset=-16, ra_offset=-8)),  # at addi s0
        (VFS_READ + 0x14, None),  # s0 set: frame records from here
        (VFS_READ + 0x30, None),
        # The epilogue: ld ra, 152(sp); ld s0, 144(sp); ld s3; mv; ld s2; addi sp, 160; ret
        (VFS_READ + 0xD2, PrologueRule(160, fp_offset=-16, ra_offset=-8)),
        (VFS_READ + 0xD4, PrologueRule(160, fp_offset=-16, ra_register=RA)),
        (VFS_READ + 0xD6, PrologueRule(160, ra_register=RA)),
        (VFS_READ + 0xDC, PrologueRule(160, ra_register=RA)),
        (VFS_READ + 0xDE, PrologueRule(0, ra_register=RA)),  # at ret
    ],
)
def test_prologue_and_epilogue_of_a_kernel_function(pc: int, rule: PrologueRule | None) -> None:
    assert RISCV64.prologue(VFS_READ_CODE, VFS_READ, pc, VFS_READ) == rule


@pytest.mark.parametrize(
    ("offset", "rule"),
    [
        (2, PrologueRule(16, ra_register=RA)),  # c.addi sp, -16 done
        (4, PrologueRule(16, fp_offset=-16, ra_register=RA)),  # c.sdsp s0, 0
        (6, PrologueRule(16, fp_offset=-16, ra_offset=-8)),  # c.sdsp ra, 8
        (8, None),  # c.addi4spn s0, sp, 16 done
        (36, PrologueRule(16, fp_offset=-16, ra_offset=-8)),  # c.li a0, 0 before the epilogue
        (40, PrologueRule(16, fp_offset=-16, ra_register=RA)),
        (42, PrologueRule(16, ra_register=RA)),
        (44, PrologueRule(0, ra_register=RA)),
    ],
)
def test_a_kernel_leaf_saves_its_record(offset: int, rule: PrologueRule | None) -> None:
    assert RISCV64.prologue(MEMCHR_CODE, MEMCHR, MEMCHR + offset, MEMCHR) == rule


def test_an_assembly_leaf_keeps_its_caller_in_ra() -> None:
    for offset in (0, 6, 0xA, 0x12, 0x16):
        rule = RISCV64.prologue(STRLEN_CODE, STRLEN, STRLEN + offset, STRLEN)
        assert rule == PrologueRule(0, ra_register=RA), offset
    assert RISCV64.prologue(STRLEN_CODE, STRLEN, STRLEN + 0xA, None) is None  # loops: unknown
    assert RISCV64.prologue(STRLEN_CODE, STRLEN, STRLEN + 0x3, STRLEN) is None  # mid-instruction


def test_a_leaf_that_branches_is_known_by_its_whole_body() -> None:
    # test_riscv64_vs_gdb found kernel_init_pages missing under memset+0x60, the target of
    # its computed jump: neither the epilogue (32 stores, then a branch back) nor the prologue
    # (a branch at +6) reach the pc in straight code, and frame records skip ra's caller.
    end = MEMSET + len(MEMSET_CODE)
    for offset in (0x60, 0x6C, 0xE0, 0xEA, 0xF0):
        assert RISCV64.prologue(MEMSET_CODE, MEMSET, MEMSET + offset, MEMSET) is None
        rule = RISCV64.prologue(MEMSET_CODE, MEMSET, MEMSET + offset, MEMSET, end)
        assert rule == PrologueRule(0, ra_register=RA), hex(offset)
    # A function that saves ra anywhere is no such leaf: the vfs_read prologue, cut short.
    cut = VFS_READ + 0x30
    assert RISCV64.prologue(VFS_READ_CODE, VFS_READ, cut, VFS_READ, VFS_READ + 0x40) is None


@pytest.mark.parametrize(
    ("pc", "rule"),
    [
        (0x3FCC, PrologueRule(80, ra_register=RA)),
        (0x3FDA, PrologueRule(80, fp_offset=-16, ra_register=RA)),
        (0x3FDC, PrologueRule(80, fp_offset=-16, ra_offset=-8)),
        (0x3FE6, PrologueRule(80, fp_offset=-16, ra_offset=-8)),  # after mv s0, a0
    ],
)
def test_prologue_of_user_code_without_frame_pointers(pc: int, rule: PrologueRule) -> None:
    assert RISCV64.prologue(LZMA_CODE_CODE, LZMA_CODE, pc, LZMA_CODE) == rule


def test_code_with_ftrace_nops_is_the_same_code() -> None:
    # 0xffffffff8077b350 in the file and in the guest (QEMU 7.2's x/4wx): run_dax's end, then
    # dax_test's four c.nop, two nop at run time; the place cuts the second nop.
    file = bytes.fromhex("f740a260026441018280010001000100")
    running = bytes.fromhex("f740a260026441018280130000001300")
    assert RISCV64.same_code(file, running)
    assert RISCV64.same_code(file, file)
    assert not RISCV64.same_code(file, running.replace(b"\x82\x80", b"\x02\x90"))
    assert not RISCV64.same_code(running, file)  # a nop never becomes a c.nop
    assert not RISCV64.same_code(file, running[:-2])
    # 0xffffffff808078b8: riscv_clock_next_event's alternative, j in the file, nop where the
    # CPU has Sstc (QEMU 7.2's virt machine).
    file = bytes.fromhex("3e9501006f00c0007310d51401458280")
    running = bytes.fromhex("3e950100130000007310d51401458280")
    assert RISCV64.same_code(file, running) and RISCV64.same_code(running, file)
    assert not RISCV64.same_code(file, running.replace(b"\x13\x00", b"\x93\x00"))  # li ra, 0


def test_calls_before_return_addresses() -> None:
    # vfs_read+0x72: auipc ra, 0xffffe; jalr 1542(ra) (a far call); +0x98: c.jalr a5.
    far_ra = VFS_READ + 0x7A
    code = VFS_READ_CODE[: far_ra - VFS_READ]
    assert RISCV64.call_before(code, far_ra) == VFS_READ + 0x72 - 0x2000 + 1542
    assert RISCV64.is_call_before(code, far_ra)
    indirect_ra = VFS_READ + 0x9A
    code = VFS_READ_CODE[: indirect_ra - VFS_READ]
    assert RISCV64.is_call_before(code, indirect_ra)
    assert RISCV64.call_before(code, indirect_ra) is None
    jal = (0x0100_00EF).to_bytes(4, "little")  # jal ra, +0x10
    assert RISCV64.call_before(jal, 0x1004) == 0x1010
    assert not RISCV64.is_call_before(VFS_READ_CODE[:0x14], VFS_READ + 0x14)  # addi s0, sp
    assert not RISCV64.is_call_before(b"\x82\x80", 0x1002)  # ret


def test_jumps_decoded_calls_and_returns_not() -> None:
    code = b"".join(
        (
            (0x0080_006F).to_bytes(4, "little"),  # j +8
            (0x00B5_0463).to_bytes(4, "little"),  # beq a0, a1, +8
            (0xA011).to_bytes(2, "little"),  # c.j +4
            (0xC111).to_bytes(2, "little"),  # c.beqz a0, +4
            (0x8782).to_bytes(2, "little"),  # c.jr a5
            (0x9782).to_bytes(2, "little"),  # c.jalr a5: a call
            (0x8082).to_bytes(2, "little"),  # ret
            (0x0001).to_bytes(2, "little"),  # c.nop
        )
    )
    assert RISCV64.branches(code, 0x1000) == [
        (0x1004, 0x1008),
        (0x1008, 0x100C),
        (0x100A, 0x100C),
        (0x100C, 0x100E),
        (0x100E, None),
    ]


KTEXT = 0xFFFF_FFFF_8000_2000
KSTACK = 0xFF20_0000_002A_8000


def test_frame_records_walked_below_the_frame_pointer() -> None:
    # Three frames up the stack; each s0 is its caller's sp, the record [s0-16] (the caller's
    # s0) and [s0-8] (the return address) below it; the outermost's s0 is 0.
    fp1, fp2, fp3 = KSTACK + 0x40, KSTACK + 0xA0, KSTACK + 0x100
    mem = memory(
        {
            fp1 - 16: fp2, fp1 - 8: KTEXT + 0x1004,
            fp2 - 16: fp3, fp2 - 8: KTEXT + 0x2008,
            fp3 - 16: 0, fp3 - 8: KTEXT + 0x300C,
        }
    )  # fmt: skip
    gprs = {RISCV64.pc: KTEXT + 0x10, RISCV64.sp: KSTACK, RISCV64.fp: fp1}
    regs = riscv64_registers(0, gprs, {})
    raw = Unwinder(RISCV64).unwind(regs, mem, AddressSpace([]))
    assert raw.pcs == (KTEXT + 0x10, KTEXT + 0x1004, KTEXT + 0x2008, KTEXT + 0x300C)
    assert raw.via == (Via.REGS, *[Via.FRAME_POINTER] * 3)
    assert raw.stop is StopReason.END
