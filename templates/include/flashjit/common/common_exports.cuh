// The C entry points every generated library exports, whatever its op: the
// loader calls these before it trusts the library. The including header
// defines flashjit_generated::Params, the struct its run entry point takes.
#pragma once
#include <cuda_runtime.h>
#include "flashjit/common/attention_params.cuh"  // FLASHJIT_ABI_VERSION

#define FLASHJIT_EXPORT __attribute__((visibility("default")))

extern "C" {

FLASHJIT_EXPORT const char* flashjit_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

FLASHJIT_EXPORT int flashjit_abi_version(void) { return FLASHJIT_ABI_VERSION; }

// sizeof the params struct, checked by the host against its ctypes mirror.
FLASHJIT_EXPORT int flashjit_params_size(void) { return sizeof(flashjit_generated::Params); }

}  // extern "C"
