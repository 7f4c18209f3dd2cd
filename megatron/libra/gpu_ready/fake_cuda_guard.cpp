// A CUDA device guard for a CPU-only PyTorch, so that fake CUDA tensors (FakeTensorMode) can be
// sliced, copied, moved and differentiated through code that opens a device guard or records
// stream events. Nothing runs on a device: every call answers device 0, the default stream,
// and events that are always complete. Loaded only by the GPU-readiness gate
// (libra_ext.gpu_ready.harness), never into a training process, and refused where a real GPU
// is present.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

namespace {

template <c10::DeviceType kType>
struct FakeGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device) const override { return device0(); }
  c10::Device getDevice() const override { return device0(); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}

 private:
  static c10::Device device0() { return c10::Device(kType, 0); }
};

C10_REGISTER_GUARD_IMPL(CUDA, FakeGuard<c10::DeviceType::CUDA>);

// CUDA hooks that say CUDA is present (one device, current device 0, its context made) and
// nothing else: the autograd engine asks them which device type is "the accelerator" and
// whether its context exists before it stashes streams for a backward through device tensors.
// Anything that needs the CUDA runtime itself still raises. Registered above the default
// priority, so they also replace the hooks of a CUDA build of PyTorch on a machine without a
// GPU (whose own hooks find no device); they take effect only if nothing in the process asked
// for CUDA hooks before this library was loaded; install() says whether they did. The guard
// above likewise replaces a CUDA build's (install() registers it again once torch is loaded).
struct CUDAHooks_ final : at::CUDAHooksInterface {
  explicit CUDAHooks_(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  c10::DeviceIndex current_device() const override { return 0; }
  int getNumGPUs() const override { return 1; }
};

bool install() {
  // a CUDA build's own guard registers when its CUDA library loads, which may come after this
  // library's static registration: register this one again, now that torch is loaded
  static FakeGuard<c10::DeviceType::CUDA> guard;
  c10::impl::DeviceGuardImplRegistrar again(c10::DeviceType::CUDA, &guard);
  return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) &&
         c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount() == 1 &&
         at::detail::getCUDAHooks().hasPrimaryContext(0);
}

}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(CUDAHooksRegistry, "CUDAHooks", c10::REGISTRY_PREFERRED,
                                       ::CUDAHooks_);
}  // namespace at

bool registry_has() { return at::CUDAHooksRegistry()->Has("CUDAHooks"); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("registry_has", &registry_has);
  m.def("install", &install, "Register the placeholder hooks; whether a CUDA guard is in place.");
}
