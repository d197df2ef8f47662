// The kernels over KIVI packed rows: a head attended from its codes (`attend_row`, and
// `attend_row4_wide` 16 floats a vector) or unpacked (`decode_rows`), and the `dispatch` pass
// over rows of BITS-bit codes (`Packed`). The rows' layout is in cpu_decode_kivi_rows.h.
//
// Part of cpu_decode.cpp's one translation unit (it includes this file, which is never compiled
// alone); everything here has internal linkage, in the unnamed namespace.

#pragma once

#include "cpu_decode_kivi_rows.h"
#include "cpu_decode_tokens.h"

namespace {

#ifdef KVTIER_SHUFFLE

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
  // Each (run k, head h, token j)'s weight times its step, w[k][h][j] = s[h][j] * step, made 16
  // at a time before the values' loop, which then takes each as a multiply-add's broadcast
  // operand: a scalar multiply and a broadcast fewer per (token, head, run), the same products.
  alignas(64) float vt[MAX_DV / 4][KIVI_GROUP];  // [run, token]: the steps, then the mins
  alignas(64) float w[MAX_DV / 4][R][KIVI_GROUP];
  for (int r = 0; r < Q; ++r)
    for (int j = 0; j < KIVI_GROUP; ++j) vt[r][j] = at.vs[at.run(j, 32 * r)];
  for (int r = 0; r < Q; ++r)
    for (int h = 0; h < R; ++h)
      for (int j = 0; j < KIVI_GROUP; j += 16) {
        v16f sj, tj;
        memcpy(&sj, &hd.s[h][j], 64);
        memcpy(&tj, &vt[r][j], 64);
        const v16f x = sj * tj;
        memcpy(&w[r][h][j], &x, 64);
      }
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
      for (int h = 0; h < R; ++h) {
        a[h] += w[k][h][j] * va;
        b[h] += w[k][h][j] * vb;
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

}  // namespace
