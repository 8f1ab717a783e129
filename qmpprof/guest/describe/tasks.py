"""A description's keys for every task and where a task that is not running was switched out
(for ``--off-cpu``): which tasks there are, each one's state, and the registers its kernel
stack is unwound from (docs/describe.md).

    tasks    every task: an array (each element is one) or a pointer to the first of a list
    next     with a list: the task after ``$task``; 0 (or back to the first) ends it
    state    the task's state, an integer (an enum's value)
    states   a table: a state's value to a letter as Linux's (R runnable, S sleeping, D, ...)
    unused   a list of state values that mark an empty slot (of an array), not a task
    pc sp fp where the task resumes: its program counter, stack and frame pointer as its
             saved context holds them (``$task->context->eip``, ``$task->context + 1``)

In these keys ``$task`` is one of ``tasks`` (an element's address). ``tasks``, ``state`` and
``states`` come together; ``pc`` and ``sp`` with them (``fp`` may be left out: the unwinder
starts without one). A state no ``states`` entry names is told as its number.
"""

from __future__ import annotations

from dataclasses import dataclass

from qmpprof.guest.describe.compile import Code, Compiler, Env, Problem, Unreadable
from qmpprof.guest.describe.syntax import SyntaxProblem

KEYS = ("tasks", "next", "state", "states", "unused", "pc", "sp", "fp")
LETTERS = "RSDTtXZIWPK"  # Linux's task states, as ps prints them
MAX_TASKS = 4096  # a list longer than this is taken as a loop the description does not end


class TaskProblem(Exception):
    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"{key}: {detail}")
        self.key, self.detail = key, detail


@dataclass(frozen=True, slots=True)
class Switched:
    """A task not running, as its saved context says: its address, its state's letter (or
    its value's number), and the registers to unwind its kernel stack from."""

    task: int
    state: str
    pc: int
    sp: int
    fp: int | None


@dataclass(frozen=True, slots=True)
class TaskKeys:
    """The task keys compiled: ``first`` the first task (an array's first element), ``step``
    the one after a task in a list (None: an array of ``count`` elements)."""

    first: Code
    count: int | None
    step: Code | None
    state: Code
    states: dict[int, str]
    unused: frozenset[int]
    pc: Code
    sp: Code
    fp: Code | None
    size_of_element: int  # an array's: the step from one task to the next

    def all(self, env: Env) -> list[int]:
        """Every task's address, empty slots among them (``switched`` tells them)."""
        first = _keyed("tasks", self.first, env)
        if self.step is None:
            assert self.count is not None
            return [first + i * self.size_of_element for i in range(self.count)]
        found: list[int] = []
        task = first
        while task and len(found) < MAX_TASKS and (task != first or not found):
            found.append(task)
            task = _keyed("next", self.step, Env(env.cpu, env.regs, env.memory, task))
        return found

    def switched(self, env: Env, task: int) -> Switched | None:
        """``task`` as it was switched out; None when it is an empty slot or running."""
        env = Env(env.cpu, env.regs, env.memory, task)
        value = _keyed("state", self.state, env)
        if value in self.unused:
            return None
        letter = self.states.get(value, str(value))
        if letter == "R":
            return None  # on a vCPU now, or runnable: its stack is the sample's, or a switch
        pc, sp = _keyed("pc", self.pc, env), _keyed("sp", self.sp, env)
        fp = None if self.fp is None else _keyed("fp", self.fp, env)
        return Switched(task, letter, pc, sp, fp)


def _keyed(key: str, code: Code, env: Env) -> int:
    try:
        return code(env)
    except Unreadable as err:
        err.key = key
        raise


def compiled(compiler: Compiler, table: dict[str, object]) -> TaskKeys | None:
    """The task keys of ``table`` checked with a compiler of their own (``$task``: a task);
    None when it has none. TaskProblem names the key that does not fit."""
    present = [key for key in KEYS if key in table]
    if not present:
        return None
    for key in ("tasks", "state", "states", "pc", "sp"):
        if key not in table:
            raise TaskProblem(present[0], f"comes with '{key}' (the keys of --off-cpu)")
    first, count, element = _tasks(compiler, _source(table, "tasks"))
    compiler.has_task, compiler.task = True, element
    step = _expression(compiler, table, "next") if count is None else None
    if count is None and step is None:
        raise TaskProblem("tasks", "a pointer: its list needs 'next' (the task after $task)")
    states, unused = _states(table.get("states")), _unused(table.get("unused"))
    fp = _expression(compiler, table, "fp")
    size = 0 if count is None else _size(compiler, element)
    return TaskKeys(
        first, count, step, _required(compiler, table, "state"), states, unused,
        _required(compiler, table, "pc"), _required(compiler, table, "sp"), fp, size,
    )  # fmt: skip


def _source(table: dict[str, object], key: str) -> str:
    source = table[key]
    if not isinstance(source, str):
        raise TaskProblem(key, f"a string holding an expression, not {source!r}")
    return source


def _tasks(compiler: Compiler, source: str) -> tuple[Code, int | None, int | None]:
    """``tasks``: its first task's address, an array's count (None: a list), $task's type."""
    try:
        term = compiler.compile(source)
        ctype = compiler.ctype(term.type)
        if term.lvalue and ctype is not None and ctype.kind == "array":
            if not ctype.count:
                raise TaskProblem("tasks", f"{source}: an array of no known length")
            assert ctype.target is not None
            return term.code, ctype.count, compiler.types.pointer_to(ctype.target)
        loaded = compiler.value(term, source)
    except (Problem, SyntaxProblem) as err:
        raise TaskProblem("tasks", str(err)) from None
    ctype = compiler.ctype(loaded.type)
    if ctype is None or ctype.kind != "pointer":
        shown = "an integer" if ctype is None else f"type {ctype.name}"
        raise TaskProblem("tasks", f"{source}: {shown}, not an array or a pointer to a task")
    return loaded.code, None, loaded.type


def _size(compiler: Compiler, pointer: int | None) -> int:
    ctype = compiler.ctype(pointer)
    assert ctype is not None and ctype.target is not None
    return compiler.types.type(ctype.target).size


def _expression(compiler: Compiler, table: dict[str, object], key: str) -> Code | None:
    """The value code of ``key``, an integer or a pointer; None when the table has none."""
    if key not in table:
        return None
    source = _source(table, key)
    try:
        term = compiler.value(compiler.compile(source), source)
    except (Problem, SyntaxProblem) as err:
        raise TaskProblem(key, str(err)) from None
    ctype = compiler.ctype(term.type)
    if ctype is not None and ctype.kind not in ("int", "pointer"):
        raise TaskProblem(key, f"{source}: type {ctype.name}, not an integer or a pointer")
    return term.code


def _required(compiler: Compiler, table: dict[str, object], key: str) -> Code:
    code = _expression(compiler, table, key)
    assert code is not None  # compiled() checked it is there
    return code


def _states(table: object) -> dict[int, str]:
    if not isinstance(table, dict):
        raise TaskProblem("states", f"a table of a state's value to a letter, not {table!r}")
    states: dict[int, str] = {}
    for value, letter in table.items():
        if not value.lstrip("-").isdigit():
            raise TaskProblem("states", f"'{value}': not a state's value (an integer)")
        if not isinstance(letter, str) or len(letter) != 1 or letter not in LETTERS:
            raise TaskProblem("states", f"{value} = {letter!r}: not one of {LETTERS}")
        states[int(value)] = letter
    return states


def _unused(values: object) -> frozenset[int]:
    if values is None:
        return frozenset()
    if not isinstance(values, list) or not all(isinstance(v, int) for v in values):
        raise TaskProblem("unused", f"a list of state values, not {values!r}")
    return frozenset(values)
