"""DWARF from bytes: the encodings, the CFA program interpreter, the CFI table of one image, the
expression evaluator and the line-number program. Pure parsing; ``elf`` and ``unwind`` use it."""
