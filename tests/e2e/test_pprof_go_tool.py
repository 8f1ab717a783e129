"""pprof output of a real run of the bundled guest read by Go's own ``go tool pprof`` (-traces):
it agrees with the folded output of the same run."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from gopprof import go_pprof, top_flat
from guestvm import running_guest
from test_report_rerender import strip_detail

from qmpprof.naming import INLINED_SUFFIX, KERNEL_SUFFIX, Detail, Naming
from qmpprof.output import folded, native


def function_leaves(counts: Counter[tuple[str, ...]]) -> Counter[str]:
    """Folded leaves as function names: detail, the kernel mark and the inlined mark dropped."""
    leaves: Counter[str] = Counter()
    for names, count in counts.items():
        (leaf,) = strip_detail(names[-1:])
        leaves[leaf.removesuffix(KERNEL_SUFFIX).removesuffix(INLINED_SUFFIX)] += count
    return leaves


def with_build_id(elf: Path, out: Path) -> str:
    """A copy of ``elf`` with a GNU build-id note (the bundled guest links with
    --build-id=none); the note is not loaded, so code and addresses stay the same."""
    build_id = hashlib.sha1(elf.read_bytes()).digest()
    note = out.with_suffix(".note")
    note.write_bytes(struct.pack("<III", 4, len(build_id), 3) + b"GNU\0" + build_id)
    subprocess.run(["objcopy", "--add-section", f".note.gnu.build-id={note}", str(elf), str(out)],
                   check=True)  # fmt: skip
    return build_id.hex()


@pytest.mark.qemu
def test_go_pprof_agrees_with_the_folded_output_of_the_same_run(tmp_path: Path) -> None:
    out = {ext: tmp_path / f"run.{ext}" for ext in ("pb.gz", "folded", "qmpprof")}
    elves = tmp_path / "elves"
    (elves / "user").mkdir(parents=True)
    with running_guest(tmp_path) as guest:
        build_ids = {elves / "kernel.elf": with_build_id(guest.kernel_elf, elves / "kernel.elf")}
        for elf in guest.user_dir.glob("*.elf"):
            build_ids[elves / "user" / elf.name] = with_build_id(elf, elves / "user" / elf.name)
        argv = [
            "--qmp-socket",
            str(guest.qmp_socket),
            "--kernel",
            str(elves / "kernel.elf"),
            "--user-dir",
            str(elves / "user"),
            "--interval",
            "5",
            "--duration",
            "2",
        ]
        for path in out.values():
            argv += ["-o", str(path)]
        run = subprocess.run([sys.executable, "-m", "qmpprof", *argv],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    folded_run = Counter(dict(folded.parse(out["folded"].read_text())))
    assert sum(folded_run.values()) >= 200
    pprof = str(out["pb.gz"])
    # -nodefraction=0: by default pprof hides functions under 0.5 % of the samples.
    top = ["-top", "-nodecount=1000", "-nodefraction=0", "-sample_index=samples"]
    # Folded names fold inlined functions into their caller, as pprof's -noinlines does.
    assert top_flat(go_pprof(tmp_path, *top, "-noinlines", pprof)) == function_leaves(folded_run)
    # pprof's default view shows inlined functions: folded shows them with --lines.
    lines = native.load(out["qmpprof"]).named_counts(Naming(Detail.LINE))
    assert top_flat(go_pprof(tmp_path, *top, pprof)) == function_leaves(lines)
    raw = go_pprof(tmp_path, "-raw", pprof)
    mappings = raw[raw.index("Mappings") :].splitlines()[1:]
    assert len(mappings) >= 2
    for line in mappings:  # e.g. 3: 0xffffffff80100000/0xffffffff80126444/0x1000 PATH ID [FN]...
        path, build_id, flags = line.split()[2:]
        assert build_ids[Path(path)] == build_id and flags == "[FN][FL][LN][IN]"
    assert f"/0x1000 {elves / 'kernel.elf'} " in raw  # the kernel's first PT_LOAD offset
    traces = go_pprof(tmp_path, "-traces", pprof)
    assert "process:" in traces and "mode:  kernel" in traces
