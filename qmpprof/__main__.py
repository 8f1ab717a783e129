"""``python -m qmpprof``: the same as the ``qmpprof`` console script."""

import sys

from qmpprof.cli import main

sys.exit(main())
