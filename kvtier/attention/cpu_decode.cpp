// Decode attention on the CPU: one query token, R query heads per KV head, over n tokens of
// token-major KV ([tokens, 2, G, D]: a token's K heads, then its V heads). Single-threaded;
// kvtier/attention/cpu_decode.py builds this file with cpu_pool.cpp at first use, which runs
// the tasks of a slice on native threads.
//
// fp32 accumulation, an online softmax over blocks of BLK tokens. GCC/Clang vector extensions
// (8 floats) instead of intrinsics, so it builds for any target with -march=native. Results
// do not depend on the number of threads: each call reduces in a fixed order.

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

constexpr int BLK = 32;      // tokens per online-softmax block
constexpr int MAX_DV = 64;   // head_dim up to 512
constexpr int MAX_R = 8;     // query heads per KV head in one pass over the KV

struct F32 {
  static constexpr int bytes = 4;
  static inline v8f load(const char* p) { v8f x; memcpy(&x, p, 32); return x; }
};

struct BF16 {
  static constexpr int bytes = 2;
  static inline v8f load(const char* p) {
    v8h h;
    memcpy(&h, p, 16);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f x;
    memcpy(&x, &u, 32);
    return x;
  }
};

inline v8f load(const float* p) { v8f x; memcpy(&x, p, 32); return x; }

inline float hsum(v8f x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

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
  v8f acc[R][MAX_DV];
  float m[R], l[R];
  alignas(32) float q[R * MAX_DV * 8];  // scaled once, so a score is one dot product
  alignas(32) float s[R][BLK];

  void init(const float* q_in, float scale, int D) {
    for (int j = 0; j < R * D; ++j) q[j] = q_in[j] * scale;
    for (int h = 0; h < R; ++h) {
      m[h] = -INFINITY;
      l[h] = 0.0f;
      for (int d = 0; d < D / 8; ++d) acc[h][d] = v8f{};
    }
  }

  // nb <= BLK tokens; k points at this head's K of the first one; V is v_off elements further.
  void block(const char* k, int nb, int64_t stride, int64_t v_off, int D) {
    const int DV = D / 8;
    // Scores, two tokens at a time (each K vector is converted once for all R heads).
    int i = 0;
    for (; i + 1 < nb; i += 2) {
      const char* k0 = k + i * stride * E;
      const char* k1 = k0 + stride * E;
      v8f p0[R], p1[R];
      for (int h = 0; h < R; ++h) p0[h] = p1[h] = v8f{};
      for (int d = 0; d < DV; ++d) {
        const v8f a = T::load(k0 + d * 8 * E), b = T::load(k1 + d * 8 * E);
        for (int h = 0; h < R; ++h) {
          const v8f qq = load(q + h * D + d * 8);
          p0[h] += qq * a;
          p1[h] += qq * b;
        }
      }
      for (int h = 0; h < R; ++h) {
        s[h][i] = hsum(p0[h]);
        s[h][i + 1] = hsum(p1[h]);
      }
    }
    for (; i < nb; ++i) {
      const char* k0 = k + i * stride * E;
      v8f p0[R];
      for (int h = 0; h < R; ++h) p0[h] = v8f{};
      for (int d = 0; d < DV; ++d) {
        const v8f a = T::load(k0 + d * 8 * E);
        for (int h = 0; h < R; ++h) p0[h] += load(q + h * D + d * 8) * a;
      }
      for (int h = 0; h < R; ++h) s[h][i] = hsum(p0[h]);
    }
    for (; i < BLK; ++i)
      for (int h = 0; h < R; ++h) s[h][i] = -INFINITY;
    // Rescale what was accumulated to the block's new maximum.
    for (int h = 0; h < R; ++h) {
      float mx = m[h];
      for (int j = 0; j < nb; ++j) mx = s[h][j] > mx ? s[h][j] : mx;
      const float scale = expf(m[h] - mx);
      float sum = 0.0f;
      for (int j = 0; j < BLK; j += 8) {
        const v8f e = vexp(load(&s[h][j]) - mx);
        memcpy(&s[h][j], &e, 32);
      }
      for (int j = 0; j < nb; ++j) sum += s[h][j];
      l[h] = l[h] * scale + sum;
      m[h] = mx;
      for (int d = 0; d < DV; ++d) acc[h][d] *= scale;
    }
    // Values, two 8-wide columns at a time, accumulators in registers across the block.
    for (int d = 0; d < DV; d += 2) {
      const bool pair = d + 1 < DV;
      v8f a[R], b[R];
      for (int h = 0; h < R; ++h) {
        a[h] = acc[h][d];
        b[h] = pair ? acc[h][d + 1] : v8f{};
      }
      for (int j = 0; j < nb; ++j) {
        const char* vp = k + (j * stride + v_off + d * 8) * E;
        const v8f va = T::load(vp), vb = pair ? T::load(vp + 8 * E) : v8f{};
        for (int h = 0; h < R; ++h) {
          const float p = s[h][j];
          a[h] += p * va;
          b[h] += p * vb;
        }
      }
      for (int h = 0; h < R; ++h) {
        acc[h][d] = a[h];
        if (pair) acc[h][d + 1] = b[h];
      }
    }
  }

  void finish(float* out, float* lse, int D) const {
    for (int h = 0; h < R; ++h) {
      const float inv = 1.0f / l[h];
      for (int d = 0; d < D / 8; ++d) {
        const v8f o = acc[h][d] * inv;
        memcpy(out + h * D + d * 8, &o, 32);
      }
      lse[h] = m[h] + logf(l[h]);
    }
  }
};

// All G KV heads of n tokens, block by block: a block's rows (all heads) are read once, in
// order, and the next block is prefetched (the hardware prefetcher does not follow the K/V
// interleave well). kv: the first token's row; the R query heads of KV head g are rows
// g * RS .. g * RS + R of q [G, RS, D], out [G, RS, D] and lse [G, RS].
template <class T, int R>
void decode(const char* kv, int64_t n, int G, const float* q, float scale, int RS, int D, float* out,
            float* lse) {
  constexpr int E = T::bytes;
  const int64_t stride = 2 * (int64_t)G * D, v_off = (int64_t)G * D, row = stride * E;
  std::vector<Head<T, R>> heads(G);
  for (int g = 0; g < G; ++g) heads[g].init(q + g * RS * D, scale, D);
  for (int64_t t0 = 0; t0 < n; t0 += BLK) {
    const int nb = (int)(n - t0 < BLK ? n - t0 : BLK);
    const char* blk = kv + t0 * row;
    const int64_t ahead = (n - t0 - nb < BLK ? n - t0 - nb : BLK) * row;
    for (int64_t b = 0; b < ahead; b += 64) __builtin_prefetch(blk + BLK * row + b, 0, 2);
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

}  // extern "C"
