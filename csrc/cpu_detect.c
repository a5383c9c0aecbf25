/* Whether this CPU runs the variant a library was built as (see cpu_simd.h). Compiled without the
 * variant's -m flags, for the baseline ISA, and linked into every variant's library, so that
 * asking is safe on any CPU: the rest of an avx512 library may not run on an AVX2-only one. */
#include <stdint.h>

/* Floats per vector of this library's variant: 16 (avx512), 8 (avx2) or 4 (portable). */
int ringctx_simd_width(void) { return RINGCTX_VEC; }

int ringctx_cpu_kernels_supported(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
#if RINGCTX_VEC == 16
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2");
#elif RINGCTX_VEC == 8
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 1;
#endif
#else
    return 1; /* the portable variant: the baseline ISA of the target (NEON on arm64) */
#endif
}
