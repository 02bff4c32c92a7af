// Cuts a token stream into training samples and loads them in the global sample order.
//
// Sample i is the window of seq_len + 1 tokens starting at token i * seq_len: its input is the
// first seq_len tokens and its target the same window shifted by one. There are
// (size - 1) / seq_len samples. The last `eval` of them (by index) are held out for evaluation and
// never appear in the training order; the rest are visited in SampleOrder's deterministic order.
// (The first eval input token is also the target of the last train sample: one token of overlap.)
//
// Batches are addressed by a cursor counted in samples: the trainer keeps one cursor for the
// whole job and advances it by the global batch size each step. A data-parallel rank loads its
// contiguous slice [cursor + rank * per_rank, + per_rank) with first = rank * per_rank, and a
// micro-batch narrows `first` further; since every call is a pure function of (seed, cursor,
// first, count), the same cursor yields the same global batch for every parallel layout and
// after a resume.
#pragma once

#include <cstdint>
#include <memory>

#include "tessel/data/sample_order.h"
#include "tessel/data/token_source.h"

namespace tessel::data {

class BatchLoader {
 public:
  // eval_fraction in [0, 1): the held-out share of the samples, rounded to the nearest count and
  // at least one sample when > 0. Throws InvalidArgumentError for seq_len < 1 or a fraction
  // outside [0, 1), ConfigError (naming the source and sizes) when the data has no sample of
  // seq_len + 1 tokens or the split leaves no training sample.
  BatchLoader(std::shared_ptr<const TokenSource> source, int64_t seq_len, uint64_t seed,
              double eval_fraction = 0.0);

  int64_t seq_len() const { return seq_len_; }
  // All windows, train and eval.
  int64_t num_samples() const { return split_.train + split_.eval; }
  // Size of the training order per epoch: samples [0, num_train_samples()).
  int64_t num_train_samples() const { return split_.train; }
  // Size of the eval set: samples [num_train_samples(), num_samples()), visited in index order.
  int64_t num_eval_samples() const { return split_.eval; }
  const SampleOrder& train_order() const { return order_; }
  const TokenSource& source() const { return *source_; }

  // Fills `count` training samples, positions [cursor + first, cursor + first + count) of the
  // training order: inputs and targets are [count, seq_len] row-major int32 buffers. Throws
  // InvalidArgumentError for negative arguments, CorruptDataError from the source. Thread-safe.
  void load(int64_t cursor, int64_t first, int64_t count, int32_t* inputs, int32_t* targets) const;
  // Fills eval samples [first, first + count) (0-based within the eval set); the range must lie
  // in [0, num_eval_samples()], else InvalidArgumentError.
  void load_eval(int64_t first, int64_t count, int32_t* inputs, int32_t* targets) const;
  // Loads one window by its sample index in [0, num_samples()).
  void load_sample(int64_t sample, int32_t* inputs, int32_t* targets) const;

  // How the windows divide between training and eval (see num_train_samples / num_eval_samples).
  struct Split {
    int64_t train;
    int64_t eval;
  };

 private:
  // Loads samples[k] into row k for k < count, in parallel when the batch is large.
  void load_samples(const int64_t* samples, int64_t count, int32_t* inputs, int32_t* targets) const;

  std::shared_ptr<const TokenSource> source_;
  int64_t seq_len_;
  Split split_;
  SampleOrder order_;
};

}  // namespace tessel::data
