// Activation memory under recomputation: what a pipeline stage's model::Transformer really
// allocates for recompute none / selective / full, against the planner's memory model
// (planner/memory_model.h).
//
// Each case is one middle pipeline stage of 4 transformer blocks (no embedding, no head), micro-
// batch 1, seq 1024, fp32, with as many activation slots as 1F1B keeps in flight on rank 0 of
// pp = 4 (planner::in_flight_micro_batches: 4), tp 1, backward_stage (no split). Models:
//   gpt2-124m     (C 768, 12 heads, F 3072)
//   llama2-7b/2   llama2-7b's structure at half its width (C 2048, 16 heads of 128, F 5504): a
//                 7B stage needs ~12.3 GiB (parameters and gradients 6.0 GiB, activations 6.3
//                 GiB without recomputation) on a machine shared with builds; --full-7b adds
//                 llama2-7b itself (refused when the memory is not available).
// Per case and mode: activation_bytes() of the built model (its storage, every page touched at
// construction), the process's RSS growth over the construction less the parameters and
// gradients (2 x 4 bytes per parameter; the allocator's cache is released between cases so each
// construction maps fresh pages), and the memory model's figure StageActivation::model_bytes(4)
// with its split into per-slot and once-per-stage (recomputed buffers + backward scratch) bytes.
// Nothing is computed: the models are only built.
//
// Last line, one JSON object:
//   recompute_mem_saving            1 - full / none, measured activation_bytes(), gpt2-124m
//   recompute_mem_saving_selective  1 - selective / none, the same
//   recompute_mem_model_error       max over models and modes of |model - measured| / measured
//   models                          per model: the measured bytes per mode and both savings
//
// Usage: bench_recompute_memory [--full-7b]
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/model/model_config.h"
#include "tessel/model/recompute.h"
#include "tessel/model/stage_range.h"
#include "tessel/model/transformer.h"
#include "tessel/planner/memory_model.h"
#include "tessel/tensor/allocator.h"

namespace {

using namespace tessel;

constexpr int kSeq = 1024, kMicroBatch = 1, kBlocks = 4, kPp = 4;

double rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return double(resident) * double(sysconf(_SC_PAGESIZE));
}

double available_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

double mib(double bytes) {
  return bytes / (1024.0 * 1024.0);
}

model::ModelConfig llama_half() {
  model::ModelConfig c = model::ModelConfig::preset("llama2-7b");
  c.name = "llama2-7b/2";
  c.n_embd = 2048;
  c.n_head = 16;
  c.n_kv_head = 16;
  c.ffn_hidden = 5504;
  c.validate();
  return c;
}

struct ModeResult {
  double measured = 0, rss = 0, model = 0;
};

// Parameters of a stage of kBlocks blocks (tp 1): what the model allocates twice (parameters and
// gradients) besides its activations.
int64_t stage_params(const model::ModelConfig& c) {
  return kBlocks * planner::unit_params(c, 1, 1);
}

std::map<model::Recompute, ModeResult> run_model(const model::ModelConfig& c,
                                                 kernels::Backend& backend, int slots) {
  // Units [first, first + kBlocks): blocks in the middle of the model (unit u is block u - 1).
  const int first = std::max(1, (c.n_layer - kBlocks) / 2 + 1);
  const model::StageRange range{first - 1, first - 1 + kBlocks, false, false};
  const double param_bytes = 2.0 * 4 * double(stage_params(c));
  fmt::print(
      "\n{}: blocks [{}, {}), B {}, T {}, {} slots (1F1B rank 0 of pp {}), parameters and "
      "gradients {:.1f} MiB\n",
      c.name, first - 1, first - 1 + kBlocks, kMicroBatch, kSeq, slots, kPp, mib(param_bytes));
  fmt::print("{:<10} {:>14} {:>14} {:>9} {:>16} {:>14} {:>14}\n", "recompute", "measured MiB",
             "model MiB", "error", "RSS growth MiB", "per slot MiB", "once MiB");
  std::map<model::Recompute, ModeResult> out;
  for (model::Recompute r :
       {model::Recompute::none, model::Recompute::selective, model::Recompute::full}) {
    const planner::StageActivation want = planner::stage_activation_bytes(
        c, first, first + kBlocks, kMicroBatch, kSeq, 1, planner::Precision::fp32, r, false);
    ModeResult res;
    res.model = want.model_bytes(slots);
    const double need = param_bytes + res.model;
    if (need > 0.8 * available_bytes()) {
      throw InvalidArgumentError(fmt::format(
          "{} {}: needs {:.1f} GiB, only {:.1f} GiB available; run without that model", c.name,
          model::recompute_name(r), need / (1 << 30), available_bytes() / (1 << 30)));
    }
    HostAllocator::instance().release_cached();  // fresh pages: the growth is this model's
    const double before = rss_bytes();
    {
      model::Transformer t(c, backend, kMicroBatch, kSeq, range, nullptr, slots, r);
      res.measured = double(t.activation_bytes());
      res.rss = rss_bytes() - before - param_bytes;
    }
    HostAllocator::instance().release_cached();
    fmt::print("{:<10} {:>14.1f} {:>14.1f} {:>8.4f}% {:>16.1f} {:>14.1f} {:>14.1f}\n",
               model::recompute_name(r), mib(res.measured), mib(res.model),
               100 * (res.model - res.measured) / res.measured, mib(res.rss), mib(want.per_slot),
               mib(want.recomputed + want.scratch));
    out[r] = res;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  bool full_7b = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--full-7b") == 0) {
      full_7b = true;
    } else {
      fmt::print(stderr, "usage: bench_recompute_memory [--full-7b]\n");
      return 2;
    }
  }
  try {
    auto backend = kernels::make_backend("cpu");
    const int slots = int(
        planner::in_flight_micro_batches(layout::ScheduleKind::one_f_one_b, kPp, 1, 2 * kPp, 0)[0]);
    std::vector<model::ModelConfig> models = {model::ModelConfig::preset("gpt2-124m"),
                                              llama_half()};
    if (full_7b) models.push_back(model::ModelConfig::preset("llama2-7b"));
    nlohmann::json per_model = nlohmann::json::object();
    double worst_error = 0, saving = 0, saving_selective = 0;
    for (const model::ModelConfig& c : models) {
      const auto res = run_model(c, *backend, slots);
      const double none = res.at(model::Recompute::none).measured;
      nlohmann::json j;
      for (const auto& [r, m] : res) {
        worst_error = std::max(worst_error, std::abs(m.model - m.measured) / m.measured);
        j[std::string(model::recompute_name(r))] = {
            {"measured_bytes", m.measured}, {"model_bytes", m.model}, {"rss_bytes", m.rss}};
      }
      j["saving"] = 1 - res.at(model::Recompute::full).measured / none;
      j["saving_selective"] = 1 - res.at(model::Recompute::selective).measured / none;
      if (c.name == "gpt2-124m") {
        saving = j["saving"].get<double>();
        saving_selective = j["saving_selective"].get<double>();
      }
      per_model[c.name] = j;
    }
    nlohmann::json out = {{"recompute_mem_saving", saving},
                          {"recompute_mem_saving_selective", saving_selective},
                          {"recompute_mem_model_error", worst_error},
                          {"seq", kSeq},
                          {"micro_batch", kMicroBatch},
                          {"blocks", kBlocks},
                          {"slots", slots},
                          {"models", per_model}};
    fmt::print("\n{}\n", out.dump());
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_recompute_memory: {}\n", e.what());
    return 1;
  }
  return 0;
}
