/* A program built with neither CFI nor frame pointers (test_unwind_scan.py): leaf <- mid <-
   outer <- main, each with its own stack use (callee-saved pushes, a local array, alloca's
   frame pointer and `leave`, a branch to a call that never returns). leaf writes its pc, its
   stack pointer and frame pointer and the 1 KiB of stack above them (all four frames) to stdout. */
#include <alloca.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

__attribute__((noinline)) static long leaf(long n) {
    uint64_t regs[3];
    __asm__ volatile("lea 0(%%rip), %0\n\tmov %%rsp, %1\n\tmov %%rbp, %2"
                     : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]));
    if (write(1, regs, sizeof regs) != sizeof regs ||
        write(1, (void *)regs[1], 1024) != 1024)
        abort();
    return n + 1;
}

__attribute__((noinline)) static long mid(long n) {
    volatile char buf[200];
    memset((char *)buf, (int)n, sizeof buf);
    if (buf[n % 7] == 99)
        abort();  /* never taken: a call that does not return, then other code */
    long r = leaf(n + buf[3]);
    for (int i = 0; i < 16; i++)
        r += buf[i * 3];
    return r;
}

__attribute__((noinline)) static long outer(long n) {
    char *p = alloca((size_t)n + 16);  /* a frame pointer, torn down by `leave` */
    memset(p, 1, (size_t)n + 16);
    long r = mid(n + p[n]);
    return r * 3 + p[1];
}

int main(int argc, char **argv) {
    (void)argv;
    long r = outer(argc + 40);
    return (int)(r & 1);
}
