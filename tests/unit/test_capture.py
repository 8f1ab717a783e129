"""What is read while the guest stands stopped (capture.Capture), on a scripted fake transport:
stop then every vCPU's registers, each vCPU's stack walked; a refused register read and a bad
sample counted, not raised; a vCPU in the mode not kept captured without a read of its memory."""

from __future__ import annotations

from fakes import (
    FakeClock,
    FakeSpace,
    FakeTransport,
    FramePointerUnwinder,
    KernelIdentifier,
    regs,
)
from test_sampler import SPACE, kernel_cpu

from qmpprof.capture import Capture
from qmpprof.errors import TransportError
from qmpprof.memory import StackReader
from qmpprof.model import Mode, StopReason
from qmpprof.stats import SamplerStats

K = FramePointerUnwinder().kernel_boundary


def capture(
    transport: FakeTransport, keep: Mode | None = None
) -> Capture[FakeSpace, tuple[tuple[int, ...], StopReason]]:
    return Capture(
        transport, FramePointerUnwinder(), KernelIdentifier(SPACE),
        StackReader(transport, 4096, 8), boundary=K, keep=keep, clock=transport.clock,
    )  # fmt: skip


async def test_stop_then_every_vcpus_registers_then_their_stacks_each_walked() -> None:
    r0, pages = kernel_cpu(0)
    clock = FakeClock(now=2.0)
    transport = FakeTransport({0: r0, 1: regs(1, K + 0x3008, rsp=r0.sp, rbp=r0.fp)}, pages,
                              clock=clock)  # fmt: skip
    stats = SamplerStats()
    captured = await capture(transport).every_cpu([0, 1], stats, 1.5, stop=True)
    assert transport.calls[:3] == ["stop", "registers:0", "registers:1"]
    assert "cont" not in transport.calls  # resuming is the sampler's
    assert [(c.regs.cpu, c.mode, c.error, c.time) for c in captured] == [
        (0, Mode.KERNEL, None, 0.5), (1, Mode.KERNEL, None, 0.5),
    ]  # fmt: skip
    assert all(c.raw is not None and c.space is SPACE for c in captured)
    assert {"stop", "registers", "memory", "unwind"} <= set(stats.phase_time)


async def test_a_refused_register_read_and_a_bad_sample_are_counted_not_raised() -> None:
    r0, pages = kernel_cpu(0)

    def hook(name: str, stops: int) -> None:
        if name == "registers:1":
            raise TransportError("no registers for vCPU 1")
        if name.startswith("read"):
            raise RuntimeError("reader bug")

    transport = FakeTransport({0: r0, 1: r0}, pages, hook=hook)
    stats = SamplerStats()
    captured = await capture(transport).every_cpu([0, 1], stats, 0.0, stop=False)
    assert "stop" not in transport.calls
    assert stats.errors == {"registers: no registers for vCPU 1": 1}
    (only,) = captured
    assert only.error == "RuntimeError: reader bug" and only.raw is None


async def test_a_vcpu_in_the_mode_not_kept_is_captured_without_reading_its_memory() -> None:
    user = regs(0, 0x40_1020, rsp=0x7FFF_0000, rbp=0, cpl=3)
    transport = FakeTransport({0: user}, {})
    stats = SamplerStats()
    (captured,) = await capture(transport, Mode.KERNEL).every_cpu([0], stats, 0.0, stop=True)
    assert captured.mode is Mode.USER and captured.raw is None and captured.error is None
    assert not any(c.startswith("read") for c in transport.calls)
    assert stats.mode_mismatch == 0
