"""scripts/bench's sampling methods, each once against the bundled guest: that they sample and
leave the guest running (speed is never asserted here; the arithmetic: tests/unit/test_bench.py)."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
from guestvm import free_tcp_port, running_guest
from support.bench.guest import symbol_address
from support.bench.intervals import serve_pauses
from support.bench.methods import (
    EmeraldHmp,
    FloorQmp,
    GdbBatch,
    GdbMiLoop,
    GdbstubLoop,
    Method,
    run_paced,
)
from support.bench.rawqmp import RawQmp


def _progress(qmp: RawQmp, addr: int) -> int:
    value: int = struct.unpack("<Q", qmp.memsave(addr, 8))[0]
    return value


@pytest.mark.qemu
async def test_every_method_samples_the_guest_and_leaves_it_running(tmp_path: Path) -> None:
    port = free_tcp_port()
    with running_guest(tmp_path, "cfi", 1, gdb_port=port) as guest:
        gdb = f"127.0.0.1:{port}"
        kernel = str(guest.kernel_elf)
        with RawQmp(str(guest.qmp_socket)) as qmp:
            emerald = EmeraldHmp(qmp)
            gdb_loop = GdbMiLoop(gdb, kernel)
            methods: list[Method] = [
                FloorQmp(qmp),
                emerald,
                GdbstubLoop(gdb),
                GdbstubLoop(gdb, fused=True),
                gdb_loop,
                GdbBatch(gdb, kernel),
            ]
            for method in methods:
                await method.setup()
                try:
                    paced = await run_paced(method, 0.002, 10.0, limit=2)
                finally:
                    await method.teardown()
                assert paced.errors == 0, (method.name, paced.details)
                assert len(paced.pauses) == 2 and all(p > 0 for p in paced.pauses), method.name
                assert qmp.running(), f"{method.name} left the guest paused"
            assert emerald.words >= 2  # one HMP round trip per word
            assert gdb_loop.frames >= 2  # gdb printed a backtrace each time
            addr = symbol_address(guest.kernel_elf, "progress_counter")
            first = _progress(qmp, addr)
            deadline = time.monotonic() + 5
            while _progress(qmp, addr) == first:
                assert time.monotonic() < deadline, "the guest makes no progress after the bench"
                time.sleep(0.02)


@pytest.mark.qemu
async def test_serve_as_the_bench_runs_it_samples_and_leaves_the_guest_running(
    tmp_path: Path,
) -> None:
    with running_guest(tmp_path, "cfi", 1) as guest:
        pauses = await serve_pauses(str(guest.qmp_socket), guest.kernel_elf, 2.0)
        assert pauses and all(p > 0 for p in pauses)
        with RawQmp(str(guest.qmp_socket)) as qmp:
            assert qmp.running(), "serve left the guest paused"
