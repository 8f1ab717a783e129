"""The run's facts as writers show them: a title naming the run and a one-line summary.

``Profile.facts`` is ordered; the key ``guest`` (what was profiled) names the run when present.
"""

from __future__ import annotations

from qmpprof.profile import Profile

NAME_KEY = "guest"
# Where the run put kernel code (``0x…``): a profile read back (a pprof) tells kernel frames by it.
BOUNDARY_KEY = "kernel boundary"


def title(profile: Profile) -> str:
    guest = profile.facts.get(NAME_KEY)
    return f"qmpprof: {guest}" if guest else "qmpprof profile"


def summary(profile: Profile) -> str:
    """Every fact as ``key: value``, in the profile's order (the order the sampler chose)."""
    return "  ·  ".join(f"{key}: {value}" for key, value in profile.facts.items())
