// Collectives between the CPU ranks of one node through a shared-memory segment, as torch ops under
// `dcpctl_shm::` (engine/shm_comm.py creates the segments and calls these).
//
// One segment per process group, mapped by every rank of the group:
//   header (4 KiB): magic, group size, slot bytes, timeout
//   one 128-byte line per rank: `seq`, the number of rounds that rank has published, and its pid
//   data: per rank two buffers of `slot` bytes (round k uses buffer k % 2)
// A collective is one or more rounds. In round k a rank waits until every peer has published round k - 1
// (so nobody still reads its buffer k % 2 from round k - 2), copies its piece into that buffer, publishes
// seq = k (release), waits until every peer has published k (acquire) and reads what it needs from the
// peers' buffers. A tensor larger than a slot takes several rounds. Sums run in fp32 over the group's ranks
// in rank order, so every rank gets the same bits: for two ranks exactly gloo's sum.
// Waiting spins with a pause for a few microseconds, then sleeps on a futex on the peer's `seq` (the publisher
// wakes it when its line counts sleepers), so a waiter whose peer was descheduled gives its core away, as gloo's
// blocking receive does, instead of spinning on a machine with more runnable processes than cores. The sleep
// wakes every 50 ms to check the peer: one whose process is gone, or a wait longer than the timeout, raises (the
// message names the peer) instead of waiting forever.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <ctime>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DCPCTL_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define DCPCTL_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define DCPCTL_CPU_RELAX() ((void)0)
#endif

namespace {

constexpr uint64_t kMagic = 0x64637063746c3031ULL;  // "dcpctl01"
constexpr int64_t kHeaderBytes = 4096;
constexpr int64_t kLineBytes = 128;  // a rank's line: two cache lines, so the adjacent-line prefetch is not shared
constexpr int kMaxRanks = 64;
constexpr int kSpins = 512;  // pause-spins before sleeping (a few microseconds: a peer on its own core arrives)
constexpr auto kCheckEvery = std::chrono::milliseconds(50);  // liveness and timeout checks while waiting

struct Header {
  uint64_t magic;
  int64_t size;
  int64_t slot;
  double timeout_s;
};

struct Line {
  uint64_t seq;  // written by its rank only, read by the others; its low 32 bits are the futex word
  int64_t pid;
  int64_t global_rank;
  uint32_t sleepers;  // peers asleep on this line's futex (the publisher wakes them)
};

static_assert(sizeof(Line) <= kLineBytes, "a rank's line must fit its 128 bytes");

// The futex word of a line: the low half of `seq` (little-endian), which changes at every round.
uint32_t* futex_word(Line* line) { return reinterpret_cast<uint32_t*>(&line->seq); }

long futex(uint32_t* word, int op, uint32_t value, const timespec* timeout) {
  return ::syscall(SYS_futex, word, op, value, timeout, nullptr, 0);  // shared (not PRIVATE): across processes
}

struct Segment {
  uint8_t* base;
  int64_t size;
  int64_t slot;
  double timeout_s;
  int rank;

  Line* line(int r) const { return reinterpret_cast<Line*>(base + kHeaderBytes + r * kLineBytes); }
  uint8_t* buffer(int r, uint64_t round) const {
    return base + kHeaderBytes + size * kLineBytes + (r * 2 + static_cast<int64_t>(round & 1)) * slot;
  }
  uint64_t published(int r) const { return __atomic_load_n(&line(r)->seq, __ATOMIC_ACQUIRE); }
  // seq_cst store, then the sleeper count: a waiter either sees the new seq or is counted here (and the kernel
  // re-checks the futex word before it sleeps), so no wake-up is lost.
  void publish(uint64_t round) const {
    Line* mine = line(rank);
    __atomic_store_n(&mine->seq, round, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&mine->sleepers, __ATOMIC_SEQ_CST) != 0) futex(futex_word(mine), FUTEX_WAKE, INT_MAX, nullptr);
  }
};

int64_t segment_bytes(int64_t size, int64_t slot) { return kHeaderBytes + size * kLineBytes + size * 2 * slot; }

Segment open_segment(const at::Tensor& segment, int64_t rank) {
  TORCH_CHECK(segment.is_cpu() && segment.scalar_type() == at::kByte && segment.is_contiguous(),
              "shm collective: the segment must be a contiguous uint8 CPU tensor");
  auto* base = segment.data_ptr<uint8_t>();
  const auto* header = reinterpret_cast<const Header*>(base);
  TORCH_CHECK(header->magic == kMagic, "shm collective: not an initialised segment");
  TORCH_CHECK(rank >= 0 && rank < header->size, "shm collective: rank ", rank, " outside the group of ", header->size);
  return Segment{base, header->size, header->slot, header->timeout_s, static_cast<int>(rank)};
}

// A process that exited, or a zombie its parent has not reaped yet (torchrun reaps every half second).
bool process_gone(int64_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT || errno == ESRCH;
  char text[512];
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (n <= 0) return true;
  text[n] = '\0';
  const char* paren = std::strrchr(text, ')');  // the command name may hold spaces and parentheses
  if (paren == nullptr || paren[1] == '\0' || paren[2] == '\0') return false;
  const char state = paren[2];
  return state == 'Z' || state == 'X' || state == 'x';
}

// Wait until rank `peer` has published `round`; raise if its process is gone or the wait outlasts the timeout.
void wait_for(const Segment& s, int peer, uint64_t round) {
  if (s.published(peer) >= round) return;
  for (int i = 0; i < kSpins; ++i) {
    DCPCTL_CPU_RELAX();
    if (s.published(peer) >= round) return;
  }
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto next_check = start + kCheckEvery;
  Line* line = s.line(peer);
  const timespec check_every{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kCheckEvery).count()};
  for (;;) {
    __atomic_add_fetch(&line->sleepers, 1, __ATOMIC_SEQ_CST);
    const uint64_t seen = __atomic_load_n(&line->seq, __ATOMIC_SEQ_CST);
    if (seen < round) futex(futex_word(line), FUTEX_WAIT, static_cast<uint32_t>(seen), &check_every);
    __atomic_sub_fetch(&line->sleepers, 1, __ATOMIC_SEQ_CST);
    if (s.published(peer) >= round) return;
    const auto now = clock::now();  // woken by an earlier round, or the sleep ran out: check now and then
    if (now < next_check) continue;
    next_check = now + kCheckEvery;
    if (process_gone(line->pid)) {
      throw std::runtime_error("shared-memory peer lost: rank " + std::to_string(line->global_rank) + " (pid " +
                               std::to_string(line->pid) + ") exited while rank " +
                               std::to_string(s.line(s.rank)->global_rank) + " waited for it in a collective");
    }
    const double waited = std::chrono::duration<double>(now - start).count();
    if (waited > s.timeout_s) {
      throw std::runtime_error("shared-memory collective timed out: rank " +
                               std::to_string(s.line(s.rank)->global_rank) + " waited " + std::to_string(waited) +
                               " s for rank " + std::to_string(line->global_rank) + " (DCPCTL_COLLECTIVE_TIMEOUT)");
    }
  }
}

void wait_for_peers(const Segment& s, uint64_t round) {
  for (int step = 1; step < s.size; ++step) wait_for(s, (s.rank + step) % s.size, round);
}

// One round: wait for the buffer, `fill` it, publish, then (unless `consume` is null) wait for every peer and
// `consume` their buffers.
template <typename Fill, typename Consume>
void run_round(const Segment& s, Fill&& fill, Consume&& consume, bool reads) {
  const uint64_t round = s.line(s.rank)->seq + 1;
  wait_for_peers(s, round - 1);
  fill(s.buffer(s.rank, round));
  s.publish(round);
  if (!reads) return;
  wait_for_peers(s, round);
  consume(round);
}

template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);
}

// out[i] = sum over ranks r (in rank order, fp32) of the elements at byte `offset` of rank r's buffer.
template <typename T>
void sum_buffers(const Segment& s, uint64_t round, int64_t offset, int64_t count, T* out) {
  constexpr int64_t kTile = 512;
  float acc[kTile];
  std::vector<const T*> src(s.size);
  for (int r = 0; r < s.size; ++r) src[r] = reinterpret_cast<const T*>(s.buffer(r, round) + offset);
  for (int64_t start = 0; start < count; start += kTile) {
    const int64_t n = std::min(kTile, count - start);
    const T* first = src[0] + start;
    for (int64_t i = 0; i < n; ++i) acc[i] = widen(first[i]);
    for (int r = 1; r < s.size; ++r) {
      const T* other = src[r] + start;
      for (int64_t i = 0; i < n; ++i) acc[i] += widen(other[i]);
    }
    for (int64_t i = 0; i < n; ++i) out[start + i] = static_cast<T>(acc[i]);
  }
}

template <typename F>
void on_float_dtype(const at::Tensor& x, const char* name, F&& body) {
  switch (x.scalar_type()) {
    case at::kFloat: return body(float{});
    case at::kBFloat16: return body(c10::BFloat16{});
    case at::kHalf: return body(c10::Half{});
    default: TORCH_CHECK(false, name, ": float32, bfloat16 or float16 expected, got ", x.scalar_type());
  }
}

// Rounds over a tensor taken whole: each round moves `chunk` bytes of it.
template <typename Body>
void whole_rounds(const Segment& s, int64_t bytes, int64_t align, Body&& body) {
  const int64_t chunk = s.slot / align * align;
  for (int64_t offset = 0; offset < bytes; offset += chunk) body(offset, std::min(chunk, bytes - offset));
}

// Rounds over a tensor of `size` equal parts, one per rank: each round moves the same byte range of every part.
template <typename Body>
void part_rounds(const Segment& s, int64_t part_bytes, int64_t align, Body&& body) {
  const int64_t chunk = std::max<int64_t>(align, s.slot / s.size / align * align);
  for (int64_t offset = 0; offset < part_bytes; offset += chunk) body(offset, std::min(chunk, part_bytes - offset));
}

void check_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cpu() && x.is_contiguous(), name, ": a contiguous CPU tensor expected");
}

}  // namespace

// The group's first rank writes the header before any rank attaches; every rank then records its pid and rank.
void shm_init(at::Tensor segment, int64_t size, int64_t slot, double timeout_s) {
  TORCH_CHECK(size >= 1 && size <= kMaxRanks, "shm collective: group size ", size, " outside 1..", kMaxRanks);
  TORCH_CHECK(slot >= 64 && slot % 64 == 0, "shm collective: slot bytes must be a positive multiple of 64");
  TORCH_CHECK(segment.numel() >= segment_bytes(size, slot), "shm collective: segment too small");
  auto* header = reinterpret_cast<Header*>(segment.data_ptr<uint8_t>());
  header->size = size;
  header->slot = slot;
  header->timeout_s = timeout_s;
  __atomic_store_n(&header->magic, kMagic, __ATOMIC_RELEASE);
}

void shm_attach(at::Tensor segment, int64_t rank, int64_t global_rank) {
  const Segment s = open_segment(segment, rank);
  Line* line = s.line(s.rank);
  line->pid = ::getpid();
  line->global_rank = global_rank;
  __atomic_store_n(&line->seq, 0, __ATOMIC_RELEASE);
}

int64_t shm_segment_bytes(int64_t size, int64_t slot) { return segment_bytes(size, slot); }

// The pids of the group's ranks whose processes this one cannot see (another pid namespace) or that are gone.
std::vector<int64_t> shm_unseen_peers(at::Tensor segment, int64_t rank) {
  const Segment s = open_segment(segment, rank);
  std::vector<int64_t> unseen;
  for (int r = 0; r < s.size; ++r) {
    if (r != s.rank && process_gone(s.line(r)->pid)) unseen.push_back(s.line(r)->pid);
  }
  return unseen;
}

void shm_all_reduce(at::Tensor segment, int64_t rank, at::Tensor x) {
  check_input(x, "shm all_reduce");
  const Segment s = open_segment(segment, rank);
  on_float_dtype(x, "shm all_reduce", [&](auto tag) {
    using T = decltype(tag);
    auto* data = reinterpret_cast<uint8_t*>(x.data_ptr<T>());
    whole_rounds(s, x.nbytes(), sizeof(T), [&](int64_t offset, int64_t bytes) {
      run_round(
          s, [&](uint8_t* mine) { std::memcpy(mine, data + offset, bytes); },
          [&](uint64_t round) { sum_buffers<T>(s, round, 0, bytes / sizeof(T), reinterpret_cast<T*>(data + offset)); },
          true);
    });
  });
}

at::Tensor shm_all_gather(at::Tensor segment, int64_t rank, at::Tensor x) {
  check_input(x, "shm all_gather");
  const Segment s = open_segment(segment, rank);
  std::vector<int64_t> shape = x.sizes().vec();
  TORCH_CHECK(!shape.empty(), "shm all_gather: a tensor with at least one dimension expected");
  shape[0] *= s.size;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t bytes = x.nbytes();
  const auto* src = static_cast<const uint8_t*>(x.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  whole_rounds(s, bytes, x.element_size(), [&](int64_t offset, int64_t n) {
    run_round(
        s, [&](uint8_t* mine) { std::memcpy(mine, src + offset, n); },
        [&](uint64_t round) {
          for (int r = 0; r < s.size; ++r) std::memcpy(dst + r * bytes + offset, s.buffer(r, round), n);
        },
        true);
  });
  return out;
}

// x [size * m, ...]: the sum over ranks of part `rank` (rows rank*m .. rank*m + m - 1).
at::Tensor shm_reduce_scatter(at::Tensor segment, int64_t rank, at::Tensor x) {
  check_input(x, "shm reduce_scatter");
  const Segment s = open_segment(segment, rank);
  std::vector<int64_t> shape = x.sizes().vec();
  TORCH_CHECK(!shape.empty() && shape[0] % s.size == 0, "shm reduce_scatter: dim 0 must divide by the group size");
  shape[0] /= s.size;
  at::Tensor out = at::empty(shape, x.options());
  on_float_dtype(x, "shm reduce_scatter", [&](auto tag) {
    using T = decltype(tag);
    const int64_t part = out.nbytes();
    const auto* src = reinterpret_cast<const uint8_t*>(x.data_ptr<T>());
    auto* dst = reinterpret_cast<uint8_t*>(out.data_ptr<T>());
    part_rounds(s, part, sizeof(T), [&](int64_t offset, int64_t n) {
      run_round(
          s,
          [&](uint8_t* mine) {
            for (int p = 0; p < s.size; ++p) std::memcpy(mine + p * n, src + p * part + offset, n);
          },
          [&](uint64_t round) { sum_buffers<T>(s, round, s.rank * n, n / sizeof(T), reinterpret_cast<T*>(dst + offset)); },
          true);
    });
  });
  return out;
}

// torch.distributed.all_to_all_single with equal splits: part j of x goes to rank j; part j of the output came
// from rank j.
at::Tensor shm_all_to_all(at::Tensor segment, int64_t rank, at::Tensor x) {
  check_input(x, "shm all_to_all");
  const Segment s = open_segment(segment, rank);
  TORCH_CHECK(x.dim() >= 1 && x.size(0) % s.size == 0, "shm all_to_all: dim 0 must divide by the group size");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t part = x.nbytes() / s.size;
  const auto* src = static_cast<const uint8_t*>(x.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  part_rounds(s, part, x.element_size(), [&](int64_t offset, int64_t n) {
    run_round(
        s,
        [&](uint8_t* mine) {
          for (int p = 0; p < s.size; ++p) std::memcpy(mine + p * n, src + p * part + offset, n);
        },
        [&](uint64_t round) {
          for (int r = 0; r < s.size; ++r) std::memcpy(dst + r * part + offset, s.buffer(r, round) + s.rank * n, n);
        },
        true);
  });
  return out;
}

// Every rank's x stacked on the group's first rank ([size, *x.shape]); an empty tensor on the others.
at::Tensor shm_gather_to_first(at::Tensor segment, int64_t rank, at::Tensor x) {
  check_input(x, "shm gather");
  const Segment s = open_segment(segment, rank);
  const bool first = s.rank == 0;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.insert(shape.begin(), first ? s.size : 0);
  at::Tensor out = at::empty(shape, x.options());
  const int64_t bytes = x.nbytes();
  const auto* src = static_cast<const uint8_t*>(x.data_ptr());
  auto* dst = first ? static_cast<uint8_t*>(out.data_ptr()) : nullptr;
  whole_rounds(s, bytes, x.element_size(), [&](int64_t offset, int64_t n) {
    run_round(
        s, [&](uint8_t* mine) { std::memcpy(mine, src + offset, n); },
        [&](uint64_t round) {
          for (int r = 0; r < s.size; ++r) std::memcpy(dst + r * bytes + offset, s.buffer(r, round), n);
        },
        first);
  });
  return out;
}

TORCH_LIBRARY(dcpctl_shm, m) {
  m.def("init(Tensor(a!) segment, int size, int slot, float timeout_s) -> ()");
  m.def("attach(Tensor(a!) segment, int rank, int global_rank) -> ()");
  m.def("segment_bytes(int size, int slot) -> int", &shm_segment_bytes);
  m.def("unseen_peers(Tensor segment, int rank) -> int[]");
  m.def("all_reduce(Tensor(a!) segment, int rank, Tensor(b!) x) -> ()");
  m.def("all_gather(Tensor(a!) segment, int rank, Tensor x) -> Tensor");
  m.def("reduce_scatter(Tensor(a!) segment, int rank, Tensor x) -> Tensor");
  m.def("all_to_all(Tensor(a!) segment, int rank, Tensor x) -> Tensor");
  m.def("gather_to_first(Tensor(a!) segment, int rank, Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(dcpctl_shm, CPU, m) {
  m.impl("init", &shm_init);
  m.impl("attach", &shm_attach);
  m.impl("unseen_peers", &shm_unseen_peers);
  m.impl("all_reduce", &shm_all_reduce);
  m.impl("all_gather", &shm_all_gather);
  m.impl("reduce_scatter", &shm_reduce_scatter);
  m.impl("all_to_all", &shm_all_to_all);
  m.impl("gather_to_first", &shm_gather_to_first);
}
