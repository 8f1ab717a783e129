"""A big Linux guest end to end (issue 38): Debian's 6.12 (one kernel is enough: the walks
checked here are the same code on every kernel) booted with init's ``qmpprof.big``, a process
holding as many mappings as vm.max_map_count allows (65,530 by default) and a module of 30,000
functions more (fixtures/linux-guest/bigmodule), the process running in both. One 5 s profile at
the default interval through the command line; then checked against the guest's own word,
printed by init on the console and in its /proc/kallsyms dump (tests/linuxvm.py):

- the process's count of mappings is the guest's limit (what the test is about);
- the process's samples carry its pid and its name, and its user frames are in the file its
  /proc/PID/maps has there, at that file's offset;
- every kernel frame is named as the guest's /proc/kallsyms names it, the big module's many
  functions among them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from linuxframes import GuestNames, check_user_frames, kernel_names
from linuxkernel import linux_dir
from linuxvm import MAPS_END, ROOTFS, LinuxGuest, Mapping, parse_maps_line, running_linux_guest
from test_linux_profile import NAMED, PLACED

from qmpprof.output import native

pytestmark = [pytest.mark.qemu, pytest.mark.linux]

BIG = "qmpprof.big"  # init's word for this workload
MODULE = "[qmpprof_big]"
FUNCTIONS = 30_000  # qg_f10000 .. qg_f39999 (each with its __pfx_ padding symbol in kallsyms)


def big_process(guest: LinuxGuest) -> tuple[int, int, int, list[Mapping], int]:
    """(pid, its /proc/PID/maps lines, vm.max_map_count, its mappings of files, the module's
    /proc/kallsyms lines), as init printed them."""
    text = guest.console_text()
    found = re.search(r"^qmpprof-linux: big pid (\d+) mappings (\d+) of (\d+)", text, re.M)
    files = re.search(r"^qmpprof-linux: maps of big pid \d+ begin\r?\n(.*?)^" + MAPS_END,
                      text, re.M | re.S)  # fmt: skip
    symbols = re.search(r"^qmpprof-linux: big module symbols (\d+)", text, re.M)
    assert found and files and symbols, text[-3000:]
    pid, mappings, limit = (int(n) for n in found.groups())
    maps = [parse_maps_line(line) for line in files.group(1).splitlines()]
    return pid, mappings, limit, maps, int(symbols.group(1))


def test_a_process_of_65530_mappings_and_a_module_of_30000_functions(tmp_path: Path) -> None:
    kernel = linux_dir("6.12") / "vmlinuz"
    saved = tmp_path / "big.qmpprof"
    with running_linux_guest(tmp_path, kaslr=True, smp=2, append=BIG, kernel=kernel) as guest:
        cmd = [sys.executable, "-m", "qmpprof", "--qmp-socket", str(guest.qmp_socket)]
        cmd += ["--kernel", str(kernel), "--user-dir", str(ROOTFS)]
        cmd += ["--duration", "5", "-v", "-o", str(saved)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        pid, mappings, limit, maps, module_lines = big_process(guest)
        names = GuestNames(guest.symbols)
    print(done.stderr)
    assert done.returncode == 0, done.stderr
    # The process holds what the kernel allows: a split past the limit is refused. Its maps
    # also has [vsyscall], which is no mapping of the process.
    print(f"big pid {pid}: {mappings} maps lines of {limit}, module {module_lines} symbols")
    assert limit - 2 <= mappings <= limit + 1
    assert module_lines >= 2 * FUNCTIONS

    profile = native.load(saved)
    ticks = int(re.search(r"(\d+) ticks", done.stderr).group(1))  # type: ignore[union-attr]
    processes = Counter(
        (stack.process.pid, stack.process.program)
        for stack, count in zip(profile.stacks, profile.counts, strict=True)
        for _ in range(count)
        if stack.process is not None
    )
    print("processes:", processes.most_common(8))
    # Three busy tasks of the workload and this one share 2 vCPUs: a tenth of the ticks at least.
    assert processes[(pid, "qmpprof-work")] >= ticks // 10, processes.most_common(8)
    assert not [p for p in processes if p[0] == pid and p[1] != "qmpprof-work"]

    found = check_user_frames(profile, pid, maps, ROOTFS)
    placed = found.placed / max(found.total, 1)
    print(f"user frames placed {found.placed}/{found.total}, by file {dict(found.files)}")
    assert found.total >= ticks // 10
    assert "/bin/qmpprof-work" in found.files
    assert placed >= PLACED, found.wrong.most_common(10)
    assert {"compute_leaf (qmpprof-work)", "big_loop (qmpprof-work)"} <= set(found.names)

    equal, total, wrong, kernel_frames = kernel_names(profile, names)
    ours = {name for name in kernel_frames if re.fullmatch(r"qg_f\d{5}", name)}
    print(f"kernel frames named as the guest's kallsyms {equal}/{total};"
          f" {len(ours)} of the module's functions")  # fmt: skip
    print("\n".join(f"{n:5d}  {what}" for what, n in wrong.most_common(10)))
    assert equal >= NAMED * total, wrong.most_common(10)
    assert "qg_read" in kernel_frames and len(ours) >= 10, kernel_frames.most_common(20)
    # Named from the module's own symbols (its mapping), not from something near it.
    modules = {f.module_name for f in profile.frames if f.symbol is not None and f.symbol in ours}
    assert modules == {MODULE}
