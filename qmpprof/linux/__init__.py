"""What qmpprof reads from a stock Linux kernel image: ORC unwind tables, BTF types, symbols."""
