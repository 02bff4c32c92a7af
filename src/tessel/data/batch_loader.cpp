#include "tessel/data/batch_loader.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <vector>

#include "tessel/core/check.h"

namespace tessel::data {
namespace {

// Splits the windows of `source` into train and eval counts, validating everything up front.
BatchLoader::Split split_samples(const TokenSource* source, int64_t seq_len, double fraction) {
  TESSEL_CHECK(source != nullptr, InvalidArgumentError, "BatchLoader needs a token source");
  TESSEL_CHECK(seq_len >= 1, InvalidArgumentError, "seq_len must be >= 1, got {}", seq_len);
  TESSEL_CHECK(fraction >= 0.0 && fraction < 1.0, InvalidArgumentError,
               "eval fraction {} must be in [0, 1)", fraction);
  const int64_t n = source->size() > 0 ? (source->size() - 1) / seq_len : 0;
  TESSEL_CHECK(n >= 1, ConfigError,
               "{} is too small for seq_len {}: one sample needs {} tokens; use a shorter "
               "seq_len or more data",
               source->describe(), seq_len, seq_len + 1);
  const int64_t eval =
      fraction == 0.0 ? 0 : std::max<int64_t>(1, std::llround(static_cast<double>(n) * fraction));
  TESSEL_CHECK(eval < n, ConfigError,
               "{} has {} samples of seq_len {}; holding out {} for eval (eval fraction {}) "
               "leaves none for training; lower the eval fraction or add data",
               source->describe(), n, seq_len, eval, fraction);
  return {n - eval, eval};
}

}  // namespace

BatchLoader::BatchLoader(std::shared_ptr<const TokenSource> source, int64_t seq_len, uint64_t seed,
                         double eval_fraction)
    : source_(std::move(source)),
      seq_len_(seq_len),
      split_(split_samples(source_.get(), seq_len, eval_fraction)),
      order_(split_.train, seed) {}

void BatchLoader::load_sample(int64_t sample, int32_t* inputs, int32_t* targets) const {
  TESSEL_CHECK(sample >= 0 && sample < num_samples(), InvalidArgumentError,
               "sample {} is outside [0, {})", sample, num_samples());
  // Read the window once: inputs get tokens [0, L), targets reuse inputs[1, L) plus token L.
  const int64_t begin = sample * seq_len_;
  source_->read(begin, seq_len_, inputs);
  std::memcpy(targets, inputs + 1, static_cast<size_t>(seq_len_ - 1) * sizeof(int32_t));
  source_->read(begin + seq_len_, 1, targets + seq_len_ - 1);
}

void BatchLoader::load_samples(const int64_t* samples, int64_t count, int32_t* inputs,
                               int32_t* targets) const {
  // Copying from a warm page cache runs at ~300M tokens/s on one thread, so threads pay off only
  // for very large batches (or cold pages); below ~1M tokens their start-up and, on a loaded
  // machine, waiting for a descheduled peer cost more than they save.
  const bool parallel = count > 1 && count * seq_len_ >= (int64_t{1} << 20);
  int64_t failed = std::numeric_limits<int64_t>::max();
  std::exception_ptr failure;
  std::mutex mu;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t k = 0; k < count; ++k) {
    try {
      load_sample(samples[k], inputs + k * seq_len_, targets + k * seq_len_);
    } catch (...) {
      // Keep the error of the first failing row so the message does not depend on timing.
      std::lock_guard<std::mutex> lock(mu);
      if (k < failed) {
        failed = k;
        failure = std::current_exception();
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
}

void BatchLoader::load(int64_t cursor, int64_t first, int64_t count, int32_t* inputs,
                       int32_t* targets) const {
  TESSEL_CHECK(cursor >= 0 && first >= 0 && count >= 0, InvalidArgumentError,
               "load(cursor {}, first {}, count {}): all must be >= 0", cursor, first, count);
  std::vector<int64_t> samples(static_cast<size_t>(count));
  order_.global_samples(cursor + first, count, samples.data());
  load_samples(samples.data(), count, inputs, targets);
}

void BatchLoader::load_eval(int64_t first, int64_t count, int32_t* inputs, int32_t* targets) const {
  TESSEL_CHECK(first >= 0 && count >= 0 && first <= split_.eval - count, InvalidArgumentError,
               "eval samples [{}, {}) are outside the eval set [0, {})", first, first + count,
               split_.eval);
  std::vector<int64_t> samples(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k) samples[k] = split_.train + first + k;
  load_samples(samples.data(), count, inputs, targets);
}

}  // namespace tessel::data
