// Paged decode attention on the CPU: one query token per sequence, attending over its blocks in place.
//
// The portable path gathers every sequence's K and V into a padded copy and runs SDPA: the KV bytes are read
// twice and written once per layer. This kernel reads each K and V row once, straight from the paged pool
// (layout [blocks, layers, 2, block_size, kv_heads, head_dim]), and computes in float32 whatever the storage
// dtype. Work is split over (sequence, kv head); each KV row is loaded once for all query heads of its group.
// Per (sequence, head) the arithmetic does not depend on the batch, so results are batch invariant.
//
// With AVX-512 (compiled with -march=native where the CPU has it) a vectorized path does the same arithmetic per
// (sequence, head): K and V rows converted to float32 in registers, scores by FMA, softmax with a polynomial exp
// (Cephes expf's, ~1 ulp), and the weighted V sum kept in registers. When the batch keeps every thread busy, a job
// is a whole sequence (all its kv heads), so each K/V row of a token is read whole and in address order. Head dims
// that are not a multiple of 16 take the scalar path. The file also holds the fused stages of the CPU forward
// (residual add + RMSNorm, RoPE + KV write, SiLU * up), the greedy argmax, the sampler's pick over the whole
// vocabulary and the small-batch bfloat16 matmul.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

template <typename T>
static inline void load_row(const T* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

static inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

static inline void axpy(float w, const float* x, float* y, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += w * x[i];
}


#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
// float32 lanes rounded to bfloat16 precision (to nearest even, as c10::BFloat16 does), kept as float32
static inline __m512 round_bf16(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16(at::BFloat16* p, __m512 v) {
  const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// e^x (inputs below -87.3 give e^-87.3, those past 88.7 inf): Cephes expf's range reduction and polynomial.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

constexpr int64_t kMaxChunks = 16;  // head_dim up to 256
constexpr int64_t kMaxHeads = 64;   // query heads in one job

// A row of D elements as C = D / 16 float32 vectors. A bfloat16 row goes by 32-element chunks, each as its even
// and its odd elements (one shift or one mask per 16 values, where a widening conversion takes two); q, K and V
// rows all take this order, so dot products and per-element sums are the same, and out rows are stored back through
// the inverse. A last chunk of 16 (D % 32 == 16) is converted in order.
template <typename T> struct Row;
template <> struct Row<float> {
  static inline void load(const float* p, __m512* r, int64_t C) {
    for (int64_t c = 0; c < C; ++c) r[c] = _mm512_loadu_ps(p + 16 * c);
  }
  static inline void store(float* p, const __m512* r, int64_t C) {
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(p + 16 * c, r[c]);
  }
};
template <> struct Row<at::BFloat16> {
  static inline void load(const at::BFloat16* p, __m512* r, int64_t C) {
    int64_t c = 0;
    for (; c + 2 <= C; c += 2) {
      const __m512i x = _mm512_loadu_si512(p + 16 * c);
      r[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));  // elements 0, 2, 4, ...
      r[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    }
    if (c < C) r[c] = load16(p + 16 * c);
  }
  static inline void store(at::BFloat16* p, const __m512* r, int64_t C) {
    int64_t c = 0;
    for (; c + 2 <= C; c += 2) {  // rounded to bfloat16 (low halves zero), even elements back in the low halves
      const __m512i even = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(r[c])), 16);
      _mm512_storeu_si512(p + 16 * c, _mm512_or_si512(even, _mm512_castps_si512(round_bf16(r[c + 1]))));
    }
    if (c < C) store16(p + 16 * c, r[c]);
  }
};

// lane i of the result = the sum of v[i]'s 16 lanes: a transpose-and-add tree, 45 instructions for 16 sums where
// 16 separate horizontal sums take about 130
static inline __m512 sum_lanes16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: one partial sum of each of 4 rows
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // 128-bit lanes 0+2 and 1+3 of two groups of 4 rows
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// acc[0, C) += sum over i < m of w[i] * v[i * stride + (0, C)], in order of i; CC > 0 fixes C at compile time, so
// the sum stays in registers
template <int CC>
static inline void weighted_sum(const float* w, const __m512* v, int64_t m, int64_t stride, __m512* acc,
                                int64_t c_rt) {
  const int64_t C = CC > 0 ? CC : c_rt;
  __m512 a[CC > 0 ? CC : kMaxChunks];
  for (int64_t c = 0; c < C; ++c) a[c] = acc[c];
  for (int64_t i = 0; i < m; ++i) {
    const __m512 wi = _mm512_set1_ps(w[i]);
    for (int64_t c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(wi, v[i * stride + c], a[c]);
  }
  for (int64_t c = 0; c < C; ++c) acc[c] = a[c];
}

// Software prefetch of tokens [t0, t1)'s rows (`bytes` each) at `base` (a layer's K or V part). A block's rows of
// one layer are short runs (6 KB for SmolLM2) at scattered addresses, which the hardware prefetcher does not follow:
// the kernel stalled on its K/V loads (perf: ~70% of its samples). Fetching the next 16 tokens while these are
// worked on: 30 layers at batch 32, context 300, 18.1 -> 14.9 ms (2-core VM; prefetching further ahead was slower).
template <typename T>
static inline void prefetch_rows(const T* cp, const int64_t* table, int64_t t0, int64_t t1, int64_t bs, int64_t base,
                                 int64_t s_block, int64_t s_tok, int64_t bytes) {
  for (int64_t t = t0; t < t1; ++t) {
    const char* r = reinterpret_cast<const char*>(cp + table[t / bs] * s_block + base + (t % bs) * s_tok);
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
  }
}

// One sequence, kv heads [h0, h0 + nkv) and their G query heads each, over n tokens; each token's K and V rows of
// those heads are read once, in address order. qp/out point at query head h0 * G. D % 16 == 0, D <= 256,
// nkv * G <= 64. kbuf holds 16 * nkv * D / 16 vectors.
template <typename T>
static void decode_seq_avx512(const T* qp, const T* cp, const int64_t* table, int64_t n, int64_t h0, int64_t nkv,
                              int64_t G, int64_t D, int64_t bs, int64_t k_base, int64_t v_base, int64_t s_block,
                              int64_t s_tok, float scale, std::vector<float>& scores, std::vector<__m512>& q,
                              std::vector<__m512>& acc, std::vector<__m512>& kbuf, T* out) {
  const int64_t C = D / 16, NH = nkv * G;
  for (int64_t j = 0; j < NH; ++j) {
    Row<T>::load(qp + j * D, q.data() + j * C, C);
    for (int64_t c = 0; c < C; ++c) q[j * C + c] = _mm512_mul_ps(q[j * C + c], _mm512_set1_ps(scale));
  }
  const int64_t n_pad = (n + 15) & ~int64_t(15);
  scores.resize(NH * n_pad);
  const int64_t row_bytes = nkv * D * static_cast<int64_t>(sizeof(T));  // of one token, the job's heads
  // pass 1: scores, 16 tokens at a time: their K rows of a head converted once, then per query head 16 dot
  // products summed across lanes together (padding tokens have zero rows)
  __m512* kb = kbuf.data();
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - t0);
    const T* rows[16];
    for (int64_t i = 0; i < m; ++i) {
      const int64_t t = t0 + i;
      rows[i] = cp + table[t / bs] * s_block + k_base + (t % bs) * s_tok + h0 * D;
    }
    if (t0 + 16 < n)  // the next 16 tokens' K, and after the last ones the first 16 tokens' V
      prefetch_rows(cp, table, t0 + 16, std::min(n, t0 + 32), bs, k_base + h0 * D, s_block, s_tok, row_bytes);
    else
      prefetch_rows(cp, table, 0, std::min<int64_t>(n, 16), bs, v_base + h0 * D, s_block, s_tok, row_bytes);
    for (int64_t kh = 0; kh < nkv; ++kh) {
      for (int64_t i = 0; i < m; ++i) Row<T>::load(rows[i] + kh * D, kb + i * C, C);
      for (int64_t i = m; i < 16; ++i)
        for (int64_t c = 0; c < C; ++c) kb[i * C + c] = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = kh * G + g;
        const __m512* qj = q.data() + j * C;
        __m512 a[16];
        for (int i = 0; i < 16; ++i) a[i] = _mm512_mul_ps(qj[0], kb[i * C]);
        for (int64_t c = 1; c < C; ++c)
          for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(qj[c], kb[i * C + c], a[i]);
        _mm512_storeu_ps(scores.data() + j * n_pad + t0, sum_lanes16(a));
      }
    }
  }
  // softmax numerators in place; padding lanes get weight 0
  float inv_sum[kMaxHeads];
  const __mmask16 tail = static_cast<__mmask16>((1u << (n & 15)) - 1u);
  for (int64_t j = 0; j < NH; ++j) {
    float* sj = scores.data() + j * n_pad;
    for (int64_t t = n; t < n_pad; ++t) sj[t] = -std::numeric_limits<float>::infinity();
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n_pad; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sj + t));
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n_pad; t += 16) {
      __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sj + t), mv));
      if (t + 16 > n && (n & 15)) e = _mm512_maskz_mov_ps(tail, e);
      _mm512_storeu_ps(sj + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv_sum[j] = 1.f / _mm512_reduce_add_ps(sum);
  }
  // pass 2: the weighted sum of V, up to 16 tokens at a time: their V rows converted once, in address order, then
  // each query head's sum kept in registers over them (tokens in order, as one long sum)
  for (int64_t j = 0; j < NH * C; ++j) acc[j] = _mm512_setzero_ps();
  const int64_t row_vecs = nkv * C;
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - t0);
    prefetch_rows(cp, table, t0 + 16, std::min(n, t0 + 32), bs, v_base + h0 * D, s_block, s_tok, row_bytes);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t t = t0 + i;
      const T* src = cp + table[t / bs] * s_block + v_base + (t % bs) * s_tok + h0 * D;
      for (int64_t kh = 0; kh < nkv; ++kh) Row<T>::load(src + kh * D, kb + i * row_vecs + kh * C, C);
    }
    for (int64_t kh = 0; kh < nkv; ++kh)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = kh * G + g;
        const float* w = scores.data() + j * n_pad + t0;
        __m512* aj = acc.data() + j * C;
        if (C == 4) weighted_sum<4>(w, kb + kh * C, m, row_vecs, aj, C);
        else if (C == 8) weighted_sum<8>(w, kb + kh * C, m, row_vecs, aj, C);
        else weighted_sum<0>(w, kb + kh * C, m, row_vecs, aj, C);
      }
  }
  for (int64_t j = 0; j < NH; ++j) {
    __m512 o[kMaxChunks];
    for (int64_t c = 0; c < C; ++c) o[c] = _mm512_mul_ps(acc[j * C + c], _mm512_set1_ps(inv_sum[j]));
    Row<T>::store(out + j * D, o, C);
  }
}
#endif

template <typename T>
static void decode_attention_impl(const at::Tensor& q, const at::Tensor& cache, int64_t layer,
                                  const at::Tensor& tables, const at::Tensor& ctx_lens, double scale,
                                  at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t L = cache.size(1), bs = cache.size(3), KVH = cache.size(4);
  const int64_t G = H / KVH;
  const int64_t W = tables.size(1);
  // strides of the pool, in elements
  const int64_t s_block = L * 2 * bs * KVH * D, s_layer = 2 * bs * KVH * D, s_kv = bs * KVH * D, s_tok = KVH * D;
  const T* qp = q.data_ptr<T>();
  const T* cp = cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = ctx_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * bs, "context length out of range for its block table");
#if defined(__AVX512F__)
  if (D % 16 == 0 && D <= 16 * kMaxChunks && H <= kMaxHeads) {
    // a job per sequence (all its heads: each K/V row read whole, in order) when that keeps every thread busy,
    // else a job per (sequence, kv head)
    const int64_t per = B >= 2 * at::get_num_threads() ? KVH : 1;
    const int64_t jobs = B * (KVH / per);
    at::parallel_for(0, jobs, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<__m512> qv(H * (D / 16)), acc(H * (D / 16)), kbuf(16 * KVH * (D / 16));
      for (int64_t job = begin; job < end; ++job) {
        const int64_t b = job / (KVH / per), h0 = (job % (KVH / per)) * per;
        decode_seq_avx512<T>(qp + (b * H + h0 * G) * D, cp, tp + b * W, lp[b], h0, per, G, D, bs,
                             layer * s_layer, layer * s_layer + s_kv, s_block, s_tok, fscale, scores, qv, acc, kbuf,
                             op + (b * H + h0 * G) * D);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), krow(D), acc(G * D), scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / KVH, h = job % KVH;
      const int64_t n = lp[b];
      for (int64_t g = 0; g < G; ++g) load_row(qp + (b * H + h * G + g) * D, qf.data() + g * D, D);
      scores.assign(G * n, 0.f);
      std::vector<float> mx(G, -std::numeric_limits<float>::infinity());
      // pass 1: scores
      for (int64_t t = 0; t < n; ++t) {
        const int64_t blk = tp[b * W + t / bs];
        const T* k = cp + blk * s_block + layer * s_layer + (t % bs) * s_tok + h * D;
        load_row(k, krow.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float s = dot(qf.data() + g * D, krow.data(), D) * fscale;
          scores[g * n + t] = s;
          if (s > mx[g]) mx[g] = s;
        }
      }
      // softmax weights
      std::vector<float> sum(G, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        for (int64_t t = 0; t < n; ++t) {
          sg[t] = std::exp(sg[t] - mx[g]);
          sum[g] += sg[t];
        }
      }
      // pass 2: weighted sum of V
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t blk = tp[b * W + t / bs];
        const T* v = cp + blk * s_block + layer * s_layer + s_kv + (t % bs) * s_tok + h * D;
        load_row(v, krow.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          axpy(scores[g * n + t], krow.data(), acc.data() + g * D, D);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / sum[g];
        T* o = op + (b * H + h * G + g) * D;
        for (int64_t i = 0; i < D; ++i) o[i] = static_cast<T>(acc[g * D + i] * inv);
      }
    }
  });
}

#if defined(__AVX512F__)
// a float32 result rounded to the storage type's precision, as a torch op on that type rounds it (no-op for float32)
template <typename S> static inline __m512 rnd(__m512 v) { return v; }
template <> inline __m512 rnd<at::BFloat16>(__m512 v) { return round_bf16(v); }
#endif
template <typename S> static inline float rnd1(float v) { return static_cast<float>(static_cast<S>(v)); }

// fn(S{}) with S the storage type of t: float or at::BFloat16; anything else is refused, naming `what`
template <typename Fn>
static void dispatch_float_or_bf16(const at::Tensor& t, const char* what, Fn&& fn) {
  if (t.scalar_type() == at::kFloat) fn(float{});
  else if (t.scalar_type() == at::kBFloat16) fn(at::BFloat16{});
  else TORCH_CHECK(false, what, " must be bfloat16 or float32");
}

// Residual add + RMSNorm over rows, in one pass: x += delta (rounded to x's dtype, as x + delta is), then
// weight * rnd(x * rsqrt(mean(x^2) + eps)) with the statistics in float32, rounded as the portable rms_norm rounds.
// Only the order of the float32 sum of squares differs from torch's reduction. x is updated in place.
template <typename S>
static void add_rms_norm_impl(S* xp, const S* dp, const S* wp, S* op, int64_t T, int64_t H, float eps) {
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      S* xr = xp + r * H;
      S* orow = op + r * H;
      float ss = 0.f;
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 acc = _mm512_setzero_ps();
      for (; i + 16 <= H; i += 16) {
        __m512 v = load16(xr + i);
        if (dp) {
          v = rnd<S>(_mm512_add_ps(v, load16(dp + r * H + i)));
          store16(xr + i, v);
        }
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      ss = _mm512_reduce_add_ps(acc);
#endif
      for (; i < H; ++i) {
        if (dp) xr[i] = static_cast<S>(static_cast<float>(xr[i]) + static_cast<float>(dp[r * H + i]));
        const float v = static_cast<float>(xr[i]);
        ss += v * v;
      }
      const float scale = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= H; i += 16) {
        // rnd(x * scale), then rnd(w * that): two roundings, as the portable path does
        const __m512 n = rnd<S>(_mm512_mul_ps(load16(xr + i), _mm512_set1_ps(scale)));
        store16(orow + i, _mm512_mul_ps(load16(wp + i), n));
      }
#endif
      for (; i < H; ++i) {
        const float n = rnd1<S>(static_cast<float>(xr[i]) * scale);
        orow[i] = static_cast<S>(static_cast<float>(wp[i]) * n);
      }
    }
  });
}

static at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H] CPU tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(), "weight must be [H], x's dtype");
  const bool has_delta = delta.has_value() && delta->defined();
  at::Tensor d;
  if (has_delta) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == x.sizes() && d.scalar_type() == x.scalar_type(), "delta must match x");
  }
  auto out = at::empty_like(x);
  auto wc = w.contiguous();
  dispatch_float_or_bf16(x, "x", [&](auto tag) {
    using S = decltype(tag);
    add_rms_norm_impl<S>(x.data_ptr<S>(), has_delta ? d.data_ptr<S>() : nullptr, wc.data_ptr<S>(), out.data_ptr<S>(),
                         x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// RoPE on the query and key heads of a fused qkv projection, in place, then this step's K and V rows written into
// the paged pool: one pass instead of slicing, cat, three multiplies, an add and two index_copy calls. qkv:
// [T, (H + 2 KVH) * D] rows, contiguous; cos/sin: float32 tables [max_pos, D]; rows: [T] layer-0 K row of each
// token in the pool viewed as [-1, KVH, D], plus k_off (and v_off for V). Rounds as the portable apply_rope does:
// cos/sin to qkv's dtype, then rnd(x * cos), rnd(rot * sin), rnd(sum) (no fused multiply-add: -ffp-contract=off).
template <typename S>
static void rope_write_kv_impl(S* base, int64_t ld, const int64_t* pp, const int64_t* rp, const float* cp,
                               const float* sp, S* kv, int64_t T, int64_t D, int64_t k_off, int64_t v_off,
                               int64_t heads, int64_t kv_heads) {
  const int64_t half = D / 2, row_len = kv_heads * D;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      S* x = base + t * ld;
      const float* c = cp + pp[t] * D;
      const float* sn = sp + pp[t] * D;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        S* xh = x + h * D;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= half; i += 16) {
          const __m512 x1 = load16(xh + i), x2 = load16(xh + half + i);
          const __m512 c1 = rnd<S>(load16(c + i)), c2 = rnd<S>(load16(c + half + i));
          const __m512 s1 = rnd<S>(load16(sn + i)), s2 = rnd<S>(load16(sn + half + i));
          // first half: x1 * cos - x2 * sin; second: x2 * cos + x1 * sin (rot = [-x2, x1])
          const __m512 lo = _mm512_add_ps(rnd<S>(_mm512_mul_ps(x1, c1)),
                                          rnd<S>(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s1)));
          const __m512 hi = _mm512_add_ps(rnd<S>(_mm512_mul_ps(x2, c2)), rnd<S>(_mm512_mul_ps(x1, s2)));
          store16(xh + i, lo);
          store16(xh + half + i, hi);
        }
#endif
        for (; i < half; ++i) {
          const float x1 = xh[i], x2 = xh[half + i];
          const float lo = rnd1<S>(x1 * rnd1<S>(c[i])) + rnd1<S>(-x2 * rnd1<S>(sn[i]));
          const float hi = rnd1<S>(x2 * rnd1<S>(c[half + i])) + rnd1<S>(x1 * rnd1<S>(sn[half + i]));
          xh[i] = static_cast<S>(lo);
          xh[half + i] = static_cast<S>(hi);
        }
      }
      std::memcpy(kv + (rp[t] + k_off) * row_len, x + heads * D, row_len * sizeof(S));
      std::memcpy(kv + (rp[t] + v_off) * row_len, x + (heads + kv_heads) * D, row_len * sizeof(S));
    }
  });
}

static void rope_write_kv(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor cache,
                          at::Tensor rows, int64_t k_off, int64_t v_off, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv: [T, W] with contiguous rows");
  TORCH_CHECK(cache.scalar_type() == qkv.scalar_type() && cache.is_contiguous(), "cache: contiguous, qkv's dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "cos/sin: float32");
  const int64_t T = qkv.size(0), D = cos.size(1);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * D && D % 2 == 0, "qkv width is not (H + 2 KVH) * D");
  TORCH_CHECK(positions.numel() == T && rows.numel() == T, "one position and one row per token");
  auto pos = positions.to(at::kLong).contiguous();
  auto rw = rows.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* rp = rw.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0), n_rows = cache.numel() / (kv_heads * D);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "position out of range");
    TORCH_CHECK(rp[t] + k_off >= 0 && rp[t] + v_off < n_rows && rp[t] + k_off < n_rows, "cache row out of range");
  }
  dispatch_float_or_bf16(qkv, "qkv", [&](auto tag) {
    using S = decltype(tag);
    rope_write_kv_impl<S>(qkv.data_ptr<S>(), qkv.stride(0), pp, rp, cos.data_ptr<float>(), sin.data_ptr<float>(),
                          cache.data_ptr<S>(), T, D, k_off, v_off, heads, kv_heads);
  });
}

// SiLU(gate) * up for a fused [T, 2I] gate/up projection: rnd(rnd(silu(g)) * u), silu in float32.
template <typename S>
static void silu_mul_impl(const S* ip, S* op, int64_t T, int64_t I) {
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const S* g = ip + t * 2 * I;
      const S* u = g + I;
      S* o = op + t * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= I; i += 16) {
        const __m512 x = load16(g + i);
        // e^-x by exp16's polynomial; it overflows to inf past 88.7 (x -> -0, as torch's silu gives)
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 sl = rnd<S>(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        store16(o + i, _mm512_mul_ps(sl, load16(u + i)));
      }
#endif
      for (; i < I; ++i) {
        const float x = g[i];
        const float sl = rnd1<S>(x / (1.f + std::exp(-x)));
        o[i] = static_cast<S>(sl * static_cast<float>(u[i]));
      }
    }
  });
}

static at::Tensor silu_mul(at::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "gate/up must be [T, 2I]");
  gu = gu.contiguous();
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = at::empty({T, I}, gu.options());
  dispatch_float_or_bf16(gu, "gate/up", [&](auto tag) {
    using S = decltype(tag);
    silu_mul_impl<S>(gu.data_ptr<S>(), out.data_ptr<S>(), T, I);
  });
  return out;
}

// Index of the largest entry of each row of [N, V] logits (bfloat16 or float32), the first one on ties, as
// torch.argmax (but NaN entries are skipped, where torch would pick them); one row per job. torch's own CPU argmax
// measured 1 ms for 32 float32 rows of 49,152 here.
static at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "[N, V] logits");
  x = x.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  auto row_argmax = [V](auto* r) -> int64_t {
    int64_t i = 0, best_i = 0;
    float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
    if (V >= 16) {
      __m512 bv = load16(r);
      __m512i bi = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      __m512i cur = bi;
      const __m512i step = _mm512_set1_epi32(16);
      for (i = 16; i + 16 <= V; i += 16) {
        cur = _mm512_add_epi32(cur, step);
        const __m512 v = load16(r + i);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);  // strictly greater: the first index stays
        bv = _mm512_mask_mov_ps(bv, gt, v);
        bi = _mm512_mask_mov_epi32(bi, gt, cur);
      }
      best = _mm512_reduce_max_ps(bv);
      const __mmask16 at_max = _mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ);
      best_i = _mm512_mask_reduce_min_epi32(at_max, bi);
    }
#endif
    for (; i < V; ++i) {
      const float v = static_cast<float>(r[i]);
      if (v > best) best = v, best_i = i;
    }
    return best_i;
  };
  dispatch_float_or_bf16(x, "logits", [&](auto tag) {
    using S = decltype(tag);
    const S* xp = x.data_ptr<S>();
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) op[n] = row_argmax(xp + n * V);
    });
  });
  return out;
}

// The argmax of argmax_rows over allowed entries only: rows[m] of [N, V] logits, entry t allowed where bit t % 32
// of bitmask[m][t / 32] is set (a grammar's mask, common/structured.py). The first largest allowed entry; where every
// allowed entry is -inf or NaN, the first allowed one; where none is allowed, 0 (as an argmax over all -inf). One
// pass: a 16-token vector takes its 16 bits of the mask as the compare's write mask.
static at::Tensor masked_argmax_rows(at::Tensor x, at::Tensor rows, at::Tensor bitmask) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "[N, V] logits");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows: [M] int64");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.size(0) == rows.size(0) &&
              bitmask.size(1) * 32 >= x.size(1), "bitmask: [M, ceil(V / 32)] int32");
  x = x.contiguous();
  rows = rows.contiguous();
  bitmask = bitmask.contiguous();
  const int64_t N = x.size(0), V = x.size(1), M = rows.size(0), W = bitmask.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) TORCH_CHECK(rp[m] >= 0 && rp[m] < N, "row ", rp[m], " out of range");
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  auto out = at::empty({M}, rows.options());
  int64_t* op = out.data_ptr<int64_t>();
  auto allowed = [](const uint32_t* bits, int64_t t) { return (bits[t >> 5] >> (t & 31)) & 1u; };
  auto row_argmax = [V, W, &allowed](auto* r, const uint32_t* bits) -> int64_t {
    int64_t i = 0, best_i = -1;
    float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
    if (V >= 16) {
      __m512 bv = _mm512_set1_ps(best);
      __m512i bi = _mm512_set1_epi32(0);
      __m512i cur = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      const __m512i step = _mm512_set1_epi32(16);
      for (i = 0; i + 16 <= V; i += 16) {
        const __mmask16 ok = static_cast<__mmask16>(bits[i >> 5] >> (i & 31));  // i % 32 is 0 or 16
        const __m512 v = load16(r + i);
        const __mmask16 gt = _mm512_mask_cmp_ps_mask(ok, v, bv, _CMP_GT_OQ);  // strictly greater: the first index
        bv = _mm512_mask_mov_ps(bv, gt, v);
        bi = _mm512_mask_mov_epi32(bi, gt, cur);
        cur = _mm512_add_epi32(cur, step);
      }
      const float vmax = _mm512_reduce_max_ps(bv);
      if (vmax > best) {
        best = vmax;
        best_i = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(bv, _mm512_set1_ps(vmax), _CMP_EQ_OQ), bi);
      }
    }
#endif
    for (; i < V; ++i) {
      const float v = static_cast<float>(r[i]);
      if (allowed(bits, i) && v > best) best = v, best_i = i;
    }
    if (best_i < 0) {  // nothing allowed above -inf: the first allowed entry, else 0
      best_i = 0;
      for (int64_t t = 0; t < std::min(V, W * 32); ++t)
        if (allowed(bits, t)) { best_i = t; break; }
    }
    return best_i;
  };
  dispatch_float_or_bf16(x, "logits", [&](auto tag) {
    using S = decltype(tag);
    const S* xp = x.data_ptr<S>();
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) op[m] = row_argmax(xp + rp[m] * V, bp + m * W);
    });
  });
  return out;
}

// ---- the sampler's pick over the whole vocabulary ---------------------------------------------------------------
// Temperature, top-p, min-p and the inverse-CDF pick of each row of [N, V] float32 logits at the row's uniform
// number, with triton_ops.pick_full's semantics (common/sampler.py sends the CPU steps with no top_k here). One row
// per job, on buffers kept by its thread: z = x / t, then w = exp(z - max z) (the largest is 1; NaN entries and those
// below e^-87.3 weigh 0) with the running mass at the end of each block of kPickBlock tokens, in double. Top-p needs
// no sort of the row: the mass by the top 12 bits of each token's order key finds the bin where the mass from the
// top reaches p × total, and only that bin's tokens are sorted (bucketed once more, by the next 12 bits, where there
// are many). The kept tokens' running mass by blocks, a binary search for the block where it passes u × the kept
// mass, and a walk through that block's tokens find the token.
constexpr int64_t kPickBlock = 64;   // tokens a block of the running mass (a multiple of 16)
constexpr int kPickBins = 4096;      // 12 bits of the order key a level of the top-p search
constexpr size_t kPickSortMax = 64;  // more tokens than this in the threshold's bin: bucketed by the next 12 bits

struct PickScratch {
  std::vector<float> z, w, ws;
  std::vector<uint32_t> keys;  // the tokens that top-p's search counts: their keys and masses
  std::vector<double> run, hist;
  std::vector<uint64_t> cand;
};

static PickScratch& pick_scratch() {
  thread_local PickScratch s;
  return s;
}

// z's bits as uint32, ordered as z (larger z, larger key; -0 just below +0; NaN above +inf or below -inf by sign)
static inline uint32_t order_key(float z) {
  uint32_t b;
  std::memcpy(&b, &z, sizeof b);
  return b ^ (static_cast<uint32_t>(static_cast<int32_t>(b) >> 31) | 0x80000000u);
}

// whether a token is kept: its key at least the top-p threshold tau, its mass at least min_p, and some mass at all
static inline bool pick_kept(float z, float w, uint32_t tau, float min_p) {
  return w > 0.f && w >= min_p && order_key(z) >= tau;
}

#if defined(__AVX512F__)
static inline __m512i order_key16(__m512 z) {
  const __m512i b = _mm512_castps_si512(z);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  return _mm512_xor_si512(b, _mm512_or_si512(_mm512_srai_epi32(b, 31), sign));
}
// the 16 lanes' sum into two double accumulators (lanes 0-7, 8-15)
static inline void add_pd16(__m512 e, __m512d& s0, __m512d& s1) {
  s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
  s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
}
#endif

// z[0, Vp) = x / t (IEEE division; -inf past V); returns the largest z, NaN skipped (-inf where there is none)
static float pick_scale(const float* x, int64_t V, int64_t Vp, float t, float* z) {
  const float ninf = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  const __m512 tv = _mm512_set1_ps(t), nv = _mm512_set1_ps(ninf);
  __m512 mv = nv;
  for (int64_t i = 0; i < Vp; i += 16) {
    const __mmask16 in = i + 16 <= V ? static_cast<__mmask16>(0xFFFF)
                                     : static_cast<__mmask16>(i < V ? (1u << (V - i)) - 1 : 0);
    const __m512 v = _mm512_mask_mov_ps(nv, in, _mm512_div_ps(_mm512_maskz_loadu_ps(in, x + i), tv));
    _mm512_storeu_ps(z + i, v);
    mv = _mm512_max_ps(v, mv);  // a NaN lane keeps mv
  }
  return _mm512_reduce_max_ps(mv);
#else
  float m = ninf;
  for (int64_t i = 0; i < V; ++i) {
    z[i] = x[i] / t;
    if (z[i] > m) m = z[i];
  }
  for (int64_t i = V; i < Vp; ++i) z[i] = ninf;
  return m;
#endif
}

// w = exp(z - m) (0 for NaN and below e^-87.3) and run[b] the mass of blocks 0..b, for a finite m
static void pick_weights(const float* z, int64_t nb, float m, float* w, double* run) {
  double acc = 0.0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m), lo = _mm512_set1_ps(-87.3f);
  for (int64_t b = 0; b < nb; ++b) {
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    for (int64_t i = b * kPickBlock; i < (b + 1) * kPickBlock; i += 16) {
      const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(z + i), mv);
      const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, lo, _CMP_GE_OQ), exp16(d));
      _mm512_storeu_ps(w + i, e);
      add_pd16(e, s0, s1);
    }
    acc += _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
    run[b] = acc;
  }
#else
  for (int64_t b = 0; b < nb; ++b) {
    double s = 0.0;
    for (int64_t i = b * kPickBlock; i < (b + 1) * kPickBlock; ++i) {
      const float d = z[i] - m;
      w[i] = d >= -87.3f ? std::exp(d) : 0.f;
      s += w[i];
    }
    acc += s;
    run[b] = acc;
  }
#endif
}

// the limit of pick_weights where the largest z is +inf: each +inf token weighs 1, the others 0
static void pick_weights_inf(const float* z, int64_t nb, float* w, double* run) {
  double acc = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i = b * kPickBlock; i < (b + 1) * kPickBlock; ++i) {
      w[i] = z[i] == std::numeric_limits<float>::infinity() ? 1.f : 0.f;
      acc += w[i];
    }
    run[b] = acc;
  }
}

// The tokens whose order key is at least `lowest`, gathered: their keys into `keys`, their masses into `ws` (z and
// w padded to Vp, the padding -inf and 0); returns how many
static int64_t pick_gather(const float* z, const float* w, int64_t Vp, uint32_t lowest, uint32_t* keys, float* ws) {
  int64_t n = 0;
#if defined(__AVX512F__)
  const __m512i fv = _mm512_set1_epi32(static_cast<int>(lowest));
  for (int64_t i = 0; i < Vp; i += 16) {
    const __m512i k = order_key16(_mm512_loadu_ps(z + i));
    const __mmask16 hit = _mm512_cmpge_epu32_mask(k, fv);
    _mm512_storeu_si512(keys + n, _mm512_maskz_compress_epi32(hit, k));
    _mm512_storeu_ps(ws + n, _mm512_maskz_compress_ps(hit, _mm512_loadu_ps(w + i)));
    n += __builtin_popcount(hit);
  }
#else
  for (int64_t i = 0; i < Vp; ++i) {
    const uint32_t k = order_key(z[i]);
    if (k >= lowest) keys[n] = k, ws[n++] = w[i];
  }
#endif
  return n;
}

// From the top (mass `above` already there), the bin of `shift`'s 12 bits of the key (the tokens' keys, masses)
// where the mass reaches `cut`, adding the bins above it to `above`; -1 where the bins' mass falls short of it
static int pick_bin(const uint32_t* keys, const float* ws, int64_t n, int shift, double cut, double& above,
                    double* hist) {
  std::fill(hist, hist + kPickBins, 0.0);
  for (int64_t j = 0; j < n; ++j) hist[(keys[j] >> shift) & (kPickBins - 1)] += ws[j];
  for (int b = kPickBins - 1; b >= 0; --b) {
    if (above + hist[b] >= cut) return b;
    above += hist[b];
  }
  return -1;
}

// Keeps (in place, in order) the tokens whose key's 12 bits at `shift` are `bin`; returns how many
static int64_t pick_keep_bin(uint32_t* keys, float* ws, int64_t n, int shift, int bin) {
  int64_t m = 0, j = 0;
#if defined(__AVX512F__)
  const __m512i bv = _mm512_set1_epi32(bin), mask = _mm512_set1_epi32(kPickBins - 1);
  const __m128i sh = _mm_cvtsi32_si128(shift);
  for (; j + 16 <= n; j += 16) {  // m <= j: the stores land on entries already read
    const __m512i k = _mm512_loadu_si512(keys + j);
    const __m512 wv = _mm512_loadu_ps(ws + j);
    const __mmask16 hit = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_srl_epi32(k, sh), mask), bv);
    _mm512_mask_storeu_epi32(keys + m, (1u << __builtin_popcount(hit)) - 1, _mm512_maskz_compress_epi32(hit, k));
    _mm512_mask_storeu_ps(ws + m, (1u << __builtin_popcount(hit)) - 1, _mm512_maskz_compress_ps(hit, wv));
    m += __builtin_popcount(hit);
  }
#endif
  for (; j < n; ++j)
    if (static_cast<int>((keys[j] >> shift) & (kPickBins - 1)) == bin) keys[m] = keys[j], ws[m++] = ws[j];
  return m;
}

// top-p's threshold: the largest order key tau whose tokens (key >= tau) have mass >= cut, for 0 < cut <= total,
// with no sort of the row: the mass by the top 12 bits of the key finds the bin where the mass from the top reaches
// the cut, the next 12 bits the same within it, and the tokens left (those of the same top 24 bits) are sorted.
// The first step counts only the tokens within ln(V / (total - cut)) + 1 of the max, which carry all but less than
// total - cut of the mass, so the threshold is among them: a model's long tail of unlikely tokens is skipped (all the
// tokens again where rounding leaves it short).
static uint32_t pick_top_p_threshold(const float* z, const float* w, int64_t V, int64_t Vp, float m, double total,
                                     double cut, PickScratch& s) {
  uint32_t* keys = s.keys.data();
  float* ws = s.ws.data();
  double* hist = s.hist.data();
  double above = 0.0;
  int bin = -1;
  int64_t n = 0;
  const double slack = total - cut;
  if (slack > 0.0) {
    const float low = m - static_cast<float>(std::log(static_cast<double>(V) / slack) + 1.0);
    if (low > m - 87.3f) {
      n = pick_gather(z, w, Vp, order_key(low) & 0xFFF00000u, keys, ws);
      bin = pick_bin(keys, ws, n, 20, cut, above, hist);
    }
  }
  if (bin < 0) {
    above = 0.0;
    n = pick_gather(z, w, Vp, 0, keys, ws);
    bin = pick_bin(keys, ws, n, 20, cut, above, hist);
    if (bin < 0) return 0;  // the bins' mass short of the cut by rounding: every token kept
  }
  n = pick_keep_bin(keys, ws, n, 20, bin);
  uint32_t lowest = static_cast<uint32_t>(bin) << 20;  // the lowest key left to choose from
  if (n > static_cast<int64_t>(kPickSortMax)) {  // many tokens in the bin: the next 12 bits of the key the same way
    const int sub = pick_bin(keys, ws, n, 8, cut, above, hist);
    if (sub < 0) return lowest;  // short of the cut by rounding: the whole bin kept
    lowest |= static_cast<uint32_t>(sub) << 8;
    n = pick_keep_bin(keys, ws, n, 8, sub);
  }
  auto& cand = s.cand;  // key << 32 | the mass's bits, sorted by key, largest first
  cand.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    uint32_t wb;
    std::memcpy(&wb, ws + j, sizeof wb);
    cand[j] = static_cast<uint64_t>(keys[j]) << 32 | wb;
  }
  std::sort(cand.begin(), cand.end(), std::greater<uint64_t>());
  for (size_t j = 0; j < cand.size();) {  // a key's tokens all at once: ties with the threshold are all kept
    const uint64_t key = cand[j] >> 32;
    for (; j < cand.size() && cand[j] >> 32 == key; ++j) {
      float wj;
      const uint32_t wb = static_cast<uint32_t>(cand[j]);
      std::memcpy(&wj, &wb, sizeof wj);
      above += wj;
    }
    if (above >= cut) return static_cast<uint32_t>(key);
  }
  return cand.empty() ? lowest : static_cast<uint32_t>(cand.back() >> 32);  // short by rounding: all of them kept
}

// run[b] = the kept mass of blocks 0..b (pick_kept)
static void pick_kept_run(const float* z, const float* w, int64_t nb, uint32_t tau, float min_p, double* run) {
  double acc = 0.0;
#if defined(__AVX512F__)
  const __m512i tv = _mm512_set1_epi32(static_cast<int>(tau));
  const __m512 mp = _mm512_set1_ps(min_p);
  for (int64_t b = 0; b < nb; ++b) {
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    for (int64_t i = b * kPickBlock; i < (b + 1) * kPickBlock; i += 16) {
      const __m512 e = _mm512_loadu_ps(w + i);
      const __mmask16 keep = _mm512_mask_cmpge_epu32_mask(_mm512_cmp_ps_mask(e, mp, _CMP_GE_OQ),
                                                          order_key16(_mm512_loadu_ps(z + i)), tv);
      add_pd16(_mm512_maskz_mov_ps(keep, e), s0, s1);
    }
    acc += _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
    run[b] = acc;
  }
#else
  for (int64_t b = 0; b < nb; ++b) {
    double s = 0.0;
    for (int64_t i = b * kPickBlock; i < (b + 1) * kPickBlock; ++i)
      if (pick_kept(z[i], w[i], tau, min_p)) s += w[i];
    acc += s;
    run[b] = acc;
  }
#endif
}

// The first token whose running kept mass passes u × the kept mass: the block by a binary search of the running
// masses, the token by a walk through it; where rounding leaves none there, the block's last kept token.
static int64_t pick_walk(const float* z, const float* w, int64_t V, int64_t nb, const double* run, uint32_t tau,
                         float min_p, double u) {
  const double target = std::max(0.0, u * run[nb - 1]);  // at least 0: a block with kept mass
  const int64_t b = std::upper_bound(run, run + nb, target) - run;
  int64_t last = -1;
  if (b == nb) {  // no mass kept, or u not below 1: the last kept token
    for (int64_t i = V - 1; i >= 0 && last < 0; --i)
      if (pick_kept(z[i], w[i], tau, min_p)) last = i;
    return last < 0 ? 0 : last;
  }
  double r = b ? run[b - 1] : 0.0;
  for (int64_t i = b * kPickBlock; i < std::min(V, (b + 1) * kPickBlock); ++i) {
    if (!pick_kept(z[i], w[i], tau, min_p)) continue;
    r += w[i];
    last = i;
    if (r > target) return i;
  }
  return last < 0 ? 0 : last;
}

static int64_t pick_row(const float* x, int64_t V, const float* p, int64_t temp_col, int64_t topp_col,
                        int64_t minp_col, int64_t u_col, bool top_p, bool min_p, PickScratch& s) {
  const int64_t nb = (V + kPickBlock - 1) / kPickBlock, Vp = nb * kPickBlock;
  if (static_cast<int64_t>(s.z.size()) < Vp) {
    s.z.resize(Vp), s.w.resize(Vp), s.ws.resize(Vp), s.keys.resize(Vp);
  }
  if (static_cast<int64_t>(s.run.size()) < nb) s.run.resize(nb);
  if (s.hist.size() < kPickBins) s.hist.resize(kPickBins);
  float* z = s.z.data();
  float* w = s.w.data();
  double* run = s.run.data();
  const float m = pick_scale(x, V, Vp, p[temp_col], z);
  if (!(m > -std::numeric_limits<float>::infinity())) return 0;  // no finite entry (all masked, or NaN)
  if (m == std::numeric_limits<float>::infinity())
    pick_weights_inf(z, nb, w, run);
  else
    pick_weights(z, nb, m, w, run);
  uint32_t tau = 0;
  if (top_p && p[topp_col] < 1.f) {
    const double cut = static_cast<double>(p[topp_col]) * run[nb - 1];
    tau = cut > 0.0 ? pick_top_p_threshold(z, w, V, Vp, m, run[nb - 1], cut, s) : order_key(m);
  }
  const float mp = min_p && p[minp_col] > 0.f ? p[minp_col] : 0.f;
  if (tau || mp > 0.f) pick_kept_run(z, w, nb, tau, mp, run);
  return pick_walk(z, w, V, nb, run, tau, mp, static_cast<double>(p[u_col]));
}

// x: [N, V] float32 logits (rows may be strided; not modified); prm: [N, C] float32, each row's temperature,
// top-p, min-p and uniform number at the given columns; top_p / min_p: whether to apply them at all. int64 [N].
static at::Tensor pick_rows(at::Tensor x, at::Tensor prm, int64_t temp_col, int64_t topp_col, int64_t minp_col,
                            int64_t u_col, bool top_p, bool min_p) {
  TORCH_CHECK(x.device().is_cpu() && prm.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "x: [N, V] float32 logits");
  TORCH_CHECK(x.size(1) <= std::numeric_limits<int32_t>::max(), "vocabulary too large");
  TORCH_CHECK(prm.dim() == 2 && prm.scalar_type() == at::kFloat && prm.size(0) == x.size(0),
              "prm: [N, C] float32");
  for (int64_t col : {temp_col, topp_col, minp_col, u_col})
    TORCH_CHECK(col >= 0 && col < prm.size(1), "column ", col, " out of range");
  if (x.stride(1) != 1) x = x.contiguous();
  prm = prm.contiguous();
  const int64_t N = x.size(0), V = x.size(1), C = prm.size(1), sx = x.stride(0);
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const float* pp = prm.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    PickScratch& s = pick_scratch();
    for (int64_t n = begin; n < end; ++n)
      op[n] = pick_row(xp + n * sx, V, pp + n * C, temp_col, topp_col, minp_col, u_col, top_p, min_p, s);
  });
  return out;
}

// ---- small-batch bfloat16 matmul (decode) ---------------------------------------------------------------------
// oneDNN's packed linear costs ~17 us of fixed overhead a call (measured: a 64x64 matmul), which at decode batch
// sizes is a fifth of a SmolLM2 layer's matmul time. For those batches (the engine: up to 32 rows) this path calls
// torch's brgemm micro-kernel (AMX) directly on weights packed once into blocks of 32 output columns, each block
// [K/2, 32, 2] (VNNI pairs), threads splitting the blocks. Same instruction, same K order, float32 accumulation and
// one rounding: the results equal oneDNN's bit for bit up to 32 rows, above which oneDNN changes its summation
// (tests/test_cpu_kernels.py).
constexpr int64_t kSmallBlock = 32;

static bool amx_bf16() { return at::native::cpublas::could_pack(at::kBFloat16); }

// w: [N, K] bfloat16 -> [N / 32, K / 2, 32, 2]
static at::Tensor pack_small_batch(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "weight must be a [N, K] bfloat16 matrix");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kSmallBlock == 0 && K % 32 == 0, "weight shape [", N, ", ", K, "] is not a multiple of 32");
  auto wt = w.t().contiguous();  // [K, N]
  auto out = at::empty({N / kSmallBlock, K / 2, kSmallBlock, 2}, w.options());
  for (int64_t b = 0; b < N / kSmallBlock; ++b)
    at::native::cpublas::pack(K, kSmallBlock, N, kSmallBlock, at::kBFloat16, at::kBFloat16,
                              wt.data_ptr<at::BFloat16>() + b * kSmallBlock,
                              out.data_ptr<at::BFloat16>() + b * kSmallBlock * K);
  return out;
}

// x [M, K] @ w.T (+ bias) with w packed by pack_small_batch -> [M, N] bfloat16
static at::Tensor linear_small_batch(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kSmallBlock, "packed weight must come from pack_small_batch");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * kSmallBlock;
  TORCH_CHECK(packed.size(1) * 2 == K, "x has ", K, " columns, the weight ", packed.size(1) * 2);
  x = x.contiguous();
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias has ", bias->numel(), " elements, expected ", N);
    bf = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(M * kSmallBlock);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kSmallBlock;
      at::native::cpublas::brgemm(M, kSmallBlock, K, K, kSmallBlock, kSmallBlock, false, xp, wp + n0 * K, c.data());
      for (int64_t m = 0; m < M; ++m) {
        float* cr = c.data() + m * kSmallBlock;
        if (bp)
          for (int64_t i = 0; i < kSmallBlock; ++i) cr[i] += bp[n0 + i];
        at::BFloat16* yr = yp + m * N + n0;
        for (int64_t i = 0; i < kSmallBlock; ++i) yr[i] = static_cast<at::BFloat16>(cr[i]);  // to nearest even
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return y;
}

// ---- prefill attention (bfloat16, AMX) -------------------------------------------------------------------------
// Causal self-attention of one sequence's prompt (no cached prefix), all heads. torch's CPU flash attention takes
// ~420 us a layer for SmolLM2 at 300 tokens (its 64-row blocks leave a slow tail) and runs each query head apart.
// Here a kv head's K (transposed) and V are packed once into brgemm's VNNI layout, then each job takes 64 query
// tokens times the G query heads of one kv head (64 G rows): scores by brgemm over the key blocks up to the
// diagonal, a causal softmax in float32 whose weights are rounded to bfloat16 (as torch's flash attention rounds
// them for its second matmul), and the weighted V by one more brgemm. Measured on the 2-core AMX VM, 9 heads over 3
// kv heads: 256 tokens 250 -> 205 us, 300 tokens 424 -> 270 us, 1,024 tokens on par; at 2,000 tokens it is 20%
// slower (the whole score row is kept), so the engine takes it up to 1,024 tokens.
#if defined(__AVX512F__)
static at::Tensor prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [S, heads, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "prefill attention is bfloat16");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(k.size(0) == S && v.size(0) == S && v.size(1) == KVH && k.size(2) == D && v.size(2) == D &&
                  KVH > 0 && H % KVH == 0, "q, k, v shapes disagree");
  TORCH_CHECK(D % 16 == 0, "head dim must be a multiple of 16");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D, "heads of a row must be contiguous");
  const int64_t G = H / KVH, ldq = q.stride(0), ldk = k.stride(0), ldv = v.stride(0);
  constexpr int64_t KB = 64, QB = 64;
  const int64_t S_pad = (S + KB - 1) / KB * KB, NKB = S_pad / KB, NQB = (S + QB - 1) / QB;
  auto out = at::empty({S, H, D}, q.options());
  if (S == 0) return out;
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  // per kv head: K^T as NKB blocks of [D/2][KB][2], V as [S_pad/2][D][2]; tokens past S are zero
  auto kpack = at::empty({KVH, S_pad * D}, q.options()), vpack = at::empty({KVH, S_pad * D}, q.options());
  uint16_t* kpk = reinterpret_cast<uint16_t*>(kpack.data_ptr<at::BFloat16>());
  uint16_t* vpk = reinterpret_cast<uint16_t*>(vpack.data_ptr<at::BFloat16>());
  at::parallel_for(0, KVH * NKB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t h = job / NKB, j = job % NKB;
      uint32_t* kd = reinterpret_cast<uint32_t*>(kpk + h * S_pad * D + j * KB * D);
      uint16_t* vd = vpk + h * S_pad * D + j * KB * D;
      for (int64_t n = 0; n < KB; ++n) {
        const int64_t t = j * KB + n;
        if (t < S) {
          const uint32_t* ks = reinterpret_cast<const uint32_t*>(kp + t * ldk + h * D);  // (d, d + 1) pairs
          const uint16_t* vs = vp + t * ldv + h * D;
          for (int64_t p = 0; p < D / 2; ++p) kd[p * KB + n] = ks[p];
          for (int64_t d = 0; d < D; ++d) vd[((n / 2) * D + d) * 2 + (n % 2)] = vs[d];
        } else {
          for (int64_t p = 0; p < D / 2; ++p) kd[p * KB + n] = 0u;
          for (int64_t d = 0; d < D; ++d) vd[((n / 2) * D + d) * 2 + (n % 2)] = 0;
        }
      }
    }
  });
  const float fs = static_cast<float>(scale);
  at::parallel_for(0, KVH * NQB, 1, [&](int64_t begin, int64_t end) {
    const int64_t R = QB * G;
    std::vector<at::BFloat16> qb(R * D), pb(R * S_pad);
    std::vector<float> sc(R * S_pad), o(R * D), inv(R);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t h = job % KVH, qi = NQB - 1 - job / KVH;  // the longest rows first
      const int64_t q0 = qi * QB, qn = std::min(QB, S - q0), rows = qn * G;
      for (int64_t i = 0; i < qn; ++i)  // row i * G + g: token q0 + i, query head h * G + g
        std::memcpy(qb.data() + i * G * D, qp + (q0 + i) * ldq + h * G * D, G * D * sizeof(uint16_t));
      const int64_t nb = (q0 + qn + KB - 1) / KB, kv_pad = nb * KB;
      const at::BFloat16* kh = reinterpret_cast<const at::BFloat16*>(kpk + h * S_pad * D);
      for (int64_t j = 0; j < nb; ++j)
        at::native::cpublas::brgemm(rows, KB, D, D, KB, kv_pad, false, qb.data(), kh + j * KB * D, sc.data() + j * KB);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = q0 + r / G + 1;  // keys [0, n) are visible
        const int64_t n16 = (n + 15) & ~int64_t(15);
        const float* s = sc.data() + r * kv_pad;
        at::BFloat16* p = pb.data() + r * kv_pad;
        const __mmask16 tail = static_cast<__mmask16>((1u << (n & 15)) - 1u);
        __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t c = 0; c < n16; c += 16) {
          const __m512 x = _mm512_loadu_ps(s + c);
          mx = _mm512_max_ps(mx, c + 16 > n && (n & 15) ? _mm512_mask_mov_ps(mx, tail, x) : x);
        }
        const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * fs), sv = _mm512_set1_ps(fs);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < n16; c += 16) {
          __m512 e = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + c), sv, mv));
          if (c + 16 > n && (n & 15)) e = _mm512_maskz_mov_ps(tail, e);
          const __m512 eb = round_bf16(e);  // the weight the second matmul uses, and the one summed
          sum = _mm512_add_ps(sum, eb);
          store16(p + c, eb);
        }
        for (int64_t c = n16; c < kv_pad; c += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + c),
                                                                      _mm256_setzero_si256());
        inv[r] = 1.f / _mm512_reduce_add_ps(sum);
      }
      at::native::cpublas::brgemm(rows, D, kv_pad, kv_pad, D, D, false, pb.data(),
                                  reinterpret_cast<const at::BFloat16*>(vpk + h * S_pad * D), o.data());
      for (int64_t r = 0; r < rows; ++r) {
        at::BFloat16* dst = op + ((q0 + r / G) * H + h * G + r % G) * D;
        for (int64_t d = 0; d < D; d += 16)
          store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o.data() + r * D + d), _mm512_set1_ps(inv[r])));
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}
#endif

// q: [B, H, D]; cache: [blocks, layers, 2, block_size, kv_heads, D] (contiguous); tables: [B, W] int64;
// ctx_lens: [B] int64. Returns [B, H, D] in q's dtype.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor cache, int64_t layer, at::Tensor tables,
                                  at::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 6, "q must be [B, H, D], cache [blocks, layers, 2, bs, kvh, D]");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(cache.is_contiguous() && tables.is_contiguous() && ctx_lens.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.size(2) == cache.size(5) && q.size(1) % cache.size(4) == 0, "head shapes disagree");
  TORCH_CHECK(layer >= 0 && layer < cache.size(1), "layer out of range");
  q = q.contiguous();
  auto out = at::empty_like(q);
  dispatch_float_or_bf16(q, "q", [&](auto tag) {
    decode_attention_impl<decltype(tag)>(q, cache, layer, tables, ctx_lens, scale, out);
  });
  return out;
}

// Every kernel lets go of the GIL while it runs (it touches no Python object), as torch's own ops do: the worker's
// asyncio and detokenizer threads run then, instead of holding the GIL when the engine thread comes back for it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over the KV pool (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q/k of a fused qkv, in place, and K/V into the pool (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of a fused [T, 2I] projection (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "argmax of each row, first index on ties (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("masked_argmax_rows", &masked_argmax_rows, "argmax of some rows over their bitmask's allowed entries (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("pick_rows", &pick_rows, "temperature, top-p, min-p and the inverse-CDF pick over whole rows (CPU)",
        py::arg("x"), py::arg("prm"), py::arg("temp_col"), py::arg("topp_col"), py::arg("minp_col"),
        py::arg("u_col"), py::arg("top_p"), py::arg("min_p"), py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "x += delta; RMSNorm(x) * weight, bf16/fp32 rows (CPU)", py::arg("x"),
        py::arg("delta"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
#if defined(__AVX512F__)
  m.def("prefill_attention", &prefill_attention, "causal self-attention of one prompt, bfloat16 (CPU, AMX brgemm)",
        py::call_guard<py::gil_scoped_release>());
#endif
  m.def("amx_bf16", &amx_bf16, "whether torch's brgemm packs bfloat16 for AMX on this CPU");
  m.def("pack_small_batch", &pack_small_batch, "pack a [N, K] bfloat16 weight for linear_small_batch");
  m.def("linear_small_batch", &linear_small_batch, "x @ w.T (+ bias), bfloat16, few rows (CPU, AMX brgemm)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
#if defined(__AVX512F__)
  m.attr("vectorized") = true;
#else
  m.attr("vectorized") = false;
#endif
}
