"""Pure code of the GDB remote serial protocol as QEMU 7.2's gdbstubs speak it: packet framing
(checksum, escaping, run-length encoding), thread lists, the target description's architecture.
(The ``g`` register layouts are the target's: ``qmpprof.arch`` reads them.)

No I/O here: ``qmpprof.transport.gdb`` does the talking and hands the packets over.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from zlib import adler32

from qmpprof.errors import TransportError

_SLICE = 256  # bytes summed by one Adler-32 (checksum)
_ESCAPED = frozenset(b"$#}*")


def checksum(body: bytes) -> int:
    """The packet checksum: the sum of the body's bytes modulo 256.

    Summed by zlib's Adler-32 over 256-byte slices: its low half is 1 + the slice's byte sum
    modulo 65521, which a slice of 256 bytes (at most 65 280) never reaches. Four times as fast
    as ``sum(body)`` on a 4 KiB memory reply (9 against 37 us here), and every sample checks
    several."""
    view = memoryview(body)
    total = 0
    for start in range(0, len(body), _SLICE):
        total += (adler32(view[start : start + _SLICE]) & 0xFFFF) - 1
    return total & 0xFF


def encode_packet(body: bytes) -> bytes:
    """Frame ``body`` as ``$body#cs``, escaping the bytes the framing reserves."""
    if _ESCAPED.intersection(body):
        out = bytearray()
        for b in body:
            if b in _ESCAPED:
                out += bytes((0x7D, b ^ 0x20))
            else:
                out.append(b)
        body = bytes(out)
    return b"$" + body + b"#%02x" % checksum(body)


def decode_body(data: bytes) -> bytes:
    """Undo the escaping (``}`` + byte^0x20) and run-length encoding (``X*n``) of a packet body.

    A run ``X*n`` stands for X followed by ``ord(n) - 29`` more copies of X.
    """
    if b"}" not in data and b"*" not in data:
        return data
    out = bytearray()
    i = 0
    while i < len(data):
        b = data[i]
        if b == 0x7D and i + 1 < len(data):
            out.append(data[i + 1] ^ 0x20)
            i += 2
        elif b == 0x2A and out and i + 1 < len(data):
            out += bytes((out[-1],)) * (data[i + 1] - 29)
            i += 2
        else:
            out.append(b)
            i += 1
    return bytes(out)


def parse_thread_ids(reply: bytes) -> dict[int, bytes]:
    """Thread ids of one ``qfThreadInfo``/``qsThreadInfo`` reply (``m1,2`` or ``l``), each
    mapped to the spelling ``Hg`` takes back.

    A stub that once talked to a gdb announcing ``multiprocess+`` keeps spelling ids ``pPID.TID``
    (QEMU never resets it), so both forms are read.
    """
    if not reply.startswith(b"m"):
        return {}
    ids: dict[int, bytes] = {}
    for token in reply[1:].split(b","):
        try:
            ids[int(token.rpartition(b".")[2].removeprefix(b"p"), 16)] = token
        except ValueError as err:
            raise TransportError(f"malformed thread list from the gdbstub: {reply!r}") from err
    return ids


def is_stop_reply(reply: bytes) -> bool:
    """A stop reply (T/S) or an exit notice (W/X): the stub's word that the guest stopped."""
    return reply[:1] in (b"T", b"S", b"W", b"X")


_ARCHITECTURE = re.compile(r"<architecture>\s*([^<\s]+)\s*</architecture>")


def architecture(target_xml: str) -> str | None:
    """The ``<architecture>`` a target description names (``i386:x86-64``), None if none."""
    found = _ARCHITECTURE.search(target_xml)
    return None if found is None else found[1]


_INCLUDE = re.compile(r'<xi:include\s+href="([^"]+)"')


def includes(target_xml: str) -> list[str]:
    """The annexes a target description includes (``system-registers.xml``), in order."""
    return _INCLUDE.findall(target_xml)


_REG = re.compile(r"<reg\s[^>]*>")
_NAME = re.compile(r'\bname="([^"]+)"')
_REGNUM = re.compile(r'\bregnum="(\d+)"')


def numbered(features: Sequence[str | None]) -> dict[str, int]:
    """Every register of a target's features (its included annexes, in their order; None for
    one that did not read) by name, numbered as gdb numbers them for ``p``: in order from 0,
    each ``regnum`` setting the number of its register and of those after it. After a feature
    that did not read, a register without ``regnum`` has no known number until one sets it
    (riscv64's ``priv``, the one register of riscv-64bit-virtual.xml, is known only by its
    place: after the core's 33 and the FPU's 32 on QEMU 7.2, number 65)."""
    out: dict[str, int] = {}
    number: int | None = 0
    for feature in features:
        if feature is None:
            number = None
            continue
        for reg in _REG.findall(feature):
            name, regnum = _NAME.search(reg), _REGNUM.search(reg)
            if regnum is not None:
                number = int(regnum[1])
            if name is not None and number is not None:
                out[name[1]] = number
            if number is not None:
                number += 1
    return out
