"""x86_64 Linux: its ORC tables (``orctables``; ``orcstep.OrcStep`` walks with
them), the KASLR slide its interrupt table's gates give away (``idt``), and the registers a
task off CPU left in its ``inactive_task_frame`` (``taskframe``)."""
