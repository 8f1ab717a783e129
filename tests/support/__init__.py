"""Code the tests and scripts/bench share, outside the installed package: the benchmark harness
(``bench/``) and synthetic stacks for measuring the unwinder offline (``synthetic.py``)."""
