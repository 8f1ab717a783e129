"""The expressions of a kernel description, parsed: a small part of C's.

    expr    := unary (('+' | '-') unary)*
    unary   := '*' unary | '&' unary | '(' type ')' unary | postfix
    type    := ('struct' | 'union' | 'enum') NAME '*'*  |  NAME '*'+
    postfix := primary ('.' NAME | '->' NAME | '[' expr ']')*
    primary := NAME | INTEGER | '$' NAME | '(' expr ')'

``NAME`` is a global of the kernel's DWARF; ``$NAME`` a register of the vCPU by the
instruction set's name, ``$cpu`` (the vCPU's index) or ``$task`` (the current task, the value of
the description's ``current``). A cast names a pointer type (``(T *)``): a cast to a plain type
name would need the kernel's types to tell from a parenthesised name. Each node keeps its
source text, for messages that name the term.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(
    r"\s*(?:(0[xX][0-9a-fA-F]+|[0-9]+)|(\$?[A-Za-z_][A-Za-z0-9_]*)|(->|[.\[\]()*&+-]))"
)
_TAGS = ("struct", "union", "enum")


class SyntaxProblem(ValueError):
    """An expression that does not parse; the message says where."""


@dataclass(frozen=True, slots=True)
class Name:
    text: str
    name: str


@dataclass(frozen=True, slots=True)
class Number:
    text: str
    value: int


@dataclass(frozen=True, slots=True)
class Register:
    """``$NAME``: a register, or ``$cpu``, ``$task``."""

    text: str
    name: str


@dataclass(frozen=True, slots=True)
class Member:
    """``base.name`` (``arrow``: ``base->name``)."""

    text: str
    base: Node
    name: str
    arrow: bool


@dataclass(frozen=True, slots=True)
class Index:
    text: str
    base: Node
    index: Node


@dataclass(frozen=True, slots=True)
class Unary:
    """``*operand`` or ``&operand``."""

    text: str
    op: str
    operand: Node


@dataclass(frozen=True, slots=True)
class Cast:
    """``(type_name stars*) operand``."""

    text: str
    type_name: str
    stars: int
    operand: Node


@dataclass(frozen=True, slots=True)
class Binary:
    text: str
    op: str
    left: Node
    right: Node


Node = Name | Number | Register | Member | Index | Unary | Cast | Binary


def parse(source: str) -> Node:
    """The expression ``source``; SyntaxProblem naming where it stops making sense."""
    parser = _Parser(source)
    node = parser.expr()
    if parser.pos < len(parser.tokens):
        raise parser.problem("an operator or the end")
    return node


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source
        self.tokens: list[tuple[str, int, int]] = []  # (token, start, end) in source
        pos = 0
        while source[pos:].strip():
            found = _TOKEN.match(source, pos)
            if found is None:
                at = len(source) - len(source[pos:].lstrip())
                raise SyntaxProblem(f"at column {at + 1}: unexpected {source[at]!r}")
            start = found.start(found.lastindex or 0)
            self.tokens.append((found.group(found.lastindex or 0), start, found.end()))
            pos = found.end()
        self.pos = 0

    def peek(self, ahead: int = 0) -> str | None:
        at = self.pos + ahead
        return self.tokens[at][0] if at < len(self.tokens) else None

    def take(self, wanted: str | None = None) -> str:
        token = self.peek()
        if token is None or (wanted is not None and token != wanted):
            raise self.problem(repr(wanted) if wanted else "more")
        self.pos += 1
        return token

    def problem(self, wanted: str) -> SyntaxProblem:
        if self.pos >= len(self.tokens):
            return SyntaxProblem(f"ends early: {wanted} expected")
        token, start, _ = self.tokens[self.pos]
        return SyntaxProblem(f"at column {start + 1}: {wanted} expected, not {token!r}")

    def text(self, first: int) -> str:
        """The source of the tokens from ``first`` up to the current one."""
        return self.source[self.tokens[first][1] : self.tokens[self.pos - 1][2]]

    def expr(self) -> Node:
        first = self.pos
        node = self.unary()
        while self.peek() in ("+", "-"):
            op = self.take()
            right = self.unary()
            node = Binary(self.text(first), op, node, right)
        return node

    def unary(self) -> Node:
        first = self.pos
        token = self.peek()
        if token in ("*", "&"):
            self.take()
            operand = self.unary()
            return Unary(self.text(first), token, operand)
        if token == "(" and self._cast_ahead():
            self.take("(")
            type_name = self.take()
            if type_name in _TAGS:
                type_name += " " + self._name()
            stars = 0
            while self.peek() == "*":
                self.take()
                stars += 1
            self.take(")")
            operand = self.unary()
            return Cast(self.text(first), type_name, stars, operand)
        return self.postfix()

    def _cast_ahead(self) -> bool:
        """``(struct ...`` or ``(NAME *``: a cast, not a parenthesised expression."""
        word, after = self.peek(1), self.peek(2)
        return word in _TAGS or (_is_name(word) and after == "*" and self._stars_close(2))

    def _stars_close(self, ahead: int) -> bool:
        while self.peek(ahead) == "*":
            ahead += 1
        return self.peek(ahead) == ")"

    def postfix(self) -> Node:
        first = self.pos
        node = self.primary()
        while self.peek() in (".", "->", "["):
            token = self.take()
            if token == "[":
                index = self.expr()
                self.take("]")
                node = Index(self.text(first), node, index)
            else:
                name = self._name()
                node = Member(self.text(first), node, name, token == "->")
        return node

    def primary(self) -> Node:
        first = self.pos
        token = self.peek()
        if token == "(":
            self.take()
            node = self.expr()
            self.take(")")
            return node
        if token is not None and token[0].isdigit():
            self.take()
            return Number(token, int(token, 0))
        if token is not None and token.startswith("$"):
            self.take()
            return Register(token, token[1:])
        if not _is_name(token) or token in _TAGS:
            raise self.problem("a term")
        name = self._name()
        return Name(self.text(first), name)

    def _name(self) -> str:
        token = self.peek()
        if not _is_name(token) or token in _TAGS:
            raise self.problem("a name")
        return self.take()


def _is_name(token: str | None) -> bool:
    return token is not None and (token[0].isalpha() or token[0] == "_")
