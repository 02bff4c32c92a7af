#include "tessel/planner/gemm_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "tessel/core/check.h"
#include "tessel/core/error.h"

namespace tessel::planner {

namespace {

struct Tile {
  double m, n, share;  // share: of the largest tile's efficiency
};
constexpr std::array<Tile, 4> kTiles = {
    {{256, 128, 1.0}, {128, 128, 0.95}, {128, 64, 0.85}, {64, 64, 0.7}}};

}  // namespace

double GemmModel::time(const GemmShape& s, double peak, double bandwidth, int bytes) const {
  TESSEL_CHECK(defined() && max_efficiency > 0 && peak > 0 && bandwidth > 0 && bytes > 0,
               InvalidArgumentError,
               "GemmModel: {} SMs, efficiency {}, peak {} FLOP/s, {} B/s, {}-byte elements; need "
               "a defined model and positive rates",
               sms, max_efficiency, peak, bandwidth, bytes);
  TESSEL_CHECK(s.m >= 1 && s.n >= 1 && s.k >= 1 && s.batch >= 1, InvalidArgumentError,
               "GemmModel: a GEMM of {} x {} x {} (batch {}); every dimension must be at least 1",
               s.m, s.n, s.k, s.batch);
  const double memory = s.batch * (s.m * s.k + s.k * s.n + s.m * s.n) * bytes / bandwidth;
  double best = std::numeric_limits<double>::infinity();
  for (const Tile& t : kTiles) {
    const double tiles = std::ceil(s.m / t.m) * std::ceil(s.n / t.n) * s.batch;
    const double waves = std::ceil(tiles / sms);
    const double compute = waves * sms * 2 * t.m * t.n * s.k / (peak * max_efficiency * t.share);
    best = std::min(best, std::sqrt(compute * compute + memory * memory));
  }
  return best + overhead_s;
}

GemmModel gemm_model_for(const std::string& device) {
  // Sources and what each number is: gemm_model.h.
  if (device.starts_with("A100")) return GemmModel{108, 271.2 / 312, 4e-6};
  if (device.starts_with("H100")) return GemmModel{132, 794.5 / 989, 6e-6};
  return GemmModel{};
}

}  // namespace tessel::planner
