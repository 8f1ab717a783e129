"""The i386 builds of the bundled guest booted under qemu-system-i386 and under
qemu-system-x86_64: what each binary's HMP and gdbstub say about a 32-bit guest's registers
(docs/i386.md), that every process has an address space (CR3) of its own, with or without PAE,
and that gdb -- the oracle of the later stack comparisons -- unwinds them through int 0x80 and
interrupts into user code under both binaries.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from guestelf import I386_BOUNDARY, I386_EXPECTED, I386_VARIANTS, sized_symbols
from guestvm import (
    WORKLOAD_LINE,
    Guest,
    expected,
    free_tcp_port,
    gdb_stack,
    process_cr3s,
    running_guest,
    section,
)
from qemu.qmp import QMPClient
from qemumark import boots_qemu
from support.gdbi386 import I386GdbProxy, i386_registers

from qmpprof.transport.gdbpackets import encode_packet

BINARIES = I386_EXPECTED["qemu"]
USER_TAIL = ["main", I386_EXPECTED["outermost"]["user"]]
UCODE_CS, KCODE_CS = 0x23, 0x08
# struct regs (kernel.h, i386): the pointer interrupt_dispatch gets; eip and cs offsets in it.
REGS_EIP, REGS_CS = 36, 40


# ---- QEMU: one boot per build and binary ------------------------------------------------------

BOOTS = [(variant, qemu) for variant in I386_VARIANTS for qemu in BINARIES]
CR0_PG, CR4_PAE = 1 << 31, 1 << 5


@pytest.fixture(scope="module", params=BOOTS, ids=[f"{v}-{q}" for v, q in BOOTS])
@boots_qemu
def booted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Guest]:
    variant, qemu = request.param
    with running_guest(
        tmp_path_factory.mktemp(variant), variant, gdb_port=free_tcp_port(), qemu=qemu
    ) as guest:
        yield guest


def test_console_shows_the_workload(booted: Guest) -> None:
    text = booted.console_text()
    assert f"({booted.variant} build)" in text
    assert f"protected mode, higher half at 0x{I386_BOUNDARY >> 28:x}" in text
    assert WORKLOAD_LINE in text


async def test_every_process_has_its_own_address_space(booted: Guest) -> None:
    """Paging as expected.json says for the build (CR4.PAE, how CR3 is aligned), one CR3 per
    process, the CPU in ring 3 under each of them and in ring 0 under the kernel's own."""
    want = expected(booted.variant)
    processes = process_cr3s(booted)
    pids = {pid: name for name, spec in want["programs"].items() for pid in spec["pids"]}
    assert {pid: name for pid, (name, _) in processes.items()} == pids
    cr3s = {cr3 for _, cr3 in processes.values()}
    assert len(cr3s) == len(processes)
    qmp = QMPClient("i386-cr3")
    await qmp.connect(str(booted.qmp_socket))
    seen: set[tuple[int, int]] = set()  # (CPL, CR3)
    try:
        for _ in range(400):
            await qmp.execute("stop")
            text = await qmp.execute("human-monitor-command", {"command-line": "info registers"})
            await qmp.execute("cont")
            assert isinstance(text, str)
            fields = dict(re.findall(r"\b(CPL|CR0|CR3|CR4)=([0-9a-f]+)\b", text))
            cr0, cr3, cr4 = (int(fields[name], 16) for name in ("CR0", "CR3", "CR4"))
            assert cr0 & CR0_PG and bool(cr4 & CR4_PAE) == want["pae"], (hex(cr0), hex(cr4))
            seen.add((int(fields["CPL"]), cr3))
            kernel = {c for cpl, c in seen if cpl == 0} - cr3s
            if {(3, cr3) for cr3 in cr3s} <= seen and kernel:
                break
            await asyncio.sleep(0.005)
    finally:
        await qmp.disconnect()
    assert {(3, cr3) for cr3 in cr3s} <= seen, (sorted(cr3s), sorted(seen))
    assert {c for cpl, c in seen if cpl == 3} == cr3s  # ring 3 only in the processes
    (kernel_cr3,) = {c for _, c in seen} - cr3s  # the kernel thread's (and idle's)
    roots = [kernel_cr3, *cr3s]
    assert all(cr3 % want["cr3_alignment"] == 0 for cr3 in roots), [hex(c) for c in roots]
    if want["cr3_same_page"]:
        # PAE: 32-byte PDPTs in one page, so only bits 5..11 tell the address spaces apart.
        assert len({cr3 >> 12 for cr3 in roots}) == 1 and all(cr3 & 0xFFF for cr3 in roots)


async def test_hmp_prints_32_bit_registers_under_both_binaries(booted: Guest) -> None:
    """Outside long mode both binaries print EAX=... EIP=... EFL=... (docs/i386.md)."""
    qmp = QMPClient("i386-test")
    await qmp.connect(str(booted.qmp_socket))
    try:
        await qmp.execute("stop")
        text = await qmp.execute("human-monitor-command", {"command-line": "info registers"})
        await qmp.execute("cont")
    finally:
        await qmp.disconnect()
    assert isinstance(text, str)
    for field in ("EAX", "ESP", "EBP", "EIP", "EFL"):
        assert re.search(rf"\b{field}=[0-9a-f]{{8}}\b", text), field
    assert "RIP=" not in text and "RAX=" not in text
    assert re.search(r"CPL=[03]\b", text)
    assert re.search(r"\bCR3=[0-9a-f]{8}\b", text)
    width = 16 if booted.qemu == "qemu-system-x86_64" else 8
    assert re.search(rf"\bDR7=[0-9a-f]{{{width}}}\b", text)


_PACKET = re.compile(rb"\$([^#]*)#[0-9a-f]{2}")


def _stub_exchange(port: int, packets: list[bytes]) -> list[bytes]:
    """Send each packet to the gdbstub and collect one reply each. QEMU stops the guest on
    connection and reports it (T02); the reply to ``?`` (T05) starts the exchange, ``D``
    detaches and lets the guest run again."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        buffer = b""

        def reply() -> bytes:
            nonlocal buffer
            while (m := _PACKET.search(buffer)) is None:
                buffer += s.recv(65536)
            buffer = buffer[m.end() :]
            s.sendall(b"+")
            return m.group(1)

        s.sendall(encode_packet(b"?"))
        while not reply().startswith(b"T05"):
            pass
        replies = []
        for packet in packets:
            s.sendall(encode_packet(packet))
            replies.append(reply())
        s.sendall(encode_packet(b"D"))
        reply()
    return replies


def test_gdbstub_register_layout_of_each_binary(booted: Guest) -> None:
    """qemu-system-i386 sends 344 bytes (i386 layout); qemu-system-x86_64 its 608-byte x86_64
    layout even for a 32-bit guest, and calls itself i386:x86-64 (docs/i386.md)."""
    assert booted.gdb_port is not None
    target_xml = b"qXfer:features:read:target.xml:0,fff"
    g, xml = _stub_exchange(booted.gdb_port, [b"g", target_xml])
    raw = bytes.fromhex(g.decode())
    if booted.qemu == "qemu-system-x86_64":
        assert len(raw) == 608
        assert b"<architecture>i386:x86-64</architecture>" in xml
        eip, cs = struct.unpack_from("<Q", raw, 128)[0], struct.unpack_from("<I", raw, 140)[0]
        cr3, cr4 = struct.unpack_from("<2Q", raw, 204)
        efer = struct.unpack_from("<Q", raw, 228)[0]
        assert eip < 1 << 32 and not efer & 1 << 10  # EFER.LMA: not in long mode
        # The proxy's rewrite gives the i386 layout's first 16 registers.
        assert len(bytes.fromhex(i386_registers(g).decode())) == 16 * 4 + 8 * 10 + 8 * 4
    else:
        assert len(raw) == 344
        assert b"<architecture>i386</architecture>" in xml
        eip, cs = struct.unpack_from("<2I", raw, 32)[0], struct.unpack_from("<I", raw, 40)[0]
        cr3, cr4 = struct.unpack_from("<2I", raw, 84)
    # The whole CR3: a PAE one keeps bits 5..11 (expected.json cr3_alignment, cr3_same_page).
    want = expected(booted.variant)
    assert cr3 and cr3 % want["cr3_alignment"] == 0 and bool(cr3 & 0xFFF) == want["cr3_same_page"]
    assert bool(cr4 & CR4_PAE) == want["pae"]
    assert cs in (UCODE_CS, KCODE_CS)
    assert (eip >= I386_BOUNDARY) == (cs == KCODE_CS)


@pytest.mark.qemu
@pytest.mark.parametrize(("variant", "qemu"), BOOTS, ids=[f"{v}-{q}" for v, q in BOOTS])
async def test_two_vcpus_come_up_and_run_user_code(tmp_path: Path, variant: str, qemu: str) -> None:
    """SMP: the AP leaves the trampoline in protected mode (PAE on in the i386-pae build) and
    schedules tasks too."""
    with running_guest(tmp_path, variant, 2, qemu=qemu) as guest:
        assert "2 cpu(s) online" in guest.console_text()
        qmp = QMPClient("i386-smp")
        await qmp.connect(str(guest.qmp_socket))
        try:
            seen: set[tuple[int, int]] = set()
            cr4s: set[tuple[int, int]] = set()
            for _ in range(200):
                await qmp.execute("stop")
                command = {"command-line": "info registers -a"}
                text = await qmp.execute("human-monitor-command", command)
                await qmp.execute("cont")
                assert isinstance(text, str)
                for cpu, cpl in re.findall(r"CPU#(\d+)\r?\n(?:.*\n){2}.*CPL=(\d)", text):
                    seen.add((int(cpu), int(cpl)))
                cr4s.update(enumerate(int(cr4, 16) for cr4 in re.findall(r"\bCR4=(\w+)", text)))
                if {(0, 3), (1, 3)} <= seen:
                    break
                await asyncio.sleep(0.01)
        finally:
            await qmp.disconnect()
    assert {(0, 3), (1, 3)} <= seen, seen
    pae = expected(variant)["pae"]
    assert {cpu for cpu, _ in cr4s} == {0, 1}
    assert all(bool(cr4 & CR4_PAE) == pae for _, cr4 in cr4s), cr4s


# ---- gdb, the oracle ------------------------------------------------------------------------


@contextlib.contextmanager
def gdb_view(guest: Guest) -> Iterator[Guest]:
    """The guest as gdb should reach it: through I386GdbProxy, which translates the registers
    under qemu-system-x86_64 and, under both binaries, keeps the stop packet QEMU may send on
    connection (after an earlier client detached from a running guest) away from gdb."""
    assert guest.gdb_port is not None
    translate = guest.qemu == "qemu-system-x86_64"
    with I386GdbProxy(guest.gdb_port, translate=translate) as proxy:
        yield dataclasses.replace(guest, gdb_port=proxy.port)


def _running(guest: Guest, program: str) -> str:
    """A gdb condition true only while ``program`` is the current process: a word of .text
    where the user programs (all linked at one address) differ."""
    texts = {}
    for name in I386_EXPECTED["programs"]:
        with guest.user_elf(name).open("rb") as f:
            text = section(ELFFile(f), ".text")
            texts[name] = (text["sh_addr"], text.data())
    address, mine = texts[program]
    others = [data for name, (_, data) in texts.items() if name != program]
    for offset in range(0, len(mine) - 3, 4):
        word = mine[offset : offset + 4]
        if all(other[offset : offset + 4] != word for other in others):
            return f"*(unsigned int *){address + offset:#x} == {struct.unpack('<I', word)[0]:#x}"
    raise AssertionError(f"{program}'s .text equals another program's")


def _interrupted(cs: int, extra: str = "") -> str:
    """At *interrupt_dispatch: the interrupted code ran with ``cs`` (and ``extra`` holds)."""
    regs = "*(unsigned int *)($esp + 4)"
    condition = f"*(unsigned int *)({regs} + {REGS_CS}) == {cs:#x}"
    return condition + (f" && {extra}" if extra else "")


def test_gdb_unwinds_the_syscall_path_into_user_code(booted: Guest) -> None:
    with gdb_view(booted) as guest:
        stack = gdb_stack(
            guest,
            guest.user_elf("sys"),
            breakpoint=I386_EXPECTED["syscall_path"][-1],
            architecture="i386",
        )
    assert stack.names == [*reversed(I386_EXPECTED["syscall_path"]), "sys_call_kernel", *USER_TAIL]
    kernel = [pc >= I386_BOUNDARY for pc, _ in stack.frames]
    assert kernel == [name in I386_EXPECTED["syscall_path"] for name in stack.names]


def test_gdb_unwinds_a_timer_interrupt_into_user_code(booted: Guest) -> None:
    with gdb_view(booted) as guest:
        stack = gdb_stack(
            guest,
            guest.user_elf("spin"),
            breakpoint="*interrupt_dispatch",
            condition=_interrupted(UCODE_CS, _running(guest, "spin")),
            architecture="i386",
        )
    valid = [s[i:] for s in I386_EXPECTED["programs"]["spin"]["stacks"] for i in range(len(s))]
    assert stack.names[:2] == ["interrupt_dispatch", "isr_common"], stack.names
    assert stack.names[2:] in valid, stack.names
    assert all(pc < I386_BOUNDARY for pc, _ in stack.frames[2:])


def test_gdb_unwinds_a_timer_interrupt_of_the_kernel_thread(booted: Guest) -> None:
    """Interrupted in ring 0 the CPU pushes no esp: the CFI's esp rule must take the other arm."""
    leaf_start, leaf_size = sized_symbols(booted.kernel_elf)["checksum_leaf"]
    eip = f"*(unsigned int *)(*(unsigned int *)($esp + 4) + {REGS_EIP})"
    in_leaf = f"{eip} >= {leaf_start:#x} && {eip} < {leaf_start + leaf_size:#x}"
    with gdb_view(booted) as guest:
        stack = gdb_stack(
            guest,
            None,
            breakpoint="*interrupt_dispatch",
            condition=_interrupted(KCODE_CS, in_leaf),
            architecture="i386",
        )
    assert stack.names[:2] == ["interrupt_dispatch", "isr_common"], stack.names
    assert stack.names[2:] in I386_EXPECTED["kernel_threads"]["kworker"]["stacks"], stack.names
