// CPU kernels for decode-sized work, registered as torch ops under `dcpctl::`.
//
// At batch 1 a decode step on CPU is bound by reading the weights and, once that is fast, by the
// fixed cost of many small torch ops. These kernels do the per-token work of a step in one pass each
// (the matmuls are in cpu_gemm.cpp, built into the same library):
//   rms_norm      HF's RMSNorm (fp32 statistics, rounding as HF rounds), optionally after the residual add.
//   rotary        rotary embedding of a [tokens, heads, dim] view, in fp32 as torch computes it (same bits).
//   store_kv      new keys/values into the paged cache through the slot mapping.
//   paged_decode  one query per sequence against its paged keys/values: exact softmax in fp32,
//                 returning the log-sum-exp per head (the DCP merge needs it).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// Elements of work below which a loop stays on the calling thread. Every at::parallel_for that forks is a
// barrier of all threads: a few microseconds on idle cores, but a scheduler time slice (milliseconds) when
// another process holds one of the cores, and a batch-16 decode step has ~270 of them (benchmarks/RESULTS.md).
// Decode-sized norms, rotary and the attention merge are far below this; prefill-sized ones still fork.
constexpr int64_t kSerialElements = 1 << 15;

// The grain for a parallel_for over items of `item_elements` each: items per task so that a task is at least
// kSerialElements (so a loop of fewer elements than that never forks).
inline int64_t grain_for(int64_t item_elements) { return std::max<int64_t>(1, kSerialElements / std::max<int64_t>(1, item_elements)); }

inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return bf16_to_float(v.x); }

template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);
}

// Calls f.template operator()<T>() with T the C++ type of a float32 or bfloat16 tensor.
template <typename F>
void on_dtype(const at::Tensor& t, const char* op, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 expected");
    f(c10::BFloat16{});
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* sum_out, int64_t rows, int64_t d,
                   float eps) {
  at::parallel_for(0, rows, grain_for(d), [&](int64_t begin, int64_t end) {
    std::vector<float> h(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      float sq = 0.f;
      for (int64_t i = 0; i < d; ++i) {
        // the sum rounds to the model dtype first, as HF's `hidden + residual` does
        T v = residual ? from_float<T>(to_float(xr[i]) + to_float(residual[r * d + i])) : xr[i];
        if (residual) sum_out[r * d + i] = v;
        h[i] = to_float(v);
        sq += h[i] * h[i];
      }
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(d) + eps);
      // HF: weight * (h * rsqrt(var + eps)).to(dtype), the product rounded again
      for (int64_t i = 0; i < d; ++i) out[r * d + i] = from_float<T>(to_float(weight[i]) * to_float(from_float<T>(h[i] * inv)));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.numel() == d && weight.scalar_type() == x.scalar_type(), "rms_norm: weight [d] of x's dtype expected");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor rc = residual.has_value() ? residual->contiguous() : at::Tensor();
  TORCH_CHECK(!rc.defined() || (rc.sizes() == x.sizes() && rc.scalar_type() == x.scalar_type()),
              "rms_norm: residual must match x");
  at::Tensor out = at::empty_like(xc), sum = rc.defined() ? at::empty_like(xc) : at::Tensor();
  on_dtype(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows(xc.data_ptr<T>(), rc.defined() ? rc.data_ptr<T>() : nullptr, wc.data_ptr<T>(), out.data_ptr<T>(),
                  sum.defined() ? sum.data_ptr<T>() : nullptr, xc.numel() / d, d, static_cast<float>(eps));
  });
  return {out, sum};
}

// x [T, H, D] (any strides but the last), cos / sin [T, 1, D] fp32 with the rotation's sign folded into sin:
// out = x * cos + partner(x) * sin, partner pairing dim i with i + D/2 (neox) or each adjacent pair (interleaved).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x [tokens, heads, dim] with a contiguous last dim expected");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && cos.numel() == tokens * dim && sin.numel() == tokens * dim, "rotary: cos/sin [T, 1, D] expected");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "rotary: fp32 cos/sin expected");
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  on_dtype(x, "rotary", [&](auto tag) {
    using T = decltype(tag);
    const T* src = x.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    const float* cp = cc.data_ptr<float>();
    const float* sp = sc.data_ptr<float>();
    at::parallel_for(0, tokens * heads, grain_for(dim), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t t = row / heads, h = row % heads;
        const T* xr = src + t * x.stride(0) + h * x.stride(1);
        const float* c = cp + t * dim;
        const float* sn = sp + t * dim;
        T* o = dst + row * dim;
        if (interleaved) {
          for (int64_t i = 0; i < dim; i += 2) {
            const float even = to_float(xr[i]), odd = to_float(xr[i + 1]);
            o[i] = from_float<T>(even * c[i] + odd * sn[i]);
            o[i + 1] = from_float<T>(odd * c[i + 1] + even * sn[i + 1]);
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            const float lo = to_float(xr[i]), hi = to_float(xr[i + half]);
            o[i] = from_float<T>(lo * c[i] + hi * sn[i]);
            o[i + half] = from_float<T>(hi * c[i + half] + lo * sn[i + half]);
          }
        }
      }
    });
  });
  return out;
}

// A layer's cache view [blocks, block_size, heads, dim] in any layout whose last dim is contiguous (the
// torch backend's storage is head-major behind it); new_kv [tokens, heads, dim].
void store_kv(const at::Tensor& new_kv, at::Tensor& cache, const at::Tensor& slots) {
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1, "store_kv: a [blocks, B, H, D] cache view expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == new_kv.size(0), "store_kv: int64 slots [tokens] expected");
  const int64_t block = cache.size(1), heads = cache.size(2), dim = cache.size(3), tokens = new_kv.size(0);
  TORCH_CHECK(new_kv.dim() == 3 && new_kv.size(1) == heads && new_kv.size(2) == dim, "store_kv: new_kv [tokens, heads, D] expected");
  TORCH_CHECK(new_kv.stride(2) == 1, "store_kv: new_kv's last dim must be contiguous");
  const int64_t* slot = slots.data_ptr<int64_t>();
  on_dtype(new_kv, "store_kv", [&](auto in_tag) {
    using In = decltype(in_tag);
    on_dtype(cache, "store_kv", [&](auto cache_tag) {
      using C = decltype(cache_tag);
      const In* src = new_kv.data_ptr<In>();
      C* dst = cache.data_ptr<C>();
      for (int64_t t = 0; t < tokens; ++t) {
        if (slot[t] < 0) continue;  // another DCP rank stores this token
        const int64_t b = slot[t] / block, off = slot[t] % block;
        for (int64_t h = 0; h < heads; ++h) {
          C* to = dst + b * cache.stride(0) + off * cache.stride(1) + h * cache.stride(2);
          const In* from = src + t * new_kv.stride(0) + h * new_kv.stride(1);
          for (int64_t i = 0; i < dim; ++i) to[i] = from_float<C>(to_float(from[i]));
        }
      }
    });
  });
}

// exp(x) for x <= 0 in a form the compiler vectorizes (std::exp does not, here): x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (relative error < 2e-7), 2^n into the exponent.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this e^x underflows fp32's normal range; the sums cannot tell
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = x - n * 0.693145752f - n * 1.42860677e-6f;  // ln2 split so n * hi is exact
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

struct DecodeShape {
  int64_t seqs, heads, kv_heads, block, dk, dv, max_blocks;
  int64_t key_block_stride, key_token_stride, key_head_stride;  // of the [blocks, B, H, D] views
  int64_t value_block_stride, value_token_stride, value_head_stride;
  float scale;
};

constexpr int64_t kMinChunkTokens = 64;  // below this a context is not worth splitting over threads

// Work items are (sequence, KV head, chunk of whole blocks): each key and value row is read and widened
// once for all the query heads that share it (GQA groups, MLA's single latent head), and at small batch
// long contexts split into chunks so that every thread has work. An item leaves, per query head, its
// chunk's max score, sum of exp(score - max) and exp-weighted value sum; a second pass merges the
// chunks of each head exactly (the same algebra as the DCP merge).
template <typename Q, typename C, int64_t FixedDk, int64_t FixedDv>
void decode_heads(const Q* q, const C* keys, const C* values, const int64_t* tables, const int64_t* lens, Q* out,
                  float* lse, const DecodeShape& a) {
  // compile-time head sizes for the common ones let the compiler unroll the per-token loops
  const int64_t dk = FixedDk ? FixedDk : a.dk, dv = FixedDv ? FixedDv : a.dv;
  const int64_t group = a.heads / a.kv_heads, pairs = a.seqs * a.kv_heads;
  const int64_t max_len = *std::max_element(lens, lens + a.seqs);
  const int64_t wanted = (2 * at::get_num_threads() + pairs - 1) / pairs;
  int64_t chunk = std::max((max_len + wanted - 1) / wanted, kMinChunkTokens);
  chunk = (chunk + a.block - 1) / a.block * a.block;
  const int64_t chunks = std::max<int64_t>(1, (max_len + chunk - 1) / chunk);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> part_max(a.seqs * a.heads * chunks, neg_inf), part_sum(part_max.size(), 0.f);
  std::vector<float> part_acc(part_max.size() * dv, 0.f);

  at::parallel_for(0, pairs * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dk), row(std::max(dk, dv)), scores(group * chunk), top(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / (a.kv_heads * chunks), g = item / chunks % a.kv_heads, c = item % chunks;
      const int64_t from = c * chunk, to = std::min(lens[s], from + chunk), n = to - from;
      if (n <= 0) continue;  // past this sequence's end (or none of it on this rank)
      const int64_t first_head = s * a.heads + g * group;
      const int64_t* table = tables + s * a.max_blocks;
      for (int64_t i = 0; i < group * dk; ++i) qf[i] = to_float(q[first_head * dk + i]) * a.scale;
      float* __restrict__ widened = row.data();  // restrict: the stores below never alias the loads
      std::fill(top.begin(), top.end(), neg_inf);
      for (int64_t first = from; first < to; first += a.block) {  // one block of keys at a time, in place
        const C* k = keys + table[first / a.block] * a.key_block_stride + g * a.key_head_stride;
        for (int64_t j = first; j < std::min(to, first + a.block); ++j, k += a.key_token_stride) {
          for (int64_t i = 0; i < dk; ++i) widened[i] = to_float(k[i]);
          for (int64_t h = 0; h < group; ++h) {
            const float* __restrict__ qh = qf.data() + h * dk;
            float dotv = 0.f;
#pragma omp simd reduction(+ : dotv)
            for (int64_t i = 0; i < dk; ++i) dotv = std::fma(qh[i], widened[i], dotv);
            scores[h * chunk + j - from] = dotv;
            top[h] = std::max(top[h], dotv);
          }
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float* sh = scores.data() + h * chunk;
        const float m = top[h];
        part_max[(first_head + h) * chunks + c] = m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          sh[j] = exp_nonpositive(sh[j] - m);
          sum += sh[j];
        }
        part_sum[(first_head + h) * chunks + c] = sum;
      }
      for (int64_t first = from; first < to; first += a.block) {
        const C* v = values + table[first / a.block] * a.value_block_stride + g * a.value_head_stride;
        for (int64_t j = first; j < std::min(to, first + a.block); ++j, v += a.value_token_stride) {
          for (int64_t i = 0; i < dv; ++i) widened[i] = to_float(v[i]);
          for (int64_t h = 0; h < group; ++h) {
            const float p = scores[h * chunk + j - from];
            float* __restrict__ acc = part_acc.data() + ((first_head + h) * chunks + c) * dv;
#pragma omp simd
            for (int64_t i = 0; i < dv; ++i) acc[i] = std::fma(p, widened[i], acc[i]);
          }
        }
      }
    }
  });

  at::parallel_for(0, a.seqs * a.heads, grain_for(chunks * dv), [&](int64_t begin, int64_t end) {
    std::vector<float> merged(dv);
    for (int64_t head = begin; head < end; ++head) {
      const float* m = part_max.data() + head * chunks;
      const float top = *std::max_element(m, m + chunks);
      Q* o = out + head * dv;
      if (top == neg_inf) {  // this rank holds none of the sequence: contributes 0 with weight exp(-inf)
        for (int64_t i = 0; i < dv; ++i) o[i] = from_float<Q>(0.f);
        lse[head] = neg_inf;
        continue;
      }
      float total = 0.f;
      std::fill(merged.begin(), merged.end(), 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        if (m[c] == neg_inf) continue;
        const float w = std::exp(m[c] - top);
        total += w * part_sum[head * chunks + c];
        const float* acc = part_acc.data() + (head * chunks + c) * dv;
        for (int64_t i = 0; i < dv; ++i) merged[i] += w * acc[i];
      }
      for (int64_t i = 0; i < dv; ++i) o[i] = from_float<Q>(merged[i] / total);
      lse[head] = top + std::log(total);
    }
  });
}

// q [S, H, Dk]; key_cache / value_cache [blocks, B, Hkv, D] views; without value_cache the values
// are the first value_dim dims of the keys (MLA). Sequence s's local token j is at
// block_tables[s, j / B], offset j % B, for j < lens[s]. Returns out [S, H, value_dim] and lse [S, H].
std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& key_cache,
                                                const std::optional<at::Tensor>& value_cache,
                                                const at::Tensor& block_tables, const at::Tensor& lens, double scale,
                                                int64_t value_dim) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.stride(3) == 1, "paged_decode: a [blocks, B, H, D] cache view expected");
  const at::Tensor& vc = value_cache.has_value() ? *value_cache : key_cache;
  TORCH_CHECK(vc.dim() == 4 && vc.stride(3) == 1 && vc.scalar_type() == key_cache.scalar_type(),
              "paged_decode: the value cache must match the key cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "paged_decode: int64 tables");
  const at::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), lc = lens.contiguous();
  const int64_t seqs = q.size(0), heads = q.size(1), dk = q.size(2);
  const int64_t block = key_cache.size(1), kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == dk && heads % kv_heads == 0, "paged_decode: q and cache head sizes disagree");
  TORCH_CHECK(value_dim <= vc.size(3), "paged_decode: value_dim exceeds the value cache");
  at::Tensor out = at::empty({seqs, heads, value_dim}, q.options());
  at::Tensor lse = at::empty({seqs, heads}, q.options().dtype(at::kFloat));
  on_dtype(q, "paged_decode", [&](auto q_tag) {
    using Q = decltype(q_tag);
    on_dtype(key_cache, "paged_decode", [&](auto cache_tag) {
      using C = decltype(cache_tag);
      const DecodeShape shape{seqs, heads, kv_heads, block, dk, value_dim, tables.size(1),
                              key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                              vc.stride(0), vc.stride(1), vc.stride(2), static_cast<float>(scale)};
      auto run = [&](auto kernel) {
        kernel(qc.data_ptr<Q>(), key_cache.data_ptr<C>(), vc.data_ptr<C>(), tables.data_ptr<int64_t>(),
               lc.data_ptr<int64_t>(), out.data_ptr<Q>(), lse.data_ptr<float>(), shape);
      };
      if (dk == 64 && value_dim == 64) {
        run(decode_heads<Q, C, 64, 64>);
      } else if (dk == 128 && value_dim == 128) {
        run(decode_heads<Q, C, 128, 128>);
      } else {
        run(decode_heads<Q, C, 0, 0>);
      }
    });
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(dcpctl, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor");
  m.def("store_kv(Tensor new_kv, Tensor(a!) cache, Tensor slots) -> ()");
  m.def(
      "paged_decode(Tensor q, Tensor key_cache, Tensor? value_cache, Tensor block_tables, Tensor lens, float scale, "
      "int value_dim) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dcpctl, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("store_kv", &store_kv);
  m.impl("paged_decode", &paged_decode);
}
