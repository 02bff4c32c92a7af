// The process-wide settings a training config makes for this host's kernels and memory.
#pragma once

#include "tessel/config/train_config.h"

namespace tessel::runtime {

// training.threads (OpenMP threads), training.gemm (kernels/gemm.h) and training.huge_pages
// (tensor/allocator.h). Called once per process, before any model is built.
void apply_host_settings(const config::TrainingConfig& training);

}  // namespace tessel::runtime
