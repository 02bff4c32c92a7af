// Fast causal attention with grouped-query heads.
//
// Every product is a small GEMM done by one register-blocked micro-kernel (a few rows times a few
// vector widths of columns, accumulators in registers). The provider GEMM is not used: the
// kernels run inside OpenMP regions, where a threaded BLAS would nest.
//
// Forward, parallel over (batch, query head, block of query rows):
//   scores = Q_blk · K^T (K^T packed once per call), softmax into probs, out = P_blk · V.
// Backward in two race-free passes:
//   1. over (batch, query head, query block): dP = dO · V^T, dS = P ⊙ (dP - rowsum(P ⊙ dP)),
//      dq += scale · dS · K. Keeps rowsum(P ⊙ dP) per row.
//   2. over (batch, kv head, key block), looping the query heads of the group inside so that no
//      two threads write the same dk/dv rows: recompute the dP columns of the block, then
//      dv += P^T · dO and dk += scale · dS^T · Q.
// Pass 2 recomputes dP for its key block (one extra T²D/2 product) instead of keeping dS, which
// would need another buffer as large as probs.
//
// The B operands of the products are first packed per head into contiguous buffers (K^T and V^T
// zero-padded, and K, V, Q, dO row-wise), kept per calling thread between calls: about the size
// of q + k + v + dout of the largest call so far, small beside probs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tessel/core/check.h"
#include "tessel/kernels/attention.h"
#include "tessel/kernels/cpu/vec_math.h"

namespace tessel::kernels::cpu {

namespace {

// GCC's vector extension rather than `omp simd` loops: with -march=native on recent Intel cores
// GCC prefers 256-bit registers for auto-vectorised code, which halves the AVX-512 FMA rate and
// makes a 4 x 64 accumulator tile spill. An explicit vector type is used at its full width.
// Without AVX (builds with TESSEL_NATIVE=OFF or sanitizers) stay at 16 bytes, the x86-64 baseline:
// wider vector types would change the calling convention and trip -Wpsabi.
#if defined(__AVX512F__)
constexpr int kVec = 16;  // floats per vector register
#elif defined(__AVX__)
constexpr int kVec = 8;
#else
constexpr int kVec = 4;
#endif
typedef float VecF __attribute__((vector_size(kVec * sizeof(float))));

constexpr int kWideVecs = 4;     // micro-kernel columns: 4 registers per row
constexpr int kRows = 4;         // micro-kernel rows: 4 x 4 accumulator registers
static_assert(kRows == 4);       // small_gemm's switch
constexpr int kQueryBlock = 16;  // query rows per task (forward and backward pass 1)
constexpr int kKeyBlock = 32;    // keys per task in backward pass 2 (a multiple of kVec)

static_assert(kKeyBlock % kVec == 0);

// Below these sizes a parallel region costs more than it saves (and a lot more when the cores
// are shared): multiply-adds of the attention products, floats moved by a packing pass.
constexpr int64_t kParallelMinWork = int64_t(1) << 18;
constexpr int64_t kParallelMinCopy = int64_t(1) << 16;

int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// Row length for the packed K^T / V^T and the score tiles: at least T rounded up to a vector, and
// an odd number of 64-byte lines, so that the micro-kernel walking down D rows of it spreads over
// all L1 sets instead of thrashing a few (T = 1024 would otherwise give a 4 KiB stride).
int64_t packed_ld(int T) {
  int64_t ld = round_up(T, 16);
  if ((ld / 16) % 2 == 0) ld += 16;
  return ld;
}

inline VecF load(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

inline void store(float* p, VecF v) {
  std::memcpy(p, &v, sizeof v);
}

// C[m, 0:NV*kVec] = alpha * sum_k A(m, k) * B[k, 0:NV*kVec] (or += with accumulate), m < M, where
// A(m, k) = A[m * a_rs + k * a_cs] and B's rows are b_rs floats apart. M and NV are compile-time
// so that the M x NV accumulators live in registers.
template <int M, int NV>
inline void micro_kernel(int K, const float* A, int64_t a_rs, int64_t a_cs, const float* B,
                         int64_t b_rs, float alpha, bool accumulate, float* C, int64_t c_rs) {
  VecF acc[M][NV];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[m][v] = VecF{};
  }
  for (int k = 0; k < K; ++k) {
    VecF b[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) b[v] = load(B + k * b_rs + v * kVec);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const float a = A[m * a_rs + k * a_cs];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[m][v] += a * b[v];
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    float* c = C + m * c_rs;
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const VecF r = alpha * acc[m][v];
      store(c + v * kVec, accumulate ? load(c + v * kVec) + r : r);
    }
  }
}

// The same for a run-time width below kVec (odd head sizes only).
template <int M>
void micro_kernel_narrow(int W, int K, const float* A, int64_t a_rs, int64_t a_cs, const float* B,
                         int64_t b_rs, float alpha, bool accumulate, float* C, int64_t c_rs) {
  float acc[M][kVec] = {};
  for (int k = 0; k < K; ++k) {
    const float* b = B + k * b_rs;
    for (int m = 0; m < M; ++m) {
      const float a = A[m * a_rs + k * a_cs];
      for (int w = 0; w < W; ++w) acc[m][w] += a * b[w];
    }
  }
  for (int m = 0; m < M; ++m) {
    float* c = C + m * c_rs;
    for (int w = 0; w < W; ++w) c[w] = alpha * acc[m][w] + (accumulate ? c[w] : 0.0f);
  }
}

// One kRows x kPanel tile (or a ragged edge of one): full-width micro-kernels, then narrower ones.
template <int M>
void tile(int N, int K, const float* A, int64_t a_rs, int64_t a_cs, const float* B, int64_t b_rs,
          float alpha, bool accumulate, float* C, int64_t c_rs) {
  int n = 0;
  if (n + kWideVecs * kVec <= N) {
    micro_kernel<M, kWideVecs>(K, A, a_rs, a_cs, B, b_rs, alpha, accumulate, C, c_rs);
    n += kWideVecs * kVec;
  }
  if (n + 2 * kVec <= N) {
    micro_kernel<M, 2>(K, A, a_rs, a_cs, B + n, b_rs, alpha, accumulate, C + n, c_rs);
    n += 2 * kVec;
  }
  if (n + kVec <= N) {
    micro_kernel<M, 1>(K, A, a_rs, a_cs, B + n, b_rs, alpha, accumulate, C + n, c_rs);
    n += kVec;
  }
  if (n < N)
    micro_kernel_narrow<M>(N - n, K, A, a_rs, a_cs, B + n, b_rs, alpha, accumulate, C + n, c_rs);
}

constexpr int kPanel = kWideVecs * kVec;  // columns of B per tile
constexpr int kDepth = 128;               // rows of B per pass: a 128 x kPanel block stays in L1

// C[M, N] (+)= alpha * A(M x K) · B[K, N], single-threaded; see micro_kernel for the layouts.
// Blocked so that each kDepth x kPanel block of B is loaded into L1 once and reused by every row
// block of A, whichever operand is larger.
void small_gemm(int M, int N, int K, const float* A, int64_t a_rs, int64_t a_cs, const float* B,
                int64_t b_rs, float alpha, bool accumulate, float* C, int64_t c_rs) {
  if (K == 0 && !accumulate) {
    for (int m = 0; m < M; ++m) std::fill_n(C + m * c_rs, N, 0.0f);
  }
  for (int k0 = 0; k0 < K; k0 += kDepth) {
    const int kc = std::min(kDepth, K - k0);
    const bool acc = accumulate || k0 > 0;
    const float* a_k = A + k0 * a_cs;
    const float* b_k = B + k0 * b_rs;
    for (int n0 = 0; n0 < N; n0 += kPanel) {
      const int nc = std::min(kPanel, N - n0);
      for (int m0 = 0; m0 < M; m0 += kRows) {
        const float* a = a_k + m0 * a_rs;
        float* c = C + m0 * c_rs + n0;
        switch (std::min(kRows, M - m0)) {
          case 4:
            tile<4>(nc, kc, a, a_rs, a_cs, b_k + n0, b_rs, alpha, acc, c, c_rs);
            break;
          case 3:
            tile<3>(nc, kc, a, a_rs, a_cs, b_k + n0, b_rs, alpha, acc, c, c_rs);
            break;
          case 2:
            tile<2>(nc, kc, a, a_rs, a_cs, b_k + n0, b_rs, alpha, acc, c, c_rs);
            break;
          default:
            tile<1>(nc, kc, a, a_rs, a_cs, b_k + n0, b_rs, alpha, acc, c, c_rs);
            break;
        }
      }
    }
  }
}

// max(x[0:n]). A `reduction(max:)` loop stays scalar without -ffast-math (NaN ordering), which
// made this serial chain the forward pass's bottleneck; vector lanes keep it independent.
float row_max(const float* x, int n) {
  VecF m = VecF{} - INFINITY;
  int j = 0;
  for (; j + kVec <= n; j += kVec) {
    const VecF v = load(x + j);
    m = v > m ? v : m;
  }
  float r = -INFINITY;
  for (int i = 0; i < kVec; ++i) r = std::max(r, m[i]);
  for (; j < n; ++j) r = std::max(r, x[j]);
  return r;
}

// Scratch that survives between calls: one set per calling thread (the packed operands and the
// row statistics) and one per OpenMP worker (score tiles). Grows, never shrinks.
float* scratch(std::vector<float>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

enum Slot { kSlotKT, kSlotVT, kSlotK, kSlotV, kSlotQ, kSlotDout, kSlotDelta, kSlotCount };

float* caller_scratch(Slot slot, size_t n) {
  thread_local std::vector<float> bufs[kSlotCount];
  return scratch(bufs[slot], n);
}

float* worker_scratch(int slot, size_t n) {
  thread_local std::vector<float> bufs[2];
  return scratch(bufs[slot], n);
}

// xt[((b * H + h) * D + d) * ld + t] = x[(b * T + t) * stride + h * D + d], zero for T <= t < ld:
// keys/values transposed so that one query row meets kVec keys per vector.
void pack_transposed(float* xt, const float* x, int B, int T, int H, int D, int64_t stride,
                     int64_t ld) {
#pragma omp parallel for collapse(2) \
    schedule(static) if (int64_t(B) * H * T * D >= kParallelMinCopy)
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      float* dst = xt + (int64_t(b) * H + h) * D * ld;
      const float* src = x + int64_t(b) * T * stride + int64_t(h) * D;
      // 16 tokens at a time, so that every store is a whole 64-byte line of a K^T row.
      for (int t0 = 0; t0 < T; t0 += 16) {
        const int n = std::min(16, T - t0);
        for (int d = 0; d < D; ++d) {
          float* out = dst + d * ld + t0;
          for (int i = 0; i < n; ++i) out[i] = src[(t0 + i) * stride + d];
        }
      }
      for (int d = 0; d < D; ++d) std::fill(dst + d * ld + T, dst + (d + 1) * ld, 0.0f);
    }
  }
}

// xp[((b * H + h) * T + t) * D + d] = x[(b * T + t) * stride + h * D + d]. The micro-kernel streams
// up to kDepth rows of its B operand; with the token strides of a fused QKV buffer (3 KiB, 9 KiB)
// those rows fall into a quarter of the L1 sets and evict each other, contiguous ones do not.
void pack_heads(float* xp, const float* x, int B, int T, int H, int D, int64_t stride) {
#pragma omp parallel for collapse(2) \
    schedule(static) if (int64_t(B) * H * T * D >= kParallelMinCopy)
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      const float* src = x + (int64_t(b) * T + t) * stride;
      for (int h = 0; h < H; ++h) {
        const float* from = src + int64_t(h) * D;
        float* to = xp + ((int64_t(b) * H + h) * T + t) * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) to[d] = from[d];  // inline: D is too short for a memcpy call
      }
    }
  }
}

void check_heads(int Hq, int Hkv) {
  TESSEL_CHECK(Hkv > 0 && Hq % Hkv == 0, InvalidArgumentError,
               "attention: {} query heads are not a multiple of {} key/value heads", Hq, Hkv);
}

}  // namespace

void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v,
                       int B, int T, int Hq, int Hkv, int D, int64_t q_stride, int64_t kv_stride) {
  check_heads(Hq, Hkv);
  if (B <= 0 || T <= 0 || Hq <= 0 || D <= 0) return;
  const int group = Hq / Hkv;
  const float scale = float(1.0 / std::sqrt(double(D)));
  const int64_t work = int64_t(B) * Hq * T * T * D;
  const int64_t ld = packed_ld(T);
  const int64_t head = int64_t(T) * D;  // floats per packed (b, h)
  float* kt = caller_scratch(kSlotKT, size_t(B) * Hkv * D * ld);
  float* vp = caller_scratch(kSlotV, size_t(B) * Hkv * head);
  pack_transposed(kt, k, B, T, Hkv, D, kv_stride, ld);
  pack_heads(vp, v, B, T, Hkv, D, kv_stride);

  const int blocks = int((T + kQueryBlock - 1) / kQueryBlock);
#pragma omp parallel for collapse(3) schedule(dynamic) if (work >= kParallelMinWork)
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hq; ++h) {
      for (int blk = 0; blk < blocks; ++blk) {
        const int hk = h / group;
        const int t0 = blk * kQueryBlock;
        const int rows = std::min(kQueryBlock, T - t0);
        const int keys = t0 + rows;  // the last row sees keys [0, keys)
        float* s = worker_scratch(0, size_t(kQueryBlock) * ld);
        const float* q_blk = q + (int64_t(b) * T + t0) * q_stride + int64_t(h) * D;
        const float* kt_bh = kt + (int64_t(b) * Hkv + hk) * D * ld;
        // Raw scores for all rows against keys [0, keys) (rounded up into the zero padding).
        small_gemm(rows, int(round_up(keys, kVec)), D, q_blk, q_stride, 1, kt_bh, ld, 1.0f, false,
                   s, ld);
        float* p_blk = probs + ((int64_t(b) * Hq + h) * T + t0) * T;
        for (int r = 0; r < rows; ++r) {
          const int n = t0 + r + 1;  // causal: keys [0, n)
          const float* sr = s + r * ld;
          float* pr = p_blk + int64_t(r) * T;
          const float mx = row_max(sr, n);
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int j = 0; j < n; ++j) {
            const float e = fast_exp((sr[j] - mx) * scale);
            pr[j] = e;
            sum += e;
          }
          const float inv = 1.0f / sum;
#pragma omp simd
          for (int j = 0; j < n; ++j) pr[j] *= inv;
          std::fill(pr + n, pr + T, 0.0f);
        }
        // out rows = P_blk[:, 0:keys] · V[0:keys]; entries above the diagonal are 0.
        const float* v_bh = vp + (int64_t(b) * Hkv + hk) * head;
        float* o_blk = out + (int64_t(b) * T + t0) * Hq * D + int64_t(h) * D;
        small_gemm(rows, D, keys, p_blk, T, 1, v_bh, D, 1.0f, false, o_blk, int64_t(Hq) * D);
      }
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* probs,
                        const float* q, const float* k, const float* v, int B, int T, int Hq,
                        int Hkv, int D, int64_t q_stride, int64_t kv_stride) {
  check_heads(Hq, Hkv);
  if (B <= 0 || T <= 0 || Hq <= 0 || D <= 0) return;
  const int group = Hq / Hkv;
  const float scale = float(1.0 / std::sqrt(double(D)));
  const int64_t work = int64_t(B) * Hq * T * T * D;
  const int64_t ld = packed_ld(T);
  const int64_t o_stride = int64_t(Hq) * D;
  const int64_t head = int64_t(T) * D;
  float* vt = caller_scratch(kSlotVT, size_t(B) * Hkv * D * ld);
  float* kp = caller_scratch(kSlotK, size_t(B) * Hkv * head);
  float* qp = caller_scratch(kSlotQ, size_t(B) * Hq * head);
  float* dop = caller_scratch(kSlotDout, size_t(B) * Hq * head);
  float* delta = caller_scratch(kSlotDelta, size_t(B) * Hq * T);  // rowsum(P ⊙ dP) per row
  pack_transposed(vt, v, B, T, Hkv, D, kv_stride, ld);
  pack_heads(kp, k, B, T, Hkv, D, kv_stride);
  pack_heads(qp, q, B, T, Hq, D, q_stride);
  pack_heads(dop, dout, B, T, Hq, D, o_stride);

  // Pass 1: dq, one query block of one head per task.
  const int q_blocks = int((T + kQueryBlock - 1) / kQueryBlock);
#pragma omp parallel for collapse(3) schedule(dynamic) if (work >= kParallelMinWork)
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hq; ++h) {
      for (int blk = 0; blk < q_blocks; ++blk) {
        const int hk = h / group;
        const int t0 = blk * kQueryBlock;
        const int rows = std::min(kQueryBlock, T - t0);
        const int keys = t0 + rows;
        float* ds = worker_scratch(0, size_t(kQueryBlock) * ld);
        const float* do_blk = dop + (int64_t(b) * Hq + h) * head + int64_t(t0) * D;
        const float* vt_bh = vt + (int64_t(b) * Hkv + hk) * D * ld;
        small_gemm(rows, int(round_up(keys, kVec)), D, do_blk, D, 1, vt_bh, ld, 1.0f, false, ds,
                   ld);
        const float* p_blk = probs + ((int64_t(b) * Hq + h) * T + t0) * T;
        float* delta_blk = delta + (int64_t(b) * Hq + h) * T + t0;
        for (int r = 0; r < rows; ++r) {
          const int n = t0 + r + 1;
          const float* pr = p_blk + int64_t(r) * T;
          float* dsr = ds + r * ld;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int j = 0; j < n; ++j) dot += pr[j] * dsr[j];
#pragma omp simd
          for (int j = 0; j < n; ++j) dsr[j] = pr[j] * (dsr[j] - dot);
          std::fill(dsr + n, dsr + keys, 0.0f);
          delta_blk[r] = dot;
        }
        const float* k_bh = kp + (int64_t(b) * Hkv + hk) * head;
        float* dq_blk = dq + (int64_t(b) * T + t0) * q_stride + int64_t(h) * D;
        small_gemm(rows, D, keys, ds, ld, 1, k_bh, D, scale, true, dq_blk, q_stride);
      }
    }
  }

  // Pass 2: dk and dv, one key block of one kv head per task; rows t < j0 see none of its keys.
  const int k_blocks = int((T + kKeyBlock - 1) / kKeyBlock);
#pragma omp parallel for collapse(3) schedule(dynamic) if (work >= kParallelMinWork)
  for (int b = 0; b < B; ++b) {
    for (int hk = 0; hk < Hkv; ++hk) {
      for (int blk = 0; blk < k_blocks; ++blk) {
        const int j0 = blk * kKeyBlock;
        const int keys = std::min(kKeyBlock, T - j0);
        const int rows = T - j0;  // query rows j0 .. T-1
        // P[j0:, j0:j0+keys] copied contiguous (rows of P are T floats apart, a stride that
        // would map every row to the same L1 set), and the dS tile of the same shape.
        float* pc = worker_scratch(0, size_t(T) * kKeyBlock);
        float* ds = worker_scratch(1, size_t(T) * kKeyBlock);
        const float* vt_blk = vt + (int64_t(b) * Hkv + hk) * D * ld + j0;
        float* dk_blk = dk + (int64_t(b) * T + j0) * kv_stride + int64_t(hk) * D;
        float* dv_blk = dv + (int64_t(b) * T + j0) * kv_stride + int64_t(hk) * D;
        for (int h = hk * group; h < (hk + 1) * group; ++h) {
          const float* p_blk = probs + ((int64_t(b) * Hq + h) * T + j0) * T + j0;
          const float* do_rows = dop + (int64_t(b) * Hq + h) * head + int64_t(j0) * D;
          const float* q_rows = qp + (int64_t(b) * Hq + h) * head + int64_t(j0) * D;
          const float* delta_rows = delta + (int64_t(b) * Hq + h) * T + j0;
          for (int r = 0; r < rows; ++r)
            std::copy_n(p_blk + int64_t(r) * T, keys, pc + int64_t(r) * kKeyBlock);
          // dv[j] += sum_t P[t, j] dO[t]: A(j, t) = P[t, j].
          small_gemm(keys, D, rows, pc, 1, kKeyBlock, do_rows, D, 1.0f, true, dv_blk, kv_stride);
          // dP[t, j] for the block's keys, then dS.
          small_gemm(rows, int(round_up(keys, kVec)), D, do_rows, D, 1, vt_blk, ld, 1.0f, false, ds,
                     kKeyBlock);
          for (int r = 0; r < rows; ++r) {
            const float* pr = pc + int64_t(r) * kKeyBlock;
            float* dsr = ds + int64_t(r) * kKeyBlock;
            const float dot = delta_rows[r];
#pragma omp simd
            for (int j = 0; j < keys; ++j) dsr[j] = pr[j] * (dsr[j] - dot);
          }
          // dk[j] += scale * sum_t dS[t, j] q[t].
          small_gemm(keys, D, rows, ds, 1, kKeyBlock, q_rows, D, scale, true, dk_blk, kv_stride);
        }
      }
    }
  }
}

}  // namespace tessel::kernels::cpu
