"""When the next tick is due, in guest run time: a full interval (optionally jittered) after
the guest ran again, however long the pause before took; a tick that came late makes the next
come that much sooner, at most one interval sooner (no burst after a long stall), so that the
rate in guest run time is the one asked.
"""

from __future__ import annotations

from collections.abc import Callable


class Pacing:
    """One run's ticks: ``wait`` before each, ``ran`` and ``held`` after, in that order."""

    def __init__(self, jitter: float, rng: Callable[[], float]) -> None:
        """``jitter``: each interval is scaled by a uniform factor in [1-jitter, 1+jitter]
        (``rng`` gives a uniform draw in [0, 1))."""
        self.jitter = jitter
        self.rng = rng
        self.late = 0.0  # run time the last tick came late by: the next one comes that much sooner
        self.interval = 0.0  # the one the next tick is due after (jittered)

    def wait(self, interval: float, ran: float) -> float:
        """Seconds to wait for the next tick, ``interval`` being the one in force and ``ran``
        the run time since the guest ran again."""
        self.interval = interval * (1 + self.jitter * (2 * self.rng() - 1))
        return max(0.0, self.interval - self.late - ran)

    def ran(self, ran: float) -> None:
        """The guest ran ``ran`` seconds before the tick: what the work between ticks (naming,
        housekeeping) and the sleep's wake-up added beyond the interval is made up next."""
        self.late = min(max(0.0, self.late + ran - self.interval), self.interval)

    def held(self, held: float) -> None:
        """The tick held the stop back ``held`` seconds while the guest ran on."""
        self.late = min(self.late + held, self.interval)
