"""The overhead budget (``--max-overhead``): the interval in force, lengthened when the pauses
grow so that the guest stands stopped at most the share asked, shortened again when they shrink.

Under a budget the tick count is not known in advance: the run ends by guest run time.
"""

from __future__ import annotations

# Under a budget the intervals aim at this share of it: the stopped share then moves around
# that aim with the pauses, and stays under the budget itself.
HEADROOM = 0.9
# The weight of the newest pause in the running average the interval follows.
NEWEST = 0.2


class OverheadBudget:
    """The interval in force under a share of wall time the guest may stand stopped (``share``;
    None: no budget, the interval stays the one asked)."""

    def __init__(self, interval: float, share: float | None, max_interval: float) -> None:
        """``interval``: the one asked, never gone below; ``max_interval``: the longest it may
        grow to (never below ``interval``): pauses too long even then are let through."""
        self.asked = interval
        self.share = share
        self.ceiling = max(interval, max_interval)
        self.interval = interval
        self._pause_avg: float | None = None  # recent pauses, exponentially weighted

    def adapt(self, pause: float) -> None:
        """After a tick's ``pause``: the next interval long enough that pause / (pause +
        interval) stays within HEADROOM of the share, pauses weighted towards the recent ones
        (kept across runs: the weighting goes on from run to run)."""
        if self.share is None:
            return
        last = self._pause_avg
        self._pause_avg = pause if last is None else (1 - NEWEST) * last + NEWEST * pause
        aim = self.share * HEADROOM
        needed = self._pause_avg * (1 - aim) / aim
        self.interval = min(self.ceiling, max(self.asked, needed))

    def spent(self, run_time: float, duration: float) -> bool:
        """Whether a budgeted run is over: its guest run time reached ``duration``."""
        return self.share is not None and run_time >= duration
