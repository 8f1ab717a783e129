"""The markdown tables of ``support.kernelcheck``'s rows: one line a kernel, the columns the
facts docs/linux-guest.md (amd64) and docs/aarch64.md (arm64) compare across kernels."""

from __future__ import annotations

from typing import Any

Row = dict[str, Any]
_L5 = "__pgtable_l5_enabled"  # without it a run takes 4-level paging (linux/running/pagetables.py)
COLUMNS = (
    "kernel",
    "suite",
    "codec",
    "load s (cold / cached; best of runs)",
    "kallsyms symbols (exports checked)",
    "tables in .rodata (label alignment; offsets)",
    "per-CPU area",
    "current task pointer",
    "THREAD_SIZE",
    "TASK_COMM_LEN",
    "ORC entries (layout): numbering",
    "BTF types (per-CPU vars)",
    "module text",
    "VMAs",
    "off CPU (--off-cpu)",
    "notes",
)


ARM64_COLUMNS = (
    "kernel",
    "suite",
    "form (MB)",
    "page size",
    "load s (cold / cached)",
    "link address",
    "relocations",
    "kallsyms symbols (not code)",
    "THREAD_SIZE",
    "current task pointer",
    "per-CPU symbols (code, run) vs the kernel's own",
    "BTF types",
    "task (TASK_COMM_LEN)",
    "module text",
    "VMAs",
    "notes",
)


def markdown(rows: list[Row]) -> str:
    return _table(COLUMNS, [_cells(row) for row in rows])


def markdown_arm64(rows: list[Row]) -> str:
    return _table(ARM64_COLUMNS, [_arm64_cells(row) for row in rows])


def _table(columns: tuple[str, ...], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def _arm64_cells(row: Row) -> list[str]:
    """An arm64 row: what the Image reader found, then what the run reads from kallsyms and
    BTF; a kernel that did not load is its error."""
    kernel, load = _kernel_and_load(row)
    suite = row.get("suite") or "tests"
    if "image" not in row:
        return [kernel, suite, "", "", load, *[""] * 10, _escape(row.get("error", "-"))]
    image, kallsyms, btf = row["image"], row["kallsyms"], row["btf"]
    symbols = (
        _escape(kallsyms["error"])
        if "error" in kallsyms
        else f"{_spaced(kallsyms['symbols'])} ({_spaced(image['data_symbols'])})"
    )
    page = _num(image["page_size"] and image["page_size"] >> 10, "d")
    said = list(row.get("notes", []))
    if image["missing_symbols"]:
        said.append("no " + ", ".join(image["missing_symbols"]) + " in kallsyms")
    if not image["parts_aligned"]:
        said.append("sections not 64 KiB-aligned")
    if image.get("exception_code") is False:  # rows from before it was read have none
        said.append("no exception model (exception frames not crossed)")
    if "exception_model" in image:
        said.append(f"exception model: {image['exception_model']}")
    said += _entries(image.get("exception_entries", []))
    said += row.get("warnings", [])
    return [
        kernel,
        suite,
        f"{image['form']} ({image['file_bytes'] / 1e6:.1f})",
        "-" if page == "-" else page + " KiB",
        load,
        f"`{image['link']}`",
        f"{image['relocations'][0]} {_spaced(image['relocations'][1])}",
        symbols,
        _num(image["thread_size"], "#x"),
        _per_cpu(row["per_cpu"])[1],
        _oracle(row.get("per_cpu_oracle", {})),
        _escape(btf["error"]) if "error" in btf else _spaced(btf["types"]),
        "-" if not btf.get("task") else f"yes ({btf['comm_len']})",
        btf.get("module") or "-",
        btf.get("vma") or "-",
        _escape("; ".join(said)) or "-",
    ]


def _entries(entries: list[dict[str, Any]]) -> list[str]:
    """The vector entries' handlers, runs of entries of one shape together: ``vectors+0x200-0x380
    known: record zeroed, ...``; an entry whose shape qmpprof does not know says so."""
    runs: list[tuple[str, str, str]] = []  # (first, last, what)
    for entry in entries:
        what = f"{'known' if entry['known'] else 'UNKNOWN'}: {entry['shape']}"
        if runs and runs[-1][2] == what:
            runs[-1] = (runs[-1][0], entry["offset"], what)
        else:
            runs.append((entry["offset"], entry["offset"], what))
    return [
        f"vectors+{first}{'' if first == last else '-' + last} {what}" for first, last, what in runs
    ]


def _spaced(count: int) -> str:
    return f"{count:,}".replace(",", " ")


def _kernel_and_load(row: Row) -> tuple[str, str]:
    """A row's kernel cell (in bold when the tests boot it) and its load times' cell."""
    kernel = row.get("version") or row["path"]
    if row.get("booted_by_tests"):
        kernel = f"**{kernel}** (booted)"
    load = _num(row.get("load_cold_s"), ".2f")
    if row.get("load_cached_s") is not None:
        load += " / " + _num(row["load_cached_s"], ".2f")
    return kernel, load


def _cells(row: Row) -> list[str]:
    kernel, load = _kernel_and_load(row)
    if "error" in row and "image" not in row:
        return [kernel, row.get("suite") or "", "", load, *[""] * 10, _escape(row["error"])]
    return [
        kernel,
        row.get("suite") or "tests",
        row["image"]["codec"],
        load,
        *_kallsyms(row["kallsyms"]),
        *_per_cpu(row["per_cpu"]),
        _num(row["image"]["thread_size"], "#x"),
        _num(row["btf"].get("comm_len"), "d"),
        _orc(row["orc"]),
        *_btf(row["btf"]),
        _notes(row),
    ]


def _kallsyms(facts: Row) -> list[str]:
    if "error" in facts:
        return [_escape(facts["error"]), ""]
    count = f"{facts['symbols']:,}".replace(",", " ")
    check = f"{facts['exports_checked']:,}".replace(",", " ")
    if not facts["same_as_load"]:
        count += " (not the load's)"
    order = " ".join(facts["order"])
    return [f"{count} ({check})", f"{order} ({facts['align']}; {facts['offsets']})"]


def _per_cpu(facts: Row) -> list[str]:
    if "error" in facts:
        return [_escape(facts["error"]), ""]
    kind = facts["kind"] if facts["kind"] != "kernel data" else f"data at {facts['start']}"
    current = facts.get("current")
    if current is None:
        return [kind, _escape(facts.get("current_error", "-"))]
    where = f"`{current['symbol']}` ({current['link']}{', moves' if current['moves'] else ''})"
    return [kind, where]


def _oracle(facts: Row) -> str:
    """Whether the per-CPU area, ``__per_cpu_offset`` and ``__entry_task`` qmpprof reads in an
    arm64 kernel's code, and those a run takes, are the kernel's own (its System.map's)."""
    if "error" in facts:
        return _escape(facts["error"])
    if facts.get("oracle") is None:
        return "no System.map"
    if facts["differs"]:
        return "differ: " + ", ".join(facts["differs"]) + f" ({facts['source']})"
    return f"agree ({facts['source']})"


def _orc(facts: Row) -> str:
    if "error" in facts:
        return _escape(facts["error"])
    if not facts["entries"]:
        return "none"
    count = f"{facts['entries']:,}".replace(",", " ")
    agree = {True: "", False: f"; entries show {facts['entries_show']}", None: "; too few"}
    return (
        f"{count} ({facts['layout']}): {facts['numbering']}, {facts['source']}"
        + agree[facts["entries_agree"]]
    )


def _btf(facts: Row) -> list[str]:
    if "error" in facts:
        return [_escape(facts["error"]), "", "", ""]
    if not facts["types"]:
        return ["none", "", "", ""]
    types = f"{facts['types']:,}".replace(",", " ")
    task = "" if facts["task"] else ", no task layout"
    return [
        f"{types} ({facts['percpu_variables']}){task}",
        facts["module"] or "-",
        facts["vma"] or "-",
        _escape(facts.get("offcpu", "-")),
    ]


def _notes(row: Row) -> str:
    said = list(row.get("notes", []))
    image = row["image"]
    missing = [name for name in image["missing_symbols"] if name != _L5]
    if _L5 in image["missing_symbols"]:
        said.append(f"no {_L5}: 4-level paging taken")
    if missing:
        said.append("no " + ", ".join(missing) + " in kallsyms")
    thunks = image.get("thunk_names", {})
    if list(thunks.values()) != ["indirect", "return"]:
        said.append(f"thunks taken for {thunks}")
    if not image["entry_text_symbols"]:
        said.append("no entry-text symbols (KASLR vote)")
    current = row["per_cpu"].get("current") or {}
    if current.get("note"):
        said.append(current["note"])
    said += row.get("warnings", [])
    if "error" in row:
        said.append(row["error"])
    return _escape("; ".join(said)) or "-"


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
