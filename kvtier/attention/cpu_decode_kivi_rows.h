// KIVI packed rows (kvtier.policies.quant.KiviCodec): their layout, their fp16 scales as floats,
// where a head's parts of a row are (`HeadOfRow`), a head unpacked into fp32, and the widening
// of codes to floats that cpu_decode_kivi.h and cpu_decode_fp8.h read.
//
// Part of cpu_decode.cpp's one translation unit (it includes this file, which is never compiled
// alone); everything here has internal linkage, in the unnamed namespace.

#pragma once

#include "cpu_decode_vec.h"

namespace {

// -- packed rows (kvtier.policies.quant.KiviCodec, groups of 32 tokens) ---------------------
//
// One row holds 32 tokens of all G KV heads, min-max quantized to BITS bits (2, 4 or 8):
//
//   [ key codes 32*G*D*BITS/8 | value codes (same) | key min G*D fp16 | key step G*D fp16 |
//     value min 32*G*NC fp16 | value step 32*G*NC fp16 ]
//
// codes in (token, head, channel) order, 8 / BITS to a byte, the first in the low bits; a key's
// (min, step) is per (head, channel) for the row's 32 tokens, a value's per (token, head, run
// of CG channels), CG = 32 when it divides D, else D (NC = D / CG runs). With 4- or 8-bit codes,
// D a multiple of 16 and up to 4 query heads a KV head, a head attends its codes directly
// (`attend_row`); otherwise a row is unpacked into token-major fp32 [32, 2, G, D] on the stack of
// the task's thread (L1-resident) and attended like fp32 rows. Either way the KV read from memory
// is the packed bytes.

constexpr int KIVI_GROUP = 32;
static_assert(KIVI_GROUP == BLK, "a packed row is one online-softmax block");
static_assert(KIVI_GROUP == 32, "attend_row4_wide reads a row's tokens as two vectors of 16");

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    const float f = (float)man * (1.0f / 16777216.0f);  // subnormal: man * 2^-24
    memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

inline int64_t kivi_row_bytes(int bits, int G, int D) {
  const int nc = D % KIVI_GROUP == 0 ? D / KIVI_GROUP : 1;
  return 2 * (int64_t)KIVI_GROUP * G * D * bits / 8 + 2 * 2 * (int64_t)G * D + 2 * 2 * (int64_t)KIVI_GROUP * G * nc;
}

inline void store(float* p, v8f x) { memcpy(p, &x, 32); }

// n fp16 values -> float32 (F16C's conversion where the target has it).
inline void halfs_to_floats(const uint16_t* h, int n, float* f) {
  int i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
#endif
  for (; i < n; ++i) f[i] = half_to_float(h[i]);
}

// A row's fp16 (min, step) pairs as float32 in `par`: keys' [min G*D | step G*D], then values'
// [min 32*G*NC | step 32*G*NC].
inline void row_params(const uint8_t* row, int bits, int G, int D, float* par) {
  const int nc = D % KIVI_GROUP == 0 ? D / KIVI_GROUP : 1;
  const int64_t codes = (int64_t)KIVI_GROUP * G * D * bits / 8;
  halfs_to_floats((const uint16_t*)(row + 2 * codes), 2 * G * D + 2 * KIVI_GROUP * G * nc, par);  // NOTE: 2-byte aligned
}

// Where head h's parts of a row are: its codes, and its float32 (min, step) in `par` (as
// row_params leaves them; for a value, per (token, head, run of cg channels), nc runs a head).
struct HeadOfRow {
  const uint8_t *kc, *vc;
  const float *klo, *ks, *vlo, *vs;
  int nc, cg, G, h, bytes;  // bytes: of one (token, head)'s codes
  HeadOfRow(const uint8_t* row, int bits, int G_, int D, int h_, const float* par) : G(G_), h(h_) {
    nc = D % KIVI_GROUP == 0 ? D / KIVI_GROUP : 1;
    cg = D / nc;
    bytes = D * bits / 8;
    const int gd = G * D;
    kc = row;
    vc = row + (int64_t)KIVI_GROUP * gd * bits / 8;
    klo = par + h * D;
    ks = par + gd + h * D;
    vlo = par + 2 * gd;
    vs = vlo + KIVI_GROUP * G * nc;
  }
  const uint8_t* keys(int t) const { return kc + (int64_t)(t * G + h) * bytes; }
  const uint8_t* values(int t) const { return vc + (int64_t)(t * G + h) * bytes; }
  int run(int t, int c) const { return (t * G + h) * nc + c / cg; }  // value (min, step) of channel c
};

// Head h of a row -> kv [32, 2, D] float32 (a token's K, then its V), values in order. Codes
// are read a byte at a time (PER codes each), inner loops of compile-time length.
template <int BITS>
void unpack_head(const uint8_t* row, int G, int D, int h, const float* par, float* kv) {
  constexpr int PER = 8 / BITS, MASK = (1 << BITS) - 1;
  const HeadOfRow at(row, BITS, G, D, h, par);
  for (int t = 0; t < KIVI_GROUP; ++t) {
    float* k = kv + (int64_t)t * 2 * D;
    float* v = k + D;
    const uint8_t *kb = at.keys(t), *vb = at.values(t);
    for (int j = 0; j < at.bytes; ++j) {
      const int b = kb[j];
      for (int u = 0; u < PER; ++u) {
        const int c = j * PER + u;
        k[c] = (float)((b >> (u * BITS)) & MASK) * at.ks[c] + at.klo[c];
      }
    }
    for (int c0 = 0; c0 < D; c0 += at.cg) {
      const int run = at.run(t, c0);
      const float step = at.vs[run], base = at.vlo[run];
      for (int j = c0 / PER; j < (c0 + at.cg) / PER; ++j) {
        const int b = vb[j];
        for (int u = 0; u < PER; ++u) v[j * PER + u] = (float)((b >> (u * BITS)) & MASK) * step + base;
      }
    }
  }
}

template <int BITS>
void params_plain(const uint8_t* row, int G, int D, float* par) {
  row_params(row, BITS, G, D, par);
}

#ifdef KVTIER_SHUFFLE
typedef uint8_t v8b __attribute__((vector_size(8)));

// As row_params for 4-bit rows, the keys' (min, step) put in F32S's chunk order (D a multiple of 16).
void params4_split(const uint8_t* row, int G, int D, float* par) {
  row_params(row, 4, G, D, par);
  for (int i = 0; i < 2 * G * D; i += 16) {
    const v8f a = load(par + i), b = load(par + i + 8);
    store(par + i, __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14));
    store(par + i + 8, __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15));
  }
}

// Head h of a 4-bit row -> kv [32, 2, D] float32 in F32S's chunk order: byte i of a 16-value
// block holds values 2i (low bits) and 2i + 1, lane i of the block's even and odd chunks.
// The 4-bit codes of 8 bytes as floats: even = the low halves (values 0, 2, .., 14), odd = the
// high ones. NOTE: AVX2's byte-to-int widening where the target has it (GCC's vector-extension
// conversion of 8 bytes does not compile to it).
inline void nibble_chunks(const uint8_t* p, v8f& even, v8f& odd) {
#if defined(__AVX2__)
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256 e = _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15)));
  const __m256 o = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
  memcpy(&even, &e, 32);
  memcpy(&odd, &o, 32);
#else
  v8b x;
  memcpy(&x, p, 8);
  const v8i w = __builtin_convertvector(x, v8i);
  even = __builtin_convertvector(w & 15, v8f);
  odd = __builtin_convertvector(w >> 4, v8f);
#endif
}

void unpack_head4_split(const uint8_t* row, int G, int D, int h, const float* par, float* kv) {
  const HeadOfRow at(row, 4, G, D, h, par);
  for (int t = 0; t < KIVI_GROUP; ++t) {
    float* k = kv + (int64_t)t * 2 * D;
    float* v = k + D;
    const uint8_t *kb = at.keys(t), *vb = at.values(t);
    for (int c = 0; c < D; c += 16) {
      v8f ke, ko, ve, vo;
      nibble_chunks(kb + c / 2, ke, ko);
      nibble_chunks(vb + c / 2, ve, vo);
      store(k + c, ke * load(at.ks + c) + load(at.klo + c));
      store(k + c + 8, ko * load(at.ks + c + 8) + load(at.klo + c + 8));
      const int run = at.run(t, c);
      store(v + c, ve * at.vs[run] + at.vlo[run]);
      store(v + c + 8, vo * at.vs[run] + at.vlo[run]);
    }
  }
}

// 8 bytes as 8 ints (AVX2's byte-to-int widening where the target has it, as nibble_chunks).
inline v8i byte_ints(const uint8_t* p) {
#if defined(__AVX2__)
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  v8i x;
  memcpy(&x, &w, 32);
  return x;
#else
  v8b x;
  memcpy(&x, p, 8);
  return __builtin_convertvector(x, v8i);
#endif
}

// 8 bytes as 8 floats.
inline v8f byte_chunk(const uint8_t* p) { return __builtin_convertvector(byte_ints(p), v8f); }
#endif

}  // namespace
