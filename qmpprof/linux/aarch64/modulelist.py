"""Where an arm64 kernel links its list of loaded modules (``modules``, a ``struct list_head``),
from its own code when kallsyms names no data symbol (bookworm's 6.1).

``find_module_all`` walks that list first thing (``list_for_each_entry_rcu(mod, &modules,
list)``): it makes the head's address in a register, loads the first entry's link from it and
compares the two, the loop's end test. gcc makes the address from an anchor of its section,
``adrp``/``add`` then a pre-indexed load that moves the register onto the head:

    adrp x21, <anchor page>
    add  x21, x21, #0x9c0        ; the anchor
    ldr  x0, [x21, #80]!         ; x21 = &modules, x0 = modules.next
    cmp  x0, x21                 ; the end of the list?

(without an anchor, ``ldr x0, [x21]``). Read so on 6.1.0-56 (0xffff800009d5ca10, the -dbg
vmlinux's ``modules``) and on 6.12.117, where kallsyms' own ``modules`` agrees.
"""

from __future__ import annotations

from qmpprof.arch.aarch64code import add_imm, adrp_page, is_adrp, signed
from qmpprof.elf.image import ElfImage
from qmpprof.linux.symbols import KernelSymbols

_WALKERS = ("find_module_all",)
_SCAN = 0x60  # bytes of it searched: the test sits ~0x30 in (6.1, 6.12)
_MASK = (1 << 64) - 1


def module_list(image: ElfImage, symbols: KernelSymbols) -> int | None:
    """The link address of ``modules``, read from the code of a function walking it; None if
    no such function compares a list head with the link loaded from it."""
    for name in _WALKERS:
        start = symbols.address_of(name)
        at = None if start is None else start - image.text_addr
        if start is None or at is None or at < 0:
            continue
        found = list_head(image.text_bytes[at : at + _SCAN], start)
        if found is not None:
            return found
    return None


def list_head(code: bytes, addr: int) -> int | None:
    """In ``code`` at ``addr``: the address ``adrp``/``add`` (and a load's pre-index) made in a
    register that is compared with a value loaded from that very address (``ldr xD, [xA]`` or
    ``[xA, #imm]!``, then ``cmp xD, xA``); None if there is no such sequence."""
    made: dict[int, int] = {}  # register -> the address made in it
    loaded: dict[int, int] = {}  # register -> the address its value was loaded from
    for i in range(0, len(code) - 3, 4):
        insn = int.from_bytes(code[i : i + 4], "little")
        rd, rn, rm = insn & 0x1F, (insn >> 5) & 0x1F, (insn >> 16) & 0x1F
        if is_adrp(insn):
            made[rd] = adrp_page(insn, addr + i)
        elif insn & 0xFF80_0000 == 0x9100_0000 and rn in made:  # ADD (immediate), 64-bit
            made[rd] = (made[rn] + add_imm(insn)) & _MASK
        elif insn & 0xFFC0_0000 == 0xF940_0000 and rn in made and insn >> 10 & 0xFFF == 0:
            loaded[rd] = made[rn]  # LDR Xt, [Xn] (unsigned offset 0)
        elif insn & 0xFFE0_0C00 == 0xF840_0C00 and rn in made:  # LDR Xt, [Xn, #simm9]!
            made[rn] = (made[rn] + signed((insn >> 12) & 0x1FF, 9)) & _MASK
            loaded[rd] = made[rn]
        elif insn & 0xFFE0_FC1F == 0xEB00_001F:  # CMP Xn, Xm (SUBS XZR, shifted, LSL #0)
            if rm in made and loaded.get(rn) == made[rm]:
                return made[rm]
            if rn in made and loaded.get(rm) == made[rn]:
                return made[rn]
        elif rd in made or rd in loaded:  # anything else writing a register forgets it
            made.pop(rd, None)
            loaded.pop(rd, None)
    return None
