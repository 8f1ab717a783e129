"""Stock Linux guests, from the files in /boot alone.

``bzimage`` turns the kernel file as found in /boot into the vmlinux ELF; ``kallsymtables``
finds the symbol tables every kernel carries in its ``.rodata`` and ``kallsyms`` decodes them,
checked against the image; ``symbols`` holds what both
kallsyms and a System.map or /proc/kallsyms text give: addresses, type letters and names, and
the ``SymbolTable`` of text symbols built from them; ``orc`` reads the kernel's ORC unwind
tables (``qmpprof.unwind.orc.OrcStep`` walks with them); ``btf`` reads its BTF types (struct
offsets); ``kaslr`` votes for the running kernel's KASLR slide from its interrupt table's gates.

Nothing here imports a transport, the guest or the unwinder: these are pure readers of bytes and
text. Linux as a guest OS, which reads the running guest, is ``qmpprof.linux.running``.
"""
