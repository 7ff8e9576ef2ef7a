// Fused CPU kernels for the decoder's small per-layer ops (built by layers/kernels.py).
//
// Each kernel replaces several PyTorch ops (and their temporaries) by one pass over the data; the
// PyTorch reference of each one is in layers/ops.py (TorchOps) and tests/test_kernels.py checks
// them against each other. float32 and bfloat16 tensors; arithmetic in float32 with one rounding
// to the tensor's dtype at the end. Plain loops written so that the compiler vectorizes them
// (-O3 -march=native -fno-trapping-math), AVX-512 or AVX2 intrinsics for the attention's inner
// loops where the CPU has them; threads through ATen's pool (at::parallel_for, so
// torch.set_num_threads applies).
//
// Batch invariance: a row's result never depends on the other rows of the call or on how many
// there are. Every reduction (a dot product, a softmax's sum, a norm's sum of squares) adds in an
// order fixed by its length alone: written out as 8 (16) interleaved partial sums combined
// pairwise, never left to the vectorizer, whose order may follow a buffer's alignment. The
// attention of a prompt's row and of a decoding row at the same position is one routine
// (attend_heads_v; a prompt's rows go two at a time, sharing only the loads of each key and value
// row), so a token's logits are the same whether it was computed in a prefill chunk of any size or
// alone (what the recompute after a lost transfer relies on).
//
// An int8 pool (--kv-cache-dtype int8, layers/kv_int8.py) has rows of D int8 values and their float32
// scale after them: attention reads them in place (a key's dot product, a value's weight, times the
// row's scale), rope_store quantizes as kv_int8.quantize does, bit for bit.
//
//   decode_attention   one query row per sequence over its paged KV, read in place (no gather)
//   prefill_attention  the rows of one prompt chunk over the sequence's paged KV, each as decode would
//   add_rms_norm       residual += x (rounded like the reference's add), then RMSNorm of it
//   rope_store         rotary embedding of q and k in place, then k and v into their pool slots
//   silu_mul           the SwiGLU gate: silu(gate) * up from the fused gate|up projection

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using bf16 = at::BFloat16;

inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return float(x); }
inline float to_float(bf16 x) {
  uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T> inline T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline bf16 from_float<bf16>(float f) {
  // round to nearest even, as c10::BFloat16 does (NaN stays a quiet NaN)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  bf16 out;
  out.x = ((u & 0x7fffffffu) > 0x7f800000u) ? uint16_t(0x7fc0) : uint16_t(rounded);
  return out;
}

template <typename T> inline void load(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

template <typename T> inline void store(const float* src, T* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

// The scale of a pool row of D values: an int8 row's float32 after its values; 1 (never applied) else.
template <typename K> inline float row_scale(const K* row, int64_t D) {
  if constexpr (std::is_same_v<K, int8_t>) {
    float f;
    std::memcpy(&f, row + D, sizeof f);
    return f;
  } else {
    return 1.f;
  }
}

// exp(x), x clamped to [-87, 88] (below: ~1e-38 instead of 0; above: ~1.6e38 instead of inf):
// 2^(x log2 e) split into 2^n * 2^f, with a degree-6 polynomial for 2^f on [0, 1) (fitted for
// relative error; ~1e-7 evaluated in float32). Vectorizes, unlike std::exp.
inline float fast_exp(float x) {
  // (vectorizes with -fno-trapping-math: the clamp and floor may then be computed on all lanes)
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float t = x * 1.4426950408889634f;
  const float n = __builtin_floorf(t);
  const float f = t - n;
  float p = 2.1690609111081347e-4f;
  p = p * f + 1.2443081525922439e-3f;
  p = p * f + 9.6784725525079721e-3f;
  p = p * f + 5.5483524724955019e-2f;
  p = p * f + 2.4022979581402090e-1f;
  p = p * f + 6.9314698705749367e-1f;
  p = p * f + 1.0f;
  return p * __builtin_bit_cast(float, uint32_t(int32_t(n) + 127) << 23);
}

// Grain for at::parallel_for over `items` items costing `work` (~flops) in all: one chunk (no
// threads woken) below ~0.5 Mflop, where waking the pool costs about as much as it saves, and
// much more on a busy machine, where a woken thread may wait for a core.
inline int64_t grain_for(int64_t work, int64_t items) {
  return work < (int64_t(1) << 19) ? std::max<int64_t>(items, 1) : 1;
}

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// -- attention ------------------------------------------------------------------------------------

// x[0] + ... + x[7], in one fixed order
inline float sum8(const float* x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum8(__m256 v) {
  float x[8];
  _mm256_storeu_ps(x, v);
  return sum8(x);
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// fast_exp on 8 lanes, the same operations
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(2.1690609111081347e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.2443081525922439e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6784725525079721e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5483524724955019e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022979581402090e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314698705749367e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// softmax of scores[0..L) in place, unnormalized; returns 1 / sum of the exponentials (applied at
// the end). The sum: lane t % 8 of 8 partial sums, in order of t.
inline float softmax_unnormalized(float* __restrict scores, int64_t L) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < L; ++t) m = scores[t] > m ? scores[t] : m;  // exact in any order
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= L; t += 8) {
    const __m256 e = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), vm));
    _mm256_storeu_ps(scores + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (t < L) {  // the tail on a padded vector, its missing lanes adding nothing
    float tail[8] = {m, m, m, m, m, m, m, m};
    std::memcpy(tail, scores + t, (L - t) * sizeof(float));
    __m256 e = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), vm));
    _mm256_storeu_ps(tail, e);
    std::memcpy(scores + t, tail, (L - t) * sizeof(float));
    for (int64_t j = L - t; j < 8; ++j) tail[j] = 0.f;
    acc = _mm256_add_ps(acc, _mm256_loadu_ps(tail));
    t = L;
  }
  _mm256_storeu_ps(part, acc);
#else
  for (; t < L; ++t) {
    const float e = fast_exp(scores[t] - m);
    scores[t] = e;
    part[t % 8] += e;
  }
#endif
  return 1.f / sum8(part);
}

// One page's rows of one kv head: scores[i] = q . K[i] (n rows, row stride rs), and
// acc += sum_i w[i] V[i] (in order of i). The dot product: 8 partial sums (lane d % 8).
template <typename T>
inline void page_scores(const float* q, const T* k, int64_t rs, int64_t n, int64_t D, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (int64_t i = 0; i < n; ++i) {
      const T* r = k + i * rs;
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), load8(r));
      for (int64_t d = 8; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(r + d), a);
      out[i] = hsum8(a);
      if constexpr (std::is_same_v<T, int8_t>) out[i] *= row_scale(r, D);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const T* r = k + i * rs;
    float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t d = 0; d < D; ++d) part[d % 8] += q[d] * to_float(r[d]);
    out[i] = sum8(part);
    if constexpr (std::is_same_v<T, int8_t>) out[i] *= row_scale(r, D);
  }
}

template <typename T>
inline void page_accumulate(const float* w, const T* v, int64_t rs, int64_t n, int64_t D, float* acc) {
  for (int64_t i = 0; i < n; ++i) {
    const T* r = v + i * rs;
    float wi = w[i];
    if constexpr (std::is_same_v<T, int8_t>) wi *= row_scale(r, D);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += wi * to_float(r[d]);  // elementwise: any vectorization
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// GB query heads of one kv head, of R consecutive rows of one sequence (row r attends its first
// L[r] tokens, L[0] <= ... <= L[R-1]), at once: each key and value row is loaded (and converted)
// once for the R x GB heads, which changes no arithmetic (each (row, head) runs the operations it
// runs alone, in the same order: R = 2 is only shared loads). q: R x GB rows of D floats (row r's
// heads at q + r * qs), already scaled; scores: R x GB x L[R-1] buffer; out: like q, normalised.
// Registers: R * GB * DV for q or the accumulators.
template <typename T, int DV, int GB, int R>
inline void attend_heads_v(const float* q, int64_t qs, const T* kv, const int64_t* pages, const int64_t* L,
                           int64_t P, int64_t s_page, int64_t s_kv, int64_t s_row, float* scores, float* out) {
  const int64_t Lmax = L[R - 1];
  __m512 qv[R][GB][DV];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < DV; ++c) qv[r][g][c] = _mm512_loadu_ps(q + r * qs + g * DV * 16 + 16 * c);
  for (int64_t t0 = 0; t0 < Lmax; t0 += P) {
    const T* k = kv + pages[t0 / P] * s_page;
    const int64_t n = std::min(P, Lmax - t0);
    for (int64_t i = 0; i < n; ++i) {
      __m512 kr[DV];
      for (int c = 0; c < DV; ++c) kr[c] = load16(k + i * s_row + 16 * c);
      for (int r = 0; r < R; ++r) {
        if (t0 + i >= L[r]) continue;  // past this row's tokens (the last rows' few extra keys)
        for (int g = 0; g < GB; ++g) {
          __m512 a = _mm512_mul_ps(qv[r][g][0], kr[0]);
          for (int c = 1; c < DV; ++c) a = _mm512_fmadd_ps(qv[r][g][c], kr[c], a);
          float sc = _mm512_reduce_add_ps(a);
          if constexpr (std::is_same_v<T, int8_t>) sc *= row_scale(k + i * s_row, DV * 16);
          scores[(r * GB + g) * Lmax + t0 + i] = sc;
        }
      }
    }
  }
  float inv[R][GB];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < GB; ++g) inv[r][g] = softmax_unnormalized(scores + (r * GB + g) * Lmax, L[r]);
  __m512 acc[R][GB][DV];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < DV; ++c) acc[r][g][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < Lmax; t0 += P) {
    const T* v = kv + pages[t0 / P] * s_page + s_kv;
    const int64_t n = std::min(P, Lmax - t0);
    for (int64_t i = 0; i < n; ++i) {
      __m512 vr[DV];
      for (int c = 0; c < DV; ++c) vr[c] = load16(v + i * s_row + 16 * c);
      for (int r = 0; r < R; ++r) {
        if (t0 + i >= L[r]) continue;
        for (int g = 0; g < GB; ++g) {
          float wi = scores[(r * GB + g) * Lmax + t0 + i];
          if constexpr (std::is_same_v<T, int8_t>) wi *= row_scale(v + i * s_row, DV * 16);
          const __m512 w = _mm512_set1_ps(wi);
          for (int c = 0; c < DV; ++c) acc[r][g][c] = _mm512_fmadd_ps(w, vr[c], acc[r][g][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < DV; ++c)
        _mm512_storeu_ps(out + r * qs + g * DV * 16 + 16 * c, _mm512_mul_ps(acc[r][g][c], _mm512_set1_ps(inv[r][g])));
}

// query heads of one kv head attended at once: R * heads * DV registers for q (or the
// accumulators), 16 of AVX-512's 32 for one row, 24 for two (none for two rows of D = 256)
constexpr int64_t heads_per_group(int DV, int R) { return R == 1 ? 16 / DV : 12 / DV; }

// heads [g0, g0 + gb) of R rows through attend_heads_v, gb <= heads_per_group(DV, R)
template <typename T, int DV, int R>
inline void attend_group_v(int64_t gb, const float* q, int64_t qs, const T* kv, const int64_t* pages,
                           const int64_t* L, int64_t P, int64_t s_page, int64_t s_kv, int64_t s_row, float* scores,
                           float* out) {
  constexpr int64_t most = heads_per_group(DV, R);
  switch (gb) {
    case 1: if constexpr (most >= 1)
              return attend_heads_v<T, DV, 1, R>(q, qs, kv, pages, L, P, s_page, s_kv, s_row, scores, out);
            break;
    case 2: if constexpr (most >= 2)
              return attend_heads_v<T, DV, 2, R>(q, qs, kv, pages, L, P, s_page, s_kv, s_row, scores, out);
            break;
    case 3: if constexpr (most >= 3)
              return attend_heads_v<T, DV, 3, R>(q, qs, kv, pages, L, P, s_page, s_kv, s_row, scores, out);
            break;
    case 4: if constexpr (most >= 4)
              return attend_heads_v<T, DV, 4, R>(q, qs, kv, pages, L, P, s_page, s_kv, s_row, scores, out);
            break;
  }
  TORCH_CHECK(false, "attend_group_v: group of ", gb, " heads of ", R, " rows with DV ", DV);
}
#endif

// The layout of one layer of the pool: kv [num_pages, 2, P, Hkv, D] (int8: D + 4 bytes a row, the
// scale last), any outer strides.
constexpr int64_t kScaleBytes = 4;
inline int64_t head_dim_of(const at::Tensor& kv) {
  return kv.size(4) - (kv.scalar_type() == at::kChar ? kScaleBytes : 0);
}
struct KVView {
  int64_t P, Hkv, D, s_page, s_kv, s_row, s_head;
  explicit KVView(const at::Tensor& kv)
      : P(kv.size(2)), Hkv(kv.size(3)), D(head_dim_of(kv)), s_page(kv.stride(0)), s_kv(kv.stride(1)),
        s_row(kv.stride(2)), s_head(kv.stride(3)) {}
};

// One work item: the G query heads of kv head h in one row (q: its first head, heads qsH apart)
// attend the first L tokens held in `pages`; the result goes to out (heads osH apart). Every row
// of a decode batch and of a prefill chunk goes through here (AVX-512: up to 16 / DV heads at once,
// each key and value row loaded once for them).
template <typename T, typename K, int DV>
void attend_item(const T* q, int64_t qsH, const K* kvp, const KVView& kv, int64_t h, const int64_t* pages,
                 int64_t L, float scale, int64_t G, T* out, int64_t osH, std::vector<float>& qf,
                 std::vector<float>& acc, std::vector<float>& scores) {
  const int64_t D = kv.D, P = kv.P;
  qf.resize(G * D);
  acc.resize(G * D);
  scores.resize(G * L);
  for (int64_t g = 0; g < G; ++g) {
    load(q + g * qsH, qf.data() + g * D, D);
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;
  }
#if defined(__AVX512F__)
  if constexpr (DV > 0) {
    constexpr int64_t gmax = heads_per_group(DV, 1);
    for (int64_t g0 = 0; g0 < G; g0 += gmax) {
      attend_group_v<K, DV, 1>(std::min(gmax, G - g0), qf.data() + g0 * D, 0, kvp + h * kv.s_head, pages, &L, P,
                               kv.s_page, kv.s_kv, kv.s_row, scores.data(), acc.data() + g0 * D);
    }
  } else
#endif
  {
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t t0 = 0; t0 < L; t0 += P) {
        const K* k = kvp + pages[t0 / P] * kv.s_page + h * kv.s_head;
        page_scores(qf.data() + g * D, k, kv.s_row, std::min(P, L - t0), D, scores.data() + t0);
      }
      const float inv = softmax_unnormalized(scores.data(), L);
      float* ag = acc.data() + g * D;
      std::fill(ag, ag + D, 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += P) {
        const K* v = kvp + pages[t0 / P] * kv.s_page + kv.s_kv + h * kv.s_head;
        page_accumulate(scores.data() + t0, v, kv.s_row, std::min(P, L - t0), D, ag);
      }
      for (int64_t d = 0; d < D; ++d) ag[d] *= inv;
    }
  }
  for (int64_t g = 0; g < G; ++g) store(acc.data() + g * D, out + g * osH, D);
}

// Two consecutive rows of a prefill chunk (row 1 attends one token more than row 0), the G query
// heads of kv head h: each key and value row is loaded once for both rows, each (row, head) runs
// exactly what attend_item runs for it (the same bits: a row's result never depends on its
// neighbour). Where two rows' registers do not fit (D = 256, or no AVX-512), one row at a time.
template <typename T, typename K, int DV>
void attend_pair(const T* q, int64_t qsT, int64_t qsH, const K* kvp, const KVView& kv, int64_t h,
                 const int64_t* pages, int64_t L0, float scale, int64_t G, T* out, int64_t osT, int64_t osH,
                 std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& scores) {
#if defined(__AVX512F__)
  if constexpr (DV > 0 && heads_per_group(DV, 2) > 0) {
    constexpr int64_t gmax = heads_per_group(DV, 2);
    const int64_t D = kv.D, L[2] = {L0, L0 + 1};
    qf.resize(2 * G * D);
    acc.resize(2 * G * D);
    scores.resize(2 * gmax * L[1]);
    for (int64_t r = 0; r < 2; ++r)
      for (int64_t g = 0; g < G; ++g) {
        float* dst = qf.data() + (r * G + g) * D;
        load(q + r * qsT + g * qsH, dst, D);
        for (int64_t d = 0; d < D; ++d) dst[d] *= scale;
      }
    for (int64_t g0 = 0; g0 < G; g0 += gmax) {
      attend_group_v<K, DV, 2>(std::min(gmax, G - g0), qf.data() + g0 * D, G * D, kvp + h * kv.s_head, pages, L,
                               kv.P, kv.s_page, kv.s_kv, kv.s_row, scores.data(), acc.data() + g0 * D);
    }
    for (int64_t r = 0; r < 2; ++r)
      for (int64_t g = 0; g < G; ++g) store(acc.data() + (r * G + g) * D, out + r * osT + g * osH, D);
    return;
  }
#endif
  for (int64_t r = 0; r < 2; ++r)
    attend_item<T, K, DV>(q + r * qsT, qsH, kvp, kv, h, pages, L0 + r, scale, G, out + r * osT, osH, qf, acc, scores);
}

// q [B, H, D]; kv one layer of the pool; table [B, max_pages] int64; lens [B] int64; out [B, H, D].
// Work item = (sequence, kv head).
template <typename T, typename K, int DV>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& table,
                           const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const KVView view(kv);
  const int64_t G = H / view.Hkv;
  const int64_t qsB = q.stride(0), qsH = q.stride(1), tsB = table.stride(0), osB = out.stride(0), osH = out.stride(1);
  const T* qp = q.data_ptr<T>();
  const K* kvp = kv.data_ptr<K>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  int64_t work = 0;  // multiply-adds of the whole call
  for (int64_t b = 0; b < B; ++b) work += lp[b] * H * D * 2;
  at::parallel_for(0, B * view.Hkv, grain_for(work, B * view.Hkv), [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / view.Hkv, h = item % view.Hkv;
      attend_item<T, K, DV>(qp + b * qsB + h * G * qsH, qsH, kvp, view, h, tp + b * tsB, lp[b], float(scale), G,
                         op + b * osB + h * G * osH, osH, qf, acc, scores);
    }
  });
}

// q [n, H, D]: a chunk of one sequence's rows, row i at position start + i (its keys already in the
// pool: rope_store ran first); pages [>= ceil((start + n) / P)] int64. Work item = (pair of rows, kv head).
template <typename T, typename K, int DV>
void prefill_attention_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& pages, int64_t start,
                            double scale, at::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const KVView view(kv);
  const int64_t G = H / view.Hkv;
  const int64_t qsT = q.stride(0), qsH = q.stride(1), osT = out.stride(0), osH = out.stride(1);
  const T* qp = q.data_ptr<T>();
  const K* kvp = kv.data_ptr<K>();
  const int64_t* pp = pages.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t work = n * (start + n) * H * D * 2, pairs = (n + 1) / 2;
  at::parallel_for(0, pairs * view.Hkv, grain_for(work, pairs * view.Hkv), [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = 2 * (item / view.Hkv), h = item % view.Hkv;
      const T* qi = qp + i * qsT + h * G * qsH;
      T* oi = op + i * osT + h * G * osH;
      if (i + 1 < n)
        attend_pair<T, K, DV>(qi, qsT, qsH, kvp, view, h, pp, start + i + 1, float(scale), G, oi, osT, osH, qf, acc,
                           scores);
      else
        attend_item<T, K, DV>(qi, qsH, kvp, view, h, pp, start + i + 1, float(scale), G, oi, osH, qf, acc, scores);
    }
  });
}

template <typename T, typename K, template <typename, typename, int> class Impl>
struct ByHeadDim {
  template <typename... Args>
  static void run(int64_t D, Args&&... args) {
#if defined(__AVX512F__)
    switch (D) {
      case 64: return Impl<T, K, 4>::run(args...);
      case 128: return Impl<T, K, 8>::run(args...);
      case 256: return Impl<T, K, 16>::run(args...);
      default: break;
    }
#endif
    Impl<T, K, 0>::run(args...);
  }
};

template <typename T, typename K, int DV>
struct DecodeImpl {
  template <typename... Args>
  static void run(Args&&... args) { decode_attention_impl<T, K, DV>(args...); }
};
template <typename T, typename K, int DV>
struct PrefillImpl {
  template <typename... Args>
  static void run(Args&&... args) { prefill_attention_impl<T, K, DV>(args...); }
};

// Impl<q's type, the pool's type> by the tensors' dtypes: float32 or bfloat16 q over a pool of the
// same dtype or of int8 rows
template <template <typename, typename, int> class Impl, typename... Args>
void by_dtypes(const at::Tensor& q, const at::Tensor& kv, Args&&... args) {
  const bool f32 = q.scalar_type() == at::kFloat, i8 = kv.scalar_type() == at::kChar;
  if (f32 && i8) return ByHeadDim<float, int8_t, Impl>::run(q.size(2), args...);
  if (f32) return ByHeadDim<float, float, Impl>::run(q.size(2), args...);
  if (i8) return ByHeadDim<bf16, int8_t, Impl>::run(q.size(2), args...);
  ByHeadDim<bf16, bf16, Impl>::run(q.size(2), args...);
}

void check_attention(const at::Tensor& q, const at::Tensor& kv) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5, "q must be [rows, H, D] and kv [pages, 2, P, Hkv, D]");
  TORCH_CHECK(kv.size(1) == 2 && head_dim_of(kv) == q.size(2) && q.size(1) % kv.size(3) == 0,
              "q / kv shapes disagree");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() || kv.scalar_type() == at::kChar,
              "kv must be of q's dtype or int8 rows");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "attention: float32 or bfloat16 only");
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(kv, "kv");
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& table,
                            const at::Tensor& lens, double scale) {
  check_attention(q, kv);
  TORCH_CHECK(table.dim() == 2 && lens.dim() == 1, "table must be [B, max_pages] and lens [B]");
  TORCH_CHECK(table.size(0) == q.size(0) && lens.size(0) == q.size(0), "one table row and length per query row");
  TORCH_CHECK(table.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "table and lens must be int64");
  auto table_c = table.contiguous(), lens_c = lens.contiguous();
  auto out = at::empty(q.sizes(), q.options());
  by_dtypes<DecodeImpl>(q, kv, q, kv, table_c, lens_c, scale, out);
  return out;
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& pages, int64_t start,
                             double scale) {
  check_attention(q, kv);
  TORCH_CHECK(pages.dim() == 1 && pages.scalar_type() == at::kLong, "pages must be int64 [n_pages]");
  TORCH_CHECK(start >= 0 && pages.size(0) * kv.size(2) >= start + q.size(0), "pages do not hold start + rows tokens");
  auto pages_c = pages.contiguous();
  auto out = at::empty(q.sizes(), q.options());
  by_dtypes<PrefillImpl>(q, kv, q, kv, pages_c, start, scale, out);
  return out;
}

// -- residual add + RMSNorm -------------------------------------------------------------------

// residual [T, N] contiguous (updated in place: residual += x, rounded to its dtype); x [T, N]
// with unit last stride, or undefined (norm only); returns RMSNorm(residual) * weight.
template <typename T>
void add_rms_norm_impl(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                       at::Tensor& out) {
  const int64_t rows = residual.size(0), N = residual.size(1);
  const bool add = x.defined();
  const int64_t xs = add ? x.stride(0) : 0;
  const T* xp = add ? x.data_ptr<T>() : nullptr;
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float feps = float(eps);
  at::parallel_for(0, rows, grain_for(rows * N * 4, rows), [&](int64_t begin, int64_t end) {
    std::vector<float> r(N), a(N), w(N);
    load(wp, w.data(), N);
    for (int64_t i = begin; i < end; ++i) {
      T* ri = rp + i * N;
      load(ri, r.data(), N);
      if (add) {
        load(xp + i * xs, a.data(), N);
#pragma omp simd
        for (int64_t j = 0; j < N; ++j) r[j] = to_float(from_float<T>(r[j] + a[j]));
        store(r.data(), ri, N);
      }
      float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // a fixed order (see the top)
      int64_t c = 0;
      for (; c + 8 <= N; c += 8)
        for (int l = 0; l < 8; ++l) part[l] += r[c + l] * r[c + l];
      for (; c < N; ++c) part[c % 8] += r[c] * r[c];
      const float inv = 1.f / std::sqrt(sum8(part) / float(N) + feps);
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) r[j] = r[j] * inv * w[j];
      store(r.data(), op + i * N, N);
    }
  });
}

at::Tensor add_rms_norm(const std::optional<at::Tensor>& x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual must be a contiguous [T, N] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == residual.size(1) && weight.is_contiguous(), "weight must be [N]");
  TORCH_CHECK(weight.scalar_type() == residual.scalar_type(), "weight and residual dtypes differ");
  at::Tensor xt;
  if (x.has_value() && x->defined()) {
    xt = *x;
    TORCH_CHECK(xt.sizes() == residual.sizes() && xt.scalar_type() == residual.scalar_type(), "x must match residual");
    check_last_dim_contiguous(xt, "x");
  }
  auto out = at::empty(residual.sizes(), residual.options());
  if (residual.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(xt, residual, weight, eps, out);
  } else {
    TORCH_CHECK(residual.scalar_type() == at::kBFloat16, "add_rms_norm: float32 or bfloat16 only");
    add_rms_norm_impl<bf16>(xt, residual, weight, eps, out);
  }
  return out;
}

// -- rotary embedding + KV store --------------------------------------------------------------

// x[0, D) -> dst: D int8 values, then their float32 scale; kv_int8.quantize's operations (absmax /
// 127, x / scale rounded half to even, clamped to +-127; 0 where the scale is 0), bit for bit.
template <typename T>
inline void quantize_row(const T* x, int8_t* dst, int64_t D) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float a = std::fabs(to_float(x[d]));
    amax = a > amax ? a : amax;
  }
  const float scale = amax / 127.f;
  for (int64_t d = 0; d < D; ++d) {
    float v = scale > 0.f ? std::nearbyint(to_float(x[d]) / scale) : 0.f;
    v = v < -127.f ? -127.f : (v > 127.f ? 127.f : v);
    dst[d] = int8_t(v);
  }
  std::memcpy(dst + D, &scale, sizeof scale);
}

// qkv [T, (H + 2 Hkv) D] (unit last stride): q and k heads rotated in place ("rotate half": with
// x = [x1, x2], x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin); then k and v copied to
// kv [num_pages, 2, P, Hkv, D] at (slot_pages[t], slot_offsets[t]), or quantized into an int8 pool's
// rows (K = int8_t). cos, sin: [T, D / 2] float32.
template <typename T, typename K>
void rope_store_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t Hkv,
                     at::Tensor& kv, const at::Tensor& pages, const at::Tensor& offsets) {
  const int64_t rows = qkv.size(0), D = head_dim_of(kv), half = D / 2;
  const int64_t qs = qkv.stride(0);
  const int64_t kvs0 = kv.stride(0), kvs1 = kv.stride(1), kvs2 = kv.stride(2), kvs3 = kv.stride(3);
  T* qp = qkv.data_ptr<T>();
  K* kvp = kv.data_ptr<K>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pp = pages.data_ptr<int64_t>();
  const int64_t* offp = offsets.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_for(rows * (H + Hkv) * D * 4, rows), [&](int64_t begin, int64_t end) {
    std::vector<float> x(D);
    for (int64_t t = begin; t < end; ++t) {
      T* row = qp + t * qs;
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t head = 0; head < H + Hkv; ++head) {
        T* xh = row + head * D;
        load(xh, x.data(), D);
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          xh[i] = from_float<T>(x1 * c[i] - x2 * s[i]);
          xh[i + half] = from_float<T>(x2 * c[i] + x1 * s[i]);
        }
      }
      K* slot = kvp + pp[t] * kvs0 + offp[t] * kvs2;
      for (int64_t head = 0; head < Hkv; ++head) {
        if constexpr (std::is_same_v<K, int8_t>) {
          quantize_row(row + (H + head) * D, slot + head * kvs3, D);
          quantize_row(row + (H + Hkv + head) * D, slot + kvs1 + head * kvs3, D);
        } else {
          std::memcpy(slot + head * kvs3, row + (H + head) * D, D * sizeof(T));
          std::memcpy(slot + kvs1 + head * kvs3, row + (H + Hkv + head) * D, D * sizeof(T));
        }
      }
    }
  });
}

void rope_store(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t Hkv,
                at::Tensor kv, const at::Tensor& pages, const at::Tensor& offsets) {
  TORCH_CHECK(qkv.dim() == 2 && kv.dim() == 5 && kv.size(1) == 2 && kv.size(3) == Hkv, "bad shapes");
  const int64_t D = head_dim_of(kv), T = qkv.size(0);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (H + 2 * Hkv) * D, "qkv must be [T, (H + 2 Hkv) D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(0) == T && cos.size(1) == D / 2 && sin.sizes() == cos.sizes(),
              "cos and sin must be contiguous float32 [T, D / 2]");
  TORCH_CHECK(pages.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && pages.is_contiguous() &&
              offsets.is_contiguous() && pages.size(0) == T && offsets.size(0) == T, "slots must be int64 [T]");
  const bool i8 = kv.scalar_type() == at::kChar;
  TORCH_CHECK(qkv.scalar_type() == kv.scalar_type() || i8, "kv must be of qkv's dtype or int8 rows");
  TORCH_CHECK(kv.stride(4) == 1 && kv.stride(3) == kv.size(4), "kv rows must be contiguous");
  check_last_dim_contiguous(qkv, "qkv");
  if (qkv.scalar_type() == at::kFloat) {
    i8 ? rope_store_impl<float, int8_t>(qkv, cos, sin, H, Hkv, kv, pages, offsets)
       : rope_store_impl<float, float>(qkv, cos, sin, H, Hkv, kv, pages, offsets);
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "rope_store: float32 or bfloat16 only");
    i8 ? rope_store_impl<bf16, int8_t>(qkv, cos, sin, H, Hkv, kv, pages, offsets)
       : rope_store_impl<bf16, bf16>(qkv, cos, sin, H, Hkv, kv, pages, offsets);
  }
}

}  // namespace

// -- SwiGLU ---------------------------------------------------------------------------------------

// out[j] = g[j] / (1 + exp(-g[j])) * u[j]
inline void sigmoid_times(const float* __restrict g, const float* __restrict u, float* __restrict out, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = g[j] / (1.f + fast_exp(-g[j])) * u[j];
}

// gate_up [T, 2I] (unit last stride) -> silu(gate) * up [T, I], silu(x) = x / (1 + exp(-x))
template <typename T>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), I = out.size(1), gs = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_for(rows * I * 20, rows), [&](int64_t begin, int64_t end) {
    std::vector<float> g(I), u(I), e(I);
    for (int64_t t = begin; t < end; ++t) {
      load(gp + t * gs, g.data(), I);
      load(gp + t * gs + I, u.data(), I);
      sigmoid_times(g.data(), u.data(), e.data(), I);
      store(e.data(), op + t * I, I);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2I]");
  check_last_dim_contiguous(gate_up, "gate_up");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_impl<float>(gate_up, out);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_mul: float32 or bfloat16 only");
    silu_mul_impl<bf16>(gate_up, out);
  }
  return out;
}

// SPLITSERVE_OPS: the op namespace, set by the builder (one per build, so two builds never clash)
TORCH_LIBRARY(SPLITSERVE_OPS, m) {
  m.def("decode_attention(Tensor q, Tensor kv, Tensor table, Tensor lens, float scale) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor kv, Tensor pages, int start, float scale) -> Tensor");
  m.def("add_rms_norm(Tensor? x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rope_store(Tensor(a!) qkv, Tensor cos, Tensor sin, int H, int Hkv, Tensor(b!) kv, Tensor pages, "
        "Tensor offsets) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(SPLITSERVE_OPS, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_store", &rope_store);
  m.impl("silu_mul", &silu_mul);
}
