// Shared by every generated modifier functor (cuflash/modifiers.py).
// Needs no header under NVRTC; a host compiler gets <math.h>.
#ifndef CUFLASH_MODIFIER_PRELUDE
#define CUFLASH_MODIFIER_PRELUDE
#if defined(__CUDACC__)
#define CUFLASH_MOD_FN __host__ __device__ __forceinline__
#else
#include <math.h>
#define CUFLASH_MOD_FN inline
#endif
#if defined(__CUDA_ARCH__)
#define CUFLASH_MOD_INF __int_as_float(0x7f800000)
#define CUFLASH_MOD_NAN __int_as_float(0x7fffffff)
#else
#define CUFLASH_MOD_INF __builtin_huge_valf()
#define CUFLASH_MOD_NAN __builtin_nanf("")
#endif

// The arrays a modifier reads: element pointer, strides and shape in elements,
// per slot (dtype and rank are known to each functor). Passed to the kernel by
// value; laid out as MODIFIER_ARRAYS_DTYPE.
struct ModifierArrays {
    const void* data[4];
    long long stride[4][4];
    long long shape[4][4];
};

// Python's // and % (floor semantics); a zero divisor gives 0.
CUFLASH_MOD_FN int cuflash_mod_floordiv(int a, int b) {
    if (b == 0) return 0;
    const int q = a / b;
    return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
CUFLASH_MOD_FN long long cuflash_mod_floordiv(long long a, long long b) {
    if (b == 0) return 0;
    const long long q = a / b;
    return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
CUFLASH_MOD_FN int cuflash_mod_mod(int a, int b) {
    if (b == 0) return 0;
    const int r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
CUFLASH_MOD_FN long long cuflash_mod_mod(long long a, long long b) {
    if (b == 0) return 0;
    const long long r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
CUFLASH_MOD_FN int cuflash_mod_abs(int a) { return a < 0 ? -a : a; }
CUFLASH_MOD_FN long long cuflash_mod_abs(long long a) { return a < 0 ? -a : a; }
CUFLASH_MOD_FN float cuflash_mod_abs(float a) { return fabsf(a); }
CUFLASH_MOD_FN int cuflash_mod_min(int a, int b) { return b < a ? b : a; }
CUFLASH_MOD_FN long long cuflash_mod_min(long long a, long long b) { return b < a ? b : a; }
CUFLASH_MOD_FN float cuflash_mod_min(float a, float b) { return fminf(a, b); }
CUFLASH_MOD_FN int cuflash_mod_max(int a, int b) { return b > a ? b : a; }
CUFLASH_MOD_FN long long cuflash_mod_max(long long a, long long b) { return b > a ? b : a; }
CUFLASH_MOD_FN float cuflash_mod_max(float a, float b) { return fmaxf(a, b); }

// An index clamped into [0, extent): no read leaves its array, whatever the values.
CUFLASH_MOD_FN long long cuflash_mod_clamp(long long index, long long extent) {
    return index < 0 ? 0 : (index >= extent ? extent - 1 : index);
}
template <typename T>
CUFLASH_MOD_FN T cuflash_mod_load(const void* data, long long offset) {
#if defined(__CUDA_ARCH__)
    return __ldg(static_cast<const T*>(data) + offset);
#else
    return static_cast<const T*>(data)[offset];
#endif
}

// The identities, for kernels instantiated without a user modifier.
struct NoScoreMod {
    static constexpr bool is_identity = true;
    CUFLASH_MOD_FN float operator()(float score, int, int, int, int, const ModifierArrays&) const {
        return score;
    }
    CUFLASH_MOD_FN float grad(float, int, int, int, int, const ModifierArrays&) const {
        return 1.0f;
    }
};
struct NoMaskMod {
    static constexpr bool is_identity = true;
    CUFLASH_MOD_FN bool operator()(int, int, int, int, const ModifierArrays&) const { return true; }
};
#endif  // CUFLASH_MODIFIER_PRELUDE
