"""End to end on qemu-system-aarch64: qmpprof ``--kernel`` given bookworm's arm64 6.1 Image in
the forms other distributions ship it (Image.gz, an EFI zboot image of zstd; made here from the
Image by their documented layouts: Debian ships neither), against a guest booted from the plain
Image with KASLR on. The slide must be the guest's, the kernel frames named as the guest's own
/proc/kallsyms names them, and the guest must run on afterwards."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aarch64vm import ROOT, Aarch64Guest, image, named_at, running_aarch64_guest
from guestvm import run_state
from kernelpack import PACK, zboot
from qemumark import boots_qemu
from test_aarch64_e2e import TextSymbols

from qmpprof.linux.kernel import LinuxKernel

pytestmark = [pytest.mark.qemu, pytest.mark.linux]

SHOTS = 4  # more one-shots at most, until one stops a vCPU in the kernel


@pytest.fixture(scope="module")
@boots_qemu
def guest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Aarch64Guest]:
    with running_aarch64_guest(tmp_path_factory.mktemp("aarch64-forms"), "6.1") as running:
        yield running


@pytest.mark.parametrize("form", ["Image.gz", "zboot"])
def test_one_shot_with_the_image_as_other_distributions_ship_it(
    form: str, guest: Aarch64Guest, tmp_path: Path
) -> None:
    plain = image("6.1").read_bytes()
    packed = tmp_path / form
    packed.write_bytes(PACK["gzip"](plain) if form == "Image.gz" else zboot(plain, "zstd"))
    run = one_shot(guest, packed)
    found = re.search(r"KASLR slide (0x[0-9a-f]+)", run.stderr)
    assert found is not None, run.stderr
    linked = LinuxKernel.load(packed).symbols.address_of("_stext")
    running = guest.symbols.address_of("_stext")
    assert linked is not None and running is not None
    assert int(found[1], 16) == running - linked != 0
    # Kernel frames named as the guest names them: one-shots until one stops a vCPU in the
    # kernel (about 60 % of samples are).
    text = TextSymbols(guest.symbols)
    kernel = [s for s in json.loads(run.stdout) if s["mode"] == "kernel"]
    for _ in range(SHOTS):
        if kernel:
            break
        kernel = [s for s in json.loads(one_shot(guest, packed).stdout) if s["mode"] == "kernel"]
    assert kernel
    for stack in kernel:
        frames = stack["frames"]
        for i, frame in enumerate(frames):
            # A caller's at its call, a tail-call frame's at its jump, the code an exception
            # taken in the kernel interrupted at its pc (a function's first instruction, often).
            assert frame.get("symbol") in text.names_at(named_at(frames, i)), (frame, stack)


def one_shot(guest: Aarch64Guest, kernel: Path) -> subprocess.CompletedProcess[str]:
    """qmpprof --one-shot with ``kernel``; the guest must run on afterwards."""
    run = subprocess.run(
        [sys.executable, "-m", "qmpprof", "--qmp-socket", str(guest.qmp_socket),
         "--kernel", str(kernel), "--one-shot", "--json", "-k", "-v"],
        cwd=ROOT, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run_state(guest.qmp_socket) == "running"
    return run
