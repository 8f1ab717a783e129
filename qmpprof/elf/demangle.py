"""Readable names for mangled symbols: C++ (Itanium ABI), Rust legacy and Rust v0.

Rust names are decoded here (legacy ``_ZN…17h<hash>E`` loses its hash, v0 ``_R`` basic paths
become ``crate::module::item``). C++ names go through ``c++filt`` in one batch per ELF: a full
Itanium demangler is a project of its own, and binutils is present wherever gcc is.
Anything that cannot be decoded keeps its mangled name.
"""

from __future__ import annotations

import re
import shutil
import subprocess

_RUST_HASH = re.compile(r"h[0-9a-f]{16}")
_RUST_ESCAPES = {
    "SP": "@",
    "BP": "*",
    "RF": "&",
    "LT": "<",
    "GT": ">",
    "LP": "(",
    "RP": ")",
    "C": ",",
}
_BASE62 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def demangle_all(names: list[str]) -> list[str]:
    """Demangle a batch of names (one c++filt process for all the C++ ones)."""
    out = list(names)
    cxx: list[int] = []
    for i, name in enumerate(names):
        if name.startswith("_R"):
            out[i] = rust_v0(name) or name
        elif name.startswith("_ZN"):
            rust = rust_legacy(name)
            if rust is not None:
                out[i] = rust
            else:
                cxx.append(i)
        elif name.startswith("_Z"):
            cxx.append(i)
    if cxx:
        for i, text in zip(cxx, _cxxfilt([names[i] for i in cxx]), strict=True):
            out[i] = text
    return out


def _cxxfilt(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if tool is None:
        return names
    try:
        done = subprocess.run(
            [tool], input="\n".join(names) + "\n", capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return names
    lines = done.stdout.splitlines()
    return lines if len(lines) == len(names) else names


def rust_legacy(name: str) -> str | None:
    """``_ZN3foo3bar17h0123456789abcdefE`` -> ``foo::bar``; None if not a Rust legacy name."""
    pos, parts = 3, []
    while pos < len(name) and name[pos] != "E":
        m = re.match(r"\d+", name[pos:])
        if m is None:
            return None
        size = int(m.group())
        pos += len(m.group())
        if size == 0 or pos + size > len(name):
            return None
        parts.append(name[pos : pos + size])
        pos += size
    if pos >= len(name) or len(parts) < 2 or not _RUST_HASH.fullmatch(parts[-1]):
        return None
    try:
        return "::".join(_rust_unescape(part) for part in parts[:-1])
    except ValueError:
        return None


def _rust_unescape(part: str) -> str:
    if part.startswith("_$"):
        part = part[1:]
    out, pos = [], 0
    while pos < len(part):
        if part.startswith("..", pos):
            out.append("::")
            pos += 2
        elif part[pos] == "$":
            end = part.index("$", pos + 1)  # ValueError when unterminated
            code = part[pos + 1 : end]
            if code in _RUST_ESCAPES:
                out.append(_RUST_ESCAPES[code])
            elif code.startswith("u"):
                out.append(chr(int(code[1:], 16)))
            else:
                raise ValueError(code)
            pos = end + 1
        else:
            out.append(part[pos])
            pos += 1
    return "".join(out)


def rust_v0(name: str) -> str | None:
    """Rust v0 basic paths (crate roots and nested paths): ``_RNvCs1_5crate3foo`` -> ``crate::foo``.

    Generic arguments, impl paths and back-references are left mangled (None).
    """
    parser = _V0(name, 2)
    try:
        path = parser.path()
    except (IndexError, ValueError):
        return None
    return path


class _V0:
    __slots__ = ("name", "pos")

    def __init__(self, name: str, pos: int) -> None:
        self.name = name
        self.pos = pos

    def path(self) -> str:
        tag = self.name[self.pos]
        self.pos += 1
        if tag == "C":
            return self.identifier()[1]
        if tag == "N":
            namespace = self.name[self.pos]
            self.pos += 1
            parent = self.path()
            dis, ident = self.identifier()
            if namespace == "C":
                return f"{parent}::{{closure#{dis}}}"
            if namespace == "S":
                return f"{parent}::{{shim:{ident}#{dis}}}"
            return f"{parent}::{ident}"
        raise ValueError(f"unsupported v0 path tag {tag}")

    def base62(self) -> int:
        """``_`` is 0, otherwise the base-62 digits before ``_`` plus one."""
        if self.name[self.pos] == "_":
            self.pos += 1
            return 0
        value = 0
        while self.name[self.pos] != "_":
            value = value * 62 + _BASE62.index(self.name[self.pos])
            self.pos += 1
        self.pos += 1
        return value + 1

    def identifier(self) -> tuple[int, str]:
        dis = 0
        if self.name[self.pos] == "s":
            self.pos += 1
            dis = self.base62() + 1
        if self.name[self.pos] == "u":
            raise ValueError("punycode identifiers are not decoded")
        m = re.match(r"\d+", self.name[self.pos :])
        if m is None:
            raise ValueError("identifier length expected")
        self.pos += len(m.group())
        size = int(m.group())
        if self.name.startswith("_", self.pos):
            self.pos += 1
        ident = self.name[self.pos : self.pos + size]
        if len(ident) != size:
            raise ValueError("truncated identifier")
        self.pos += size
        return dis, ident
