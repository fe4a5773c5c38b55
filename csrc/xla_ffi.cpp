// The XLA FFI handler of mtapply.optax: runs mtapply's kernels inside jax.jit with no Python.
//
// At trace time mtapply.optax (mtapply/_xla.py) prepares a plan: per GPU, the kernels compiled
// by NVRTC, the block map and records in device memory, and the argument words of each launch
// (mtapply/engine.py, _Launcher). It registers the plan here and names it in the custom call.
// At each step XLA calls `mta_ffi_step` with the buffers (results first, then arguments): the
// handler compares every buffer's address with the records it uploaded last, copies the records
// that moved on XLA's stream, writes the addresses of the scalar operands (learning rate, step,
// global norm) into the argument words and launches every pass over every group on that stream.
//
// Several devices. One compiled program runs the same call on every device of a jax.pmap, a
// shard_map or a sharded jit, each on its own stream, at once. A plan holds kernels, tables and
// workspaces per GPU (made for every local GPU when the step is traced), and the handler takes
// those of the GPU that XLA's stream belongs to, asked from the stream itself: every address it
// launches with is then of that GPU. It checks what could make it read or write outside its
// own memory (the call's buffer count against the plan's, the GPU's part of the plan) and returns
// an error instead, and it leaves the thread's current CUDA context as XLA set it.
//
// The CUDA driver is opened at run time (dlopen), so building needs only the XLA FFI headers.
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct CUstream_st;
using CUstream = CUstream_st*;
using CUresult = int;
using CUfunction = void*;
using CUevent = void*;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;

// The driver entry points the handler uses, found in libcuda at the first call.
struct Driver {
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                     unsigned, CUstream, void**, void**) = nullptr;
  CUresult (*copy_to_device)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*event_create)(CUevent*, unsigned) = nullptr;
  CUresult (*event_record)(CUevent, CUstream) = nullptr;
  CUresult (*stream_wait)(CUstream, CUevent, unsigned) = nullptr;
  CUresult (*stream_context)(CUstream, CUcontext*) = nullptr;
  CUresult (*current_context)(CUcontext*) = nullptr;
  CUresult (*set_context)(CUcontext) = nullptr;
  CUresult (*context_device)(int*) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  std::string problem;

  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) {
      problem = "the CUDA driver (libcuda.so.1) could not be opened";
      return;
    }
    find(lib, launch, "cuLaunchKernel");
    find(lib, copy_to_device, "cuMemcpyHtoDAsync_v2");
    find(lib, event_create, "cuEventCreate");
    find(lib, event_record, "cuEventRecord");
    find(lib, stream_wait, "cuStreamWaitEvent");
    find(lib, stream_context, "cuStreamGetCtx");
    find(lib, current_context, "cuCtxGetCurrent");
    find(lib, set_context, "cuCtxSetCurrent");
    find(lib, context_device, "cuCtxGetDevice");
    find(lib, error_string, "cuGetErrorString");
  }

  template <class F>
  void find(void* lib, F& function, const char* name) {
    function = reinterpret_cast<F>(dlsym(lib, name));
    if (function == nullptr && problem.empty()) problem = std::string("libcuda has no ") + name;
  }
};

const Driver& driver() {
  static const Driver instance;
  return instance;
}

std::string describe_error(const char* what, CUresult code) {
  const char* text = nullptr;
  if (driver().error_string != nullptr) driver().error_string(code, &text);
  return std::string("mtapply: ") + what + " failed: " + (text ? text : std::to_string(code));
}

// One launch group (tensors of one dtype signature) of a plan on one device.
struct Group {
  std::vector<CUfunction> functions;  // one per pass
  unsigned blocks = 0;
  unsigned threads = 0;               // per block
  std::vector<uint64_t> words;        // the kernel's argument struct
  CUdeviceptr records = 0;            // device address of the records
  int slots = 0;                      // addresses per record
  std::vector<int64_t> shadow;        // the records as last uploaded: numel, then addresses
  std::vector<int32_t> operands;      // per tensor and slot: index into the call's buffers
  std::vector<int64_t> offsets;       // per tensor and slot: bytes from that buffer's start
};

struct DevicePlan {
  std::mutex lock;
  std::vector<Group> groups;
  int passes = 0;
  CUstream last_stream = nullptr;
  CUevent done = nullptr;
};

struct Plan {
  std::vector<int64_t> elements;         // per buffer of the call (results, then arguments)
  std::vector<int32_t> scalar_words;     // argument word receiving each scalar's address
  std::vector<int32_t> scalar_operands;  // the scalar's index among the call's buffers
  std::unordered_map<int, std::unique_ptr<DevicePlan>> devices;
};

std::mutex registry_lock;
std::unordered_map<int64_t, std::unique_ptr<Plan>> registry;
int64_t next_id = 1;

Plan* find_plan(int64_t id) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto it = registry.find(id);
  return it == registry.end() ? nullptr : it->second.get();
}

DevicePlan* find_device(Plan* plan, int device) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto it = plan->devices.find(device);
  return it == plan->devices.end() ? nullptr : it->second.get();
}

// Writes the call's addresses into the group's shadow records; returns the span of words
// that changed, [first, end), empty when nothing moved.
std::pair<size_t, size_t> refresh(Group& group, void* const* addresses) {
  const size_t stride = group.slots + 1;
  const size_t tensors = group.shadow.size() / stride;
  size_t first = group.shadow.size(), end = 0;
  for (size_t t = 0; t < tensors; ++t) {
    int64_t* record = group.shadow.data() + t * stride + 1;
    const int32_t* operand = group.operands.data() + t * group.slots;
    const int64_t* offset = group.offsets.data() + t * group.slots;
    for (int s = 0; s < group.slots; ++s) {
      const int64_t address =
          static_cast<int64_t>(reinterpret_cast<uintptr_t>(addresses[operand[s]])) + offset[s];
      if (record[s] != address) {
        record[s] = address;
        const size_t word = t * stride + 1 + s;
        first = std::min(first, word);
        end = std::max(end, word + 1);
      }
    }
  }
  return {first, end};
}

// The addresses of a call's buffers: results first, then arguments. `mismatch` is the first
// buffer whose element count is not the plan's (the step would walk past its end), or -1.
class Buffers {
 public:
  Buffers(const ffi::RemainingRets& rets, const ffi::RemainingArgs& args,
          const std::vector<int64_t>& elements) {
    Rets r(rets);
    Args a(args);
    addresses_.reserve(r.size() + a.size());
    for (size_t i = 0; i < r.size(); ++i) add(r.buffer(i), elements);
    for (size_t i = 0; i < a.size(); ++i) add(a.buffer(i), elements);
  }
  void* const* data() const { return addresses_.data(); }
  size_t size() const { return addresses_.size(); }
  int64_t mismatch() const { return mismatch_; }
  int64_t found() const { return found_; }

 private:
  void add(const XLA_FFI_Buffer* buffer, const std::vector<int64_t>& elements) {
    int64_t count = 1;
    for (int64_t d = 0; d < buffer->rank; ++d) count *= buffer->dims[d];
    if (mismatch_ < 0 && count != elements[addresses_.size()]) {
      mismatch_ = static_cast<int64_t>(addresses_.size());
      found_ = count;
    }
    addresses_.push_back(buffer->data);
  }
  // Raw access to the call frame: decoding each buffer through `get` costs more than the
  // whole step on large trees.
  struct Args : ffi::RemainingArgs {
    explicit Args(const ffi::RemainingArgs& base) : ffi::RemainingArgs(base) {}
    const XLA_FFI_Buffer* buffer(size_t i) const {
      return static_cast<XLA_FFI_Buffer*>(args()->args[offset() + i]);
    }
  };
  struct Rets : ffi::RemainingRets {
    explicit Rets(const ffi::RemainingRets& base) : ffi::RemainingRets(base) {}
    const XLA_FFI_Buffer* buffer(size_t i) const {
      return static_cast<XLA_FFI_Buffer*>(rets()->rets[offset() + i]);
    }
  };
  std::vector<void*> addresses_;
  int64_t mismatch_ = -1, found_ = 0;
};

// The stream's context made current for the handler's driver calls; the caller's restored after.
class StreamContext {
 public:
  explicit StreamContext(CUstream stream) {
    const Driver& cu = driver();
    if ((error_ = cu.stream_context(stream, &wanted_))) return;
    cu.current_context(&previous_);
    if (previous_ != wanted_ && (error_ = cu.set_context(wanted_))) return;
    error_ = cu.context_device(&device_);
  }
  ~StreamContext() {
    if (previous_ != wanted_ && previous_ != nullptr) driver().set_context(previous_);
  }
  CUresult error() const { return error_; }
  int device() const { return device_; }  // the GPU of the stream (the driver's ordinal)

 private:
  CUcontext wanted_ = nullptr, previous_ = nullptr;
  CUresult error_ = 0;
  int device_ = -1;
};

ffi::Error run(Plan& plan, DevicePlan& device, CUstream stream, const Buffers& buffers) {
  const Driver& cu = driver();
  if (device.done == nullptr) {
    if (CUresult e = cu.event_create(&device.done, 2 /* CU_EVENT_DISABLE_TIMING */))
      return ffi::Error::Internal(describe_error("cuEventCreate", e));
  }
  if (device.last_stream != nullptr && device.last_stream != stream) {
    // the records may still be read by the last launches, on another stream
    if (CUresult e = cu.stream_wait(stream, device.done, 0)) return ffi::Error::Internal(describe_error("cuStreamWaitEvent", e));
  }
  for (Group& group : device.groups) {
    const auto [first, end] = refresh(group, buffers.data());
    if (first < end) {
      // From pageable memory the copy returns once the words are staged: the shadow may change.
      CUresult e = cu.copy_to_device(group.records + first * sizeof(int64_t), group.shadow.data() + first,
                                     (end - first) * sizeof(int64_t), stream);
      if (e) return ffi::Error::Internal(describe_error("cuMemcpyHtoDAsync", e));
    }
    for (size_t k = 0; k < plan.scalar_words.size(); ++k)
      group.words[plan.scalar_words[k]] = reinterpret_cast<uintptr_t>(buffers.data()[plan.scalar_operands[k]]);
  }
  for (int pass = 0; pass < device.passes; ++pass) {
    for (Group& group : device.groups) {
      if (group.blocks == 0) continue;
      void* params[] = {group.words.data()};
      CUresult e = cu.launch(group.functions[pass], group.blocks, 1, 1, group.threads, 1, 1, 0, stream, params, nullptr);
      if (e) return ffi::Error::Internal(describe_error("cuLaunchKernel", e));
    }
  }
  if (CUresult e = cu.event_record(device.done, stream)) return ffi::Error::Internal(describe_error("cuEventRecord", e));
  device.last_stream = stream;
  return ffi::Error::Success();
}

ffi::Error step(CUstream stream, int64_t plan_id, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (!driver().problem.empty()) return ffi::Error::Internal("mtapply: " + driver().problem);
  Plan* plan = find_plan(plan_id);
  if (plan == nullptr) return ffi::Error::Internal("mtapply: no plan " + std::to_string(plan_id) + " is registered");
  if (args.size() + rets.size() != plan->elements.size())
    return ffi::Error::InvalidArgument("mtapply: plan " + std::to_string(plan_id) + " steps a call of " +
                                       std::to_string(plan->elements.size()) + " buffers, this one has " +
                                       std::to_string(args.size() + rets.size()));
  const Buffers buffers(rets, args, plan->elements);
  if (buffers.mismatch() >= 0)
    return ffi::Error::InvalidArgument(
        "mtapply: buffer " + std::to_string(buffers.mismatch()) + " of the call has " +
        std::to_string(buffers.found()) + " elements, plan " + std::to_string(plan_id) + " was made for " +
        std::to_string(plan->elements[buffers.mismatch()]) +
        " (was the call partitioned? mtapply steps whole buffers: shard with shard_map or pmap)");
  const StreamContext context(stream);
  if (context.error()) return ffi::Error::Internal(describe_error("finding the GPU of XLA's stream", context.error()));
  DevicePlan* device = find_device(plan, context.device());
  if (device == nullptr)
    return ffi::Error::Internal("mtapply: the plan has no kernels for GPU " + std::to_string(context.device()) +
                                " (it was prepared for the GPUs local when the step was traced)");
  std::lock_guard<std::mutex> guard(device->lock);
  return run(*plan, *device, stream, buffers);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(mta_ffi_step, step,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Attr<int64_t>("plan")
                                  .RemainingArgs()
                                  .RemainingRets());

// ---- Registration, called through ctypes by mtapply/_xla.py --------------------------------

// A new plan of a call of `buffers` buffers (results, then arguments) of `elements` elements
// each; `scalar_words[k]` is the argument word that receives the address of the call's buffer
// `scalar_operands[k]` (a one-element float32 array). Returns its id, or -1 for a scalar
// operand outside the buffers.
extern "C" int64_t mta_plan_create(int32_t n_scalars, const int32_t* scalar_words,
                                   const int32_t* scalar_operands, int32_t buffers,
                                   const int64_t* elements) {
  for (int k = 0; k < n_scalars; ++k)
    if (scalar_operands[k] < 0 || scalar_operands[k] >= buffers) return -1;
  auto plan = std::make_unique<Plan>();
  plan->elements.assign(elements, elements + buffers);
  plan->scalar_words.assign(scalar_words, scalar_words + n_scalars);
  plan->scalar_operands.assign(scalar_operands, scalar_operands + n_scalars);
  std::lock_guard<std::mutex> guard(registry_lock);
  const int64_t id = next_id++;
  registry[id] = std::move(plan);
  return id;
}

// Adds a launch group on `device`: its kernel (one function per pass), grid, threads per block,
// argument words, the device address of its records, and per tensor its element count and, for each slot, the
// call's buffer holding it and its byte offset there (several tensors may share one buffer).
// Returns 0, -1 for an unknown plan, or -2 for a buffer index outside the call's buffers.
extern "C" int32_t mta_plan_add_group(int64_t plan_id, int32_t device, int32_t passes,
                                      const uint64_t* functions, uint32_t blocks, uint32_t threads,
                                      int32_t n_words,
                                      const uint64_t* words, uint64_t records, int32_t tensors,
                                      int32_t slots, const int64_t* numels, const int32_t* operands,
                                      const int64_t* offsets) {
  Plan* plan = find_plan(plan_id);
  if (plan == nullptr) return -1;
  for (size_t k = 0; k < static_cast<size_t>(tensors) * slots; ++k)
    if (operands[k] < 0 || static_cast<size_t>(operands[k]) >= plan->elements.size()) return -2;
  Group group;
  for (int p = 0; p < passes; ++p) group.functions.push_back(reinterpret_cast<CUfunction>(functions[p]));
  group.blocks = blocks;
  group.threads = threads;
  group.words.assign(words, words + n_words);
  group.records = records;
  group.slots = slots;
  group.shadow.assign(static_cast<size_t>(tensors) * (slots + 1), 0);
  for (int t = 0; t < tensors; ++t) group.shadow[static_cast<size_t>(t) * (slots + 1)] = numels[t];
  group.operands.assign(operands, operands + static_cast<size_t>(tensors) * slots);
  group.offsets.assign(offsets, offsets + static_cast<size_t>(tensors) * slots);
  std::lock_guard<std::mutex> guard(registry_lock);
  auto& entry = plan->devices[device];
  if (!entry) entry = std::make_unique<DevicePlan>();
  entry->passes = passes;
  entry->groups.push_back(std::move(group));
  return 0;
}

extern "C" void mta_plan_destroy(int64_t plan_id) {
  std::lock_guard<std::mutex> guard(registry_lock);
  registry.erase(plan_id);
}

// What a step would upload, without CUDA: refreshes every group of the plan on `device` from
// `addresses` (the call's buffers) and writes each group's changed span [first, end) into
// `spans`. Returns the number of groups, or -1 for an unknown plan or device.
extern "C" int32_t mta_plan_refresh(int64_t plan_id, int32_t device, void* const* addresses, int64_t* spans) {
  Plan* plan = find_plan(plan_id);
  DevicePlan* entry = plan ? find_device(plan, device) : nullptr;
  if (entry == nullptr) return -1;
  std::lock_guard<std::mutex> guard(entry->lock);
  for (size_t g = 0; g < entry->groups.size(); ++g) {
    const auto [first, end] = refresh(entry->groups[g], addresses);
    spans[2 * g] = first < end ? static_cast<int64_t>(first) : 0;
    spans[2 * g + 1] = first < end ? static_cast<int64_t>(end) : 0;
  }
  return static_cast<int32_t>(entry->groups.size());
}

// Copies group `group`'s shadow records (tensors * (slots + 1) words) into `out`.
extern "C" int32_t mta_plan_records(int64_t plan_id, int32_t device, int32_t group, int64_t* out) {
  Plan* plan = find_plan(plan_id);
  DevicePlan* entry = plan ? find_device(plan, device) : nullptr;
  if (entry == nullptr || group < 0 || group >= static_cast<int32_t>(entry->groups.size())) return -1;
  std::lock_guard<std::mutex> guard(entry->lock);
  const auto& shadow = entry->groups[group].shadow;
  std::copy(shadow.begin(), shadow.end(), out);
  return 0;
}
