// tdmdev: a small PrivateUse1 device for the tests, whose memory is host memory.
//
// It gives the tests a second real device on a CPU-only machine: tensors on it
// live in their own allocations (so a move really copies), its allocator keeps
// the same statistics as CUDA's (allocated / reserved / peak, resettable) and
// can be given a memory limit past which it raises torch.OutOfMemoryError, and
// it has streams and events for torch.Stream / torch.Event. Work is done on the
// host, synchronously: a stream never has work pending, an event is a host
// timestamp. Any operator without a kernel here runs on the CPU through torch's
// boxed CPU fallback (copy in, run on CPU, copy out).
//
// Written from torch's PrivateUse1 documentation and the headers torch 2.13
// ships (c10/core/CachingDeviceAllocator.h, c10/core/impl/DeviceGuardImplInterface.h,
// ATen/detail/PrivateUse1HooksInterface.h).

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <unistd.h> // sysconf: the host's memory, the total without a limit

namespace tdmdev {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
constexpr c10::DeviceIndex kDevices = 2; // two, so that device-to-device moves can be tested
constexpr size_t kBlock = 512; // what the allocator reserves is rounded up to this, as CUDA's

thread_local c10::DeviceIndex current_device = 0;

using Stats = c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingAllocator::StatType;

// --- allocator ------------------------------------------------------------------

// What a deleter needs to know about one allocation (a DataPtr's context).
struct Block {
  void* ptr;
  size_t requested;
  size_t reserved;
  c10::DeviceIndex device;
};

constexpr size_t kAll = static_cast<size_t>(StatType::AGGREGATE);

class Allocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex device = current_device;
    const c10::Device where(kType, device);
    if (n == 0) {
      return {nullptr, nullptr, &noop, where};
    }
    const size_t reserved = (n + kBlock - 1) / kBlock * kBlock;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      Stats& s = stats_[device];
      const int64_t limit = limit_.load();
      if (limit > 0 && s.reserved_bytes[kAll].current + static_cast<int64_t>(reserved) > limit) {
        s.num_ooms += 1;
        TORCH_CHECK_WITH(
            OutOfMemoryError, false,
            "tdmdev out of memory: tried to allocate ", n, " bytes on tdmdev:", int(device),
            " with ", s.reserved_bytes[kAll].current, " of its ", limit, " bytes in use");
      }
      update(s, n, reserved, +1); // counted before the malloc, so that two threads keep the limit
    }
    auto* block = new Block{std::aligned_alloc(64, reserved), n, reserved, device};
    if (block->ptr == nullptr) {
      release(block);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "tdmdev out of memory: the host refused");
    }
    return {block->ptr, block, &release, where};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr; // the deleter needs its Block: no raw allocations
  }

  void copy_data(void* dest, const void* src, std::size_t count) const final {
    std::memcpy(dest, src, count);
  }

  bool initialized() override {
    return true;
  }
  void emptyCache(c10::MempoolId_t) override {} // nothing is cached
  void recordStream(const c10::DataPtr&, c10::Stream) override {} // work is synchronous

  Stats getDeviceStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_.at(device);
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    for_each_stat(stats_.at(device), [](auto& stat) { stat.reset_accumulated(); });
    stats_.at(device).num_ooms = 0;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    for_each_stat(stats_.at(device), [](auto& stat) { stat.reset_peak(); });
  }

  // (free, total): the limit where one is set, else the host's memory.
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    const int64_t limit = limit_.load();
    size_t total = limit > 0 ? static_cast<size_t>(limit) : host_bytes();
    const size_t used = getDeviceStats(device).reserved_bytes[kAll].current;
    return {total > used ? total - used : 0, total};
  }

  void set_limit(int64_t bytes) {
    limit_ = bytes;
  }
  int64_t limit() const {
    return limit_.load();
  }

 private:
  // Allocated and requested bytes are what was asked for; reserved and active
  // are the rounded blocks actually taken from the host. Every allocation is its
  // own segment (nothing is cached), and counts in the large pool, like CUDA's
  // allocations over 1 MiB, so that the aggregate and one pool agree.
  static void update(Stats& s, size_t requested, size_t reserved, int sign) {
    for (size_t type : {kAll, static_cast<size_t>(StatType::LARGE_POOL)}) {
      auto step = [sign](c10::CachingAllocator::Stat& stat, size_t amount) {
        sign > 0 ? stat.increase(amount) : stat.decrease(amount);
      };
      step(s.allocation[type], 1);
      step(s.segment[type], 1);
      step(s.active[type], 1);
      step(s.allocated_bytes[type], requested);
      step(s.requested_bytes[type], requested);
      step(s.reserved_bytes[type], reserved);
      step(s.active_bytes[type], reserved);
    }
    (sign > 0 ? s.num_device_alloc : s.num_device_free) += 1;
  }

  // The counters this allocator keeps, in every pool.
  template <typename F>
  static void for_each_stat(Stats& s, F f) {
    for (auto* array : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes,
                        &s.reserved_bytes, &s.active_bytes, &s.requested_bytes}) {
      for (auto& stat : *array) f(stat);
    }
  }

  static void release(void* ctx) {
    auto* block = static_cast<Block*>(ctx);
    std::free(block->ptr);
    instance().forget(*block);
    delete block;
  }

  void forget(const Block& block) {
    std::lock_guard<std::mutex> lock(mutex_);
    update(stats_[block.device], block.requested, block.reserved, -1);
  }

  static void noop(void*) {}

  static size_t host_bytes() {
    return static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGE_SIZE));
  }

 public:
  static Allocator& instance();

 private:
  std::mutex mutex_;
  std::array<Stats, kDevices> stats_{};
  std::atomic<int64_t> limit_{0}; // bytes per device; 0: no limit
};

Allocator& Allocator::instance() {
  static Allocator* allocator = new Allocator(); // leaked: tensors may outlive static destruction
  return *allocator;
}

// Makes c10::GetAllocator(PrivateUse1) ours, which torch.accelerator's memory functions read.
struct RegisterAllocator {
  RegisterAllocator() {
    c10::SetAllocator(kType, &Allocator::instance());
  }
} register_allocator;

// Grow (or shrink) a storage in place: a new block, the old bytes copied over.
void resize_storage(c10::StorageImpl* storage, size_t nbytes) {
  TORCH_CHECK(storage->resizable(), "tdmdev: trying to resize a storage that is not resizable");
  c10::DeviceGuard guard(storage->device());
  c10::DataPtr fresh = storage->allocator()->allocate(nbytes);
  const size_t keep = std::min(nbytes, storage->nbytes());
  if (keep > 0) {
    std::memcpy(fresh.get(), storage->data(), keep);
  }
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(nbytes);
}

// --- device guard: current device, streams, events -------------------------------

// An event is the host time at which it was recorded (work before it is already done).
struct Event {
  double ms = 0;
};

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// The current stream of each device, per thread; stream 0 is the default one.
thread_local std::array<c10::StreamId, kDevices> current_streams{};
std::atomic<c10::StreamId> next_stream{1};

struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kType;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override {
    return {kType, current_device};
  }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "tdmdev: not a tdmdev device: ", d);
    TORCH_CHECK(d.index() >= 0 && d.index() < kDevices, "tdmdev: no device ", d);
    current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < kDevices) current_device = d.index();
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return kDevices;
  }

  c10::Stream getStream(c10::Device d) const override {
    return stream(d.index(), current_streams.at(index(d.index())));
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return stream(d.index(), 0);
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return stream(d.index(), next_stream++);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return getNewStream(d, 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    current_streams.at(index(s.device_index())) = s.id();
    return old;
  }
  bool queryStream(const c10::Stream&) const override {
    return true; // no work is ever pending
  }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeDevice(c10::DeviceIndex) const override {}

  void record(void** event, const c10::Stream&, c10::DeviceIndex, c10::EventFlag) const override {
    if (*event == nullptr) *event = new Event();
    static_cast<Event*>(*event)->ms = now_ms();
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override {
    return true;
  }
  void synchronizeEvent(void*) const override {}
  void destroyEvent(void* event, c10::DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
  double elapsedTime(void* start, void* end, c10::DeviceIndex) const override {
    TORCH_CHECK(start && end, "tdmdev: both events must be recorded before elapsed_time");
    return static_cast<Event*>(end)->ms - static_cast<Event*>(start)->ms;
  }

 private:
  // torch.Stream("tdmdev") asks with index -1: the current device.
  static c10::DeviceIndex index(c10::DeviceIndex i) {
    return i < 0 ? current_device : i;
  }
  static c10::Stream stream(c10::DeviceIndex i, c10::StreamId id) {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, index(i)), id);
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// --- hooks: what torch.accelerator and generic code ask of the backend ------------

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true; // there is no context to create
  }
  c10::DeviceIndex deviceCount() const override {
    return kDevices;
  }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    GuardImpl().setDevice({kType, d});
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return current_device;
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    return GuardImpl().exchangeDevice({kType, d}).index();
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override {
    return exchangeDevice(d);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    resize_storage(storage.unsafeGetStorageImpl(), nbytes);
  }
};

struct RegisterHooks {
  RegisterHooks() {
    at::RegisterPrivateUse1HooksInterface(new Hooks()); // leaked: torch keeps the pointer
  }
} register_hooks;

// --- kernels ---------------------------------------------------------------------

c10::DeviceIndex index_of(std::optional<c10::Device> device) {
  return device && device->has_index() ? device->index() : current_device;
}

at::Tensor empty(
    c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
    std::optional<c10::Device> device, std::optional<bool>,
    std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard({kType, index_of(device)}); // the allocator allocates on the current one
  return at::detail::empty_generic(
      size, &Allocator::instance(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(
    c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
    std::optional<at::Layout>, std::optional<c10::Device> device, std::optional<bool>) {
  c10::DeviceGuard guard({kType, index_of(device)});
  return at::detail::empty_strided_generic(
      size, stride, &Allocator::instance(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
}

// A CPU tensor over the same bytes (device memory is host memory), with the
// same lazy conjugate and negative bits, which the CPU's copy then resolves.
at::Tensor on_host(const at::Tensor& t) {
  if (t.is_cpu()) return t;
  at::Tensor host =
      at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(c10::kCPU));
  if (t.is_conj()) host = host._conj();
  if (t.is_neg()) host = host._neg_view();
  return host;
}

// Every direction (host to device, device to host, device to device) is a CPU
// copy between views of the same bytes, so strides and dtype casts come for free.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  on_host(dst).copy_(on_host(self));
  return dst;
}

const at::Tensor& resize_(
    const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat> format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (format) impl->empty_tensor_restride(*format);
  const size_t nbytes = at::detail::computeStorageNbytes(
      self.sizes(), self.strides(), self.dtype().itemsize(), self.storage_offset());
  if (self.numel() > 0 && nbytes > self.storage().nbytes()) {
    resize_storage(self.storage().unsafeGetStorageImpl(), nbytes);
  }
  return self;
}

// The CPU fallback writes out= results through this.
at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Tensor& set_storage(
    at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
    c10::IntArrayRef stride) {
  at::native::checkSetStorage(self, source, offset, size, stride);
  const c10::DimVector strides =
      stride.data() ? c10::DimVector(stride) : c10::contiguous_strides(size);
  at::native::setStrided(self, size, c10::IntArrayRef(strides), offset);
  return self;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack);
}

// --- for Python: torch.ops.tdmdev.set_memory_limit(bytes) and friends ---------------

void set_memory_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "tdmdev: a memory limit is a number of bytes, or 0 for none");
  Allocator::instance().set_limit(bytes);
}

int64_t memory_limit() {
  return Allocator::instance().limit();
}

int64_t device_count() {
  return kDevices; // torch.accelerator.device_count() asks torch.tdmdev, which asks this
}

} // namespace tdmdev

TORCH_LIBRARY(tdmdev, m) {
  m.def("set_memory_limit(int bytes) -> ()", &tdmdev::set_memory_limit);
  m.def("memory_limit() -> int", &tdmdev::memory_limit);
  m.def("device_count() -> int", &tdmdev::device_count);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &tdmdev::empty);
  m.impl("empty_strided", &tdmdev::empty_strided);
  m.impl("_copy_from", &tdmdev::copy_from);
  m.impl("_copy_from_and_resize", &tdmdev::copy_from_and_resize);
  m.impl("resize_", &tdmdev::resize_);
  m.impl("set_.source_Storage_storage_offset", &tdmdev::set_storage);
  // Views must alias, which the CPU fallback cannot do: torch's own kernels only
  // touch sizes and strides, so they serve any device.
  m.impl("as_strided", &at::native::as_strided_tensorimpl);
  m.impl("view", &at::native::view);
  m.impl("_reshape_alias", &at::native::_reshape_alias);
}

// A lazily conjugated (or negated) source reaches _copy_from with its bit set, which
// on_host() carries over. Without these, torch's conjugate fallback would first
// materialise it with clone(), which copies through _copy_from again, for ever.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&tdmdev::fallback>());
}
