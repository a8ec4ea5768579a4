// CPU kernels for decode-sized work, registered as torch ops under `dcpctl::`.
//
// At batch 1 a decode step on CPU is bound by reading the weights and, once that is fast, by the
// fixed cost of many small torch ops. These kernels do the per-token work of a step in one pass each
// (the matmuls are in cpu_gemm.cpp, built into the same library):
//   rms_norm      HF's RMSNorm (fp32 statistics, rounding as HF rounds), optionally after the residual add.
//   rotary        rotary embedding of a [tokens, heads, dim] view, in fp32 as torch computes it (same bits).
//   store_kv      new keys/values into the paged cache through the slot mapping.
//   (store_kv, rotary_store_kv and paged_decode also take fp8 caches, e4m3fn and e5m2: value / scale stored rounded to
//   nearest and saturated as torch's clamp-then-convert stores them, read back through a 256-entry table, exact; the
//   caller folds the scales into paged_decode's softmax scale and output.)
//   rotary_store_kv  rotary of a layer's query and key heads and the store of its keys and values, in one op.
//   paged_decode  one query per sequence against its paged keys/values: exact softmax in fp32,
//                 returning the log-sum-exp per head (the DCP merge needs it).
//   prefill_causal  causal attention of each prompt's new tokens to themselves and, optionally, to the prompt's
//                 cached context read from the paged cache in the same pass (GQA without repeated keys), exact
//                 softmax in fp32, with the log-sum-exp: one op per layer instead of a flash call per prompt
//                 (bf16 with AVX512-BF16: the products on the stored bits, on oneDNN's brgemm where the CPU has
//                 AMX, else as vdpbf16ps register tiles; `prefill_bf16_products`).
//   silu_and_mul  silu(gate) * up of [gate | up] rows in one pass, with torch's `F.silu(gate) * up` bits.
//   argmax_rows   torch.argmax over the last dim of fp32 rows (greedy sampling's logits), vectorized.
//   bind_threads  pin each OpenMP thread of the calling thread's team to one core (the team torch's and oneDNN's
//                 parallel regions run on when this thread calls them).
//   release_openmp_pool  let the calling thread's idle OpenMP workers exit (before another thread steps the engine).

// silu_and_mul computes SiLU with ATen's vector exp (Sleef's, exported by libtorch): ATen's vector headers must see
// the capability of the ATen kernels that torch runs on a CPU of this build's level (cpu_isa.py caps both alike).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/StringUtil.h>
#include <torch/library.h>

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

using Fp8E4m3 = c10::Float8_e4m3fn;
using Fp8E5m2 = c10::Float8_e5m2;

// Every value of an fp8 format as fp32 (c10's exact conversion), built when the library loads: a cache read is one
// table load per element (one gather per vector in the decode kernel's vector paths).
template <typename F>
std::array<float, 256> fp8_values() {
  std::array<float, 256> values;
  for (int i = 0; i < 256; ++i) values[i] = static_cast<float>(F(static_cast<uint8_t>(i), F::from_bits()));
  return values;
}
const std::array<float, 256> kE4m3Values = fp8_values<Fp8E4m3>();
const std::array<float, 256> kE5m2Values = fp8_values<Fp8E5m2>();
inline const float* fp8_table(const Fp8E4m3*) { return kE4m3Values.data(); }
inline const float* fp8_table(const Fp8E5m2*) { return kE5m2Values.data(); }

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return bf16_to_float(v.x); }
inline float to_float(Fp8E4m3 v) { return kE4m3Values[v.x]; }
inline float to_float(Fp8E5m2 v) { return kE5m2Values[v.x]; }

template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);
}

// c10's float -> bf16 rounding (to nearest even; NaN -> 0x7FC0) without its branch, so that loops vectorize
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return c10::BFloat16(v != v ? uint16_t(0x7FC0) : rounded, c10::BFloat16::from_bits());
}

// fp8: saturated at the format's largest finite value (NaN stays NaN), then c10's rounding to nearest even: the
// bytes of the torch backend's `kv_quant.to_cache` (clamp, then convert).
template <typename F>
inline F saturated_fp8(float v) {
  const float largest = static_cast<float>(std::numeric_limits<F>::max());
  return F(v > largest ? largest : (v < -largest ? -largest : v));
}
template <>
inline Fp8E4m3 from_float<Fp8E4m3>(float v) {
  return saturated_fp8<Fp8E4m3>(v);
}
template <>
inline Fp8E5m2 from_float<Fp8E5m2>(float v) {
  return saturated_fp8<Fp8E5m2>(v);
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

// One row of rms_norm (restrict-qualified so that every loop vectorizes); h: d floats of scratch.
// on_dtype for a KV cache: float32, bfloat16, or fp8 (e4m3fn, e5m2).
template <typename F>
void on_cache_dtype(const at::Tensor& t, const char* op, F&& f) {
  if (t.scalar_type() == c10::ScalarType::Float8_e4m3fn) {
    f(Fp8E4m3{});
  } else if (t.scalar_type() == c10::ScalarType::Float8_e5m2) {
    f(Fp8E5m2{});
  } else {
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op,
                ": a float32, bfloat16 or fp8 (e4m3fn, e5m2) cache expected");
    on_dtype(t, op, f);
  }
}

template <typename T>
inline void rms_norm_row(const T* __restrict__ x, const T* __restrict__ residual, const T* __restrict__ weight,
                         T* __restrict__ out, T* __restrict__ sum_out, float* __restrict__ h, int64_t d, float eps) {
  if (residual) {  // the sum rounds to the model dtype first, as HF's `hidden + residual` does
    for (int64_t i = 0; i < d; ++i) sum_out[i] = from_float<T>(to_float(x[i]) + to_float(residual[i]));
    for (int64_t i = 0; i < d; ++i) h[i] = to_float(sum_out[i]);
  } else {
    for (int64_t i = 0; i < d; ++i) h[i] = to_float(x[i]);
  }
  float sq = 0.f;  // summed in vector lanes (HF's torch reduction has an order of its own: fp32 agrees to rounding)
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < d; ++i) sq += h[i] * h[i];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(d) + eps);
  // HF: weight * (h * rsqrt(var + eps)).to(dtype), the product rounded again
  for (int64_t i = 0; i < d; ++i) out[i] = from_float<T>(to_float(weight[i]) * to_float(from_float<T>(h[i] * inv)));
}

template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* sum_out, int64_t rows, int64_t d,
                   float eps) {
  at::parallel_for(0, rows, grain_for(d), [&](int64_t begin, int64_t end) {
    std::vector<float> h(d);
    for (int64_t r = begin; r < end; ++r) {
      rms_norm_row(x + r * d, residual ? residual + r * d : nullptr, weight, out + r * d,
                   sum_out ? sum_out + r * d : nullptr, h.data(), d, eps);
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

// One head's row of rotary: out = x * cos + partner(x) * sin over dim elements, cos / sin fp32 with the rotation's sign
// folded into sin, partner pairing dim i with i + dim/2 (neox) or each adjacent pair (interleaved).
template <typename T>
inline void rotary_row(const T* __restrict__ x, const float* __restrict__ c, const float* __restrict__ sn,
                       T* __restrict__ o, int64_t dim, bool interleaved) {
  if (interleaved) {
    for (int64_t i = 0; i < dim; i += 2) {
      const float even = to_float(x[i]), odd = to_float(x[i + 1]);
      o[i] = from_float<T>(even * c[i] + odd * sn[i]);
      o[i + 1] = from_float<T>(odd * c[i + 1] + even * sn[i + 1]);
    }
  } else {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; ++i) {
      const float lo = to_float(x[i]), hi = to_float(x[i + half]);
      o[i] = from_float<T>(lo * c[i] + hi * sn[i]);
      o[i + half] = from_float<T>(hi * c[i + half] + lo * sn[i + half]);
    }
  }
}

void check_rotary_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t tokens, int64_t dim, const char* op) {
  TORCH_CHECK(dim % 2 == 0 && cos.numel() == tokens * dim && sin.numel() == tokens * dim, op, ": cos/sin [T, 1, D] expected");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, op, ": fp32 cos/sin expected");
}

// x [T, H, D] (any strides but the last), cos / sin [T, 1, D]: the rotated heads [T, H, D] (rotary_row).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x [tokens, heads, dim] with a contiguous last dim expected");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  check_rotary_tables(cos, sin, tokens, dim, "rotary");
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
        rotary_row(src + t * x.stride(0) + h * x.stride(1), cp + t * dim, sp + t * dim, dst + row * dim, dim,
                   interleaved);
      }
    });
  });
  return out;
}

// One head's row into the cache, converted to the cache's dtype through fp32; an fp8 cache stores value / scale (a
// float cache's scale is 1: exact), the bytes of `kv_quant.to_cache`. A cache of the row's own dtype at scale 1 is
// a copy of the same bits (no division per element).
template <typename In, typename C>
inline void store_row(const In* __restrict__ from, C* __restrict__ to, int64_t dim, float scale) {
  if constexpr (std::is_same_v<In, C>) {
    if (scale == 1.f) {
      std::memcpy(to, from, dim * sizeof(C));
      return;
    }
  }
  for (int64_t i = 0; i < dim; ++i) to[i] = from_float<C>(to_float(from[i]) / scale);
}

void check_scale(double scale, const char* op) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0, op, ": a KV cache scale must be positive and finite");
}

void check_cache_view(const at::Tensor& cache, const at::Tensor& slots, int64_t tokens, const char* op) {
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1, op, ": a [blocks, B, H, D] cache view expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == tokens && slots.is_contiguous(), op,
              ": int64 slots [tokens] expected");
}

// A layer's cache view [blocks, block_size, heads, dim] in any layout whose last dim is contiguous (the
// torch backend's storage is head-major behind it); new_kv [tokens, heads, dim].
void store_kv(const at::Tensor& new_kv, at::Tensor& cache, const at::Tensor& slots, double scale) {
  const int64_t tokens = new_kv.size(0);
  check_scale(scale, "store_kv");
  check_cache_view(cache, slots, tokens, "store_kv");
  const int64_t block = cache.size(1), heads = cache.size(2), dim = cache.size(3);
  TORCH_CHECK(new_kv.dim() == 3 && new_kv.size(1) == heads && new_kv.size(2) == dim, "store_kv: new_kv [tokens, heads, D] expected");
  TORCH_CHECK(new_kv.stride(2) == 1, "store_kv: new_kv's last dim must be contiguous");
  const int64_t* slot = slots.data_ptr<int64_t>();
  on_dtype(new_kv, "store_kv", [&](auto in_tag) {
    using In = decltype(in_tag);
    on_cache_dtype(cache, "store_kv", [&](auto cache_tag) {
      using C = decltype(cache_tag);
      const In* src = new_kv.data_ptr<In>();
      C* dst = cache.data_ptr<C>();
      for (int64_t t = 0; t < tokens; ++t) {
        if (slot[t] < 0) continue;  // another DCP rank stores this token
        const int64_t b = slot[t] / block, off = slot[t] % block;
        for (int64_t h = 0; h < heads; ++h) {
          store_row(src + t * new_kv.stride(0) + h * new_kv.stride(1),
                    dst + b * cache.stride(0) + off * cache.stride(1) + h * cache.stride(2), dim, float(scale));
        }
      }
    });
  });
}

// qkv [T, Hq + 2 Hkv, D] (one projection's query, key and value heads, any strides but the last) -> the rotated
// query heads [T, Hq, D] and key heads [T, Hkv, D], as `rotary` computes them; the rotated keys and the values go into the cache
// views [blocks, B, Hkv, D] at `slots` as `store_kv` writes them (-1: another DCP rank's token, skipped). One op per
// layer instead of three, each token's rows rotated and stored while they are in L1.
std::tuple<at::Tensor, at::Tensor> rotary_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                           at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slots, double k_scale,
                           double v_scale) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1,
              "rotary_store_kv: qkv [tokens, q heads + 2 kv heads, dim] with a contiguous last dim expected");
  const int64_t tokens = qkv.size(0), dim = qkv.size(2);
  check_cache_view(key_cache, slots, tokens, "rotary_store_kv");
  check_cache_view(value_cache, slots, tokens, "rotary_store_kv");
  const int64_t kv_heads = key_cache.size(2), rotated = qkv.size(1) - kv_heads, q_heads = rotated - kv_heads;
  TORCH_CHECK(key_cache.size(3) == dim && value_cache.size(2) == kv_heads && value_cache.size(3) == dim &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "rotary_store_kv: key and value caches [blocks, B, Hkv, D] of one dtype expected");
  TORCH_CHECK(q_heads >= 0, "rotary_store_kv: qkv has fewer heads than twice the cache's");
  check_rotary_tables(cos, sin, tokens, dim, "rotary_store_kv");
  check_scale(k_scale, "rotary_store_kv");
  check_scale(v_scale, "rotary_store_kv");
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor q_out = at::empty({tokens, q_heads, dim}, qkv.options());
  at::Tensor k_out = at::empty({tokens, kv_heads, dim}, qkv.options());
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t block = key_cache.size(1);
  on_dtype(qkv, "rotary_store_kv", [&](auto in_tag) {
    using In = decltype(in_tag);
    on_cache_dtype(key_cache, "rotary_store_kv", [&](auto cache_tag) {
      using C = decltype(cache_tag);
      const In* src = qkv.data_ptr<In>();
      In* const outs[2] = {q_out.data_ptr<In>(), k_out.data_ptr<In>()};
      C* const caches[2] = {key_cache.data_ptr<C>(), value_cache.data_ptr<C>()};
      const at::Tensor* views[2] = {&key_cache, &value_cache};
      const float* cp = cc.data_ptr<float>();
      const float* sp = sc.data_ptr<float>();
      auto dest = [&](int kind, int64_t t, int64_t h) {
        const at::Tensor& v = *views[kind];
        return caches[kind] + slot[t] / block * v.stride(0) + slot[t] % block * v.stride(1) + h * v.stride(2);
      };
      at::parallel_for(0, tokens, grain_for((rotated + kv_heads) * dim), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const In* x = src + t * qkv.stride(0);
          In* const q = outs[0] + t * q_heads * dim;
          In* const k = outs[1] + t * kv_heads * dim;
          for (int64_t h = 0; h < rotated; ++h) {
            In* o = h < q_heads ? q + h * dim : k + (h - q_heads) * dim;
            rotary_row(x + h * qkv.stride(1), cp + t * dim, sp + t * dim, o, dim, interleaved);
          }
          if (slot[t] < 0) continue;  // another DCP rank stores this token
          for (int64_t h = 0; h < kv_heads; ++h) {
            store_row(k + h * dim, dest(0, t, h), dim, float(k_scale));
            store_row(x + (rotated + h) * qkv.stride(1), dest(1, t, h), dim, float(v_scale));
          }
        }
      });
    });
  });
  return {q_out, k_out};
}

// x [rows, 2n] = [gate | up] (rows any stride, the last dim contiguous) -> silu(gate) * up [rows, n], with the bits of
// torch's `F.silu(gate) * up`: SiLU as ATen's kernel computes it (x / (1 + exp(-x)) in fp32 with ATen's vector exp,
// over runs of two vectors of the dtype, the rest of a row with std::exp), rounded to the dtype, then the product
// rounded once. One pass and one output instead of two ops and a temporary. buf: n floats of scratch.
template <typename T>
void silu_mul_row(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out, float* __restrict__ buf,
                  int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t vector_end = n - n % (2 * at::vec::Vectorized<T>::size());
  for (int64_t i = 0; i < n; ++i) buf[i] = to_float(gate[i]);
  for (int64_t i = 0; i < vector_end; i += Vec::size()) {
    const Vec g = Vec::loadu(buf + i);
    (g / (Vec(1.f) + g.neg().exp())).store(buf + i);
  }
  for (int64_t i = vector_end; i < n; ++i) buf[i] = buf[i] / (1.f + std::exp(-buf[i]));
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(to_float(from_float<T>(buf[i])) * to_float(up[i]));
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1,
              "silu_and_mul: x [rows, 2n] with a contiguous last dim expected");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, x.options());
  on_dtype(x, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* src = x.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, rows, grain_for(2 * n), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(n);
      for (int64_t r = begin; r < end; ++r) {
        silu_mul_row(src + r * stride, src + r * stride + n, dst + r * n, buf.data(), n);
      }
    });
  });
  return out;
}

// The exps' range reduction x = n ln2 + r: log2(e), and ln2 split so that n * kLn2Hi is exact.
constexpr float kLog2e = 1.44269504f, kLn2Hi = 0.693145752f, kLn2Lo = 1.42860677e-6f;

// exp(x) for x <= 0 in a form the compiler vectorizes (std::exp does not, here): x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (relative error < 2e-7), 2^n into the exponent.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this e^x underflows fp32's normal range; the sums cannot tell
  // round to nearest even as nearbyint does, in a form that vectorizes: adding 1.5 * 2^23 drops the fraction bits
  const float n = (x * kLog2e + 12582912.f) - 12582912.f;
  const float r = x - n * kLn2Hi - n * kLn2Lo;
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

// Sixteen fp32 lanes as one GCC vector: one AVX-512 register, two AVX2 ones, four SSE/NEON ones (the compiler splits).
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
constexpr int64_t kVec = 16;

// The lanes of two vectors of one type picked by constant indices (0 .. 2 x lanes - 1): __builtin_shufflevector
// where the compiler has it (clang, GCC 12+), else GCC's __builtin_shuffle (GCC 11, Ubuntu 22.04's, and older),
// which takes the indices as a vector of `Index`, integers of the lanes' size; both compile to the same shuffles.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define DCPCTL_SHUFFLEVECTOR
#endif
#endif
#if defined(DCPCTL_SHUFFLEVECTOR)
#define SHUFFLE(Index, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(Index, a, b, ...) __builtin_shuffle(a, b, Index{__VA_ARGS__})
#endif
// The vector path of paged_decode is measured on AVX-512 only (where 16 lanes are one register); AVX2 and portable
// builds keep the scalar loops, as before it.
#if defined(__AVX512F__)
constexpr bool kVectorDecode = true;
#else
constexpr bool kVectorDecode = false;
#endif
// bf16 queries against a bf16 cache on an AVX512-BF16 build: the key dot products as vdpbf16ps on the cache's own
// bits (exact products, fp32 sums), so a key row is neither widened nor re-read per query head.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kBf16DotDecode = true;
#else
constexpr bool kBf16DotDecode = false;
#endif
// AVX2 (x86-64-v3) builds have a path of their own, shaped for 16 registers of 8 lanes (see decode_heads).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
constexpr bool kVectorDecode8 = true;
#else
constexpr bool kVectorDecode8 = false;
#endif

inline v16 vload16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v16 vload16(const c10::BFloat16* p) {  // bf16 -> fp32: the bits into the upper half
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  const v16u bits = __builtin_convertvector(h, v16u) << 16;
  v16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// fp8 -> fp32 through the format's table: one gather of the 16 bytes' values
template <typename F>
inline v16 vload16_fp8(const F* p) {
  const float* table = fp8_table(p);
#if defined(__AVX512F__)
  const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return v16(_mm512_i32gather_ps(index, table, 4));
#else
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(p);
  v16 v;
  for (int64_t i = 0; i < kVec; ++i) v[i] = table[bytes[i]];
  return v;
#endif
}
inline v16 vload16(const Fp8E4m3* p) { return vload16_fp8(p); }
inline v16 vload16(const Fp8E5m2* p) { return vload16_fp8(p); }

inline v16 vsplat16(float s) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(s);  // one broadcast (v16{} + s is an add, then the broadcast)
#else
  return v16{} + s;
#endif
}

// a * b + c with one rounding (the scalar path's std::fma); only AVX-512 builds take the vector path
inline v16 vfma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#else
  v16 r;
  for (int64_t i = 0; i < kVec; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// The lane sums of 16 vectors as one vector: sums[t] = the sum of v[t]'s lanes. A tree of two-source shuffles and
// adds, halving the vectors and doubling the lanes each sum is spread over at each level: 15 adds for 16 sums
// where one horizontal sum per vector would take ~7 dependent operations each.
inline v16 lane_sums16(const v16* v) {
  v16 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)  // c[i]: lanes 0-7 sum to v[2i]'s total, lanes 8-15 to v[2i + 1]'s
    c[i] = SHUFFLE(v16i, v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(v16i, v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // d[i]: four groups of 4 lanes, for v[4i] .. v[4i + 3]
    d[i] = SHUFFLE(v16i, c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUFFLE(v16i, c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // e[i]: eight pairs of lanes, for v[8i] .. v[8i + 7]
    e[i] = SHUFFLE(v16i, d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUFFLE(v16i, d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return SHUFFLE(v16i, e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE(v16i, e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Eight fp32 lanes: one AVX2 register. The AVX2 decode path (kVectorDecode8) and, in every build, argmax_row.
typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int64_t kVec8 = 8;

inline v8 vload8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline bool any_lane(v8i m) {
#if defined(__AVX2__)
  __m256i bits;
  std::memcpy(&bits, &m, sizeof(m));
  return !_mm256_testz_si256(bits, bits);
#else
  int32_t any = 0;
  for (int64_t l = 0; l < kVec8; ++l) any |= m[l];
  return any != 0;
#endif
}

// The index of one row's largest value as torch.argmax gives it: the first of equal maxima, or the first NaN if the
// row has one. 8 lanes at a time (one AVX2 register): the max and a NaN flag in one pass, then the first match.
inline int64_t argmax_row(const float* row, int64_t n) {
  const int64_t body = n - n % kVec8;
  v8 top = v8{} + row[0];
  v8i nan = v8i{};
  for (int64_t i = 0; i < body; i += kVec8) {
    const v8 x = vload8(row + i);
    top = x > top ? x : top;
    nan |= x != x;
  }
  float best = row[0];
  bool has_nan = any_lane(nan);
  for (int64_t l = 0; l < kVec8; ++l) best = top[l] > best ? top[l] : best;
  for (int64_t i = body; i < n; ++i) {
    best = row[i] > best ? row[i] : best;
    has_nan |= row[i] != row[i];
  }
  const v8 want = v8{} + best;
  int64_t i = 0;
  for (; i < body; i += kVec8) {
    const v8 x = vload8(row + i);
    if (any_lane(has_nan ? x != x : x == want)) break;
  }
  while (has_nan ? row[i] == row[i] : row[i] != best) ++i;
  return i;
}

inline v8 vload8(const c10::BFloat16* p) {  // bf16 -> fp32: the bits into the upper half
#if defined(__AVX2__)  // one vpmovzxwd of all 8 lanes (GCC's convertvector widened each 128-bit half apart)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return v8(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
#else
  v8h h;
  std::memcpy(&h, p, sizeof(h));
  const v8u bits = __builtin_convertvector(h, v8u) << 16;
  v8 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}

template <typename F>
inline v8 vload8_fp8(const F* p) {  // fp8 -> fp32 through the format's table
  const float* table = fp8_table(p);
#if defined(__AVX2__)
  const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return v8(_mm256_i32gather_ps(table, index, 4));
#else
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(p);
  v8 v;
  for (int64_t i = 0; i < kVec8; ++i) v[i] = table[bytes[i]];
  return v;
#endif
}
inline v8 vload8(const Fp8E4m3* p) { return vload8_fp8(p); }
inline v8 vload8(const Fp8E5m2* p) { return vload8_fp8(p); }

inline v8 vfma8(v8 a, v8 b, v8 c) {  // a * b + c with one rounding
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  v8 r;
  for (int64_t i = 0; i < kVec8; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// lane_sums16's tree for 8 vectors of 8 lanes: sums[t] = the sum of v[t]'s lanes, in 7 adds. The first level pairs
// v[i] with v[i + 4] (128-bit halves, the only lane-crossing shuffles), the next two stay within 128-bit lanes
// (vshufps), which leaves the sums in order.
inline v8 lane_sums8(const v8* v) {
  v8 c[4], d[2];
  for (int i = 0; i < 4; ++i)  // c[i]: lanes 0-3 sum to v[i]'s total, lanes 4-7 to v[i + 4]'s
    c[i] = SHUFFLE(v8i, v[i], v[i + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(v8i, v[i], v[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // d[i]: pairs of lanes for v[2i], v[2i + 1], v[2i + 4], v[2i + 5]
    d[i] = SHUFFLE(v8i, c[2 * i], c[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           SHUFFLE(v8i, c[2 * i], c[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return SHUFFLE(v8i, d[0], d[1], 0, 2, 8, 10, 4, 6, 12, 14) +
         SHUFFLE(v8i, d[0], d[1], 1, 3, 9, 11, 5, 7, 13, 15);
}

// The AVX2 path's value sums of one block of tokens for `Heads` query heads at once, over all dims in slices of
// `Slice` registers per head (Heads x Slice <= 8 accumulators: the rest of the 16 registers hold the value slice and
// the heads' weights). acc[h] is the head's running sum (dv floats) and p[h] its scores row, from the block's first
// token; the block's value rows stay in L1 over the slices.
template <int64_t Heads, int64_t Slice, int64_t Nv, typename C>
inline void accumulate_values(const C* v, int64_t rows, int64_t stride, const float* const* p, float* const* acc) {
  static_assert(Nv % Slice == 0, "a head's vectors split into whole slices");
  for (int64_t s = 0; s < Nv; s += Slice) {
    v8 sums[Heads][Slice];
#pragma GCC unroll 8
    for (int64_t h = 0; h < Heads; ++h)
#pragma GCC unroll 8
      for (int64_t i = 0; i < Slice; ++i) sums[h][i] = vload8(acc[h] + (s + i) * kVec8);
    const C* row = v + s * kVec8;
    for (int64_t j = 0; j < rows; ++j, row += stride) {
      v8 vr[Slice];
#pragma GCC unroll 8
      for (int64_t i = 0; i < Slice; ++i) vr[i] = vload8(row + i * kVec8);
#pragma GCC unroll 8
      for (int64_t h = 0; h < Heads; ++h) {
        const float weight = p[h][j];
        const v8 w = {weight, weight, weight, weight, weight, weight, weight, weight};
#pragma GCC unroll 8
        for (int64_t i = 0; i < Slice; ++i) sums[h][i] = vfma8(w, vr[i], sums[h][i]);
      }
    }
#pragma GCC unroll 8
    for (int64_t h = 0; h < Heads; ++h)
#pragma GCC unroll 8
      for (int64_t i = 0; i < Slice; ++i) std::memcpy(acc[h] + (s + i) * kVec8, &sums[h][i], sizeof(v8));
  }
}

// exp_nonpositive on 8 lanes, the same operations in the same order (so the same bits): GCC leaves the scalar
// loop of it unvectorized in the AVX2 build (std::max became a branch), a third of the kernel's time.
inline v8 exp_nonpositive8(v8 x) {
  const v8 floor = {-87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f};
  x = x < floor ? floor : x;
  const v8 n = (x * kLog2e + 12582912.f) - 12582912.f;
  const v8 r = x - n * kLn2Hi - n * kLn2Lo;
  v8 p = v8{} + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  v8i bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += __builtin_convertvector(n, v8i) << 23;
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

// Ask for `rows` cache rows of `bytes` each, `stride` elements apart, into L1 (Locality 3; 2: into L2): a block's rows
// for one KV head are one tile of the paged cache, a page of its own, where the hardware prefetchers (which stop at
// page boundaries) do not follow the block table.
template <int Locality = 3, typename C>
inline void prefetch_rows(const C* row, int64_t rows, int64_t stride, int64_t bytes) {
  for (int64_t r = 0; r < rows; ++r, row += stride)
    for (int64_t off = 0; off < bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(row) + off, 0, Locality);
}

// The vector decode path's key dot products of up to 16 keys (rows `stride` apart, the first `count` real) against H
// query heads at once: each key row is loaded once for all H heads, whose N query vectors each stay in registers over
// the 16 keys (q: the heads' vectors one after the other). dots[h][t] is head h's partial lanes for key t (zeros for
// t >= count), each dot summed in the order the path always used: two chains of FMAs over the row's vectors, then
// their sum; with Pairs (bf16 on an AVX512-BF16 build) one vdpbf16ps chain over the row's bf16 pairs.
template <int64_t H, int64_t N, bool Pairs, typename C>
inline void key_dots16(const v16* q, const C* k, int64_t stride, int64_t count, v16 (*dots)[kVec]) {
  v16 qr[H][N];
#pragma GCC unroll 16
  for (int64_t h = 0; h < H; ++h)
#pragma GCC unroll 16
    for (int64_t v = 0; v < N; ++v) qr[h][v] = q[h * N + v];
  for (int64_t t = 0; t < kVec; ++t, k += stride) {
    if (t >= count) {
      for (int64_t h = 0; h < H; ++h) dots[h][t] = v16{};
      continue;
    }
    if constexpr (Pairs) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      __m512bh kr[N];
#pragma GCC unroll 16
      for (int64_t v = 0; v < N; ++v) kr[v] = (__m512bh)_mm512_loadu_ps(k + v * 2 * kVec);
#pragma GCC unroll 16
      for (int64_t h = 0; h < H; ++h) {
        __m512 dot = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int64_t v = 0; v < N; ++v) dot = _mm512_dpbf16_ps(dot, (__m512bh)qr[h][v], kr[v]);
        dots[h][t] = v16(dot);
      }
#endif
    } else {
      v16 kr[N];
#pragma GCC unroll 16
      for (int64_t v = 0; v < N; ++v) kr[v] = vload16(k + v * kVec);
#pragma GCC unroll 16
      for (int64_t h = 0; h < H; ++h) {
        v16 even{}, odd{};  // two chains of FMAs
#pragma GCC unroll 16
        for (int64_t v = 0; v < N; ++v) (v % 2 ? odd : even) = vfma16(qr[h][v], kr[v], v % 2 ? odd : even);
        dots[h][t] = even + odd;
      }
    }
  }
}

// The vector decode path's value sums of H query heads over one chunk of tokens [from, to): per token one value row
// of N vectors in registers, times each head's weight (its scores row p[h], from the chunk's first token), into
// accumulators that stay in registers over the whole chunk; acc[h] receives head h's sums (dv floats). `rows(token)`
// is the value rows' start of the token's block; the next block's rows are prefetched as a block starts.
template <int64_t H, int64_t N, typename C, typename Rows>
inline void value_sums16(const float* const* p, Rows rows, int64_t from, int64_t to, int64_t block, int64_t stride,
                         int64_t row_bytes, float* const* acc) {
  v16 sums[H][N] = {};
  for (int64_t first = from; first < to; first += block) {
    const C* v = rows(first);
    const int64_t last = std::min(to, first + block);
    if (last < to) prefetch_rows(rows(last), block, stride, row_bytes);
    for (int64_t j = first; j < last; ++j, v += stride) {
      v16 vr[N];
#pragma GCC unroll 16
      for (int64_t i = 0; i < N; ++i) vr[i] = vload16(v + i * kVec);
#pragma GCC unroll 16
      for (int64_t h = 0; h < H; ++h) {
        const v16 w = vsplat16(p[h][j - from]);
#pragma GCC unroll 16
        for (int64_t i = 0; i < N; ++i) sums[h][i] = vfma16(w, vr[i], sums[h][i]);
      }
    }
  }
#pragma GCC unroll 16
  for (int64_t h = 0; h < H; ++h)
#pragma GCC unroll 16
    for (int64_t i = 0; i < N; ++i) std::memcpy(acc[h] + i * kVec, &sums[h][i], sizeof(v16));
}

// f(std::integral_constant<int64_t, n>{}) for a count n in 1 .. Max only known at run time: a kernel instantiated per
// head count (key_dots16, value_sums16) picked once per pass
template <int64_t Max, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (Max > 0) {
    if (n == Max) return f(std::integral_constant<int64_t, Max>{});
    with_count<Max - 1>(n, std::forward<F>(f));
  }
}

struct DecodeShape {
  int64_t seqs, heads, kv_heads, block, dk, dv, max_blocks;
  int64_t key_block_stride, key_token_stride, key_head_stride;  // of the [blocks, B, H, D] views
  int64_t value_block_stride, value_token_stride, value_head_stride;
  float scale;
};

// One work item's key and value rows (tokens [pos, to) of one KV head of one sequence), asked into L2 a few rows at a
// time by `advance` while the item before it computes: the item's L1 prefetches then find its rows in L2. With only
// the L1 prefetches a step's attention waited on memory (AVX-512 bf16 and the AVX2 build ran 1.15-1.5x slower without
// this on Zen 4; AVX-512 fp32 was level).
template <typename C>
struct ItemPrefetch {
  const C* keys = nullptr;  // the KV head's rows in block 0 of the cache
  const C* values = nullptr;
  const int64_t* table = nullptr;
  int64_t pos = 0, to = 0;

  void advance(int64_t rows, const DecodeShape& a, int64_t key_bytes, int64_t value_bytes) {
    while (rows > 0 && pos < to) {
      const int64_t o = pos % a.block, n = std::min({rows, a.block - o, to - pos}), b = table[pos / a.block];
      prefetch_rows<2>(keys + b * a.key_block_stride + o * a.key_token_stride, n, a.key_token_stride, key_bytes);
      prefetch_rows<2>(values + b * a.value_block_stride + o * a.value_token_stride, n, a.value_token_stride,
                       value_bytes);
      pos += n;
      rows -= n;
    }
  }
};

constexpr int64_t kMinChunkTokens = 64;  // below this a context is not worth splitting over threads

// Work items are (sequence, KV head, chunk of whole blocks): each key and value row is read and widened
// once for all the query heads that share it (GQA groups, MLA's single latent head), and at small batch
// long contexts split into chunks so that every thread has work. An item leaves, per query head, its
// chunk's max score, sum of exp(score - max) and exp-weighted value sum; a second pass merges the
// chunks of each head exactly (the same algebra as the DCP merge).
// On AVX-512, compile-time head sizes that are whole vectors (64, 128) take the vector path: each key row loaded once
// against the query vectors of up to 16 registers' worth of heads (key_dots16; bf16 against a bf16 cache with
// AVX512-BF16: vdpbf16ps on the stored bits), the value sums of up to 16 vectors of heads in registers over the whole
// chunk (value_sums16), and the next block's keys and this block's values prefetched 16 rows at a time as the keys go
// by (a batch-16 decode step read its KV at a third of the memory bandwidth without prefetching, and at 0.6-0.75x of
// this with each whole block asked for at its start), the next item's rows into L2 at the same pace (ItemPrefetch).
// On AVX2 (16 registers of 8 lanes) the same sizes take a path of their own: 8 keys at a time against each query head
// (the query from L1, the 8 dot products in registers, lane_sums8), then block by block the value sums of up to 4
// heads over slices of their dims (accumulate_values: at most 8 accumulators in registers), the next block prefetched
// and the next item's rows into L2 as on AVX-512.
template <typename Q, typename C, int64_t FixedDk, int64_t FixedDv>
void decode_heads(const Q* q, const C* keys, const C* values, const int64_t* tables, const int64_t* lens, Q* out,
                  float* lse, const DecodeShape& a) {
  constexpr bool kVector = kVectorDecode && FixedDk > 0 && FixedDk % kVec == 0 && FixedDv > 0 && FixedDv % kVec == 0;
  constexpr int64_t kNk = FixedDk / kVec, kNv = FixedDv / kVec;
  constexpr bool kVector8 = kVectorDecode8 && FixedDk > 0 && FixedDk % 64 == 0 && FixedDv > 0 && FixedDv % 64 == 0;
  constexpr int64_t kNk8 = FixedDk / kVec8, kNv8 = FixedDv / kVec8;
  // key dots on bf16 pairs: 32 dims per register, the query's bits as they are (the scale applied to the sums)
  constexpr bool kBf16Keys = kVector && kBf16DotDecode && FixedDk % (2 * kVec) == 0 &&
                             std::is_same_v<Q, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
  constexpr int64_t kNk2 = FixedDk / (2 * kVec);
  // the vector path's heads per pass: their query vectors (keys) or value sums (values) in 16 of the 32 registers
  constexpr int64_t kKeyVectors = kBf16Keys ? kNk2 : kNk;
  constexpr int64_t kKeyHeads = kVector ? std::max<int64_t>(1, 16 / std::max<int64_t>(1, kKeyVectors)) : 1;
  constexpr int64_t kValueHeads = kVector ? std::max<int64_t>(1, 16 / std::max<int64_t>(1, kNv)) : 1;
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
    // scores: a row per head, padded by a vector (the vector path stores 16 at a time)
    const int64_t score_stride = chunk + kVec;
    // row: one widened key or value row, or (AVX2 path, bf16) a group of 8 widened keys
    std::vector<float> qf(group * dk), row(std::max(dk, dv) * (kVector8 ? kVec8 : 1));
    std::vector<float> scores(group * score_stride, 0.f), top(group);
    std::vector<v16> qv(kVector ? group * kNk : 0);  // kBf16Keys: the query heads' bf16 pairs (kNk2 each)
    // the vector path: each head's running max as 16 lanes, and one pass's dot products (key_dots16)
    std::vector<v16> top_lanes(kVector ? group : 0);
    v16 dots[kKeyHeads][kVec];
    const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / (a.kv_heads * chunks), g = item / chunks % a.kv_heads, c = item % chunks;
      const int64_t from = c * chunk, to = std::min(lens[s], from + chunk), n = to - from;
      if (n <= 0) continue;  // past this sequence's end (or none of it on this rank)
      const int64_t first_head = s * a.heads + g * group;
      const int64_t* table = tables + s * a.max_blocks;
      auto key_rows = [&](int64_t token) { return keys + table[token / a.block] * a.key_block_stride + g * a.key_head_stride; };
      auto value_rows = [&](int64_t token) {
        return values + table[token / a.block] * a.value_block_stride + g * a.value_head_stride;
      };
      const C* next_item_keys = nullptr;  // the vector paths' prefetch target after this item's last key block
      ItemPrefetch<C> ahead;  // the vector path's: the next item's rows, into L2 as this item's keys go by
      if constexpr (kVector || kVector8) {
        const int64_t after = item + 1, s2 = after / (a.kv_heads * chunks), g2 = after / chunks % a.kv_heads;
        const int64_t from2 = after % chunks * chunk;
        if (after < end && from2 < lens[s2]) {
          ahead = {keys + g2 * a.key_head_stride, values + g2 * a.value_head_stride, tables + s2 * a.max_blocks,
                   from2, std::min(lens[s2], from2 + chunk)};
          next_item_keys = ahead.keys + ahead.table[from2 / a.block] * a.key_block_stride;
        }
      }
      if constexpr (!kBf16Keys)
        for (int64_t i = 0; i < group * dk; ++i) qf[i] = to_float(q[first_head * dk + i]) * a.scale;
      float* __restrict__ widened = row.data();  // restrict: the stores below never alias the loads
      std::fill(top.begin(), top.end(), neg_inf);
      std::fill(top_lanes.begin(), top_lanes.end(), vsplat16(neg_inf));
      if constexpr (kBf16Keys) {
        for (int64_t i = 0; i < group * kNk2; ++i) std::memcpy(&qv[i], q + first_head * dk + i * 2 * kVec, sizeof(v16));
      } else if constexpr (kVector) {
        for (int64_t i = 0; i < group * kNk; ++i) qv[i] = vload16(qf.data() + i * kVec);
      }
      for (int64_t first = from; first < to; first += a.block) {  // one block of keys at a time, in place
        const C* k = key_rows(first);
        const int64_t last = std::min(to, first + a.block);
        if constexpr (kVector) {  // 16 keys at a time against each head: their dot products as one vector
          // with each 16 keys, 16 rows of the next block's keys (after the chunk's last block: the next item's first)
          // and this block's values asked for: spread over the block (a whole block asked for at its start queued
          // behind the core's few line-fill buffers and stalled the loads of the keys in hand)
          const C* next_keys = last < to ? key_rows(last) : next_item_keys;
          const C* block_values = value_rows(first);
          for (int64_t j0 = first; j0 < last; j0 += kVec, k += kVec * a.key_token_stride) {
            const int64_t count = std::min(kVec, last - j0), o = j0 - first;
            if (next_keys)
              prefetch_rows(next_keys + o * a.key_token_stride, std::min(kVec, a.block - o), a.key_token_stride,
                            dk * int64_t(sizeof(C)));
            prefetch_rows(block_values + o * a.value_token_stride, count, a.value_token_stride, dv * int64_t(sizeof(C)));
            ahead.advance(kVec, a, dk * int64_t(sizeof(C)), dv * int64_t(sizeof(C)));
            for (int64_t h0 = 0; h0 < group; h0 += kKeyHeads) {
              const int64_t heads = std::min(kKeyHeads, group - h0);
              with_count<kKeyHeads>(heads, [&](auto h) {
                key_dots16<decltype(h)::value, kKeyVectors, kBf16Keys>(qv.data() + h0 * kKeyVectors, k,
                                                                       a.key_token_stride, count, dots);
              });
              for (int64_t h = h0; h < h0 + heads; ++h) {
                const v16 sums = kBf16Keys ? lane_sums16(dots[h - h0]) * a.scale : lane_sums16(dots[h - h0]);
                std::memcpy(scores.data() + h * score_stride + j0 - from, &sums, sizeof(sums));  // rows padded
                const v16 live = count == kVec ? sums : (lane < float(count) ? sums : vsplat16(neg_inf));
                top_lanes[h] = top_lanes[h] < live ? live : top_lanes[h];
              }
            }
          }
        } else if constexpr (kVector8) {  // 8 keys at a time against each head: their dot products as one vector
          // with each group of 8 keys, 8 rows of the next block's keys (after the chunk's last block: the next
          // item's first) and this block's values asked for: spread over the block, not all at its start
          const C* next_keys = last < to ? key_rows(last) : next_item_keys;
          const C* block_values = value_rows(first);
          for (int64_t j0 = first; j0 < last; j0 += kVec8, k += kVec8 * a.key_token_stride) {
            const int64_t count = std::min(kVec8, last - j0), o = j0 - first;
            if (next_keys)
              prefetch_rows(next_keys + o * a.key_token_stride, std::min(kVec8, a.block - o), a.key_token_stride,
                            dk * int64_t(sizeof(C)));
            prefetch_rows(block_values + o * a.value_token_stride, count, a.value_token_stride,
                          dv * int64_t(sizeof(C)));
            ahead.advance(kVec8, a, dk * int64_t(sizeof(C)), dv * int64_t(sizeof(C)));
            // bf16 keys: the 8 rows widened once into L1 for all the heads, not once per head
            constexpr bool kWiden = !std::is_same_v<C, float>;
            if constexpr (kWiden)
              for (int64_t t = 0; t < count; ++t)
                for (int64_t v = 0; v < kNk8; ++v) {
                  const v8 x = vload8(k + t * a.key_token_stride + v * kVec8);
                  std::memcpy(widened + (t * kNk8 + v) * kVec8, &x, sizeof(x));
                }
            for (int64_t h = 0; h < group; ++h) {
              const float* qh = qf.data() + h * dk;  // from L1: registers go to the 8 dot products
              v8 dots[kVec8];
              for (int64_t t = 0; t < kVec8; ++t) {
                const auto* kt = [&] {
                  if constexpr (kWiden) return static_cast<const float*>(widened + t * dk);
                  else return k + t * a.key_token_stride;
                }();
                v8 even{}, odd{};  // two chains of FMAs
                if (t < count)
                  for (int64_t v = 0; v < kNk8; ++v)
                    (v % 2 ? odd : even) = vfma8(vload8(qh + v * kVec8), vload8(kt + v * kVec8), v % 2 ? odd : even);
                dots[t] = even + odd;
              }
              const v8 sums = lane_sums8(dots);
              std::memcpy(scores.data() + h * score_stride + j0 - from, &sums, sizeof(sums));  // rows padded
              for (int64_t t = 0; t < count; ++t) top[h] = std::max(top[h], sums[t]);
            }
          }
        } else {
          for (int64_t j = first; j < last; ++j, k += a.key_token_stride) {
            for (int64_t i = 0; i < dk; ++i) widened[i] = to_float(k[i]);
            for (int64_t h = 0; h < group; ++h) {
              const float* __restrict__ qh = qf.data() + h * dk;
              float dotv = 0.f;
#pragma omp simd reduction(+ : dotv)
              for (int64_t i = 0; i < dk; ++i) dotv = std::fma(qh[i], widened[i], dotv);
              scores[h * score_stride + j - from] = dotv;
              top[h] = std::max(top[h], dotv);
            }
          }
        }
      }
      if constexpr (kVector)
        for (int64_t h = 0; h < group; ++h)
          for (int64_t t = 0; t < kVec; ++t) top[h] = std::max(top[h], top_lanes[h][t]);
      for (int64_t h = 0; h < group; ++h) {
        float* sh = scores.data() + h * score_stride;
        const float m = top[h];
        part_max[(first_head + h) * chunks + c] = m;
        float sum = 0.f;
        if constexpr (kVector8) {  // whole vectors, then the rest one by one
          v8 sums{};
          int64_t j = 0;
          for (; j + kVec8 <= n; j += kVec8) {
            const v8 e = exp_nonpositive8(vload8(sh + j) - m);
            std::memcpy(sh + j, &e, sizeof(e));
            sums += e;
          }
          for (; j < n; ++j) {
            sh[j] = exp_nonpositive(sh[j] - m);
            sum += sh[j];
          }
          for (int64_t i = 0; i < kVec8; ++i) sum += sums[i];
        } else {
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < n; ++j) {
            sh[j] = exp_nonpositive(sh[j] - m);
            sum += sh[j];
          }
        }
        part_sum[(first_head + h) * chunks + c] = sum;
      }
      if constexpr (kVector) {
        for (int64_t h0 = 0; h0 < group; h0 += kValueHeads) {
          const int64_t heads = std::min(kValueHeads, group - h0);
          const float* p[kValueHeads];
          float* acc[kValueHeads];
          for (int64_t h = 0; h < heads; ++h) {
            p[h] = scores.data() + (h0 + h) * score_stride;
            acc[h] = part_acc.data() + ((first_head + h0 + h) * chunks + c) * dv;
          }
          with_count<kValueHeads>(heads, [&](auto h) {
            value_sums16<decltype(h)::value, kNv, C>(p, value_rows, from, to, a.block, a.value_token_stride,
                                                     dv * int64_t(sizeof(C)), acc);
          });
        }
      } else if constexpr (kVector8) {
        for (int64_t first = from; first < to; first += a.block) {
          const int64_t last = std::min(to, first + a.block);
          if (last < to) prefetch_rows(value_rows(last), a.block, a.value_token_stride, dv * int64_t(sizeof(C)));
          for (int64_t h0 = 0; h0 < group; h0 += 4) {  // up to 4 heads per pass over the block's rows
            const float* p[4];
            float* acc[4];
            const int64_t heads = std::min<int64_t>(4, group - h0);
            for (int64_t h = 0; h < heads; ++h) {
              p[h] = scores.data() + (h0 + h) * score_stride + first - from;
              acc[h] = part_acc.data() + ((first_head + h0 + h) * chunks + c) * dv;
            }
            const C* v = value_rows(first);
            const int64_t rows = last - first, stride = a.value_token_stride;
            switch (heads) {
              case 1: accumulate_values<1, 8, kNv8>(v, rows, stride, p, acc); break;
              case 2: accumulate_values<2, 4, kNv8>(v, rows, stride, p, acc); break;
              case 3: accumulate_values<3, 2, kNv8>(v, rows, stride, p, acc); break;
              default: accumulate_values<4, 2, kNv8>(v, rows, stride, p, acc); break;
            }
          }
        }
      } else {
        for (int64_t first = from; first < to; first += a.block) {
          const C* v = value_rows(first);
          for (int64_t j = first; j < std::min(to, first + a.block); ++j, v += a.value_token_stride) {
            for (int64_t i = 0; i < dv; ++i) widened[i] = to_float(v[i]);
            for (int64_t h = 0; h < group; ++h) {
              const float p = scores[h * score_stride + j - from];
              float* __restrict__ acc = part_acc.data() + ((first_head + h) * chunks + c) * dv;
#pragma omp simd
              for (int64_t i = 0; i < dv; ++i) acc[i] = std::fma(p, widened[i], acc[i]);
            }
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

// torch.argmax over the last dim of fp32 x [rows, n] (the last dim contiguous): int64 [rows].
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "argmax_rows: fp32 x [rows, n > 0] with a contiguous last dim expected");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* src = x.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) idx[r] = argmax_row(src + r * stride, n);
  });
  return out;
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
    on_cache_dtype(key_cache, "paged_decode", [&](auto cache_tag) {
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

// ---- prefill_causal: causal attention of the new tokens of each prompt, one op per layer ----

// The vector prefill_causal computes in: one AVX-512 register where the build has AVX-512, else 8 lanes (one AVX2
// register; SSE/NEON builds split it). Any head size: the packed keys and values are padded with zeros.
#if defined(__AVX512F__)
using PrefillVec = v16;
using PrefillInt = v16i;
#else
using PrefillVec = v8;
using PrefillInt = v8i;
#endif
constexpr int64_t kPrefillLanes = sizeof(PrefillVec) / sizeof(float);
// Query rows per register tile (x 2 vectors of keys for the scores, x 2 vectors of value dims for P.V): 12
// accumulators + 3 operands in AVX2's 16 registers; 16 + 3 of AVX-512's 32.
constexpr int64_t kPrefillRows = kPrefillLanes == 16 ? 8 : 6;
constexpr int64_t kPrefillKeys = 64;        // keys per block: one packed key panel, the online softmax's step
// Query rows per work item (its query tokens x the GQA group): 32 tokens at groups of 1-3, fewer for larger groups
// (MLA: all the heads share one latent KV head), so that an item's rows, scores and sums stay in L2.
constexpr int64_t kPrefillItemRows = 96, kPrefillMaxTokens = 32;
static_assert(kPrefillKeys % (2 * kPrefillLanes) == 0, "a key block is whole tiles of 2 vectors of keys");

inline PrefillVec prefill_load(const float* p) {
  PrefillVec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void prefill_store(float* p, PrefillVec v) { std::memcpy(p, &v, sizeof(v)); }

// s in every lane: one broadcast (`PrefillVec{} + s` is an add too: 0 + -0 is +0)
inline PrefillVec prefill_splat(float s) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(s);
#elif defined(__AVX__)
  return _mm256_set1_ps(s);
#else
  PrefillVec v;
  for (int64_t i = 0; i < kPrefillLanes; ++i) v[i] = s;
  return v;
#endif
}

// a * b + c: one FMA where the build has the instruction; else a product and a sum (std::fma without the instruction
// is a library call per lane)
inline PrefillVec prefill_madd(PrefillVec a, PrefillVec b, PrefillVec c) {
#if defined(__AVX512F__)
  return vfma16(a, b, c);
#elif defined(__FMA__)
  return vfma8(a, b, c);
#else
  return a * b + c;
#endif
}

struct PrefillShape {
  int64_t tokens, heads, kv_heads, dk, dv;
  int64_t dv_pad;  // dv rounded up to 2 vectors: the packed value rows and the accumulators
  float scale;
};

// Where prompt p's key j lives: its first context[p] keys are cached tokens in the paged cache (row p of the block
// tables; cache views [blocks, B, Hkv, D]), the rest are the prompt's new tokens, rows cu[p] + j - context[p] of
// k / v. Without context (context == nullptr) every key is a new token.
template <typename T>
struct PrefillKeys {
  const T *k, *v;
  std::array<int64_t, 2> k_strides, v_strides;
  const int64_t* cu;
  const int64_t* context = nullptr;
  const T *key_cache = nullptr, *value_cache = nullptr;
  std::array<int64_t, 3> kc_strides{}, vc_strides{};
  const int64_t* tables = nullptr;
  int64_t table_width = 0, block_size = 1;

  const T* key(int64_t p, int64_t j, int64_t head) const {
    return row(k, k_strides, key_cache, kc_strides, p, j, head);
  }

  const T* value(int64_t p, int64_t j, int64_t head) const {
    return row(v, v_strides, value_cache, vc_strides, p, j, head);
  }

 private:
  const T* row(const T* fresh, const std::array<int64_t, 2>& fresh_strides, const T* cache,
               const std::array<int64_t, 3>& cache_strides, int64_t p, int64_t j, int64_t head) const {
    const int64_t c = context ? context[p] : 0;
    if (j >= c) return fresh + (cu[p] + j - c) * fresh_strides[0] + head * fresh_strides[1];
    const int64_t block = tables[p * table_width + j / block_size];
    return cache + block * cache_strides[0] + j % block_size * cache_strides[1] + head * cache_strides[2];
  }
};

// scores[m][t] = sum_d qf[m][d] * panel[d][t] for rows [0, rows) (whole tiles) and keys [0, keys) (whole tiles of 2
// vectors), row tile by row tile; `visible(m)`: the keys row m's tile needs at most (later tiles are skipped).
template <typename Visible>
inline void prefill_scores(const float* qf, int64_t rows, int64_t dk, const float* panel, int64_t keys, float* scores,
                           Visible visible) {
  constexpr int64_t R = kPrefillRows, L = kPrefillLanes;
  for (int64_t i0 = 0; i0 < rows; i0 += R) {
    const int64_t tile_keys = std::min(keys, visible(i0 + R - 1));
    for (int64_t t0 = 0; t0 < tile_keys; t0 += 2 * L) {
      PrefillVec acc[R][2] = {};
      const float* k = panel + t0;
      for (int64_t d = 0; d < dk; ++d, k += kPrefillKeys) {
        const PrefillVec k0 = prefill_load(k), k1 = prefill_load(k + L);
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) {
          const PrefillVec b = prefill_splat(qf[(i0 + r) * dk + d]);
          acc[r][0] = prefill_madd(b, k0, acc[r][0]);
          acc[r][1] = prefill_madd(b, k1, acc[r][1]);
        }
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        prefill_store(scores + (i0 + r) * kPrefillKeys + t0, acc[r][0]);
        prefill_store(scores + (i0 + r) * kPrefillKeys + t0 + L, acc[r][1]);
      }
    }
  }
}

// acc[m][:] += sum_j probs[m][j] * values[j][:] for rows [0, rows) (whole tiles) over dims in slices of 2 vectors,
// the accumulators of a tile's slice in registers across the keys; `visible(m)`: as for prefill_scores.
template <typename Visible>
inline void prefill_values(const float* probs, int64_t rows, const float* values, int64_t keys, int64_t dv_pad,
                           float* acc, Visible visible) {
  constexpr int64_t R = kPrefillRows, L = kPrefillLanes;
  for (int64_t i0 = 0; i0 < rows; i0 += R) {
    const int64_t tile_keys = std::min(keys, visible(i0 + R - 1));
    for (int64_t s = 0; s < dv_pad; s += 2 * L) {
      PrefillVec sums[R][2];
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        sums[r][0] = prefill_load(acc + (i0 + r) * dv_pad + s);
        sums[r][1] = prefill_load(acc + (i0 + r) * dv_pad + s + L);
      }
      const float* v = values + s;
      for (int64_t j = 0; j < tile_keys; ++j, v += dv_pad) {
        const PrefillVec v0 = prefill_load(v), v1 = prefill_load(v + L);
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) {
          const PrefillVec p = prefill_splat(probs[(i0 + r) * kPrefillKeys + j]);
          sums[r][0] = prefill_madd(p, v0, sums[r][0]);
          sums[r][1] = prefill_madd(p, v1, sums[r][1]);
        }
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        prefill_store(acc + (i0 + r) * dv_pad + s, sums[r][0]);
        prefill_store(acc + (i0 + r) * dv_pad + s + L, sums[r][1]);
      }
    }
  }
}

// exp(x) for x <= 0 on the prefill's vector: exp_nonpositive's range reduction and degree-7 polynomial with every
// multiply-add one prefill_madd (one rounding where the build has FMA: the build's -ffp-contract=off leaves
// exp_nonpositive's a multiply and an add each) and 2^n added into the exponent.
inline PrefillVec prefill_exp(PrefillVec x) {
  const PrefillVec floor = prefill_splat(-87.f), magic = prefill_splat(12582912.f);  // 1.5 x 2^23: rounds to integers
  x = x < floor ? floor : x;
  const PrefillVec n = prefill_madd(x, prefill_splat(kLog2e), magic) - magic;
  const PrefillVec r = prefill_madd(n, prefill_splat(-kLn2Lo), prefill_madd(n, prefill_splat(-kLn2Hi), x));
  PrefillVec p = prefill_splat(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = prefill_madd(p, r, prefill_splat(c));
  PrefillInt bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += __builtin_convertvector(n, PrefillInt) << 23;
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

inline float prefill_max_lanes(PrefillVec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(v);
#else
  float m = v[0];
  for (int64_t l = 1; l < kPrefillLanes; ++l) m = std::max(m, v[l]);
  return m;
#endif
}

// One row's online-softmax step over a key block, in registers: the block's scores as vectors (lanes past `visible`
// -inf), the block's max, exp(score - max) through key `keys` - 1 (0 past `visible`, stored over the scores), the
// running max moved to the new max with the row's sums and accumulator rescaled. The row's sum stays kPrefillLanes
// partial sums (`sums`), added up once when the row is done (a horizontal sum per row and block was a serial chain).
inline void prefill_softmax_row(float* __restrict__ row, int64_t visible, int64_t keys, float& top,
                                float* __restrict__ sums, float* __restrict__ acc, int64_t dv_pad) {
  constexpr int64_t L = kPrefillLanes, V = kPrefillKeys / L;
  if (visible <= 0) {  // the whole block is after this row's token
    std::fill(row, row + keys, 0.f);
    return;
  }
  const int64_t vectors = (keys + L - 1) / L;
  const PrefillVec neg_inf = prefill_splat(-std::numeric_limits<float>::infinity());
  PrefillInt lane;
  for (int64_t l = 0; l < L; ++l) lane[l] = static_cast<int32_t>(l);
  PrefillVec x[V], tops = neg_inf;
#pragma GCC unroll 8
  for (int64_t i = 0; i < V; ++i) {
    if (i == vectors) break;
    x[i] = prefill_load(row + L * i);
    x[i] = lane + static_cast<int32_t>(L * i) < static_cast<int32_t>(visible) ? x[i] : neg_inf;
    tops = x[i] > tops ? x[i] : tops;
  }
  const float next = std::max(top, prefill_max_lanes(tops));
  if (next > top) {  // exp(-inf) = 0 on the first block: the accumulator and sums are 0 there anyway
    const PrefillVec alphas = prefill_splat(std::exp(top - next));
    prefill_store(sums, prefill_load(sums) * alphas);
    for (int64_t i = 0; i < dv_pad; i += L) prefill_store(acc + i, prefill_load(acc + i) * alphas);
    top = next;
  }
  const PrefillVec nexts = prefill_splat(next), zero{};
  PrefillVec block_sums = prefill_load(sums);
#pragma GCC unroll 8
  for (int64_t i = 0; i < V; ++i) {
    if (i == vectors) break;
    const PrefillVec e = x[i] == neg_inf ? zero : prefill_exp(x[i] - nexts);
    block_sums += e;
    prefill_store(row + L * i, e);
  }
  prefill_store(sums, block_sums);
}

// Pack one key block of one prompt and KV head (its keys first .. first + n - 1): keys transposed into a panel
// [dk][kPrefillKeys] of fp32 (zeros past the prompt), and the block's value rows widened into [n][dv_pad] (zeros
// past dv).
template <typename T>
inline void prefill_pack_block(const PrefillKeys<T>& src, int64_t prompt, int64_t head, int64_t first, int64_t n,
                               const PrefillShape& a, float* __restrict__ panel, float* __restrict__ values) {
  for (int64_t j = 0; j < n; ++j) {
    const T *k = src.key(prompt, first + j, head), *v = src.value(prompt, first + j, head);
    for (int64_t d = 0; d < a.dk; ++d) panel[d * kPrefillKeys + j] = to_float(k[d]);
    float* row = values + j * a.dv_pad;
    for (int64_t i = 0; i < a.dv; ++i) row[i] = to_float(v[i]);
    std::fill(row + a.dv, row + a.dv_pad, 0.f);
  }
  if (n < kPrefillKeys)  // a prompt's last block: the scores of the keys past its end are computed (as 0), never used
    for (int64_t d = 0; d < a.dk; ++d) std::fill(panel + d * kPrefillKeys + n, panel + (d + 1) * kPrefillKeys, 0.f);
}

struct PrefillItem {
  int64_t prompt, head, first;  // first: the item's first query token within its prompt
};

// A prefill's work items, (prompt, KV head, up to `tokens_per_item` query tokens), and their split over the threads
// by work (rows x keys: later query tokens see more keys) in contiguous runs: part p runs items
// [part_start(p), part_start(p + 1)). A prompt's keys are its cached context (`context`, nullptr: none) then its new
// tokens; they are packed in blocks of kPrefillKeys, each prompt's keys starting a block: block index
// head * total_blocks + first_block[prompt] + key / kPrefillKeys (`block`).
struct PrefillItems {
  const int64_t* cu;
  const int64_t* context;
  const PrefillShape& a;
  std::vector<int64_t> first_block;  // each prompt's first key block, the total last
  std::vector<PrefillItem> items;
  std::vector<int64_t> work_before{0};  // running sum of rows x keys
  int64_t parts = 1;

  PrefillItems(const int64_t* cu_seqlens, const int64_t* context_lens, int64_t prompts, const PrefillShape& shape,
               int64_t tokens_per_item)
      : cu(cu_seqlens), context(context_lens), a(shape), first_block(prompts + 1, 0) {
    const int64_t group = a.heads / a.kv_heads;
    for (int64_t p = 0; p < prompts; ++p) {
      const int64_t n = cu[p + 1] - cu[p], cached = cached_keys(p);
      first_block[p + 1] = first_block[p] + (cached + n + kPrefillKeys - 1) / kPrefillKeys;
      for (int64_t g = 0; g < a.kv_heads; ++g)
        for (int64_t first = 0; first < n; first += tokens_per_item) {
          const int64_t last = std::min(n, first + tokens_per_item);
          items.push_back({p, g, first});
          work_before.push_back(work_before.back() + (last - first) * group * (cached + last));
        }
    }
    const int64_t most = std::min<int64_t>(at::get_num_threads(), items.size());
    parts = std::clamp<int64_t>(work_before.back() * (a.dk + a.dv_pad) / kSerialElements, 1, std::max<int64_t>(most, 1));
  }

  int64_t cached_keys(int64_t prompt) const { return context ? context[prompt] : 0; }

  int64_t total_blocks() const { return first_block.back(); }  // key blocks over all prompts

  int64_t part_start(int64_t part) const {  // the first item whose work starts at or after the part's share
    const int64_t share = work_before.back() * part / parts;
    return std::lower_bound(work_before.begin(), work_before.end() - 1, share) - work_before.begin();
  }

  int64_t block(const PrefillItem& item, int64_t key) const {  // the packed block holding the item's key `key`
    return item.head * total_blocks() + first_block[item.prompt] + key / kPrefillKeys;
  }

  // Calls pack(block, prompt, kv head, first key, keys) for every packed key block, over the threads.
  template <typename Pack>
  void for_each_key_block(int64_t block_elements, Pack pack) const {
    at::parallel_for(0, a.kv_heads * total_blocks(), grain_for(block_elements), [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t head = item / total_blocks(), block = item % total_blocks();
        const int64_t p = std::upper_bound(first_block.begin(), first_block.end(), block) - first_block.begin() - 1;
        const int64_t first = (block - first_block[p]) * kPrefillKeys;
        pack(item, p, head, first, std::min(kPrefillKeys, cached_keys(p) + cu[p + 1] - cu[p] - first));
      }
    });
  }
};

// Causal attention of each prompt's new tokens (cu[p] .. cu[p+1]-1) to its cached context and to themselves
// (`PrefillKeys`: the new token i sees every cached key and new keys 0 .. i), GQA without repeating keys: work items are
// (prompt, KV head, up to 32 query tokens), whose rows are the tokens x the group's query heads (token-major). Keys and
// values are packed once per layer (prefill_pack_block); an item walks its keys a block at a time: the scores of a
// tile of rows x 2 vectors of keys in registers, an online softmax step per row (fp32), then P.V with a tile of rows x
// 2 vectors of value dims in registers. Tiles past a tile's last causal key are skipped. The items are split over
// the threads by their work (rows x keys: later query tokens see more keys), in contiguous runs.
template <typename T>
void prefill_causal_heads(const T* q, const PrefillKeys<T>& src, int64_t prompts, std::array<int64_t, 2> q_strides,
                          T* out, float* lse, const PrefillShape& a) {
  constexpr int64_t R = kPrefillRows, KB = kPrefillKeys;
  const int64_t group = a.heads / a.kv_heads, dk = a.dk, dv_pad = a.dv_pad;
  const int64_t QT = std::clamp<int64_t>(kPrefillItemRows / group, 1, kPrefillMaxTokens);  // query tokens per item
  const int64_t* cu = src.cu;
  const PrefillItems plan(cu, src.context, prompts, a, QT);
  // every element the items read is written by the packing: no zero-filled allocation (megabytes per layer)
  const std::unique_ptr<float[]> panels(new float[a.kv_heads * plan.total_blocks() * dk * KB]);
  const std::unique_ptr<float[]> values(new float[a.kv_heads * plan.total_blocks() * KB * dv_pad]);
  plan.for_each_key_block(KB * (dk + dv_pad), [&](int64_t item, int64_t p, int64_t head, int64_t first, int64_t n) {
    prefill_pack_block(src, p, head, first, n, a, panels.get() + item * dk * KB, values.get() + item * KB * dv_pad);
  });

  const std::vector<PrefillItem>& items = plan.items;
  at::parallel_for(0, plan.parts, 1, [&](int64_t part_begin, int64_t part_end) {
    const int64_t max_rows = (QT * group + R - 1) / R * R;
    std::vector<float> qf(max_rows * dk), scores(max_rows * KB), acc(max_rows * dv_pad), top(max_rows);
    std::vector<float> sum(max_rows * kPrefillLanes);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int64_t it = plan.part_start(part_begin); it < plan.part_start(part_end); ++it) {
      const PrefillItem& item = items[it];
      const int64_t start = cu[item.prompt], n = cu[item.prompt + 1] - start;
      const int64_t tokens = std::min(QT, n - item.first), rows = tokens * group, padded = (rows + R - 1) / R * R;
      const int64_t head0 = item.head * group;
      for (int64_t m = 0; m < rows; ++m) {
        const T* qr = q + (start + item.first + m / group) * q_strides[0] + (head0 + m % group) * q_strides[1];
        for (int64_t d = 0; d < dk; ++d) qf[m * dk + d] = to_float(qr[d]) * a.scale;
      }
      std::fill(qf.begin() + rows * dk, qf.begin() + padded * dk, 0.f);  // the last tile's padding rows
      std::fill(acc.begin(), acc.begin() + padded * dv_pad, 0.f);
      std::fill(top.begin(), top.end(), neg_inf);
      std::fill(sum.begin(), sum.end(), 0.f);
      const int64_t cached = plan.cached_keys(item.prompt), keys_end = cached + item.first + tokens;
      for (int64_t k0 = 0; k0 < keys_end; k0 += KB) {  // keys [0, keys_end) of the prompt: cached, then new
        const int64_t n_keys = std::min(KB, keys_end - k0);
        const int64_t block = plan.block(item, k0);
        // the keys row m may see in this block: through its own token (padding rows: as the last real row)
        auto visible = [&](int64_t m) { return cached + item.first + std::min(m, rows - 1) / group + 1 - k0; };
        constexpr int64_t tile = 2 * kPrefillLanes;  // scores come in tiles of 2 vectors of keys
        auto score_keys = [&](int64_t m) {
          return (std::clamp<int64_t>(visible(m), 0, n_keys) + tile - 1) / tile * tile;
        };
        prefill_scores(qf.data(), padded, dk, panels.get() + block * dk * KB, n_keys, scores.data(), score_keys);
        for (int64_t m = 0; m < rows; ++m)
          prefill_softmax_row(scores.data() + m * KB, std::min(visible(m), n_keys), n_keys, top[m],
                              sum.data() + m * kPrefillLanes, acc.data() + m * dv_pad, dv_pad);
        for (int64_t m = rows; m < padded; ++m) std::fill(scores.data() + m * KB, scores.data() + m * KB + n_keys, 0.f);
        auto value_keys = [&](int64_t m) { return std::clamp<int64_t>(visible(m), 0, n_keys); };
        prefill_values(scores.data(), padded, values.get() + block * KB * dv_pad, n_keys, dv_pad, acc.data(),
                       value_keys);
      }
      for (int64_t m = 0; m < rows; ++m) {
        const int64_t token = start + item.first + m / group, head = head0 + m % group;
        T* o = out + (token * a.heads + head) * a.dv;
        float total = 0.f;
        for (int64_t l = 0; l < kPrefillLanes; ++l) total += sum[m * kPrefillLanes + l];
        const float inv = 1.f / total;
        for (int64_t i = 0; i < a.dv; ++i) o[i] = from_float<T>(acc[m * dv_pad + i] * inv);
        lse[token * a.heads + head] = top[m] + std::log(total);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// ---- prefill_causal in bfloat16 on the stored bits: AMX tiles (brgemm) or AVX512-BF16 dot products ----
//
// With an AVX512-BF16 build, the two products of each key block run on the stored bf16 bits with fp32 sums: scores =
// Q.K^T of the item's rows, then acc += P.V with the probabilities rounded to bfloat16, as torch's flash attention
// rounds them, with an AVX-512 online softmax per row between them (amx_softmax_row, fp32). Where torch's cpublas can
// pack bfloat16 for its brgemm (a CPU with AMX) the products are brgemm calls (BrgemmProducts); elsewhere (Zen 4,
// Cooper Lake) register tiles of vdpbf16ps, 2 multiply-adds per fp32 lane and instruction (DotProducts), twice the
// vector path's FMAs on widened values. Keys and values are packed once per layer into the VNNI layout both read
// (pairs of consecutive K-dimension elements side by side): keys as K^T [dk/2][64 keys][2], values as
// [32 key pairs][stride][2] (stride: dv for brgemm, dv_pad for the dot tiles), zeros past a prompt's last key, an odd
// dk and dv.
constexpr int64_t kAmxItemRows = 192, kAmxMaxTokens = 64;  // rows per item: 64 tokens x a group of 3 (12 row tiles)

// e^x in 16 lanes for x <= 8 (a score less its row's reference point): x floored at -87 (below, e^x is not a normal
// fp32: the sums cannot tell, and a far more negative x would leave r too large for the polynomial), x = n ln2 + r with
// |r| <= ln2 / 2 (ln2 split so that n * hi is exact), e^r by its degree-6 Taylor polynomial (relative error ~2e-7, a
// few ulp), and 2^n applied by vscalefps: 12 instructions, where ATen's exp_u20 takes 19 (its clamps, its conversions
// to and from integers and its exponent arithmetic). A NaN stays NaN (the floor's max returns its second operand).
inline __m512 exp_scaled16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// One row's online-softmax step over a key block of 64 scores, 16 lanes at a time: the first `visible` scores, scaled,
// become exp(score - top) rounded to bfloat16 in `probs` (the rest 0), where `top` is the row's reference point (its
// running max, moved lazily), and the row's sums and accumulator are rescaled when it moves. The sum stays 16 lanes
// of partial sums (`sums`), added up once at the end. exp is exp_scaled16 (a few ulp): the probabilities are rounded to
// bfloat16 (2^-9 relative) right after.
inline void amx_softmax_row(const float* __restrict__ row, int64_t visible, float scale, float& top,
                            float* __restrict__ sums, float* __restrict__ acc, int64_t dv_pad,
                            uint16_t* __restrict__ probs) {
  static_assert(kPrefillKeys == 64, "a key block is 4 vectors of 16 scores");
  if (visible <= 0) {  // the whole block is after this row's token
    std::memset(probs, 0, kPrefillKeys * sizeof(uint16_t));
    return;
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), scales = _mm512_set1_ps(scale);
  __m512 x[4];
  __mmask16 lanes[4];
  for (int i = 0; i < 4; ++i) {
    const int64_t left = std::clamp<int64_t>(visible - 16 * i, 0, 16);
    lanes[i] = static_cast<__mmask16>((1u << left) - 1u);
    x[i] = _mm512_mask_mul_ps(neg_inf, lanes[i], _mm512_loadu_ps(row + 16 * i), scales);
  }
  const float block_top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
  // The reference point moves only when a score passes it by more than kLazyRescale (always on the first block: top
  // is -inf there, and exp(-inf) = 0 clears the empty accumulator and sums): exp(score - top) stays below e^8, far
  // inside fp32 and bf16, and most blocks skip the rescale and its scalar exp.
  constexpr float kLazyRescale = 8.f;
  if (block_top > top + kLazyRescale) {
    const __m512 alphas = _mm512_set1_ps(std::exp(top - block_top));
    _mm512_storeu_ps(sums, _mm512_mul_ps(_mm512_loadu_ps(sums), alphas));
    for (int64_t i = 0; i < dv_pad; i += 16) _mm512_storeu_ps(acc + i, _mm512_mul_ps(_mm512_loadu_ps(acc + i), alphas));
    top = block_top;
  }
  const __m512 tops = _mm512_set1_ps(top);
  __m512 e[4];
  for (int i = 0; i < 4; ++i)
    e[i] = _mm512_maskz_mov_ps(lanes[i], exp_scaled16(_mm512_sub_ps(x[i], tops)));
  const __m512 block_sums = _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3]));
  _mm512_storeu_ps(sums, _mm512_add_ps(_mm512_loadu_ps(sums), block_sums));
  _mm512_storeu_si512(probs, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
  _mm512_storeu_si512(probs + 32, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
}

// Keys first .. first + n - 1 of one prompt and KV head as K^T [dk/2][64 keys][2] (zeros past n and an odd dk): a
// pair of a key's dims is the 32 bits that hold them (little-endian: the first in the low half).
inline void amx_pack_keys(const PrefillKeys<c10::BFloat16>& src, int64_t prompt, int64_t head, int64_t first,
                          int64_t n, int64_t dk, uint32_t* __restrict__ out) {
  const int64_t pairs = (dk + 1) / 2;
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* k = reinterpret_cast<const uint16_t*>(src.key(prompt, first + j, head));
    for (int64_t w = 0; w < dk / 2; ++w) std::memcpy(out + w * kPrefillKeys + j, k + 2 * w, sizeof(uint32_t));
    if (dk % 2) out[(pairs - 1) * kPrefillKeys + j] = k[dk - 1];
  }
  for (int64_t w = 0; w < pairs; ++w) std::fill(out + w * kPrefillKeys + n, out + (w + 1) * kPrefillKeys, 0u);
}

// The same keys' values as [32 key pairs][stride][2] (zeros past n and past dv): each 32 bits are one dim of a pair
// of consecutive keys, the first key in the low half.
inline void amx_pack_values(const PrefillKeys<c10::BFloat16>& src, int64_t prompt, int64_t head, int64_t first,
                            int64_t n, int64_t dv, int64_t stride, uint16_t* __restrict__ out) {
  for (int64_t j = 0; j < kPrefillKeys; j += 2) {
    uint32_t* __restrict__ o = reinterpret_cast<uint32_t*>(out) + (j / 2) * stride;
    auto row = [&](int64_t key) { return reinterpret_cast<const uint16_t*>(src.value(prompt, first + key, head)); };
    if (j + 1 < n) {
      const uint16_t *r0 = row(j), *r1 = row(j + 1);
      for (int64_t c = 0; c < dv; ++c) o[c] = uint32_t{r0[c]} | (uint32_t{r1[c]} << 16);
    } else if (j < n) {
      const uint16_t* r0 = row(j);
      for (int64_t c = 0; c < dv; ++c) o[c] = r0[c];
    } else {
      std::fill(o, o + dv, 0u);
    }
    std::fill(o + dv, o + stride, 0u);
  }
}

// The products of a key block on oneDNN's brgemm (AMX tiles), a call per product over all of an item's rows.
struct BrgemmProducts {
  static constexpr int64_t kRowTile = 1;
  static int64_t value_stride(const PrefillShape& a) { return a.dv; }

  // scores [rows][64] = qb [rows][dk2] . keys [dk2/2][64][2]
  template <typename Visible>
  static void scores(int64_t rows, const uint16_t* qb, int64_t dk2, const uint32_t* keys, float* scores, Visible) {
    at::native::cpublas::brgemm(rows, kPrefillKeys, dk2, dk2, kPrefillKeys, kPrefillKeys, false,
                                reinterpret_cast<const c10::BFloat16*>(qb), reinterpret_cast<const c10::BFloat16*>(keys),
                                scores);
  }

  // acc [rows][dv_pad] += pb [rows][64] . values [32][dv][2]
  template <typename Visible>
  static void values(int64_t rows, const uint16_t* pb, const uint16_t* values, const PrefillShape& a, float* acc,
                     Visible) {
    at::native::cpublas::brgemm(rows, a.dv, kPrefillKeys, kPrefillKeys, a.dv, a.dv_pad, true,
                                reinterpret_cast<const c10::BFloat16*>(pb),
                                reinterpret_cast<const c10::BFloat16*>(values), acc);
  }

  static void release() { at::native::cpublas::brgemm_release(); }
};

// c[r][16v + l] (+)= sum over w < pairs of the bf16 pairs a[r][w] . b[w][16v + l] (each 32 bits: two bf16), for R rows
// and V vectors of 16 columns: R x V accumulators in registers (6 x 4 = 24 of AVX-512's 32), one vdpbf16ps per pair.
template <int R, int V, bool kAccumulate>
inline void dot_tile(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t pairs, float* c,
                     int64_t ldc) {
  __m512 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = kAccumulate ? _mm512_loadu_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t w = 0; w < pairs; ++w) {
    __m512bh bv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + w * ldb + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * lda + w]));
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
}

// dot_tile over `vectors` vectors of 16 columns, 4 at a time.
template <int R, bool kAccumulate>
inline void dot_tiles(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t pairs, int64_t vectors,
                      float* c, int64_t ldc) {
  for (int64_t v0 = 0; v0 < vectors; v0 += 4) {
    const uint32_t* bs = b + 16 * v0;
    float* cs = c + 16 * v0;
    switch (std::min<int64_t>(4, vectors - v0)) {
      case 4: dot_tile<R, 4, kAccumulate>(a, lda, bs, ldb, pairs, cs, ldc); break;
      case 3: dot_tile<R, 3, kAccumulate>(a, lda, bs, ldb, pairs, cs, ldc); break;
      case 2: dot_tile<R, 2, kAccumulate>(a, lda, bs, ldb, pairs, cs, ldc); break;
      default: dot_tile<R, 1, kAccumulate>(a, lda, bs, ldb, pairs, cs, ldc); break;
    }
  }
}

// The products of a key block as vdpbf16ps register tiles of 6 rows, each tile only over the keys its last row sees
// (`visible(m)`: the keys row m sees in the block, at most 64): whole vectors of 16 keys for the scores, whole key
// pairs for P.V (the probabilities past a row's last visible key are 0).
struct DotProducts {
  static constexpr int64_t kRowTile = 6;
  static int64_t value_stride(const PrefillShape& a) { return a.dv_pad; }

  template <typename Visible>
  static void scores(int64_t rows, const uint16_t* qb, int64_t dk2, const uint32_t* keys, float* scores,
                     Visible visible) {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(qb);
    for (int64_t i0 = 0; i0 < rows; i0 += kRowTile) {
      const int64_t vectors = (visible(i0 + kRowTile - 1) + 15) / 16;
      if (vectors > 0)
        dot_tiles<kRowTile, false>(q + i0 * dk2 / 2, dk2 / 2, keys, kPrefillKeys, dk2 / 2, vectors,
                                   scores + i0 * kPrefillKeys, kPrefillKeys);
    }
  }

  template <typename Visible>
  static void values(int64_t rows, const uint16_t* pb, const uint16_t* values, const PrefillShape& a, float* acc,
                     Visible visible) {
    const uint32_t *p = reinterpret_cast<const uint32_t*>(pb), *v = reinterpret_cast<const uint32_t*>(values);
    for (int64_t i0 = 0; i0 < rows; i0 += kRowTile) {
      const int64_t pairs = (visible(i0 + kRowTile - 1) + 1) / 2;
      if (pairs > 0)
        dot_tiles<kRowTile, true>(p + i0 * kPrefillKeys / 2, kPrefillKeys / 2, v, a.dv_pad, pairs, a.dv_pad / 16,
                                  acc + i0 * a.dv_pad, a.dv_pad);
    }
  }

  static void release() {}
};

// Causal attention of each prompt's new tokens to its context and to themselves, as prefill_causal_heads, in bfloat16
// on the stored bits: items of up to 64 query tokens x the group's heads; the products are `Products`'.
template <typename Products>
void prefill_causal_bf16(const c10::BFloat16* q, const PrefillKeys<c10::BFloat16>& src, int64_t prompts,
                         std::array<int64_t, 2> q_strides, c10::BFloat16* out, float* lse, const PrefillShape& a) {
  constexpr int64_t KB = kPrefillKeys, R = Products::kRowTile;
  const int64_t group = a.heads / a.kv_heads, dk2 = (a.dk + 1) / 2 * 2, dv = a.dv, dv_pad = a.dv_pad;
  const int64_t stride = Products::value_stride(a);
  const int64_t QT = std::clamp<int64_t>(kAmxItemRows / group, 1, kAmxMaxTokens);
  const int64_t* cu = src.cu;
  const PrefillItems plan(cu, src.context, prompts, a, QT);
  const std::unique_ptr<uint32_t[]> keys(new uint32_t[a.kv_heads * plan.total_blocks() * dk2 / 2 * KB]);
  const std::unique_ptr<uint16_t[]> values(new uint16_t[a.kv_heads * plan.total_blocks() * KB * stride]);
  plan.for_each_key_block(KB * (dk2 + stride), [&](int64_t item, int64_t p, int64_t head, int64_t first, int64_t n) {
    amx_pack_keys(src, p, head, first, n, a.dk, keys.get() + item * dk2 / 2 * KB);
    amx_pack_values(src, p, head, first, n, dv, stride, values.get() + item * KB * stride);
  });

  at::parallel_for(0, plan.parts, 1, [&](int64_t part_begin, int64_t part_end) {
    const int64_t max_rows = (QT * group + R - 1) / R * R;  // the row tiles' padding rows are computed, never stored
    std::vector<uint16_t> qb(max_rows * dk2, 0), pb(max_rows * KB, 0);
    std::vector<float> scores(max_rows * KB), acc(max_rows * dv_pad), top(max_rows), sums(max_rows * 16);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int64_t it = plan.part_start(part_begin); it < plan.part_start(part_end); ++it) {
      const PrefillItem& item = plan.items[it];
      const int64_t start = cu[item.prompt], n = cu[item.prompt + 1] - start;
      const int64_t tokens = std::min(QT, n - item.first), rows = tokens * group, head0 = item.head * group;
      for (int64_t m = 0; m < rows; ++m) {
        const int64_t token = start + item.first + m / group, head = head0 + m % group;
        std::memcpy(qb.data() + m * dk2, q + token * q_strides[0] + head * q_strides[1], a.dk * sizeof(uint16_t));
      }
      std::fill(acc.begin(), acc.begin() + rows * dv_pad, 0.f);
      std::fill(top.begin(), top.end(), neg_inf);
      std::fill(sums.begin(), sums.end(), 0.f);
      const int64_t cached = plan.cached_keys(item.prompt), keys_end = cached + item.first + tokens;
      for (int64_t k0 = 0; k0 < keys_end; k0 += KB) {  // keys [0, keys_end) of the prompt: cached, then new
        const int64_t n_keys = std::min(KB, keys_end - k0);
        const int64_t block = plan.block(item, k0);
        // the keys row m sees in this block: through its own token (padding rows: as the last real row)
        auto visible = [&](int64_t m) {
          return std::clamp<int64_t>(cached + item.first + std::min(m, rows - 1) / group + 1 - k0, 0, n_keys);
        };
        Products::scores(rows, qb.data(), dk2, keys.get() + block * dk2 / 2 * KB, scores.data(), visible);
        for (int64_t m = 0; m < rows; ++m)
          amx_softmax_row(scores.data() + m * KB, visible(m), a.scale, top[m], sums.data() + m * 16,
                          acc.data() + m * dv_pad, dv_pad, pb.data() + m * KB);
        Products::values(rows, pb.data(), values.get() + block * KB * stride, a, acc.data(), visible);
      }
      for (int64_t m = 0; m < rows; ++m) {
        const int64_t token = start + item.first + m / group, head = head0 + m % group;
        c10::BFloat16* o = out + (token * a.heads + head) * dv;
        const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(sums.data() + m * 16)), inv = 1.f / sum;
        for (int64_t i = 0; i < dv; ++i) o[i] = from_float<c10::BFloat16>(acc[m * dv_pad + i] * inv);
        lse[token * a.heads + head] = top[m] + std::log(sum);
      }
    }
    Products::release();
  });
}

// Whether torch's cpublas can run bfloat16 brgemm here: it packs bfloat16 only where the CPU has AMX.
bool prefill_amx_available() {
  static const bool available = at::native::cpublas::could_pack(at::kBFloat16);
  return available;
}
#endif

// How prefill_causal can run bfloat16 products in this build on this CPU, best first: "amx" (oneDNN's brgemm on AMX
// tiles), "avx512_bf16" (vdpbf16ps register tiles), "fp32" (the vector path, on values widened to fp32).
std::vector<std::string> prefill_bf16_products() {
#if defined(__AVX512BF16__)
  if (prefill_amx_available()) return {"amx", "avx512_bf16", "fp32"};
  return {"avx512_bf16", "fp32"};
#else
  return {"fp32"};
#endif
}

// q [T, H, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] (one dtype, any strides but the last), cu_seqlens [P + 1] int64:
// causal attention of each prompt's tokens to themselves and, with `context_lens` [P] int64, to the first
// context_lens[p] tokens of prompt p in the paged cache (cache views [blocks, B, Hkv, D] of q's dtype, block_tables
// [P, W] int64), which precede its new tokens. `products`: how bfloat16 products run, one of prefill_bf16_products()
// ("auto": the first; float32 takes "auto" or "fp32"). Returns out [T, H, Dv] (q's dtype) and lse [T, H] fp32.
std::tuple<at::Tensor, at::Tensor> prefill_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& cu_seqlens, double scale,
                                                  const std::optional<at::Tensor>& context_lens,
                                                  const std::optional<at::Tensor>& key_cache,
                                                  const std::optional<at::Tensor>& value_cache,
                                                  const std::optional<at::Tensor>& block_tables,
                                                  c10::string_view products) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "prefill_causal: q/k/v [tokens, heads, dim] with a contiguous last dim expected");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "prefill_causal: q, k and v of one dtype expected");
  const int64_t tokens = q.size(0), heads = q.size(1), dk = q.size(2), kv_heads = k.size(1), dv = v.size(2);
  TORCH_CHECK(k.size(0) == tokens && v.size(0) == tokens && k.size(2) == dk && v.size(1) == kv_heads && kv_heads > 0 &&
                  heads % kv_heads == 0,
              "prefill_causal: q [T, H, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] with Hkv dividing H expected");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1,
              "prefill_causal: int64 cu_seqlens [prompts + 1] expected");
  const at::Tensor cu = cu_seqlens.contiguous();
  const int64_t* c = cu.data_ptr<int64_t>();
  const int64_t prompts = cu.numel() - 1;
  TORCH_CHECK(c[0] == 0 && c[prompts] == tokens, "prefill_causal: cu_seqlens must run from 0 to the token count");
  at::Tensor context, tables;
  if (context_lens.has_value()) {
    TORCH_CHECK(key_cache.has_value() && value_cache.has_value() && block_tables.has_value(),
                "prefill_causal: context_lens needs key_cache, value_cache and block_tables");
    context = context_lens->contiguous();
    tables = block_tables->contiguous();
    const at::Tensor &kc = *key_cache, &vc = *value_cache;
    TORCH_CHECK(context.scalar_type() == at::kLong && context.dim() == 1 && context.numel() == prompts,
                "prefill_causal: int64 context_lens [prompts] expected");
    TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == prompts,
                "prefill_causal: int64 block_tables [prompts, W] expected");
    TORCH_CHECK(kc.dim() == 4 && vc.dim() == 4 && kc.stride(3) == 1 && vc.stride(3) == 1 &&
                    kc.scalar_type() == q.scalar_type() && vc.scalar_type() == q.scalar_type() &&
                    kc.size(2) == kv_heads && vc.size(2) == kv_heads && kc.size(3) == dk && vc.size(3) >= dv &&
                    vc.size(1) == kc.size(1),
                "prefill_causal: key/value cache views [blocks, B, Hkv, D] of q's dtype and head sizes expected");
    const int64_t* ctx = context.data_ptr<int64_t>();
    for (int64_t p = 0; p < prompts; ++p)
      TORCH_CHECK(ctx[p] >= 0 && ctx[p] <= tables.size(1) * kc.size(1),
                  "prefill_causal: a context longer than its block table");
  }
  for (int64_t p = 0; p < prompts; ++p) TORCH_CHECK(c[p + 1] >= c[p], "prefill_causal: cu_seqlens must not decrease");
  at::Tensor out = at::empty({tokens, heads, dv}, q.options());
  at::Tensor lse = at::empty({tokens, heads}, q.options().dtype(at::kFloat));
  if (tokens == 0) return {out, lse};
  const int64_t pair = 2 * kPrefillLanes;
  const PrefillShape shape{tokens, heads, kv_heads, dk, dv, (dv + pair - 1) / pair * pair, static_cast<float>(scale)};
  auto keys_of = [&](auto tag) {
    using T = decltype(tag);
    PrefillKeys<T> src{k.data_ptr<T>(), v.data_ptr<T>(), {k.stride(0), k.stride(1)}, {v.stride(0), v.stride(1)}, c};
    if (context.defined()) {
      const at::Tensor &kc = *key_cache, &vc = *value_cache;
      src.context = context.data_ptr<int64_t>();
      src.key_cache = kc.data_ptr<T>();
      src.value_cache = vc.data_ptr<T>();
      src.kc_strides = {kc.stride(0), kc.stride(1), kc.stride(2)};
      src.vc_strides = {vc.stride(0), vc.stride(1), vc.stride(2)};
      src.tables = tables.data_ptr<int64_t>();
      src.table_width = tables.size(1);
      src.block_size = kc.size(1);
    }
    return src;
  };
  const std::vector<std::string> runs_here =
      q.scalar_type() == at::kBFloat16 ? prefill_bf16_products() : std::vector<std::string>{"fp32"};
  const std::string chosen = products == "auto" ? runs_here.front() : std::string(products);
  TORCH_CHECK(std::find(runs_here.begin(), runs_here.end(), chosen) != runs_here.end(), "prefill_causal: products '",
              chosen, "' do not run for ", q.scalar_type(), " in this build on this CPU (", c10::Join(", ", runs_here),
              ")");
#if defined(__AVX512BF16__)
  if (chosen == "amx" || chosen == "avx512_bf16") {
    const auto run = chosen == "amx" ? prefill_causal_bf16<BrgemmProducts> : prefill_causal_bf16<DotProducts>;
    run(q.data_ptr<c10::BFloat16>(), keys_of(c10::BFloat16{}), prompts, {q.stride(0), q.stride(1)},
        out.data_ptr<c10::BFloat16>(), lse.data_ptr<float>(), shape);
    return {out, lse};
  }
#endif
  on_dtype(q, "prefill_causal", [&](auto tag) {
    using T = decltype(tag);
    prefill_causal_heads(q.data_ptr<T>(), keys_of(tag), prompts, {q.stride(0), q.stride(1)}, out.data_ptr<T>(),
                         lse.data_ptr<float>(), shape);
  });
  return {out, lse};
}

// Pins thread t of the calling thread's OpenMP team (at::get_num_threads() threads, the calling thread is t = 0) to
// cores[t % cores.size()]. libgomp keeps a team's threads for the next parallel region the same thread starts with
// as many threads or fewer (torch's parallel_for and oneDNN both do), so the pinning lasts. Returns the core each
// thread was pinned to, -1 where the kernel refused (a core outside the process's CPU set).
std::vector<int64_t> bind_threads(at::IntArrayRef cores) {
  TORCH_CHECK(!cores.empty(), "bind_threads: at least one core expected");
  const int threads = at::get_num_threads();
  std::vector<int64_t> bound(threads, -1);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int64_t core = cores[t % cores.size()];
    cpu_set_t set;
    CPU_ZERO(&set);
    if (core >= 0 && core < CPU_SETSIZE) {
      CPU_SET(static_cast<int>(core), &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) bound[t] = core;
    }
  }
  return bound;
}

// The calling thread's OpenMP thread pool freed (OpenMP 5.0's soft pause: libgomp frees that thread's pool, its workers
// gone until the thread forks again; LLVM's runtime puts the process's pool threads to sleep instead). libgomp cuts every barrier's spin
// to zero (GOMP_SPINCOUNT applies no more) while a process has more OpenMP threads than cores: a server whose engine
// was loaded on the main thread and steps on another would keep both teams and sleep at every barrier. Returns 0 if
// released, else the runtime's refusal (or -1 where the OpenMP headers predate 5.0's pause; GCC 9-13 declare it but
// still report OpenMP 4.5 in _OPENMP).
int64_t release_openmp_pool() {
#if defined(_OPENMP) && (_OPENMP >= 201811 || (!defined(__clang__) && __GNUC__ >= 9))
  return omp_pause_resource_all(omp_pause_soft);
#else
  return -1;
#endif
}

}  // namespace

TORCH_LIBRARY(dcpctl, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor");
  m.def("store_kv(Tensor new_kv, Tensor(a!) cache, Tensor slots, float scale) -> ()");
  m.def(
      "rotary_store_kv(Tensor qkv, Tensor cos, Tensor sin, bool interleaved, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slots, float k_scale, float v_scale) -> (Tensor, Tensor)");
  m.def(
      "paged_decode(Tensor q, Tensor key_cache, Tensor? value_cache, Tensor block_tables, Tensor lens, float scale, "
      "int value_dim) -> (Tensor, Tensor)");
  m.def(
      "prefill_causal(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale, Tensor? context_lens=None, "
      "Tensor? key_cache=None, Tensor? value_cache=None, Tensor? block_tables=None, str products=\"auto\") -> "
      "(Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("prefill_bf16_products() -> str[]", &prefill_bf16_products);  // no tensors to dispatch on
  m.def("bind_threads(int[] cores) -> int[]", &bind_threads);  // no tensors to dispatch on: one kernel for all
  m.def("release_openmp_pool() -> int", &release_openmp_pool);
}

TORCH_LIBRARY_IMPL(dcpctl, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("store_kv", &store_kv);
  m.impl("rotary_store_kv", &rotary_store_kv);
  m.impl("paged_decode", &paged_decode);
  m.impl("prefill_causal", &prefill_causal);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
}
