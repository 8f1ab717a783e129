"""The Linux test guest (scripts/build-linux-guest, scripts/run-linux-guest) boots Debian's
kernel on 2 vCPUs with and without KASLR: the workload runs, the guest's /proc/kallsyms comes
over COM2 whole (module symbols included), and QEMU reports the VM running over QMP."""

from __future__ import annotations

from pathlib import Path

import pytest
from linuxvm import MODULE, MODULE_KO, WORK_ELF, build_linux_guest, running_linux_guest

from qmpprof.elf.image import ElfImage
from qmpprof.transport.qmp import QmpTransport

pytestmark = [pytest.mark.qemu, pytest.mark.linux]

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


@pytest.mark.parametrize("kaslr", [False, True], ids=["nokaslr", "kaslr"])
async def test_boots_with_workload_and_kallsyms(tmp_path: Path, kaslr: bool) -> None:
    with running_linux_guest(tmp_path, kaslr=kaslr, smp=2) as guest:
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
        assert len(symbols) > 150_000
        for name in MODULE_FUNCTIONS:
            addr = symbols.address_of(name, MODULE)
            assert addr is not None and guest.module_address <= addr < guest.module_address + (
                1 << 20
            ), name
        assert symbols.address_of("qb_read") is None  # only as a module symbol
        kinds = {m for m in symbols.modules if m is not None}
        assert kinds == {MODULE}


def test_build_outputs() -> None:
    """The workload program keeps .eh_frame and a build-id; the module carries ORC tables."""
    build_linux_guest()
    work = ElfImage.load(WORK_ELF)
    assert work.section(".eh_frame")
    assert work.build_id
    module = ElfImage.load(MODULE_KO)
    assert module.section(".orc_unwind") and module.section(".orc_unwind_ip")


def test_boots_without_the_kallsyms_dump(tmp_path: Path) -> None:
    with running_linux_guest(tmp_path, dump_kallsyms=False) as guest:
        assert "qmpprof-linux: tainted 12288" in guest.console_text()
        assert not guest.kallsyms.exists()
        assert guest.kallsyms_gz.stat().st_size == 0
