// Describes lists of torch tensors at C speed for mtapply's one-call API (mtapply/_describe.py),
// checks that a param group of mtapply.torch is still as its plans were bound, and moves the
// version counters of the params a step wrote (mtapply/_torch_binding.py); reads which params
// require grad (mtapply/_flat_grads.py).
//
// Each tensor becomes five 64-bit words: address of its first element, element count, a code
// for dtype, device and contiguity, and hashes of its sizes and strides. Built against the
// installed torch by mtapply/_native.py; loaded with ctypes.PyDLL (the GIL is held throughout).
#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>

namespace {

// The codes of mtapply/_describe.py: 1 float32, 2 float16, 3 bfloat16, 4 float64, 5 uint8;
// 0 other.
int64_t dtype_code(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return 1;
    case c10::ScalarType::Half: return 2;
    case c10::ScalarType::BFloat16: return 3;
    case c10::ScalarType::Double: return 4;
    case c10::ScalarType::Byte: return 5;
    default: return 0;
  }
}

int64_t hash_of(c10::IntArrayRef values) {
  uint64_t h = 1469598103934665603ull ^ values.size();  // FNV-1a over the words
  for (int64_t v : values) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  return static_cast<int64_t>(h);
}

// Fills out[0..2] (address, element count, dtype, device and contiguity); false when the
// tensor is not a plain strided CUDA or CPU tensor of a supported dtype (the caller then reads
// the whole call through DLPack).
bool describe_head(const at::Tensor& t, int64_t* out) {
  if (t.layout() != c10::kStrided || t.is_neg() || t.is_conj()) return false;
  const int64_t code = dtype_code(t.scalar_type());
  const c10::Device device = t.device();
  if (code == 0 || !(device.is_cuda() || device.is_cpu())) return false;
  const int64_t place = device.is_cuda() ? device.index() + 1 : 0;
  out[0] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
  out[1] = t.numel();
  out[2] = code | (place << 8) | (static_cast<int64_t>(t.is_contiguous()) << 24);
  return true;
}

// Fills out[0..4]: the head, then hashes of the sizes and strides.
bool describe(const at::Tensor& t, int64_t* out) {
  if (!describe_head(t, out)) return false;
  out[3] = hash_of(t.sizes());
  out[4] = hash_of(t.strides());
  return true;
}

// Calls visit(tensor, i) for every item of a sequence while it returns true; each item must be
// an exact torch.Tensor or torch.nn.Parameter (subclasses such as DTensor may not own the memory
// they describe). Returns the count, or -1 where an item is of another type, visit returned
// false or threw (e.g. a tensor without storage; DLPack or the Python path then explains it).
template <class Visit>
int64_t for_each_tensor(PyObject* tensors, PyObject* tensor_type, PyObject* parameter_type,
                        Visit visit) {
  PyObject* seq = PySequence_Fast(tensors, "expected a sequence");
  if (seq == nullptr) {
    PyErr_Clear();
    return -1;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  int64_t result = n;
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      if ((Py_TYPE(items[i]) != reinterpret_cast<PyTypeObject*>(tensor_type) &&
           Py_TYPE(items[i]) != reinterpret_cast<PyTypeObject*>(parameter_type)) ||
          !visit(THPVariable_Unpack(items[i]), i)) {
        result = -1;
        break;
      }
    }
  } catch (...) {
    result = -1;
  }
  Py_DECREF(seq);
  return result;
}

}  // namespace

// Describes tensors[i] into out[5 * i .. 5 * i + 4] for every i (only exact torch.Tensor and
// torch.nn.Parameter instances, `tensor_type` and `parameter_type`). Returns the number of
// tensors, or -1 when one of them must go through DLPack instead.
extern "C" int64_t mta_describe_torch(PyObject* tensors, int64_t* out, PyObject* tensor_type,
                                      PyObject* parameter_type) {
  return for_each_tensor(tensors, tensor_type, parameter_type,
                         [out](const at::Tensor& t, Py_ssize_t i) { return describe(t, out + 5 * i); });
}

// Whether a param group is as its plans were bound: params[i] is bound[i] (the same Python
// object) at the address addresses[i], and its grad is defined and described by the first
// three of grad_words[5 * i .. 5 * i + 4] (as mta_describe_torch describes it: address, numel,
// dtype, device and contiguity; the kernels read a contiguous tensor as its elements, whatever
// its shape). Returns -1 when all n hold, else the first i that differs (or -2 where the lists
// are not n long).
extern "C" int64_t mta_check_binding(PyObject* params, PyObject* bound, const int64_t* addresses,
                                     const int64_t* grad_words, int64_t n) {
  PyObject* seq = PySequence_Fast(params, "expected a sequence");
  if (seq == nullptr) {
    PyErr_Clear();
    return -2;
  }
  PyObject* held = PySequence_Fast(bound, "expected a sequence");
  if (held == nullptr) {
    PyErr_Clear();
    Py_DECREF(seq);
    return -2;
  }
  int64_t result = -1;
  if (PySequence_Fast_GET_SIZE(seq) != n || PySequence_Fast_GET_SIZE(held) != n) result = -2;
  PyObject** items = PySequence_Fast_ITEMS(seq);
  PyObject** kept = PySequence_Fast_ITEMS(held);
  try {
    int64_t words[3];
    for (int64_t i = 0; result == -1 && i < n; ++i) {
      if (items[i] != kept[i]) {
        result = i;
        break;
      }
      const at::Tensor& param = THPVariable_Unpack(items[i]);
      const at::Tensor& grad = param.grad();
      if (reinterpret_cast<int64_t>(param.const_data_ptr()) != addresses[i] || !grad.defined() ||
          !describe_head(grad, words)) {
        result = i;
        break;
      }
      for (int k = 0; k < 3; ++k) {
        if (words[k] != grad_words[5 * i + k]) {
          result = i;
          break;
        }
      }
    }
  } catch (...) {  // a param without storage, ...: the Python path explains it
    result = 0;
  }
  Py_DECREF(held);
  Py_DECREF(seq);
  return result;
}

// Whether tensors[i].requires_grad() is flags[i] (one byte each) for every i: the count where
// all are, else -1 (one differs, or an item is not an exact torch.Tensor or
// torch.nn.Parameter: the caller then reads the flags in Python). mtapply/_flat_grads.py
// scans its params with it at every step, to find the ones frozen or unfrozen since.
extern "C" int64_t mta_requires_grad_is(PyObject* tensors, const uint8_t* flags,
                                        PyObject* tensor_type, PyObject* parameter_type) {
  return for_each_tensor(tensors, tensor_type, parameter_type,
                         [flags](const at::Tensor& t, Py_ssize_t i) {
                           return t.requires_grad() == static_cast<bool>(flags[i]);
                         });
}

// Moves the version counter of every tensor of a sequence, as an in-place op on it does (so
// that autograd refuses a backward through a graph that saved it before). Returns the count,
// or -1 where an item is not an exact torch.Tensor or torch.nn.Parameter (nothing moved from it on).
extern "C" int64_t mta_bump_versions(PyObject* tensors, PyObject* tensor_type,
                                     PyObject* parameter_type) {
  return for_each_tensor(tensors, tensor_type, parameter_type, [](const at::Tensor& t, Py_ssize_t) {
    torch::autograd::impl::bump_version(t);
    return true;
  });
}
