/* Functions inlined two levels deep, for the DWARF line and inlined-frame tests. */
volatile unsigned long sink;

static inline __attribute__((always_inline)) unsigned long mix(unsigned long x) {
    x ^= x << 13;
    x ^= x >> 7;
    return x ^ (x << 17);
}

static inline __attribute__((always_inline)) unsigned long round2(unsigned long x) {
    for (int i = 0; i < 4; i++) {
        x = mix(x) + (unsigned long)i;
        sink = x;
    }
    return x;
}

__attribute__((noinline)) unsigned long outer(unsigned long x) {
    unsigned long y = round2(x);
    sink = y;
    return round2(y + 1);
}

int main(int argc, char **argv) {
    (void)argv;
    return (int)outer((unsigned long)argc);
}
