// The C entry points of a generated attention library. The including template
// defines namespace flashjit_generated with launch(), ctas_per_sm(), kRowsPerCta
// and kSplitAlign first.
#pragma once
#include <cstddef>

#include "flashjit/common/attention_params.cuh"

namespace flashjit_generated {
using Params = FlashjitAttentionParams;
}  // namespace flashjit_generated

#include "flashjit/common/common_exports.cuh"

// The host packs the stream as the block's first 8 bytes, the params right after.
static_assert(offsetof(FlashjitAttentionLaunch, params) == 8, "params follow the 8-byte stream");

extern "C" {

FLASHJIT_EXPORT int flashjit_attention_run(const FlashjitAttentionLaunch* launch) {
  if (launch == nullptr) return cudaErrorInvalidValue;
  return flashjit_generated::launch(launch->params, static_cast<cudaStream_t>(launch->stream));
}

FLASHJIT_EXPORT int flashjit_rows_per_cta(void) { return flashjit_generated::kRowsPerCta; }

FLASHJIT_EXPORT int flashjit_split_align(void) { return flashjit_generated::kSplitAlign; }

FLASHJIT_EXPORT int flashjit_ctas_per_sm(void) { return flashjit_generated::ctas_per_sm(); }

}  // extern "C"
