// Describes lists of torch tensors at C speed for mtapply's one-call API (mtapply/_describe.py).
//
// Each tensor becomes five 64-bit words: address of its first element, element count, a code
// for dtype, device and contiguity, and hashes of its sizes and strides. Built against the
// installed torch by mtapply/_native.py; loaded with ctypes.PyDLL (the GIL is held throughout).
#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

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

// Fills out[0..4]; false when the tensor is not a plain strided CUDA or CPU tensor of a
// supported dtype (the caller then reads the whole call through DLPack).
bool describe(const at::Tensor& t, int64_t* out) {
  if (t.layout() != c10::kStrided || t.is_neg() || t.is_conj()) return false;
  const int64_t code = dtype_code(t.scalar_type());
  const c10::Device device = t.device();
  if (code == 0 || !(device.is_cuda() || device.is_cpu())) return false;
  const int64_t place = device.is_cuda() ? device.index() + 1 : 0;
  out[0] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
  out[1] = t.numel();
  out[2] = code | (place << 8) | (static_cast<int64_t>(t.is_contiguous()) << 24);
  out[3] = hash_of(t.sizes());
  out[4] = hash_of(t.strides());
  return true;
}

}  // namespace

// Describes tensors[i] into out[5 * i .. 5 * i + 4] for every i. `tensor_type` and
// `parameter_type` are torch.Tensor and torch.nn.Parameter: only exact instances are read
// (subclasses such as DTensor may not own the memory they describe). Returns the number of
// tensors, or -1 when one of them must go through DLPack instead.
extern "C" int64_t mta_describe_torch(PyObject* tensors, int64_t* out, PyObject* tensor_type,
                                      PyObject* parameter_type) {
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
      PyObject* item = items[i];
      if (Py_TYPE(item) != reinterpret_cast<PyTypeObject*>(tensor_type) &&
          Py_TYPE(item) != reinterpret_cast<PyTypeObject*>(parameter_type)) {
        result = -1;
        break;
      }
      if (!describe(THPVariable_Unpack(item), out + 5 * i)) {
        result = -1;
        break;
      }
    }
  } catch (...) {  // e.g. a tensor without storage: DLPack explains it
    result = -1;
  }
  Py_DECREF(seq);
  return result;
}
