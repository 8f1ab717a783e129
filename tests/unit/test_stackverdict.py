"""The gdb oracle's verdicts on hand-built stacks (tests/stackverdict.py): what is equal, what
each allowance lets pass, and what stays a difference; how the oracle tests count them
(tests/gdbmoments.py): an allowed stack is not an equal one, each kind capped."""

from __future__ import annotations

import struct

from gdbmoments import Tally
from linuxgdb import GdbFrame, GdbStack
from stackverdict import KINDS, NO_TAILCALL, STOPS_EARLY, WALKS_ON, Verdict, judge

# Functions at 0x1000-byte steps; frames' pcs inside them.
LEAF, CALLEE, JUMPER, CALLER, ENTRY = 0x1010, 0x2020, 0x3030, 0x4040, 0x5050


def start(addr: int) -> int:
    return addr & ~0xFFF


def stack(*frames: tuple[int, str], stop: str = "entry", log: tuple[str, ...] = ()) -> GdbStack:
    return GdbStack(tuple(GdbFrame(pc, kind, f"f{pc:x}", b"") for pc, kind in frames), stop, log)


def normal(*pcs: int, stop: str = "entry", log: tuple[str, ...] = ()) -> GdbStack:
    return stack(*((pc, "normal") for pc in pcs), stop=stop, log=log)


def test_the_same_frames_down_to_the_entry_are_equal() -> None:
    verdict = judge(normal(LEAF, CALLER, ENTRY), [LEAF, CALLER, ENTRY, 0x6000], True, start)
    assert verdict == Verdict() and verdict.equal


def test_gdbs_tail_call_frames_count() -> None:
    gdb = stack((LEAF, "normal"), (JUMPER, "tailcall"), (CALLER, "normal"), (ENTRY, "normal"))
    assert judge(gdb, [LEAF, JUMPER, CALLER, ENTRY], True, start).equal
    lacking = judge(gdb, [LEAF, CALLER, ENTRY], True, start)
    assert not lacking.agrees and "lacks gdb's frame 1" in (lacking.difference or "")


def test_another_return_address_differs() -> None:
    assert not judge(normal(LEAF, CALLER, ENTRY), [LEAF, CALLEE, ENTRY], True, start).agrees


def test_gdb_stopping_early_is_allowed_where_qmpprof_goes_on() -> None:
    gdb = normal(LEAF, CALLER, stop="outermost: memory error while unwinding")
    verdict = judge(gdb, [LEAF, CALLER, ENTRY], True, start)
    assert verdict.agrees and not verdict.equal
    assert verdict.allowances == (
        f"gdb stops at f{CALLER:x}: outermost: memory error while unwinding",
    )
    # Both stopping at the same frame is no allowance: nothing went unreached.
    assert judge(gdb, [LEAF, CALLER], True, start).equal


def test_gdb_walking_past_qmpprofs_end_is_allowed_only_when_the_walk_ended() -> None:
    gdb = normal(LEAF, CALLER, 0xFFFF_0000, stop="user")
    assert judge(gdb, [LEAF, CALLER], True, start).allowances == (f"gdb walks on past f{CALLER:x}",)
    assert not judge(gdb, [LEAF, CALLER], False, start).agrees  # truncated: a difference


def test_a_tail_call_frame_gdb_says_it_cannot_make() -> None:
    gdb = normal(
        LEAF, CALLER, ENTRY, log=(f"DW_AT_call_target is not specified at {CALLER:#x} in f",)
    )
    verdict = judge(gdb, [LEAF, JUMPER, CALLER, ENTRY], True, start)
    assert verdict.agrees and verdict.allowances[0].startswith("gdb cannot make a tail-call frame")
    # The jump site on the path (the added frame's pc) counts as well.
    on_path = (f"DW_OP_entry_value resolving cannot find DW_TAG_call_site {JUMPER:#x} in f",)
    assert judge(normal(LEAF, CALLER, ENTRY, log=on_path), [LEAF, JUMPER, CALLER, ENTRY], True,
                 start).agrees  # fmt: skip
    # Unexplained, or explained for another caller: a difference.
    assert not judge(normal(LEAF, CALLER, ENTRY), [LEAF, JUMPER, CALLER, ENTRY], True, start).agrees
    other = (f"DW_AT_call_target is not specified at {ENTRY:#x} in f",)
    assert not judge(normal(LEAF, CALLER, ENTRY, log=other), [LEAF, JUMPER, CALLER, ENTRY], True,
                     start).agrees  # fmt: skip


def test_a_function_without_dwarf_on_the_path() -> None:
    """gdb names the function it found no DWARF for: the call's target (read from the code
    before the caller's return address) or the function of an added frame."""
    call = b"\x90\x90\x90\xe8" + struct.pack("<i", start(JUMPER) - CALLER)
    said = f"DW_TAG_call_site resolving failed to find function name for address {start(JUMPER):#x}"
    gdb = GdbStack(
        (GdbFrame(LEAF, "normal", "leaf", b""), GdbFrame(CALLER, "normal", "caller", call),
         GdbFrame(ENTRY, "normal", "entry", b"")),
        "entry",
        (said,),
    )  # fmt: skip
    assert judge(gdb, [LEAF, JUMPER, CALLER, ENTRY], True, start).agrees


def test_each_allowance_has_its_kind() -> None:
    early = judge(normal(LEAF, CALLER, stop="outermost"), [LEAF, CALLER, ENTRY], True, start)
    past = judge(normal(LEAF, CALLER, 0xFFFF_0000, stop="user"), [LEAF, CALLER], True, start)
    log = (f"DW_AT_call_target is not specified at {CALLER:#x} in f",)
    jump = judge(normal(LEAF, CALLER, ENTRY, log=log), [LEAF, JUMPER, CALLER, ENTRY], True, start)
    assert (early.kinds, past.kinds, jump.kinds) == ({STOPS_EARLY}, {WALKS_ON}, {NO_TAILCALL})
    assert judge(normal(LEAF, CALLER, ENTRY), [LEAF, CALLER, ENTRY], True, start).kinds == set()


def test_an_allowed_stack_is_not_an_agreeing_one_and_each_kind_has_its_ceiling() -> None:
    """100 moments, 200 stacks: 190 equal, 3 different, 7 allowed (5 of them gdb stopping
    early): 190 of the 193 compared whole agree, and 5 stops early pass a ceiling of 2 %."""
    tally = Tally(moments=100, stacks=200, equal=190, allowed_stacks=7)
    tally.differences = ["a", "b", "c"]
    tally.kinds.update({STOPS_EARLY: 5, WALKS_ON: 2})
    assert tally.judged == 193 and tally.agreeing == 190 / 193
    ceilings = dict.fromkeys(KINDS, 0.02)
    assert tally.beyond(ceilings) == {STOPS_EARLY: 5}
    assert tally.beyond({**ceilings, STOPS_EARLY: 0.05}) == {}
