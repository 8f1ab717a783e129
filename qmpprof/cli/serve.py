"""``qmpprof serve``: the flags of the continuous-profiling daemon (qmpprof/serve/ does the rest).

A VM that is not there yet is only "down"; a URI libvirt refuses (--libvirt) ends serve at
start (exit 3) before any guest is touched; a malformed --qmp-socket or --listen, a missing
--qmp-dir, a bad --config file or a bad ELF file ends serve at start with one line and the exit
code of its class. The flags are every VM's defaults; --config overrides them per VM.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from qmpprof.cli.options import (
    Parser,
    add_guest_flags,
    add_view_flags,
    guest_fields,
    kernel_boundary_of,
    mode_of,
    naming_of,
    parse_cpus,
)
from qmpprof.errors import UsageError
from qmpprof.sampler import SamplerConfig
from qmpprof.serve.config import (
    MAX_INTERVAL,
    VmSettings,
    parse_interval,
    parse_overhead,
    read_config,
)
from qmpprof.serve.daemon import ServeConfig, serve
from qmpprof.session import RunSpec

DEFAULT_LISTEN = "127.0.0.1:6060"
MAX_WINDOW = 86400


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="qmpprof serve",
        description="Profile QEMU guests continuously and serve their profiles over HTTP: "
        "/debug/pprof/profile?seconds=N (go tool pprof, Pyroscope, Parca), /flamegraph.svg, "
        "/metrics (Prometheus), / (index).",
        epilog="Example: qmpprof serve --qmp-socket vm1=./qmp-socket --kernel kernel.elf; "
        "then go tool pprof http://127.0.0.1:6060/debug/pprof/profile?seconds=30",
    )
    add = p.add_argument
    add("--qmp-socket", metavar="[NAME=]PATH", action="append", default=[],
        help="a VM's QMP Unix socket (repeatable); NAME defaults to the file's stem")  # fmt: skip
    add("--qmp-dir", metavar="DIR",
        help="a directory of QMP sockets, one per VM named by its file name; rescanned "
             "every second")  # fmt: skip
    add("--libvirt", metavar="URI",
        help="every domain running at this libvirt URI, each named by its domain name, "
             "followed as it starts and dropped as it stops (not with --qmp-socket, --qmp-dir "
             "or sockets in --config; [vm.NAME] tables give a domain its settings)")  # fmt: skip
    add("--listen", metavar="HOST:PORT", default=DEFAULT_LISTEN,
        help="where to serve HTTP (default %(default)s; port 0 picks a free one). The "
             "profiles show what runs inside the guests: keep it on localhost")  # fmt: skip
    add("--config", metavar="FILE",
        help="per-VM settings in TOML: [vm.NAME] tables of socket, kernel, kallsyms, user_dir, "
             "os, interval, max_overhead, off_cpu (a VM of --qmp-dir also reads NAME.toml "
             "beside its socket); the flags are the defaults")  # fmt: skip
    add("--interval", metavar="MS", type=float, default=50.0,
        help="guest run time between samples, the shortest under a budget (default "
             "%(default)g ms)")  # fmt: skip
    add("--max-overhead", metavar="PCT", default="1",
        help="keep each guest stopped at most PCT %% of the wall time: its interval lengthens "
             "when pauses cost more, up to 5 s (default %(default)s; 0 or none: no budget, "
             "every --interval)")  # fmt: skip
    add("--off-cpu", action="store_true",
        help="every task of a Linux guest off CPU too, at each tick, under [off-cpu: STATE] "
             "(profiles, flame graphs; /metrics counts them apart)")  # fmt: skip
    add("--window", metavar="SECONDS", type=int, default=300,
        help="how many seconds of profile to keep per VM (default %(default)s)")  # fmt: skip
    add_view_flags(p)
    add_guest_flags(p)
    return p


def parse(args: list[str]) -> ServeConfig:
    ns = parser().parse_args(args)
    interval = parse_interval(ns.interval)
    if not 1 <= ns.window <= MAX_WINDOW:
        raise UsageError(f"--window must be from 1 to {MAX_WINDOW} seconds, not {ns.window}")
    qmp_dir = Path(ns.qmp_dir) if ns.qmp_dir else None
    if qmp_dir is not None and not qmp_dir.is_dir():
        raise UsageError(f"--qmp-dir: not a directory: {ns.qmp_dir}")
    host, port = parse_listen(ns.listen)
    settings = read_config(Path(ns.config)) if ns.config else {}
    spec = RunSpec(
        **guest_fields(ns),
        lines=True,  # pprof answers carry source lines and inlined frames
        off_cpu=ns.off_cpu,
        sampling=SamplerConfig(
            interval=interval,
            cpus=parse_cpus(ns.cpus) if ns.cpus else None,
            kernel_boundary=kernel_boundary_of(ns),
            keep=mode_of(ns),
            max_overhead=parse_overhead(ns.max_overhead),
            max_interval=MAX_INTERVAL,
        ),
    )
    sockets = with_configured(parse_sockets(ns.qmp_socket), settings)
    if ns.libvirt is not None and (sockets or qmp_dir is not None):
        # A domain and a socket of the same name would be two VMs under one name.
        raise UsageError(
            "--libvirt names every VM: not with --qmp-socket, --qmp-dir or sockets in --config"
        )
    if not sockets and qmp_dir is None and ns.libvirt is None:
        raise UsageError(
            "give --qmp-socket [NAME=]PATH (repeatable), --qmp-dir DIR, --libvirt URI, or "
            "sockets in --config"
        )
    return ServeConfig(
        spec=spec,
        sockets=sockets,
        qmp_dir=qmp_dir,
        host=host,
        port=port,
        window=ns.window,
        naming=naming_of(ns),
        settings=settings,
        libvirt=ns.libvirt,
    )


def with_configured(
    sockets: tuple[tuple[str, Path], ...], settings: dict[str, VmSettings]
) -> tuple[tuple[str, Path], ...]:
    """The --qmp-socket VMs, then those --config gives a socket."""
    named = dict(sockets)
    for name, vm in settings.items():
        if vm.socket is None:
            continue
        if name in named:
            raise UsageError(f"two sockets for the VM {name!r}: --qmp-socket and --config")
        named[name] = vm.socket
    return tuple(named.items())


def parse_sockets(texts: list[str]) -> tuple[tuple[str, Path], ...]:
    """``vm1=./a.sock`` -> ("vm1", a.sock); a bare ``./b.sock`` is named "b"."""
    out: dict[str, Path] = {}
    for text in texts:
        name, eq, path = text.partition("=")
        if not eq or "/" in name:  # a path that happens to hold "="
            name, path = Path(text).stem, text
        if not name or not path:
            raise UsageError(f"--qmp-socket: not [NAME=]PATH: {text!r}")
        if name in out:
            raise UsageError(f"--qmp-socket: two VMs named {name!r}")
        out[name] = Path(path)
    return tuple(out.items())


def parse_listen(text: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen: not HOST:PORT: {text!r}")
    return (host or "127.0.0.1", int(port))


def main(args: list[str]) -> int:
    config = parse(args)
    return asyncio.run(serve(config, sys.stderr))
