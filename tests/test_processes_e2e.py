"""User processes end to end: every process under its own name and pid, the workload's known
split between functions, and syscall-path samples stitched onto the calling user frames."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter, defaultdict

import pytest
from guestvm import expected, running_guest
from qemus import every_qemu

from qmpprof.output.folded import parse

pytestmark = [pytest.mark.qemu, every_qemu]

K = "_[k]"
TOLERANCE = 0.05  # the issue's +-5 percentage points


Stacks = list[tuple[tuple[str, ...], int]]
_profiles: dict[str, Stacks] = {}


def profile(tmp_path_factory: pytest.TempPathFactory, variant: str) -> Stacks:
    """One long run per variant, shared by the tests of this file.

    About 5000 ticks: a program with a quarter of the time gets ~1250 samples, so the binomial
    noise of a share is ~1.4 points and the +-5 point tolerance is 3.5 sigma.
    """
    if variant not in _profiles:
        tmp_path = tmp_path_factory.mktemp(f"processes-{variant}")
        out = tmp_path / f"{variant}.folded"
        with running_guest(tmp_path, variant, 1) as guest:
            cmd = [
                sys.executable, "-m", "qmpprof",
                "--qmp-socket", str(guest.qmp_socket),
                "--kernel", str(guest.kernel_elf),
                "--user-dir", str(guest.user_dir),
                "--interval", "2", "--duration", "10", "--jitter", "0.5",
                "-o", str(out),
            ]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        print(done.stderr)
        _profiles[variant] = parse(out.read_text())
    return _profiles[variant]


def bare(name: str) -> str:
    return name.removesuffix(K)


def shares_by_root(stacks: list[tuple[tuple[str, ...], int]]) -> dict[str, Counter[str]]:
    """For each root label: how many samples contain each function (once per sample)."""
    found: dict[str, Counter[str]] = defaultdict(Counter)
    for frames, count in stacks:
        root = frames[0]
        found[root]["__samples__"] += count
        for name in {bare(f) for f in frames[1:]}:
            found[root][name] += count
    return found


def program_of(root: str) -> str:
    return root.split(" (", 1)[0]


@pytest.mark.parametrize("variant", ["cfi", "fp"])
def test_processes_are_named_and_the_known_split_is_measured(
    tmp_path_factory: pytest.TempPathFactory, variant: str
) -> None:
    stacks = profile(tmp_path_factory, variant)
    shape = expected()
    by_root = shares_by_root(stacks)
    roots = set(by_root)
    for program, spec in shape["programs"].items():
        for pid in spec["pids"]:
            assert f"{program} (pid {pid})" in roots, sorted(roots)
    assert "kernel" in roots  # the kernel thread has no process

    report = []
    for program, spec in [*shape["programs"].items(), *shape["kernel_threads"].items()]:
        counts: Counter[str] = Counter()
        for root, found in by_root.items():
            if program_of(root) == program or (root == "kernel" and program in spec_roots(shape)):
                counts.update(found)
        total = counts["__samples__"]
        assert total >= 100, f"{program}: only {total} samples"
        for function, share in spec["shares"].items():
            measured = counts[function] / total
            report.append(f"{variant} {program}.{function}: {measured:.3f} vs {share:.3f}")
            assert abs(measured - share) <= TOLERANCE, "\n".join(report)
    print("\n".join(report))


def spec_roots(shape: dict[str, object]) -> set[str]:
    """Kernel threads have no process: their samples are under the root ``kernel``."""
    threads = shape["kernel_threads"]
    assert isinstance(threads, dict)
    return set(threads)


@pytest.mark.parametrize("variant", ["cfi", "fp"])
def test_both_instances_are_fully_symbolized(
    tmp_path_factory: pytest.TempPathFactory, variant: str
) -> None:
    stacks = profile(tmp_path_factory, variant)
    for pid in expected()["programs"]["spin"]["pids"]:
        mine = [(f, n) for f, n in stacks if f[0] == f"spin (pid {pid})"]
        assert mine, f"no samples of spin pid {pid}"
        named = sum(n for f, n in mine if all(not x.startswith(("[unknown]", "0x")) for x in f))
        assert named / sum(n for _, n in mine) >= 0.99
        assert any(f[-1] == "spin_mix" and "spin_hot" in f for f, _ in mine)


@pytest.mark.parametrize("variant", ["cfi", "fp"])
def test_syscall_samples_show_the_calling_user_frames_below(
    tmp_path_factory: pytest.TempPathFactory, variant: str
) -> None:
    stacks = profile(tmp_path_factory, variant)
    path = expected()["syscall_path"]
    entry = f"{path[0]}{K}"
    in_syscall = [(f, n) for f, n in stacks if f[0].startswith("sys (") and entry in f]
    assert sum(n for _, n in in_syscall) >= 100
    for frames, _ in in_syscall:
        assert frames[1 : frames.index(entry)] == ("_start", "main", "sys_call_kernel"), frames
        kernel_part = [bare(f) for f in frames[frames.index(entry) :]]
        # The syscall chain in call order, then maybe an interrupt taken on top of it.
        interrupted = [i for i, f in enumerate(kernel_part) if f.startswith("isr_")]
        chain = kernel_part[: interrupted[0]] if interrupted else kernel_part
        assert chain == path[: len(chain)], frames
