"""KernelSymbols: a kernel's symbols as kallsyms knows them, and the text forms of that list.

Whatever the source (the kallsyms tables in the image, a System.map, the guest's
/proc/kallsyms), a kernel symbol is an address, nm's one-letter type and a name, in the
kernel's own order: by address, aliases in the order the kernel prefers them. /proc/kallsyms
adds the module a symbol belongs to (``[ext4]``).

Only text symbols (``t T w W``) name code: ``text_symbols`` and ``symbol_table`` give them, one
per address, the first alias as the kernel names an address by it, with sizes taken as the
distance to the next symbol at a higher address, since kallsyms records no sizes.

``parse_export_table`` reads another list the image holds, its exported symbols (name and
address, ``__ksymtab``): what the kallsyms decoded from an image are checked against.
"""

from __future__ import annotations

import operator
import struct
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate, pairwise

from qmpprof.elf.symbols import Symbol, SymbolTable
from qmpprof.errors import SymbolMapError

TEXT_TYPES = frozenset("tTwW")
END = 1 << 64  # the end of a symbol with nothing above it


@dataclass(slots=True)
class KernelSymbols:
    """Parallel lists, one entry per symbol, sorted by address (a stable sort keeps alias
    order). ``modules[i]`` is None for the kernel image itself."""

    addrs: list[int]
    types: list[str]
    names: list[str]
    modules: list[str | None] = field(default_factory=list)
    _by_name: dict[str, int] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.modules:
            self.modules = [None] * len(self.addrs)

    def __len__(self) -> int:
        return len(self.addrs)

    def address_of(self, name: str, module: str | None = None) -> int | None:
        """The address of the first symbol with this name (in the kernel image by default)."""
        if module is None:
            if self._by_name is None:
                # Built backwards, so that the first symbol of a name is the one that stays.
                rows = zip(
                    reversed(self.names), reversed(self.addrs), reversed(self.modules), strict=True
                )
                self._by_name = {sym_name: addr for sym_name, addr, mod in rows if mod is None}
            return self._by_name.get(name)
        for addr, sym_name, mod in zip(self.addrs, self.names, self.modules, strict=True):
            if sym_name == name and mod == module:
                return addr
        return None

    def has(self, name: str, addr: int) -> bool:
        """Whether a symbol of the kernel image with this name is at ``addr`` (static functions
        of the same name live elsewhere, the first of them maybe lower)."""
        if self.address_of(name) == addr:
            return True
        i = bisect_left(self.addrs, addr)
        while i < len(self.addrs) and self.addrs[i] == addr:
            if self.names[i] == name and self.modules[i] is None:
                return True
            i += 1
        return False

    def text_symbols(self, module: str | None = None) -> list[Symbol]:
        """The text symbols of the kernel image (or of ``module``), one per address, sized to
        the next symbol; the last one has size 0."""
        starts, ends, names = self.text_arrays(module)
        return [
            Symbol(start, end - start if end != END else 0, name)
            for start, end, name in zip(starts, ends, names, strict=True)
        ]

    def symbol_table(self, module: str | None = None) -> SymbolTable:
        return SymbolTable.from_sorted(*self.text_arrays(module))

    def text_arrays(self, module: str | None) -> tuple[list[int], list[int], list[str]]:
        """(starts, ends, names) of text symbols: at an address shared by aliases the first
        text one, as the kernel names it; the end is the next address any symbol has."""
        starts, ends, picks = self.text_picks(module)
        names = self.names
        return starts, ends, [names[i] for i in picks]

    def text_picks(self, module: str | None) -> tuple[list[int], list[int], list[int]]:
        """``text_arrays`` with the index of each name's symbol instead of the name. Only the
        last start can have nothing above it (an end of ``END``)."""
        pairs = [
            (addr, i)
            for i, (addr, kind, mod) in enumerate(
                zip(self.addrs, self.types, self.modules, strict=True)
            )
            if kind in TEXT_TYPES and mod == module
        ]
        first = dict(reversed(pairs))  # the earliest alias is assigned last, so it stays
        starts = list(first)[::-1]
        distinct = list(dict.fromkeys(self.addrs))
        following = dict(pairwise(distinct))
        ends = [following.get(start, END) for start in starts]
        return starts, ends, [first[start] for start in starts]


def parse_symbol_map(text: str, path: str = "<symbols>") -> KernelSymbols:
    """System.map or /proc/kallsyms text: ``ADDR TYPE NAME [module]`` lines, any order.

    Lines that do not parse are skipped; a file with no symbol line at all is an error, and so
    is one whose addresses are all zero (/proc/kallsyms read without the right to see them).
    """
    rows: list[tuple[int, str, str, str | None]] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or len(parts[1]) != 1:
            continue
        try:
            addr = int(parts[0], 16)
        except ValueError:
            continue
        module = parts[3].strip("[]") if len(parts) > 3 and parts[3].startswith("[") else None
        rows.append((addr, parts[1], parts[2], module))
    if not rows:
        raise SymbolMapError(path, "no 'ADDRESS TYPE NAME' lines")
    if not any(addr for addr, *_ in rows):
        raise SymbolMapError(path, "every address is 0 (read /proc/kallsyms as root)")
    if len(rows) == 1 and rows[0][2].startswith("The"):
        raise SymbolMapError(path, "a stub System.map (the real one is in the -dbg package)")
    rows.sort(key=lambda row: row[0])  # stable: the file's order among aliases is kept
    return KernelSymbols(
        [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]
    )


def parse_export_table(
    entries: bytes, entries_addr: int, strings: bytes, strings_addr: int
) -> list[tuple[str, int]] | None:
    """(name, address) of each exported symbol in a ``__ksymtab`` section: with
    CONFIG_HAVE_ARCH_PREL32_RELOCATIONS (x86_64) three s32 (value, name, namespace), each
    relative to its own address, the names in ``__ksymtab_strings``. None when the entries are
    not of that form (a name outside the strings). Without it (riscv64) three u64 (value,
    name, namespace) hold addresses: taken where every name points into the strings."""
    absolute = _absolute_exports(entries, strings, strings_addr)
    if absolute is not None:
        return absolute
    if len(entries) % 12:
        return None
    fields = struct.unpack(f"<{len(entries) // 4}i", entries)
    parts = strings.decode("latin-1").split("\0")
    starts = accumulate(map((1).__add__, map(len, parts)), initial=0)  # one more than parts
    by_offset = dict(zip(starts, parts, strict=False))
    name_at = map(operator.add, fields[1::3], range(entries_addr + 4 - strings_addr, END, 12))
    # The linker merges strings, so a name may be the tail of another.
    names = [by_offset.get(at) or _string_at(strings, at) for at in name_at]
    if "" in names:
        return None
    addrs = map(operator.add, fields[::3], range(entries_addr, END, 12))
    return list(zip(names, (addr % END for addr in addrs), strict=True))


def _absolute_exports(
    entries: bytes, strings: bytes, strings_addr: int
) -> list[tuple[str, int]] | None:
    """``parse_export_table``'s entries as three u64 each; None unless every value is in the
    upper half (the kernel's) and every name and namespace (0: none) points into the strings."""
    if not entries or len(entries) % 24:
        return None
    fields = struct.unpack(f"<{len(entries) // 8}Q", entries)
    inside = range(strings_addr, strings_addr + len(strings))
    if any(value < 1 << 63 for value in fields[::3]):
        return None
    if any(at not in inside for at in fields[1::3]) or any(
        at and at not in inside for at in fields[2::3]
    ):
        return None
    names = [_string_at(strings, at - strings_addr) for at in fields[1::3]]
    return None if "" in names else list(zip(names, fields[::3], strict=True))


def _string_at(data: bytes, pos: int) -> str:
    """The NUL-terminated string at ``pos``, or "" when there is none."""
    end = data.find(b"\0", pos) if 0 <= pos < len(data) else -1
    return data[pos:end].decode("latin-1") if end > pos else ""
