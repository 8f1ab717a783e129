"""ELF files: headers, text, symbols and CFI of the kernel and user programs."""
