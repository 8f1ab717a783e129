"""DWARF call-frame information: the encodings, the CFA program interpreter, the CFI table of one
image and the expression evaluator. Pure parsing over bytes; ``elf`` and ``unwind`` both use it."""
