/* A program whose functions exercise the CFI gcc emits: alloca (CFA on rbp), many callee-saved
   registers, varargs, recursion, a noreturn call, and a deep call chain for unwinding tests. */
#include <alloca.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

volatile int sink;

__attribute__((noinline)) int uw_leaf(int n) {
    sink = n;
    return n * 3;
}

__attribute__((noinline)) int uw_with_alloca(int n) {
    char *p = alloca(n + 16);
    memset(p, n, n + 16);
    return uw_leaf(p[n]) + p[0];
}

__attribute__((noinline)) int uw_many_saved(int a, int b, int c, int d, int e, int f) {
    int x = uw_leaf(a) + uw_leaf(b), y = uw_leaf(c) * uw_leaf(d), z = uw_leaf(e) - uw_leaf(f);
    return uw_with_alloca(x & 63) + y + z + a * b * c;
}

__attribute__((noinline)) int uw_sum(int count, ...) {
    va_list ap;
    va_start(ap, count);
    int total = 0;
    for (int i = 0; i < count; i++) total += va_arg(ap, int);
    va_end(ap);
    return total + uw_many_saved(count, total, 3, 4, 5, 6);
}

__attribute__((noinline)) int uw_recurse(int depth) {
    if (depth == 0) return uw_sum(3, 1, 2, 3);
    return uw_recurse(depth - 1) + depth;
}

__attribute__((noinline, noreturn)) void uw_die(int code) {
    sink = code;
    exit(code);
}

int main(int argc, char **argv) {
    int r = uw_recurse(argc + 2);
    if (r < 0) uw_die(r);
    return r & 1;
}
