"""Linux on riscv64: its kernel file (``kernelfile``) and its running kernel (``running``), the
instruction set's two platforms (``qmpprof.linux.platforms``,
``qmpprof.linux.running.platforms``)."""
