// C++ with exceptions: CIEs with "zPLR" augmentation (personality, LSDA) and, with
// -mno-accumulate-outgoing-args -m32-style pushes of stack arguments, DW_CFA_GNU_args_size.
#include <stdexcept>
#include <string>

struct Big { long a, b, c, d, e, f, g, h; };

__attribute__((noinline)) long take(Big x, Big y, int n) {
    if (n < 0) throw std::runtime_error("negative " + std::to_string(n));
    return x.a + y.h + n;
}

__attribute__((noinline)) long call_many(int n) {
    Big a{1, 2, 3, 4, 5, 6, 7, 8}, b{8, 7, 6, 5, 4, 3, 2, 1};
    std::string s(static_cast<size_t>(n), 'x');
    return take(a, b, n) + static_cast<long>(s.size());
}

int main(int argc, char **) {
    try {
        return static_cast<int>(call_many(argc - 5));
    } catch (const std::exception &) {
        return 3;
    }
}
