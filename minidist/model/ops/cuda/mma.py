"""The warp's tensor-core product and shuffle for minidist's kernels, and their CPU form.

``mma.sync.aligned.m16n8k16`` (NVIDIA's PTX ISA, "Warp-level matrix multiply-accumulate"): the
32 lanes of a warp together multiply a 16 x 16 A by a 16 x 8 B into a 16 x 8 float32 C, each
lane holding a fixed part of each operand in its registers.  With g = lane / 4 and t = lane % 4:
A's four registers hold rows g and g + 8, columns 2t, 2t + 1 and 2t + 8, 2t + 9 (two 16-bit
values a register, the lower column in the low half); B's two hold rows 2t, 2t + 1 and
2t + 8, 2t + 9 of column g; C's four floats rows g and g + 8, columns 2t and 2t + 1.

``SOURCE`` gives a kernel the 16-bit element type ``E`` (bf16 with ``IS_BF16`` 1, fp16 with 0),
its conversions (``to_float``, ``to_elem``, ``pack`` of two floats into one register), ``mma``
and ``shfl_xor``: inline PTX on a GPU and, compiled by a host compiler (tests/cuda_on_cpu.py,
where a block's threads are fibers that hand over at ``__syncthreads``), the same arithmetic
with the lanes' registers exchanged through a static array between two barriers.  So every
warp of a block must reach each ``mma`` and ``shfl_xor`` together, as it must on a GPU.  Used
by ``flash_mma.py``; tests/test_flash_mma_kernel.py pins the layout against a plain product.
"""

SOURCE = r"""
// IS_BF16: 1 for bfloat16, 0 for float16.  E is the element's 16 bits.
typedef unsigned short E;

#ifdef __CUDACC__
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float to_float(E h) {
#if IS_BF16
    return __uint_as_float((unsigned)h << 16);
#else
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
#endif
}
// two floats as the two 16-bit halves of one register, ``lo`` in the low half (the lower column)
__device__ __forceinline__ unsigned pack(float lo, float hi) {
    unsigned r;
#if IS_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}
__device__ __forceinline__ E to_elem(float f) { return (E)(pack(f, 0.f) & 0xffffu); }
// d = a b + c for a 16 x 16 A (row-major fragment), a 16 x 8 B (column-major fragment)
__device__ __forceinline__ void mma(float d[4], const unsigned a[4], const unsigned b[2]) {
#if IS_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
#else
// ---- the CPU form (tests/cuda_on_cpu.py): the same arithmetic, lanes exchanged via statics
#include <cstdint>
#include <cstring>
#include <limits>
#define __launch_bounds__(...)
inline float neg_inf() { return -std::numeric_limits<float>::infinity(); }
inline float bits_f(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned f_bits(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float to_float(E h) {
#if IS_BF16
    return bits_f((unsigned)h << 16);
#else
    _Float16 x; std::memcpy(&x, &h, 2); return (float)x;
#endif
}
inline E to_elem(float f) {
#if IS_BF16
    unsigned u = f_bits(f);  // round to nearest even, as cvt.rn
    if ((u & 0x7fffffffu) > 0x7f800000u) return (E)((u >> 16) | 0x40u);
    return (E)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#else
    _Float16 x = (_Float16)f; E h; std::memcpy(&h, &x, 2); return h;
#endif
}
inline unsigned pack(float lo, float hi) { return (unsigned)to_elem(lo) | ((unsigned)to_elem(hi) << 16); }
static unsigned lane_words[1024][6];
static float lane_floats[1024][4];
inline float half_of(unsigned w, int hi) { return to_float((E)(hi ? w >> 16 : w & 0xffffu)); }
// The warp's 32 lanes publish their fragments, then each computes its own four outputs.
inline void mma(float d[4], const unsigned a[4], const unsigned b[2]) {
    const int t = threadIdx.x, lane = t & 31, w0 = t - lane, g = lane >> 2, tg = lane & 3;
    for (int i = 0; i < 4; ++i) lane_words[t][i] = a[i];
    lane_words[t][4] = b[0]; lane_words[t][5] = b[1];
    __syncthreads();
    float out[4];
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1), col = 2 * tg + (e & 1);
        float sum = d[e];
        for (int k = 0; k < 16; ++k) {
            // A(row, k): lane (row % 8) * 4 + (k % 8) / 2, register (row / 8) + 2 (k / 8), half k % 2
            const float av = half_of(lane_words[w0 + (row % 8) * 4 + (k % 8) / 2][(row / 8) + 2 * (k / 8)], k & 1);
            // B(k, col): lane col * 4 + (k % 8) / 2, register 4 + k / 8, half k % 2
            const float bv = half_of(lane_words[w0 + col * 4 + (k % 8) / 2][4 + k / 8], k & 1);
            sum += av * bv;
        }
        out[e] = sum;
    }
    __syncthreads();
    for (int e = 0; e < 4; ++e) d[e] = out[e];
}
inline float shfl_xor(float v, int mask) {
    const int t = threadIdx.x, lane = t & 31;
    lane_floats[t][0] = v;
    __syncthreads();
    const float other = lane_floats[t - lane + (lane ^ mask)][0];
    __syncthreads();
    return other;
}
#endif
"""
