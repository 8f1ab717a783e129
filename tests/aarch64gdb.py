"""gdb-multiarch as the oracle of a running aarch64 test guest (tests/aarch64vm.py): the x86
oracle's gdb session (``linuxgdb.KernelOracle``: the -dbg vmlinux moved by the KASLR slide,
attached to QEMU's gdbstub) with arm64's ``current``.

The current task of a vCPU (``qg_task_arm64``), by its exception level (PSTATE's M[3:2]):

- in the kernel (EL1), SP_EL0, once the entry code has loaded it: on the way in from user mode
  (the vectors, ``kernel_entry``) and out (``kernel_exit``) it still holds the user's stack
  pointer, and the task is the per-CPU ``__entry_task`` the entry code loads it from;
- in user mode (EL0), ``__entry_task``. There the kernel is unmapped (KPTI: TTBR1 holds the
  trampoline's tables), so gdb reads it in QEMU's physical-memory mode
  (``maint packet Qqemu.PhyMemMode:1``): per-CPU data and tasks are in the linear map
  (physical = virtual - PAGE_OFFSET + ``memstart_addr``), init_task in the image (physical =
  virtual - ``kimage_voffset``); those, PAGE_OFFSET (from TCR_EL1.T1SZ) and each CPU's
  ``__entry_task`` address are read once while some vCPU runs the kernel (``layout``).

An exception taken in the kernel (``_interrupted``): where gdb's walk reaches a handler of the
vector table's kernel half (not as the leaf), the kernel's own unwinder goes on from the
``pt_regs`` the handler's frame record is in (6.13+: that record zeroed, typed
FRAME_META_TYPE_PT_REGS; to 6.12: {x29, ELR}): gdb goes on from the registers saved there (the
frame's sp is ``pt_regs``, its x29 the record's address, its saved PSTATE at EL1), put in the
vCPU for that and put back after (``linuxgdb.qg_stack``), so that gdb unwinds the interrupted
code by its CFI at its own pc, as the innermost frame. A vCPU stopped in the entry code itself
(at a vector, in a handler before its record) is compared down to there: its interrupted pc
is in ELR_EL1 only, which qmpprof cannot read over QMP, the transport of the oracle tests (gdb
holds the gdbstub); given gdb's walk from ELR_EL1 there, 10 of 157 stacks of a 7.2 run
differed, all of them that. tests/e2e/test_aarch64_e2e.py checks qmpprof's walk on from
ELR_EL1 (over its private gdbstub) against the guest's kallsyms.

Pointer authentication: gdb 13.1 cannot strip a kernel return address's code. QEMU 7.2's stub
offers no ``org.gnu.gdb.aarch64.pauth`` registers; given them (a relay adding the feature,
tried here), gdb 13.1 strips with the low half's mask only (``addr & ~pauth_cmask``: a return
address to 0xffffb59af2090a20, signed, became 0x2f00b59af2090a20) and stops there. The guest
boots with ``arm64.nopauth`` (``NOPAUTH``): the kernel signs nothing, gdb and qmpprof read
plain return addresses. qmpprof's stripping is tested on signed stacks by
tests/e2e/test_aarch64_e2e.py.
"""

from __future__ import annotations

from linuxgdb import SCRIPT, KernelOracle

NOPAUTH = "arm64.nopauth"

_ARM64 = r"""
QG_LAYOUT = None  # PAGE_OFFSET, memstart_addr, kimage_voffset, _text, _end, per-CPU offsets

def _el():
    return (int(gdb.parse_and_eval("$cpsr")) >> 2) & 3

def qg_el():
    print("QGINT %d" % _el())

def _kernel_sp_el0():
    # Bit 55 selects the kernel's half, whatever its size (6.12's linear map is at
    # 0xfff0000000000000: 52-bit addresses).
    value = int(gdb.parse_and_eval("$SP_EL0")) % 2**64
    return value if value >> 55 & 1 else None

def qg_arm64_layout():
    global QG_LAYOUT
    threads = gdb.selected_inferior().threads()
    for thread in threads:
        thread.switch()
        if _el() == 1 and _kernel_sp_el0() is not None:
            # The linear map starts at -(2 ** VA size), the size from TCR_EL1.T1SZ.
            va_bits = 64 - ((int(gdb.parse_and_eval("$TCR_EL1")) >> 16) & 0x3F)
            QG_LAYOUT = [2**64 - 2**va_bits] + [
                int(gdb.parse_and_eval(e)) % 2**64
                for e in ("memstart_addr", "kimage_voffset", "&_text", "&_end")
            ] + [[_per_cpu(cpu, "__entry_task") for cpu in range(len(threads))]]
            break
    print("QGINT %d" % (QG_LAYOUT is not None))

def _physical(addr):
    page_offset, memstart, voffset, start, end, _ = QG_LAYOUT
    return addr - voffset if start <= addr < end else addr - page_offset + memstart

QG_REGISTERS = tuple("x%d" % i for i in range(31)) + ("sp", "pc")
QG_PT_REGS = None  # struct pt_regs *

def _interrupted(frame):
    global QG_PT_REGS
    if QG_PT_REGS is None:
        QG_PT_REGS = gdb.lookup_type("struct pt_regs").pointer()
    sp = int(frame.read_register("sp")) % 2**64
    regs = gdb.Value(sp).cast(QG_PT_REGS).dereference()
    record = int(regs["stackframe"].address) % 2**64
    if int(frame.read_register("x29")) % 2**64 != record:
        return None  # not a handler's frame whose record is in pt_regs
    if (int(regs["pstate"]) >> 2) & 3 != 1:
        return None  # from user mode: the kernel stack ends here
    saved = {"x%d" % i: int(regs["regs"][i]) % 2**64 for i in range(31)}
    saved.update(sp=int(regs["sp"]) % 2**64, pc=int(regs["pc"]) % 2**64)
    return saved

def qg_task_arm64(cpu):
    sp_el0 = _kernel_sp_el0() if _el() == 1 else None
    if sp_el0 is not None:
        _print_task(_task(sp_el0), "SP_EL0")
        return
    gdb.execute("maint packet Qqemu.PhyMemMode:1", to_string=True)
    try:
        entry_task = _physical(QG_LAYOUT[5][cpu])
        task = _task(_physical(_pointer_at(entry_task)))
        _print_task(task, "__entry_task", _task(_physical(int(task["group_leader"]) % 2**64)))
    finally:
        gdb.execute("maint packet Qqemu.PhyMemMode:0", to_string=True)
"""


class Aarch64KernelOracle(KernelOracle):
    """gdb-multiarch on an arm64 kernel's -dbg vmlinux."""

    program = "gdb-multiarch"
    script = SCRIPT + _ARM64
    task_function = "qg_task_arm64"

    def layout(self) -> bool:
        """Read what user-mode moments need while some vCPU of the stopped guest runs the
        kernel; False if none does."""
        return self._python("qg_arm64_layout()", "QGINT") == "1"

    def levels(self, count: int) -> list[int]:
        """Each vCPU's exception level (PSTATE's), the guest stopped."""
        found = []
        for cpu in range(count):
            self.command(f"-thread-select {cpu + 1}")
            found.append(int(self._python("qg_el()", "QGINT")))
        return found

    def let_go(self) -> None:
        """Disconnect, the guest left stopped: QEMU resumes a guest on a detach only."""
        self.disconnect()
