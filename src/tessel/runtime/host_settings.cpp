#include "tessel/runtime/host_settings.h"

#include <omp.h>

#include "tessel/kernels/gemm.h"
#include "tessel/tensor/allocator.h"

namespace tessel::runtime {

void apply_host_settings(const config::TrainingConfig& training) {
  if (training.threads > 0) omp_set_num_threads(training.threads);
  if (training.gemm != "auto") kernels::set_gemm_provider(training.gemm);
  HostAllocator::instance().set_huge_pages(training.huge_pages);
}

}  // namespace tessel::runtime
