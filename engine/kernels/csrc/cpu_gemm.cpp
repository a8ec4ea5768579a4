// The engine's CPU matmuls, registered as torch ops under `dcpctl::` (the library is cpu_kernels.cpp's):
//   gemv          y = x @ w.T (+ bias) for a few rows, on the plain [n, k] weight. oneDNN's packed path reads
//                 the weights at 50-65% of the memory bandwidth here, this row-streaming loop at ~90%
//                 (benchmarks/gemv_roofline.py). Rows of w split over torch's intra-op threads. bf16 with
//                 AVX512-BF16: vdpbf16ps on the weight's and x's own bits, one row of w at a time in memory order.
//   pack_panels   a [n, k] weight reordered once into panels of kPanel output columns, [ceil(n / kPanel), k, kPanel]
//                 (the last panel zero-padded), in the weight's own dtype. A bf16 panel row interleaves its two
//                 vectors' columns (j, j + kLanes) in each 32-bit pair, so that widening them to fp32 is a shift
//                 and a mask: no widening shuffles competing with the FMAs for the vector ports.
//   panel_linear  y = x @ w.T (+ bias) for any number of rows against those panels: the register-blocked
//                 outer product BLAS libraries use (a block of x rows times one panel, k steps of one FMA per
//                 row and vector), fp32 accumulation, bf16 weights widened in registers. It is the bf16 path
//                 where oneDNN has none (CPUs without AVX-512 or AVX-NE-CONVERT) and keeps bf16's memory.
//                 With AVX512-BF16 (`-mavx512bf16`) a bf16 panel holds pairs of consecutive k values per column
//                 instead, and x goes in as the same pairs: one vdpbf16ps per vector does two k steps (twice the fp32
//                 FMA rate), accumulating in fp32.
// This file is built once per ISA level (cpu_kernels.py): the vector width comes from the -march it gets. Defining
// DCPCTL_EMULATE_AVX512_BF16 (the test build of tests/test_cpu_gemm_avx512.py, never the engine's) selects the
// AVX-512 + AVX512-BF16 code on any CPU, SIMDe's portable intrinsics standing in for the instructions, and names
// its ops `dcpctl_avx512_emulated::` so that it loads beside the engine's build.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(DCPCTL_EMULATE_AVX512_BF16)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define DCPCTL_AVX512
#define DCPCTL_AVX512_BF16
#define DCPCTL_OPS dcpctl_avx512_emulated
#else
#if defined(__AVX512F__)
#define DCPCTL_AVX512
#if defined(__AVX512BF16__)
#define DCPCTL_AVX512_BF16
#endif
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#define DCPCTL_OPS dcpctl
#endif

namespace {

// One vector register of fp32 lanes, as wide as this build's ISA has (GCC vector types: the intrinsics'
// __m512 / __m256 are such types too, so lanes can be indexed).
#if defined(DCPCTL_AVX512)
constexpr int64_t kLanes = 16;
using vfloat = __m512;
inline vfloat vfma(vfloat a, vfloat b, vfloat acc) { return _mm512_fmadd_ps(a, b, acc); }
inline vfloat vsplat(float s) { return _mm512_set1_ps(s); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using vfloat = __m256;
inline vfloat vfma(vfloat a, vfloat b, vfloat acc) { return _mm256_fmadd_ps(a, b, acc); }
inline vfloat vsplat(float s) { return _mm256_set1_ps(s); }
#else
constexpr int64_t kLanes = 4;  // portable build: SSE2 on x86-64, NEON on arm64; no fused multiply-add
typedef float vfloat __attribute__((vector_size(16)));
inline vfloat vfma(vfloat a, vfloat b, vfloat acc) { return a * b + acc; }
inline vfloat vsplat(float s) { return vfloat{s, s, s, s}; }
#endif
typedef uint16_t vbf16 __attribute__((vector_size(kLanes * 2)));
typedef uint32_t vbits __attribute__((vector_size(kLanes * 4)));

constexpr int64_t kPanel = 2 * kLanes;  // output columns per panel: two vectors
// x rows per register block: IB rows x 2 vectors of accumulators, plus 2 weight vectors and a broadcast,
// must fit the 32 (AVX-512) or 16 (AVX2, SSE) vector registers
constexpr int64_t kBlockRows = kLanes == 16 ? 12 : 6;
constexpr int64_t kChunkBytes = 256 * 1024;  // x rows per pass over a thread's panels: they stay in L2
constexpr int64_t kInlineElements = 1 << 15;  // below this many x elements, regrouping x is not worth threads

inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

inline float to_fp32(float v) { return v; }
inline float to_fp32(uint16_t bits) { return bf16_to_float(bits); }

#if defined(DCPCTL_AVX512_BF16)
constexpr bool kBf16Pairs = true;
#else
constexpr bool kBf16Pairs = false;
#endif
// A bf16 pair (k values 2s and 2s + 1, the first in the low half) as the dot-product path's weights and x hold them
using bf16_pair = uint32_t;

// fp32 -> fp32, or -> bf16 bits rounded to nearest even as c10::BFloat16 rounds (NaN -> 0x7FC0)
template <typename Out>
inline Out from_fp32(float v) {
  if constexpr (std::is_same_v<Out, float>) {
    return v;
  } else {
    return c10::BFloat16(v).x;
  }
}

inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

inline void vstore(uint16_t* p, vfloat v) {
  vbits bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vbits nan = (vbits)(v != v);
  const vbits rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const vbf16 h = __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), vbf16);
  std::memcpy(p, &h, sizeof(h));
}

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One panel row's two vectors of weights as fp32: columns [0, kLanes) and [kLanes, kPanel).
inline void vload_row(const float* p, vfloat& lo, vfloat& hi) {
  lo = vload(p);
  hi = vload(p + kLanes);
}

// A bf16 row is interleaved (pack_panels): 32-bit lane j holds column j in its low half and column j + kLanes in its
// high half. bf16 -> fp32 is the bits moved into the upper half: a shift for the low column, a mask for the high.
inline void vload_row(const uint16_t* p, vfloat& lo, vfloat& hi) {
  vbits bits;
  std::memcpy(&bits, p, sizeof(bits));
  const vbits low = bits << 16, high = bits & 0xFFFF0000u;
  std::memcpy(&lo, &low, sizeof(lo));
  std::memcpy(&hi, &high, sizeof(hi));
}

// A panel of the dtype is [steps, width] elements: k rows of kPanel columns, or for bf16 pairs ceil(k / 2) rows of
// kPanel pairs (an odd k padded with a zero).
inline bool pairs_of(at::ScalarType dtype) { return kBf16Pairs && dtype == at::kBFloat16; }
inline int64_t panel_steps(at::ScalarType dtype, int64_t k) { return pairs_of(dtype) ? (k + 1) / 2 : k; }
inline int64_t panel_width(at::ScalarType dtype) { return pairs_of(dtype) ? 2 * kPanel : kPanel; }

// Where w[c][i] (column c of a panel, k index i) sits in it: in order for fp32, interleaved as vload_row reads it for
// bf16, or in the (i, i + 1) pair of column c for bf16 pairs.
inline int64_t panel_slot(int64_t i, int64_t c, at::ScalarType dtype) {
  if (dtype == at::kFloat) return i * kPanel + c;
  if (pairs_of(dtype)) return (i / 2) * 2 * kPanel + 2 * c + i % 2;
  return i * kPanel + (c < kLanes ? 2 * c : 2 * (c - kLanes) + 1);
}

inline float dot(const float* row, const float* x, int64_t k) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < k; ++i) acc += row[i] * x[i];
  return acc;
}

inline float dot(const uint16_t* row, const float* x, int64_t k) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < k; ++i) acc += bf16_to_float(row[i]) * x[i];
  return acc;
}

// Weight rows per task: a few KB of w each, so both threads stream from the start.
constexpr int64_t kGrainRows = 16;

// x as fp32 [m, k] (a bf16 x is widened once; an fp32 x is used in place)
const float* fp32_rows(const at::Tensor& x, std::vector<float>& widened) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  widened.resize(x.numel());
  const auto* bits = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) widened[i] = bf16_to_float(bits[i]);
  return widened.data();
}

// bias as fp32 [n], or nullptr
const float* fp32_bias(const std::optional<at::Tensor>& bias, int64_t n, at::ScalarType dtype, std::vector<float>& out) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->numel() == n && bias->scalar_type() == dtype, "dcpctl linear: bias [n] of the weight's dtype expected");
  const at::Tensor b = bias->contiguous();
  out.resize(n);
  if (dtype == at::kFloat) {
    std::memcpy(out.data(), b.data_ptr<float>(), n * sizeof(float));
  } else {
    const auto* bits = reinterpret_cast<const uint16_t*>(b.data_ptr());
    for (int64_t j = 0; j < n; ++j) out[j] = bf16_to_float(bits[j]);
  }
  return out.data();
}

void check_weight(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), op, ": x and w must share a dtype");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 expected");
  TORCH_CHECK(w.is_contiguous(), op, ": w must be contiguous");
}

template <typename W, typename Out>
void gemv_rows(const W* w, const float* x, const float* bias, int64_t m, int64_t n, int64_t k, Out* y) {
  at::parallel_for(0, n, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const W* row = w + j * k;
      const float b = bias ? bias[j] : 0.f;
      for (int64_t i = 0; i < m; ++i) y[i * n + j] = from_fp32<Out>(dot(row, x + i * k, k) + b);
    }
  });
}

#if defined(DCPCTL_AVX512_BF16)
inline __m512bh as_bf16_pairs(__m512i v) {
  __m512bh pairs;
  std::memcpy(&pairs, &v, sizeof(pairs));
  return pairs;
}

inline float lane_sum(__m512 v) {
#if defined(DCPCTL_EMULATE_AVX512_BF16)  // SIMDe has no _mm512_reduce_add_ps
  float lanes[kLanes], sum = 0.f;
  std::memcpy(lanes, &v, sizeof(lanes));
  for (float lane : lanes) sum += lane;
  return sum;
#else
  return _mm512_reduce_add_ps(v);
#endif
}

// The bf16 GEMV on x's and w's own bits: vdpbf16ps does 32 k steps of a row per instruction (exact products, fp32
// sums), where the widening loop above spends three instructions per 16 weights before its FMA and read the weights
// at ~60% of what oneDNN's packed path reaches at one row. One weight row at a time, in memory order: consecutive
// rows' dot products are independent, so the core overlaps them, and the weights stream as one sequence. Four rows
// interleaved (four streams of 1-3 KB rows) read SmolLM2's 121 weights at ~20 GB/s on a Zen 4, one row at a time at
// ~26-29 (benchmarks/gemv_roofline.py; docs/results/cpu-kernels.md), with the same sums in the same order.
void gemv_rows_bf16_dot(const uint16_t* w, const uint16_t* x, const float* bias, int64_t m, int64_t n, int64_t k,
                        uint16_t* y) {
  constexpr int64_t kStep = 2 * kLanes;  // the k values of one register of bf16 pairs
  const int64_t body = k / kStep * kStep;
  auto load = [](const uint16_t* p) { return as_bf16_pairs(_mm512_loadu_si512(p)); };
  auto load_tail = [&](const uint16_t* p) {  // the last k % kStep values, zero-padded
    uint16_t padded[kStep] = {};
    std::memcpy(padded, p, (k - body) * sizeof(uint16_t));
    return load(padded);
  };
  std::vector<__m512bh> x_tails;  // each x row's tail, padded once rather than once per weight row
  if (body < k)
    for (int64_t i = 0; i < m; ++i) x_tails.push_back(load_tail(x + i * k + body));
  at::parallel_for(0, n, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint16_t* row = w + j * k;
      for (int64_t i = 0; i < m; ++i) {
        const uint16_t* xi = x + i * k;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < body; c += kStep) acc = _mm512_dpbf16_ps(acc, load(row + c), load(xi + c));
        if (body < k) acc = _mm512_dpbf16_ps(acc, load_tail(row + body), x_tails[i]);
        y[i * n + j] = from_fp32<uint16_t>(lane_sum(acc) + (bias ? bias[j] : 0.f));
      }
    }
  });
}
#endif

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [m, k] and w [n, k] expected");
  check_weight(x, w, "gemv");
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  const at::Tensor xc = x.contiguous();
  std::vector<float> xf, bf;
  const float* bs = fp32_bias(bias, n, w.scalar_type(), bf);
  at::Tensor out = at::empty({m, n}, x.options());
#if defined(DCPCTL_AVX512_BF16)
  if (w.scalar_type() == at::kBFloat16) {
    gemv_rows_bf16_dot(reinterpret_cast<const uint16_t*>(w.data_ptr()), reinterpret_cast<const uint16_t*>(xc.data_ptr()),
                       bs, m, n, k, reinterpret_cast<uint16_t*>(out.data_ptr()));
    return out;
  }
#endif
  const float* xs = fp32_rows(xc, xf);
  if (w.scalar_type() == at::kFloat) {
    gemv_rows(w.data_ptr<float>(), xs, bs, m, n, k, out.data_ptr<float>());
  } else {
    gemv_rows(reinterpret_cast<const uint16_t*>(w.data_ptr()), xs, bs, m, n, k,
              reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack_panels: a [n, k] weight expected");
  check_weight(w, w, "pack_panels");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  const at::ScalarType dtype = w.scalar_type();
  const int64_t steps = panel_steps(dtype, k), width = panel_width(dtype);
  at::Tensor out = at::zeros({panels, steps, width}, w.options());
  const int64_t size = w.element_size();
  const auto* src = static_cast<const char*>(w.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < std::min(kPanel, n - p * kPanel); ++c)
        for (int64_t i = 0; i < k; ++i)
          std::memcpy(dst + (p * steps * width + panel_slot(i, c, dtype)) * size,
                      src + ((p * kPanel + c) * k + i) * size, size);
  });
  return out;
}

// x's rows split into register blocks of at most kBlockRows, as even as possible (16 rows: 8 + 8, not 12 + 4)
struct RowBlocks {
  int64_t count, base, extra;
  explicit RowBlocks(int64_t m) : count((m + kBlockRows - 1) / kBlockRows), base(m / count), extra(m % count) {}
  int64_t first(int64_t b) const { return b * base + std::min(b, extra); }
  int64_t rows(int64_t b) const { return base + (b < extra ? 1 : 0); }
};

// Step p of an x row [k] as the micro-kernel takes it: fp32 (a bf16 x widened), or the bf16 pair (2p, 2p + 1)
template <typename X, typename Src>
inline X x_step(const Src* row, int64_t p, int64_t k) {
  if constexpr (std::is_same_v<X, float>) {
    return to_fp32(row[p]);
  } else {
    return bf16_pair(row[2 * p]) | (2 * p + 1 < k ? bf16_pair(row[2 * p + 1]) << 16 : 0u);
  }
}

// x regrouped per register block: block b holds its rows as [steps][rows] at row first(b), so that the
// micro-kernel's broadcasts read one contiguous stream (x_step: widened or paired on the way).
template <typename X, typename Src>
std::vector<X> pack_row_blocks(const Src* x, const RowBlocks& blocks, int64_t k, int64_t steps) {
  std::vector<X> out(blocks.first(blocks.count) * steps);
  const int64_t grain = std::max<int64_t>(1, kInlineElements / (kBlockRows * k));  // decode-sized x: no threads
  at::parallel_for(0, blocks.count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = blocks.first(b), rows = blocks.rows(b);
      X* block = out.data() + first * steps;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t p = 0; p < steps; ++p) block[p * rows + i] = x_step<X>(x + (first + i) * k, p, k);
    }
  });
  return out;
}

// Software prefetch of the panel a thread computes next, spread over the k steps of the current one: the current
// panel's later blocks of rows read it from L2, and without this the memory would idle meanwhile (a 16-row decode
// GEMM is as much memory- as FMA-bound). Step p asks for the two cache lines from `base + p * step` into L2.
struct Prefetch {
  const char* base;
  int64_t step;
  inline void touch(int64_t p) const {
    __builtin_prefetch(base + p * step, 0, 2);  // locality 2: prefetcht1, into L2
    __builtin_prefetch(base + p * step + step / 2, 0, 2);
  }
};

// One step of IB rows against a panel row: each row's x broadcast times the row's weights (widened), fp32 FMAs
template <int64_t IB, typename W>
inline void panel_step(const float* xt, const W* row, vfloat* lo, vfloat* hi) {
  vfloat w0, w1;
  vload_row(row, w0, w1);
  for (int64_t i = 0; i < IB; ++i) {
    const vfloat xi = vsplat(xt[i]);
    lo[i] = vfma(xi, w0, lo[i]);
    hi[i] = vfma(xi, w1, hi[i]);
  }
}

#if defined(DCPCTL_AVX512_BF16)
// Two k steps of IB rows: each row's x pair broadcast to every lane, dotted with each column's weight pair
template <int64_t IB>
inline void panel_step(const bf16_pair* xt, const bf16_pair* row, vfloat* lo, vfloat* hi) {
  const __m512bh w0 = as_bf16_pairs(_mm512_loadu_si512(row)), w1 = as_bf16_pairs(_mm512_loadu_si512(row + kLanes));
  for (int64_t i = 0; i < IB; ++i) {
    const __m512bh xi = as_bf16_pairs(_mm512_set1_epi32(int32_t(xt[i])));
    lo[i] = _mm512_dpbf16_ps(lo[i], xi, w0);
    hi[i] = _mm512_dpbf16_ps(hi[i], xi, w1);
  }
}
#endif

// IB rows of x ([steps][IB] from pack_row_blocks) times one panel [steps, kPanel] into y (row stride ldy) at the
// panel's first column; `cols` of its columns are real (the last panel's are fewer), bias (fp32) starts at that column
template <int64_t IB, typename X, typename W, typename Out>
inline void panel_block(const X* xt, int64_t steps, const W* panel, const float* bias, Out* y, int64_t ldy,
                        int64_t cols, const Prefetch& next) {
  vfloat lo[IB], hi[IB];
  for (int64_t i = 0; i < IB; ++i) lo[i] = hi[i] = vfloat{};
  for (int64_t p = 0; p < steps; ++p, panel += kPanel, xt += IB) {
    next.touch(p);
    panel_step<IB>(xt, panel, lo, hi);
  }
  for (int64_t i = 0; i < IB; ++i, y += ldy) {
    if (cols == kPanel) {
      vstore(y, bias ? lo[i] + vload(bias) : lo[i]);
      vstore(y + kLanes, bias ? hi[i] + vload(bias + kLanes) : hi[i]);
    } else {
      for (int64_t c = 0; c < cols; ++c)
        y[c] = from_fp32<Out>((c < kLanes ? lo[i][c] : hi[i][c - kLanes]) + (bias ? bias[c] : 0.f));
    }
  }
}

// a block's row count is only known at run time: pick its instantiation
template <typename X, typename W, typename Out, int64_t IB = kBlockRows>
inline void panel_block_of(int64_t rows, const X* xt, int64_t steps, const W* panel, const float* bias, Out* y,
                           int64_t ldy, int64_t cols, const Prefetch& next) {
  if constexpr (IB > 0) {
    if (rows == IB) return panel_block<IB>(xt, steps, panel, bias, y, ldy, cols, next);
    panel_block_of<X, W, Out, IB - 1>(rows, xt, steps, panel, bias, y, ldy, cols, next);
  }
}

// Threads split the panels; each takes x a chunk of blocks at a time (the chunk stays in L2) against its panels.
// A panel is `steps` rows of kPanel W (pack_panels), xt the blocks of pack_row_blocks.
template <typename X, typename W, typename Out>
void panel_gemm(const X* xt, const RowBlocks& blocks, const W* panels, const float* bias, int64_t n, int64_t steps,
                Out* y) {
  const int64_t count = (n + kPanel - 1) / kPanel;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (kBlockRows * steps * int64_t(sizeof(X))));
  const int64_t panel_bytes = steps * kPanel * int64_t(sizeof(W));
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = 0; b0 < blocks.count; b0 += chunk) {
      for (int64_t p = begin; p < end; ++p) {
        const W* panel = panels + p * steps * kPanel;
        const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
        const int64_t b1 = std::min(blocks.count, b0 + chunk);
        // the thread's next panel (or, after its last, the chunk's first again), fetched while this one computes
        const W* following = panels + (p + 1 < end ? p + 1 : begin) * steps * kPanel;
        const int64_t step = panel_bytes / ((b1 - b0) * steps);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t first = blocks.first(b);
          const Prefetch next{reinterpret_cast<const char*>(following) + (b - b0) * steps * step, step};
          panel_block_of(blocks.rows(b), xt + first * steps, steps, panel, bias ? bias + col : nullptr,
                         y + first * n + col, n, cols, next);
        }
      }
    }
  });
}

// n, k: the packed weight's shape (bf16 pairs of an odd k and of k + 1 have one panel shape, so x's k is checked on it)
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, int64_t k,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "panel_linear: x [m, k] expected for a [n, k] weight");
  check_weight(x, panels, "panel_linear");
  const at::ScalarType dtype = panels.scalar_type();
  const int64_t m = x.size(0), steps = panel_steps(dtype, k);
  TORCH_CHECK(panels.dim() == 3 && panels.size(0) == (n + kPanel - 1) / kPanel && panels.size(1) == steps &&
                  panels.size(2) == panel_width(dtype),
              "panel_linear: x [m, k] and panels from pack_panels of a [n, k] weight in this build expected");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const at::Tensor xc = x.contiguous();
  std::vector<float> bf;
  const float* bs = fp32_bias(bias, n, dtype, bf);
  const RowBlocks blocks(m);
  if (dtype == at::kFloat) {
    const std::vector<float> xt = pack_row_blocks<float>(xc.data_ptr<float>(), blocks, k, k);
    panel_gemm(xt.data(), blocks, panels.data_ptr<float>(), bs, n, k, out.data_ptr<float>());
    return out;
  }
  const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  auto* yb = reinterpret_cast<uint16_t*>(out.data_ptr());
#if defined(DCPCTL_AVX512_BF16)
  const std::vector<bf16_pair> xt = pack_row_blocks<bf16_pair>(xb, blocks, k, steps);
  panel_gemm(xt.data(), blocks, reinterpret_cast<const bf16_pair*>(panels.data_ptr()), bs, n, steps, yb);
#else
  const std::vector<float> xt = pack_row_blocks<float>(xb, blocks, k, k);
  panel_gemm(xt.data(), blocks, reinterpret_cast<const uint16_t*>(panels.data_ptr()), bs, n, k, yb);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(DCPCTL_OPS, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("pack_panels(Tensor w) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int n, int k, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(DCPCTL_OPS, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}
