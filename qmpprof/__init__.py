"""qmpprof: a sampling profiler for OS kernels and their user processes running in QEMU."""

__version__ = "0.1.0"
