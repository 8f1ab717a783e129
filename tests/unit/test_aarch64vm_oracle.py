"""The aarch64 end-to-end tests' oracle: where the guest's kallsyms must name each frame of a
one-shot's JSON stack (aarch64vm.named_at), and which frames are the exception code entered
from user mode, where a kernel stack ends (aarch64vm.from_user_entry, past_user_entry). Stacks
as the 6.1 and 6.12 guests gave them."""

from __future__ import annotations

from aarch64vm import TextSymbols, from_user_entry, named_at, past_user_entry

from qmpprof.linux.symbols import parse_symbol_map

KALLSYMS = """\
ffff800008010800 T vectors
ffff8000080110a0 t el1h_64_irq
ffff800008011500 t el0t_64_sync
ffff80000838b800 T __fdget_raw
ffff80000838b870 T __fdget_pos
ffff80000838b900 T ksys_write
ffff80000838c000 T cpu_weight_nice_read_s64
ffff80000838c040 t arch_local_irq_disable
ffff80000838c060 t __schedule
ffff80000838c400 T jumper
ffff80000838c420 T jumped_to
"""
TEXT = TextSymbols(parse_symbol_map(KALLSYMS))


def frame(addr: int, symbol: str, offset: int, tail_call: bool = False) -> dict[str, object]:
    return {"address": f"{addr:#x}", "symbol": symbol, "offset": offset, "tail_call": tail_call}


def named(frames: list[dict[str, object]]) -> list[set[str]]:
    return [TEXT.names_at(named_at(frames, i)) for i in range(len(frames))]


def test_code_interrupted_at_a_functions_first_instruction_is_named_at_its_pc() -> None:
    # Caught at the IRQ vector from the kernel: ELR_EL1 is __fdget_pos's first instruction; at
    # its address - 1 the guest names __fdget_raw.
    frames = [
        frame(0xFFFF800008010A80, "vectors", 0x280),
        frame(0xFFFF80000838B870, "__fdget_pos", 0),
        frame(0xFFFF80000838B938, "ksys_write", 0x38),
        frame(0xFFFF80000801168C, "el0t_64_sync", 0x18C),
    ]
    assert named(frames) == [{"vectors"}, {"__fdget_pos"}, {"ksys_write"}, {"el0t_64_sync"}]
    # Under el1h_64_irq the same: the arch_local_irq_disable+0, not the function
    # before it.
    frames = [
        frame(0xFFFF800008011104, "el1h_64_irq", 0x64),
        frame(0xFFFF80000838C040, "arch_local_irq_disable", 0),
        frame(0xFFFF80000838C100, "__schedule", 0xA0),
    ]
    assert named(frames) == [{"el1h_64_irq"}, {"arch_local_irq_disable"}, {"__schedule"}]


def test_a_return_address_after_a_call_ending_a_function_is_named_at_the_call() -> None:
    frames = [
        frame(0xFFFF80000838C044, "arch_local_irq_disable", 4),
        frame(0xFFFF80000838C040, "cpu_weight_nice_read_s64", 0x40),
    ]
    assert named(frames) == [{"arch_local_irq_disable"}, {"cpu_weight_nice_read_s64"}]


def test_a_tail_call_frame_is_named_at_its_jump() -> None:
    # jumper ends in "b jumped_to": its frame's address is after the jump, jumped_to's start.
    frames = [
        frame(0xFFFF80000838C424, "jumped_to", 4),
        frame(0xFFFF80000838C420, "jumper", 0x20, tail_call=True),
        frame(0xFFFF80000838C100, "__schedule", 0xA0),
    ]
    assert named(frames) == [{"jumped_to"}, {"jumper"}, {"__schedule"}]


# A 6.12 guest's exception code entered from user mode: the table's user half, the IRQ
# handler, the C function it calls and what that calls (issue 35: caught in the C function,
# the stack is that function's frame then its handler's, which the test took for a walk
# going on past the entry).
AT_VECTOR = frame(0xFFFF800080010C80, "vectors", 0x480)
EL0_IRQ = frame(0xFFFF8000800116E8, "el0t_64_irq", 0x190)
IRQ_HANDLER = frame(0xFFFF800080F296A8, "el0t_64_irq_handler", 0x10)
COMMON = frame(0xFFFF800080F28E20, "__el0_irq_handler_common", 0x20)


def test_the_c_function_a_user_mode_handler_calls_is_not_the_entry() -> None:
    assert from_user_entry(AT_VECTOR) and from_user_entry(EL0_IRQ)
    assert from_user_entry(frame(0xFFFF8000800120E8, "ret_to_user", 0))
    assert not from_user_entry(IRQ_HANDLER)
    assert not from_user_entry(frame(0xFFFF800080F295B8, "el0t_64_sync_handler", 0))
    assert not from_user_entry(frame(0xFFFF800080010A80, "vectors", 0x280))  # from the kernel


def test_a_kernel_stack_entered_from_user_mode_ends_at_its_entry() -> None:
    assert not past_user_entry([AT_VECTOR])
    assert not past_user_entry([IRQ_HANDLER, EL0_IRQ])
    assert not past_user_entry([COMMON, IRQ_HANDLER, EL0_IRQ])
    # A walk going on past the entry (into stale words, a previous stack): kernel frames below.
    assert past_user_entry([AT_VECTOR, IRQ_HANDLER])
    assert past_user_entry([IRQ_HANDLER, EL0_IRQ, COMMON])
