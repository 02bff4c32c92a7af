// Reference causal attention with grouped-query heads: one query row at a time, double
// accumulation, probs stored in full (zeros above the diagonal).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tessel/core/check.h"
#include "tessel/kernels/attention.h"

namespace tessel::kernels::ref {

namespace {

void check_heads(int Hq, int Hkv) {
  TESSEL_CHECK(Hkv > 0 && Hq % Hkv == 0, InvalidArgumentError,
               "attention: {} query heads are not a multiple of {} key/value heads", Hq, Hkv);
}

}  // namespace

void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v,
                       int B, int T, int Hq, int Hkv, int D, int64_t q_stride, int64_t kv_stride) {
  check_heads(Hq, Hkv);
  const int group = Hq / Hkv;
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> score(T), acc(D);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hq; ++h) {
      const int hk = h / group;
      for (int t = 0; t < T; ++t) {
        const float* qt = q + (int64_t(b) * T + t) * q_stride + int64_t(h) * D;
        double max_score = -INFINITY;
        for (int j = 0; j <= t; ++j) {
          const float* kj = k + (int64_t(b) * T + j) * kv_stride + int64_t(hk) * D;
          double s = 0;
          for (int d = 0; d < D; ++d) s += double(qt[d]) * kj[d];
          score[j] = s * scale;
          max_score = std::max(max_score, score[j]);
        }
        double sum = 0;
        for (int j = 0; j <= t; ++j) {
          score[j] = std::exp(score[j] - max_score);
          sum += score[j];
        }
        float* p = probs + ((int64_t(b) * Hq + h) * T + t) * T;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int j = 0; j < T; ++j) {
          if (j > t) {
            p[j] = 0.0f;
            continue;
          }
          const double pj = score[j] / sum;
          p[j] = float(pj);
          const float* vj = v + (int64_t(b) * T + j) * kv_stride + int64_t(hk) * D;
          for (int d = 0; d < D; ++d) acc[d] += pj * vj[d];
        }
        float* o = out + (int64_t(b) * T + t) * Hq * D + int64_t(h) * D;
        for (int d = 0; d < D; ++d) o[d] = float(acc[d]);
      }
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* probs,
                        const float* q, const float* k, const float* v, int B, int T, int Hq,
                        int Hkv, int D, int64_t q_stride, int64_t kv_stride) {
  check_heads(Hq, Hkv);
  const int group = Hq / Hkv;
  const double scale = 1.0 / std::sqrt(double(D));
  // dk and dv collect terms from every later query row of every head in the group; sum them in
  // double and add once at the end. Indexed [b, t, hk, d] contiguously.
  std::vector<double> dk_acc(size_t(B) * T * Hkv * D, 0.0), dv_acc(dk_acc.size(), 0.0);
  std::vector<double> dp(T), dq_acc(D);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hq; ++h) {
      const int hk = h / group;
      for (int t = 0; t < T; ++t) {
        const float* p = probs + ((int64_t(b) * Hq + h) * T + t) * T;
        const float* dot = dout + (int64_t(b) * T + t) * Hq * D + int64_t(h) * D;
        const float* qt = q + (int64_t(b) * T + t) * q_stride + int64_t(h) * D;
        // out_t = sum_j p_j v_j gives dp_j = dout_t . v_j and dv_j += p_j dout_t.
        double p_dot_dp = 0;
        for (int j = 0; j <= t; ++j) {
          const float* vj = v + (int64_t(b) * T + j) * kv_stride + int64_t(hk) * D;
          double* dvj = dv_acc.data() + ((int64_t(b) * T + j) * Hkv + hk) * D;
          double s = 0;
          for (int d = 0; d < D; ++d) {
            s += double(dot[d]) * vj[d];
            dvj[d] += double(p[j]) * dot[d];
          }
          dp[j] = s;
          p_dot_dp += p[j] * s;
        }
        // Softmax backward: dscore_j = p_j (dp_j - sum_i p_i dp_i), and score = scale * q . k.
        std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
        for (int j = 0; j <= t; ++j) {
          const float* kj = k + (int64_t(b) * T + j) * kv_stride + int64_t(hk) * D;
          double* dkj = dk_acc.data() + ((int64_t(b) * T + j) * Hkv + hk) * D;
          const double ds = p[j] * (dp[j] - p_dot_dp) * scale;
          for (int d = 0; d < D; ++d) {
            dq_acc[d] += ds * kj[d];
            dkj[d] += ds * qt[d];
          }
        }
        float* dqt = dq + (int64_t(b) * T + t) * q_stride + int64_t(h) * D;
        for (int d = 0; d < D; ++d) dqt[d] += float(dq_acc[d]);
      }
    }
  }
  for (int64_t n = 0; n < int64_t(B) * T; ++n) {
    for (int64_t i = 0; i < int64_t(Hkv) * D; ++i) {
      dk[n * kv_stride + i] += float(dk_acc[n * Hkv * D + i]);
      dv[n * kv_stride + i] += float(dv_acc[n * Hkv * D + i]);
    }
  }
}

}  // namespace tessel::kernels::ref
