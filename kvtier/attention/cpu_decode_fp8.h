// The kernel over fp8 rows (kvtier.policies.quant.Fp8Codec): E4M3 codes widened to floats in
// registers and scaled per key or value vector, nothing unpacked.
//
// Part of cpu_decode.cpp's one translation unit (it includes this file, which is never compiled
// alone); everything here has internal linkage, in the unnamed namespace.

#pragma once

#include "cpu_decode_kivi_rows.h"
#include "cpu_decode_tokens.h"

namespace {

// -- fp8 rows (kvtier.policies.quant.Fp8Codec: one token a row) ----------------------------------
//
// A row: E4M3 codes [2, G, D] (the token's K heads, then its V heads), then fp16 scales [2, G],
// one per key or value vector: k = code * scale. So a score is scale_k * (q . code) and a value
// weight p * scale_v: the codes are widened to floats in registers, nothing is unpacked.

#ifdef KVTIER_SHUFFLE

// 8 E4M3FN codes -> 8 floats, exactly (bias 7; exponent 0 is subnormal: m * 2^-9). The codec
// never writes NaN (0x7f, 0xff): it scales by amax / 448. With F16C: a code's bits moved into an
// fp16's (exponent e in its 5-bit field, m at its mantissa's top) read 2^(e - 15) (1 + m / 8),
// or m * 2^-17 when e = 0, so one conversion and a multiply by 2^8 give the E4M3 value.
inline v8f e4m3_chunk(const uint8_t* p) {
#if defined(__F16C__) && defined(__AVX2__)
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
  v8f x;
  memcpy(&x, &f, 32);
  return x;
#else
  const v8u x = __builtin_convertvector(byte_ints(p), v8u), e = (x >> 3) & 15u, m = x & 7u;
  const v8u sign = (x & 0x80u) << 24;
  const v8u normal = sign | ((e + 120u) << 23) | (m << 20);
  v8f nf, sub = __builtin_convertvector(m, v8f) * (1.0f / 512.0f);
  memcpy(&nf, &normal, 32);
  v8u sb;
  memcpy(&sb, &sub, 32);
  sb |= sign;
  memcpy(&sub, &sb, 32);
  return e == 0u ? sub : nf;
#endif
}

template <int R>
void decode_fp8(const uint8_t* rows, int64_t n, int G, const float* q, float scale, int RS, int D, float* out,
                float* lse) {
  const int C = D / 8;
  const int64_t rb = 2 * (int64_t)G * (D + 2), codes = 2 * (int64_t)G * D;
  constexpr int TOK = Head<F32, R>::TOK;
  thread_local std::vector<Head<F32, R>> heads;
  if ((int)heads.size() < G) heads.resize(G);
  for (int g = 0; g < G; ++g) heads[g].init(q + g * RS * D, scale, D);
  auto sc = [&](const uint8_t* row, int kv, int g) {  // a vector's fp16 scale
    uint16_t h;
    memcpy(&h, row + codes + 2 * (kv * G + g), 2);
    return half_to_float(h);
  };
  for (int64_t t0 = 0; t0 < n; t0 += BLK) {
    const int nb = (int)(n - t0 < BLK ? n - t0 : BLK);
    const uint8_t* blk = rows + t0 * rb;
    for (int g = 0; g < G; ++g) {
      Head<F32, R>& hd = heads[g];
      for (int i = 0; i < nb; i += TOK) {
        const int u_n = nb - i < TOK ? nb - i : TOK;
        v8f p[TOK][R];
        for (int u = 0; u < TOK; ++u)
          for (int h = 0; h < R; ++h) p[u][h] = v8f{};
        for (int c = 0; c < C; ++c) {
          v8f k[TOK];
          for (int u = 0; u < u_n; ++u) k[u] = e4m3_chunk(blk + (i + u) * rb + g * D + c * 8);
          for (int h = 0; h < R; ++h)
            for (int u = 0; u < u_n; ++u) p[u][h] += hd.q[h][c] * k[u];
        }
        for (int u = 0; u < u_n; ++u) {
          const float ks = sc(blk + (i + u) * rb, 0, g);
          for (int h = 0; h < R; ++h) hd.part[h][i + u] = p[u][h] * ks;
        }
      }
      hd.weights(nb, C, nullptr);
      for (int c = 0; c < C; ++c) {
        v8f a[R];
        for (int h = 0; h < R; ++h) a[h] = hd.acc[h][c];
        for (int j = 0; j < nb; ++j) {
          const uint8_t* row = blk + j * rb;
          const v8f v = e4m3_chunk(row + G * D + g * D + c * 8);
          const float vs = sc(row, 1, g);
          for (int h = 0; h < R; ++h) a[h] += (hd.s[h][j] * vs) * v;
        }
        for (int h = 0; h < R; ++h) hd.acc[h][c] = a[h];
      }
    }
  }
  for (int g = 0; g < G; ++g) heads[g].finish(out + g * RS * D, lse + g * RS, D);
}

// `decode_fp8` as a `dispatch` pass (n counts rows, one token each).
template <int R>
struct Fp8Pass {
  static void run(const char* rows, int64_t n, int G, const float* q, float scale, int RS, int D, float* out,
                  float* lse) {
    decode_fp8<R>((const uint8_t*)rows, n, G, q, scale, RS, D, out, lse);
  }
};
#endif

}  // namespace
