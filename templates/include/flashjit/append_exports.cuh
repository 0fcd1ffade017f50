// The C entry points of a generated append library. The including template
// defines namespace flashjit_generated with launch() first.
#pragma once
#include <cuda_runtime.h>
#include "append_paged.cuh"

#define FLASHJIT_EXPORT __attribute__((visibility("default")))

extern "C" {

FLASHJIT_EXPORT int flashjit_append_run(const FlashjitAppendParams* params, void* stream) {
  if (params == nullptr) return cudaErrorInvalidValue;
  return flashjit_generated::launch(*params, static_cast<cudaStream_t>(stream));
}

FLASHJIT_EXPORT const char* flashjit_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

FLASHJIT_EXPORT int flashjit_abi_version(void) { return FLASHJIT_ABI_VERSION; }

// sizeof(FlashjitAppendParams), checked by the host against its mirror.
FLASHJIT_EXPORT int flashjit_params_size(void) { return sizeof(FlashjitAppendParams); }

}  // extern "C"
