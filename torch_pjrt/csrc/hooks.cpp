// Native PrivateUse1 device guard, hooks and generator, and the pjrt tensors and storages themselves.
//
// PyTorch's Python-side guard reports one device and its Python hooks have no
// generators, so autograd gets a single device queue and torch.Generator(device="pjrt")
// fails. These C++ versions are registered before the Python ones (which then skip
// their own registration). Streams and events are trivial: pjrt ops are ordered by jax.
// Storages sit at fake addresses from one allocator (also PyTorch's allocator for the device); what their DataPtrs hold, and resizing them in
// place (the hooks' resizePrivateUse1Bytes), is storage_link.cpp's.

#include <ATen/core/Generator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/profiler/stubs/base.h>
#include <torch/extension.h>

#include "native.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_set>

namespace torch_pjrt {
namespace {

constexpr c10::DeviceType kPjrt = c10::DeviceType::PrivateUse1;
constexpr int64_t kStateBytes = 2 * sizeof(uint64_t);

std::atomic<c10::DeviceIndex> device_count{1};
// The autograd engine reads the guard's count once, at the first backward of the process
// (maybe a CPU one, before jax has counted the devices), and keeps that many device queues.
std::atomic<c10::DeviceIndex> engine_devices{0};
thread_local c10::DeviceIndex current_index = 0;

c10::DeviceIndex count() {
  return device_count.load(std::memory_order_relaxed);
}

// An index the caller asked for, -1 meaning the thread's current device.
c10::DeviceIndex resolve(c10::DeviceIndex index) {
  return index < 0 ? current_index : index;
}

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(
      index >= 0 && index < count(),
      "pjrt:",
      static_cast<int>(index),
      " does not exist: this process has ",
      static_cast<int>(count()),
      " pjrt device(s) (set TORCH_PJRT_CPU_DEVICES=N for more CPU devices).");
}

c10::Stream default_stream(c10::Device device) {
  return c10::Stream(c10::Stream::DEFAULT, device);
}

struct Guard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kPjrt;
  }

  c10::Device exchangeDevice(c10::Device device) const override {
    const c10::Device previous = getDevice();
    setDevice(device);
    return previous;
  }

  c10::Device getDevice() const override {
    return c10::Device(kPjrt, current_index);
  }

  // No upper bound check: the autograd engine sets every device index below the count it
  // read at start-up from its own threads, and the count may have been lowered since.
  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kPjrt && device.index() >= 0, "expected a pjrt device with an index, got ", device);
    current_index = device.index();
  }

  void uncheckedSetDevice(c10::Device device) const noexcept override {
    current_index = device.index();
  }

  c10::Stream getStream(c10::Device device) const override {
    return default_stream(device);
  }

  c10::Stream getDefaultStream(c10::Device device) const override {
    return default_stream(device);
  }

  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*high_priority*/) const override {
    return default_stream(device);
  }

  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return default_stream(device);
  }

  // Only the default stream exists, so it is always the current one.
  c10::Stream exchangeStream(c10::Stream stream) const override {
    return default_stream(stream.device());
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    return std::max(count(), engine_devices.load(std::memory_order_relaxed));
  }

  // Events: work on one device runs in order, so every event has already happened.
  void record(void** /*event*/, const c10::Stream& /*stream*/, const c10::DeviceIndex /*index*/,
              const c10::EventFlag /*flag*/) const override {}

  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}

  bool queryEvent(void* /*event*/) const override {
    return true;
  }

  void destroyEvent(void* /*event*/, const c10::DeviceIndex /*index*/) const noexcept override {}

  void synchronizeEvent(void* /*event*/) const override {}

  bool queryStream(const c10::Stream& /*stream*/) const override {
    return true;
  }

  void synchronizeStream(const c10::Stream& /*stream*/) const override {}

  void synchronizeDevice(const c10::DeviceIndex /*index*/) const override {}
};

Guard* guard_instance() {
  static auto* instance = new Guard();
  return instance;
}

// The RNG state of a pjrt device: a seed and an offset (the counter of keys drawn).
struct PjrtGenerator final : public c10::GeneratorImpl {
  explicit PjrtGenerator(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(kPjrt, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}

  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
  }

  uint64_t current_seed() const override {
    return seed_;
  }

  uint64_t seed() override {
    set_current_seed(c10::detail::getNonDeterministicRandom());
    return seed_;
  }

  void set_offset(uint64_t offset) override {
    offset_ = offset;
  }

  uint64_t get_offset() const override {
    return offset_;
  }

  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    at::Tensor state = at::empty({kStateBytes}, at::TensorOptions().dtype(at::kByte).device(at::kCPU));
    const uint64_t values[2] = {seed_, offset_};
    std::memcpy(state.data_ptr(), values, kStateBytes);
    return state.getIntrusivePtr();
  }

  void set_state(const c10::TensorImpl& new_state) override {
    at::detail::check_rng_state(new_state);
    TORCH_CHECK(
        new_state.numel() == kStateBytes,
        "a pjrt RNG state is ",
        kStateBytes,
        " bytes (seed and offset, as returned by get_state()), got ",
        new_state.numel());
    uint64_t values[2];
    std::memcpy(values, new_state.data(), kStateBytes);
    seed_ = values[0];
    offset_ = values[1];
  }

 private:
  PjrtGenerator* clone_impl() const override {
    auto* copy = new PjrtGenerator(device().index());
    copy->seed_ = seed_;
    copy->offset_ = offset_;
    return copy;
  }

  uint64_t seed_ = c10::default_rng_seed_val;
  uint64_t offset_ = 0;
};

// The allocator PyTorch itself asks for device bytes (torch.UntypedStorage(n, device="pjrt"), a storage's
// clone): a counted storage at a fresh fake address on the thread's current device (PyTorch sets the
// guard to the storage's device first). Its device storage is attached on first use, uninitialised
// (storage_link.cpp). There are no host bytes behind the address to copy.
struct DeviceAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    TORCH_CHECK(bytes <= static_cast<size_t>(std::numeric_limits<int64_t>::max()),
                "cannot allocate ", bytes, " bytes on a pjrt device");
    const auto nbytes = static_cast<int64_t>(bytes);
    return counted_data_ptr(new_address(nbytes), c10::Device(kPjrt, current_index), nbytes);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    TORCH_CHECK(false, "pjrt storages hold no host bytes to copy; copy pjrt tensors with Tensor.copy_ instead.");
  }
};

// "Pinned" host memory for pin_memory(): ordinary host memory whose blocks are remembered, so
// is_pinned() tells them apart. PJRT copies from any host buffer; the CPU platform needs nothing more.
struct PinnedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    void* data = bytes ? c10::alloc_cpu(bytes) : nullptr;
    if (data != nullptr) {
      std::lock_guard<std::mutex> lock(mutex());
      blocks().insert(data);
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static bool owns(const void* data) {
    std::lock_guard<std::mutex> lock(mutex());
    return blocks().count(const_cast<void*>(data)) > 0;
  }

  static void release(void* data) {
    {
      std::lock_guard<std::mutex> lock(mutex());
      blocks().erase(data);
    }
    c10::free_cpu(data);
  }

  static std::mutex& mutex() {
    static std::mutex instance;
    return instance;
  }

  static std::unordered_set<void*>& blocks() {
    static auto* instance = new std::unordered_set<void*>();
    return *instance;
  }
};

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }

  bool isAvailable() const override {
    return true;
  }

  bool hasPrimaryContext(c10::DeviceIndex /*index*/) const override {
    return true;
  }

  c10::DeviceIndex deviceCount() const override {
    return count();
  }

  c10::DeviceIndex getCurrentDevice() const override {
    return current_index;
  }

  void setCurrentDevice(c10::DeviceIndex index) const override {
    check_index(index);
    current_index = index;
  }

  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    const c10::DeviceIndex previous = current_index;
    setCurrentDevice(index);
    return previous;
  }

  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override {
    return exchangeDevice(index);
  }

  // Default generators live as long as the process; std::map keeps references stable.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    const c10::DeviceIndex resolved = resolve(index);
    check_index(resolved);
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = defaults_.find(resolved);
    if (found == defaults_.end()) {
      found = defaults_.emplace(resolved, at::make_generator<PjrtGenerator>(resolved)).first;
    }
    return found->second;
  }

  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    const c10::DeviceIndex resolved = resolve(index);
    check_index(resolved);
    return at::make_generator<PjrtGenerator>(resolved);
  }

  // pjrt storages hold fake addresses, so a pointer alone cannot name its device.
  at::Device getDeviceFromPtr(void* /*data*/) const override {
    return c10::Device(kPjrt, 0);
  }

  at::Allocator* getPinnedMemoryAllocator() const override {
    static PinnedAllocator allocator;
    return &allocator;
  }

  bool isPinnedPtr(const void* data) const override {
    return PinnedAllocator::owns(data);
  }

  // untyped_storage().resize_(n), as FSDP2 frees (n = 0) and re-allocates its unsharded parameters.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage(storage.unsafeGetStorageImpl(), newsize);
  }

  mutable std::mutex mutex_;
  mutable std::map<c10::DeviceIndex, at::Generator> defaults_;
};

Hooks* hooks_instance() {
  static auto* instance = new Hooks();
  return instance;
}

// The PrivateUse1 stubs of PyTorch's legacy profiler mode (torch.autograd.profiler.profile with
// use_device="pjrt" and no kineto), which calls them around every op: without any, each op's record
// fails and the profile's CPU times come out negative. They time nothing per op: torch_pjrt/profiler.py
// times whole programs and adds those to the profile in every mode.
struct ProfilerStubs final : torch::profiler::impl::ProfilerStubs {
  void record(c10::DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* /*event*/,
              int64_t* cpu_ns) const override {
    if (device != nullptr) {
      *device = current_index;
    }
    if (cpu_ns != nullptr) {
      *cpu_ns = c10::getTime();
    }
  }
  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* /*start*/,
                const torch::profiler::impl::ProfilerVoidEventStub* /*end*/) const override {
    return 0;
  }
  void mark(const char* /*name*/) const override {}
  void rangePush(const char* /*name*/) const override {}
  void rangePop() const override {}
  bool enabled() const override {
    return true;
  }
  void onEachDevice(std::function<void(int)> op) const override {
    for (c10::DeviceIndex index = 0; index < count(); ++index) {
      op(index);
    }
  }
  void synchronize() const override {}
};

ProfilerStubs* profiler_stubs_instance() {
  static auto* instance = new ProfilerStubs();
  return instance;
}

c10::DeviceIndex checked_count(int64_t n) {
  TORCH_CHECK(n >= 0 && n <= std::numeric_limits<c10::DeviceIndex>::max(), "invalid pjrt device count ", n);
  return static_cast<c10::DeviceIndex>(n);
}

void set_device_count(int64_t n) {
  device_count.store(checked_count(n), std::memory_order_relaxed);
}

bool installed() {
  return c10::impl::hasDeviceGuardImpl(kPjrt) && c10::impl::getDeviceGuardImpl(kPjrt) == guard_instance() &&
      at::isPrivateUse1HooksRegistered() && &at::detail::getPrivateUse1Hooks() == hooks_instance();
}

// Registers the guard and hooks unless PrivateUse1 already has some; true when ours are in use.
bool install(int64_t n, int64_t engine_n) {
  set_device_count(n);
  engine_devices.store(checked_count(engine_n), std::memory_order_relaxed);
  if (!c10::impl::hasDeviceGuardImpl(kPjrt)) {
    c10::impl::registerDeviceGuard(kPjrt, guard_instance());
  }
  if (!at::isPrivateUse1HooksRegistered()) {
    at::RegisterPrivateUse1HooksInterface(hooks_instance());
  }
  static DeviceAllocator allocator;
  c10::SetAllocator(kPjrt, &allocator);
  if (installed() && !torch::profiler::impl::privateuse1Stubs()->enabled()) {
    torch::profiler::impl::registerPrivateUse1Methods(profiler_stubs_instance());
  }
  return installed();
}

py::object default_generator(int64_t index) {
  TORCH_CHECK(installed(), "torch_pjrt._hooks.install() has not registered the pjrt hooks.");
  const at::Generator& generator = hooks_instance()->getDefaultGenerator(static_cast<c10::DeviceIndex>(index));
  return py::reinterpret_steal<py::object>(THPGenerator_Wrap(generator));
}

// A pjrt tensor over a new non-owning storage at a fake address: what the Python path builds
// from a template tensor with two redispatched ops, in one call (every op's outputs need one).
at::Tensor new_tensor(
    int64_t index,
    py::handle dtype,
    std::vector<int64_t> sizes,
    std::vector<int64_t> strides,
    int64_t address,
    int64_t nbytes) {
  TORCH_CHECK(THPDtype_Check(dtype.ptr()), "new_tensor expects a torch.dtype");
  TORCH_CHECK(sizes.size() == strides.size(), "new_tensor: sizes and strides differ in length");
  const auto scalar_type = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
  return make_tensor(static_cast<c10::DeviceIndex>(index), scalar_type, sizes, strides, address, nbytes);
}

constexpr int64_t kAddressBase = int64_t{1} << 52;
constexpr int64_t kAlign = 64;
std::atomic<int64_t> next_address{kAddressBase};

c10::Storage counted_storage(c10::Device device, int64_t address, int64_t nbytes) {
  return c10::Storage(
      c10::Storage::use_byte_size_t(),
      static_cast<size_t>(nbytes),
      counted_data_ptr(address, device, nbytes),
      /*allocator=*/nullptr,
      /*resizable=*/false);
}

// A storage alone (resize_ gives a tensor a new one), counted like a tensor's.
py::object new_storage(int64_t index, int64_t address, int64_t nbytes) {
  const c10::Device device(kPjrt, static_cast<c10::DeviceIndex>(index));
  return py::reinterpret_steal<py::object>(THPStorage_Wrap(counted_storage(device, address, nbytes)));
}

}  // namespace

int64_t address_span(int64_t nbytes) {
  return std::max(kAlign, (nbytes + kAlign - 1) / kAlign * kAlign);
}

int64_t new_address(int64_t nbytes) {
  return next_address.fetch_add(address_span(nbytes), std::memory_order_relaxed);
}

at::Tensor make_tensor(
    c10::DeviceIndex index,
    c10::ScalarType scalar_type,
    c10::IntArrayRef sizes,
    c10::IntArrayRef strides,
    int64_t address,
    int64_t nbytes) {
  c10::Storage storage = counted_storage(c10::Device(kPjrt, index), address, nbytes);
  auto tensor = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::scalarTypeToTypeMeta(scalar_type));
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
  return tensor;
}

}  // namespace torch_pjrt

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native PrivateUse1 guard, hooks and generator of the pjrt device.";
  m.def("install", &torch_pjrt::install, py::arg("device_count"), py::arg("engine_devices") = 0,
        "Register the guard and hooks (before the Python registration); True when they are in use. "
        "The autograd engine is shown at least engine_devices devices.");
  m.def("installed", &torch_pjrt::installed, "Whether this module's guard and hooks serve PrivateUse1.");
  m.def("set_device_count", &torch_pjrt::set_device_count, py::arg("n"), "Set the device count the guard reports.");
  m.def("device_count", []() { return static_cast<int64_t>(torch_pjrt::count()); });
  m.def("new_tensor", &torch_pjrt::new_tensor, py::arg("index"), py::arg("dtype"), py::arg("sizes"),
        py::arg("strides"), py::arg("address"), py::arg("nbytes"),
        "A pjrt tensor over a new non-owning storage at a fake address.");
  m.def("new_address", &torch_pjrt::new_address, py::arg("nbytes"),
        "A fresh fake address for a storage of nbytes (unique for the process).");
  m.def("new_storage", &torch_pjrt::new_storage, py::arg("index"), py::arg("address"), py::arg("nbytes"),
        "A pjrt storage at a fake address, counted in the device's memory figures.");
  torch_pjrt::init_storage_link(m);
  torch_pjrt::init_dispatch(m);
  m.def("default_generator", &torch_pjrt::default_generator, py::arg("index"),
        "The default torch.Generator of pjrt:index.");
}
