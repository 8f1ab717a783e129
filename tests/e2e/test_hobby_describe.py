"""The teaching-kernel-shaped guests (fixtures/hobby, hobby64) profiled with their shipped
descriptions (describe.toml beside their sources) and no flag but --kernel, --user-dir and
--describe, on every QEMU.

At MOMENTS random moments gdb stops the guest and qmpprof samples it stopped: each vCPU's
sample's pid and name must be the guest's own table's, ``cpus[i].proc->pid`` and ``->name`` for
vCPU i, as gdb reads them at that moment (no process when ``cpus[i].proc`` is 0: the CPU idles,
or the kernel runs alone). That vCPU i is ``cpus[i]`` is the guest's own doing (mycpu() finds
the CPU by its local APIC id, cpus[] is in the MADT's order) and the description's (``$cpu`` is
QEMU's CPU index), so it is checked apart: whenever gdb's thread i + 1 (vCPU i) has a process's
page directory in CR3, that process is ``cpus[i].proc``. Then a run from the command line labels
its samples ``name (pid N)`` from that table; and a description whose pid reads unmapped memory
still runs, with one warning line.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter
from pathlib import Path

import pytest
from guestvm import free_tcp_port
from hobbyvm import SMP, Hobby, every_hobby, running_hobby
from qemus import every_qemu
from test_hobby_vs_gdb import HobbyOracle

from qmpprof import session
from qmpprof.cli import main
from qmpprof.sampler import Sampler, SamplerConfig
from qmpprof.session import RunSpec
from qmpprof.transport.qmp import QmpTransport

pytestmark = [pytest.mark.qemu, every_qemu, every_hobby]

MOMENTS = 100
REQUIRED = 0.99
# fixtures/hobby/sched.c (userinit) spawns these, in this order (test_hobby_guest.py reads
# them with gdb).
TABLE = {(1, "crunch"), (2, "chatter"), (3, "chatter")}
_TASK = re.compile(r'~"QGTASK (none|(\d+) (\w*)) (\w+)\\n"')
# qg_task(i, cpus, procs, kernbase): cpus[i]'s process, and the pid of the process whose page
# table vCPU i's CR3 holds ("kernel": none's), the kernel's arrays as gdb names them. CR3 holds
# V2P(pgdir): pgdir - KERNBASE. A name is bytes (C's char[16], Rust's [u8; 16]).
_SCRIPT = r"""
def qg_task(cpu, cpus, procs, kernbase):
    proc = gdb.parse_and_eval("%s[%d].proc" % (cpus, cpu))
    if int(proc) == 0:
        task = "none"
    else:
        name = bytes(int(proc["name"][i]) & 0xFF for i in range(16)).split(b"\0")[0]
        task = "%d %s" % (int(proc["pid"]), name.decode())
    gdb.execute("thread %d" % (cpu + 1), to_string=True)
    cr3, owner = int(gdb.parse_and_eval("$cr3")), "kernel"
    for i in range(int(gdb.parse_and_eval("sizeof(%s) / sizeof(%s[0])" % (procs, procs)))):
        p = gdb.parse_and_eval("%s[%d]" % (procs, i))
        if int(p["state"]) != 0 and int(p["pgdir"]) - kernbase == cr3:
            owner = str(int(p["pid"]))
    print("QGTASK %s %s" % (task, owner))
"""


class TaskOracle(HobbyOracle):
    def __init__(
        self, hobby: Hobby, kernel: Path, user_dir: Path, port: int, scripts: Path
    ) -> None:
        super().__init__(hobby, kernel, user_dir, port, scripts)
        (scripts / "qgtask.py").write_text(_SCRIPT)
        self.command(f'-interpreter-exec console "source {scripts / "qgtask.py"}"')

    def task(self, cpu: int) -> tuple[tuple[int, str] | None, int | None]:
        """The pid and name of ``cpus[cpu]``'s process (None: none), and the pid of the process
        whose page directory vCPU ``cpu`` has loaded (None: the kernel's)."""
        hobby = self.hobby
        call = (
            f'qg_task({cpu}, \\"{hobby.names.cpus}\\", \\"{hobby.names.procs}\\", {hobby.kernbase})'
        )
        lines = self.command(f'-interpreter-exec console "python {call}"')
        found = [m for line in lines for m in [_TASK.match(line)] if m]
        assert found, lines
        task = None if found[0][1] == "none" else (int(found[0][2]), found[0][3])
        return task, None if found[0][4] == "kernel" else int(found[0][4])


Task = tuple[int, str] | None


async def compare(
    tmp_path: Path, hobby: Hobby
) -> tuple[list[Task], list[str], list[str], Counter[int]]:
    """gdb's task on each vCPU at each moment, the vCPUs where qmpprof's differs, those where
    the process in CR3 is not ``cpus[i]``'s, and how often each vCPU had a process's CR3."""
    port = free_tcp_port()
    rng = random.Random("qmpprof-hobby-describe")
    truths: list[Task] = []
    differences, strangers = [], []
    loaded_on: Counter[int] = Counter()
    with running_hobby(tmp_path, hobby, gdb_port=port) as guest:
        spec = RunSpec(
            kernel=guest.kernel_elf,
            user_dir=guest.user_dir,
            os_options=(("describe", hobby.description),),
        )
        identifier = session.load(spec)
        unwinder = session.unwinder(spec, identifier)
        oracle = TaskOracle(hobby, guest.kernel_elf, guest.user_dir, port, tmp_path)
        transport = await QmpTransport.connect(guest.qmp_socket)
        try:
            for moment in range(MOMENTS):
                time.sleep(rng.uniform(0.002, 0.03))  # spreads the moments; no synchronisation
                oracle.stop()
                sampler = Sampler(transport, unwinder, identifier, SamplerConfig())
                outcome = await sampler.run(one_shot=True)
                assert sorted(s.cpu for s in outcome.last) == list(range(SMP))
                for sample in outcome.last:
                    truth, loaded = oracle.task(sample.cpu)
                    process = sample.process
                    ours = None if process is None else (process.pid, process.program)
                    truths.append(truth)
                    where = f"moment {moment} cpu {sample.cpu}"
                    if ours != truth:
                        differences.append(f"{where}: gdb {truth}, qmpprof {ours}")
                    loaded_on[sample.cpu] += loaded is not None
                    if loaded is not None and (truth is None or truth[0] != loaded):
                        strangers.append(f"{where}: CR3 of pid {loaded}, cpus[] says {truth}")
                oracle.resume()
        finally:
            oracle.close()
            await transport.close()
    return truths, differences, strangers, loaded_on


def test_pids_and_names_are_the_guests_own(tmp_path: Path, hobby: Hobby) -> None:
    truths, differences, strangers, loaded_on = asyncio.run(compare(tmp_path, hobby))
    counts, samples = Counter(truths), SMP * MOMENTS
    print(f"{samples - len(differences)} of {samples} samples agree; gdb's tasks: {counts}")
    print("\n".join(differences))
    assert len(truths) == samples
    # vCPU i is cpus[i]: a process's CR3 is only ever loaded where cpus[] says it runs.
    print(f"samples with a process's CR3, by vCPU: {dict(loaded_on)}")
    assert not strangers, "\n".join(strangers)
    assert all(loaded_on[cpu] for cpu in range(SMP)), loaded_on
    assert len(differences) <= (1 - REQUIRED) * samples, "\n".join(differences)
    seen = {truth for truth in truths if truth is not None}
    assert seen <= TABLE, seen
    assert len(seen) >= 2, truths  # crunch's loops and a chatter's system calls, at least


def test_a_run_labels_its_samples_by_pid_and_goes_on_past_unmapped_memory(
    tmp_path: Path, hobby: Hobby, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.folded"
    unmapped = tmp_path / "unmapped.toml"
    # 0x20000000: neither the user's 4 MiB nor the kernel's map (kernel.h: KERNBASE on).
    current = hobby.names.cpus.strip("'").removeprefix(hobby.names.namespace)  # as described
    pid = f"*({hobby.names.integer} *)0x20000000"
    unmapped.write_text(f'current = "{current}[$cpu].proc"\npid = "{pid}"\n')
    with running_hobby(tmp_path, hobby) as guest:
        files = ["--kernel", str(guest.kernel_elf), "--user-dir", str(guest.user_dir)]
        run = ["--qmp-socket", str(guest.qmp_socket), *files, "--duration", "0.5"]
        code = main([*run, "--describe", str(hobby.description), "-o", str(out)])
        said = capsys.readouterr().err
        unreadable = main([*run, "--describe", str(unmapped)])
        warned = capsys.readouterr().err
    assert code == 0, said
    assert "could not be read" not in said, said
    labels = {line.split(";", 1)[0] for line in out.read_text().splitlines()}
    with_pids = {label for label in labels if "(pid " in label}
    assert with_pids and with_pids <= {f"{name} (pid {pid})" for pid, name in TABLE}, labels
    assert unreadable == 0, warned
    lines = [line for line in warned.splitlines() if "could not be read" in line]
    assert len(lines) == 1 and lines[0].endswith(" (first: unmapped memory at 0x20000000)")
    assert lines[0].startswith("Warning: unmapped.toml: 'pid' could not be read in "), lines
    assert "Traceback" not in warned
