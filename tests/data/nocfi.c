/* A program built with neither CFI nor frame pointers (test_unwind_scan.py): leaf <- mid <-
   never_returns <- outer <- main, each with its own stack use (callee-saved pushes, a local
   array, alloca's frame pointer and `leave`, a branch to a call that never returns, a function
   that ends in exit and is called through a pointer). leaf writes its pc, its stack pointer and
   frame pointer and the 1 KiB of stack above them (all five frames) to stdout. */
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

/* No path returns: its caller is found from its start (a code pointer in .data). */
__attribute__((noinline)) static void never_returns(long n) {
    long r = mid(n + 1);
    exit((int)(r & 1));
}

static void (*volatile call_it)(long) = never_returns;

__attribute__((noinline)) static long outer(long n) {
    char *p = alloca((size_t)n + 16);  /* a frame pointer, torn down by `leave` */
    memset(p, 1, (size_t)n + 16);
    call_it(n + p[n]);
    return p[1];
}

int main(int argc, char **argv) {
    (void)argv;
    long r = outer(argc + 40);
    return (int)(r & 1);
}
