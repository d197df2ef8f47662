// Decode attention on the CPU: one query token, R query heads per KV head, over n tokens of
// token-major KV ([tokens, 2, G, D]: a token's K heads, then its V heads). Single-threaded;
// kvtier/attention/cpu_decode.py builds this file with cpu_pool.cpp at first use, which runs
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

  void init(const float* q_in, float scale, int D) {
    for (int h = 0; h < R; ++h) {
      m[h] = -INFINITY;
      l[h] = 0.0f;
      for (int c = 0; c < D / 8; ++c) {
        acc[h][c] = v8f{};
        for (int i = 0; i < 8; ++i) q[h][c][i] = q_in[h * D + T::value(c, i, D)] * scale;
      }
    }
  }

  // Score partials of U tokens from k0 (rows `stride` elements apart).
  template <int U>
  void score(const char* k0, int64_t stride, int C, int i) {
    v8f p[U][R];
    for (int u = 0; u < U; ++u)
      for (int h = 0; h < R; ++h) p[u][h] = v8f{};
    // NOTE: this head's K and V of the token BLK ahead (past the last row too: a prefetch never
    // faults). Spread over the block: a burst at the block's start stalls on the cache's miss
    // buffers, and the hardware prefetcher does not follow the K/V interleave well.
    for (int u = 0; u < U; ++u) {
      const char* ahead = k0 + (u + BLK) * stride * E;
      for (int b = 0; b < C * 8 * E; b += 64) {
        __builtin_prefetch(ahead + b, 0, 2);
        __builtin_prefetch(ahead + stride * E / 2 + b, 0, 2);
      }
    }
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
    int i = 0;
    for (; i + TOK <= nb; i += TOK) score<TOK>(k + i * stride * E, stride, C, i);
    for (; i < nb; ++i) score<1>(k + i * stride * E, stride, C, i);
    const int nb8 = (nb + 7) / 8 * 8;
    for (int h = 0; h < R; ++h) {
      for (int j = nb; j < nb8; ++j) part[h][j] = v8f{};
      for (int j = 0; j < nb8; j += 8) sum8(&part[h][j], &s[h][j]);
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
    // Values, two chunks at a time (one when R > 4), accumulators in registers across the block.
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
          chunks<T>(k + (j * stride + v_off) * E, c, C, va, vb);
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

// NOTE: more than MAX_R query heads per KV head run MAX_R at a time (each pass reads the KV again).
template <class T>
int dispatch(const char* kv, int64_t n, int G, const float* q, float scale, int R, int D, float* out,
             float* lse) {
  if (n < 1 || G < 1 || R < 1 || D % 8 != 0 || D / 8 > MAX_DV) return -1;
  for (int h0 = 0; h0 < R; h0 += MAX_R) {
    const int r = R - h0 < MAX_R ? R - h0 : MAX_R;
    const float* qh = q + h0 * D;
    float *oh = out + h0 * D, *lh = lse + h0;
    switch (r) {
      case 1: decode<T, 1>(kv, n, G, qh, scale, R, D, oh, lh); break;
      case 2: decode<T, 2>(kv, n, G, qh, scale, R, D, oh, lh); break;
      case 3: decode<T, 3>(kv, n, G, qh, scale, R, D, oh, lh); break;
      case 4: decode<T, 4>(kv, n, G, qh, scale, R, D, oh, lh); break;
      case 5: decode<T, 5>(kv, n, G, qh, scale, R, D, oh, lh); break;
      case 6: decode<T, 6>(kv, n, G, qh, scale, R, D, oh, lh); break;
      case 7: decode<T, 7>(kv, n, G, qh, scale, R, D, oh, lh); break;
      default: decode<T, 8>(kv, n, G, qh, scale, R, D, oh, lh); break;
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// n tokens of a slice's rows (kv: [n, 2, G, D], contiguous rows), queries q [G, R, D] float32
// (scores are q . k * scale) -> out [G, R, D] and lse [G, R] float32. One task, on the calling
// thread (cpu_pool.cpp runs many). Returns 0, or -1 for shapes it does not take (D not a
// multiple of 8 or > 512, n < 1).
int kvtier_decode_f32(const void* kv, int64_t n, int G, const float* q, float scale, int R, int D, float* out,
                      float* lse) {
  return dispatch<F32>((const char*)kv, n, G, q, scale, R, D, out, lse);
}

int kvtier_decode_bf16(const void* kv, int64_t n, int G, const float* q, float scale, int R, int D, float* out,
                       float* lse) {
  return dispatch<BF16>((const char*)kv, n, G, q, scale, R, D, out, lse);
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
