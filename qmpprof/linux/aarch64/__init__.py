"""arm64 Linux: its Image made an ELF (``kernelimage``, ``relr``), what its code says where its
kallsyms name no data (``bootcode``: the initial task; ``modulelist``; ``percpu``), the
registers a task off CPU left in ``thread.cpu_context`` (``cpucontext``) and its exception
entry code (``vectors``)."""
