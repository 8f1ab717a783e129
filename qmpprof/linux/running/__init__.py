"""Linux as a guest OS, read from the kernel's own description: its image (``qmpprof.linux``
reads the bzImage, kallsyms, ORC and BTF), then, in the running guest, where it was loaded
(``slide``, and each instruction set's ``platform``), its modules (``modules``), each vCPU's
current task (``current``), the tasks (``tasks``) and the processes' address spaces
(``spaces``, ``vma``, ``pagetables``), put together by ``guest.LinuxGuest``; ``linuxos`` is the
guest OS the registry knows, ``kernels`` the kernels it loads.

This package's ``__init__`` imports nothing, so that an instruction set's platform can import
the parts it builds on without the whole guest coming back half-loaded.
"""
