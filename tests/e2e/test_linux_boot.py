"""The Linux test guest (scripts/build-linux-guest, scripts/run-linux-guest) boots every kernel
on 2 vCPUs with KASLR (6.12 also without): the workload runs, the guest's /proc/kallsyms comes
over COM2 whole (module symbols included), and QEMU reports the VM running over QMP; every
kernel fetched (5.10, 6.1, 6.12, 7.x) boots with KASLR, its test module loaded, Debian's xz
running (its /proc/PID/maps on the console) and the churn workload starting processes in each of
its reports (how many a second is scripts/bench's linux_churn_processes_per_s)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from guestvm import free_tcp_port
from linuxkernel import linux_dir
from linuxvm import (
    MODULE,
    ROOT,
    LinuxGuest,
    module_ko,
    running_linux_guest,
    wait_churn,
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


@pytest.mark.qemu
@pytest.mark.linux
async def test_boots_without_kaslr_with_workload_and_kallsyms(tmp_path: Path) -> None:
    with running_linux_guest(tmp_path, kaslr=False, smp=2) as guest:
        await check_booted(guest, kaslr=False)


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


IMAGE_KERNEL_TEXT = 0xFFFFFFFF80000000  # KASLR keeps _text in [this, +1 GiB)
CHURN_TIMEOUT = 120.0  # 15 s of guest time: a guard against a hung guest, not a speed check


@pytest.mark.linux
def test_every_kernel_boots_with_module_xz_and_churn(churn_linux: Shared) -> None:
    guest = churn_linux.guest
    release = (linux_dir(churn_linux.series) / "version").read_text().strip()
    # The first report overlaps the boot: the next two are the workload's own rate.
    rates = wait_churn(guest, 3, CHURN_TIMEOUT)
    console = guest.console_text()
    xz_pid, maps = guest.xz_maps()
    print(f"{release}: boot {guest.boot_seconds:.1f} s, text {guest.text_address:#x}, {rates}")
    # KASLR moved the kernel by a multiple of 2 MiB, within the kernel's 1 GiB.
    assert guest.text_address != IMAGE_TEXT
    assert (guest.text_address - IMAGE_TEXT) % (2 << 20) == 0
    assert IMAGE_KERNEL_TEXT <= guest.text_address < IMAGE_KERNEL_TEXT + (1 << 30)
    # The module built for this kernel loaded, unsigned and out of tree (taint O + E).
    assert module_ko(release).exists()
    assert "insmod failed" not in console, console
    assert guest.module_address >= 0xFFFFFFFFC0000000
    assert "qmpprof-linux: tainted 12288" in console
    # xz runs, its program and liblzma mapped from the initramfs, code executable.
    paths = {m.path for m in maps}
    assert {"/usr/bin/xz", "/lib/x86_64-linux-gnu/liblzma.so.5.4.1"} <= paths, maps
    for path in ("/usr/bin/xz", "/lib/x86_64-linux-gnu/liblzma.so.5.4.1"):
        assert any(m.path == path and m.perms == "r-xp" for m in maps), maps
        assert (ROOT / "fixtures/build/linux-guest/rootfs" / path.lstrip("/")).is_file()
    assert xz_pid > 1
    # The churn workload starts processes all the time: in each report past the boot's.
    assert all(r.processes > 0 and r.seconds > 0 for r in rates[1:3]), rates


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
