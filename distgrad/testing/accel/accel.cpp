// dgtest: distgrad's test accelerator, a PrivateUse1 backend whose memory is host
// memory and whose "kernels" are torch's CPU kernels run through a boxed fallback.
//
// Everything executes synchronously, in order, on the calling thread, so a missing
// stream synchronization could never show as a wrong number. The stream-order
// checker below turns such a race into a deterministic error instead: every stream
// (and the host) carries a vector clock, every allocation remembers its last write
// and the reads since, and each op checks that its stream is ordered after the
// accesses of other streams it depends on (CUDA's rules: events, wait_stream,
// synchronize, record_stream before a free).
//
// Loaded by distgrad/testing/accel/__init__.py (torch.ops.load_library); the Python
// side renames PrivateUse1 to "dgtest" and registers torch.dgtest.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace dgtest {

using c10::DeviceIndex;
using c10::DeviceType;

constexpr DeviceType kDev = DeviceType::PrivateUse1;
constexpr int kMaxDevices = 8;
constexpr int64_t kPoolSize = 4;       // pool streams are ids 1..kPoolSize
constexpr int64_t kFirstNewStream = 16; // getNewStream hands out 16, 17, ...

int device_count() {
  static const int n = [] {
    const char* s = std::getenv("DISTGRAD_TEST_DEVICES");
    int v = s && *s ? std::atoi(s) : 2;
    if (v < 2) v = 2;
    if (v > kMaxDevices) v = kMaxDevices;
    return v;
  }();
  return n;
}

void check_index(DeviceIndex i) {
  TORCH_CHECK(i >= 0 && i < device_count(), "dgtest: invalid device index ", int(i),
              " (there are ", device_count(), " dgtest devices)");
}

// ---------------------------------------------------------------- thread state
thread_local DeviceIndex tls_device = 0;
thread_local std::array<int64_t, kMaxDevices> tls_stream{};  // 0: the default stream

DeviceIndex resolve(DeviceIndex i) { return i < 0 ? tls_device : i; }

// ---------------------------------------------------------------- clocks
using Key = uint64_t;  // (device << 48) | stream id; kHost for the host
constexpr Key kHost = ~Key(0);
Key key_of(DeviceIndex d, int64_t id) { return (Key(uint8_t(d)) << 48) | (Key(id) & 0xffffffffffffULL); }
Key key_of(const c10::Stream& s) { return key_of(s.device_index(), s.id()); }
int key_device(Key k) { return int(k >> 48); }
int64_t key_stream(Key k) { return int64_t(k & 0xffffffffffffULL); }

std::string key_name(Key k) {
  if (k == kHost) return "the host";
  int64_t id = key_stream(k);
  std::string s = "stream " + std::to_string(id);
  if (id == 0) s += " (default)";
  else if (id <= kPoolSize) s += " (pool)";
  return s + " of dgtest:" + std::to_string(key_device(k));
}

// a vector clock: (stream, time) pairs sorted by stream
struct Clock {
  std::vector<std::pair<Key, uint64_t>> v;
  std::vector<std::pair<Key, uint64_t>>::iterator find(Key k) {
    return std::lower_bound(v.begin(), v.end(), k, [](const auto& e, Key x) { return e.first < x; });
  }
  uint64_t get(Key k) const {
    auto it = std::lower_bound(v.begin(), v.end(), k, [](const auto& e, Key x) { return e.first < x; });
    return it != v.end() && it->first == k ? it->second : 0;
  }
  // returns whether anything rose
  bool raise_to(Key k, uint64_t t) {
    auto it = find(k);
    if (it != v.end() && it->first == k) {
      if (it->second >= t) return false;
      it->second = t;
      return true;
    }
    v.insert(it, {k, t});
    return true;
  }
  bool merge(const Clock& o) {
    bool rose = false;
    for (const auto& e : o.v) rose = raise_to(e.first, e.second) || rose;
    return rose;
  }
  uint64_t bump(Key k) {
    auto it = find(k);
    if (it != v.end() && it->first == k) return ++it->second;
    v.insert(it, {k, 1});
    return 1;
  }
};

struct StreamState {
  Clock clock;
  uint64_t host_seen = 0;  // the host clock's version last merged in
};

struct OpName {
  const char* name;
  const char* overload;
  std::string str() const {
    std::string s = name ? name : "?";
    if (overload && *overload) { s += "."; s += overload; }
    return s;
  }
};

struct Allocation {
  void* ptr = nullptr;
  size_t nbytes = 0;
  DeviceIndex device = 0;
  Key alloc_stream = 0;
  uint64_t id = 0;
  uint64_t epoch = 0;
  bool written = false;
  Key w_stream = 0;
  uint64_t w_time = 0;
  OpName w_op{nullptr, nullptr};
  std::vector<std::pair<Key, uint64_t>> reads;  // since the last write
  std::vector<std::pair<Key, uint64_t>> uses;   // last use per stream
  std::vector<Key> recorded;                    // record_stream
};

struct Event {
  Clock clock;
  bool recorded = false;
  DeviceIndex device = 0;
  double time_ms = 0;
};

void set_pair(std::vector<std::pair<Key, uint64_t>>& v, Key k, uint64_t t) {
  for (auto& e : v) if (e.first == k) { e.second = t; return; }
  v.emplace_back(k, t);
}

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

class Checker {
 public:
  std::mutex mu;
  bool enabled = true;
  bool raise = true;
  uint64_t epoch = 1;
  std::unordered_map<Key, StreamState> streams;
  Clock host;
  uint64_t host_version = 1;
  std::deque<std::string> log;
  uint64_t total = 0;
  std::vector<std::string> pending;  // found in a free (a deleter may not throw)
  std::atomic<bool> has_pending{false};
  std::unordered_map<void*, Allocation*> live;
  uint64_t next_id = 1;
  size_t live_bytes[kMaxDevices] = {};

  Clock& clock_of(Key k) { return streams[k].clock; }

  // a stream's clock after the host's: work queued now follows what the host saw
  Clock& synced(Key k) {
    StreamState& st = streams[k];
    if (st.host_seen != host_version) {
      st.clock.merge(host);
      st.host_seen = host_version;
    }
    return st.clock;
  }

  void host_merge(const Clock& c) {
    if (host.merge(c)) ++host_version;
    if (!landing.empty()) land(host, nullptr);
  }

  // non-blocking copies into pinned host memory: on a GPU the bytes arrive when the
  // copy's stream gets there, so the host may read them only after synchronizing with
  // that stream (an event, the stream, the device). Here the destination holds a poison
  // (NaN, or an odd integer) until the host (or a stream that reads the buffer) has seen
  // the copy, and then the bytes the copy read. A missing host synchronization before
  // reading staged bytes then shows as a wrong number.
  struct Landing {
    Key s;
    uint64_t t;
    at::Tensor data;  // what the copy read, at its place in its stream's order
    at::Tensor dst;
  };
  std::vector<Landing> landing;
  // landed copies: their tensors are released outside the checker's lock, since the
  // last reference to a tensor Python made may need the GIL (drop_landed)
  std::vector<Landing> landed;
  std::atomic<bool> has_landed{false};

  // a copy's bytes reach its destination; its tensors are freed outside the lock
  void arrive(Landing&& l) {
    l.dst.copy_(l.data, false);
    landed.push_back(std::move(l));
    has_landed = true;
  }

  // land every copy that clock `c` has seen (only those into `only`'s storage, if given)
  void land(const Clock& c, const c10::StorageImpl* only) {
    size_t kept = 0;
    for (size_t i = 0; i < landing.size(); ++i) {
      Landing& l = landing[i];
      bool mine = !only || l.dst.storage().unsafeGetStorageImpl() == only;
      if (mine && c.get(l.s) >= l.t) {
        arrive(std::move(l));
      } else {
        if (kept != i) landing[kept] = std::move(l);
        ++kept;
      }
    }
    landing.resize(kept);
  }

  // the op's start on stream `s`
  uint64_t tick(Key s) { return synced(s).bump(s); }

  void refresh(Allocation* a) {
    if (a->epoch == epoch) return;
    a->epoch = epoch;
    a->written = false;
    a->reads.clear();
    a->uses.clear();
    a->recorded.clear();
  }

  std::string where(const Allocation* a) {
    return "allocation #" + std::to_string(a->id) + " (" + std::to_string(a->nbytes) +
           " bytes on dgtest:" + std::to_string(a->device) + ")";
  }

  void note(std::string msg) {
    ++total;
    log.push_back(msg);
    if (log.size() > 200) log.pop_front();
  }

  // check one op's accesses; returns the violation text ("" when ordered)
  std::string check(Key s, uint64_t now, const OpName& op, const std::vector<Allocation*>& reads,
                    const std::vector<Allocation*>& writes) {
    const Clock& c = clock_of(s);
    auto head = [&](const char* verb, Allocation* a) {
      return "stream-order violation: " + op.str() + " on " + key_name(s) + " at t=" +
             std::to_string(now) + " " + verb + " " + where(a);
    };
    for (Allocation* a : reads) {
      refresh(a);
      if (a->written && a->w_stream != s && c.get(a->w_stream) < a->w_time)
        return head("reads", a) + " last written by " + a->w_op.str() + " on " + key_name(a->w_stream) +
               " at t=" + std::to_string(a->w_time) + ", but " + key_name(s) + " has seen " +
               key_name(a->w_stream) + " only up to t=" + std::to_string(c.get(a->w_stream)) +
               " (missing wait_stream / event wait before the read)";
    }
    for (Allocation* a : writes) {
      refresh(a);
      if (a->written && a->w_stream != s && c.get(a->w_stream) < a->w_time)
        return head("writes", a) + " last written by " + a->w_op.str() + " on " + key_name(a->w_stream) +
               " at t=" + std::to_string(a->w_time) + ", but " + key_name(s) + " has seen " +
               key_name(a->w_stream) + " only up to t=" + std::to_string(c.get(a->w_stream)) +
               " (write after write without wait_stream / event wait)";
      for (const auto& r : a->reads)
        if (r.first != s && c.get(r.first) < r.second)
          return head("writes", a) + " read by " + key_name(r.first) + " at t=" + std::to_string(r.second) +
                 ", but " + key_name(s) + " has seen " + key_name(r.first) + " only up to t=" +
                 std::to_string(c.get(r.first)) + " (write after read without wait_stream / event wait)";
    }
    return "";
  }

  void apply(Key s, uint64_t now, const OpName& op, const std::vector<Allocation*>& reads,
             const std::vector<Allocation*>& writes) {
    for (Allocation* a : reads) {
      set_pair(a->reads, s, now);
      set_pair(a->uses, s, now);
    }
    for (Allocation* a : writes) mark_written(a, s, now, op);
  }

  void mark_written(Allocation* a, Key s, uint64_t now, const OpName& op) {
    refresh(a);
    a->written = true;
    a->w_stream = s;
    a->w_time = now;
    a->w_op = op;
    a->reads.clear();
    set_pair(a->uses, s, now);
  }

  void free_check(Allocation* a) {
    if (!enabled) return;
    refresh(a);
    Clock c = synced(a->alloc_stream);
    for (const auto& u : a->uses) {
      if (u.first == a->alloc_stream) continue;
      bool rec = false;
      for (Key k : a->recorded) rec = rec || k == u.first;
      if (rec || c.get(u.first) >= u.second) continue;
      std::string msg = "stream-order violation: free of " + where(a) + ", allocated on " +
                        key_name(a->alloc_stream) + ": freed while " + key_name(u.first) +
                        " may still use it (last use at t=" + std::to_string(u.second) + "; " +
                        key_name(a->alloc_stream) + " and the host have seen it only up to t=" +
                        std::to_string(c.get(u.first)) + "); call record_stream(" + key_name(u.first) +
                        ") or synchronize before freeing";
      note(msg);
      if (raise) {
        pending.push_back(msg);
        has_pending = true;
      }
      return;
    }
  }
};

Checker& checker() {
  static Checker* c = new Checker();  // leaked: deleters may run at exit
  return *c;
}

void drop_landed() {
  Checker& k = checker();
  if (!k.has_landed.load(std::memory_order_relaxed)) return;
  std::vector<Checker::Landing> gone;
  {
    std::lock_guard<std::mutex> g(k.mu);
    gone.swap(k.landed);
    k.has_landed = false;
  }
}  // (`gone` released here, unlocked)

void raise_pending() {
  drop_landed();
  Checker& k = checker();
  if (!k.has_pending.load(std::memory_order_relaxed)) return;
  std::string msg;
  {
    std::lock_guard<std::mutex> g(k.mu);
    if (k.pending.empty()) return;
    msg = k.pending.front();
    k.pending.clear();
    k.has_pending = false;
  }
  TORCH_CHECK(false, msg);
}

// one op's accesses on stream `s`: checked, then recorded (raises on a violation)
uint64_t run_checks(Key s, const OpName& op, const std::vector<Allocation*>& reads,
                    const std::vector<Allocation*>& writes) {
  Checker& k = checker();
  std::string err;
  uint64_t now;
  {
    std::lock_guard<std::mutex> g(k.mu);
    if (!k.enabled) return 0;
    now = k.tick(s);
    err = k.check(s, now, op, reads, writes);
    if (!err.empty()) k.note(err);
    if (err.empty() || !k.raise) k.apply(s, now, op, reads, writes);
  }
  if (!err.empty() && k.raise) TORCH_CHECK(false, err);
  return now;
}

void mark_fresh(Allocation* a, Key s, uint64_t now, const OpName& op) {
  if (!a) return;
  Checker& k = checker();
  std::lock_guard<std::mutex> g(k.mu);
  if (!k.enabled) return;
  k.mark_written(a, s, now, op);
}

void host_sync_stream(Key s) {
  Checker& k = checker();
  std::lock_guard<std::mutex> g(k.mu);
  if (!k.enabled) return;
  k.host_merge(k.clock_of(s));
}

Key current_key(DeviceIndex d) {
  d = resolve(d);
  return key_of(d, tls_stream[d]);
}

// ---------------------------------------------------------------- allocators
void dg_delete(void* ctx) {
  auto* a = static_cast<Allocation*>(ctx);
  {
    Checker& k = checker();
    std::lock_guard<std::mutex> g(k.mu);
    k.free_check(a);
    k.live.erase(a->ptr);
    k.live_bytes[a->device] -= a->nbytes;
  }
  std::free(a->ptr);
  delete a;
}

void noop_delete(void*) {}

struct DgAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    DeviceIndex d = tls_device;
    c10::Device dev(kDev, d);
    if (n == 0) return {nullptr, nullptr, &noop_delete, dev};
    void* p = nullptr;
    size_t rounded = (n + 63) & ~size_t(63);
    TORCH_CHECK(posix_memalign(&p, 64, rounded) == 0 && p, "dgtest: out of memory allocating ", n, " bytes");
    auto* a = new Allocation();
    a->ptr = p;
    a->nbytes = n;
    a->device = d;
    a->alloc_stream = key_of(d, tls_stream[d]);
    {
      Checker& k = checker();
      std::lock_guard<std::mutex> g(k.mu);
      a->id = k.next_id++;
      a->epoch = k.epoch;
      k.live[p] = a;
      k.live_bytes[d] += n;
    }
    return {p, a, &dg_delete, dev};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

DgAllocator g_alloc;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_alloc)

Allocation* alloc_of(const c10::StorageImpl* st) {
  if (!st) return nullptr;
  const auto& dp = st->data_ptr();
  if (dp.get_deleter() != &dg_delete) return nullptr;
  return static_cast<Allocation*>(dp.get_context());
}
Allocation* alloc_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  return alloc_of(t.storage().unsafeGetStorageImpl());
}

// pinned host memory (for tensor.pin_memory()): plain aligned host memory, remembered
// (leaked, like the checker: deleters may run during static destruction)
std::mutex& g_pinned_mu = *new std::mutex();
std::unordered_set<const void*>& g_pinned = *new std::unordered_set<const void*>();

bool pinned_ptr(const void* p) {
  std::lock_guard<std::mutex> g(g_pinned_mu);
  return g_pinned.count(p) != 0;
}

void pinned_delete(void* p) {
  {
    std::lock_guard<std::mutex> g(g_pinned_mu);
    g_pinned.erase(p);
  }
  std::free(p);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &noop_delete, c10::Device(c10::kCPU)};
    void* p = nullptr;
    TORCH_CHECK(posix_memalign(&p, 64, (n + 63) & ~size_t(63)) == 0 && p, "dgtest: out of pinned memory");
    {
      std::lock_guard<std::mutex> g(g_pinned_mu);
      g_pinned.insert(p);
    }
    return {p, p, &pinned_delete, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};
PinnedAllocator g_pinned_alloc;

// grow a device storage to `nbytes` (copying its bytes), as resize_ and
// UntypedStorage.resize_ do; the checker sees a read of the old memory and a
// write of the new one on the current stream
void grow_storage(c10::StorageImpl* st, size_t nbytes, const OpName& op) {
  c10::DeviceIndex d = st->device().index();
  c10::DeviceGuard guard(c10::Device(kDev, d));
  Key s = current_key(d);
  std::vector<Allocation*> reads, writes;
  if (Allocation* a = alloc_of(st)) reads.push_back(a);
  uint64_t now = run_checks(s, op, reads, writes);
  c10::DataPtr nd = g_alloc.allocate(nbytes);
  size_t keep = std::min(nbytes, st->nbytes());
  if (keep && st->data()) std::memcpy(nd.get(), st->data(), keep);
  st->set_data_ptr_noswap(std::move(nd));
  st->set_nbytes(nbytes);
  mark_fresh(alloc_of(st), s, now, op);
}

// ---------------------------------------------------------------- device guard
struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  static std::atomic<int64_t> next_stream;
  static std::array<std::atomic<int64_t>, kMaxDevices> pool_next;

  DeviceType type() const override { return kDev; }
  c10::Device exchangeDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kDev, "dgtest guard got a ", d.type(), " device");
    DeviceIndex old = tls_device;
    if (d.index() >= 0) {
      check_index(d.index());
      tls_device = d.index();
    }
    return {kDev, old};
  }
  c10::Device getDevice() const override { return {kDev, tls_device}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kDev, "dgtest guard got a ", d.type(), " device");
    if (d.index() < 0) return;
    check_index(d.index());
    tls_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count()) tls_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    DeviceIndex i = resolve(d.index());
    check_index(i);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDev, i), tls_stream[i]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    DeviceIndex i = resolve(d.index());
    check_index(i);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDev, i), 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool = false) const override {
    DeviceIndex i = resolve(d.index());
    check_index(i);
    int64_t id = 1 + (pool_next[i]++ % kPoolSize);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDev, i), id);
  }
  c10::Stream getNewStream(c10::Device d, int = 0) const override {
    DeviceIndex i = resolve(d.index());
    check_index(i);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDev, i), next_stream++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    DeviceIndex i = s.device_index();
    check_index(i);
    int64_t old = tls_stream[i];
    tls_stream[i] = s.id();
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDev, i), old);
  }
  DeviceIndex deviceCount() const noexcept override { return DeviceIndex(device_count()); }

  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
  void record(void** event, const c10::Stream& stream, const DeviceIndex device_index,
              const c10::EventFlag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(), "dgtest: event on dgtest:",
                int(device_index), " recorded on a stream of dgtest:", int(stream.device_index()));
    auto* e = static_cast<Event*>(*event);
    if (!e) {
      e = new Event();
      *event = e;
    }
    e->device = stream.device_index();
    e->time_ms = now_ms();
    Checker& k = checker();
    std::lock_guard<std::mutex> g(k.mu);
    e->clock = k.synced(key_of(stream));
    e->recorded = true;
  }
  void block(void* event, const c10::Stream& stream) const override {
    auto* e = static_cast<Event*>(event);
    if (!e || !e->recorded) return;
    Checker& k = checker();
    std::lock_guard<std::mutex> g(k.mu);
    k.clock_of(key_of(stream)).merge(e->clock);
  }
  bool queryEvent(void* event) const override {
    auto* e = static_cast<Event*>(event);
    if (e && e->recorded) {  // "done" orders the host after it, as a CUDA query does
      Checker& k = checker();
      std::lock_guard<std::mutex> g(k.mu);
      k.host_merge(e->clock);
    }
    return true;
  }
  bool queryStream(const c10::Stream& stream) const override {
    host_sync_stream(key_of(stream));
    return true;
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    host_sync_stream(key_of(stream));
    raise_pending();
  }
  void synchronizeEvent(void* event) const override {
    queryEvent(event);
    raise_pending();
  }
  void synchronizeDevice(const DeviceIndex device_index) const override {
    int d = resolve(device_index);
    {
      Checker& k = checker();
      std::lock_guard<std::mutex> g(k.mu);
      for (auto& kv : k.streams)
        if (key_device(kv.first) == d) k.host_merge(kv.second.clock);
    }
    raise_pending();
  }
  void recordDataPtrOnStream(const c10::DataPtr& dp, const c10::Stream& stream) const override {
    if (dp.get_deleter() != &dg_delete) return;
    auto* a = static_cast<Allocation*>(dp.get_context());
    Checker& k = checker();
    std::lock_guard<std::mutex> g(k.mu);
    k.refresh(a);
    Key s = key_of(stream);
    for (Key r : a->recorded) if (r == s) return;
    a->recorded.push_back(s);
  }
  double elapsedTime(void* e1, void* e2, const DeviceIndex) const override {
    auto* a = static_cast<Event*>(e1);
    auto* b = static_cast<Event*>(e2);
    TORCH_CHECK(a && b && a->recorded && b->recorded,
                "dgtest: both events must be recorded before elapsed_time()");
    return b->time_ms - a->time_ms;
  }
};
std::atomic<int64_t> GuardImpl::next_stream{kFirstNewStream};
std::array<std::atomic<int64_t>, kMaxDevices> GuardImpl::pool_next{};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ---------------------------------------------------------------- hooks
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return DeviceIndex(device_count()); }
  void setCurrentDevice(DeviceIndex d) const override {
    check_index(d);
    tls_device = d;
  }
  DeviceIndex getCurrentDevice() const override { return tls_device; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    DeviceIndex old = tls_device;
    if (d >= 0) setCurrentDevice(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  // random ops run on the CPU through the fallback: the CPU generator serves them
  const at::Generator& getDefaultGenerator(DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(DeviceIndex) const override { return at::detail::createCPUGenerator(); }
  at::Device getDeviceFromPtr(void* p) const override {
    Checker& k = checker();
    std::lock_guard<std::mutex> g(k.mu);
    auto it = k.live.find(p);
    return {kDev, it == k.live.end() ? tls_device : it->second->device};
  }
  bool isPinnedPtr(const void* p) const override {
    std::lock_guard<std::mutex> g(g_pinned_mu);
    return g_pinned.count(p) != 0;
  }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_alloc; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    raise_pending();
    auto* st = storage.unsafeGetStorageImpl();
    TORCH_CHECK(st->resizable(), "dgtest: trying to resize a storage that is not resizable");
    grow_storage(st, newsize, {"UntypedStorage.resize_", ""});
  }
};

const bool g_hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

// ---------------------------------------------------------------- CPU aliases
// A CPU tensor that views a device tensor's memory: CPU kernels read and write the
// device memory in place. Aliases of one device storage share one CPU storage, so
// CPU's overlap checks and view detection see what the device tensors share.
struct Shadow {
  c10::Storage dev;  // the device storage
  c10::Storage cpu;  // its CPU twin over the same bytes (resizable: out= may grow it)
  void* orig = nullptr;
};

struct Shadows {
  std::vector<Shadow> v;
  Shadow& of(const c10::Storage& dev) {
    for (auto& s : v) if (s.dev.unsafeGetStorageImpl() == dev.unsafeGetStorageImpl()) return s;
    auto* impl = dev.unsafeGetStorageImpl();
    void* p = impl->mutable_data();
    c10::Storage cpu(c10::Storage::use_byte_size_t(), impl->nbytes(), c10::DataPtr(p, c10::Device(c10::kCPU)),
                     c10::GetCPUAllocator(), /*resizable=*/true);
    v.push_back(Shadow{dev, std::move(cpu), p});
    return v.back();
  }
  Shadow* by_cpu(const c10::StorageImpl* cpu) {
    for (auto& s : v) if (s.cpu.unsafeGetStorageImpl() == cpu) return &s;
    return nullptr;
  }
};

at::Tensor with_storage(c10::Storage st, c10::DispatchKey key, const at::Tensor& like) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(st), c10::DispatchKeySet(key), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  if (like.is_conj()) t._set_conj(true);
  if (like.is_neg()) t._set_neg(true);
  return t;
}

at::Tensor cpu_alias(Shadows& sh, const at::Tensor& t) {
  return with_storage(sh.of(t.storage()).cpu, c10::DispatchKey::CPU, t);
}

bool dev_tensor(const at::Tensor& t) { return t.defined() && t.device().type() == kDev; }

std::string devname(const c10::Device& d) {
  if (d.type() == kDev) return "dgtest:" + std::to_string(int(d.index()));
  return d.str();
}

[[noreturn]] void two_devices(const std::string& a, const std::string& b) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", a,
              " and ", b, "!");
}

// ---------------------------------------------------------------- native kernels
at::Tensor empty_memory_format(c10::SymIntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  raise_pending();
  c10::Device d = c10::device_or_default(device);
  TORCH_CHECK(d.type() == kDev, "dgtest: empty on ", d);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "dgtest: only strided tensors");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "dgtest: only CPU memory can be pinned");
  c10::DeviceGuard guard(d);
  return at::detail::empty_generic(C10_AS_INTARRAYREF_SLOW(size), &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::SymIntArrayRef size, c10::SymIntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  raise_pending();
  c10::Device d = c10::device_or_default(device);
  TORCH_CHECK(d.type() == kDev, "dgtest: empty_strided on ", d);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "dgtest: only strided tensors");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "dgtest: only CPU memory can be pinned");
  c10::DeviceGuard guard(d);
  return at::detail::empty_strided_generic(C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride), &g_alloc,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> offset) {
  std::optional<int64_t> off;
  if (offset) off = offset->guard_int(__FILE__, __LINE__);
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride), off);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor unfold(const at::Tensor& self, int64_t dim, int64_t size, int64_t step) {
  return at::native::unfold(self, dim, size, step);
}

at::Tensor view_as_real(const at::Tensor& self) { return at::native::view_as_real(self); }
at::Tensor view_as_complex(const at::Tensor& self) { return at::native::view_as_complex(self); }

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  raise_pending();
  auto sizes = C10_AS_INTARRAYREF_SLOW(size);
  c10::DeviceGuard guard(self.device());
  auto* st = self.storage().unsafeGetStorageImpl();
  int64_t numel = 1;
  for (auto s : sizes) numel *= s;
  size_t need = numel == 0 ? 0 : size_t(self.storage_offset() + numel) * self.dtype().itemsize();
  if (need > st->nbytes()) grow_storage(st, need, {"aten::resize_", ""});
  at::native::resize_(self, sizes, memory_format);
  return self;
}

at::Tensor& set_storage(at::Tensor& self, at::Storage source, c10::SymInt offset, c10::SymIntArrayRef size,
                        c10::SymIntArrayRef stride) {
  raise_pending();
  TORCH_CHECK(source.device().type() == kDev, "dgtest: set_ with a storage on ", source.device());
  c10::DeviceGuard guard(source.device());
  auto sizes = C10_AS_INTARRAYREF_SLOW(size);
  auto strides = C10_AS_INTARRAYREF_SLOW(stride);
  int64_t off = offset.guard_int(__FILE__, __LINE__);
  // set_storage_cpu_ only touches the TensorImpl and (when it must grow) the
  // storage through its own allocator, which is ours
  return at::native::set_storage_cpu_(self, std::move(source), off, sizes, strides);
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) { return at::native::set_(self, std::move(source)); }

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  c10::Storage st(c10::Storage::use_byte_size_t(), 0, g_alloc.allocate(0), &g_alloc, true);
  return self.set_(st, 0, {0}, {});
}

// copies in every direction; CUDA's streams: a device side runs on its device's
// current stream, a cross-device copy orders both current streams around it, and a
// blocking copy that touches the host synchronizes the stream (so the host is
// ordered after it)
at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  raise_pending();
  static const OpName op{"aten::copy_", ""};
  Shadows sh;
  bool sd = dev_tensor(src), dd = dev_tensor(dst);
  TORCH_CHECK(sd || dd, "dgtest: _copy_from without a dgtest tensor");
  TORCH_CHECK((sd || src.is_cpu()) && (dd || dst.is_cpu()), "dgtest: copies between dgtest and ",
              sd ? dst.device() : src.device(), " are not supported");
  at::Tensor s_cpu = sd ? cpu_alias(sh, src) : src;
  at::Tensor d_cpu = dd ? cpu_alias(sh, dst) : dst;
  std::vector<Allocation*> reads, writes;
  if (sd) if (auto* a = alloc_of(src)) reads.push_back(a);
  if (dd) if (auto* a = alloc_of(dst)) writes.push_back(a);
  if (sd && dd && src.device() != dst.device()) {
    Key ks = current_key(src.device().index()), kd = current_key(dst.device().index());
    {
      Checker& k = checker();
      std::lock_guard<std::mutex> g(k.mu);
      if (k.enabled) k.synced(ks).merge(k.synced(kd));  // the copy waits for dst's stream
    }
    run_checks(ks, op, reads, writes);
    {
      Checker& k = checker();
      std::lock_guard<std::mutex> g(k.mu);
      if (k.enabled) k.clock_of(kd).merge(k.clock_of(ks));  // dst's stream waits for the copy
    }
  } else {
    Key s = current_key(sd ? src.device().index() : dst.device().index());
    uint64_t now = run_checks(s, op, reads, writes);
    if (!sd && src.has_storage()) {  // the host memory it reads: copies this stream has seen land
      Checker& k = checker();
      std::lock_guard<std::mutex> g(k.mu);
      if (k.enabled && !k.landing.empty()) k.land(k.clock_of(s), src.storage().unsafeGetStorageImpl());
    }
    if (sd && non_blocking && now != 0 && dst.has_storage() && pinned_ptr(dst.storage().data())) {
      at::Tensor data = s_cpu.clone();
      if (d_cpu.is_floating_point() || d_cpu.is_complex()) d_cpu.fill_(std::nan(""));
      else if (d_cpu.scalar_type() == at::kBool) d_cpu.fill_(true);
      else d_cpu.fill_(91);
      // an alias made here (no Python object behind it) of the destination's memory
      at::Tensor alias = at::empty({0}, dst.options().pinned_memory(std::nullopt))
                             .set_(dst.storage(), dst.storage_offset(), dst.sizes(), dst.strides());
      Checker& k = checker();
      std::lock_guard<std::mutex> g(k.mu);
      k.landing.push_back({s, now, std::move(data), std::move(alias)});
      return dst;
    }
    if (!non_blocking && (!sd || !dd)) host_sync_stream(s);
  }
  d_cpu.copy_(s_cpu, false);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& src, const at::Tensor& dst) {
  if (dst.sizes() != src.sizes()) dst.resize_(src.sizes());
  return copy_from(src, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  raise_pending();
  Shadows sh;
  Key s = current_key(self.device().index());
  std::vector<Allocation*> reads, writes;
  if (auto* a = alloc_of(self)) reads.push_back(a);
  run_checks(s, {"aten::_local_scalar_dense", ""}, reads, writes);
  host_sync_stream(s);  // .item() synchronizes, as on CUDA
  return cpu_alias(sh, self).item();
}

void record_stream(at::Tensor& self, c10::Stream s) {
  TORCH_CHECK(s.device_type() == kDev, "dgtest: record_stream with a ", s.device_type(), " stream");
  GuardImpl().recordDataPtrOnStream(self.storage().data_ptr(), s);
}

// torch's RNN cells call the fused cell kernels for any non-CPU input, and the CPU
// has none: these are the same math in ops (they run through the fallback). The
// workspaces only need to agree between a forward and its backward.
using T3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

at::Tensor one_minus(const at::Tensor& t) { return t.neg().add_(1); }

T3 lstm_cell(const at::Tensor& ig, const at::Tensor& hg, const at::Tensor& cx,
             const std::optional<at::Tensor>& ib, const std::optional<at::Tensor>& hb) {
  at::Tensor gates = ig + hg;
  if (ib && ib->defined()) gates = gates + *ib;
  if (hb && hb->defined()) gates = gates + *hb;
  auto ch = gates.chunk(4, 1);
  at::Tensor i = ch[0].sigmoid(), f = ch[1].sigmoid(), g = ch[2].tanh(), o = ch[3].sigmoid();
  at::Tensor cy = f * cx + i * g;
  at::Tensor hy = o * cy.tanh();
  return {hy, cy, at::cat({i, f, g, o}, 1)};
}

T3 lstm_cell_backward(const std::optional<at::Tensor>& ghy, const std::optional<at::Tensor>& gcy,
                      const at::Tensor& cx, const at::Tensor& cy, const at::Tensor& ws, bool has_bias) {
  const bool h = ghy && ghy->defined(), c = gcy && gcy->defined();
  if (!h && !c) return {at::Tensor(), at::Tensor(), at::Tensor()};
  auto ch = ws.chunk(4, 1);
  const at::Tensor &i = ch[0], &f = ch[1], &g = ch[2], &o = ch[3];
  at::Tensor tcy = cy.tanh();
  at::Tensor gc = c ? gcy->clone() : at::zeros_like(cy);
  at::Tensor go;
  if (h) {
    gc = gc + *ghy * o * one_minus(tcy * tcy);
    go = *ghy * tcy * o * one_minus(o);
  } else {
    go = at::zeros_like(o);
  }
  at::Tensor gates = at::cat({gc * g * i * one_minus(i), gc * cx * f * one_minus(f), gc * i * one_minus(g * g), go}, 1);
  return {gates, gc * f, has_bias ? gates.sum(0) : at::Tensor()};
}

std::tuple<at::Tensor, at::Tensor> gru_cell(const at::Tensor& ig, const at::Tensor& hg, const at::Tensor& hx,
                                            const std::optional<at::Tensor>& ib,
                                            const std::optional<at::Tensor>& hb) {
  at::Tensor a = (ib && ib->defined()) ? ig + *ib : ig;
  at::Tensor b = (hb && hb->defined()) ? hg + *hb : hg;
  auto ic = a.chunk(3, 1), hc = b.chunk(3, 1);
  at::Tensor r = (ic[0] + hc[0]).sigmoid(), z = (ic[1] + hc[1]).sigmoid();
  at::Tensor n = (ic[2] + r * hc[2]).tanh();
  at::Tensor hy = n + z * (hx - n);
  return {hy, at::cat({r, z, n, hx, hc[2]}, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gru_cell_backward(const at::Tensor& ghy,
                                                                                         const at::Tensor& ws,
                                                                                         bool has_bias) {
  auto ch = ws.chunk(5, 1);
  const at::Tensor &r = ch[0], &z = ch[1], &n = ch[2], &hx = ch[3], &hn = ch[4];
  at::Tensor gz = ghy * (hx - n) * z * one_minus(z);
  at::Tensor gn = ghy * one_minus(z) * one_minus(n * n);
  at::Tensor gr = gn * hn * r * one_minus(r);
  at::Tensor gi = at::cat({gr, gz, gn}, 1), gh = at::cat({gr, gz, gn * r}, 1);
  return {gi, gh, ghy * z, has_bias ? gi.sum(0) : at::Tensor(), has_bias ? gh.sum(0) : at::Tensor()};
}

// ---------------------------------------------------------------- the fallback
bool arg_writes(const c10::Argument& a) {
  const auto* ai = a.alias_info();
  if (!ai) return false;
  if (ai->isWrite()) return true;
  for (const auto& c : ai->containedTypes()) if (c.isWrite()) return true;
  return false;
}

struct Arg {
  at::Tensor dev;
  at::Tensor cpu;
  bool write;
};

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  raise_pending();
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t nargs = arguments.size();
  const size_t base = stack->size() - nargs;
  const OpName opname{schema.name().c_str(), schema.overload_name().c_str()};

  // 1. devices: CUDA's rule (one device per op; CPU scalars and 0-dim CPU tensors,
  //    and CPU index tensors, allowed)
  int dev = -1;
  int dev_arg = -1;
  bool cpu_tensor = false;
  auto see = [&](const at::Tensor& t, bool index_list) {
    if (!t.defined()) return;
    const auto d = t.device();
    if (d.type() == kDev) {
      if (dev < 0) dev = d.index();
      else if (dev != d.index()) two_devices("dgtest:" + std::to_string(dev), devname(d));
    } else if (d.is_cpu()) {
      if (t.dim() != 0 && !index_list) cpu_tensor = true;
    } else if (!d.is_meta()) {
      two_devices(dev >= 0 ? "dgtest:" + std::to_string(dev) : std::string("dgtest"), devname(d));
    }
  };
  for (size_t i = 0; i < nargs; ++i) {
    const c10::IValue& iv = (*stack)[base + i];
    if (iv.isTensor()) {
      see(iv.toTensor(), false);
    } else if (iv.isTensorList()) {
      for (const at::Tensor& t : iv.toTensorList()) see(t, false);
    } else if (iv.isList()) {
      for (const c10::IValue& e : iv.toListRef())
        if (e.isTensor()) see(e.toTensor(), true);
    } else if (iv.isDevice()) {
      auto d = iv.toDevice();
      if (d.type() == kDev && dev_arg < 0) dev_arg = resolve(d.index());
    } else if (iv.isStorage()) {
      TORCH_CHECK(iv.toStorage().device().type() != kDev, "dgtest: ", opname.str(),
                  " takes a Storage argument; the dgtest fallback cannot run it");
    }
  }
  if (dev >= 0 && cpu_tensor) two_devices("dgtest:" + std::to_string(dev), "cpu");
  const int exec_dev = dev >= 0 ? dev : (dev_arg >= 0 ? dev_arg : tls_device);
  const int out_dev = dev_arg >= 0 ? dev_arg : exec_dev;

  // 2. device tensors become CPU aliases of their memory
  Shadows sh;
  std::vector<Arg> args;
  std::vector<const c10::TensorImpl*> cpu_inputs;
  std::vector<Allocation*> reads, writes;
  auto convert = [&](const at::Tensor& t, bool write) -> at::Tensor {
    if (!dev_tensor(t)) {
      if (t.defined()) cpu_inputs.push_back(t.unsafeGetTensorImpl());
      return t;
    }
    at::Tensor c = cpu_alias(sh, t);
    args.push_back(Arg{t, c, write});
    if (Allocation* a = alloc_of(t)) (write ? writes : reads).push_back(a);
    return c;
  };
  for (size_t i = 0; i < nargs; ++i) {
    c10::IValue& iv = (*stack)[base + i];
    const bool write = arg_writes(arguments[i]);
    if (iv.isTensor()) {
      iv = convert(iv.toTensor(), write);
    } else if (iv.isTensorList()) {
      auto l = iv.toTensorList();
      c10::List<at::Tensor> out;
      out.reserve(l.size());
      for (const at::Tensor& t : l) out.push_back(convert(t, write));
      iv = out;
    } else if (iv.isList()) {
      auto l = iv.toList();
      bool any = false;
      for (const c10::IValue& e : l) any = any || (e.isTensor() && dev_tensor(e.toTensor()));
      if (any) {
        c10::impl::GenericList out(l.elementType());
        out.reserve(l.size());
        for (const c10::IValue& e : l) out.push_back(e.isTensor() ? c10::IValue(convert(e.toTensor(), write)) : e);
        iv = out;
      }
    } else if (iv.isDevice() && iv.toDevice().type() == kDev) {
      iv = c10::Device(c10::kCPU);
    }
  }

  // 3. the checker: one tick of the op's stream, its reads and writes
  const Key s = current_key(DeviceIndex(exec_dev));
  const uint64_t now = run_checks(s, opname, reads, writes);

  // 4. run the CPU kernel
  op.callBoxed(stack);

  // 5. mutated arguments: a CPU-side growth (out= resize) moves into the device
  //    storage; new sizes/strides move onto the device tensor
  for (auto& shadow : sh.v) {
    auto* cst = shadow.cpu.unsafeGetStorageImpl();
    if (cst->data_ptr().get() == shadow.orig) continue;
    auto* dst = shadow.dev.unsafeGetStorageImpl();
    c10::DeviceGuard guard(dst->device());
    c10::DataPtr nd = g_alloc.allocate(cst->nbytes());
    if (cst->nbytes()) std::memcpy(nd.get(), cst->data(), cst->nbytes());
    dst->set_data_ptr_noswap(std::move(nd));
    dst->set_nbytes(cst->nbytes());
    shadow.orig = dst->mutable_data();
    mark_fresh(alloc_of(dst), current_key(dst->device().index()), now, opname);
  }
  for (auto& a : args) {
    if (!a.write) continue;
    auto* ci = a.cpu.unsafeGetTensorImpl();
    if (!sh.by_cpu(a.cpu.storage().unsafeGetStorageImpl())) {
      // the CPU kernel gave the argument a storage of its own (set_): copy it over
      const auto* cst = a.cpu.storage().unsafeGetStorageImpl();
      c10::DeviceGuard guard(a.dev.device());
      c10::DataPtr nd = g_alloc.allocate(cst->nbytes());
      if (cst->nbytes()) std::memcpy(nd.get(), cst->data(), cst->nbytes());
      c10::Storage st(c10::Storage::use_byte_size_t(), cst->nbytes(), std::move(nd), &g_alloc, true);
      mark_fresh(alloc_of(st.unsafeGetStorageImpl()), current_key(a.dev.device().index()), now, opname);
      a.dev.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(st));
    }
    if (a.dev.sizes() != a.cpu.sizes() || a.dev.strides() != a.cpu.strides() ||
        a.dev.storage_offset() != a.cpu.storage_offset())
      a.dev.unsafeGetTensorImpl()->set_sizes_and_strides(ci->sizes(), ci->strides(), ci->storage_offset());
  }

  // 6. results: an argument comes back as itself, a view of an argument as a device
  //    view of its storage, anything new is copied to the op's device
  std::vector<std::pair<const c10::StorageImpl*, c10::Storage>> fresh;
  bool host_value = false;
  auto back = [&](const at::Tensor& c) -> at::Tensor {
    if (!c.defined()) return c;
    const auto* impl = c.unsafeGetTensorImpl();
    for (const auto& a : args) if (a.cpu.unsafeGetTensorImpl() == impl) return a.dev;
    for (const auto* ci : cpu_inputs) if (ci == impl) return c;
    TORCH_CHECK(c.layout() == c10::Layout::Strided && c.has_storage() && c.device().is_cpu(), "dgtest: ",
                opname.str(), " gave a ", c.layout(), " ", c.device(),
                " tensor; dgtest holds strided tensors only");
    const auto* cst = c.storage().unsafeGetStorageImpl();
    if (Shadow* shadow = sh.by_cpu(cst)) return with_storage(shadow->dev, c10::DispatchKey::PrivateUse1, c);
    for (const auto& f : fresh) if (f.first == cst) return with_storage(f.second, c10::DispatchKey::PrivateUse1, c);
    c10::DeviceGuard guard(c10::Device(kDev, DeviceIndex(out_dev)));
    size_t nb = cst->nbytes();
    c10::DataPtr dp = g_alloc.allocate(nb);
    if (nb) std::memcpy(dp.get(), cst->data(), nb);
    c10::Storage st(c10::Storage::use_byte_size_t(), nb, std::move(dp), &g_alloc, true);
    if (out_dev == exec_dev) mark_fresh(alloc_of(st.unsafeGetStorageImpl()), s, now, opname);
    else {
      Key so = current_key(DeviceIndex(out_dev));
      uint64_t t = run_checks(so, opname, {}, {});
      mark_fresh(alloc_of(st.unsafeGetStorageImpl()), so, t, opname);
    }
    fresh.emplace_back(cst, st);
    return with_storage(st, c10::DispatchKey::PrivateUse1, c);
  };
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  for (size_t i = 0; i < nret; ++i) {
    c10::IValue& iv = (*stack)[rbase + i];
    if (iv.isTensor()) {
      iv = back(iv.toTensor());
    } else if (iv.isTensorList()) {
      auto l = iv.toTensorList();
      c10::List<at::Tensor> out;
      out.reserve(l.size());
      for (const at::Tensor& t : l) out.push_back(back(t));
      iv = out;
    } else if (iv.isList()) {
      auto l = iv.toList();
      c10::impl::GenericList out(l.elementType());
      out.reserve(l.size());
      for (const c10::IValue& e : l) out.push_back(e.isTensor() ? c10::IValue(back(e.toTensor())) : e);
      iv = out;
    } else if (!iv.isNone()) {
      host_value = true;  // a number/bool on the host: the stream was synchronized
    }
  }
  if (host_value) host_sync_stream(s);
}

// ---------------------------------------------------------------- control ops
void set_checker(bool on, bool raise_errors) {
  Checker& k = checker();
  std::lock_guard<std::mutex> g(k.mu);
  if (on && !k.enabled) ++k.epoch;  // what happened while off is forgotten
  if (!on) {  // turned off: every copy in flight lands now
    for (auto& l : k.landing) k.arrive(std::move(l));
    k.landing.clear();
  }
  k.enabled = on;
  k.raise = raise_errors;
  if (!on || !raise_errors) {
    k.pending.clear();
    k.has_pending = false;
  }
}

std::vector<int64_t> checker_state() {
  Checker& k = checker();
  std::lock_guard<std::mutex> g(k.mu);
  return {int64_t(k.enabled), int64_t(k.raise), int64_t(k.total)};
}

std::vector<std::string> violations() {
  Checker& k = checker();
  std::lock_guard<std::mutex> g(k.mu);
  return std::vector<std::string>(k.log.begin(), k.log.end());
}

void clear_violations() {
  Checker& k = checker();
  std::lock_guard<std::mutex> g(k.mu);
  k.log.clear();
  k.pending.clear();
  k.has_pending = false;
}

void check() { raise_pending(); }

int64_t count() { return device_count(); }
int64_t current_device() { return tls_device; }
void set_device(int64_t d) {
  check_index(DeviceIndex(d));
  tls_device = DeviceIndex(d);
}
int64_t current_stream(int64_t d) {
  DeviceIndex i = resolve(DeviceIndex(d));
  check_index(i);
  return tls_stream[i];
}
int64_t exchange_stream(int64_t d, int64_t id) {
  DeviceIndex i = resolve(DeviceIndex(d));
  check_index(i);
  int64_t old = tls_stream[i];
  tls_stream[i] = id;
  return old;
}
void synchronize(int64_t d) {
  if (d == -2) {
    for (int i = 0; i < device_count(); ++i) GuardImpl().synchronizeDevice(DeviceIndex(i));
  } else {
    GuardImpl().synchronizeDevice(DeviceIndex(d));
  }
}
std::vector<int64_t> memory_allocated() {
  Checker& k = checker();
  std::lock_guard<std::mutex> g(k.mu);
  std::vector<int64_t> out;
  for (int i = 0; i < device_count(); ++i) out.push_back(int64_t(k.live_bytes[i]));
  return out;
}

}  // namespace dgtest

TORCH_LIBRARY(dgtest, m) {
  m.def("set_checker(bool on, bool raise_errors) -> ()", &dgtest::set_checker);
  m.def("checker_state() -> int[]", &dgtest::checker_state);
  m.def("violations() -> str[]", &dgtest::violations);
  m.def("clear_violations() -> ()", &dgtest::clear_violations);
  m.def("check() -> ()", &dgtest::check);
  m.def("device_count() -> int", &dgtest::count);
  m.def("current_device() -> int", &dgtest::current_device);
  m.def("set_device(int device) -> ()", &dgtest::set_device);
  m.def("current_stream(int device) -> int", &dgtest::current_stream);
  m.def("exchange_stream(int device, int stream_id) -> int", &dgtest::exchange_stream);
  m.def("synchronize(int device) -> ()", &dgtest::synchronize);
  m.def("memory_allocated() -> int[]", &dgtest::memory_allocated);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &dgtest::empty_memory_format);
  m.impl("empty_strided", &dgtest::empty_strided);
  m.impl("as_strided", &dgtest::as_strided);
  m.impl("view", &dgtest::view);
  m.impl("_reshape_alias", &dgtest::reshape_alias);
  m.impl("unfold", &dgtest::unfold);
  m.impl("view_as_real", &dgtest::view_as_real);
  m.impl("view_as_complex", &dgtest::view_as_complex);
  m.impl("resize_", &dgtest::resize_);
  m.impl("set_.source_Storage_storage_offset", &dgtest::set_storage);
  m.impl("set_.source_Storage", &dgtest::set_source_storage);
  m.impl("set_.source_Tensor", &dgtest::set_source_tensor);
  m.impl("set_", &dgtest::set_empty);
  m.impl("_copy_from", &dgtest::copy_from);
  m.impl("_copy_from_and_resize", &dgtest::copy_from_and_resize);
  m.impl("_local_scalar_dense", &dgtest::local_scalar_dense);
  m.impl("record_stream", &dgtest::record_stream);
  // CompositeExplicitAutograd kernels that pick a backend by device (and find none
  // for PrivateUse1): run the whole op through the fallback, on the CPU
  m.impl("_thnn_fused_lstm_cell", &dgtest::lstm_cell);
  m.impl("_thnn_fused_lstm_cell_backward_impl", &dgtest::lstm_cell_backward);
  m.impl("_thnn_fused_gru_cell", &dgtest::gru_cell);
  m.impl("_thnn_fused_gru_cell_backward", &dgtest::gru_cell_backward);
  for (const char* name : {"convolution", "_convolution", "convolution_backward"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&dgtest::fallback>());
}

// copies carry conj/neg bits to the CPU copy (which resolves them); without these
// the Conjugate fallback would clone the source, and clone copies: endless
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&dgtest::fallback>());
}
