// The C entry points of a generated append library. The including template
// defines namespace flashjit_generated with launch() first.
#pragma once
#include <cstddef>

#include "flashjit/append/append_paged.cuh"

namespace flashjit_generated {
using Params = FlashjitAppendParams;
}  // namespace flashjit_generated

#include "flashjit/common/common_exports.cuh"

static_assert(offsetof(FlashjitAppendLaunch, params) == 8, "params follow the 8-byte stream");

extern "C" {

FLASHJIT_EXPORT int flashjit_append_run(const FlashjitAppendLaunch* launch) {
  if (launch == nullptr) return cudaErrorInvalidValue;
  return flashjit_generated::launch(launch->params, static_cast<cudaStream_t>(launch->stream));
}

}  // extern "C"
