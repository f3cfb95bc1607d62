// Paged decode attention on the CPU: one query token per sequence, attending over its blocks in place.
//
// The portable path gathers every sequence's K and V into a padded copy and runs SDPA: the KV bytes are read
// twice and written once per layer. This kernel reads each K and V row once, straight from the paged pool
// (layout [blocks, layers, 2, block_size, kv_heads, head_dim]), and computes in float32 whatever the storage
// dtype. Work is split over (sequence, kv head); each KV row is loaded once for all query heads of its group.
// Per (sequence, head) the arithmetic does not depend on the batch, so results are batch invariant.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

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

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), krow(D), acc(G * D), scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / KVH, h = job % KVH;
      const int64_t n = lp[b];
      TORCH_CHECK(n >= 1 && n <= W * bs, "context length out of range for its block table");
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
  if (q.scalar_type() == at::kFloat) {
    decode_attention_impl<float>(q, cache, layer, tables, ctx_lens, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_attention_impl<at::BFloat16>(q, cache, layer, tables, ctx_lens, scale, out);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 only");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over the KV pool (CPU)");
}
