"""Kernel descriptions (--describe): the expression parser, the checker's one-line messages (a
wrong name, member or type, naming the key and the term), evaluation against hand-made memory,
and the identifier's reads and its one warning for unmapped memory, with types built by hand;
then the shipped description against the hobby kernel's DWARF, and the command line's checks."""

from __future__ import annotations

import asyncio
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from fakes import FakeTransport
from guestvm import BUILD_ROOT, ROOT, build_fixtures
from qmpgreeter import Server
from test_elf_dwarftypes import hobby_types

from qmpprof import session
from qmpprof.arch.x86 import I386
from qmpprof.cli import main
from qmpprof.elf.dwarftypes import CType, Member, TypeTable, Variable
from qmpprof.errors import DescribeError, UsageError
from qmpprof.guest.cr3 import Cr3Identifier
from qmpprof.guest.describe import description, syntax
from qmpprof.guest.describe.compile import Env, Unreadable
from qmpprof.guest.describe.guest import DescribedIdentifier
from qmpprof.guest.programs import ProgramIndex
from qmpprof.memory import fetch_piece, reader
from qmpprof.model import Registers
from qmpprof.pagecache import PAGE, PageCache
from qmpprof.session import RunSpec

INT, CHAR, UINT, NAME, TASK, TASK_P, CPU, CPUS = range(1, 9)
CPUS_AT, COUNT_AT, TASK_AT = 0x8000_1000, 0x8000_2000, 0x8000_3000


class Table(TypeTable):
    """``struct task { int pid; char name[8]; struct task *next; uint flags: 3; }`` and
    ``struct cpu { int id; struct task *cur; } cpus[2]``; ``int count``."""

    def __init__(self) -> None:
        super().__init__(4)
        task = (Member("pid", 0, INT), Member("name", 4, NAME), Member("next", 12, TASK_P),
                Member("flags", 16, UINT, bits=True))  # fmt: skip
        for key, ctype in {
            INT: CType("int", "int", 4, signed=True),
            CHAR: CType("int", "char", 1, signed=True, char=True),
            UINT: CType("int", "uint", 4),
            NAME: CType("array", "char[]", 8, target=CHAR, count=8),
            TASK: CType("struct", "struct task", 20, members=task),
            TASK_P: CType("pointer", "struct task *", 4, target=TASK),
            CPU: CType("struct", "struct cpu", 8, members=(Member("id", 0, INT),
                                                          Member("cur", 4, TASK_P))),
            CPUS: CType("array", "struct cpu[]", 16, target=CPU, count=2),
        }.items():  # fmt: skip
            self.put(key, ctype)
        self.globals = {"cpus": Variable("cpus", CPUS_AT, CPUS),
                        "count": Variable("count", COUNT_AT, INT)}  # fmt: skip

    def variable(self, name: str) -> Variable | None:
        return self.globals.get(name)

    def named(self, name: str) -> int | None:
        return {"struct task": TASK, "int": INT, "uint": UINT}.get(name)


class Memory:
    """Bytes at addresses; anything else is unmapped."""

    def __init__(self, words: dict[int, bytes]) -> None:
        self.words = words
        self.reads: list[tuple[int, int]] = []

    def read(self, addr: int, size: int) -> bytes | None:
        self.reads.append((addr, size))
        for start, data in self.words.items():
            if start <= addr and addr + size <= start + len(data):
                return data[addr - start : addr - start + size]
        return None


def regs(cpu: int = 1, ebx: int = 0, user: bool = False) -> Registers:
    return Registers(cpu, "i386", 0x8010_0000, 0, 0, user, 0x5000, gprs={3: ebx})


def task_bytes(pid: int, name: bytes) -> bytes:
    return struct.pack("<i8sII", pid, name, 0, 0)


MEMORY = {CPUS_AT: struct.pack("<iIiI", 0, 0, 1, TASK_AT), TASK_AT: task_bytes(42, b"init")}
HOBBY = 'current = "cpus[$cpu].cur"\npid = "$task->pid"\nname = "$task->name"\n'


def described(tmp_path: Path, text: str) -> description.Description:
    path = tmp_path / "kernel.toml"
    path.write_text(text)
    return description.load(path, Table(), I386)


def value(source: str, memory: dict[int, bytes], cpu: int = 1, ebx: int = 0) -> int:
    compiler = description.Compiler(Table(), description.register_readers(I386))
    term = compiler.value(compiler.compile(source), source)
    return term.code(Env(cpu, regs(cpu, ebx), Memory(memory)))


# ---- the parser --------------------------------------------------------------------------------


def test_the_parser_reads_the_terms_of_c() -> None:
    node = syntax.parse("cpus[$cpu].proc")
    assert isinstance(node, syntax.Member) and node.name == "proc" and not node.arrow
    assert isinstance(node.base, syntax.Index) and node.base.text == "cpus[$cpu]"
    assert node.base.index == syntax.Register("$cpu", "cpu")
    cast = syntax.parse("*(struct task **)($gs_base + 0x10)")
    assert isinstance(cast, syntax.Unary) and cast.op == "*"
    assert isinstance(cast.operand, syntax.Cast)
    assert (cast.operand.type_name, cast.operand.stars) == ("struct task", 2)
    assert cast.operand.operand == syntax.Binary(
        "$gs_base + 0x10", "+", syntax.Register("$gs_base", "gs_base"), syntax.Number("0x10", 16)
    )
    assert isinstance(syntax.parse("(uint *)count"), syntax.Cast)
    assert syntax.parse("(count)") == syntax.Name("count", "count")  # not a cast
    chain = syntax.parse("&p->next->name[2] - 1")
    assert isinstance(chain, syntax.Binary) and chain.left.text == "&p->next->name[2]"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("cpus[", "ends early: a term expected"),
        ("cpus @ 1", "at column 6: unexpected '@'"),
        ("cpus proc", "at column 6: an operator or the end expected, not 'proc'"),
        ("$task->", "ends early: a name expected"),
        ("(struct *)x", "at column 9: a name expected, not '*'"),
    ],
)
def test_the_parser_says_where_an_expression_stops_making_sense(source: str, message: str) -> None:
    with pytest.raises(syntax.SyntaxProblem) as found:
        syntax.parse(source)
    assert str(found.value) == message


# ---- the checker: one line naming the key and the term -----------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('current = "cpu[$cpu].cur"', "current: cpu: no global of this name in the kernel's DWARF"),
        (HOBBY + 'root = "$task->pgdir"', "root: $task->pgdir: struct task has no member 'pgdir'"),
        ('current = "cpus[$cpu].cur"\npid = "$task->name"',
         "pid: $task->name: type char *, not an integer"),
        ('current = "cpus[$cpu].cur"\nname = "$task->pid"',
         "name: $task->pid: type int, not an array of bytes or a pointer to them"),
        ('current = "cpus[$cpu]"', "current: cpus[$cpu]: type struct cpu: not a value this "
         "language reads"),
        ('current = "cpus[$cpu].cur"\npid = "$task->flags"',
         "pid: $task->flags: a bit field: not read by this language"),
        ('current = "count->pid"', "current: count: type int, not a pointer"),
        ('current = "$xyz"', "current: $xyz: no such register (these are: cr3, eax, ebp, ebx, "
         "ecx, edi, edx, eip, esi, esp, cpu, task)"),
        ('current = "(struct tsk *)$ebx"', "current: (struct tsk *)$ebx: no type 'struct tsk' "
         "in the kernel's DWARF"),
        ('current = "cpus[$cpu].cur +"', "current: ends early: a term expected"),
        ('pid = "$task->pid"', "no 'current' (the expression of the running task)"),
        ('current = "cpus[$cpu].cur"\npids = "1"', "unknown key 'pids' (keys: current, pid, "
         "name, root, tasks, next, state, states, unused, pc, sp, fp)"),
        ('current = 3', "current: a string holding an expression, not 3"),
    ],
)  # fmt: skip
def test_a_description_that_does_not_fit_is_one_line(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(DescribeError) as found:
        described(tmp_path, text)
    assert str(found.value) == f"kernel description {tmp_path / 'kernel.toml'}: {message}"
    assert "\n" not in str(found.value) and DescribeError.exit_code == 10


def test_a_file_that_is_not_toml(tmp_path: Path) -> None:
    with pytest.raises(DescribeError, match=r"kernel\.toml: not TOML: "):
        described(tmp_path, "current = cpus")


# ---- evaluation --------------------------------------------------------------------------------


def test_expressions_read_what_c_would() -> None:
    assert value("cpus[$cpu].cur", MEMORY) == TASK_AT
    assert value("cpus[$cpu].cur->pid", MEMORY) == 42
    assert value("(cpus + 1)->cur->pid", MEMORY, cpu=0) == 42  # pointer arithmetic by element
    assert value("&cpus[1].cur", MEMORY) == CPUS_AT + 12
    assert value("*(struct task **)($ebx + 4)", MEMORY, ebx=CPUS_AT + 8) == TASK_AT
    assert value("((struct task *)$ebx)->pid - 2", MEMORY, ebx=TASK_AT) == 40
    assert value("cpus[0].cur", MEMORY) == 0
    assert value("*(int *)0x80003000", MEMORY) == 42


def test_a_description_gives_the_task_its_pid_and_name(tmp_path: Path) -> None:
    found = described(tmp_path, HOBBY)
    env = Env(1, regs(), Memory(MEMORY))
    task = found.current_task(env)
    assert task == TASK_AT
    assert found.about(env, task) == description.Described(TASK_AT, 42, "init")
    assert found.current_task(Env(0, regs(0), Memory(MEMORY))) is None  # cur is 0: idle
    # What the pause fetches first: the current pointer of each vCPU's cpus[] entry, with the
    # stack; then the task's bytes the keys read, in one piece.
    assert [(code(env), size) for code, size in found.fixed_reads] == [(CPUS_AT + 12, 4)]
    assert found.task_span == (0, 12)


def test_unmapped_memory_is_unreadable_and_names_its_key(tmp_path: Path) -> None:
    found = described(tmp_path, HOBBY)
    memory = {CPUS_AT: struct.pack("<iIiI", 0, 0, 1, 0x9000_0000)}
    env = Env(1, regs(), Memory(memory))
    task = found.current_task(env)
    assert task == 0x9000_0000
    with pytest.raises(Unreadable) as err:
        found.about(env, task)
    assert (err.value.key, err.value.what) == ("pid", "unmapped memory at 0x90000000")


# ---- the identifier in a pause -----------------------------------------------------------------


def page(words: dict[int, bytes]) -> tuple[int, bytes]:
    base = next(iter(words)) & ~(PAGE - 1)
    data = bytearray(PAGE)
    for addr, word in words.items():
        data[addr - base : addr - base + len(word)] = word
    return base, bytes(data)


def test_the_identifier_reads_a_new_task_once_and_warns_once(tmp_path: Path) -> None:
    found = described(tmp_path, HOBBY)
    identifier = DescribedIdentifier(Cr3Identifier([], ProgramIndex([]), I386), found)
    transport = FakeTransport({1: regs()}, dict([page({TASK_AT: task_bytes(7, b"chatter")})]))

    async def sample(current: int) -> tuple[str | None, list[str], list[tuple[int, int]]]:
        """The label, the reads identify made, and those made with the stack before it."""
        transport.pages.update([page({CPUS_AT + 12: struct.pack("<I", current)})])
        cache, early = PageCache(), list(identifier.reads_for(regs()))
        for addr, size in early:  # with the stack, in its request
            await fetch_piece(reader(transport, 1), cache, addr, size)
        transport.calls.clear()
        identity = await identifier.identify(transport, regs(), cache)
        process = identity.process
        return (None if process is None else process.label), transport.calls, early

    current = (CPUS_AT + 12, 4)
    first = ("chatter (pid 7)", [f"read:{TASK_AT:#x}+0xc"], [current])
    assert asyncio.run(sample(TASK_AT)) == first
    # The same task again: its fields were read with the stack, where it was last time.
    again = ("chatter (pid 7)", [], [current, (TASK_AT, 12)])
    assert asyncio.run(sample(TASK_AT)) == again
    assert asyncio.run(sample(0)) == (None, [], [current, (TASK_AT, 12)])  # idle in the kernel
    assert identifier.warnings() == []
    assert asyncio.run(sample(0x9000_0000))[:2] == (None, ["read:0x90000000+0xc"])
    for _ in range(2):
        assert asyncio.run(sample(0x9000_0000)) == (None, [], [current, (0x9000_0000, 12)])
    assert identifier.warnings() == [
        "Warning: kernel.toml: 'pid' could not be read in 3 samples, which have no pid (first:"
        " unmapped memory at 0x90000000)"
    ]


# ---- the hobby kernel's DWARF and the command line ---------------------------------------------


def test_the_shipped_hobby_description_fits_its_kernel() -> None:
    _, types = hobby_types()
    shipped = description.load(ROOT / "fixtures" / "hobby" / "describe.toml", types, I386)
    cpus = types.variable("cpus")
    assert cpus is not None
    # cpus[$cpu].proc: struct cpu is 180 bytes, proc at 164 (kernel.h); read with the stack.
    fixed = [(code(Env(1, regs(), Memory({}))), n) for code, n in shipped.fixed_reads]
    assert fixed == [(cpus.addr + 180 + 164, 4)]
    assert shipped.task_span == (0, 28)  # pid, name[16], state, pgdir: one read
    assert shipped.tasks is not None and shipped.tasks.count == 8  # procs[NPROC]
    assert shipped.tasks.states == {1: "S", 2: "R", 3: "R"}


def test_a_wrong_member_is_told_before_the_guest_is_touched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build_fixtures(("hobby",))
    bad = tmp_path / "hobby.toml"
    bad.write_text('current = "cpus[$cpu].proc"\npid = "$task->tid"\n')
    socket_dir = Path(tempfile.mkdtemp(prefix="qd-", dir="/tmp"))  # a short socket path
    server = Server(socket_dir / "qmp.sock")
    kernel = BUILD_ROOT / "hobby" / "kernel.elf"
    try:
        argv = ["--qmp-socket", str(server.path), "--kernel", str(kernel), "--describe", str(bad)]
        assert main(argv) == DescribeError.exit_code
    finally:
        server.close()
        shutil.rmtree(socket_dir)
    err = capsys.readouterr().err
    assert err == (
        f"qmpprof: error: kernel description {bad}: pid: $task->tid: struct proc has no member"
        " 'tid'\n"
    )
    assert server.accepted == 1  # the greeting read by the socket's check, nothing sent


def test_a_tasks_root_is_its_process_space(tmp_path: Path) -> None:
    found = described(tmp_path, HOBBY + 'root = "(uint *)$task->next"\n')
    identifier = DescribedIdentifier(Cr3Identifier([], ProgramIndex([]), I386), found)
    transport = FakeTransport({1: regs()}, dict([page({TASK_AT: task_bytes(7, b"chatter")})]))
    struct_next = struct.pack("<I", 0x8020_0000)  # task_bytes leaves next 0: a root of its own
    transport.pages[TASK_AT] = transport.pages[TASK_AT][:12] + struct_next + bytes(PAGE - 16)
    cache = PageCache()
    ((addr, size),) = identifier.reads_for(regs())
    cache.pieces[addr] = (size, struct.pack("<I", TASK_AT))
    process = asyncio.run(identifier.identify(transport, regs(), cache)).process
    assert process is not None and (process.space, process.space_name) == (0x8020_0000, "root")
    assert process.label == "chatter (pid 7)" and found.task_span == (0, 16)


@pytest.mark.parametrize(
    ("os", "kernel", "message"),
    [
        ("cr3", True, "--describe goes with --os auto or described, not --os cr3"),
        ("auto", False, "--describe needs --kernel: the kernel's DWARF types its expressions"),
    ],
)
def test_a_description_needs_its_kernel_and_its_guest_os(
    os: str, kernel: bool, message: str
) -> None:
    build_fixtures(("hobby",))
    spec = RunSpec(
        kernel=BUILD_ROOT / "hobby" / "kernel.elf" if kernel else None,
        os=os,
        os_options=(("describe", ROOT / "fixtures" / "hobby" / "describe.toml"),),
    )
    with pytest.raises(UsageError) as found:
        session.load(spec)
    assert str(found.value) == message


def test_the_described_guest_os_needs_a_description() -> None:
    with pytest.raises(UsageError, match=r"^--os described needs --describe FILE$"):
        session.load(RunSpec(os="described"))
