// Vector types and helpers of the CPU decode kernel: 8-float vectors (GCC/Clang vector
// extensions), fp32 / bf16 row loads in chunk order, horizontal sums, exp, and the 16-float
// helpers of AVX-512 targets (KVTIER_WIDE).
//
// A row's D values are handled as D/8 "chunks" of 8 floats, in the order they load fastest:
//
//   fp32:  chunk c = values 8c .. 8c+7
//   bf16:  one 32-byte load holds values 16p .. 16p+15 as 8 32-bit words; word << 16 is the
//          even values (chunk 2p), word & 0xffff0000 the odd ones (chunk 2p+1): one instruction
//          per chunk instead of a widening convert (NOTE: little-endian, value 2i is word i's
//          low half). A D that is not a multiple of 16 ends with one chunk of 8 values in order.
//
// q is permuted into chunk order once per call and the output back at the end; a dot product
// does not care about the order of its terms.
//
// Part of cpu_decode.cpp's one translation unit (it includes this file, which is never compiled
// alone); everything here has internal linkage, in the unnamed namespace.

#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

constexpr int BLK = 32;     // tokens per online-softmax block
constexpr int MAX_DV = 64;  // head_dim up to 512
constexpr int MAX_R = 8;    // query heads per KV head in one pass over the KV

inline v8f load(const float* p) { v8f x; memcpy(&x, p, 32); return x; }

struct F32 {
  static constexpr int bytes = 4;
  static inline void load2(const char* p, v8f& a, v8f& b) { memcpy(&a, p, 32); memcpy(&b, p + 32, 32); }
  static inline v8f load1(const char* p) { v8f x; memcpy(&x, p, 32); return x; }
  static inline int value(int c, int i, int) { return c * 8 + i; }  // chunk c, lane i -> value index
};

struct BF16 {
  static constexpr int bytes = 2;
  static inline void load2(const char* p, v8f& a, v8f& b) {
    v8u w;
    memcpy(&w, p, 32);
    const v8u even = w << 16, odd = w & 0xffff0000u;
    memcpy(&a, &even, 32);
    memcpy(&b, &odd, 32);
  }
  static inline v8f load1(const char* p) {
    v8h h;
    memcpy(&h, p, 16);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f x;
    memcpy(&x, &u, 32);
    return x;
  }
  static inline int value(int c, int i, int D) {
    return c < D / 16 * 2 ? c / 2 * 16 + 2 * i + (c & 1) : c * 8 + i;
  }
};

// fp32 values stored in BF16's chunk order (chunk 2p = the even values of 16p .. 16p+15, chunk
// 2p+1 the odd ones): how packed rows are unpacked, so a byte's two 4-bit codes land in two
// chunks without shuffles. D a multiple of 16.
struct F32S {
  static constexpr int bytes = 4;
  static inline void load2(const char* p, v8f& a, v8f& b) { F32::load2(p, a, b); }
  static inline v8f load1(const char* p) { return F32::load1(p); }
  static inline int value(int c, int i, int D) { return BF16::value(c, i, D); }
};

// Chunks c and c + 1 (c even) of a row; chunk c alone (b = 0) when it is the last of a D % 16 == 8 row.
template <class T>
inline void chunks(const char* row, int c, int C, v8f& a, v8f& b) {
  if (c + 1 < C) {
    T::load2(row + c * 8 * T::bytes, a, b);
  } else {
    a = T::load1(row + c * 8 * T::bytes);
    b = v8f{};
  }
}

inline float hsum(v8f x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

inline float hmax(v8f x) {
  float m = x[0];
  for (int i = 1; i < 8; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define KVTIER_SHUFFLE 1
#endif
#endif

// s[i] = the sum of x[i]'s 8 lanes, i < 8 (a transposing tree of pairwise adds).
inline void sum8(const v8f* x, float* s) {
#ifdef KVTIER_SHUFFLE
  auto hadd = [](v8f a, v8f b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  const v8f a = hadd(hadd(x[0], x[1]), hadd(x[2], x[3]));  // lanes 0-3 of x0..x3, then lanes 4-7
  const v8f b = hadd(hadd(x[4], x[5]), hadd(x[6], x[7]));
  const v8f r = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  memcpy(s, &r, 32);
#else
  for (int i = 0; i < 8; ++i) s[i] = hsum(x[i]);
#endif
}

// exp(x) for x <= 0 (-inf gives 0): 2^n * p(f) with a degree-6 polynomial, relative error < 3e-7.
inline v8f vexp(v8f x) {
  const v8f lo = v8f{} - 87.0f;
  x = x < lo ? lo : x;
  const v8f t = x * 1.44269504088896341f + 0.5f;
  v8i n = __builtin_convertvector(t, v8i);  // truncates toward zero
  v8f nf = __builtin_convertvector(n, v8f);
  nf = nf > t ? nf - 1.0f : nf;  // floor(t): round to nearest of x * log2(e)
  n = __builtin_convertvector(nf, v8i);
  const v8f f = (x - nf * 0.693145751953125f) - nf * 1.428606765330187045e-6f;
  v8f p = v8f{} + 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  const v8i bits = (n + 127) << 23;
  v8f scale;
  memcpy(&scale, &bits, 32);
  return p * scale;
}

#if defined(__AVX512F__) && defined(KVTIER_SHUFFLE)
// 16 floats a vector (AVX-512 targets): 64 bytes of bf16 values or 16 bytes of 4-bit codes hold
// 32 values, two 16-value blocks, so one widening gives chunks c and c + 2 (BF16's / F32S's even
// values of both blocks) in one vector and c + 1, c + 3 (their odd values) in another; q and the
// accumulators are paired the same way, and a score's two halves are added before its
// horizontal sum. Half the widenings, conversions and multiply-adds of the 8-float path.
#define KVTIER_WIDE 1
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

int g_wide = 1;  // kvtier_wide: 0 takes the 8-float paths (A/B checks and benchmarks)
inline bool wide() { return __atomic_load_n(&g_wide, __ATOMIC_RELAXED) != 0; }

inline v16f cat(v8f a, v8f b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline v8f lo8(v16f x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7); }
inline v8f hi8(v16f x) { return __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15); }

// 64 bytes of bf16 values 32p .. 32p + 31 as floats: even (chunks 4p, 4p + 2), odd (4p + 1, 4p + 3).
inline void bf16_chunks16(const char* p, v16f& even, v16f& odd) {
  v16u w;
  memcpy(&w, p, 64);
  const v16u e = w << 16, o = w & 0xffff0000u;
  memcpy(&even, &e, 64);
  memcpy(&odd, &o, 64);
}
#endif

}  // namespace
