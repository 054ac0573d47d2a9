// AVX-512 helpers shared by kernels: 16 bf16 widened to float32, a vectorised exp, silu(gate) * up and gelu(gate) * up,
// and a 16 x 16 transpose of 32-bit lanes.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

static inline __m512 exp512(__m512 x) {  // Cephes expf: 2^n * p(r), |r| <= ln2/2
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-103.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 widen16(const uint16_t *bf16) {  // 16 consecutive bf16 -> float32: the bits move to the top half
    __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bf16));
    return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

static inline __m512 silu_times(__m512 gate, __m512 up) {
    __m512 one = _mm512_set1_ps(1.f);
    __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
    return _mm512_mul_ps(_mm512_mul_ps(gate, sig), up);
}

// v as a value the compiler cannot see into: the kernels build with -fassociative-math, which
// lets it regroup a * (b * c) as (a * b) * c in one function and not in another; where two
// kernels must give the same bits (batch invariance), their last products go through this.
static inline __m512 opaque(__m512 v) {
    __asm__("" : "+v"(v));
    return v;
}

// float32 -> the nearest bf16 (ties to even), kept as float32: a bf16 store and reload.
static inline __m512 round_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xFFFF0000)));
}

// silu(gate) * up as 16 bf16, rounding where the unfused torch ops round: gate and up to bf16
// (as a GEMM stores them), silu, then the product. Every native path of a dense MLP computes its
// activation here, fused in a GEMM's epilogue or not, so a token's activation is the same bits
// whichever path its step took (batch invariance).
static inline __m256i times_up_bf16x16(__m512 activated, __m512 up) {
    __m512 product = round_bf16(_mm512_mul_ps(round_bf16(activated), round_bf16(up)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(product), 16));
}

static inline __m256i silu_and_mul_bf16x16(__m512 gate, __m512 up) {
    __m512 g = round_bf16(gate), one = _mm512_set1_ps(1.f);
    return times_up_bf16x16(_mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))), up);
}

// gelu(gate) * up, GELU's tanh approximation, rounded as above (Gemma's MLP: layers/mlp.py and the decode
// stack both call gemm.c's gelu_tanh_and_mul_bf16). 0.5 g (1 + tanh(u)) written as g / (1 + exp(-2u)), with
// u = sqrt(2 / pi) (g + 0.044715 g^3): silu's form, one exp and no tanh.
static inline __m256i gelu_tanh_and_mul_bf16x16(__m512 gate, __m512 up) {
    __m512 g = round_bf16(gate), one = _mm512_set1_ps(1.f);
    __m512 cubic = _mm512_fmadd_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(0.044715f), one);
    __m512 minus_2u = _mm512_mul_ps(_mm512_mul_ps(g, _mm512_set1_ps(-1.5957691216f)), cubic);
    return times_up_bf16x16(_mm512_div_ps(g, _mm512_add_ps(one, exp512(minus_2u))), up);
}

static inline void transpose16(__m512 r[16]) {  // r[i][j] <- r[j][i]
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int j = 0; j < 2; j++) {
            __m512d a = _mm512_castps_pd(t[i + j]), b = _mm512_castps_pd(t[i + j + 2]);
            r[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            r[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 16; j += 8) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}
#endif
