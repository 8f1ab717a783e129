"""SymbolTable lookups (sizes, lenient mode, aliases, nesting) and name demangling."""

from __future__ import annotations

import pytest

from qmpprof.elf.demangle import demangle_all, rust_legacy, rust_v0
from qmpprof.elf.symbols import Symbol, SymbolTable


def table(*symbols: Symbol) -> SymbolTable:
    return SymbolTable(symbols)


def test_sizes_are_respected() -> None:
    t = table(Symbol(0x1000, 0x20, "a"), Symbol(0x1100, 0x10, "b"))
    assert t.lookup(0x1000) == ("a", 0)
    assert t.lookup(0x101F) == ("a", 0x1F)
    assert t.lookup(0x1020) is None  # past a's end, before b
    assert t.lookup(0x1110) is None  # past the last symbol
    assert t.lookup(0xFFF) is None  # below every symbol
    assert len(t) == 2


def test_lenient_attributes_to_the_symbol_below() -> None:
    t = table(Symbol(0x1000, 0x20, "a"), Symbol(0x1100, 0x10, "b"))
    assert t.lookup(0x1020, lenient=True) == ("a", 0x20)
    assert t.lookup(0x2000, lenient=True) == ("b", 0xF00)
    assert t.lookup(0xFFF, lenient=True) is None


def test_size_zero_symbol_reaches_the_next_symbol() -> None:
    t = table(Symbol(0x1000, 0, "isr_stub"), Symbol(0x1040, 0x10, "handler"))
    assert t.lookup(0x103F) == ("isr_stub", 0x3F)
    assert t.lookup(0x1040) == ("handler", 0)


def test_aliases_prefer_global_then_sized_then_shorter() -> None:
    t = table(
        Symbol(0x1000, 0x10, "local_alias", rank=2),
        Symbol(0x1000, 0x10, "global_name", rank=0),
        Symbol(0x1000, 0x10, "weak_name", rank=1),
        Symbol(0x2000, 0, "unsized"),
        Symbol(0x2000, 8, "sized_long_name"),
    )
    assert t.lookup(0x1004) == ("global_name", 4)
    assert t.lookup(0x2004) == ("sized_long_name", 4)
    assert len(t) == 2


def test_an_enclosing_symbol_covers_addresses_past_a_nested_one() -> None:
    t = table(Symbol(0x1000, 0x100, "outer"), Symbol(0x1010, 0x10, "inner"))
    assert t.lookup(0x1018) == ("inner", 8)
    assert t.lookup(0x1030) == ("outer", 0x30)


def test_empty_table() -> None:
    t = table()
    assert t.lookup(0x1000) is None and t.lookup(0x1000, lenient=True) is None
    assert t.items() == []


def test_names_are_demangled_at_load() -> None:
    t = table(
        Symbol(0x1000, 0x10, "_ZN3foo3barEi"), Symbol(0x2000, 0x10, "_RNvCs1234_7mycrate3foo")
    )
    assert t.lookup(0x1000) == ("foo::bar(int)", 0)
    assert t.address_of("mycrate::foo") == 0x2000
    raw = SymbolTable([Symbol(0x1000, 0x10, "_ZN3foo3barEi")], demangle=False)
    assert raw.lookup(0x1000) == ("_ZN3foo3barEi", 0)


@pytest.mark.parametrize(
    ("mangled", "readable"),
    [
        ("_ZN3foo3barEi", "foo::bar(int)"),
        (
            "_ZNSt6vectorIiSaIiEE9push_backERKi",
            "std::vector<int, std::allocator<int> >::push_back(int const&)",
        ),
        ("_Z4workv.cold", "work() [clone .cold]"),
        ("main", "main"),
        ("_Znot_really_mangled", "_Znot_really_mangled"),
        ("_ZN4core3ptr13drop_in_place17h0123456789abcdefE", "core::ptr::drop_in_place"),
        (
            "_ZN66_$LT$alloc..vec..Vec$LT$T$GT$$u20$as$u20$core..ops..drop..Drop$GT$4drop"
            "17h0123456789abcdefE",
            "<alloc::vec::Vec<T> as core::ops::drop::Drop>::drop",
        ),
        ("_RNvCs1234_7mycrate3foo", "mycrate::foo"),
        ("_RNvNtCs1234_7mycrate3bar3baz", "mycrate::bar::baz"),
        ("_RNCNvCs1_5crate4mains_0", "crate::main::{closure#1}"),
        ("_RINvCs1_5crate4workpE", "_RINvCs1_5crate4workpE"),  # generics: left mangled
    ],
)
def test_demangle(mangled: str, readable: str) -> None:
    assert demangle_all([mangled]) == [readable]


def test_rust_decoders_reject_what_they_do_not_understand() -> None:
    assert rust_legacy("_ZN3foo3barE") is None  # no hash: C++, not Rust
    assert rust_legacy("_ZN3f$oo3bar17h0123456789abcdefE") is None  # unterminated escape
    assert rust_v0("_RNvCs1234_7mycrate99foo") is None  # truncated identifier
    assert rust_v0("_RNvCs1234_7mycrateu3foo") is None  # punycode
