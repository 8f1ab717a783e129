"""A description's task keys (every task, its state, its saved context for --off-cpu): their
checking at load (one line naming the key and the term) and their evaluation over hand-made
memory, for an array of tasks with empty slots and for a linked list, with types built by hand."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest
from fakes import FakeTransport

from qmpprof.arch.x86 import I386
from qmpprof.elf.dwarftypes import CType, Member, TypeTable, Variable
from qmpprof.errors import DescribeError
from qmpprof.guest.cr3 import Cr3Identifier
from qmpprof.guest.describe import description
from qmpprof.guest.describe.compile import Env, Unreadable
from qmpprof.guest.describe.guest import DescribedIdentifier
from qmpprof.guest.describe.tasks import Switched, TaskKeys
from qmpprof.guest.programs import ProgramIndex
from qmpprof.model import Registers
from qmpprof.pagecache import PAGE

INT, UINT, CTX, CTX_P, PROC, PROC_P, PROCS = range(1, 8)
PROCS_AT, HEAD_AT, STACKS = 0x8000_1000, 0x8000_2000, 0x8000_4000


class Table(TypeTable):
    """``struct context { uint edi, esi, ebx, ebp, eip; }``, ``struct proc { int state;
    struct context *context; struct proc *next; } procs[3]`` and ``struct proc *head``."""

    def __init__(self) -> None:
        super().__init__(4)
        context = tuple(
            Member(n, 4 * i, UINT) for i, n in enumerate(("edi", "esi", "ebx", "ebp", "eip"))
        )
        proc = (Member("state", 0, INT), Member("context", 4, CTX_P), Member("next", 8, PROC_P))
        for key, ctype in {
            INT: CType("int", "int", 4, signed=True),
            UINT: CType("int", "uint", 4),
            CTX: CType("struct", "struct context", 20, members=context),
            CTX_P: CType("pointer", "struct context *", 4, target=CTX),
            PROC: CType("struct", "struct proc", 12, members=proc),
            PROC_P: CType("pointer", "struct proc *", 4, target=PROC),
            PROCS: CType("array", "struct proc[]", 36, target=PROC, count=3),
        }.items():  # fmt: skip
            self.put(key, ctype)
        self.globals = {"procs": Variable("procs", PROCS_AT, PROCS),
                        "head": Variable("head", HEAD_AT, PROC_P)}  # fmt: skip

    def variable(self, name: str) -> Variable | None:
        return self.globals.get(name)

    def named(self, name: str) -> int | None:
        return {"struct proc": PROC, "int": INT}.get(name)


class Memory:
    """Bytes at addresses; anything else is unmapped."""

    def __init__(self, words: dict[int, bytes]) -> None:
        self.words = words

    def read(self, addr: int, size: int) -> bytes | None:
        for start, data in self.words.items():
            if start <= addr and addr + size <= start + len(data):
                return data[addr - start : addr - start + size]
        return None


CURRENT = 'current = "head"\n'
SWITCH = (
    'state = "$task->state"\nunused = [0]\npc = "$task->context->eip"\n'
    'sp = "$task->context + 1"\nfp = "$task->context->ebp"\n'
)
STATES = '[states]\n1 = "S"\n2 = "R"\n4 = "D"\n'
ARRAY = CURRENT + 'tasks = "procs"\n' + SWITCH + STATES
LIST = CURRENT + 'tasks = "head"\nnext = "$task->next"\n' + SWITCH + STATES


def loaded(tmp_path: Path, text: str) -> description.Description:
    path = tmp_path / "kernel.toml"
    path.write_text(text)
    return description.load(path, Table(), I386)


def keys(tmp_path: Path, text: str) -> TaskKeys:
    found = loaded(tmp_path, text).tasks
    assert found is not None
    return found


def env(memory: dict[int, bytes]) -> Env:
    regs = Registers(0, "i386", 0x8010_0000, 0, 0, False, 0x5000)
    return Env(0, regs, Memory(memory))


def proc(state: int, context: int, following: int = 0) -> bytes:
    return struct.pack("<iII", state, context, following)


def saved(ebp: int, eip: int) -> bytes:
    return struct.pack("<5I", 1, 2, 3, ebp, eip)


# procs[0] sleeps (its context at STACKS), procs[1] is an empty slot, procs[2] runs; head -> the
# list procs[2] -> procs[0].
MEMORY = {
    PROCS_AT: proc(1, STACKS, 0) + proc(0, 0) + proc(2, STACKS + 0x100, PROCS_AT),
    HEAD_AT: struct.pack("<I", PROCS_AT + 24),
    STACKS: saved(0x8000_4F00, 0x8010_1234),
}


def test_an_array_of_tasks_gives_each_sleeping_task_its_saved_context(tmp_path: Path) -> None:
    found = keys(tmp_path, ARRAY)
    at = env(MEMORY)
    tasks = found.all(at)
    assert tasks == [PROCS_AT, PROCS_AT + 12, PROCS_AT + 24]
    # The sleeper resumes at the saved eip, with swtch's five words popped, on its saved ebp.
    assert [found.switched(at, task) for task in tasks] == [
        Switched(PROCS_AT, "S", 0x8010_1234, STACKS + 20, 0x8000_4F00),
        None,
        None,
    ]


def test_a_list_of_tasks_is_walked_by_next(tmp_path: Path) -> None:
    found = keys(tmp_path, LIST)
    assert found.all(env(MEMORY)) == [PROCS_AT + 24, PROCS_AT]
    procs = proc(1, STACKS, PROCS_AT + 24) + MEMORY[PROCS_AT][12:]  # back to the first
    looped = MEMORY | {PROCS_AT: procs}
    assert found.all(env(looped)) == [PROCS_AT + 24, PROCS_AT]


def test_a_state_no_table_names_is_told_by_its_value(tmp_path: Path) -> None:
    found = keys(tmp_path, ARRAY)
    memory = MEMORY | {PROCS_AT: proc(7, STACKS)}
    switched = found.switched(env(memory), PROCS_AT)
    assert switched is not None and switched.state == "7"


def test_unmapped_context_is_unreadable_and_names_its_key(tmp_path: Path) -> None:
    found = keys(tmp_path, ARRAY)
    memory = MEMORY | {PROCS_AT: proc(1, 0x9000_0000)}
    with pytest.raises(Unreadable) as err:
        found.switched(env(memory), PROCS_AT)
    assert (err.value.key, err.value.what) == ("pc", "unmapped memory at 0x90000010")


def pages(memory: dict[int, bytes]) -> dict[int, bytes]:
    """Each range of ``memory`` in a page of its own."""
    out = {}
    for addr, data in memory.items():
        base = addr & ~(PAGE - 1)
        out[base] = bytes(addr - base) + data + bytes(PAGE - (addr - base) - len(data))
    return out


def test_the_described_guest_lists_its_switched_out_tasks_for_off_cpu(tmp_path: Path) -> None:
    identifier = DescribedIdentifier(
        Cr3Identifier([], ProgramIndex([]), I386), loaded(tmp_path, ARRAY)
    )
    transport = FakeTransport({0: env({}).regs}, pages(MEMORY))
    found = asyncio.run(identifier.every_task(transport))
    assert [(t.at, t.state, t.cpu, t.version) for t in found] == [
        (PROCS_AT, "S", None, (0x8010_1234, STACKS + 20))
    ]  # the empty slot and the running task are not there
    kernel = found[0].kernel
    assert kernel is not None
    assert (kernel.pc, kernel.sp, kernel.fp, kernel.user) == (
        0x8010_1234, STACKS + 20, 0x8000_4f00, False
    )  # fmt: skip
    assert asyncio.run(identifier.versions(transport, found)) == [(0x8010_1234, STACKS + 20)]
    # Its context unmapped: the task is left out, the run goes on and says so once.
    transport.pages.update(pages({PROCS_AT: proc(1, 0x9000_0000) + MEMORY[PROCS_AT][12:]}))
    assert asyncio.run(identifier.every_task(transport)) == []
    assert identifier.warnings() == [
        "Warning: kernel.toml: 'pc' could not be read for --off-cpu, tasks left out (first:"
        " unmapped memory at 0x90000010)"
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (CURRENT + 'tasks = "procs"\n', "tasks: comes with 'state' (the keys of --off-cpu)"),
        (ARRAY.replace('"procs"', '"prcs"'), "tasks: prcs: no global of this name in the "
         "kernel's DWARF"),
        (ARRAY.replace('"procs"', '"procs[0].state"'), "tasks: procs[0].state: type int, not "
         "an array or a pointer to a task"),
        (LIST.replace('next = "$task->next"\n', ""), "tasks: a pointer: its list needs 'next' "
         "(the task after $task)"),
        (ARRAY.replace("->eip", "->rip"), "pc: $task->context->rip: struct context has no "
         "member 'rip'"),
        (ARRAY.replace('$task->state"', '*$task->context"'), "state: *$task->context: type "
         "struct context: not a value this language reads"),
        (ARRAY.replace('2 = "R"', '2 = "Q"'), "states: 2 = 'Q': not one of RSDTtXZIWPK"),
        (ARRAY.replace('2 = "R"', 'RUNNING = "R"'), "states: 'RUNNING': not a state's value "
         "(an integer)"),
        (ARRAY.replace("unused = [0]", 'unused = "0"'), "unused: a list of state values, not '0'"),
    ],
)  # fmt: skip
def test_task_keys_that_do_not_fit_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(DescribeError) as found:
        keys(tmp_path, text)
    assert str(found.value) == f"kernel description {tmp_path / 'kernel.toml'}: {message}"
    assert "\n" not in str(found.value)
