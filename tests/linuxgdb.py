"""gdb as the oracle of a running Linux test guest: whole kernel stacks and the current task.

One long-lived gdb session per boot (reading a 400-650 MB -dbg vmlinux takes gdb 15-20 s) on
the kernel's DWARF vmlinux from scripts/fetch-linux-dbg, moved by the KASLR slide the guest
printed (``symbol-file -o``), with the test module's .ko at its load address. For each vCPU
of a stopped guest it gives:

- the kernel stack as gdb walks it: every frame but the inlined ones (qmpprof walks without
  DWARF), tail-call frames (``TAILCALL``, made up from DWARF call sites) included, each with
  its kind, the symbol at its lookup address and the 8 bytes of running code before a
  caller's pc; down to the first frame in entry text (no DWARF CFI past ``entry_SYSCALL_64``
  or ``asm_sysvec_*``) or wherever gdb itself stops, and why (``GdbStack.stop``). gdb runs
  with ``set debug entry-values 1``: what it says of the tail-call frames it could not make
  is kept with the stack (``GdbStack.log``);
- the current task (pid, tgid, flags, comm, its group leader's comm), read through the
  per-CPU current task pointer of whichever layout the vmlinux has: the ``pcpu_hot`` struct's
  ``current_task`` when the vmlinux has ``pcpu_hot`` (6.2 to 6.x), else the ``current_task``
  variable. Where that pointer is depends on the per-CPU area's kind, read from the vmlinux's
  ``.data..percpu``: linked at 0 (up to 6.12), a per-CPU symbol is an offset, which KASLR
  leaves alone but ``symbol-file -o`` moved (the slide is taken back); linked elsewhere (7.x),
  it is an ordinary kernel address, moved by KASLR as by ``-o``. Either way the pointer is at
  ``__per_cpu_offset[cpu]`` + the symbol's runtime address, mod 2**64. (arm64's:
  tests/aarch64gdb.py.)
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from linuxkernel import linux_dir
from linuxvm import BUILD, MODULE
from support.bench.gdbcli import GdbMi

from qmpprof.elf.image import ElfImage
from qmpprof.linux.symbols import KernelSymbols

PF_KTHREAD = 0x0020_0000

# Run inside gdb. Output lines: "QGSTACK " / "QGTASK " / "QGBYTES " + hex (MI escapes quotes).
SCRIPT = r"""
import gdb, json

QG_SLIDE = 0
QG_PERCPU_AT_ZERO = True

# Addresses as Python ints of pointers, never through a C cast: in 5.10's vmlinux gdb takes
# "unsigned long" from a 32-bit compilation unit (4 bytes), and (unsigned long)&sym is cut to
# its low half.
_ENTRY = [int(gdb.parse_and_eval("&__entry_text_" + e)) for e in ("start", "end")]
_KINDS = {gdb.NORMAL_FRAME: "normal", gdb.TAILCALL_FRAME: "tailcall",
          gdb.SIGTRAMP_FRAME: "sigtramp", gdb.ARCH_FRAME: "arch"}

def _symbol(addr):
    # The ELF symbol of the address's own section: gdb's DWARF of the relocatable .ko would
    # put qb_init (.init.text) over .text.
    found = gdb.execute("info symbol %#x" % addr, to_string=True)
    return "??" if found.startswith("No symbol") else found.split()[0]

def _before(pc):
    try:
        return bytes(gdb.selected_inferior().read_memory(pc - 8, 8)).hex()
    except gdb.MemoryError:
        return ""

def _interrupted(frame):
    # The registers an exception entry saved, where the walk goes on in the code it interrupted
    # (an architecture's script says; none here: the walk stops at the entry).
    return None

def _registers():
    frame = gdb.newest_frame()
    return {name: int(frame.read_register(name)) % 2**64 for name in QG_REGISTERS}

def _set_registers(values):
    for name, value in values.items():
        gdb.execute("set $%s = %#x" % (name, value), to_string=True)

QG_REGISTERS = ()  # what _interrupted gives, which the walk puts back in the vCPU after it

def qg_stack():
    # At an entry the exception came into from the kernel (_interrupted), gdb walks on from the
    # registers it saved: they are put in the vCPU for that (gdb then unwinds the interrupted
    # code as the innermost frame, its CFI at its pc), and the vCPU's own put back after.
    out, frame, stop, exact, own, crossed = [], gdb.newest_frame(), "limit", True, None, 0
    try:
        while frame is not None and len(out) < 64:
            pc, kind = frame.pc(), frame.type()
            if pc < 0xffff800000000000:
                stop = "user"
                break
            if kind != gdb.INLINE_FRAME:
                lookup = pc if exact else pc - 1
                out.append([pc, _KINDS.get(kind, str(kind)), _symbol(lookup),
                            "" if exact else _before(pc)])
                exact = False
                if _ENTRY[0] <= pc < _ENTRY[1]:
                    saved = _interrupted(frame) if len(out) > 1 else None
                    if saved is None:
                        stop = "entry"
                        break
                    own = own or _registers()
                    _set_registers(saved)
                    frame, exact, crossed = gdb.newest_frame(), True, crossed + 1
                    continue
            try:
                older = frame.older()
            except gdb.error as err:
                stop = "error: " + str(err)
                break
            if older is None:
                stop = "outermost: " + gdb.frame_stop_reason_string(frame.unwind_stop_reason())
            frame = older
    finally:
        if own is not None:
            _set_registers(own)
            assert _registers() == own, "the vCPU's registers are not back"
    found = {"frames": out, "stop": stop, "crossed": crossed}
    print("QGSTACK " + json.dumps(found).encode().hex())

def _has(name):
    return gdb.lookup_global_symbol(name) is not None or gdb.lookup_static_symbol(name) is not None

def _current_task_variable():
    # The vmlinux's own DWARF says which layout it has.
    return "pcpu_hot.current_task" if _has("pcpu_hot") else "current_task"

def _comm(array):
    return bytes(int(array[i]) & 0xff for i in range(16)).split(b"\0")[0].hex() or "-"

def _per_cpu(cpu, variable):
    # The address of the per-CPU variable's copy for the CPU.
    base = int(gdb.parse_and_eval("__per_cpu_offset[%d]" % cpu))
    symbol = int(gdb.parse_and_eval("&" + variable))
    if QG_PERCPU_AT_ZERO:
        symbol -= QG_SLIDE  # an offset in the per-CPU area: KASLR leaves it, -o moved it
    return (base + symbol) % 2**64

QG_TASK = None  # struct task_struct *, looked up once: a lookup by name costs ~0.5 s each time

def _task(addr):
    global QG_TASK
    if QG_TASK is None:
        QG_TASK = gdb.lookup_type("struct task_struct").pointer()
    return gdb.Value(addr).cast(QG_TASK).dereference()

def _pointer_at(addr):
    return int.from_bytes(gdb.selected_inferior().read_memory(addr, 8), "little")

def qg_task(cpu):
    variable = _current_task_variable()
    _print_task(_task(_pointer_at(_per_cpu(cpu, variable))), variable)

def _print_task(task, variable, leader=None):
    leader = task["group_leader"].dereference() if leader is None else leader
    print("QGTASK " + json.dumps({"variable": variable, "pid": int(task["pid"]),
        "tgid": int(task["tgid"]), "flags": int(task["flags"]) % 2**32,
        "comm": _comm(task["comm"]), "leader": _comm(leader["comm"])}).encode().hex())

def qg_int(text):
    print("QGINT %d" % (int(gdb.parse_and_eval(text)) % 2**64))

def qg_bytes(addr, size):
    print("QGBYTES " + bytes(gdb.selected_inferior().read_memory(addr, size)).hex())
"""

# What gdb says of the tail-call frames it makes or cannot make (dwarf2/loc.c and
# frame-tailcall.c, under ``set debug entry-values 1``).
_EXPLAINING = (
    "tailcall:",
    "DW_OP_entry_value resolving cannot find DW_TAG_call_site",
    "DW_AT_call_target",
    "DW_TAG_call_site resolving failed",
    "There are no unambiguously",
    "Cannot find function",
    "Unable to find function",
)


@dataclass(frozen=True, slots=True)
class KernelFiles:
    """One kernel's files: the bzImage, gdb's DWARF vmlinux, the test module built for it."""

    series: str
    release: str
    vmlinuz: Path
    vmlinux_dbg: Path
    module_ko: Path


def kernel_files(series: str) -> KernelFiles:
    """scripts/build-linux-guest builds the module for 6.12 in ``module/``, for the others in
    ``module-<release>/`` (the unstripped .ko, with the DWARF gdb unwinds it by)."""
    folder = linux_dir(series)
    release = (folder / "version").read_text().strip()
    build = BUILD / ("module" if series == "6.12" else f"module-{release}")
    return KernelFiles(
        series, release, folder / "vmlinuz", folder / "vmlinux-dbg", build / f"{MODULE}.ko"
    )


@dataclass(frozen=True, slots=True)
class GdbFrame:
    pc: int
    kind: str  # "normal", "tailcall", ...
    symbol: str  # at pc for the leaf, pc - 1 for the others ("??": none)
    before: bytes  # the 8 bytes of running code before a caller's pc


@dataclass(frozen=True, slots=True)
class GdbStack:
    frames: tuple[GdbFrame, ...]  # leaf first
    stop: str  # "entry", "user", "limit", "error: ..." or "outermost: ..."
    log: tuple[str, ...]  # gdb's words on tail-call frames while it walked this moment
    crossed: int = 0  # exceptions taken in the kernel it walked across (arm64: aarch64gdb.py)

    @property
    def reached_entry(self) -> bool:
        """gdb walked down to the system call or interrupt entry (or on into user space)."""
        return self.stop in ("entry", "user")


@dataclass(frozen=True, slots=True)
class GdbTask:
    variable: str  # the per-CPU variable the pointer was read from
    pid: int
    tgid: int
    flags: int
    comm: str
    leader_comm: str

    def expected(self) -> tuple[int, str, int, str]:
        """The process qmpprof must name for this task: (pid, name, tid, thread name)."""
        if self.pid == 0:
            return 0, self.comm, 0, self.comm
        if self.flags & PF_KTHREAD:
            return self.tgid, f"[{self.comm}]", self.pid, self.comm
        return self.tgid, self.leader_comm, self.pid, self.comm


def percpu_at_zero(vmlinux_dbg: Path) -> bool:
    """Whether the kernel links its per-CPU area at 0 (per-CPU symbols are offsets)."""
    address = ElfImage.load(vmlinux_dbg, mapped=True).section_addr(".data..percpu")
    assert address is not None, f"{vmlinux_dbg} has no .data..percpu"
    return address == 0


class KernelOracle(GdbMi):
    """One gdb session on a kernel's -dbg vmlinux, attached to the guest's gdbstub, running
    ``script`` (gdb Python); ``task_function``: its function that reads a vCPU's current task."""

    # Reading the vmlinux takes 15-20 s on an idle machine; the first lookups in a
    # compilation unit expand its DWARF, seconds more.
    timeout = 240.0
    script = SCRIPT
    task_function = "qg_task"

    def __init__(self, port: int, vmlinux_dbg: Path, script: Path, slide: int) -> None:
        """``slide``: the running kernel's KASLR slide, by which gdb moves the symbols."""
        super().__init__(None)
        self.log: list[str] = []  # gdb's explanations since the guest last stopped
        self.command(f'-interpreter-exec console "symbol-file -o {slide:#x} {vmlinux_dbg}"')
        script.write_text(self.script)
        self.command(f'-interpreter-exec console "source {script}"')
        zero = percpu_at_zero(vmlinux_dbg)
        self.command(f'-interpreter-exec console "python QG_SLIDE = {slide:#x}"')
        self.command(f'-interpreter-exec console "python QG_PERCPU_AT_ZERO = {zero}"')
        self.command('-interpreter-exec console "set debug entry-values 1"')
        self.attach(f"127.0.0.1:{port}")

    def add_module(self, ko: Path, text_addr: int) -> None:
        """The module's symbols and CFI at its .text's load address. Its init and exit code
        (freed, or never run) go to low addresses no frame has: otherwise gdb lays them over
        .text and names qb_burn_leaf ``qb_init``."""
        away = "-s .init.text 0x1000 -s .exit.text 0x2000"
        self.command(f'-interpreter-exec console "add-symbol-file {ko} {text_addr:#x} {away}"')

    def stop_guest(self) -> None:
        # The *stopped record may come before or after the prompt that ends ^done; gdb has
        # unwound the stopped vCPU's first frame by then (and said what it found).
        lines = self.command("-exec-interrupt")
        if not any(line.startswith("*stopped") for line in lines):
            lines += self._until(lambda line: line.startswith("*stopped"))
        self.log = _explanations(lines)

    def resume(self) -> None:
        self.command("-exec-continue")

    def _python(self, call: str, tag: str) -> str:
        lines = self.command(f'-interpreter-exec console "python {call}"')
        self.log += _explanations(lines)
        for line in lines:
            if line.startswith(f'~"{tag} '):
                return line[len(tag) + 3 : -3]
        raise AssertionError(f"gdb printed no {tag} for {call}: {lines[-6:]}")

    def value(self, expression: str) -> int:
        """An integer expression as gdb evaluates it (symbols where ``-o`` put them)."""
        return int(self._python(f"qg_int({expression!r})", "QGINT"))

    def stack(self, cpu: int) -> GdbStack:
        self.log += _explanations(self.command(f"-thread-select {cpu + 1}"))
        found = json.loads(bytes.fromhex(self._python("qg_stack()", "QGSTACK")))
        frames = tuple(
            GdbFrame(pc, kind, symbol, bytes.fromhex(before))
            for pc, kind, symbol, before in found["frames"]
        )
        return GdbStack(frames, found["stop"], tuple(dict.fromkeys(self.log)), found["crossed"])

    def task(self, cpu: int) -> GdbTask:
        self.log += _explanations(self.command(f"-thread-select {cpu + 1}"))
        call = f"{self.task_function}({cpu})"
        found = json.loads(bytes.fromhex(self._python(call, "QGTASK")))
        name = {key: _name(found[key]) for key in ("comm", "leader")}
        return GdbTask(
            found["variable"], found["pid"], found["tgid"], found["flags"], name["comm"],
            name["leader"],
        )  # fmt: skip

    def read(self, addr: int, size: int) -> bytes:
        return bytes.fromhex(self._python(f"qg_bytes({addr:#x}, {size})", "QGBYTES"))


def _name(hexed: str) -> str:
    return "" if hexed == "-" else bytes.fromhex(hexed).decode(errors="replace")


def _explanations(lines: list[str]) -> list[str]:
    """gdb's console and log lines (MI ``~"..."``, ``&"..."`` records, joined and unescaped)
    that explain its tail-call frames, each once."""
    text = "".join(
        line[2:-1].encode().decode("unicode_escape")
        for line in lines
        if line.startswith(('~"', '&"'))
    )
    found = [line.strip() for line in text.splitlines() if line.startswith(_EXPLAINING)]
    return list(dict.fromkeys(found))


def module_text(symbols: KernelSymbols, ko: Path) -> int:
    """Where the module's .text was loaded: a function's address in the guest's /proc/kallsyms
    (``symbols``) minus its offset in the .ko (all its functions that stay after init are in
    .text)."""
    runtime = symbols.address_of("qb_read", MODULE)
    assert runtime is not None, "the guest's kallsyms lack the test module"
    nm = subprocess.run(["nm", str(ko)], capture_output=True, text=True, check=True)
    offsets = [
        int(line.split()[0], 16) for line in nm.stdout.splitlines() if line.endswith(" qb_read")
    ]
    assert len(offsets) == 1, offsets
    return runtime - offsets[0]
