"""Where the running Linux kernel was loaded (its KASLR slide), read while the guest runs from
where the image's banner reads in kernel memory (``qmpprof.linux.bannerslide``): what every
instruction set's platform can do (x86_64's reads its IDT first)."""

from __future__ import annotations

import asyncio
import time

from qmpprof.arch.base import InstructionSet
from qmpprof.errors import KernelMismatchError, NoKernelRunningError
from qmpprof.linux import bannerslide
from qmpprof.linux.kernel import LinuxKernel
from qmpprof.memory import reader
from qmpprof.transport.base import GuestTransport

WAIT = 10.0  # seconds to wait for a vCPU in the kernel (a guest busy in user code)
_IDLE = 0.02  # seconds between two looks at the vCPUs then
_NO_KERNEL = "no vCPU runs in the kernel: no KASLR slide (kernel not booted?)"


_CODE = 64  # bytes of code around a vCPU's pc compared with the image's


async def _running_code(
    control: GuestTransport, cpu: int, pc: int, kernel: LinuxKernel, arch: InstructionSet
) -> list[int]:
    """The slides the pc allows whose image code around it is the guest's, most of its words
    (one read: a busy guest's vCPU does not stay in the kernel through a read of every
    candidate's banner; the kernel patches a few instructions at boot), or all of them when
    that code does not read or no slide's matches."""
    slides = bannerslide.candidates(pc, kernel.span)
    at = pc & ~(_CODE - 1)
    (running,) = await reader(control, cpu)([(at, _CODE)])
    image, start = kernel.image.text_bytes, kernel.image.text_addr
    if running is None:
        return slides
    same = []
    for slide in slides:
        offset = ((at - slide) & arch.mask) - start
        code = image[offset : offset + _CODE] if offset >= 0 else b""
        words = sum(code[i : i + 4] == running[i : i + 4] for i in range(0, _CODE, 4))
        if len(code) == _CODE and 4 * words >= 3 * _CODE // 4:
            same.append(slide)
    return same or slides


async def slide_by_banner(
    control: GuestTransport,
    kernel: LinuxKernel,
    arch: InstructionSet,
    passes: int = 5,
    wait: float = WAIT,
) -> int:
    """The slide at which the guest holds the image's banner, from the candidates the pc of a
    vCPU in the kernel allows. Kernel memory reads through a vCPU only while it runs in the
    kernel (arm64 unmaps the kernel at EL0 where the CPU needs it), and the guest runs on: a
    pass in which the vCPU left for user code may find nothing, and is tried again, up to
    ``passes`` times; while every vCPU runs user code, for up to ``wait`` seconds (not at all
    in a paused guest, nor with ``--kallsyms``, whose slide the caller may take then:
    NoKernelRunningError)."""
    found = bannerslide.banner(kernel.image)
    if found is None:
        raise KernelMismatchError("the vCPU's registers show no IDT and the image no banner")
    link, text = found
    problem = ""  # why the banner's slide was not found, once a vCPU was in the kernel
    deadline = time.monotonic() + wait
    tried = 0
    while tried < passes:
        in_kernel = False
        for cpu in await control.cpus():
            regs = await control.registers(cpu)
            if regs.user or regs.pc < arch.shared_from:
                continue
            in_kernel = True
            slides = await _running_code(control, cpu, regs.pc, kernel, arch)
            reads = [((link + slide) & arch.mask, len(text)) for slide in slides]
            seen = await reader(control, cpu)(reads)
            matches = [slide for slide, data in zip(slides, seen, strict=True) if data == text]
            if len(matches) == 1:
                return matches[0]
            problem = (
                f"the image's banner reads in the guest at {len(matches)} of the {len(slides)}"
                f" slides vCPU {cpu}'s pc {regs.pc:#x} allows: not this guest's kernel?"
            )
            if matches:
                break
        if in_kernel:
            tried += 1
        elif kernel.kallsyms_slide is not None or time.monotonic() > deadline:
            break
        elif not await control.is_running():
            break  # paused (by its user, a debugger): no vCPU will get to the kernel
        else:
            await asyncio.sleep(_IDLE)
    if not tried:  # no pass met a vCPU in the kernel
        raise NoKernelRunningError(_NO_KERNEL)
    raise KernelMismatchError(problem)
