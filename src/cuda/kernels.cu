// gradpack's CUDA kernels, compiled at run time by NVRTC (src/cuda/device.rs).
//
// Each kernel is the scalar reference of its CPU module written for one
// element per thread: src/codec/reference.rs (2-bit), src/quant/qsgd/portable.rs
// (`code`), src/quant/noise.rs (`bits`, `unit`), src/quant/onebit.rs.
// NVRTC runs with --fmad=false and IEEE division, so every float operation
// rounds exactly as the CPU's does and results are bit-identical.
//
// Error flags: a kernel that finds bad input records `n - i` for element
// `i` with atomicMax, so the host reads back the FIRST bad element (the
// largest `n - i`) and 0 means none. Kernels that may find bad input write
// only to buffers the caller discards on error (validate, then mutate).

typedef unsigned int u32;
typedef unsigned long long u64;

#define GP_FULL_MASK 0xffffffffu

__device__ __forceinline__ bool gp_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// Gradient element types (codec::Gradient): 0 float32, 1 float16, 2 bfloat16.
// Both 16-bit types widen to float32 exactly, as the CPU's `to_f32` does.
__device__ __forceinline__ float gp_widen(unsigned short h, int dtype) {
    if (dtype == 2) return __uint_as_float((u32)h << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float gp_load(const void* g, u64 i, int dtype) {
    return dtype == 0 ? ((const float*)g)[i] : gp_widen(((const unsigned short*)g)[i], dtype);
}

// ---------------------------------------------------------------- checks

// bad[0] <- n - i for the first i where r[i] + g[i] (or g[i] when r is
// null) is NaN or infinite; g of type dtype.
extern "C" __global__ void gp_check_finite(const void* __restrict__ g, const float* __restrict__ r, u64 n, u64* bad, int dtype) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float x = r ? r[i] + gp_load(g, i, dtype) : gp_load(g, i, dtype);
        if (!gp_finite(x)) atomicMax(bad, n - i);
    }
}

// bad[0] <- k - j for the first index idx[j] >= n.
extern "C" __global__ void gp_check_index(const u64* __restrict__ idx, u64 k, u64 n, u64* bad) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < k && idx[j] >= n) atomicMax(bad, k - j);
}

// ---------------------------------------------------------------- 2-bit

// One element of quantize (reference::quantize_one): the code, and the new
// residual in *next.
__device__ __forceinline__ u32 gp_q2_one(float x, float neg, float pos, float* next) {
    if (x >= pos) { *next = x - pos; return 1u; }
    if (x <= neg) { *next = x - neg; return 2u; }
    *next = x;
    return 0u;
}

// Four consecutive elements per thread, loaded and stored as float4 when
// `vec` (every pointer 16-byte aligned): four threads make one block word,
// whose codes sit at bits 31-2j, 30-2j for element j of the block; OR over
// the four. In place when next == r. Launch ceil(n / 4) threads in blocks
// of a multiple of 32, at least one block (thread 0 writes the header).
__device__ __forceinline__ void gp_q2_four(const void* g, const float* r, float* next, float* compr, u64 n, float neg, float pos,
                                           float size, u64* bad, int vec, int dtype) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 i0 = 4 * t;
    float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    bool whole = vec && i0 + 3 < n;
    if (whole) {
        float4 b = ((const float4*)r)[t];
        float a[4];
        if (dtype == 0) {
            float4 v = ((const float4*)g)[t];
            a[0] = v.x; a[1] = v.y; a[2] = v.z; a[3] = v.w;
        } else { // four 16-bit values (the host checked 8-byte alignment)
            uint2 v = ((const uint2*)g)[t];
            a[0] = gp_widen(v.x & 0xffffu, dtype); a[1] = gp_widen(v.x >> 16, dtype);
            a[2] = gp_widen(v.y & 0xffffu, dtype); a[3] = gp_widen(v.y >> 16, dtype);
        }
        x[0] = b.x + a[0]; x[1] = b.y + a[1]; x[2] = b.z + a[2]; x[3] = b.w + a[3];
    } else {
        for (int j = 0; j < 4; j++) if (i0 + j < n) x[j] = r[i0 + j] + gp_load(g, i0 + j, dtype);
    }
    u32 w = 0;
    float nx[4];
    u32 base = 30u - 8u * (u32)(t & 3u);
    for (int j = 0; j < 4; j++) {
        if (i0 + j < n) {
            if (bad && !gp_finite(x[j])) atomicMax(bad, n - (i0 + j));
            w |= gp_q2_one(x[j], neg, pos, &nx[j]) << (base - 2u * j);
        }
    }
    if (whole) {
        ((float4*)next)[t] = make_float4(nx[0], nx[1], nx[2], nx[3]);
    } else {
        for (int j = 0; j < 4; j++) if (i0 + j < n) next[i0 + j] = nx[j];
    }
    w |= __shfl_xor_sync(GP_FULL_MASK, w, 1);
    w |= __shfl_xor_sync(GP_FULL_MASK, w, 2);
    if (t == 0) { compr[0] = neg; compr[1] = pos; compr[2] = size; }
    if ((t & 3u) == 0 && i0 < n) ((u32*)(compr + 3))[i0 >> 4] = w;
}

// Out of place, at the memory floor: reads g and r, writes next and compr
// (header and blocks), and flags a non-finite r + g in bad.
extern "C" __global__ void gp_2bit_quantize_to(const void* __restrict__ g, const float* __restrict__ r, float* __restrict__ next,
                                               float* __restrict__ compr, u64 n, float neg, float pos, float size, u64* bad, int vec, int dtype) {
    gp_q2_four(g, r, next, compr, n, neg, pos, size, bad, vec, dtype);
}

// In place, for input that gp_check_finite has accepted.
extern "C" __global__ void gp_2bit_quantize(const void* __restrict__ g, float* r, float* __restrict__ compr, u64 n, float neg, float pos, float size, int vec, int dtype) {
    gp_q2_four(g, r, r, compr, n, neg, pos, size, (u64*)0, vec, dtype);
}

// bad[0] <- nwords - b for the first block b holding code 0b11; bad[1] <- 1
// when the last block's padding (past n) is not all 0b00.
extern "C" __global__ void gp_2bit_check(const u32* __restrict__ words, u64 nwords, u64 n, u64* bad) {
    u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b < nwords) {
        u32 w = words[b];
        if (w & (w >> 1) & 0x55555555u) atomicMax(bad, nwords - b);
        u32 rem = (u32)(n & 15u);
        if (b == nwords - 1 && rem != 0 && (w & ((1u << (2u * (16u - rem))) - 1u)) != 0) atomicMax(bad + 1, 1ull);
    }
}

// out = decode(words), or out += decode(words) when add; words checked.
// Four elements per thread, as float4 when `vec` (out 16-byte aligned).
extern "C" __global__ void gp_2bit_dequantize(const u32* __restrict__ words, float* __restrict__ out, u64 n, float neg, float pos, int add, int vec) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 i0 = 4 * t;
    if (i0 >= n) return;
    u32 w = words[i0 >> 4] >> (30u - 8u * (u32)(t & 3u) - 6u); // the four codes in bits 7..0
    float v[4];
    for (int j = 0; j < 4; j++) {
        u32 c = (w >> (6u - 2u * j)) & 3u;
        v[j] = c == 1u ? pos : (c == 2u ? neg : 0.0f);
    }
    if (vec && i0 + 3 < n) {
        float4* o = (float4*)out + t;
        if (add) { float4 a = *o; v[0] = a.x + v[0]; v[1] = a.y + v[1]; v[2] = a.z + v[2]; v[3] = a.w + v[3]; }
        *o = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        for (int j = 0; j < 4; j++) if (i0 + j < n) { if (add) out[i0 + j] += v[j]; else out[i0 + j] = v[j]; }
    }
}

// ---------------------------------------------------------------- noise and QSGD

// noise::bits: a keyed two-round multiply-xorshift hash of the index's low half.
__device__ __forceinline__ u32 gp_bits(u32 k0, u32 k1, u32 i) {
    u32 x = i ^ k0;
    x ^= x >> 16;
    x *= 0x21f0aaadu;
    x ^= (x >> 15) ^ k1;
    x *= 0x735a2d97u;
    return x ^ (x >> 15);
}

// noise::unit: a uniform float in [0, 1) on a grid of 2^-24.
__device__ __forceinline__ float gp_unit(u32 k0, u32 k1, u32 i) {
    return (float)(int)(gp_bits(k0, k1, i) >> 8) * 5.9604644775390625e-8f;
}

// out[j] = unit(first + j) for j < n (the noise test's kernel).
extern "C" __global__ void gp_noise_fill(u32 k0, u32 k1, u32 first, float* __restrict__ out, u64 n) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n) out[j] = gp_unit(k0, k1, first + (u32)j);
}

// qsgd kernels::code, for f >= 0 and s in [0, 2^30] (the host makes them so).
__device__ __forceinline__ int gp_qsgd_code(float g, float u, float f, float s) {
    float l = fminf(fabsf(g) * f, s); // fminf takes s over a NaN, as f32::min does
    int fl = (int)l;
    int level = fl + (u < l - (float)fl ? 1 : 0);
    return g < 0.0f ? -level : level;
}

// Codes of g[j], element first + j of the noise stream (k0, k1); added to
// codes when add (a sum over members). Four elements per thread, as float4
// and int4 when `vec` (both 16-byte aligned).
extern "C" __global__ void gp_qsgd_quantize(const float* __restrict__ g, int* __restrict__ codes, u64 n, u32 k0, u32 k1, u32 first, float f, float s, int add, int vec) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 j0 = 4 * t;
    if (j0 >= n) return;
    if (vec && j0 + 3 < n) {
        float4 v = ((const float4*)g)[t];
        u32 i = first + (u32)j0;
        int4 c = make_int4(gp_qsgd_code(v.x, gp_unit(k0, k1, i), f, s), gp_qsgd_code(v.y, gp_unit(k0, k1, i + 1u), f, s),
                           gp_qsgd_code(v.z, gp_unit(k0, k1, i + 2u), f, s), gp_qsgd_code(v.w, gp_unit(k0, k1, i + 3u), f, s));
        int4* o = (int4*)codes + t;
        if (add) { int4 a = *o; c.x += a.x; c.y += a.y; c.z += a.z; c.w += a.w; }
        *o = c;
    } else {
        for (u64 j = j0; j < n && j < j0 + 4; j++) {
            int c = gp_qsgd_code(g[j], gp_unit(k0, k1, first + (u32)j), f, s);
            if (add) codes[j] += c; else codes[j] = c;
        }
    }
}

// out[i] = c[i] * step, in double, rounded once (qsgd::decode_at).
extern "C" __global__ void gp_qsgd_decode(const int* __restrict__ c, float* __restrict__ out, u64 n, double step) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __double2float_rn((double)c[i] * step);
}

// (max |x| as float bits, any non-finite) over x, grid-stride, as float4
// when `vec` (x 16-byte aligned); max is exact in any order, so it equals
// the CPU's.
__device__ __forceinline__ void gp_max_one(float v, u32* m, u32* nonfinite) {
    u32 b = __float_as_uint(v) & 0x7fffffffu;
    if (b >= 0x7f800000u) *nonfinite = 1; else *m = max(*m, b);
}

extern "C" __global__ void gp_max_abs(const float* __restrict__ x, u64 n, u32* maxbits, u64* bad, int vec) {
    u32 m = 0, nonfinite = 0;
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    u64 quads = vec ? n / 4 : 0;
    for (u64 q = t; q < quads; q += stride) {
        float4 v = ((const float4*)x)[q];
        gp_max_one(v.x, &m, &nonfinite); gp_max_one(v.y, &m, &nonfinite);
        gp_max_one(v.z, &m, &nonfinite); gp_max_one(v.w, &m, &nonfinite);
    }
    for (u64 i = 4 * quads + t; i < n; i += stride) gp_max_one(x[i], &m, &nonfinite);
    for (int d = 16; d > 0; d >>= 1) {
        m = max(m, __shfl_xor_sync(GP_FULL_MASK, m, d));
        nonfinite |= __shfl_xor_sync(GP_FULL_MASK, nonfinite, d);
    }
    if ((threadIdx.x & 31u) == 0) {
        atomicMax(maxbits, m);
        if (nonfinite) atomicMax(bad, 1ull);
    }
}

// ---------------------------------------------------------------- 1-bit

// onebit::quantize on input gp_check_finite has accepted: r += g; the bit is
// r > threshold; r -= 1 for a 1, r += 1 for a 0. Added to bits when add.
// Four elements per thread, vectorized when `vec` (all 16-byte aligned).
__device__ __forceinline__ int gp_1bit_one(float g, float* r, float threshold) {
    float x = *r + g;
    int bit = x > threshold;
    *r = bit ? x - 1.0f : x + 1.0f;
    return bit;
}

extern "C" __global__ void gp_1bit_quantize(const float* __restrict__ g, float* r, int* __restrict__ bits, u64 n, float threshold, int add, int vec) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 i0 = 4 * t;
    if (i0 >= n) return;
    if (vec && i0 + 3 < n) {
        float4 gv = ((const float4*)g)[t], rv = ((float4*)r)[t];
        int4 b = make_int4(gp_1bit_one(gv.x, &rv.x, threshold), gp_1bit_one(gv.y, &rv.y, threshold),
                           gp_1bit_one(gv.z, &rv.z, threshold), gp_1bit_one(gv.w, &rv.w, threshold));
        ((float4*)r)[t] = rv;
        int4* o = (int4*)bits + t;
        if (add) { int4 a = *o; b.x += a.x; b.y += a.y; b.z += a.z; b.w += a.w; }
        *o = b;
    } else {
        for (u64 i = i0; i < n && i < i0 + 4; i++) {
            int bit = gp_1bit_one(g[i], &r[i], threshold);
            if (add) bits[i] += bit; else bits[i] = bit;
        }
    }
}

// out[i] = 2 c[i] - workers: c of the workers sent +1, the others -1.
extern "C" __global__ void gp_1bit_decode(const int* __restrict__ c, float* __restrict__ out, u64 n, int workers) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (float)(2 * c[i] - workers);
}

// ---------------------------------------------------------------- random-K

// out[j] = x[idx[j]] (indices checked by gp_check_index).
extern "C" __global__ void gp_gather(const float* __restrict__ x, const u64* __restrict__ idx, float* __restrict__ out, u64 k) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < k) out[j] = x[idx[j]];
}

// out[idx[j]] = v[j] (indices checked; out zeroed by the host first).
extern "C" __global__ void gp_scatter(const float* __restrict__ v, const u64* __restrict__ idx, float* __restrict__ out, u64 k) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < k) out[idx[j]] = v[j];
}
