// The C entry points of a generated library. The including template defines
// namespace flashjit_generated with launch(), ctas_per_sm(), kRowsPerCta and kSplitAlign first.
#pragma once
#include <cuda_runtime.h>
#include "attention_params.cuh"

#define FLASHJIT_EXPORT __attribute__((visibility("default")))

extern "C" {

FLASHJIT_EXPORT int flashjit_attention_run(const FlashjitAttentionParams* params, void* stream) {
  if (params == nullptr) return cudaErrorInvalidValue;
  return flashjit_generated::launch(*params, static_cast<cudaStream_t>(stream));
}

FLASHJIT_EXPORT const char* flashjit_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

FLASHJIT_EXPORT int flashjit_abi_version(void) { return FLASHJIT_ABI_VERSION; }

FLASHJIT_EXPORT int flashjit_params_size(void) { return sizeof(FlashjitAttentionParams); }

FLASHJIT_EXPORT int flashjit_rows_per_cta(void) { return flashjit_generated::kRowsPerCta; }

FLASHJIT_EXPORT int flashjit_split_align(void) { return flashjit_generated::kSplitAlign; }

FLASHJIT_EXPORT int flashjit_ctas_per_sm(void) { return flashjit_generated::ctas_per_sm(); }

}  // extern "C"
