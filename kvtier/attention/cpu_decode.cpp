// Decode attention on the CPU: one query token, R query heads per KV head, over n tokens of
// token-major KV ([tokens, 2, G, D]: a token's K heads, then its V heads). Single-threaded;
// kvtier/attention/cpu_native.py builds this file with cpu_pool.cpp at first use, which runs
// the tasks of a slice on native threads.
//
// fp32 accumulation, an online softmax over blocks of BLK tokens. GCC/Clang vector extensions
// (8 floats) instead of intrinsics, so it builds for any target with -march=native. Results
// do not depend on the number of threads: each call reduces in a fixed order.
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

// The running state of one KV head's R query heads: an online softmax over blocks of tokens.
template <class T, int R>
struct Head {
  static constexpr int E = T::bytes;
  static constexpr int TOK = R >= 8 ? 1 : 8 / R;  // tokens scored together: <= 8 accumulators
  v8f acc[R][MAX_DV];  // chunk order
  v8f q[R][MAX_DV];    // chunk order, scaled once, so a score is one dot product
  v8f part[R][BLK];    // a block's scores before their horizontal sums
  alignas(32) float s[R][BLK];
  float m[R], l[R];
#ifdef KVTIER_WIDE
  v16f qw[R][MAX_DV / 4][2];  // q's chunks (c, c + 2) and (c + 1, c + 3), c = 4k (score_wide)
#endif

  void init(const float* q_in, float scale, int D) {
    for (int h = 0; h < R; ++h) {
      m[h] = -INFINITY;
      l[h] = 0.0f;
      for (int c = 0; c < D / 8; ++c) {
        acc[h][c] = v8f{};
        for (int i = 0; i < 8; ++i) q[h][c][i] = q_in[h * D + T::value(c, i, D)] * scale;
      }
#ifdef KVTIER_WIDE
      for (int c = 0; c + 4 <= D / 8; c += 4) {
        qw[h][c / 4][0] = cat(q[h][c], q[h][c + 2]);
        qw[h][c / 4][1] = cat(q[h][c + 1], q[h][c + 3]);
      }
#endif
    }
  }

  // This head's K and V of the U tokens BLK ahead of k0 (past the last row too: a prefetch never
  // faults). NOTE: spread over the block: a burst at the block's start stalls on the cache's
  // miss buffers, and the hardware prefetcher does not follow the K/V interleave well.
  template <int U>
  static void prefetch_ahead(const char* k0, int64_t stride, int C) {
    for (int u = 0; u < U; ++u) {
      const char* ahead = k0 + (u + BLK) * stride * E;
      for (int b = 0; b < C * 8 * E; b += 64) {
        __builtin_prefetch(ahead + b, 0, 2);
        __builtin_prefetch(ahead + stride * E / 2 + b, 0, 2);
      }
    }
  }

  // Score partials of U tokens from k0 (rows `stride` elements apart).
  template <int U>
  void score(const char* k0, int64_t stride, int C, int i) {
    v8f p[U][R];
    for (int u = 0; u < U; ++u)
      for (int h = 0; h < R; ++h) p[u][h] = v8f{};
    prefetch_ahead<U>(k0, stride, C);
    for (int c = 0; c < C; c += 2) {
      v8f a[U], b[U];
      for (int u = 0; u < U; ++u) chunks<T>(k0 + u * stride * E, c, C, a[u], b[u]);
      const bool pair = c + 1 < C;
      for (int h = 0; h < R; ++h) {
        const v8f qa = q[h][c], qb = pair ? q[h][c + 1] : v8f{};
        for (int u = 0; u < U; ++u) {
          p[u][h] += qa * a[u];
          p[u][h] += qb * b[u];
        }
      }
    }
    for (int u = 0; u < U; ++u)
      for (int h = 0; h < R; ++h) part[h][i + u] = p[u][h];
  }

  // nb <= BLK tokens; k points at this head's K of the first one; V is v_off elements further.
  void block(const char* k, int nb, int64_t stride, int64_t v_off, int D) {
    const int C = D / 8;
#ifdef KVTIER_WIDE
    if constexpr (E == 2) {  // bf16 rows, D a multiple of 32: 16 floats a vector
      if (D % 32 == 0 && wide()) {
        int i = 0;
        for (; i + TOK <= nb; i += TOK) score_wide<TOK>(k + i * stride * E, stride, C, i);
        for (; i < nb; ++i) score_wide<1>(k + i * stride * E, stride, C, i);
        weights(nb, C, nullptr);
        values_wide(k + v_off * E, nb, stride, C);
        return;
      }
    }
#endif
    int i = 0;
    for (; i + TOK <= nb; i += TOK) score<TOK>(k + i * stride * E, stride, C, i);
    for (; i < nb; ++i) score<1>(k + i * stride * E, stride, C, i);
    weights(nb, C, nullptr);
    values(k + v_off * E, nb, stride, C);
  }

#ifdef KVTIER_WIDE
  // `score` over bf16 rows 16 floats a vector (D % 32 == 0): chunks (c, c + 2) and (c + 1, c + 3)
  // of q, 4 chunks (64 bytes) of a key a step.
  template <int U>
  void score_wide(const char* k0, int64_t stride, int C, int i) {
    v16f p[U][R];
    for (int u = 0; u < U; ++u)
      for (int h = 0; h < R; ++h) p[u][h] = v16f{};
    prefetch_ahead<U>(k0, stride, C);
    for (int c = 0; c < C; c += 4) {
      v16f a[U], b[U];
      for (int u = 0; u < U; ++u) bf16_chunks16(k0 + u * stride * E + c * 8 * E, a[u], b[u]);
      for (int h = 0; h < R; ++h) {
        const v16f qa = qw[h][c / 4][0], qb = qw[h][c / 4][1];
        for (int u = 0; u < U; ++u) {
          p[u][h] += qa * a[u];
          p[u][h] += qb * b[u];
        }
      }
    }
    for (int u = 0; u < U; ++u)
      for (int h = 0; h < R; ++h) part[h][i + u] = lo8(p[u][h]) + hi8(p[u][h]);
  }

  // `values` over bf16 rows 16 floats a vector (D % 32 == 0), all R heads' accumulators of 4
  // chunks in registers across the block.
  void values_wide(const char* v, int nb, int64_t stride, int C) {
    for (int c = 0; c < C; c += 4) {
      v16f a[R], b[R];
      for (int h = 0; h < R; ++h) {
        a[h] = cat(acc[h][c], acc[h][c + 2]);
        b[h] = cat(acc[h][c + 1], acc[h][c + 3]);
      }
      for (int j = 0; j < nb; ++j) {
        v16f va, vb;
        bf16_chunks16(v + j * stride * E + c * 8 * E, va, vb);
        for (int h = 0; h < R; ++h) {
          const float w = s[h][j];
          a[h] += w * va;
          b[h] += w * vb;
        }
      }
      for (int h = 0; h < R; ++h) {
        acc[h][c] = lo8(a[h]);
        acc[h][c + 2] = hi8(a[h]);
        acc[h][c + 1] = lo8(b[h]);
        acc[h][c + 3] = hi8(b[h]);
      }
    }
  }
#endif

  // The block's scores part[h][0, nb) (8-lane partials; plus bias[h] each, unless null) -> s[h]
  // as softmax weights exp(score - m) (0 past nb), with m, l and acc moved to the new maximum.
  void weights(int nb, int C, const float* bias) {
    const int nb8 = (nb + 7) / 8 * 8;
    for (int h = 0; h < R; ++h) {
      for (int j = nb; j < nb8; ++j) part[h][j] = v8f{};
      for (int j = 0; j < nb8; j += 8) sum8(&part[h][j], &s[h][j]);
      if (bias != nullptr)
        for (int j = 0; j < nb; ++j) s[h][j] += bias[h];
      for (int j = nb; j < BLK; ++j) s[h][j] = -INFINITY;
    }
    // Rescale what was accumulated to the block's new maximum.
    for (int h = 0; h < R; ++h) {
      v8f mx8 = load(&s[h][0]);
      for (int j = 8; j < BLK; j += 8) {
        const v8f x = load(&s[h][j]);
        mx8 = x > mx8 ? x : mx8;
      }
      const float bm = hmax(mx8), mx = bm > m[h] ? bm : m[h];
      const float scale = expf(m[h] - mx);
      for (int j = 0; j < BLK; j += 8) {
        const v8f e = vexp(load(&s[h][j]) - mx);
        memcpy(&s[h][j], &e, 32);
      }
      for (int j = nb; j < BLK; ++j) s[h][j] = 0.0f;  // NOTE: vexp(-inf) is 2^-126, not 0
      v8f sum = load(&s[h][0]);
      for (int j = 8; j < BLK; j += 8) sum += load(&s[h][j]);
      l[h] = l[h] * scale + hsum(sum);
      m[h] = mx;
      for (int c = 0; c < C; ++c) acc[h][c] *= scale;
    }
  }

  // acc += the block's weights s times its nb values from v (rows `stride` elements apart), two
  // chunks at a time (one when R > 4), accumulators in registers across the block.
  void values(const char* v, int nb, int64_t stride, int C) {
    constexpr int W = R > 4 ? 1 : 2;
    for (int c = 0; c < C; c += 2) {
      const bool pair = c + 1 < C;
      for (int w = 0; w < (pair ? 2 : 1); w += W) {
        v8f a[R], b[R];
        for (int h = 0; h < R; ++h) {
          a[h] = acc[h][c + w];
          b[h] = W == 2 && pair ? acc[h][c + 1] : v8f{};
        }
        for (int j = 0; j < nb; ++j) {
          v8f va, vb;
          chunks<T>(v + j * stride * E, c, C, va, vb);
          if (W == 1 && w == 1) va = vb;
          for (int h = 0; h < R; ++h) {
            const float p = s[h][j];
            a[h] += p * va;
            if (W == 2) b[h] += p * vb;
          }
        }
        for (int h = 0; h < R; ++h) {
          acc[h][c + w] = a[h];
          if (W == 2 && pair) acc[h][c + 1] = b[h];
        }
      }
    }
  }

  void finish(float* out, float* lse, int D) const {
    for (int h = 0; h < R; ++h) {
      const float inv = 1.0f / l[h];
      for (int c = 0; c < D / 8; ++c)
        for (int i = 0; i < 8; ++i) out[h * D + T::value(c, i, D)] = acc[h][c][i] * inv;
      lse[h] = m[h] + logf(l[h]);
    }
  }
};

// All G KV heads of n tokens, block by block (each head's K and V of the next block prefetched
// while it scores this one). kv: the first token's row; the R query heads of KV head g are rows
// g * RS .. g * RS + R of q [G, RS, D], out [G, RS, D] and lse [G, RS].
template <class T, int R>
void decode(const char* kv, int64_t n, int G, const float* q, float scale, int RS, int D, float* out,
            float* lse) {
  constexpr int E = T::bytes;
  const int64_t stride = 2 * (int64_t)G * D, v_off = (int64_t)G * D, row = stride * E;
  // NOTE: per thread and kept: a task allocates nothing (8 heads of R = 8 are ~330 KB).
  thread_local std::vector<Head<T, R>> heads;
  if ((int)heads.size() < G) heads.resize(G);
  for (int g = 0; g < G; ++g) heads[g].init(q + g * RS * D, scale, D);
  for (int64_t t0 = 0; t0 < n; t0 += BLK) {
    const int nb = (int)(n - t0 < BLK ? n - t0 : BLK);
    const char* blk = kv + t0 * row;
    for (int g = 0; g < G; ++g) heads[g].block(blk + g * D * E, nb, stride, v_off, D);
  }
  for (int g = 0; g < G; ++g) heads[g].finish(out + g * RS * D, lse + g * RS, D);
}

// One kernel over `n` tokens or rows for each pass of R query heads: Pass<R>::run(kv, n, G, q,
// scale, RS, D, out, lse). NOTE: more than MAX_R query heads per KV head run MAX_R at a time
// (each pass reads the KV again).
template <template <int> class Pass>
int dispatch(const char* kv, int64_t n, int G, const float* q, float scale, int R, int D, float* out,
             float* lse) {
  if (n < 1 || G < 1 || R < 1 || D % 8 != 0 || D / 8 > MAX_DV) return -1;
  for (int h0 = 0; h0 < R; h0 += MAX_R) {
    const int r = R - h0 < MAX_R ? R - h0 : MAX_R;
    const float* qh = q + h0 * D;
    float *oh = out + h0 * D, *lh = lse + h0;
    switch (r) {
      case 1: Pass<1>::run(kv, n, G, qh, scale, R, D, oh, lh); break;
      case 2: Pass<2>::run(kv, n, G, qh, scale, R, D, oh, lh); break;
      case 3: Pass<3>::run(kv, n, G, qh, scale, R, D, oh, lh); break;
      case 4: Pass<4>::run(kv, n, G, qh, scale, R, D, oh, lh); break;
      case 5: Pass<5>::run(kv, n, G, qh, scale, R, D, oh, lh); break;
      case 6: Pass<6>::run(kv, n, G, qh, scale, R, D, oh, lh); break;
      case 7: Pass<7>::run(kv, n, G, qh, scale, R, D, oh, lh); break;
      default: Pass<8>::run(kv, n, G, qh, scale, R, D, oh, lh); break;
    }
  }
  return 0;
}

// `decode` over token-major rows of T, as a `dispatch` pass.
template <class T>
struct Tokens {
  template <int R>
  struct Pass {
    static void run(const char* kv, int64_t n, int G, const float* q, float scale, int RS, int D, float* out,
                    float* lse) {
      decode<T, R>(kv, n, G, q, scale, RS, D, out, lse);
    }
  };
};

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

// Chunks c and c + 1 (c even: 16 values) of a (token, head)'s codes as floats, in the chunk
// order of Codes<BITS>::Order: 4 bits, F32S's (a byte's low code in chunk c, its high one in
// c + 1); 8 bits, F32's.
template <int BITS>
struct Codes;
template <>
struct Codes<4> {
  using Order = F32S;
  static inline void load(const uint8_t* codes, int c, v8f& a, v8f& b) { nibble_chunks(codes + c * 4, a, b); }
};
template <>
struct Codes<8> {
  using Order = F32;
  static inline void load(const uint8_t* codes, int c, v8f& a, v8f& b) {
    a = byte_chunk(codes + c * 8);
    b = byte_chunk(codes + c * 8 + 8);
  }
};

// Head h of a 4- or 8-bit row attended from its codes, nothing unpacked (R <= 4 query heads, D a
// multiple of 16; the row's scales in the codes' chunk order, as the row's PARAMS leave them).
// A key is code * step + min per channel, a value code * step + min per (token, run of cg
// channels), so
//   q . k = (q * step) . code + q . min         (q * step and q . min once per row)
//   p * v = (p * step) * code + p * min         (the mins' sums once per run, after the codes)
// which saves the unpacking's multiply-add, store and reload of every value (2x on 4 bits).
template <int BITS, int R>
void attend_row(Head<typename Codes<BITS>::Order, R>& hd, const HeadOfRow& at, int D) {
  constexpr int TOK = Head<typename Codes<BITS>::Order, R>::TOK;
  static_assert(KIVI_GROUP % TOK == 0, "a row is whole groups of scored tokens");
  const int C = D / 8;
  v8f qs[R][MAX_DV];
  float bias[R];
  for (int h = 0; h < R; ++h) {
    v8f b = v8f{};
    for (int c = 0; c < C; ++c) {
      qs[h][c] = hd.q[h][c] * load(at.ks + c * 8);
      b += hd.q[h][c] * load(at.klo + c * 8);
    }
    bias[h] = hsum(b);
  }
  for (int i = 0; i < KIVI_GROUP; i += TOK) {
    v8f p[TOK][R];
    for (int u = 0; u < TOK; ++u)
      for (int h = 0; h < R; ++h) p[u][h] = v8f{};
    for (int c = 0; c < C; c += 2) {
      v8f a[TOK], b[TOK];
      for (int u = 0; u < TOK; ++u) Codes<BITS>::load(at.keys(i + u), c, a[u], b[u]);
      for (int h = 0; h < R; ++h)
        for (int u = 0; u < TOK; ++u) {
          p[u][h] += qs[h][c] * a[u];
          p[u][h] += qs[h][c + 1] * b[u];
        }
    }
    for (int u = 0; u < TOK; ++u)
      for (int h = 0; h < R; ++h) hd.part[h][i + u] = p[u][h];
  }
  hd.weights(KIVI_GROUP, C, bias);
  for (int c = 0; c < C; c += 2) {
    v8f a[R], b[R];
    for (int h = 0; h < R; ++h) {
      a[h] = hd.acc[h][c];
      b[h] = hd.acc[h][c + 1];
    }
    for (int j = 0; j < KIVI_GROUP; ++j) {
      v8f va, vb;
      Codes<BITS>::load(at.values(j), c, va, vb);
      const float step = at.vs[at.run(j, c * 8)];  // NOTE: a run is whole 16-value blocks
      for (int h = 0; h < R; ++h) {
        const float w = hd.s[h][j] * step;
        a[h] += w * va;
        b[h] += w * vb;
      }
    }
    for (int h = 0; h < R; ++h) {
      hd.acc[h][c] = a[h];
      hd.acc[h][c + 1] = b[h];
    }
  }
  for (int r = 0; r < at.nc; ++r) {  // run r: values r * cg .. (r + 1) * cg - 1, chunks c0 .. c1 - 1
    const int c0 = r * at.cg / 8, c1 = c0 + at.cg / 8;
    for (int h = 0; h < R; ++h) {
      float m = 0.0f;
      for (int j = 0; j < KIVI_GROUP; ++j) m += hd.s[h][j] * at.vlo[at.run(j, r * at.cg)];
      for (int c = c0; c < c1; ++c) hd.acc[h][c] += m;
    }
  }
}
#endif

#ifdef KVTIER_WIDE
// -- 4-bit rows, 16 floats a vector (see KVTIER_WIDE) -----------------------------------------
//
// attend_row<4, R> with twice the lanes, which the CPU is bound by (issue 23: int4 rows were
// attended at 0.93x the bf16 kernel's token rate on the H200's host).


// 16 bytes of 4-bit codes as floats: even = the low halves (chunks c, c + 2), odd = the high ones.
inline void nibble_chunks16(const uint8_t* p, v16f& even, v16f& odd) {
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m512 e = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
  const __m512 o = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
  memcpy(&even, &e, 64);
  memcpy(&odd, &o, 64);
}

// Head h of a 4-bit row attended from its codes (R <= 4, D a multiple of 32: a value's run of
// 32 channels is one group of four chunks), as attend_row<4, R>.
template <int R>
void attend_row4_wide(Head<F32S, R>& hd, const HeadOfRow& at, int D) {
  constexpr int TOK = Head<F32S, R>::TOK;
  const int C = D / 8, Q = D / 32;
  v16f qa[R][MAX_DV / 4], qb[R][MAX_DV / 4];  // (q * step) of chunks (c, c + 2) and (c + 1, c + 3)
  float bias[R];
  for (int h = 0; h < R; ++h) {
    v8f b = v8f{};
    for (int c = 0; c < C; ++c) b += hd.q[h][c] * load(at.klo + c * 8);
    bias[h] = hsum(b);
    for (int k = 0; k < Q; ++k) {
      const int c = 4 * k;
      v8f s[4];
      for (int j = 0; j < 4; ++j) s[j] = hd.q[h][c + j] * load(at.ks + (c + j) * 8);
      qa[h][k] = cat(s[0], s[2]);
      qb[h][k] = cat(s[1], s[3]);
    }
  }
  for (int i = 0; i < KIVI_GROUP; i += TOK) {
    v16f p[TOK][R];
    for (int u = 0; u < TOK; ++u)
      for (int h = 0; h < R; ++h) p[u][h] = v16f{};
    for (int k = 0; k < Q; ++k) {
      v16f e[TOK], o[TOK];
      for (int u = 0; u < TOK; ++u) nibble_chunks16(at.keys(i + u) + 16 * k, e[u], o[u]);
      for (int h = 0; h < R; ++h)
        for (int u = 0; u < TOK; ++u) {
          p[u][h] += qa[h][k] * e[u];
          p[u][h] += qb[h][k] * o[u];
        }
    }
    for (int u = 0; u < TOK; ++u)
      for (int h = 0; h < R; ++h) hd.part[h][i + u] = lo8(p[u][h]) + hi8(p[u][h]);
  }
  hd.weights(KIVI_GROUP, C, bias);
  for (int k = 0; k < Q; ++k) {
    const int c = 4 * k;
    v16f a[R], b[R];
    for (int h = 0; h < R; ++h) {
      a[h] = cat(hd.acc[h][c], hd.acc[h][c + 2]);
      b[h] = cat(hd.acc[h][c + 1], hd.acc[h][c + 3]);
    }
    for (int j = 0; j < KIVI_GROUP; ++j) {
      v16f va, vb;
      nibble_chunks16(at.values(j) + 16 * k, va, vb);
      const float step = at.vs[at.run(j, 32 * k)];
      for (int h = 0; h < R; ++h) {
        const float w = hd.s[h][j] * step;
        a[h] += w * va;
        b[h] += w * vb;
      }
    }
    for (int h = 0; h < R; ++h) {
      hd.acc[h][c] = lo8(a[h]);
      hd.acc[h][c + 2] = hi8(a[h]);
      hd.acc[h][c + 1] = lo8(b[h]);
      hd.acc[h][c + 3] = hi8(b[h]);
    }
  }
  // The values' mins: p . min of each run, the row's mins gathered by run once for all R heads
  // (attend_row reads them strided, once per query head; ~13% of this path's time here).
  alignas(64) float vt[MAX_DV / 4][KIVI_GROUP];  // [run, token]
  for (int r = 0; r < at.nc; ++r)
    for (int j = 0; j < KIVI_GROUP; ++j) vt[r][j] = at.vlo[at.run(j, r * at.cg)];
  for (int h = 0; h < R; ++h) {
    v16f s0, s1;
    memcpy(&s0, &hd.s[h][0], 64);
    memcpy(&s1, &hd.s[h][16], 64);
    for (int r = 0; r < at.nc; ++r) {
      v16f t0, t1;
      memcpy(&t0, &vt[r][0], 64);
      memcpy(&t1, &vt[r][16], 64);
      const v16f x = s0 * t0 + s1 * t1;
      const float m = hsum(lo8(x) + hi8(x));
      for (int c = r * at.cg / 8; c < (r + 1) * at.cg / 8; ++c) hd.acc[h][c] += m;
    }
  }
}
#endif

// nrows packed rows of all G KV heads; q, out and lse as `decode`. T: the block's order (F32, or
// F32S for unpack_head4_split); PARAMS converts a row's scales, UNPACK one head of it into a
// [32, 2, D] block (32 KB at D = 128: it stays in L1 while the head attends it).
template <class T, int R, void (*PARAMS)(const uint8_t*, int, int, float*),
          void (*UNPACK)(const uint8_t*, int, int, int, const float*, float*), int BITS = 0>
void decode_rows(const uint8_t* rows, int64_t nrows, int64_t rb, int G, const float* q, float scale, int RS,
                 int D, float* out, float* lse) {
  const int nc = D % KIVI_GROUP == 0 ? D / KIVI_GROUP : 1;
  // NOTE: per thread and kept, as in `decode`: a task allocates nothing after its first.
  thread_local std::vector<Head<T, R>> heads;
  thread_local std::vector<float> kv, par;
  if ((int)heads.size() < G) heads.resize(G);
  kv.resize((size_t)KIVI_GROUP * 2 * D);
  par.resize((size_t)2 * G * D + 2 * KIVI_GROUP * G * nc);
  for (int g = 0; g < G; ++g) heads[g].init(q + g * RS * D, scale, D);
  const int64_t share = (rb / G + 63) / 64 * 64;  // bytes of the next row prefetched per head
  for (int64_t r = 0; r < nrows; ++r) {
    const uint8_t* row = rows + r * rb;
    PARAMS(row, G, D, par.data());
    for (int g = 0; g < G; ++g) {
      // NOTE: the next row, a G-th of it while each head attends (a prefetch never faults): a
      // head reads one 64-byte line of codes a token, rows apart, which the hardware
      // prefetcher does not follow; without this a thread waited on memory ~30% of the time.
      const uint8_t* ahead = row + rb + g * share;
      for (int64_t b = 0; b < share; b += 64) __builtin_prefetch(ahead + b, 0, 2);
#ifdef KVTIER_SHUFFLE
      if constexpr (BITS != 0) {
#ifdef KVTIER_WIDE
        if constexpr (BITS == 4) {
          if (D % 32 == 0 && wide()) {
            attend_row4_wide<R>(heads[g], HeadOfRow(row, BITS, G, D, g, par.data()), D);
            continue;
          }
        }
#endif
        attend_row<BITS, R>(heads[g], HeadOfRow(row, BITS, G, D, g, par.data()), D);
        continue;
      }
#endif
      UNPACK(row, G, D, g, par.data(), kv.data());
      heads[g].block((const char*)kv.data(), KIVI_GROUP, 2 * D, D, D);
    }
  }
  for (int g = 0; g < G; ++g) heads[g].finish(out + g * RS * D, lse + g * RS, D);
}

template <int BITS, int R>
void decode_rows_any(const uint8_t* rows, int64_t n, int G, const float* q, float scale, int RS, int D, float* out,
                     float* lse) {
  const int64_t rb = kivi_row_bytes(BITS, G, D);
#ifdef KVTIER_SHUFFLE
  // From the codes (attend_row: BITS) up to 4 query heads a KV head; else rows unpacked.
  constexpr int DIRECT = R <= 4 ? BITS : 0;
  if constexpr (BITS == 4) {
    if (D % 16 == 0) {
      decode_rows<F32S, R, params4_split, unpack_head4_split, DIRECT>(rows, n, rb, G, q, scale, RS, D, out, lse);
      return;
    }
  }
  if constexpr (BITS == 8) {
    if (D % 16 == 0) {
      decode_rows<F32, R, params_plain<8>, unpack_head<8>, DIRECT>(rows, n, rb, G, q, scale, RS, D, out, lse);
      return;
    }
  }
#endif
  decode_rows<F32, R, params_plain<BITS>, unpack_head<BITS>>(rows, n, rb, G, q, scale, RS, D, out, lse);
}

// `decode_rows_any` over packed rows of BITS-bit codes, as a `dispatch` pass.
template <int BITS>
struct Packed {
  template <int R>
  struct Pass {
    static void run(const char* rows, int64_t n, int G, const float* q, float scale, int RS, int D, float* out,
                    float* lse) {
      decode_rows_any<BITS, R>((const uint8_t*)rows, n, G, q, scale, RS, D, out, lse);
    }
  };
};

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

extern "C" {

// n tokens of a slice's rows (kv: [n, 2, G, D], contiguous rows), queries q [G, R, D] float32
// (scores are q . k * scale) -> out [G, R, D] and lse [G, R] float32. One task, on the calling
// thread (cpu_pool.cpp runs many). Returns 0, or -1 for shapes it does not take (D not a
// multiple of 8 or > 512, n < 1).
int kvtier_decode_f32(const void* kv, int64_t n, int G, const float* q, float scale, int R, int D, float* out,
                      float* lse) {
  return dispatch<Tokens<F32>::Pass>((const char*)kv, n, G, q, scale, R, D, out, lse);
}

int kvtier_decode_bf16(const void* kv, int64_t n, int G, const float* q, float scale, int R, int D, float* out,
                       float* lse) {
  return dispatch<Tokens<BF16>::Pass>((const char*)kv, n, G, q, scale, R, D, out, lse);
}

// n packed rows (KiviCodec, 32 tokens a row, 2/4/8-bit codes) of a slice, from `rows`; q, out
// and lse as kvtier_decode_f32. One task on the calling thread.
int kvtier_decode_kivi2(const void* rows, int64_t n, int G, const float* q, float scale, int R, int D,
                        float* out, float* lse) {
  return dispatch<Packed<2>::Pass>((const char*)rows, n, G, q, scale, R, D, out, lse);
}

int kvtier_decode_kivi4(const void* rows, int64_t n, int G, const float* q, float scale, int R, int D,
                        float* out, float* lse) {
  return dispatch<Packed<4>::Pass>((const char*)rows, n, G, q, scale, R, D, out, lse);
}

int kvtier_decode_kivi8(const void* rows, int64_t n, int G, const float* q, float scale, int R, int D,
                        float* out, float* lse) {
  return dispatch<Packed<8>::Pass>((const char*)rows, n, G, q, scale, R, D, out, lse);
}

// Whether bf16 tokens and 4-bit rows (D a multiple of 32) are attended 16 floats a vector
// (KVTIER_WIDE targets; on = 1, the default) or 8 (0); a negative `on` only asks. Returns the
// setting, or -1 where the target has no such path.
int kvtier_wide(int on) {
#ifdef KVTIER_WIDE
  if (on >= 0) __atomic_store_n(&g_wide, on ? 1 : 0, __ATOMIC_RELAXED);
  return __atomic_load_n(&g_wide, __ATOMIC_RELAXED);
#else
  (void)on;
  return -1;
#endif
}

// n fp8 rows (Fp8Codec: one token a row, E4M3 codes and an fp16 scale per vector); q, out and lse
// as kvtier_decode_f32. Returns -1 where the target lacks the vector shuffles (the torch path).
int kvtier_decode_fp8(const void* rows, int64_t n, int G, const float* q, float scale, int R, int D, float* out,
                      float* lse) {
#ifdef KVTIER_SHUFFLE
  return dispatch<Fp8Pass>((const char*)rows, n, G, q, scale, R, D, out, lse);
#else
  return -1;
#endif
}

// The P tasks' partial results out [P, H, D], lse [P, H] merged by log-sum-exp -> merged
// [H, D], merged_lse [H] (float32; weights and sums in double). NOTE: added task by task in
// order on one thread, so the result depends on neither thread count (PyTorch's sum over P
// splits it differently with its intra-op thread count).
void kvtier_merge(int64_t P, int H, int D, const float* out, const float* lse, float* merged,
                  float* merged_lse) {
  std::vector<double> acc(D);
  for (int h = 0; h < H; ++h) {
    double m = -INFINITY, total = 0.0;
    for (int64_t p = 0; p < P; ++p) m = lse[p * H + h] > m ? lse[p * H + h] : m;
    for (int d = 0; d < D; ++d) acc[d] = 0.0;
    for (int64_t p = 0; p < P; ++p) {
      const double w = exp(lse[p * H + h] - m);
      const float* o = out + (p * H + h) * D;
      total += w;
      for (int d = 0; d < D; ++d) acc[d] += w * o[d];
    }
    for (int d = 0; d < D; ++d) merged[h * D + d] = (float)(acc[d] / total);
    merged_lse[h] = (float)(m + log(total));
  }
}

}  // extern "C"
