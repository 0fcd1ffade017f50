// The C entry points by which the host plans an fa2 MLA library whose kernel
// depends on the head count (flashjit_generated::Kernels, an MlaKernelPair):
// rows per CTA, split-KV alignment and CTAs per SM of the kernel that `heads`
// query heads run (loader.KernelModule.for_group).
#pragma once
#include "flashjit/common/common_exports.cuh"

extern "C" {
FLASHJIT_EXPORT int flashjit_rows_per_cta_for(int heads) { return flashjit_generated::Kernels::rows_per_cta(heads); }
FLASHJIT_EXPORT int flashjit_split_align_for(int heads) { return flashjit_generated::Kernels::split_align(heads); }
FLASHJIT_EXPORT int flashjit_ctas_per_sm_for(int heads) { return flashjit_generated::Kernels::ctas_per_sm(heads); }
}  // extern "C"
