"""A kernel description (``--describe FILE``): a TOML file of C expressions over the kernel's
DWARF-typed globals and the vCPU's registers that say who runs on a vCPU (docs/describe.md).

Its keys, each a string holding one expression (syntax.py):

    current  the task running on the vCPU: a pointer (or an address); 0 or null: none (the
             vCPU idles, or runs the kernel alone), the sample is the kernel's
    pid      the task's pid, an integer
    name     its name: an array of bytes (char, u8), or a pointer to a NUL-terminated string
    root     the root of its address space as the kernel keeps it (its page tables), a
             pointer or an integer: the process's space in the profile (saved with it; its
             label when there is no pid), in place of the vCPU's page-table register

``current`` is required; the others use ``$task``, current's value. Everything is checked when
the file is loaded, before the guest is touched (DescribeError: one line naming the key and the
term). Every task, its state and its saved context (for --off-cpu) are tasks.py's keys; kernel
threads are for keys to come.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from qmpprof.arch.base import InstructionSet
from qmpprof.elf.dwarftypes import TypeSource
from qmpprof.errors import DescribeError
from qmpprof.guest.describe import tasks
from qmpprof.guest.describe.compile import Code, Compiler, Env, Problem, Term, Unreadable
from qmpprof.guest.describe.syntax import SyntaxProblem
from qmpprof.guest.describe.tasks import TaskKeys, TaskProblem
from qmpprof.model import Registers

KEYS = ("current", "pid", "name", "root", *tasks.KEYS)
NAME_LIMIT = 64  # bytes of a name read through a pointer (a char array: its own size)


@dataclass(frozen=True, slots=True)
class Described:
    """What a description says of one vCPU at one moment: its task's address (None: no task
    runs), and as far as they were read, its pid, name and address-space root."""

    task: int | None
    pid: int | None = None
    name: str | None = None
    root: int | None = None


@dataclass(frozen=True, slots=True)
class Description:
    """A description checked and compiled: ``fixed_reads`` (address code, size) are the reads
    that depend on the vCPU's index alone (read with the stack); ``task_span`` (from, to):
    the bytes of the task the other keys read at constant offsets (read in one piece)."""

    path: Path
    current: Code
    pid: Code | None
    name: Callable[[Env], str] | None
    root: Code | None
    fixed_reads: tuple[tuple[Code, int], ...]
    task_span: tuple[int, int] | None
    tasks: TaskKeys | None = None  # every task and where each was switched out (--off-cpu)

    def current_task(self, env: Env) -> int | None:
        """The address of the task on ``env``'s vCPU, None when none runs (``current`` is 0).
        Unreadable when an expression read unmapped memory (or a register the sample lacks);
        the memory's own exception for
        memory not fetched yet."""
        return _keyed("current", self.current, env) or None

    def about(self, env: Env, task: int) -> Described:
        """What the other keys say of ``task``."""
        env = Env(env.cpu, env.regs, env.memory, task)
        pid = None if self.pid is None else _keyed("pid", self.pid, env)
        name = None if self.name is None else _keyed("name", self.name, env)
        root = None if self.root is None else _keyed("root", self.root, env)
        return Described(task, pid, name, root)


T = TypeVar("T")


def _keyed(key: str, code: Callable[[Env], T], env: Env) -> T:
    try:
        return code(env)
    except Unreadable as err:
        err.key = key
        raise


def load(path: Path, types: TypeSource, arch: InstructionSet) -> Description:
    """The description in ``path``, checked against ``types`` (the kernel's DWARF)."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as err:
        raise DescribeError(f"{path}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise DescribeError(f"{path}: not TOML: {err}") from None
    unknown = [key for key in table if key not in KEYS]
    if unknown:
        raise DescribeError(f"{path}: unknown key '{unknown[0]}' (keys: {', '.join(KEYS)})")
    if "current" not in table:
        raise DescribeError(f"{path}: no 'current' (the expression of the running task)")
    for key, value in table.items():
        if not isinstance(value, str) and key not in ("states", "unused"):
            raise DescribeError(f"{path}: {key}: a string holding an expression, not {value!r}")
    compiler = Compiler(types, register_readers(arch))
    try:
        return _compiled(path, table, compiler)
    except (KeyProblem, TaskProblem) as err:
        raise DescribeError(f"{path}: {err.key}: {err.detail}") from None


class KeyProblem(Exception):
    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"{key}: {detail}")
        self.key, self.detail = key, detail


def _compiled(path: Path, table: dict[str, object], compiler: Compiler) -> Description:
    current = _checked(compiler, table, "current", ("pointer", "int"))
    assert current is not None
    compiler.has_task, compiler.task = True, current.type
    pid = _checked(compiler, table, "pid", ("int",))
    root = _checked(compiler, table, "root", ("pointer", "int"))
    name = _name(compiler, table)
    reads = compiler.task_reads
    span = (min(o for o, _ in reads), max(o + n for o, n in reads)) if reads else None
    # The task keys' $task is any task, not the current one: a compiler of their own.
    every = tasks.compiled(Compiler(compiler.types, compiler.registers), table)
    return Description(
        path, current.code, None if pid is None else pid.code, name,
        None if root is None else root.code, tuple(compiler.fixed_reads), span, every,
    )  # fmt: skip


def _checked(
    compiler: Compiler, table: dict[str, object], key: str, kinds: tuple[str, ...]
) -> Term | None:
    """The loaded term of ``key``, of one of the type ``kinds``; None when the file has none."""
    source = table.get(key)
    if source is None:
        return None
    assert isinstance(source, str)
    try:
        term = compiler.value(compiler.compile(source), source)
    except (Problem, SyntaxProblem) as err:
        raise KeyProblem(key, str(err)) from None
    ctype = compiler.ctype(term.type)
    kind = "int" if ctype is None else ctype.kind
    if kind not in kinds:
        shown = "an integer" if ctype is None else f"type {ctype.name}"
        raise KeyProblem(key, f"{source}: {shown}, not {' or '.join(_SAID[k] for k in kinds)}")
    return term


_SAID = {"pointer": "a pointer", "int": "an integer"}


def _name(compiler: Compiler, table: dict[str, object]) -> Callable[[Env], str] | None:
    """The code of ``name``: a char array's bytes, or a string's through a char pointer."""
    source = table.get("name")
    if source is None:
        return None
    assert isinstance(source, str)
    try:
        term = compiler.compile(source)
        ctype = compiler.ctype(term.type)
        if (
            term.lvalue
            and ctype is not None
            and ctype.kind == "array"
            and _chars(compiler, ctype.target)
        ):
            size = ctype.size or NAME_LIMIT
            if term.task_offset is not None:
                compiler.task_reads.append((term.task_offset, size))
            return _string(term.code, size)
        loaded = compiler.value(term, source)
        ctype = compiler.ctype(loaded.type)
        if ctype is not None and ctype.kind == "pointer" and _chars(compiler, ctype.target):
            return _string(loaded.code, NAME_LIMIT)
    except (Problem, SyntaxProblem) as err:
        raise KeyProblem("name", str(err)) from None
    shown = "an integer" if ctype is None else f"type {ctype.name}"
    raise KeyProblem("name", f"{source}: {shown}, not an array of bytes or a pointer to them")


def _chars(compiler: Compiler, key: int | None) -> bool:
    """A byte: C's char (signed or not), or any integer of one byte (Rust's names are u8)."""
    element = compiler.ctype(key)
    return element is not None and element.kind == "int" and element.size == 1


def _string(address: Code, size: int) -> Callable[[Env], str]:
    def read(env: Env) -> str:
        addr = address(env)
        data = env.memory.read(addr, size)
        if data is None:
            raise Unreadable(f"unmapped memory at {addr:#x}")
        return data.split(b"\0", 1)[0].decode(errors="replace")

    return read


def register_readers(arch: InstructionSet) -> dict[str, Callable[[Registers], int | None]]:
    """``$NAME`` for each register of the instruction set by its name (DWARF's numbering), and
    its page-table root (``$cr3``, ``$satp``, ...)."""
    readers = {name: _gpr(number) for number, name in enumerate(arch.names)}
    readers[arch.space_register] = _space
    return readers


def _gpr(number: int) -> Callable[[Registers], int | None]:
    return lambda regs: regs.gprs.get(number)


def _space(regs: Registers) -> int | None:
    return regs.space
