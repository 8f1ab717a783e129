"""Linux, the guest OS: its kernel files read alone (this package's top modules, pure readers of
bytes and text), the running guest (``running``), and what Linux does its own way on each
instruction set (one subpackage each: ``x86_64``, ``aarch64``).

``bzimage`` turns the kernel file as found in /boot into the vmlinux ELF (its decompressors
serve arm64's compressed Images too); ``kallsymtables`` finds the symbol tables every kernel
carries in its ``.rodata`` and ``kallsyms`` decodes them, checked against the image;
``symbols`` holds what both kallsyms and a System.map or /proc/kallsyms text give: addresses,
type letters and names, and the ``SymbolTable`` of text symbols built from them; ``btf`` reads
its BTF types (struct offsets).

Nothing at the top or in the instruction sets' readers imports a transport, the guest or the
unwinder; the running guest is ``qmpprof.linux.running``.
"""
