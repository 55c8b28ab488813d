// The DCIR runtime: collectives, waits, buffer release and the parameter-shard store,
// registered as torch.ops.dcir.* (TORCH_LIBRARY) over a c10d ProcessGroup resolved by
// name, so the same code runs gloo on CPU and NCCL on GPU.
//
// A collective start returns its result tensors at once, allocated and in their final
// shape, and records the unfinished work under them (the "pending" values of the IR).
// dcir::wait(t) finishes the work of t: it waits for the transfer (with the runtime's
// timeout), then runs the work's epilogue (copy-out of a coalesced gather, the 1/N of an
// average) exactly once, whichever of the results is waited on first.
//
// Shard layout (the IR's shard<T, N>): T flattened, zero-padded to a multiple of N,
// rank r holding elements [r * chunk, (r + 1) * chunk), chunk = ceil(numel / N): the
// rule of the Python side's dcir.layout.ShardLayout, written here only in chunk_of.
//
// With CUDA (DCIR_WITH_CUDA), every collective runs on a dedicated communication stream
// that first waits, through an event, for the work already queued on the compute stream;
// dcir::wait makes the compute stream wait for the communication stream in turn, so
// compute never blocks the host and overlaps the transfers.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#ifdef DCIR_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dcir {
namespace {

using c10::intrusive_ptr;
using c10d::ProcessGroup;
using c10d::Work;

// ---- accounting -------------------------------------------------------------------------

struct Stats {
  int64_t gathered_bytes = 0;       // live buffers allocated by all_gather, not yet freed
  int64_t peak_gathered_bytes = 0;
  int64_t freed_bytes = 0;          // released by dcir::free
  int64_t collectives = 0;
  int64_t sent_bytes = 0;           // payload handed to the process group
  int64_t wait_ns = 0;              // host time blocked in dcir::wait
  int64_t shm_fallbacks = 0;        // collectives that did not fit the shared-memory outbox (sent over the group)
};

std::mutex mu;
Stats stats;
// group name -> [collectives started, payload bytes handed to it]: what each group of a mesh carried
std::map<std::string, std::array<int64_t, 2>> per_group;
// storage -> bytes, for gathered buffers (weak: a buffer dropped without free leaves no trace)
std::unordered_map<c10::StorageImpl*, std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, int64_t>> gathered;
std::chrono::milliseconds timeout{300000};

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

void prune_locked() {
  for (auto it = gathered.begin(); it != gathered.end();) {
    if (it->second.first.expired()) {
      stats.gathered_bytes -= it->second.second;
      it = gathered.erase(it);
    } else {
      ++it;
    }
  }
}

void track_gathered(const at::Tensor& buffer) {
  auto* impl = buffer.storage().unsafeGetStorageImpl();
  int64_t bytes = static_cast<int64_t>(buffer.storage().nbytes());
  std::lock_guard<std::mutex> g(mu);
  // buffers dropped without mem.free (a gathered copy released at its last use, as the
  // recompute pass's gathers are) are gone before this one is counted: the peak is of
  // the live ones
  prune_locked();
  auto it = gathered.find(impl);
  if (it != gathered.end()) return;  // tracked already (a dropped one at this address was pruned above)
  gathered.emplace(impl, std::make_pair(buffer.storage().getWeakStorageImpl(), bytes));
  stats.gathered_bytes += bytes;
  stats.peak_gathered_bytes = std::max(stats.peak_gathered_bytes, stats.gathered_bytes);
}

// ---- pending work -----------------------------------------------------------------------

struct Pending {
  intrusive_ptr<Work> work;
  std::function<void()> epilogue;  // runs once, after the transfer
  std::string what;                // for error messages: "all_gather of %w"
  std::string group_name;
  bool done = false;
};

// result tensor -> its pending work; the tensor is held so its address is not reused
std::unordered_map<c10::TensorImpl*, std::pair<at::Tensor, std::shared_ptr<Pending>>> pending;

intrusive_ptr<ProcessGroup> group(const std::string& name) { return c10d::resolve_process_group(name); }

// ---- c10d calls, by their current names -------------------------------------------------
//
// torch 2.13 renamed the single-buffer collectives (all_gather_single,
// reduce_scatter_single, all_to_all_single) and deprecated the old names. The
// runtime calls the current name whenever the installed torch has it; only a torch
// without it (2.12 and older, where the old name is the current API) gets the old
// one. `if constexpr` on a dependent type keeps the branch not taken from being
// compiled, so no build ever sees a deprecated call.

template <typename PG, typename = void>
struct has_single_collectives : std::false_type {};
template <typename PG>
struct has_single_collectives<PG, std::void_t<decltype(&PG::all_gather_single), decltype(&PG::reduce_scatter_single),
                                             decltype(&PG::all_to_all_single)>> : std::true_type {};

template <typename PG>
intrusive_ptr<Work> reduce_scatter_into(PG& pg, at::Tensor& received, at::Tensor& send,
                                        const c10d::ReduceScatterOptions& opts) {
  if constexpr (has_single_collectives<PG>::value) {
    return pg.reduce_scatter_single(received, send, opts);
  } else {
    return pg._reduce_scatter_base(received, send, opts);
  }
}

template <typename PG>
intrusive_ptr<Work> all_to_all_into(PG& pg, at::Tensor& received, at::Tensor& send, const c10d::AllToAllOptions& opts) {
  std::vector<int64_t> even;  // empty split sizes: equal parts
  if constexpr (has_single_collectives<PG>::value) {
    return pg.all_to_all_single(received, send, even, even, opts);
  } else {
    return pg.alltoall_base(received, send, even, even, opts);
  }
}

// What a rank sends to gather its `parts` (side by side, flat) over the process group
// (`gather_into`): on a GPU the parts once, elsewhere once per rank; one copy either way,
// none for a single part on a GPU.
at::Tensor gather_send(at::TensorList parts, int64_t world) {
  int64_t copies = parts[0].is_cuda() ? 1 : world;
  if (parts.size() == 1) return copies == 1 ? parts[0] : parts[0].repeat({copies});
  std::vector<at::Tensor> all;
  for (int64_t r = 0; r < copies; ++r) all.insert(all.end(), parts.begin(), parts.end());
  return at::cat(all);
}

// Gathers every rank's shard into `buffer` from `send` (`gather_send`). On a GPU it is the
// group's all_gather. Elsewhere it is an all-to-all that writes straight into `buffer`:
// gloo's all_gather receives into a buffer of its own, which its worker thread allocates
// and then copies out, and glibc keeps that thread's heap apart from the rank's, so each
// gather's size stayed resident once more.
template <typename PG>
intrusive_ptr<Work> gather_into(PG& pg, at::Tensor& buffer, at::Tensor& send) {
  if (!send.is_cuda()) {
    c10d::AllToAllOptions opts;
    opts.timeout = timeout;
    return all_to_all_into(pg, buffer, send, opts);
  }
  if constexpr (has_single_collectives<PG>::value) {
    return pg.all_gather_single(buffer, send);
  } else {
    return pg._allgather_base(buffer, send);
  }
}

[[noreturn]] void fail(const std::string& what, const std::string& group_name, const std::string& why) {
  TORCH_CHECK(false, "dcir runtime: ", what, " (process group '", group_name, "') failed: ", why);
}

#ifdef DCIR_WITH_CUDA
// one communication stream per device, taken from the pool once
c10::cuda::CUDAStream comm_stream(c10::DeviceIndex device) {
  static std::unordered_map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> g(mu);
  auto it = streams.find(device);
  if (it == streams.end()) {
    it = streams.emplace(device, c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)).first;
  }
  return it->second;
}
#endif

// Runs `launch` (which starts the collective) on the communication stream when the
// tensors are on a GPU; registers the pending work under every result.
void start(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& results,
           const std::function<intrusive_ptr<Work>()>& launch, std::function<void()> epilogue,
           std::string what, const std::string& group_name) {
  auto p = std::make_shared<Pending>();
  p->what = std::move(what);
  p->group_name = group_name;
  p->epilogue = std::move(epilogue);
  try {
#ifdef DCIR_WITH_CUDA
    if (!inputs.empty() && inputs[0].is_cuda()) {
      auto device = inputs[0].device().index();
      auto compute = c10::cuda::getCurrentCUDAStream(device);
      auto comm = comm_stream(device);
      at::cuda::CUDAEvent ready;
      ready.record(compute);
      ready.block(comm);
      {
        c10::cuda::CUDAStreamGuard guard(comm);
        p->work = launch();
      }
      // the caching allocator must not reuse these blocks until the comm stream is done
      for (const auto& t : inputs) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), comm);
      for (const auto& t : results) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), comm);
    } else {
      p->work = launch();
    }
#else
    p->work = launch();
#endif
  } catch (const c10::Error& e) {
    fail(p->what, group_name, e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(p->what, group_name, e.what());
  }
  std::lock_guard<std::mutex> g(mu);
  stats.collectives += 1;
  auto& mine = per_group[group_name];
  mine[0] += 1;
  for (const auto& t : inputs) {
    stats.sent_bytes += nbytes(t);
    mine[1] += nbytes(t);
  }
  for (const auto& r : results) pending[r.unsafeGetTensorImpl()] = {r, p};
}

// Elements of each rank's flat shard: follows dcir.layout.ShardLayout.chunk (dcir/layout.py),
// the one Python statement of the layout; tests/test_layout.py checks that the two agree.
int64_t chunk_of(int64_t numel, int64_t world) { return (numel + world - 1) / world; }

// ---- shared-memory transport ------------------------------------------------------------
//
// Over gloo on one host, a transfer goes through the kernel's loopback: copied into a
// socket and out again by gloo's worker threads, on the cores the ranks compute on.
// When every rank of a group is on one host, the runtime moves the bytes of its
// gathers, reduce-scatters and all-to-alls through shared memory instead: each rank
// owns a segment (its outbox) that every rank maps. A collective's start copies this
// rank's part into its outbox and publishes the op's sequence number; its wait copies
// (or, for a reduce-scatter, sums in rank order, as the gloo path does) straight out of
// the peers' outboxes, then acknowledges. One copy in, one out, no kernel, no thread.
//
// Every rank runs the same program, so its collectives start and are waited in one
// order everywhere, and the outbox is allocated the same way on every rank: a ring, in
// start order. A region is reused only when the op that held it has been waited on
// here (so, in program order, on every rank): its start then waits for the peers'
// acknowledgements, which they give at that wait, and cannot deadlock. An op whose
// region would overlap one not yet waited on, or that is larger than the outbox, goes
// over the process group instead: the decision depends only on the program, so every
// rank takes it alike.
//
// A transfer of more than kStreamAbove bytes streams through the outbox instead, at its
// start: in parts of at most kStreamPart bytes, each copied in, published, read by every
// rank and acknowledged before the next takes the same region. Its start returns with
// the transfer done, and the next op may take that region. So the outbox needs a part,
// not the whole (the largest transfers, an embedding's gather, no longer set its size),
// at the cost of meeting the peers at the start rather than at the wait. Its parts take
// consecutive sequence numbers before any later op starts, so the peers still publish
// in order.

constexpr int64_t kAckSlots = 4096;  // acknowledgements kept per outbox, by sequence number
constexpr int64_t kAlign = 64;
constexpr int64_t kStreamAbove = 8 << 20;  // transport.STREAM_ABOVE
constexpr int64_t kStreamPart = 4 << 20;   // transport.STREAM_PART
constexpr auto kAliveEvery = std::chrono::milliseconds(5);  // how often a wait looks at its peers' processes

// A peer's process has ended: a wait on it fails now, not at the timeout.
struct PeerExited : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Whether process `pid` has ended: gone, or a zombie whose parent has not reaped it yet
// (kill(pid, 0) still succeeds on one, and a launcher may reap it seconds later, or at
// the end of the run). Without /proc, kill alone.
bool exited(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[32], line[128];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  int fd = open(path, O_RDONLY);
  if (fd < 0) return false;
  ssize_t n = read(fd, line, sizeof line - 1);
  close(fd);
  line[n > 0 ? n : 0] = '\0';
  // "pid (command) state ...": the command may hold spaces and parentheses, so the last ')'
  const char* end = std::strrchr(line, ')');
  return end != nullptr && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X');
}

struct Region {
  int64_t offset, bytes, seq;
  bool waited;
};

struct Shm {
  int64_t rank = 0, world = 0, capacity = 0, header = 0;
  std::vector<char*> base;       // each rank's outbox, mapped here
  std::vector<size_t> mapped;
  std::string own_name;          // this rank's segment, until unlinked
  int64_t seq = 0;               // ops started over shared memory
  int64_t head = 0;              // where the next region starts
  std::deque<Region> live;       // in start order, not yet acknowledged by every peer
  std::vector<pid_t> pids;       // each rank's process, to notice one that exited (0: not checked)
  std::chrono::steady_clock::time_point checked{};

  ~Shm() {
    for (size_t r = 0; r < base.size(); ++r) {
      if (base[r] != nullptr) munmap(base[r], mapped[r]);
    }
  }

  std::atomic<int64_t>& written(int64_t r) { return *reinterpret_cast<std::atomic<int64_t>*>(base[r]); }
  std::atomic<int64_t>& pid_of(int64_t r) { return *reinterpret_cast<std::atomic<int64_t>*>(base[r] + 8); }
  // A peer that exited fails the wait now, not after the timeout (gloo notices a closed
  // connection as fast); checked every kAliveEvery of waiting.
  void check_alive() {
    auto now = std::chrono::steady_clock::now();
    if (now - checked < kAliveEvery) return;
    checked = now;
    for (int64_t p = 0; p < world; ++p) {
      if (pids[p] != 0 && exited(pids[p])) {
        throw PeerExited("rank " + std::to_string(p) + " (process " + std::to_string(pids[p]) + ") has exited");
      }
    }
  }
  // the peers that have not reached what `pending(p)` says of rank p, as "rank 1" or "ranks 1, 3"
  std::string ranks_where(const std::function<bool(int64_t)>& pending) {
    std::string ranks;
    for (int64_t p = 0; p < world; ++p) {
      if (p != rank && pending(p)) ranks += (ranks.empty() ? "" : ", ") + std::to_string(p);
    }
    return (ranks.find(',') == std::string::npos ? "rank " : "ranks ") + ranks;
  }
  // in `owner`'s outbox: the latest op `reader` has read from it, for op `seq`'s slot
  std::atomic<int64_t>& ack(int64_t owner, int64_t seq, int64_t reader) {
    auto* slots = reinterpret_cast<std::atomic<int64_t>*>(base[owner] + kAlign);
    return slots[(seq % kAckSlots) * world + reader];
  }
  char* data(int64_t r, int64_t offset) { return base[r] + header + offset; }

  bool acknowledged(const Region& g) {
    for (int64_t p = 0; p < world; ++p) {
      if (p != rank && ack(rank, g.seq, p).load(std::memory_order_acquire) < g.seq) return false;
    }
    return true;
  }
  void await_acknowledged(const Region& g) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::microseconds(5);
    while (!acknowledged(g)) {
      check_alive();
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "timed out after ", timeout.count() / 1000, " s: ",
                  ranks_where([&](int64_t p) { return ack(rank, g.seq, p).load(std::memory_order_acquire) < g.seq; }),
                  " has not read the shared memory this transfer reuses (a rank that crashed or runs a "
                  "different program leaves the others waiting here)");
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(200));
    }
  }
  // A region of `bytes` for the next op and its sequence number, or -1: send it over the
  // process group (see above). Waits for the peers to have read what it reuses. `parts`:
  // the sequence numbers the op takes (a stream's parts), whose acknowledgement slots
  // must not be one an op not yet waited still needs.
  std::pair<int64_t, int64_t> reserve(int64_t bytes, int64_t parts = 1) {
    bytes = (bytes + kAlign - 1) / kAlign * kAlign;
    if (bytes > capacity) return {-1, -1};
    // nothing in flight (every op waited here, so on every rank): start at the ring's
    // start, so each function of a program lays its transfers out alike (transport.py sizes it so)
    if (std::all_of(live.begin(), live.end(), [](const Region& g) { return g.waited; })) head = 0;
    int64_t offset = head + bytes > capacity ? 0 : head;
    for (const auto& g : live) {
      if (!g.waited && (overlaps(g, offset, bytes) || g.seq <= seq + parts - kAckSlots)) return {-1, -1};
    }
    head = offset + bytes;
    return {offset, take(offset, bytes)};
  }
  // The next part of a stream, in the region its first part took (`reserve`): the region
  // holds only that stream's earlier parts, waited, so it waits for the peers to have read them.
  int64_t reserve_part(int64_t offset, int64_t bytes) {
    return take(offset, (bytes + kAlign - 1) / kAlign * kAlign);
  }
  static bool overlaps(const Region& g, int64_t offset, int64_t bytes) {
    return g.offset < offset + bytes && offset < g.offset + g.bytes;
  }
  // The next sequence number, for `bytes` at `offset`, once the peers have read what it
  // reuses there (its memory, or its acknowledgement slot).
  int64_t take(int64_t offset, int64_t bytes) {
    int64_t next = seq + 1;
    for (auto it = live.begin(); it != live.end();) {
      if (overlaps(*it, offset, bytes) || it->seq <= next - kAckSlots) await_acknowledged(*it);
      it = it->waited && acknowledged(*it) ? live.erase(it) : std::next(it);
    }
    seq = next;
    live.push_back({offset, bytes, seq, false});
    return seq;
  }
  void publish(int64_t s) { written(rank).store(s, std::memory_order_release); }
  bool arrived(int64_t s) {
    for (int64_t p = 0; p < world; ++p) {
      if (written(p).load(std::memory_order_acquire) < s) return false;
    }
    return true;
  }
  void done(int64_t s) {
    for (int64_t p = 0; p < world; ++p) {
      if (p != rank) ack(p, s, rank).store(s, std::memory_order_release);
    }
    for (auto& g : live) {
      if (g.seq == s) g.waited = true;
    }
  }
};

std::unordered_map<std::string, std::shared_ptr<Shm>> transports;  // by process group name
std::unordered_map<std::string, std::shared_ptr<Shm>> staged;      // being set up

std::shared_ptr<Shm> transport_of(const std::string& group_name, const at::Tensor& t) {
  if (t.device().type() != at::kCPU) return nullptr;
  std::lock_guard<std::mutex> g(mu);
  auto it = transports.find(group_name);
  return it == transports.end() ? nullptr : it->second;
}

// A collective over shared memory: complete when every rank has published op `seq`;
// its wait runs `receive` (reading the peers' outboxes), then acknowledges.
class ShmWork : public Work {
 public:
  ShmWork(std::shared_ptr<Shm> shm, int64_t seq, std::function<void()> receive)
      : shm_(std::move(shm)), seq_(seq), receive_(std::move(receive)) {}
  bool isCompleted() override {
    if (shm_->arrived(seq_)) return true;
    shm_->check_alive();
    return false;
  }
  bool wait(std::chrono::milliseconds) override {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!isCompleted()) {
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "timed out", stalled());
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    receive_();
    std::lock_guard<std::mutex> g(mu);
    shm_->done(seq_);
    return true;
  }
  // who the wait is still waiting for: ": rank 1 has not started this transfer"
  std::string stalled() {
    return ": " + shm_->ranks_where([&](int64_t p) { return shm_->written(p).load(std::memory_order_acquire) < seq_; }) +
           " has not started this transfer";
  }

 private:
  std::shared_ptr<Shm> shm_;
  int64_t seq_;
  std::function<void()> receive_;
};

// `numel` elements of rank `r`'s outbox from byte `offset`, as a flat tensor like `like`
at::Tensor outbox(Shm& shm, int64_t r, int64_t offset, int64_t numel, const at::Tensor& like) {
  return at::from_blob(shm.data(r, offset), {numel}, like.options());
}

// Sets up this rank's outbox of `capacity` bytes as shared memory `name` + rank; false
// when the host cannot give it (dcir_runtime.transport says why).
bool shm_create(const std::string& group_name, const std::string& name, int64_t rank, int64_t world,
                int64_t capacity) {
  auto shm = std::make_shared<Shm>();
  shm->rank = rank, shm->world = world, shm->capacity = capacity;
  shm->header = (kAlign + kAckSlots * world * 8 + 4095) / 4096 * 4096;
  shm->base.assign(world, nullptr);
  shm->mapped.assign(world, 0);
  shm->own_name = name + "-" + std::to_string(rank);
  size_t size = static_cast<size_t>(shm->header + capacity);
  int fd = shm_open(shm->own_name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return false;
  // fallocate, not only ftruncate: a /dev/shm too small fails here, not with SIGBUS later
  int err = ftruncate(fd, static_cast<off_t>(size)) == 0 ? posix_fallocate(fd, 0, static_cast<off_t>(size)) : errno;
  void* p = err == 0 ? mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(shm->own_name.c_str());
    return false;
  }
  std::memset(p, 0, static_cast<size_t>(shm->header));
  shm->base[rank] = static_cast<char*>(p);
  shm->pids.assign(world, 0);
  shm->pid_of(rank).store(getpid(), std::memory_order_release);
  shm->mapped[rank] = size;
  std::lock_guard<std::mutex> g(mu);
  staged[group_name] = shm;
  return true;
}

// Maps every peer's outbox (after every rank created its own); false if one is missing
// (a peer on another host).
bool shm_attach(const std::string& group_name, const std::string& name) {
  std::shared_ptr<Shm> shm;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = staged.find(group_name);
    if (it == staged.end()) return false;
    shm = it->second;
  }
  size_t size = static_cast<size_t>(shm->header + shm->capacity);
  for (int64_t r = 0; r < shm->world; ++r) {
    if (r == shm->rank) continue;
    int fd = shm_open((name + "-" + std::to_string(r)).c_str(), O_RDWR, 0600);
    if (fd < 0) return false;
    struct stat st;
    void* p = fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == size
                  ? mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                  : MAP_FAILED;
    close(fd);
    if (p == MAP_FAILED) return false;
    shm->base[r] = static_cast<char*>(p);
    shm->mapped[r] = size;
    // a peer's process id means something here only in the same process namespace
    auto pid = static_cast<pid_t>(shm->pid_of(r).load(std::memory_order_acquire));
    shm->pids[r] = pid > 0 && kill(pid, 0) == 0 ? pid : 0;
  }
  return true;
}

// After every rank attached (or one failed): removes this rank's segment name (the
// mappings stay) and, if `use`, runs the group's gathers and reduce-scatters over it.
void shm_commit(const std::string& group_name, bool use) {
  std::lock_guard<std::mutex> g(mu);
  auto it = staged.find(group_name);
  if (it != staged.end()) {
    shm_unlink(it->second->own_name.c_str());
    if (use) transports[group_name] = it->second;
    staged.erase(it);
  }
  if (!use) transports.erase(group_name);
}

// A finished transfer (a stream's, done at its start).
class DoneWork : public Work {
 public:
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
};

// What a collective puts in each rank's outbox, as `units` of `unit_bytes` each, and how:
// `send(shm, at, lo, len)` copies this rank's units [lo, lo + len) to byte `at` of its
// outbox, `receive(shm, at, lo, len)` reads (or sums) those of every rank from theirs.
// A transfer moves them all at once, a stream a part at a time. `receive` runs after the
// start returns, so it holds what it reads and writes.
using Part = std::function<void(Shm&, int64_t at, int64_t lo, int64_t len)>;

// A region of `bytes` in the outbox (`Shm::reserve`), under the lock; one that does not
// fit is counted (its transfer runs over the process group).
std::pair<int64_t, int64_t> place(Shm& shm, int64_t bytes, int64_t parts = 1) {
  std::lock_guard<std::mutex> g(mu);
  auto placed = shm.reserve(bytes, parts);
  if (placed.second < 0) stats.shm_fallbacks += 1;
  return placed;
}

// A stream (above): every part through the region its first part takes. nullptr: that
// part does not fit, and the whole transfer runs over the process group.
intrusive_ptr<Work> stream(const std::shared_ptr<Shm>& shm, int64_t units, int64_t unit_bytes, const Part& send,
                           const Part& receive) {
  int64_t per = std::max<int64_t>(1, kStreamPart / unit_bytes);
  int64_t offset, seq;  // not a structured binding: the part's wait captures them
  std::tie(offset, seq) = place(*shm, std::min(per, units) * unit_bytes, (units + per - 1) / per);
  if (seq < 0) return nullptr;
  for (int64_t lo = 0; lo < units; lo += per) {
    int64_t len = std::min(per, units - lo);
    if (lo > 0) {
      std::lock_guard<std::mutex> g(mu);
      seq = shm->reserve_part(offset, len * unit_bytes);
    }
    send(*shm, offset, lo, len);
    shm->publish(seq);
    c10::make_intrusive<ShmWork>(shm, seq, [&] { receive(*shm, offset, lo, len); })->wait(timeout);
  }
  std::lock_guard<std::mutex> g(mu);
  shm->head = offset;  // done: the next op may take its region (transport._places_all)
  return c10::make_intrusive<DoneWork>();
}

// Starts a collective over the group's shared memory when it has one and the op fits
// (see above): reserves its region, lets `send` fill this rank's part, publishes it;
// or streams it. nullptr: run it over the process group.
intrusive_ptr<Work> try_shm(const std::string& group_name, const at::Tensor& like, int64_t units, int64_t unit_bytes,
                            const std::string& what, const Part& send, const Part& receive) {
  auto shm = transport_of(group_name, like);
  if (!shm) return nullptr;
  try {
    if (units * unit_bytes > kStreamAbove) return stream(shm, units, unit_bytes, send, receive);
    auto [offset, seq] = place(*shm, units * unit_bytes);
    if (seq < 0) return nullptr;
    send(*shm, offset, 0, units);
    shm->publish(seq);
    return c10::make_intrusive<ShmWork>(shm, seq, [shm, offset = offset, units, receive] {
      receive(*shm, offset, 0, units);
    });
  } catch (const c10::Error& e) {
    fail(what, group_name, e.what_without_backtrace());
  } catch (const PeerExited& e) {
    fail(what, group_name, e.what());
  }
}

// In writer `r`'s outbox, the slot of the chunk it sends to rank `p` (no slot for itself).
int64_t slot_of(int64_t p, int64_t r) { return p < r ? p : p - 1; }

bool shm_active(const std::string& group_name) {
  std::lock_guard<std::mutex> g(mu);
  return transports.count(group_name) > 0;
}

c10d::ReduceOp reduce_op(const std::string& op) {
  if (op == "sum" || op == "avg") return c10d::ReduceOp::SUM;  // avg: SUM, then 1/N on wait
  if (op == "max") return c10d::ReduceOp::MAX;
  if (op == "min") return c10d::ReduceOp::MIN;
  TORCH_CHECK(false, "dcir runtime: unknown reduction '", op, "' (sum, avg, max, min)");
}

// ---- the ops ----------------------------------------------------------------------------

// Gathers the flat shards of every rank into one tensor of `size` (a view of the
// gathered buffer when the split is even or the padding is at the end, which it is).
at::Tensor all_gather(const at::Tensor& shard, at::IntArrayRef size, const std::string& group_name,
                      const std::string& tag) {
  auto pg = group(group_name);
  int64_t world = pg->getSize();
  TORCH_CHECK(shard.dim() == 1, "dcir runtime: all_gather of ", tag, ": a shard is flat, got ", shard.sizes());
  auto buffer = at::empty({shard.numel() * world}, shard.options());
  int64_t numel = c10::multiply_integers(size);
  TORCH_CHECK(numel <= buffer.numel(), "dcir runtime: all_gather of ", tag, ": shard of ", shard.numel(),
              " elements on ", world, " ranks cannot hold ", size);
  auto result = buffer.narrow(0, 0, numel).view(size);
  auto input = shard.contiguous();
  track_gathered(buffer);
  int64_t n = input.numel();
  auto work = try_shm(group_name, input, n, input.element_size(), "all_gather of " + tag,
      [&](Shm& shm, int64_t at, int64_t lo, int64_t len) {
        outbox(shm, shm.rank, at, len, input).copy_(input.narrow(0, lo, len));
      },
      [n, buffer, input](Shm& shm, int64_t at, int64_t lo, int64_t len) {
        auto rows = buffer.view({shm.world, n});
        for (int64_t r = 0; r < shm.world; ++r) rows[r].narrow(0, lo, len).copy_(outbox(shm, r, at, len, input));
      });
  auto send = work ? input : gather_send(input, world);
  start({input}, {result}, [&] { return work ? work : gather_into(*pg, buffer, send); }, [buffer, send] {},
        "all_gather of " + tag, group_name);
  return result;
}

at::Tensor all_gather_meta(const at::Tensor& shard, at::IntArrayRef size, const std::string&, const std::string&) {
  return at::empty(size, shard.options().device(at::kMeta));
}

// One transfer for several shards: rank r's shards side by side in one send buffer of
// bytes (shards of different dtypes, such as int8 weights and their f32 scales, travel as
// they are, never promoted to a common type); the gathered buffer is copied out into each
// full tensor when the first result is waited on.
std::vector<at::Tensor> all_gather_coalesced(at::TensorList shards, at::IntArrayRef sizes, at::IntArrayRef ranks,
                                             const std::string& group_name, const std::string& tag) {
  auto pg = group(group_name);
  int64_t world = pg->getSize();
  TORCH_CHECK(!shards.empty() && static_cast<int64_t>(shards.size()) == static_cast<int64_t>(ranks.size()),
              "dcir runtime: all_gather_coalesced of ", tag, ": one rank per shard");
  std::vector<at::Tensor> flat, results, result_bytes;
  std::vector<int64_t> offsets;
  int64_t total = 0, at_dim = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    auto sz = sizes.slice(at_dim, ranks[i]);
    at_dim += ranks[i];
    flat.push_back(shards[i].contiguous().view(-1).view(at::kByte));
    offsets.push_back(total);
    total += flat.back().numel();
    results.push_back(at::empty(sz, shards[i].options()));
    result_bytes.push_back(results.back().view(-1).view(at::kByte));
  }
  for (const auto& r : results) track_gathered(r);
  // bytes [lo, lo + len) of the shards side by side: of shard i, [a, b) from its offset
  auto overlap = [](int64_t offset, int64_t n, int64_t lo, int64_t len) {
    return std::make_pair(std::max(offset, lo), std::min(offset + n, lo + len));
  };
  auto work = try_shm(group_name, flat[0], total, 1, "all_gather_coalesced of " + tag,
      [&](Shm& shm, int64_t at, int64_t lo, int64_t len) {
        auto mine = outbox(shm, shm.rank, at, len, flat[0]);
        for (size_t i = 0; i < flat.size(); ++i) {
          auto [a, b] = overlap(offsets[i], flat[i].numel(), lo, len);
          if (a < b) mine.narrow(0, a - lo, b - a).copy_(flat[i].narrow(0, a - offsets[i], b - a));
        }
      },
      [result_bytes, offsets, flat, overlap](Shm& shm, int64_t at, int64_t lo, int64_t len) {
        for (int64_t r = 0; r < shm.world; ++r) {
          auto theirs = outbox(shm, r, at, len, flat[0]);
          for (size_t i = 0; i < result_bytes.size(); ++i) {  // rank r's shard i, less padding past the end
            int64_t n = flat[i].numel();
            auto [a, b] = overlap(offsets[i], std::min(n, result_bytes[i].numel() - r * n), lo, len);
            if (a < b) result_bytes[i].narrow(0, r * n + a - offsets[i], b - a).copy_(theirs.narrow(0, a - lo, b - a));
          }
        }
      });
  if (work) {
    start(flat, results, [&] { return work; }, [] {}, "all_gather_coalesced of " + tag, group_name);
    return results;
  }
  auto send = gather_send(flat, world);
  auto mine = send.narrow(0, 0, total);  // what this rank contributes, as the traffic count reads it
  auto buffer = at::empty({total * world}, send.options());
  auto copy_out = [buffer, send, result_bytes, offsets, flat, total, world] {
    auto per_rank = buffer.view({world, total});
    for (size_t i = 0; i < result_bytes.size(); ++i) {
      auto gathered = per_rank.narrow(1, offsets[i], flat[i].numel()).reshape(-1);
      result_bytes[i].copy_(gathered.narrow(0, 0, result_bytes[i].numel()));
    }
  };
  start({mine}, results, [&] { return gather_into(*pg, buffer, send); }, copy_out,
        "all_gather_coalesced of " + tag, group_name);
  return results;
}

std::vector<at::Tensor> all_gather_coalesced_meta(at::TensorList shards, at::IntArrayRef sizes,
                                                  at::IntArrayRef ranks, const std::string&, const std::string&) {
  std::vector<at::Tensor> out;
  int64_t at_dim = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    out.push_back(at::empty(sizes.slice(at_dim, ranks[i]), shards[i].options().device(at::kMeta)));
    at_dim += ranks[i];
  }
  return out;
}

// Sums (or max/min) `rows` (one per rank, each [n]) into `out` in rank order, then
// divides by the world size for an average. The first two rows combine straight into
// `out` (no copy of row 0 first): one pass fewer over the shard, the same bits.
void reduce_rows(const std::vector<at::Tensor>& rows, const at::Tensor& out, const std::string& op, int64_t world) {
  auto& into = const_cast<at::Tensor&>(out);
  if (world == 1) into.copy_(rows[0]);
  for (int64_t r = 1; r < world; ++r) {
    const at::Tensor& acc = r == 1 ? rows[0] : out;
    if (op == "max") {
      at::maximum_out(into, acc, rows[r]);
    } else if (op == "min") {
      at::minimum_out(into, acc, rows[r]);
    } else {
      at::add_out(into, acc, rows[r]);
    }
  }
  if (op == "avg") into.div_(world);
}

// An all-to-all's start over shared memory: elements [lo, lo + len) of chunk p of `send`
// ([world * n], flat) go to this rank's outbox slot for rank p (its own chunk stays in `send`).
void post_chunks(Shm& shm, int64_t at, int64_t n, int64_t lo, int64_t len, const at::Tensor& send) {
  for (int64_t p = 0; p < shm.world; ++p) {
    if (p != shm.rank) outbox(shm, shm.rank, at + slot_of(p, shm.rank) * len * send.element_size(), len, send)
                           .copy_(send.narrow(0, p * n + lo, len));
  }
}

// Its wait: those elements of what each rank r sent this one, in rank order (views of their outboxes).
std::vector<at::Tensor> chunks_for_me(Shm& shm, int64_t at, int64_t n, int64_t lo, int64_t len,
                                      const at::Tensor& send) {
  std::vector<at::Tensor> rows;
  for (int64_t r = 0; r < shm.world; ++r) {
    rows.push_back(r == shm.rank ? send.narrow(0, r * n + lo, len)
                                 : outbox(shm, r, at + slot_of(shm.rank, r) * len * send.element_size(), len, send));
  }
  return rows;
}

// Starts the reduce-scatter of `send` ([world * n]: the chunk for rank r at r * n) into
// `received` ([n]). On GPU it is the process group's reduce_scatter. Elsewhere it is an
// all-to-all (each rank receives every rank's copy of its chunk, the same bytes a ring
// reduce-scatter moves) and a sum in rank order on wait: the result is the same bits
// whatever the transport's ring order, so training is reproducible run to run and
// matches one device summing the ranks' gradients in order.
void start_reduce_scatter(const at::Tensor& send, const at::Tensor& received, const std::vector<at::Tensor>& results,
                          const std::string& op, const intrusive_ptr<ProcessGroup>& pg,
                          const std::string& group_name, const std::string& what) {
  int64_t world = pg->getSize();
  reduce_op(op);  // rejects an unknown reduction before anything starts
  if (send.is_cuda()) {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = reduce_op(op);
    opts.timeout = timeout;
    std::function<void()> epilogue = [] {};
    if (op == "avg") epilogue = [received, world] { received.div_(world); };
    start({send}, results, [&] { return reduce_scatter_into(*pg, const_cast<at::Tensor&>(received),
                                                             const_cast<at::Tensor&>(send), opts); },
          epilogue, what, group_name);
    return;
  }
  int64_t n = received.numel();
  auto work = try_shm(group_name, send, n, (world - 1) * send.element_size(), what,
      [&](Shm& shm, int64_t at, int64_t lo, int64_t len) { post_chunks(shm, at, n, lo, len, send); },
      [n, send, received, op, world](Shm& shm, int64_t at, int64_t lo, int64_t len) {
        reduce_rows(chunks_for_me(shm, at, n, lo, len, send), received.narrow(0, lo, len), op, world);
      });
  if (work) {
    start({send}, results, [&] { return work; }, [] {}, what, group_name);
    return;
  }
  auto rows = at::empty({world, received.numel()}, send.options());
  c10d::AllToAllOptions opts;
  opts.timeout = timeout;
  start({send}, results, [&] {
          auto flat = rows.view(-1);
          return all_to_all_into(*pg, flat, const_cast<at::Tensor&>(send), opts);
        },
        [rows, received, op, world] { reduce_rows(rows.unbind(0), received, op, world); }, what, group_name);
}

// Reduces `full` across the ranks; this rank keeps its flat shard.
at::Tensor reduce_scatter(const at::Tensor& full, const std::string& op, const std::string& group_name,
                          const std::string& tag) {
  auto pg = group(group_name);
  int64_t world = pg->getSize();
  int64_t chunk = chunk_of(full.numel(), world);
  auto input = full.reshape(-1);
  if (chunk * world != full.numel()) {
    input = at::constant_pad_nd(input, {0, chunk * world - full.numel()});
  } else {
    input = input.contiguous();
  }
  auto result = at::empty({chunk}, full.options());
  start_reduce_scatter(input, result, {result}, op, pg, group_name, "reduce_scatter of " + tag);
  return result;
}

at::Tensor reduce_scatter_meta(const at::Tensor& full, const std::string&, const std::string& group_name,
                               const std::string&) {
  int64_t world = group(group_name)->getSize();
  return at::empty({chunk_of(full.numel(), world)}, full.options().device(at::kMeta));
}

// Several reductions in one transfer: the send buffer holds, for each rank, the chunks of
// every tensor that rank keeps; each result is a view of this rank's received chunk.
std::vector<at::Tensor> reduce_scatter_coalesced(at::TensorList fulls, const std::string& op,
                                                 const std::string& group_name, const std::string& tag) {
  auto pg = group(group_name);
  int64_t world = pg->getSize();
  std::vector<at::Tensor> per_tensor;
  std::vector<int64_t> chunks;
  int64_t total = 0;
  for (const auto& f : fulls) {
    int64_t chunk = chunk_of(f.numel(), world);
    auto flat = at::constant_pad_nd(f.reshape(-1), {0, chunk * world - f.numel()});
    per_tensor.push_back(flat.view({world, chunk}));
    chunks.push_back(chunk);
    total += chunk;
  }
  auto send = at::cat(per_tensor, 1).reshape(-1);  // [world, total]: rank r's chunks side by side
  auto received = at::empty({total}, send.options());
  std::vector<at::Tensor> results;
  int64_t offset = 0;
  for (auto c : chunks) {
    results.push_back(received.narrow(0, offset, c));
    offset += c;
  }
  start_reduce_scatter(send, received, results, op, pg, group_name, "reduce_scatter_coalesced of " + tag);
  return results;
}

std::vector<at::Tensor> reduce_scatter_coalesced_meta(at::TensorList fulls, const std::string&,
                                                      const std::string& group_name, const std::string&) {
  int64_t world = group(group_name)->getSize();
  std::vector<at::Tensor> out;
  for (const auto& f : fulls) out.push_back(at::empty({chunk_of(f.numel(), world)}, f.options().device(at::kMeta)));
  return out;
}

// Sends row p of `rows` ([world, ...]) to rank p; row r of the result is what rank r sent
// this one. Over NCCL or gloo the process group's all_to_all, else shared memory.
at::Tensor all_to_all(const at::Tensor& rows, const std::string& group_name, const std::string& tag) {
  auto pg = group(group_name);
  int64_t world = pg->getSize();
  TORCH_CHECK(rows.dim() >= 1 && rows.size(0) == world, "dcir runtime: all_to_all of ", tag, ": one row per rank (",
              world, "), got ", rows.sizes());
  auto send = rows.contiguous();
  auto result = at::empty_like(send);
  int64_t n = send.numel() / world;
  auto flat_send = send.view(-1), flat = result.view(-1);
  intrusive_ptr<Work> work;
  if (!send.is_cuda()) work = try_shm(group_name, send, n, (world - 1) * send.element_size(),
      "all_to_all of " + tag,
      [&](Shm& shm, int64_t at, int64_t lo, int64_t len) { post_chunks(shm, at, n, lo, len, flat_send); },
      [n, flat_send, flat](Shm& shm, int64_t at, int64_t lo, int64_t len) {
        auto mine = chunks_for_me(shm, at, n, lo, len, flat_send);
        for (int64_t r = 0; r < shm.world; ++r) flat.narrow(0, r * n + lo, len).copy_(mine[r]);
      });
  c10d::AllToAllOptions opts;
  opts.timeout = timeout;
  start({send}, {result}, [&] { return work ? work : all_to_all_into(*pg, flat, flat_send, opts); }, [] {},
        "all_to_all of " + tag, group_name);
  return result;
}

at::Tensor all_to_all_meta(const at::Tensor& rows, const std::string&, const std::string&) {
  return at::empty(rows.sizes(), rows.options().device(at::kMeta));
}

// Reduces every tensor across the ranks (out of place), in one transfer.
std::vector<at::Tensor> all_reduce_coalesced(at::TensorList tensors, const std::string& op,
                                             const std::string& group_name, const std::string& tag) {
  auto pg = group(group_name);
  int64_t world = pg->getSize();
  std::vector<at::Tensor> flat;
  for (const auto& t : tensors) flat.push_back(t.reshape(-1));
  auto buffer = at::cat(flat);
  std::vector<at::Tensor> results;
  int64_t offset = 0;
  for (const auto& t : tensors) {
    results.push_back(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
  c10d::AllreduceOptions opts;
  opts.reduceOp = reduce_op(op);
  opts.timeout = timeout;
  std::function<void()> epilogue = [] {};
  if (op == "avg") epilogue = [buffer, world] { buffer.div_(world); };
  std::vector<at::Tensor> io{buffer};
  start({buffer}, results, [&] { return pg->allreduce(io, opts); }, epilogue, "all_reduce of " + tag, group_name);
  return results;
}

std::vector<at::Tensor> all_reduce_coalesced_meta(at::TensorList tensors, const std::string&, const std::string&,
                                                  const std::string&) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) out.push_back(at::empty(t.sizes(), t.options().device(at::kMeta)));
  return out;
}

at::Tensor all_reduce(const at::Tensor& t, const std::string& op, const std::string& group_name,
                      const std::string& tag) {
  return all_reduce_coalesced({t}, op, group_name, tag)[0];
}

at::Tensor all_reduce_meta(const at::Tensor& t, const std::string&, const std::string&, const std::string&) {
  return at::empty(t.sizes(), t.options().device(at::kMeta));
}

// Finishes the collective that produced t; returns t, now holding its value.
at::Tensor wait(const at::Tensor& t) {
  std::shared_ptr<Pending> p;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = pending.find(t.unsafeGetTensorImpl());
    TORCH_CHECK(it != pending.end(), "dcir runtime: wait on a tensor that no collective is producing");
    p = it->second.second;
    pending.erase(it);
  }
  if (!p->done) {
    auto begin = std::chrono::steady_clock::now();
    try {
      // Work::wait(timeout) is not honoured by every backend (gloo waits for its own,
      // the group's, timeout), so on the CPU the runtime bounds the wait itself: poll
      // with a backoff capped at 200 us, then let wait() rethrow a failure. On a GPU,
      // wait() only makes the compute stream wait for the transfer (NCCL's watchdog
      // enforces the group's timeout): polling would block the host until the transfer
      // ends, and compute queued behind it could not be launched meanwhile.
      if (!t.is_cuda()) {
        auto deadline = begin + timeout;
        auto pause = std::chrono::microseconds(5);
        auto* shm = dynamic_cast<ShmWork*>(p->work.get());  // names the ranks it waits for
        while (!p->work->isCompleted()) {
          TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "timed out", shm ? shm->stalled() : "");
          std::this_thread::sleep_for(pause);
          pause = std::min(pause * 2, std::chrono::microseconds(200));
        }
      }
      p->work->wait();
    } catch (const PeerExited& e) {
      fail(p->what, p->group_name, e.what());
    } catch (const c10::Error& e) {
      fail(p->what, p->group_name, std::string(e.what_without_backtrace()) + " (timeout " +
                                        std::to_string(timeout.count() / 1000) +
                                        " s; a rank that crashed or runs a different program leaves the others "
                                        "waiting here)");
    } catch (const std::exception& e) {
      fail(p->what, p->group_name, std::string(e.what()) + " (timeout " + std::to_string(timeout.count() / 1000) +
                            " s; a rank that crashed or runs a different program leaves the others waiting here)");
    }
    p->epilogue();
    p->done = true;
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - begin).count();
    std::lock_guard<std::mutex> g(mu);
    stats.wait_ns += ns;
  }
  return t;
}

at::Tensor wait_meta(const at::Tensor& t) { return t; }

// Releases a buffer's memory now (its storage becomes empty), as mem.free says.
void free_(const at::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> g(mu);
  auto it = gathered.find(impl);
  if (it != gathered.end()) {
    stats.gathered_bytes -= it->second.second;
    gathered.erase(it);
  }
  stats.freed_bytes += static_cast<int64_t>(impl->nbytes());
  impl->reset();
}

void free_meta(const at::Tensor&) {}

// ---- parameter-shard store ----------------------------------------------------------------

std::unordered_map<std::string, at::Tensor> shards;

void set_shard(const std::string& name, const at::Tensor& shard) {
  std::lock_guard<std::mutex> g(mu);
  shards[name] = shard;
}

at::Tensor get_shard(const std::string& name) {
  std::lock_guard<std::mutex> g(mu);
  auto it = shards.find(name);
  TORCH_CHECK(it != shards.end(), "dcir runtime: no shard of @", name, " in the store");
  return it->second;
}

// Drops every shard whose name starts with `prefix` (an engine's, when it goes away).
void drop_shards(const std::string& prefix) {
  std::lock_guard<std::mutex> g(mu);
  for (auto it = shards.begin(); it != shards.end();) {
    it = it->first.rfind(prefix, 0) == 0 ? shards.erase(it) : std::next(it);
  }
}

// [shard bytes, gathered bytes now, peak gathered, freed, collectives, sent bytes, wait ns, pending]
std::vector<int64_t> memory_stats() {
  std::lock_guard<std::mutex> g(mu);
  prune_locked();
  int64_t shard_bytes = 0;
  for (const auto& kv : shards) shard_bytes += nbytes(kv.second);
  return {shard_bytes,        stats.gathered_bytes, stats.peak_gathered_bytes,
          stats.freed_bytes,  stats.collectives,    stats.sent_bytes,
          stats.wait_ns,      static_cast<int64_t>(pending.size()), stats.shm_fallbacks};
}

// [collectives, sent bytes] the runtime started over the group named `group_name`
std::vector<int64_t> group_stats(const std::string& group_name) {
  std::lock_guard<std::mutex> g(mu);
  auto it = per_group.find(group_name);
  if (it == per_group.end()) return {0, 0};
  return {it->second[0], it->second[1]};
}

void reset_peak() {
  std::lock_guard<std::mutex> g(mu);
  prune_locked();
  stats.peak_gathered_bytes = stats.gathered_bytes;
}

void set_timeout(int64_t ms) {
  std::lock_guard<std::mutex> g(mu);
  timeout = std::chrono::milliseconds(ms);
}

bool has_cuda() {
#ifdef DCIR_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace dcir

using namespace dcir;

TORCH_LIBRARY(dcir, m) {
  m.def("all_gather(Tensor shard, int[] size, str group, str tag) -> Tensor");
  m.def("all_gather_coalesced(Tensor[] shards, int[] sizes, int[] ranks, str group, str tag) -> Tensor[]");
  m.def("reduce_scatter(Tensor full, str op, str group, str tag) -> Tensor");
  m.def("reduce_scatter_coalesced(Tensor[] fulls, str op, str group, str tag) -> Tensor[]");
  m.def("all_to_all(Tensor rows, str group, str tag) -> Tensor");
  m.def("all_reduce(Tensor t, str op, str group, str tag) -> Tensor");
  m.def("all_reduce_coalesced(Tensor[] tensors, str op, str group, str tag) -> Tensor[]");
  // no alias annotation: functionalization (Inductor) rejects custom ops returning an
  // alias; the result is the input tensor, now holding the collective's value
  m.def("wait(Tensor t) -> Tensor");
  m.def("free(Tensor(a!) t) -> ()");
  // state and bookkeeping: one kernel for every device
  m.def("set_shard(str name, Tensor shard) -> ()", &set_shard);
  m.def("get_shard(str name) -> Tensor", &get_shard);
  m.def("drop_shards(str prefix) -> ()", &drop_shards);
  m.def("memory_stats() -> int[]", &memory_stats);
  m.def("reset_peak() -> ()", &reset_peak);
  m.def("group_stats(str group) -> int[]", &group_stats);
  m.def("set_timeout(int ms) -> ()", &set_timeout);
  m.def("has_cuda() -> bool", &has_cuda);
  m.def("shm_create(str group, str name, int rank, int world, int capacity) -> bool", &shm_create);
  m.def("shm_attach(str group, str name) -> bool", &shm_attach);
  m.def("shm_commit(str group, bool use) -> ()", &shm_commit);
  m.def("shm_active(str group) -> bool", &shm_active);
}

TORCH_LIBRARY_IMPL(dcir, CompositeExplicitAutograd, m) {
  m.impl("all_gather", all_gather);
  m.impl("all_gather_coalesced", all_gather_coalesced);
  m.impl("reduce_scatter", reduce_scatter);
  m.impl("reduce_scatter_coalesced", reduce_scatter_coalesced);
  m.impl("all_to_all", all_to_all);
  m.impl("all_reduce", all_reduce);
  m.impl("all_reduce_coalesced", all_reduce_coalesced);
  m.impl("wait", wait);
  m.impl("free", free_);
}

TORCH_LIBRARY_IMPL(dcir, Meta, m) {
  m.impl("all_gather", all_gather_meta);
  m.impl("all_gather_coalesced", all_gather_coalesced_meta);
  m.impl("reduce_scatter", reduce_scatter_meta);
  m.impl("reduce_scatter_coalesced", reduce_scatter_coalesced_meta);
  m.impl("all_to_all", all_to_all_meta);
  m.impl("all_reduce", all_reduce_meta);
  m.impl("all_reduce_coalesced", all_reduce_coalesced_meta);
  m.impl("wait", wait_meta);
  m.impl("free", free_meta);
}

