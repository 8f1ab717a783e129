"""``qmpprof serve``: continuous profiling of several VMs behind a Go-style pprof endpoint.

- ``ring.py``: per-second aggregates of one VM over the retention window (bounded memory);
- ``vm.py``: one VM's worker (connect, sample, reconnect) and what it measured;
- ``views.py``: the index page;
- ``metrics.py``: the Prometheus metrics (``prometheus_client``, a registry per daemon);
- ``endpoints.py``: the HTTP endpoints, answered from the rings in threads of their own;
- ``daemon.py``: the VMs to follow (sockets given, a directory rescanned), signals, shutdown.
"""
