// Device costs the sharding tests plan for (sharding_ilp_test, graph_sharding_test), and small
// dense matrices to run strategies on emulated devices (op_sharding_test, mesh_strategies_test).
#pragma once

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "tessel/planner/op_sharding.h"
#include "tessel/planner/sharding_ilp.h"

namespace tessel::planner::testing {

// An A100's tensor-parallel group: 150 TFLOP/s achieved, NVLink at 150 GB/s per device.
inline ShardingCosts nvlink_costs() {
  ShardingCosts c;
  c.flops_per_s = 150e12;
  c.bandwidth = 150e9;
  c.latency_s = 10e-6;
  return c;
}

// CPU workers (the shape of a `tessel profile` cluster): 300 GFLOP/s, 4 GB/s links.
inline ShardingCosts cpu_worker_costs() {
  ShardingCosts c;
  c.flops_per_s = 3e11;
  c.bandwidth = 4e9;
  c.latency_s = 3e-5;
  return c;
}

// A small dense matrix, to run each strategy on t emulated devices and check that what they
// hold, read back in the strategy's output layout, is the unsharded result.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  double& at(int64_t r, int64_t c) { return v[size_t(r * cols + c)]; }
  double at(int64_t r, int64_t c) const { return v[size_t(r * cols + c)]; }
};

inline Mat random_mat(int64_t rows, int64_t cols, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  Mat m{rows, cols, std::vector<double>(size_t(rows * cols))};
  for (double& x : m.v) x = u(rng);
  return m;
}

inline Mat zeros(int64_t rows, int64_t cols) {
  return {rows, cols, std::vector<double>(size_t(rows * cols))};
}

inline Mat matmul(const Mat& a, const Mat& b) {
  Mat c = zeros(a.rows, b.cols);
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t k = 0; k < a.cols; ++k)
      for (int64_t j = 0; j < b.cols; ++j) c.at(i, j) += a.at(i, k) * b.at(k, j);
  return c;
}

inline Mat transpose(const Mat& a) {
  Mat t = zeros(a.cols, a.rows);
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < a.cols; ++j) t.at(j, i) = a.at(i, j);
  return t;
}

// Device i's part of `m` in layout s (partial: device 0 holds it, the others zeros).
inline Mat part(const Mat& m, const Shard& s, int i, int t) {
  if (s.kind == Shard::Kind::replicated) return m;
  if (s.kind == Shard::Kind::partial) return i == 0 ? m : zeros(m.rows, m.cols);
  const bool by_rows = s.dim == 0;
  const int64_t n = (by_rows ? m.rows : m.cols) / t;
  Mat p = by_rows ? zeros(n, m.cols) : zeros(m.rows, n);
  for (int64_t r = 0; r < p.rows; ++r)
    for (int64_t c = 0; c < p.cols; ++c)
      p.at(r, c) = m.at(by_rows ? i * n + r : r, by_rows ? c : i * n + c);
  return p;
}

// The whole tensor the devices' parts make in layout s.
inline Mat whole(const std::vector<Mat>& parts, const Shard& s) {
  const int t = int(parts.size());
  if (s.kind == Shard::Kind::replicated) {
    for (const Mat& p : parts)
      for (size_t k = 0; k < p.v.size(); ++k) EXPECT_NEAR(p.v[k], parts[0].v[k], 1e-12);
    return parts[0];
  }
  if (s.kind == Shard::Kind::partial) {
    Mat sum = zeros(parts[0].rows, parts[0].cols);
    for (const Mat& p : parts)
      for (size_t k = 0; k < p.v.size(); ++k) sum.v[k] += p.v[k];
    return sum;
  }
  const bool by_rows = s.dim == 0;
  Mat w =
      by_rows ? zeros(parts[0].rows * t, parts[0].cols) : zeros(parts[0].rows, parts[0].cols * t);
  for (int i = 0; i < t; ++i)
    for (int64_t r = 0; r < parts[size_t(i)].rows; ++r)
      for (int64_t c = 0; c < parts[size_t(i)].cols; ++c)
        w.at(by_rows ? i * parts[size_t(i)].rows + r : r,
             by_rows ? c : i * parts[size_t(i)].cols + c) = parts[size_t(i)].at(r, c);
  return w;
}

inline void expect_equal(const Mat& a, const Mat& b, const std::string& what) {
  ASSERT_EQ(a.rows, b.rows) << what;
  ASSERT_EQ(a.cols, b.cols) << what;
  for (size_t k = 0; k < a.v.size(); ++k) EXPECT_NEAR(a.v[k], b.v[k], 1e-12) << what;
}

}  // namespace tessel::planner::testing
