// Decode attention on the CPU: one query token, R query heads per KV head, over n tokens of
// token-major KV ([tokens, 2, G, D]: a token's K heads, then its V heads). Single-threaded;
// kvtier/attention/cpu_native.py builds this file with cpu_pool.cpp at first use, which runs
// the tasks of a slice on native threads.
//
// fp32 accumulation, an online softmax over blocks of BLK tokens. GCC/Clang vector extensions
// (8 floats) instead of intrinsics, so it builds for any target with -march=native. Results
// do not depend on the number of threads: each call reduces in a fixed order.
//
// This file holds the C entry points; the kernels are in headers beside it, which it includes,
// so the kernel is still one translation unit (built from this file and cpu_pool.cpp):
//
//   cpu_decode_vec.h        vector types, row loads in chunk order, sums, exp
//   cpu_decode_tokens.h     Head (the online softmax), fp32 / bf16 token rows, dispatch
//   cpu_decode_kivi_rows.h  KIVI packed rows: layout, scales, unpacking
//   cpu_decode_kivi.h       KIVI packed rows attended
//   cpu_decode_fp8.h        fp8 rows attended

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

// NOTE: in this order, the kernel's order when it was one file: each header uses what the ones
// before it define.
#include "cpu_decode_vec.h"
#include "cpu_decode_tokens.h"
#include "cpu_decode_kivi_rows.h"
#include "cpu_decode_kivi.h"
#include "cpu_decode_fp8.h"

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
