"""A description's expressions checked against the kernel's types and compiled to code that
reads guest memory in a pause.

Checking (``Compiler.compile``) walks a parsed expression with each term's C type: a name must
be a global, a member must be its struct's, ``->`` and ``*`` need a pointer, ``[]`` an array or
a pointer and an integer, a cast a known type; any other term is a ``Problem`` naming it. The
code made is a tree of closures over an ``Env`` (the vCPU, its registers, the current task, the
sample's memory). What depends on nothing but the vCPU's index (the address of ``cpus[$cpu]``)
is computed once per vCPU and kept. Loads from such an address (``fixed_reads``) and from the
current task at a constant offset (``task_reads``) are told apart, so that a pause can fetch
them before evaluating: the first with the stack, the second in one read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from qmpprof.elf.dwarftypes import CType, TypeSource
from qmpprof.guest.describe import syntax
from qmpprof.model import Registers


class Problem(ValueError):
    """A term that does not fit; ``term``: its source text."""

    def __init__(self, term: str, detail: str) -> None:
        super().__init__(f"{term}: {detail}")
        self.term = term


class Unreadable(Exception):
    """What an expression needed could not be read in this sample: guest memory not mapped
    (``what``: where), or a register the sample lacks."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.key: str | None = None  # the description's key that read it, once known


class Memory(Protocol):
    """The sample's memory: bytes at an address, None when unmapped (``PageCache.read``, which
    raises PageMissing for what was not fetched yet)."""

    def read(self, addr: int, size: int) -> bytes | None: ...


@dataclass(frozen=True, slots=True)
class Env:
    cpu: int
    regs: Registers
    memory: Memory
    task: int | None = None


Code = Callable[[Env], int]


@dataclass(frozen=True, slots=True)
class Term:
    """A checked term: the code of its value (``lvalue``: of its address), its type (None: a
    plain integer: a literal, a register, ``$cpu``), whether it depends on the vCPU's index
    alone (``fixed``), and its address's offset from ``$task`` when that is constant."""

    code: Code
    type: int | None
    lvalue: bool = False
    fixed: bool = False
    task_offset: int | None = None


@dataclass(slots=True)
class Compiler:
    """Checks and compiles expressions over ``types``; ``registers``: the instruction set's
    register names (``$NAME``); ``has_task``: ``current`` was compiled (``$task``'s type)."""

    types: TypeSource
    registers: dict[str, Callable[[Registers], int | None]]
    task: int | None = None  # the type of $task (None: an integer)
    has_task: bool = False
    fixed_reads: list[tuple[Code, int]] = field(default_factory=list)
    task_reads: list[tuple[int, int]] = field(default_factory=list)

    def compile(self, source: str) -> Term:
        """The checked term of ``source``: Problem (or syntax.SyntaxProblem) when it fits not."""
        return self.term(syntax.parse(source))

    def term(self, node: syntax.Node) -> Term:
        if isinstance(node, syntax.Number):
            value = node.value
            return Term(lambda env: value, None, fixed=True)
        if isinstance(node, syntax.Name):
            return self._global(node)
        if isinstance(node, syntax.Register):
            return self._register(node)
        if isinstance(node, syntax.Member):
            return self._member(node)
        if isinstance(node, syntax.Index):
            return self._index(node)
        if isinstance(node, syntax.Unary):
            return self._unary(node)
        if isinstance(node, syntax.Cast):
            return self._cast(node)
        return self._binary(node)

    def ctype(self, key: int | None) -> CType | None:
        return None if key is None else self.types.type(key)

    def _global(self, node: syntax.Name) -> Term:
        found = self.types.variable(node.name)
        if found is None:
            raise Problem(node.text, "no global of this name in the kernel's DWARF")
        addr = found.addr
        return Term(lambda env: addr, found.type, lvalue=True, fixed=True)

    def _register(self, node: syntax.Register) -> Term:
        if node.name == "cpu":
            return Term(lambda env: env.cpu, None, fixed=True)
        if node.name == "task":
            if not self.has_task:
                raise Problem(node.text, "$task is the value of 'current', which comes first")
            return Term(_task, self.task, task_offset=0)
        read = self.registers.get(node.name)
        if read is None:
            known = ", ".join(sorted(self.registers))
            raise Problem(node.text, f"no such register (these are: {known}, cpu, task)")
        missing = f"no {node.text} in this sample"

        def register(env: Env) -> int:
            value = read(env.regs)
            if value is None:
                raise Unreadable(missing)
            return value

        return Term(register, None)

    def value(self, term: Term, text: str) -> Term:
        """``term`` as a value: an lvalue loaded (an array: its address, as C decays it)."""
        if not term.lvalue:
            return term
        ctype = self.ctype(term.type)
        assert ctype is not None  # lvalues are typed
        if ctype.kind == "array":
            pointer = self.types.pointer_to(ctype.target)
            return Term(term.code, pointer, fixed=term.fixed)
        if ctype.kind not in ("int", "pointer") or ctype.size not in (1, 2, 4, 8):
            raise Problem(text, f"type {ctype.name}: not a value this language reads")
        address = per_cpu(term.code) if term.fixed else term.code
        if term.fixed:
            self.fixed_reads.append((address, ctype.size))
        if term.task_offset is not None:
            self.task_reads.append((term.task_offset, ctype.size))
        return Term(load(address, ctype.size, ctype.signed), term.type)

    def pointee(self, term: Term, text: str) -> tuple[Term, CType]:
        """A pointer term loaded, and the type it points to."""
        loaded = self.value(term, text)
        ctype = self.ctype(loaded.type)
        if ctype is None or ctype.kind != "pointer":
            shown = "an integer" if ctype is None else f"type {ctype.name}"
            raise Problem(text, f"{shown}, not a pointer")
        if ctype.target is None:
            raise Problem(text, "a void pointer: cast it to the type it points to")
        return loaded, self.types.type(ctype.target)

    def _member(self, node: syntax.Member) -> Term:
        base = self.term(node.base)
        if node.arrow:
            base, aggregate = self.pointee(base, node.base.text)
            base_offset = base.task_offset  # a pointer's: its value's offset from $task
        else:
            aggregate = self._aggregate_of(base, node.base.text)
            base_offset = base.task_offset
        if aggregate.kind not in ("struct", "union"):
            raise Problem(node.base.text, f"type {aggregate.name}, not a struct or union")
        member = aggregate.member(node.name)
        if member is None:
            raise Problem(node.text, f"{aggregate.name} has no member '{node.name}'")
        if member.bits:
            raise Problem(node.text, "a bit field: not read by this language")
        offset, code = member.offset, base.code
        task_offset = None if base_offset is None else base_offset + offset
        return Term(lambda env: code(env) + offset, member.type, lvalue=True, fixed=base.fixed,
                    task_offset=task_offset)  # fmt: skip

    def _aggregate_of(self, term: Term, text: str) -> CType:
        ctype = self.ctype(term.type)
        if not term.lvalue or ctype is None:
            raise Problem(text, "not a struct in memory: '.' needs one ('->' for a pointer)")
        return ctype

    def _index(self, node: syntax.Index) -> Term:
        base = self.term(node.base)
        ctype = self.ctype(base.type)
        if base.lvalue and ctype is not None and ctype.kind == "array":
            assert ctype.target is not None
            element = self.types.type(ctype.target)
            start: Term = Term(base.code, base.type, fixed=base.fixed)
            key = ctype.target
        else:
            start, element = self.pointee(base, node.base.text)
            target = self.ctype(start.type)
            assert target is not None and target.target is not None
            key = target.target
        index = self.integer(self.term(node.index), node.index.text)
        size, at, i = element.size, start.code, index.code
        fixed = start.fixed and index.fixed
        return Term(lambda env: at(env) + i(env) * size, key, lvalue=True, fixed=fixed)

    def integer(self, term: Term, text: str) -> Term:
        loaded = self.value(term, text)
        ctype = self.ctype(loaded.type)
        if ctype is not None and ctype.kind != "int":
            raise Problem(text, f"type {ctype.name}, not an integer")
        return loaded

    def _unary(self, node: syntax.Unary) -> Term:
        operand = self.term(node.operand)
        if node.op == "&":
            if not operand.lvalue or operand.type is None:
                raise Problem(node.operand.text, "has no address ('&' needs a term in memory)")
            pointer = self.types.pointer_to(operand.type)
            return Term(operand.code, pointer, fixed=operand.fixed)
        loaded, _ = self.pointee(operand, node.operand.text)
        ctype = self.ctype(loaded.type)
        assert ctype is not None
        return Term(loaded.code, ctype.target, lvalue=True, task_offset=loaded.task_offset)

    def _cast(self, node: syntax.Cast) -> Term:
        key = self.types.named(node.type_name)
        if key is None:
            raise Problem(node.text, f"no type '{node.type_name}' in the kernel's DWARF")
        for _ in range(node.stars):
            key = self.types.pointer_to(key)
        operand = self.value(self.term(node.operand), node.operand.text)
        ctype = self.ctype(operand.type)
        if ctype is not None and ctype.kind not in ("int", "pointer"):
            raise Problem(node.operand.text, f"type {ctype.name}: cannot be cast")
        return Term(operand.code, key, fixed=operand.fixed)

    def _binary(self, node: syntax.Binary) -> Term:
        left = self.value(self.term(node.left), node.left.text)
        right = self.integer(self.term(node.right), node.right.text)
        ctype = self.ctype(left.type)
        scale = 1
        if ctype is not None and ctype.kind == "pointer":
            target = self.ctype(ctype.target)
            scale = 1 if target is None or target.size == 0 else target.size
        elif ctype is not None and ctype.kind != "int":
            raise Problem(node.left.text, f"type {ctype.name}: no arithmetic on it")
        sign = -1 if node.op == "-" else 1
        mask = (1 << (8 * self.types.address_size)) - 1
        a, b, step = left.code, right.code, sign * scale
        fixed = left.fixed and right.fixed
        return Term(lambda env: (a(env) + b(env) * step) & mask, left.type, fixed=fixed)


def _task(env: Env) -> int:
    assert env.task is not None  # the identifier evaluates $task's users only with a task
    return env.task


def per_cpu(code: Code) -> Code:
    """``code`` (of a term that depends on the vCPU's index alone) computed once per vCPU."""
    known: dict[int, int] = {}

    def kept(env: Env) -> int:
        found = known.get(env.cpu)
        if found is None:
            found = known[env.cpu] = code(env)
        return found

    return kept


def load(address: Code, size: int, signed: bool) -> Code:
    """The code of an integer of ``size`` bytes (little-endian) read at ``address``."""

    def loaded(env: Env) -> int:
        addr = address(env)
        data = env.memory.read(addr, size)
        if data is None:
            raise Unreadable(f"unmapped memory at {addr:#x}")
        return int.from_bytes(data, "little", signed=signed)

    return loaded
