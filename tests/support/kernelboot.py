"""A kernel the tests never boot, booted with the test guest's initramfs (KASLR, 2 vCPUs; the
test module is not built for it, so /init says "insmod failed" and runs its busybox loop) and
profiled for a few seconds through the command line, as a user would: how many samples, how
many truncated, which processes were named, and every kernel frame's name against the guest's
own /proc/kallsyms (``linuxframes.kernel_names``).

    python -m support.kernelboot VMLINUZ [--seconds 5] [--json FILE] [--profile FILE]

One QEMU at a time (TCG): the host's cores are shared.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from linuxframes import GuestNames, kernel_names
from linuxvm import ROOTFS, running_linux_guest

import qmpprof.output.native as native
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.profile import Profile, StackRecord

CLI_TIMEOUT = 300.0


def boot_and_profile(
    vmlinuz: Path, seconds: float, tmp: Path, keep: Path | None = None
) -> dict[str, Any]:
    """Boot ``vmlinuz``, run ``qmpprof`` against it for ``seconds``, and say what it found
    (the profile copied to ``keep``, with the guest's kallsyms beside it)."""
    out = tmp / "out.qmpprof"
    with running_linux_guest(tmp, kaslr=True, smp=2, kernel=vmlinuz) as guest:
        argv = [
            sys.executable, "-m", "qmpprof",
            "--qmp-socket", str(guest.qmp_socket),
            "--kernel", str(vmlinuz),
            "--user-dir", str(ROOTFS),
            "--duration", str(seconds), "--interval", "10", "-v", "-o", str(out),
        ]  # fmt: skip
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=CLI_TIMEOUT, stdin=subprocess.DEVNULL
        )
        table = GuestNames(guest.symbols)
        text = guest.text_address
        if keep is not None and done.returncode == 0:
            shutil.copyfile(out, keep)
            shutil.copyfile(guest.kallsyms, keep.with_suffix(".kallsyms"))
        console = guest.console.read_text(errors="replace")
    report: dict[str, Any] = {
        "kernel": str(vmlinuz),
        "boot_s": round(guest.boot_seconds, 1),
        "exit_status": done.returncode,
        "stderr": done.stderr.strip().splitlines(),
        "insmod_failed": "insmod failed" in console,
    }
    image_text = LinuxKernel.load(vmlinuz).symbols.address_of("_text")
    report["slide"] = None if image_text is None else hex(text - image_text)
    if done.returncode == 0:
        report |= summary(native.load(out), table)
    return report


def summary(profile: Profile, table: GuestNames) -> dict[str, Any]:
    """Samples, truncated ones and why, processes, and kernel frames named as the guest does."""
    equal, total, wrong, names = kernel_names(profile, table)
    processes: Counter[str] = Counter()
    stops: Counter[str] = Counter()
    kernel_stacks = whole_kernel = user_frames = user_named = 0
    for record, count in zip(profile.stacks, profile.counts, strict=True):
        users = [profile.frames[f] for f in record.frames if not profile.frames[f].kernel]
        user_frames += count * len(users)
        user_named += count * sum(f.symbol is not None for f in users)
        process = record.process
        processes[(process.program or "?") if process else "(none)"] += count
        if record.truncated:
            stops[record.stop.value] += count
        if record.frames and profile.frames[record.frames[0]].kernel:
            kernel_stacks += count
            whole_kernel += count * (not record.truncated or _leaves_kernel(profile, record))
    return {
        "samples": len(profile),
        "truncated": profile.truncated,
        "stops": dict(stops.most_common()),
        "processes": dict(processes.most_common()),
        "kernel_frames_named_as_guest": f"{equal}/{total}",
        "kernel_names_wrong": [f"{n} {what}" for what, n in wrong.most_common(10)],
        "kernel_top": dict(names.most_common(8)),
        "kernel_stacks_reaching_user_or_end": f"{whole_kernel}/{kernel_stacks}",
        "user_frames_named": f"{user_named}/{user_frames}",
    }


def _leaves_kernel(profile: Profile, record: StackRecord) -> bool:
    """Whether a truncated stack that starts in the kernel got out of it (to user frames in the
    lower half: a kernel-half address below the kernel's text is a bad return, no user code):
    its kernel part was whole, the user part is what stopped."""
    return any(
        not profile.frames[fid].kernel and profile.frames[fid].pc >> 63 == 0
        for fid in record.frames
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernelboot", description=__doc__.split("\n\n")[0])
    parser.add_argument("vmlinuz", type=Path)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", type=Path, help="keep the profile here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kernelboot-") as tmp:
        report = boot_and_profile(args.vmlinuz.resolve(), args.seconds, Path(tmp), args.profile)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
