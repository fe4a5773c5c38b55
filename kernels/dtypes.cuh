// Storage types and the one place where values enter and leave the fp32 (or fp64) math.
// No CUDA headers are included: NVRTC then needs no include path, on a GPU machine or off one.
#pragma once

namespace mta {

struct f16  { unsigned short bits; };
struct bf16 { unsigned short bits; };

__device__ __forceinline__ float  to_acc(float x)  { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_acc(bf16 x) {
  return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}

template <class T> struct Rounder;
template <> struct Rounder<float>  { __device__ static float  from(double x) { return static_cast<float>(x); } };
template <> struct Rounder<double> { __device__ static double from(double x) { return x; } };
template <> struct Rounder<f16> {
  __device__ static f16 from(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
  }
};
template <> struct Rounder<bf16> {
  __device__ static bf16 from(float x) {
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
  }
};

// Round an accumulator value to the storage type T (round to nearest even).
template <class T, class A>
__device__ __forceinline__ T from_acc(A x) { return Rounder<T>::from(x); }

}  // namespace mta
