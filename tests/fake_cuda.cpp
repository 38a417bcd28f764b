// A CUDA device for a CPU-only torch, for tests/cuda_dry.py: nothing runs on it.
//
// FakeTensorMode makes tensors on device "cuda" without a GPU, but a CPU build has no
// CUDA device guard (indexing, .contiguous() and autograd ask for one: "PyTorch is not
// linked with support for cuda devices") and its CUDA hooks say CUDA is not built
// (autograd's engine asks at::getAccelerator(), which then refuses). This registers c10's
// FakeGuardImpl for CUDA (device index and stream bookkeeping only) and CUDA hooks that
// say "built, available, initialised". Loaded before `import torch` (the hooks are read
// once, at torch's start); never loaded by the library or by a normal test process.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace c10::impl {
C10_REGISTER_GUARD_IMPL(CUDA, FakeGuardImpl<DeviceType::CUDA>);
}  // namespace c10::impl

namespace at {
struct CtxparFakeCUDAHooks : CUDAHooksInterface {
  explicit CtxparFakeCUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
};
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, CtxparFakeCUDAHooks);
}  // namespace at
