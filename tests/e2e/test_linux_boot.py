"""The Linux test guest (scripts/build-linux-guest, scripts/run-linux-guest) boots every kernel
on 2 vCPUs with KASLR (6.12 also without): the workload runs, the guest's /proc/kallsyms comes
over COM2 whole (module symbols included), and QEMU reports the VM running over QMP. That
every kernel boots with its module, xz and the churn workload is tests/e2e/test_linux_churn.py's
(it shares that guest)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from guestvm import free_tcp_port
from linuxvm import (
    MODULE,
    LinuxGuest,
    running_linux_guest,
)
from sharedlinux import Shared

from qmpprof.transport.qmp import QmpTransport

IMAGE_TEXT = 0xFFFFFFFF81000000  # _text in Debian's vmlinux (its first LOAD)
MODULE_FUNCTIONS = (
    "qb_read",
    "qb_burn_outer",
    "qb_burn_middle",
    "qb_burn_leaf",
    "qb_kwork_fn",
    "qb_kwork_tick",
    "qb_kwork_leaf",
)


@pytest.mark.linux
async def test_boots_without_kaslr_with_workload_and_kallsyms(nokaslr_linux: Shared) -> None:
    await check_booted(nokaslr_linux.guest, kaslr=False)


@pytest.mark.linux
async def test_boots_with_kaslr_workload_and_kallsyms(kaslr_linux: Shared) -> None:
    await check_booted(kaslr_linux.guest, kaslr=True)


async def check_booted(guest: LinuxGuest, *, kaslr: bool) -> None:
    """Running on both vCPUs, the module loaded, the guest's kallsyms placed as KASLR says."""
    transport = await QmpTransport.connect(guest.qmp_socket)
    try:
        assert await transport.status() == "running"
        assert await transport.cpus() == [0, 1]
    finally:
        await transport.close()
    # Debian's kernel takes the unsigned out-of-tree module: taint O (4096) + E (8192).
    assert "qmpprof-linux: tainted 12288" in guest.console_text()
    symbols = guest.symbols
    text = symbols.address_of("_text")
    assert text == guest.text_address
    assert (text == IMAGE_TEXT) is not kaslr
    assert (text - IMAGE_TEXT) % (2 << 20) == 0
    assert len(symbols) > 90_000  # 94 000 (6.1) to 199 000 (7.2) and the module's
    for name in MODULE_FUNCTIONS:
        addr = symbols.address_of(name, MODULE)
        assert addr is not None and guest.module_address <= addr < guest.module_address + (
            1 << 20
        ), name
    assert symbols.address_of("qb_read") is None  # only as a module symbol
    kinds = {m for m in symbols.modules if m is not None}
    assert kinds == {MODULE}


@pytest.mark.qemu
@pytest.mark.linux
async def test_boots_without_the_kallsyms_dump_with_gdbstub(tmp_path: Path) -> None:
    port = free_tcp_port()
    with running_linux_guest(tmp_path, dump_kallsyms=False, gdb_port=port) as guest:
        assert "qmpprof-linux: tainted 12288" in guest.console_text()
        assert not guest.kallsyms.exists()
        assert "qmpprof-linux: kallsyms" not in guest.console_text()
        gdb = subprocess.run(
            ["gdb", "-batch", "-nx", "-ex", "set architecture i386:x86-64",
             "-ex", f"target remote 127.0.0.1:{port}", "-ex", "info threads", "-ex", "detach"],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert "CPU#0" in gdb.stdout and "CPU#1" in gdb.stdout, gdb.stdout + gdb.stderr
        transport = await QmpTransport.connect(guest.qmp_socket)
        try:
            assert await transport.status() == "running"  # gdb's detach resumes the guest
        finally:
            await transport.close()
