// MT_HOST_DEVICE: a function for the host and for CUDA device code alike (the arithmetic
// the host's reference and the device kernels share: common/*_math.h).
#pragma once

#if defined(__CUDACC__)
#define MT_HOST_DEVICE __host__ __device__
#else
#define MT_HOST_DEVICE
#endif
