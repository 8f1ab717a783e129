"""A kernel described in a few lines of C expressions (``--describe``): who runs on a vCPU."""
