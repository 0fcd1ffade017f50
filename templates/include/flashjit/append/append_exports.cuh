// The C entry points of a generated append library. The including template
// defines namespace flashjit_generated with launch() first.
#pragma once
#include "flashjit/append/append_paged.cuh"

namespace flashjit_generated {
using Params = FlashjitAppendParams;
}  // namespace flashjit_generated

#include "flashjit/common/common_exports.cuh"

extern "C" {

FLASHJIT_EXPORT int flashjit_append_run(const FlashjitAppendParams* params, void* stream) {
  if (params == nullptr) return cudaErrorInvalidValue;
  return flashjit_generated::launch(*params, static_cast<cudaStream_t>(stream));
}

}  // extern "C"
