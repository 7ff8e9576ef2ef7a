// The decoder's matmuls, batch-invariant (built with cpu_kernels.cpp by layers/kernels.py):
//
//   linear_f32     y = x W^T (+ b) on a float32 [N, K] weight as it is
//   quant_linear   the same on a quantized weight kept as GGUF blocks (layers/quant.py)
//   quant_pack     a GGUF tensor's rows repacked for quant_linear; quant_rows: rows dequantized
//
// Batch invariance: each output element is computed by the same operations in the same order
// whatever the number of rows in the call (M) and whichever other rows share it, so a row gives the
// same bits alone, in a decode batch or inside a prefill chunk of any size (what the recompute of a
// lost transfer relies on; BLAS's sgemm does not promise it: its kernels and its blocking of K
// change with M). The rows are tiled 1-4 at a time, which shares loads, never arithmetic; threads
// split the output columns (at::parallel_for), which changes no arithmetic either.
//
// float32: per output, 8 partial sums over k (lane k % 8), fma in order of k, added pairwise at the
// end; the weight is read as it is (a tied embedding needs no second copy).
//
// Quantized weights: GGUF's Q8_0, Q4_0, Q4_1 and Q4_K rows (their block bytes as llama.cpp writes
// them), repacked once by `quant_pack` into groups of 8 output rows whose blocks are interleaved 4
// bytes at a time: one 32-byte load then holds 4 consecutive k of 8 rows, lane r = row r, so a
// multiply-add of those bytes against 4 bytes of activations broadcast gives 8 outputs at once and
// the 32 outputs of one block need no horizontal sums. Same bytes as the file (Q4_K: its 6-bit
// scales unpacked, 148 bytes per 256 instead of 144).
//
//   group block of 8 rows (one per 32 k; Q4_K one per 256 k):
//   Q8_0  d[8] f16 | 8 x 32 B     vector g, lane r: row r's int8 q[4g .. 4g+3]
//   Q4_0  d[8] f16 | 4 x 32 B     vector i, lane r: row r's bytes qs[4i .. 4i+3] (low nibble k, high k+16)
//   Q4_1  d[8] f16 | m[8] f16 | 4 x 32 B                                      (as Q4_0)
//   Q4_K  d[8] f16 | dmin[8] f16 | sc[8 sub][8 rows] u8 | m[8][8] u8 | 4 chunks x 8 x 32 B
//         chunk j vector i, lane r: row r's qs[32j + 4i ..]: low nibble sub-block 2j, high 2j+1
//
// Activations are quantized per row in blocks of 32 (as llama.cpp's Q8_0/Q8_1 activations):
// int8 q = round(x / d), d = max|x| / 127, with the block's integer sum S (for Q4_0's offset) and
// s = d * S (for the Q4_1/Q4_K minimum). One output, per block: an exact integer dot product of
// the block, then acc = fma(float(dot), dw * dx, acc) (and acc = fma(m, s, acc) for a minimum),
// over the blocks in order.
//
// AVX2 (+FMA, F16C) kernels; elsewhere plain loops with the same arithmetic per element (std::fma),
// which keep the batch invariance (not necessarily an AVX2 machine's bits).
//
// AMX-INT8 (a build with AMX-TILE, AMX-INT8 and AVX-512, on Linux once the process is granted the
// tile state): Q4_0 and Q8_0 calls of at least AMX_MIN_ROWS rows. A thread unpacks 16 output rows'
// blocks once into int8 A tiles (16 outputs x 32 k; Q4_0 as nibble - 8, so the tile's dot is the
// vector path's dot - 8 * S), the activations are laid out once as B tiles (8 x 64 bytes: 16 rows x
// 32 k), and per block one TDPBSSD gives the 16 x 16 int32 dot products of that block. Integer dot
// products are exact whatever computes them, and the float epilogue is the vector path's, per output
// and block in order: acc = fma(float(dot), dw * dx, acc) from 0, then + bias and the store's
// rounding; so every output has the same bits on either path, and a row's bits stay the same
// whatever M is. The tiles' padding rows (past M, past N) are computed and never stored.
// SPLITSERVE_KERNELS_AMX=0 (read at each call) keeps every call on the vector path.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QK_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QK_VNNI 1  // the same integer dot products in one instruction (vpdpbusd) instead of three
#endif
#endif

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__linux__) && \
    defined(QK_AVX2)
#define QK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12;  // GGML type ids
constexpr int64_t ROWS = 8;  // output rows per group

inline float half_to_float(uint16_t h) { return float(c10::Half(h, c10::Half::from_bits())); }

struct Kind {
  int64_t block;      // k per block of the file
  int64_t raw_bytes;  // bytes of one block of one row in the file
  int64_t grp_bytes;  // bytes of one packed block of a group of 8 rows
};

Kind kind_info(int64_t kind) {
  switch (kind) {
    case kQ8_0: return {32, 34, 16 + 256};
    case kQ4_0: return {32, 18, 16 + 128};
    case kQ4_1: return {32, 20, 32 + 128};
    case kQ4_K: return {256, 144, 32 + 128 + 1024};
  }
  TORCH_CHECK(false, "unsupported quantized type id ", kind, " (supported: Q4_0 2, Q4_1 3, Q8_0 8, Q4_K 12)");
}

// Q4_K's packed 6-bit scale and minimum of sub-block j (llama.cpp's get_scale_min_k4)
inline void q4k_scale_min(const uint8_t* q, int j, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// -- packing ----------------------------------------------------------------------------------------

// raw [N, K / block * raw_bytes] uint8 (the file's rows) -> [ceil(N / 8), K / block * grp_bytes]
at::Tensor quant_pack(const at::Tensor& raw, int64_t kind, int64_t K) {
  const Kind ki = kind_info(kind);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "raw must be contiguous uint8 [N, bytes]");
  TORCH_CHECK(K % ki.block == 0 && raw.size(1) == K / ki.block * ki.raw_bytes, "raw rows do not hold K = ", K,
              " values of this type");
  const int64_t N = raw.size(0), nb = K / ki.block, G = (N + ROWS - 1) / ROWS;
  auto out = at::zeros({G, nb * ki.grp_bytes}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row_bytes = raw.size(1), grp_row = out.size(1);
  at::parallel_for(0, G, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t r = 0; r < ROWS && g * ROWS + r < N; ++r) {
        const uint8_t* row = src + (g * ROWS + r) * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = row + b * ki.raw_bytes;
          uint8_t* gb = dst + g * grp_row + b * ki.grp_bytes;
          if (kind == kQ8_0 || kind == kQ4_0) {
            std::memcpy(gb + 2 * r, blk, 2);
            const int64_t vecs = kind == kQ8_0 ? 8 : 4;
            for (int64_t i = 0; i < vecs; ++i) std::memcpy(gb + 16 + 32 * i + 4 * r, blk + 2 + 4 * i, 4);
          } else if (kind == kQ4_1) {
            std::memcpy(gb + 2 * r, blk, 2);
            std::memcpy(gb + 16 + 2 * r, blk + 2, 2);
            for (int64_t i = 0; i < 4; ++i) std::memcpy(gb + 32 + 32 * i + 4 * r, blk + 4 + 4 * i, 4);
          } else {  // Q4_K
            std::memcpy(gb + 2 * r, blk, 2);
            std::memcpy(gb + 16 + 2 * r, blk + 2, 2);
            for (int j = 0; j < 8; ++j) q4k_scale_min(blk + 4, j, gb[32 + 8 * j + r], gb[96 + 8 * j + r]);
            const uint8_t* qs = blk + 16;
            for (int64_t c = 0; c < 4; ++c)
              for (int64_t i = 0; i < 8; ++i) std::memcpy(gb + 160 + 256 * c + 32 * i + 4 * r, qs + 32 * c + 4 * i, 4);
          }
        }
      }
    }
  });
  return out;
}

// -- dequantization (rows: the embedding lookup; all rows: tests and expansion) ---------------------

// row n of a packed weight into float out[K]: the gguf library's arithmetic (exact products, one rounding)
void dequant_row(const uint8_t* packed, int64_t grp_row, const Kind& ki, int64_t kind, int64_t K, int64_t n,
                 float* out) {
  const int64_t g = n / ROWS, r = n % ROWS, nb = K / ki.block;
  const uint8_t* base = packed + g * grp_row;
  uint16_t h;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* gb = base + b * ki.grp_bytes;
    float* o = out + b * ki.block;
    std::memcpy(&h, gb + 2 * r, 2);
    const float d = half_to_float(h);
    if (kind == kQ8_0) {
      for (int64_t i = 0; i < 32; ++i) o[i] = d * float(int8_t(gb[16 + 32 * (i / 4) + 4 * r + i % 4]));
    } else if (kind == kQ4_0 || kind == kQ4_1) {
      float m = 0.f;
      if (kind == kQ4_1) {
        std::memcpy(&h, gb + 16 + 2 * r, 2);
        m = half_to_float(h);
      }
      const uint8_t* qs = gb + (kind == kQ4_1 ? 32 : 16);
      for (int64_t i = 0; i < 16; ++i) {
        const uint8_t byte = qs[32 * (i / 4) + 4 * r + i % 4];
        if (kind == kQ4_1) {
          o[i] = d * float(byte & 0xF) + m;
          o[i + 16] = d * float(byte >> 4) + m;
        } else {
          o[i] = d * float(int(byte & 0xF) - 8);
          o[i + 16] = d * float(int(byte >> 4) - 8);
        }
      }
    } else {  // Q4_K: (d * sc) * q - dmin * m per sub-block of 32
      std::memcpy(&h, gb + 16 + 2 * r, 2);
      const float dmin = half_to_float(h);
      for (int64_t c = 0; c < 4; ++c) {
        const float d1 = d * float(gb[32 + 8 * (2 * c) + r]), m1 = dmin * float(gb[96 + 8 * (2 * c) + r]);
        const float d2 = d * float(gb[32 + 8 * (2 * c + 1) + r]), m2 = dmin * float(gb[96 + 8 * (2 * c + 1) + r]);
        for (int64_t l = 0; l < 32; ++l) {
          const uint8_t byte = gb[160 + 256 * c + 32 * (l / 4) + 4 * r + l % 4];
          o[64 * c + l] = d1 * float(byte & 0xF) - m1;
          o[64 * c + 32 + l] = d2 * float(byte >> 4) - m2;
        }
      }
    }
  }
}

// packed [G, bytes]; rows int64 [T] in [0, N) -> float32 [T, K]
at::Tensor quant_rows(const at::Tensor& packed, int64_t kind, int64_t N, int64_t K, const at::Tensor& rows) {
  const Kind ki = kind_info(kind);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(0) == (N + ROWS - 1) / ROWS && packed.size(1) == K / ki.block * ki.grp_bytes,
              "packed weight does not match N, K and the type");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be int64 [T]");
  auto idx = rows.contiguous();
  const int64_t T = idx.size(0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "row ", ip[t], " out of range [0, ", N, ")");
  auto out = at::empty({T, K}, packed.options().dtype(at::kFloat));
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t grp_row = packed.size(1);
  at::parallel_for(0, T, T * K < (int64_t(1) << 18) ? std::max<int64_t>(T, 1) : 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) dequant_row(pp, grp_row, ki, kind, K, ip[t], op + t * K);
  });
  return out;
}

// -- activations ----------------------------------------------------------------------------------

// x [M, K] -> per row and block of 32: int8 q[32], d, s = d * sum(q), S = sum(q)
struct Acts {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
  int64_t K = 0, nb = 0;
};

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return float(x); }

template <typename T>
void quantize_rows(const T* x, int64_t xs, int64_t M, int64_t K, Acts& a) {
  a.K = K;
  a.nb = K / 32;
  a.q.resize(M * K);
  a.d.resize(M * a.nb);
  a.s.resize(M * a.nb);
  a.sum.resize(M * a.nb);
  at::parallel_for(0, M, M * K < (int64_t(1) << 16) ? std::max<int64_t>(M, 1) : 1, [&](int64_t m0, int64_t m1) {
    float buf[32];
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < a.nb; ++b) {
        const T* src = x + m * xs + 32 * b;
        for (int i = 0; i < 32; ++i) buf[i] = to_float(src[i]);
        int8_t* q = a.q.data() + m * K + 32 * b;
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(buf[i]));
        const float d = amax / 127.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
#if defined(QK_AVX2)
        const __m256 vid = _mm256_set1_ps(id);
        __m256i iv[4];
        for (int c = 0; c < 4; ++c) {
          const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(buf + 8 * c), vid);
          iv[c] = _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        const __m256i s = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        sum = _mm_cvtsi128_si32(s4);
        // int32 -> int8 (|q| <= 127: no saturation); packs interleave 128-bit lanes, the permute undoes it
        const __m256i p16a = _mm256_packs_epi32(iv[0], iv[1]), p16b = _mm256_packs_epi32(iv[2], iv[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                            _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
        for (int i = 0; i < 32; ++i) {
          const int32_t v = int32_t(std::nearbyint(buf[i] * id));
          q[i] = int8_t(v);
          sum += v;
        }
#endif
        a.d[m * a.nb + b] = d;
        a.sum[m * a.nb + b] = sum;
        a.s[m * a.nb + b] = d * float(sum);
      }
    }
  });
}

// -- the tiles: MR activation rows x one group of 8 output rows -----------------------------------

#if defined(QK_AVX2)
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256 load_half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// p += unsigned bytes u . signed bytes s, 4 at a time per 32-bit lane; dot32(p): p's int32 sums.
// Exact integer arithmetic either way (AVX2: int16 partial sums, which the callers keep below
// 2^15), so AVX512-VNNI gives the AVX2 bits.
#if defined(QK_VNNI)
inline __m256i acc_u8s8(__m256i p, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(p, u, s); }
inline __m256i dot32(__m256i p) { return p; }
#else
inline __m256i acc_u8s8(__m256i p, __m256i u, __m256i s) { return _mm256_add_epi16(p, _mm256_maddubs_epi16(u, s)); }
inline __m256i dot32(__m256i p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
#endif

// Q4_0 (MIN false) and Q4_1 (MIN true), one block of 32 k per step
template <int MR, bool MIN>
inline void tile_q4(const uint8_t* grp, const Acts& a, int64_t m0, __m256* acc) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const int64_t K = a.K;
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* gb = grp + b * (MIN ? 160 : 144);
    const uint8_t* qs = gb + (MIN ? 32 : 16);
    __m256i p[MR];
    for (int m = 0; m < MR; ++m) p[m] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i));
      const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      for (int m = 0; m < MR; ++m) {
        const int8_t* xq = a.q.data() + (m0 + m) * K + 32 * b;
        // 8 products of <= 2 * 15 * 127 in each int16 lane: <= 30480, no saturation
        p[m] = acc_u8s8(p[m], lo, bcast4(xq + 4 * i));
        p[m] = acc_u8s8(p[m], hi, bcast4(xq + 16 + 4 * i));
      }
    }
    const __m256 dw = load_half8(gb);
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * a.nb + b;
      __m256i dot = dot32(p[m]);
      if (!MIN) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * a.sum[at]));  // (q - 8) . x
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[at])), acc[m]);
      if (MIN) acc[m] = _mm256_fmadd_ps(load_half8(gb + 16), _mm256_set1_ps(a.s[at]), acc[m]);
    }
  }
}

template <int MR>
inline void tile_q8(const uint8_t* grp, const Acts& a, int64_t m0, __m256* acc) {
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const int64_t K = a.K;
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* gb = grp + b * 272;
    __m256i s[MR];
    for (int m = 0; m < MR; ++m) s[m] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 16 + 32 * g));
      const __m256i aw = _mm256_sign_epi8(w, w);  // |w| (as unsigned: -128 -> 128)
      for (int m = 0; m < MR; ++m) {
        const __m256i x = bcast4(a.q.data() + (m0 + m) * K + 32 * b + 4 * g);
        // |w| * (x with w's sign): 2 products of <= 128 * 127 per int16 lane
#if defined(QK_VNNI)
        s[m] = _mm256_dpbusd_epi32(s[m], aw, _mm256_sign_epi8(x, w));
#else
        s[m] = _mm256_add_epi32(s[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones));
#endif
      }
    }
    const __m256 dw = load_half8(gb);
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * a.nb + b;
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m]), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[at])), acc[m]);
    }
  }
}

template <int MR>
inline void tile_q4k(const uint8_t* grp, const Acts& a, int64_t m0, __m256* acc) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const int64_t K = a.K, nsb = K / 256;
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* gb = grp + sb * 1184;
    const __m256 d = load_half8(gb), dmin = load_half8(gb + 16);
    for (int sub = 0; sub < 8; ++sub) {
      const int64_t c = sub / 2, shift = (sub % 2) * 4, k0 = 256 * sb + 32 * sub;
      __m256i p[MR];
      for (int m = 0; m < MR; ++m) p[m] = _mm256_setzero_si256();
      for (int i = 0; i < 8; ++i) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 160 + 256 * c + 32 * i));
        const __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, int(shift)), mask);
        for (int m = 0; m < MR; ++m)
          p[m] = acc_u8s8(p[m], q, bcast4(a.q.data() + (m0 + m) * K + k0 + 4 * i));
      }
      const __m256 scale = _mm256_mul_ps(d, load_u8x8(gb + 32 + 8 * sub));
      const __m256 minimum = _mm256_mul_ps(dmin, load_u8x8(gb + 96 + 8 * sub));
      for (int m = 0; m < MR; ++m) {
        const int64_t at = (m0 + m) * a.nb + k0 / 32;
        const __m256 dot = _mm256_cvtepi32_ps(dot32(p[m]));
        acc[m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(a.d[at])), acc[m]);
        acc[m] = _mm256_fnmadd_ps(minimum, _mm256_set1_ps(a.s[at]), acc[m]);
      }
    }
  }
}

template <int MR>
inline void tile(int64_t kind, const uint8_t* grp, const Acts& a, int64_t m0, float* res) {
  __m256 acc[MR];
  switch (kind) {
    case kQ4_0: tile_q4<MR, false>(grp, a, m0, acc); break;
    case kQ4_1: tile_q4<MR, true>(grp, a, m0, acc); break;
    case kQ8_0: tile_q8<MR>(grp, a, m0, acc); break;
    default: tile_q4k<MR>(grp, a, m0, acc); break;
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(res + 8 * m, acc[m]);
}
#else
// the same arithmetic per output element, one lane at a time
template <int MR>
inline void tile(int64_t kind, const uint8_t* grp, const Acts& a, int64_t m0, float* res) {
  const Kind ki = kind_info(kind);
  for (int m = 0; m < MR; ++m) {
    const int8_t* xq = a.q.data() + (m0 + m) * a.K;
    for (int r = 0; r < 8; ++r) {
      float acc = 0.f;
      uint16_t h;
      for (int64_t b = 0; b < a.K / ki.block; ++b) {
        const uint8_t* gb = grp + b * ki.grp_bytes;
        std::memcpy(&h, gb + 2 * r, 2);
        const float dw = half_to_float(h);
        if (kind == kQ8_0 || kind == kQ4_0 || kind == kQ4_1) {
          const int64_t at = (m0 + m) * a.nb + b;
          int32_t dot = 0;
          if (kind == kQ8_0) {
            for (int i = 0; i < 32; ++i) dot += int32_t(int8_t(gb[16 + 32 * (i / 4) + 4 * r + i % 4])) * xq[32 * b + i];
          } else {
            const uint8_t* qs = gb + (kind == kQ4_1 ? 32 : 16);
            for (int i = 0; i < 16; ++i) {
              const uint8_t byte = qs[32 * (i / 4) + 4 * r + i % 4];
              dot += int32_t(byte & 0xF) * xq[32 * b + i] + int32_t(byte >> 4) * xq[32 * b + 16 + i];
            }
            if (kind == kQ4_0) dot -= 8 * a.sum[at];
          }
          acc = std::fma(float(dot), dw * a.d[at], acc);
          if (kind == kQ4_1) {
            std::memcpy(&h, gb + 16 + 2 * r, 2);
            acc = std::fma(half_to_float(h), a.s[at], acc);
          }
        } else {
          std::memcpy(&h, gb + 16 + 2 * r, 2);
          const float dmin = half_to_float(h);
          for (int sub = 0; sub < 8; ++sub) {
            const int64_t c = sub / 2, shift = (sub % 2) * 4, k0 = 256 * b + 32 * sub, at = (m0 + m) * a.nb + k0 / 32;
            int32_t dot = 0;
            for (int l = 0; l < 32; ++l)
              dot += int32_t((gb[160 + 256 * c + 32 * (l / 4) + 4 * r + l % 4] >> shift) & 0xF) * xq[k0 + l];
            const float scale = dw * float(gb[32 + 8 * sub + r]), minimum = dmin * float(gb[96 + 8 * sub + r]);
            acc = std::fma(float(dot), scale * a.d[at], acc);
            acc = std::fma(-minimum, a.s[at], acc);
          }
        }
      }
      res[8 * m + r] = acc;
    }
  }
}
#endif

// Rows per tile: 8 where AVX-512VL gives 32 vector registers (a weight group's nibbles unpacked
// once for 8 rows: 2-6 % faster on 512-2,048-row prompt chunks, Zen 4), else 4 (AVX2's 16).
#if defined(QK_VNNI)
constexpr int64_t MR_MAX = 8;
#else
constexpr int64_t MR_MAX = 4;
#endif
constexpr int64_t GROUP_CHUNK = 16;  // groups of weights kept hot while the row tiles pass over them

// a tile size past this build's maximum is never asked for
template <int MR>
inline void tile_or_max(int64_t kind, const uint8_t* grp, const Acts& a, int64_t m0, float* res) {
  tile<(MR <= MR_MAX ? MR : int(MR_MAX))>(kind, grp, a, m0, res);
}

void tile_rows(int64_t mr, int64_t kind, const uint8_t* grp, const Acts& a, int64_t m0, float* res) {
  switch (mr) {
    case 1: return tile<1>(kind, grp, a, m0, res);
    case 2: return tile<2>(kind, grp, a, m0, res);
    case 3: return tile<3>(kind, grp, a, m0, res);
    case 4: return tile<4>(kind, grp, a, m0, res);
    case 5: return tile_or_max<5>(kind, grp, a, m0, res);
    case 6: return tile_or_max<6>(kind, grp, a, m0, res);
    case 7: return tile_or_max<7>(kind, grp, a, m0, res);
    default: return tile_or_max<8>(kind, grp, a, m0, res);
  }
}

inline void store_out(float v, float* o) { *o = v; }
inline void store_out(float v, at::BFloat16* o) { *o = at::BFloat16(v); }

// -- AMX-INT8: Q4_0 and Q8_0 on prompt-sized calls (the header says why the bits are the same) ---

bool amx_switched_off() {
  const char* env = std::getenv("SPLITSERVE_KERNELS_AMX");
  if (env == nullptr) return false;
  std::string v(env);
  for (auto& ch : v) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  return v == "0" || v == "false" || v == "off" || v == "no";
}

#if defined(QK_AMX)
constexpr int64_t AMX_MIN_ROWS = 16;  // below a tile of rows the vector path is as fast
constexpr int64_t AMX_CHUNK = 4;      // output tiles of 16 unpacked at once, reused by every row tile

// Linux hands a process the tile registers' state only when asked (once: the grant is per process)
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// tiles 0-3: C [16 outputs x 16 rows] int32; 4, 5: A [16 outputs x 32 k] int8; 6, 7: B [8 x 64] int8
void amx_config() {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;  // palette 1
  const uint16_t colsb[8] = {64, 64, 64, 64, 32, 32, 64, 64};
  const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 8, 8};
  std::memcpy(cfg + 16, colsb, sizeof(colsb));
  std::memcpy(cfg + 48, rows, sizeof(rows));
  _tile_loadconfig(cfg);
}

// activations as B tiles: q [tiles][nbp][8][64], B[kk][4c + i] = row 16t + c's q[32b + 4kk + i];
// d [tiles][nb][16]; rows past M and blocks past nb (up to nbp, a multiple of 4) are zeros
struct AmxActs {
  std::vector<int8_t> q;
  std::vector<float> d;
  int64_t tiles = 0, nbp = 0;
};

void amx_acts(const Acts& a, int64_t M, AmxActs& t) {
  const int64_t nb = a.nb;
  t.tiles = (M + 15) / 16;
  t.nbp = (nb + 3) / 4 * 4;
  t.q.assign(t.tiles * t.nbp * 512, 0);
  t.d.assign(t.tiles * nb * 16, 0.f);
  at::parallel_for(0, t.tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tt = t0; tt < t1; ++tt)
      for (int64_t c = 0; c < 16 && 16 * tt + c < M; ++c) {
        const int64_t m = 16 * tt + c;
        for (int64_t b = 0; b < nb; ++b) {
          int8_t* dst = t.q.data() + (tt * t.nbp + b) * 512 + 4 * c;
          const int8_t* src = a.q.data() + m * a.K + 32 * b;
          for (int kk = 0; kk < 8; ++kk) std::memcpy(dst + 64 * kk, src + 4 * kk, 4);
          t.d[(tt * nb + b) * 16 + c] = a.d[m * nb + b];
        }
      }
  });
}

// a group block's 8 rows as A-tile rows of 32 int8 (Q4_0: nibble - 8, low nibbles k 0-15, high
// 16-31; Q8_0: as they are): a transpose of the group's 4-byte lanes (dword 8i + r: row r's i-th)
inline void amx_unpack(int64_t kind, const uint8_t* qs, int8_t* rows) {
  const __m512i pick0 = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
  const __m512i halves = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), halves2 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  const __m512i mask = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  for (int h = 0; h < 2; ++h) {  // rows 4h .. 4h + 3, one per 128-bit lane: a their k 0-15, b 16-31
    const __m512i pick = _mm512_add_epi32(pick0, _mm512_set1_epi32(4 * h));
    __m512i a, b;
    if (kind == kQ8_0) {
      a = _mm512_permutex2var_epi32(_mm512_loadu_si512(qs), pick, _mm512_loadu_si512(qs + 64));
      b = _mm512_permutex2var_epi32(_mm512_loadu_si512(qs + 128), pick, _mm512_loadu_si512(qs + 192));
    } else {
      const __m512i q = _mm512_permutex2var_epi32(_mm512_loadu_si512(qs), pick, _mm512_loadu_si512(qs + 64));
      a = _mm512_sub_epi8(_mm512_and_si512(q, mask), eight);
      b = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(q, 4), mask), eight);
    }
    _mm512_storeu_si512(rows + 128 * h, _mm512_permutex2var_epi64(a, halves, b));
    _mm512_storeu_si512(rows + 128 * h + 64, _mm512_permutex2var_epi64(a, halves2, b));
  }
}

// output tile o (groups 2o, 2o + 1) as A tiles w [nb][16][32] int8 and dw [nb][16]
void amx_weights(int64_t kind, const uint8_t* pp, int64_t grp_row, int64_t G, int64_t o, int64_t nb, int8_t* w,
                 float* dw) {
  const int64_t gbytes = kind == kQ4_0 ? 144 : 272;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t g = 2 * o + half;
      if (g >= G) {  // an odd number of groups: the tile's second half is padding
        std::memset(w + b * 512 + 256 * half, 0, 256);
        std::fill(dw + b * 16 + 8 * half, dw + b * 16 + 8 * half + 8, 0.f);
        continue;
      }
      const uint8_t* gb = pp + g * grp_row + b * gbytes;
      _mm256_storeu_ps(dw + b * 16 + 8 * half, load_half8(gb));
      amx_unpack(kind, gb + 16, w + b * 512 + 256 * half);
    }
}

// acc[j] lane c (output j, row c) = fma(float(dot), dw * dx, acc[j]): the vector tiles' arithmetic
inline void amx_epilogue(const int32_t* dots, const float* dw, const float* dx, __m512* acc) {
  const __m512 vdx = _mm512_loadu_ps(dx);
  for (int j = 0; j < 16; ++j) {
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_loadu_si512(dots + 16 * j));
    acc[j] = _mm512_fmadd_ps(dot, _mm512_mul_ps(_mm512_set1_ps(dw[j]), vdx), acc[j]);
  }
}

// block b's 16 x 16 dot products into tile C (A, B: its operand tiles); a macro: gcc's tile
// intrinsics name their registers by the literal number
#define AMX_BLOCK(C, A, B, w, xq, b)          \
  do {                                        \
    _tile_zero(C);                            \
    _tile_loadd(A, (w) + (b) * 512, 32);      \
    _tile_loadd(B, (xq) + (b) * 512, 64);     \
    _tile_dpbssd(C, A, B);                    \
  } while (0)

// blocks b, b + 1 (those before nb) into acc
inline void amx_epilogue2(const int32_t (*dots)[256], const float* dw, const float* dx, int64_t b, int64_t nb,
                          __m512* acc) {
  if (b < nb) amx_epilogue(dots[0], dw + b * 16, dx + b * 16, acc);
  if (b + 1 < nb) amx_epilogue(dots[1], dw + (b + 1) * 16, dx + (b + 1) * 16, acc);
}

// 16 outputs x 16 rows over nb blocks (w, xq padded with zero blocks to nbp, a multiple of 4) into
// res[16 outputs][16 rows]; the epilogue of blocks b, b + 1 runs while the tiles compute b + 2 to
// b + 5, on dot products stored an issue earlier (a tile store does not forward to vector loads)
void amx_tile(const int8_t* w, const float* dw, const int8_t* xq, const float* dx, int64_t nb, int64_t nbp,
              float* res) {
  alignas(64) int32_t dots[2][2][256];
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  AMX_BLOCK(0, 4, 6, w, xq, 0);
  AMX_BLOCK(1, 5, 7, w, xq, 1);
  for (int64_t b = 0; b < nbp; b += 4) {
    AMX_BLOCK(2, 4, 6, w, xq, b + 2);
    AMX_BLOCK(3, 5, 7, w, xq, b + 3);
    _tile_stored(0, dots[0][0], 64);
    _tile_stored(1, dots[0][1], 64);
    if (b > 0) amx_epilogue2(dots[1], dw, dx, b - 2, nb, acc);
    if (b + 4 < nbp) {
      AMX_BLOCK(0, 4, 6, w, xq, b + 4);
      AMX_BLOCK(1, 5, 7, w, xq, b + 5);
    }
    _tile_stored(2, dots[1][0], 64);
    _tile_stored(3, dots[1][1], 64);
    amx_epilogue2(dots[0], dw, dx, b, nb, acc);
  }
  amx_epilogue2(dots[1], dw, dx, nbp - 2, nb, acc);
  for (int j = 0; j < 16; ++j) _mm512_storeu_ps(res + 16 * j, acc[j]);
}

template <typename T>
void amx_store(const float* res, const float* bp, T* op, int64_t os, int64_t M, int64_t N, int64_t m0, int64_t n0) {
  const int64_t mr = std::min<int64_t>(16, M - m0), nr = std::min<int64_t>(16, N - n0);
  for (int64_t m = 0; m < mr; ++m) {
    T* o = op + (m0 + m) * os + n0;
    for (int64_t n = 0; n < nr; ++n) store_out(bp ? res[16 * n + m] + bp[n0 + n] : res[16 * n + m], o + n);
  }
}

template <typename T>
void quant_linear_amx(const Acts& a, int64_t kind, const uint8_t* pp, int64_t G, int64_t grp_row, int64_t N,
                      int64_t M, const float* bp, T* op, int64_t os) {
  AmxActs t;
  amx_acts(a, M, t);
  const int64_t O = (G + 1) / 2, nb = a.nb, nbp = t.nbp;
  const int64_t work = G * grp_row * M / 4;  // one thread for a small weight, as the vector path
  at::parallel_for(0, O, work < (int64_t(1) << 18) ? O : 1, [&](int64_t o0, int64_t o1) {
    amx_config();
    std::vector<int8_t> w(AMX_CHUNK * nbp * 512);  // the blocks past nb stay zero
    std::vector<float> dw(AMX_CHUNK * nb * 16);
    alignas(64) float res[256];
    for (int64_t c0 = o0; c0 < o1; c0 += AMX_CHUNK) {
      const int64_t c1 = std::min(o1, c0 + AMX_CHUNK);
      for (int64_t o = c0; o < c1; ++o)
        amx_weights(kind, pp, grp_row, G, o, nb, w.data() + (o - c0) * nbp * 512, dw.data() + (o - c0) * nb * 16);
      for (int64_t tt = 0; tt < t.tiles; ++tt)
        for (int64_t o = c0; o < c1; ++o) {
          amx_tile(w.data() + (o - c0) * nbp * 512, dw.data() + (o - c0) * nb * 16, t.q.data() + tt * nbp * 512,
                   t.d.data() + tt * nb * 16, nb, nbp, res);
          amx_store(res, bp, op, os, M, N, 16 * tt, 16 * o);
        }
    }
    _tile_release();
  });
}
#endif

// whether this call takes the AMX path
bool amx_used(int64_t kind, int64_t M) {
#if defined(QK_AMX)
  return (kind == kQ4_0 || kind == kQ8_0) && M >= AMX_MIN_ROWS && !amx_switched_off() && amx_permitted();
#else
  (void)kind;
  (void)M;
  return false;
#endif
}

// whether this build and process can take the AMX path (tests: the two paths are then compared)
bool quant_amx_available() {
#if defined(QK_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

template <typename T>
void quant_linear_impl(const at::Tensor& x, const at::Tensor& packed, int64_t kind, int64_t N,
                       const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), G = packed.size(0), grp_row = packed.size(1);
  Acts a;
  quantize_rows<T>(x.data_ptr<T>(), x.stride(0), M, K, a);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t os = out.stride(0);
#if defined(QK_AMX)
  if (amx_used(kind, M)) return quant_linear_amx<T>(a, kind, pp, G, grp_row, N, M, bp, op, os);
#endif
  // one thread below ~256 KiB of weights at batch 1 (waking the pool costs about what it saves)
  const int64_t work = G * grp_row * std::max<int64_t>(M, 4) / 4;
  at::parallel_for(0, G, work < (int64_t(1) << 18) ? G : 1, [&](int64_t g0, int64_t g1) {
    float res[MR_MAX * 8];
    for (int64_t c0 = g0; c0 < g1; c0 += GROUP_CHUNK) {
      const int64_t c1 = std::min(g1, c0 + GROUP_CHUNK);
      for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
        const int64_t mr = std::min(MR_MAX, M - m0);
        for (int64_t g = c0; g < c1; ++g) {
          tile_rows(mr, kind, pp + g * grp_row, a, m0, res);
          const int64_t n0 = g * ROWS, nr = std::min(ROWS, N - n0);
          for (int64_t m = 0; m < mr; ++m) {
            T* o = op + (m0 + m) * os + n0;
            for (int64_t r = 0; r < nr; ++r) store_out(bp ? res[8 * m + r] + bp[n0 + r] : res[8 * m + r], o + r);
          }
        }
      }
    }
  });
}

// x [M, K] float32 or bfloat16 (unit last stride); packed from quant_pack; bias float32 [N] or None
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t kind, int64_t N,
                        const std::optional<at::Tensor>& bias) {
  const Kind ki = kind_info(kind);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with a unit last stride");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % ki.block == 0, "K = ", K, " is not a multiple of the type's block ", ki.block);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(0) == (N + ROWS - 1) / ROWS && packed.size(1) == K / ki.block * ki.grp_bytes,
              "packed weight does not match x's K, N and the type");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be float32 [N]");
  auto out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    quant_linear_impl<float>(x, packed, kind, N, bias, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quant_linear: float32 or bfloat16 activations only");
    quant_linear_impl<at::BFloat16>(x, packed, kind, N, bias, out);
  }
  return out;
}


// -- float32 ----------------------------------------------------------------------------------------

inline float sum8(const float* x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }

// MR rows of x times NR rows of w over all of K into res[MR][NR]
template <int MR, int NR>
inline void tile_f32(const float* x, int64_t xs, const float* w, int64_t ws, int64_t K, float* res) {
#if defined(QK_AVX2)
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm256_loadu_ps(w + n * ws + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * xs + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  if (k < K) {  // the last K % 8: masked loads, the other lanes add +0
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(K - k)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm256_maskload_ps(w + n * ws + k, mask);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_maskload_ps(x + m * xs + k, mask);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  float lanes[8];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      _mm256_storeu_ps(lanes, acc[m][n]);
      res[m * NR + n] = sum8(lanes);
    }
#else
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t k = 0; k < K; ++k) part[k % 8] = std::fma(x[m * xs + k], w[n * ws + k], part[k % 8]);
      res[m * NR + n] = sum8(part);
    }
#endif
}

template <int MR>
inline void tile_f32_n(int64_t nr, const float* x, int64_t xs, const float* w, int64_t ws, int64_t K, float* res) {
  switch (nr) {
    case 1: return tile_f32<MR, 1>(x, xs, w, ws, K, res);
    case 2: return tile_f32<MR, 2>(x, xs, w, ws, K, res);
    default: return tile_f32<MR, 3>(x, xs, w, ws, K, res);
  }
}

constexpr int64_t F32_NR = 3, F32_MR = 4, F32_NB = 48;  // a tile of 4 x 3 outputs; 48 weight rows hot in L2

// x [M, K] float32 (unit last stride); w [N, K] float32 (unit last stride); bias float32 [N] or None
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] must share K");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear_f32: float32 only");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1, "x and w need a unit last stride");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), ws = w.stride(0), blocks = (N + F32_NB - 1) / F32_NB;
  const int64_t work = M * N * K;
  at::parallel_for(0, blocks, work < (int64_t(1) << 19) ? blocks : 1, [&](int64_t b0, int64_t b1) {
    float res[F32_MR * F32_NR];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t nb0 = b * F32_NB, nb1 = std::min(N, nb0 + F32_NB);
      for (int64_t m0 = 0; m0 < M; m0 += F32_MR) {
        const int64_t mr = std::min(F32_MR, M - m0);
        for (int64_t n0 = nb0; n0 < nb1; n0 += F32_NR) {
          const int64_t nr = std::min(F32_NR, nb1 - n0);
          const float* xt = xp + m0 * xs;
          const float* wt = wp + n0 * ws;
          switch (mr) {
            case 1: tile_f32_n<1>(nr, xt, xs, wt, ws, K, res); break;
            case 2: tile_f32_n<2>(nr, xt, xs, wt, ws, K, res); break;
            case 3: tile_f32_n<3>(nr, xt, xs, wt, ws, K, res); break;
            default: tile_f32_n<4>(nr, xt, xs, wt, ws, K, res); break;
          }
          for (int64_t m = 0; m < mr; ++m)
            for (int64_t n = 0; n < nr; ++n)
              op[(m0 + m) * N + n0 + n] = bp ? res[m * nr + n] + bp[n0 + n] : res[m * nr + n];
        }
      }
    }
  });
  return out;
}

// -- float32, packed: the projections ----------------------------------------------------------------
//
// The weight [N, K] repacked once into panels of 16 output columns, k-major: panel p holds
// w[16p + j, k] at [p][k][j] (the last panel zero-padded). Each output is one fma chain over k in
// order, acc = fma(x[m, k], w[n, k], acc) from acc = 0, then + bias: the tiles (up to F32P_MR rows
// x F32P_NP panels, chosen by what is left) only share loads, so a row gets the same bits whatever
// M is, and every vector width gives the same bits (a 16-wide AVX-512 lane, an 8-wide AVX2 lane
// and the plain loop all run that one chain per output). An outer-product tile reads a weight
// vector once for all its rows (BLAS's shape), where the dot-product form above reads it once per
// row: ~2x faster on prompt chunks, the same on one row.

constexpr int64_t PANEL = 16;

// w [N, K] float32 (unit last stride) -> [ceil(N / 16), K, 16]
at::Tensor f32_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.stride(1) == 1, "f32_pack: float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), P = (N + PANEL - 1) / PANEL, ws = w.stride(0);
  auto out = at::zeros({P, K, PANEL}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < PANEL && p * PANEL + j < N; ++j) {
        const float* row = src + (p * PANEL + j) * ws;
        float* col = dst + p * K * PANEL + j;
        for (int64_t k = 0; k < K; ++k) col[k * PANEL] = row[k];
      }
  });
  return out;
}

#if defined(__AVX512F__)
constexpr int64_t F32P_MR = 6, F32P_NP = 4;
#elif defined(QK_AVX2)
constexpr int64_t F32P_MR = 6, F32P_NP = 1;
#else
constexpr int64_t F32P_MR = 4, F32P_NP = 2;
#endif

// MR rows of x times NP panels over all of K into res[MR][NP * 16]
template <int MR, int NP>
inline void tile_f32p(const float* x, int64_t xs, const float* w, int64_t K, float* res) {
#if defined(__AVX512F__)
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_ps(w + (p * K + k) * PANEL);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * xs + k]);
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(xv, wv[p], acc[m][p]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(res + (m * NP + p) * PANEL, acc[m][p]);
#elif defined(QK_AVX2)
  __m256 acc[MR][2 * NP];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2 * NP; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[2 * NP];
    for (int v = 0; v < 2 * NP; ++v) wv[v] = _mm256_loadu_ps(w + ((v / 2) * K + k) * PANEL + 8 * (v % 2));
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_set1_ps(x[m * xs + k]);
      for (int v = 0; v < 2 * NP; ++v) acc[m][v] = _mm256_fmadd_ps(xv, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2 * NP; ++v) _mm256_storeu_ps(res + m * NP * PANEL + 8 * v, acc[m][v]);
#else
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p)
      for (int j = 0; j < PANEL; ++j) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc = std::fma(x[m * xs + k], w[(p * K + k) * PANEL + j], acc);
        res[(m * NP + p) * PANEL + j] = acc;
      }
#endif
}

// the tile sizes up to the maximum this build has (a case past it is never taken)
constexpr int clampi(int v, int64_t hi) { return v <= hi ? v : int(hi); }

template <int MR>
inline void tile_f32p_np(int64_t np, const float* x, int64_t xs, const float* w, int64_t K, float* res) {
  switch (np) {
    case 1: return tile_f32p<MR, 1>(x, xs, w, K, res);
    case 2: return tile_f32p<MR, clampi(2, F32P_NP)>(x, xs, w, K, res);
    case 3: return tile_f32p<MR, clampi(3, F32P_NP)>(x, xs, w, K, res);
    default: return tile_f32p<MR, clampi(4, F32P_NP)>(x, xs, w, K, res);
  }
}

void tile_f32p_rows(int64_t mr, int64_t np, const float* x, int64_t xs, const float* w, int64_t K, float* res) {
  switch (mr) {
    case 1: return tile_f32p_np<1>(np, x, xs, w, K, res);
    case 2: return tile_f32p_np<clampi(2, F32P_MR)>(np, x, xs, w, K, res);
    case 3: return tile_f32p_np<clampi(3, F32P_MR)>(np, x, xs, w, K, res);
    case 4: return tile_f32p_np<clampi(4, F32P_MR)>(np, x, xs, w, K, res);
    case 5: return tile_f32p_np<clampi(5, F32P_MR)>(np, x, xs, w, K, res);
    default: return tile_f32p_np<clampi(6, F32P_MR)>(np, x, xs, w, K, res);
  }
}

constexpr int64_t F32P_MB = 48;  // rows of x kept hot while a thread's panels pass over them

// x [M, K] float32 (unit last stride); packed from f32_pack; N its output count; bias float32 [N] or None
at::Tensor linear_f32_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "linear_f32_packed: x must be float32 [M, K] with a unit last stride");
  const int64_t M = x.size(0), K = x.size(1), P = (N + PANEL - 1) / PANEL;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(0) == P && packed.size(1) == K && packed.size(2) == PANEL,
              "packed weight does not match x's K and N");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), groups = (P + F32P_NP - 1) / F32P_NP;
  const int64_t work = M * N * K;
  at::parallel_for(0, groups, work < (int64_t(1) << 19) ? groups : 1, [&](int64_t g0, int64_t g1) {
    float res[F32P_MR * F32P_NP * PANEL];
    for (int64_t mb = 0; mb < M; mb += F32P_MB) {
      const int64_t mb1 = std::min(M, mb + F32P_MB);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t p0 = g * F32P_NP, np = std::min(F32P_NP, P - p0), n0 = p0 * PANEL;
        const int64_t nr = std::min(np * PANEL, N - n0);
        for (int64_t m0 = mb; m0 < mb1; m0 += F32P_MR) {
          const int64_t mr = std::min(F32P_MR, mb1 - m0);
          tile_f32p_rows(mr, np, xp + m0 * xs, xs, wp + p0 * K * PANEL, K, res);
          for (int64_t m = 0; m < mr; ++m) {
            const float* r = res + m * np * PANEL;
            float* o = op + (m0 + m) * N + n0;
            if (bp)
              for (int64_t n = 0; n < nr; ++n) o[n] = r[n] + bp[n0 + n];
            else
              std::memcpy(o, r, nr * sizeof(float));
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SPLITSERVE_OPS, m) {
  m.def("quant_pack(Tensor raw, int kind, int K) -> Tensor");
  m.def("quant_rows(Tensor packed, int kind, int N, int K, Tensor rows) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor packed, int kind, int N, Tensor? bias) -> Tensor");
  m.def("quant_amx_available() -> bool", &quant_amx_available);  // no tensor: no dispatch key
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("f32_pack(Tensor w) -> Tensor");
  m.def("linear_f32_packed(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(SPLITSERVE_OPS, CPU, m) {
  m.impl("quant_pack", &quant_pack);
  m.impl("quant_rows", &quant_rows);
  m.impl("quant_linear", &quant_linear);
  m.impl("linear_f32", &linear_f32);
  m.impl("f32_pack", &f32_pack);
  m.impl("linear_f32_packed", &linear_f32_packed);
}
