"""What a sampling run measured about itself: counts, pauses, where the pause time went.

Failures inside one sample are counted here by kind, never raised; filtered samples (not asked
for with --kernel-only / --user-only) are counted apart, they are not failures.
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections import Counter
from dataclasses import dataclass, field

from qmpprof.profile import share_margin

# Phases of one pause, in the order they happen while the guest is stopped.
PHASES = ("stop", "registers", "memory", "unwind", "cont")


@dataclass(slots=True)
class SamplerStats:
    ticks: int = 0  # stop/cont cycles (each samples every selected vCPU)
    filtered: int = 0  # vCPU samples left out by the mode filter
    mode_mismatch: int = 0  # the pc's side of the kernel boundary disagreed with the CPU's mode
    errors: Counter[str] = field(default_factory=Counter)
    pauses: array[float] = field(default_factory=lambda: array("d"))  # seconds stopped, per tick
    phase_time: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    run_time: float = 0.0  # seconds the guest ran between samples
    wall_time: float = 0.0  # seconds from the first to the last tick
    requested_hz: float = 0.0  # the rate asked for (1 / --interval)
    budget: float | None = None  # --max-overhead, as a fraction

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def rate_hz(self) -> float:
        """Ticks per second of guest run time (the rate the profile represents)."""
        return self.ticks / self.run_time if self.run_time > 0 else 0.0

    def wall_rate_hz(self) -> float:
        return self.ticks / self.wall_time if self.wall_time > 0 else 0.0

    def running_fraction(self) -> float:
        """Fraction of wall time the guest ran (the rest it spent stopped by qmpprof)."""
        if self.wall_time <= 0:
            return 1.0
        return max(0.0, 1.0 - sum(self.pauses) / self.wall_time)

    def pause_ms(self) -> tuple[float, float, float]:
        """Median, 95th percentile and maximum pause per tick, in milliseconds."""
        if not self.pauses:
            return (0.0, 0.0, 0.0)
        ordered = sorted(self.pauses)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return (statistics.median(ordered) * 1e3, p95 * 1e3, ordered[-1] * 1e3)

    def phase_ms(self) -> dict[str, float]:
        """Mean milliseconds per tick spent in each phase of the pause."""
        n = max(1, len(self.pauses))
        return {name: total * 1e3 / n for name, total in self.phase_time.items()}

    def summary_lines(self, samples: int, truncated: int, unique_stacks: int) -> list[str]:
        """``samples`` (of which ``truncated``) and ``unique_stacks`` are the profile's counts."""
        median, p95, worst = self.pause_ms()
        lines = [
            f"Samples: {samples}  Errors: {self.error_count}  Truncated: {truncated}"
            f"  Filtered: {self.filtered}  Unique stacks: {unique_stacks}"
        ]
        if self.run_time > 0:  # not for a single snapshot
            lines.append(
                f"Rate: {self.rate_hz():.1f} Hz of guest run time ({self.wall_rate_hz():.1f} Hz"
                f" wall; {self.requested_hz:.1f} Hz asked), {self.ticks} ticks, guest ran"
                f" {self.running_fraction():.1%} of {self.wall_time:.2f} s"
            )
            stopped = 1 - self.running_fraction()
            if self.budget is not None:
                lines.append(
                    f"Overhead: the guest stood stopped {stopped:.1%} of the wall time"
                    f" (budget {self.budget:.1%})"
                )
        first = self.pauses[0] * 1e3 if self.pauses else 0.0
        lines.append(
            f"Pause per sample: median {median:.2f} ms, p95 {p95:.2f} ms, max {worst:.2f} ms,"
            f" first {first:.2f} ms"
        )
        lines.extend(f"  error: {kind} x{n}" for kind, n in self.errors.most_common())
        margin = few_samples_margin(samples) if self.run_time > 0 else None
        if margin is not None:
            lines.append(
                f"Warning: only {samples} samples: a share of the profile is known to"
                f" +-{margin:.0f} points at best (95 %); profile longer or more often"
            )
        return lines

    def detail_lines(self) -> list[str]:
        """Where the pause time went (for --verbose)."""
        phases = ", ".join(f"{name} {ms:.3f}" for name, ms in self.phase_ms().items())
        lines = [f"Pause breakdown (mean ms per tick): {phases}"]
        if self.mode_mismatch:
            lines.append(
                f"the CPU's mode (user or kernel) disagreed with the kernel boundary in"
                f" {self.mode_mismatch} samples (--kernel-boundary sets it)"
            )
        return lines


TRUSTED_MARGIN = 5.0  # points: below this many samples a profile's shares are too rough
TRUSTED_SAMPLES = math.ceil(0.25 * (196 / TRUSTED_MARGIN) ** 2)  # 385: the fewest within it


def few_samples_margin(samples: int) -> float | None:
    """The 95 % margin, in percentage points, of a share near one half estimated from
    ``samples`` samples, when it is wider than TRUSTED_MARGIN (else None)."""
    if samples <= 0:
        return None
    margin = share_margin(samples)
    return margin if margin > TRUSTED_MARGIN else None
