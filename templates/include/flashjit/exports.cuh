// The C entry points of a generated library. The including template defines
// namespace flashjit_generated with launch() and kRowsPerCta first.
#pragma once
#include <cuda_runtime.h>
#include "attention_params.cuh"

extern "C" {

int flashjit_attention_run(const FlashjitAttentionParams* params, void* stream) {
  if (params == nullptr) return cudaErrorInvalidValue;
  return flashjit_generated::launch(*params, static_cast<cudaStream_t>(stream));
}

const char* flashjit_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

int flashjit_abi_version(void) { return FLASHJIT_ABI_VERSION; }

int flashjit_rows_per_cta(void) { return flashjit_generated::kRowsPerCta; }

}  // extern "C"
