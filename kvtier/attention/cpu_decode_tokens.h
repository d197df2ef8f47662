// The kernel over token-major fp32 / bf16 rows: `Head`, the online softmax of one KV head's R
// query heads over blocks of tokens (the packed-row kernels reuse it), `decode` over all G KV
// heads of n tokens, and `dispatch`, which runs a kernel in passes of up to MAX_R query heads.
//
// Part of cpu_decode.cpp's one translation unit (it includes this file, which is never compiled
// alone); everything here has internal linkage, in the unnamed namespace.

#pragma once

#include "cpu_decode_vec.h"

namespace {

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
      // NOTE: a block below the running maximum scales by exp(0) = 1: nothing to multiply
      if (scale != 1.0f)
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

}  // namespace
