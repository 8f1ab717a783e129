"""Run inside gdb: stop at a breakpoint, save the registers, the stack memory and gdb's backtrace.

Environment: SNAP_BREAK (a gdb location, e.g. "*leaf"), SNAP_CALLER (continue until the
caller frame has this name; empty = first hit), SNAP_OUT (output prefix: .json and .stack).
"""

import json
import os

import gdb

gdb.execute("set pagination off")
gdb.execute("set startup-with-shell off")
gdb.execute("starti", to_string=True)
gdb.execute("break " + os.environ["SNAP_BREAK"], to_string=True)
caller = os.environ.get("SNAP_CALLER", "")
for _ in range(1000):
    gdb.execute("continue", to_string=True)
    older = gdb.newest_frame().older()
    if not caller or (older is not None and older.name() == caller):
        break

regs = {}
for name in (
    "rax",
    "rdx",
    "rcx",
    "rbx",
    "rsi",
    "rdi",
    "rbp",
    "rsp",
    "r8",
    "r9",
    "r10",
    "r11",
    "r12",
    "r13",
    "r14",
    "r15",
    "rip",
):
    regs[name] = int(gdb.parse_and_eval("$" + name).cast(gdb.lookup_type("unsigned long")))
stack_end = 0
for line in gdb.execute("info proc mappings", to_string=True).splitlines():
    fields = line.split()
    if fields and fields[-1] == "[stack]":
        stack_end = int(fields[1], 16)
start = regs["rsp"] & ~0xFFF
memory = gdb.selected_inferior().read_memory(start, stack_end - start)
frames = []
frame = gdb.newest_frame()
while frame is not None:
    frames.append([frame.pc(), frame.name()])
    frame = frame.older()
main = int(gdb.parse_and_eval("&main").cast(gdb.lookup_type("unsigned long")))
out = os.environ["SNAP_OUT"]
with open(out + ".stack", "wb") as f:
    f.write(bytes(memory))
with open(out + ".json", "w") as f:
    json.dump({"regs": regs, "stack_start": start, "frames": frames, "main": main}, f)
gdb.execute("kill")
