"""What serve shows about its VMs as a page: the index (HTML). Read from the HTTP threads: each
VM's numbers are copied once. The Prometheus metrics are metrics.py's."""

from __future__ import annotations

import html
import urllib.parse
from collections.abc import Sequence

from qmpprof.serve.vm import LIVE, Vm

DEFAULT_SECONDS = 30  # what the links ask for (Go's default for /debug/pprof/profile)


def index(vms: Sequence[Vm], window: int) -> str:
    rows = "\n".join(_row(vm, min(DEFAULT_SECONDS, window)) for vm in vms)
    if not vms:
        rows = '<tr><td colspan="10">no VM yet</td></tr>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>qmpprof serve</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }}
th, td {{ border-bottom: 1px solid #ccc; padding: 0.3em 0.8em; text-align: right; }}
th:first-child, td:first-child, td.links, tr.note td {{ text-align: left; }}
tr.note td {{ border-bottom: none; color: #555; font-size: 90%; }}
.down, .paused {{ color: #b00; }}
</style></head>
<body>
<h1>qmpprof serve</h1>
<p>Profiles of the last {window} s are kept; live numbers cover the last {LIVE} s.
<a href="/metrics">metrics</a></p>
<table id="vms">
<tr><th>VM</th><th>state</th><th>rate (Hz)</th><th>interval (ms)</th>
<th>median pause (ms)</th><th>errors</th><th>truncated</th><th>guest stopped</th>
<th>budget</th><th>profiles</th></tr>
{rows}
</table>
</body></html>
"""


def _row(vm: Vm, seconds: int) -> str:
    live = vm.live()
    name = html.escape(vm.name)
    query = html.escape(urllib.parse.urlencode({"vm": vm.name, "seconds": seconds}))
    state = html.escape(vm.state)
    if vm.problem:
        state = f'<span title="{html.escape(vm.problem)}">{state}</span>'
    notes = "".join(
        f'<tr class="note"><td></td><td colspan="9">note: {html.escape(note)}</td></tr>'
        for note in vm.notes
    )
    return (
        f'<tr class="vm"><td>{name}</td><td class="{html.escape(vm.state)}">{state}</td>'
        f"<td>{live.rate_hz:.1f}</td><td>{vm.interval * 1e3:.0f}</td>"
        f"<td>{live.median_pause_ms:.2f}</td>"
        f"<td>{vm.errors_total}</td><td>{vm.truncated_total}</td>"
        f'<td class="stopped">{live.stopped:.2%}</td>'
        f"<td>{'none' if vm.budget is None else f'{vm.budget:.2%}'}</td>"
        f'<td class="links"><a href="/flamegraph.svg?{query}">flame graph ({seconds} s)</a> '
        f'<a href="/debug/pprof/profile?{query}">pprof (collects {seconds} s)</a></td></tr>' + notes
    )
