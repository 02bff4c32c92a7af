// Box copies: the re-partition of training state between layouts and the store's sub-tensor
// reads, which all go through the box-copy engine (tensor/box_copy.h, tensor/region_runs.h).
//
// Cases (each timed after one warm-up, `--reps` times or, for short ones, more until 0.5 s; the
// median and the minimum are reported):
//   reshard/<model>/<from>-><to>  reshard::execute_in_memory of the whole state (parameters and
//       both Adam moments) from one layout to another, every old rank a process that is also the
//       new rank of the same index (so local copies, packed messages and unpacking all run; it
//       allocates each message's staging buffer, so first touches of fresh pages count too).
//   messages/<model>/<from>-><to>  only pack_message + unpack_message of every message of that
//       plan, into staging buffers allocated once (the gather/scatter part).
//       Models: gpt2-124m (long runs: rows of 768..3072 floats) and `narrow` (gpt2, 48 layers of
//       width 128, byte vocabulary: tensor-parallel shards made of 64..256-float rows, so the
//       per-run cost shows).
//   box/...      pack_box / unpack_box on a [4096, 4096] f32 array: whole, a column half (a
//                tensor-parallel shard), 16-column strips (64-byte runs), and a 3-d box.
//   store/...    SafetensorsReader::read_box and CheckpointReader::read_box of column and row
//                slices of a [8192, 1024] f32 tensor (page cache warm; the checkpoint holds it as
//                two row-half pieces, so reads cross pieces and verify chunk checksums).
// Prints one line per case (median ms, GB/s of the bytes the case moves, min and max) and, last,
// one JSON object {"cases": {name: {"median_ms", "min_ms"}, ...}, "reps": n}. scripts/bench reshard
// runs it, and with TESSEL_BENCH_BASELINE=<another bench_reshard> runs both interleaved and
// compares.
//
// Usage: bench_reshard [--reps 5] [--only SUBSTRING] [--dir TMPDIR]
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "tessel/layout/plan.h"
#include "tessel/layout/state_layout.h"
#include "tessel/model/model_config.h"
#include "tessel/reshard/executor.h"
#include "tessel/reshard/transfer_plan.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/store/safetensors.h"
#include "tessel/tensor/box_copy.h"

namespace {

using namespace tessel;
namespace fs = std::filesystem;

struct Options {
  int reps = 5;
  std::string only;
  std::string dir;
};

struct Result {
  std::string name;
  double median_ms = 0, min_ms = 0;
  double bytes = 0;
};

std::vector<Result> results;

void time_case(const Options& o, const std::string& name, double bytes,
               const std::function<void()>& f) {
  if (!o.only.empty() && name.find(o.only) == std::string::npos) return;
  f();  // warm-up
  // At least `reps` repetitions, and more (up to 50 x reps) until they took 0.5 s: short cases
  // get enough samples for a steady minimum on a shared machine.
  std::vector<double> ms;
  double total = 0;
  while (int(ms.size()) < o.reps || (total < 500 && int(ms.size()) < 50 * o.reps)) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    total += ms.back();
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  results.push_back({name, med, ms.front(), bytes});
  fmt::print("{:<44} {:>10.3f} ms {:>8.2f} GB/s  (min {:.3f}, max {:.3f}, {} runs)\n", name, med,
             bytes / (med * 1e-3) / 1e9, ms.front(), ms.back(), ms.size());
  std::fflush(stdout);
}

layout::Plan plan_of(int dp, int tp, int pp, int zero) {
  layout::Plan p;
  p.dp = dp;
  p.tp = tp;
  p.pp = pp;
  p.zero_stage = zero;
  p.micro_batches = pp;
  return p;
}

struct Layout {
  std::string name;
  layout::Plan plan;
};

// Every rank's buffers of a layout, owned (touched: zero-filled or filled).
struct State {
  std::vector<std::vector<std::vector<float>>> by_rank;
  std::vector<std::vector<std::span<const float>>> const_spans() const {
    std::vector<std::vector<std::span<const float>>> out;
    for (const auto& r : by_rank) {
      out.emplace_back();
      for (const auto& b : r) out.back().emplace_back(b);
    }
    return out;
  }
  std::vector<std::vector<std::span<float>>> spans() {
    std::vector<std::vector<std::span<float>>> out;
    for (auto& r : by_rank) {
      out.emplace_back();
      for (auto& b : r) out.back().emplace_back(b);
    }
    return out;
  }
};

State allocate(const layout::StateLayout& L) {
  State s;
  for (int r = 0; r < L.world(); ++r) {
    s.by_rank.emplace_back();
    for (const auto& b : L.buffers(r)) s.by_rank.back().emplace_back(size_t(b.numel), 0.0f);
  }
  return s;
}

void bench_reshard(const Options& o, const std::string& model_name,
                   const model::ModelConfig& config,
                   const std::vector<std::pair<Layout, Layout>>& moves) {
  for (const auto& [from, to] : moves) {
    const std::string name = fmt::format("reshard/{}/{}->{}", model_name, from.name, to.name);
    if (!o.only.empty() && name.find(o.only) == std::string::npos) continue;
    const auto A = layout::StateLayout::build(config, from.plan);
    const auto B = layout::StateLayout::build(config, to.plan);
    const auto plan = reshard::TransferPlan::build(A, B, std::vector<int>(size_t(A.world()), 0),
                                                   std::vector<int>(size_t(B.world()), 0));
    State old_state = allocate(A), new_state = allocate(B);
    for (int r = 0; r < A.world(); ++r) {
      std::vector<std::span<float>> bufs;
      for (auto& b : old_state.by_rank[size_t(r)]) bufs.emplace_back(b);
      A.fill(
          r,
          [](const model::ParamSpec&, layout::StateKind kind, const Box& box, float* out) {
            std::fill(out, out + box.volume(), 1.0f + float(int(kind)));
          },
          bufs);
    }
    const auto olds = old_state.const_spans();
    auto news = new_state.spans();
    // Bytes moved: what lands in new buffers that are not kept as they are.
    const double bytes = double(plan.stats().total_bytes - plan.stats().kept_bytes);
    time_case(o, name, bytes, [&] { reshard::execute_in_memory(plan, olds, news); });
    // The messages alone, into staging buffers allocated (and touched) once: what the executor's
    // sender and receiver do with their state besides sending.
    std::vector<std::vector<float>> staging;
    double message_bytes = 0;
    for (const auto& m : plan.messages()) {
      staging.emplace_back(size_t(m.numel), 0.0f);
      message_bytes += double(m.bytes());
    }
    if (message_bytes == 0) continue;  // every element stays within its process
    time_case(o, "messages/" + name.substr(name.find('/') + 1), 2 * message_bytes, [&] {
      for (size_t i = 0; i < plan.messages().size(); ++i) {
        const auto& m = plan.messages()[i];
        reshard::pack_message(plan, m, olds[size_t(plan.old_rank_of(m.src_process))],
                              staging[i].data());
        reshard::unpack_message(plan, m, staging[i].data(),
                                news[size_t(plan.new_rank_of(m.dst_process))]);
      }
    });
  }
}

void bench_boxes(const Options& o) {
  const Shape shape{4096, 4096};
  std::vector<float> a(size_t(shape.numel())), packed(size_t(shape.numel()));
  std::iota(a.begin(), a.end(), 0.0f);
  std::vector<float> back(a.size(), 0.0f);
  auto pack = [&](const std::string& name, const Box& box) {
    time_case(o, "box/pack " + name, double(box.volume()) * 4,
              [&] { pack_box(a.data(), shape, box, packed.data(), sizeof(float)); });
    time_case(o, "box/unpack " + name, double(box.volume()) * 4,
              [&] { unpack_box(packed.data(), box, back.data(), shape, sizeof(float)); });
  };
  pack("whole [4096, 4096]", Box::of(shape));
  pack("column half [:, 2048:4096]", Box({0, 2048}, {4096, 4096}));
  pack("16-column strip [:, 1000:1016]", Box({0, 1000}, {4096, 1016}));
  // 3-d: a [64, 64, 4096]-shaped view of the same memory, a box in the middle.
  const Shape s3{64, 64, 4096};
  const Box b3({8, 4, 512}, {56, 60, 2560});
  time_case(o, "box/pack 3-d [8:56, 4:60, 512:2560]", double(b3.volume()) * 4,
            [&] { pack_box(a.data(), s3, b3, packed.data(), sizeof(float)); });
}

void bench_store(const Options& o) {
  const fs::path dir = fs::path(o.dir) / fmt::format("bench-reshard-{}", ::getpid());
  fs::create_directories(dir);
  const Shape shape{8192, 1024};
  std::vector<float> t(size_t(shape.numel()));
  std::iota(t.begin(), t.end(), 0.0f);
  const std::string st = (dir / "t.safetensors").string();
  store::write_safetensors(st, {{"t", DType::f32, shape, t.data()}});
  const std::string ck = (dir / "ckpt").string();
  {
    store::CheckpointWriterOptions opt;
    opt.save_id = "bench";
    for (int r = 0; r < 2; ++r) {
      store::CheckpointWriter w(ck, r, opt);
      const Box half({4096 * r, 0}, {4096 * (r + 1), 1024});
      w.add("t", DType::f32, shape, half, t.data() + size_t(r) * 4096 * 1024);
      w.write_rank_file();
      if (r == 1) w.commit(2, nlohmann::json::object());
    }
  }
  const auto reader = store::SafetensorsReader::open(st);
  const store::CheckpointReader ckpt(ck);
  std::vector<float> out(t.size());
  const std::vector<std::pair<std::string, Box>> boxes = {
      {"columns [:, 256:768]", Box({0, 256}, {8192, 768})},
      {"16-column strip [:, 100:116]", Box({0, 100}, {8192, 116})},
      {"rows [1000:7000, :]", Box({1000, 0}, {7000, 1024})},
  };
  for (const auto& [name, box] : boxes) {
    time_case(o, "store/safetensors " + name, double(box.volume()) * 4,
              [&] { reader.read_box("t", box, out.data()); });
    time_case(o, "store/checkpoint " + name, double(box.volume()) * 4,
              [&] { ckpt.read_box("t", box, out.data()); });
  }
  fs::remove_all(dir);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  o.dir = fs::temp_directory_path().string();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) {
      o.reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--only" && i + 1 < argc) {
      o.only = argv[++i];
    } else if (a == "--dir" && i + 1 < argc) {
      o.dir = argv[++i];
    } else {
      fmt::print(stderr, "usage: bench_reshard [--reps 5] [--only SUBSTRING] [--dir TMPDIR]\n");
      return 2;
    }
  }
  const Layout dp2{"dp2", plan_of(2, 1, 1, 0)}, tp2{"tp2", plan_of(1, 2, 1, 0)},
      tp4{"tp4", plan_of(1, 4, 1, 0)}, pp2{"pp2", plan_of(1, 1, 2, 0)},
      z2{"dp2-zero1", plan_of(2, 1, 1, 1)}, z3{"dp3-zero1", plan_of(3, 1, 1, 1)},
      dp2tp2{"dp2-tp2", plan_of(2, 2, 1, 0)};
  bench_reshard(o, "gpt2-124m", model::ModelConfig::preset("gpt2-124m"),
                {{dp2, tp2}, {tp2, pp2}, {z2, z3}, {tp2, dp2}});
  model::ModelConfig narrow = model::ModelConfig::preset("gpt2-tiny");
  narrow.name = "narrow";
  narrow.n_layer = 48;
  narrow.n_embd = 128;
  narrow.n_head = 4;
  narrow.n_kv_head = 4;
  narrow.ffn_hidden = 512;
  narrow.validate();
  bench_reshard(o, "narrow", narrow, {{dp2, tp4}, {tp4, dp2tp2}, {tp2, pp2}, {z2, z3}});
  bench_boxes(o);
  bench_store(o);
  nlohmann::json j;
  j["reps"] = o.reps;
  j["cases"] = nlohmann::json::object();
  for (const auto& r : results) {
    j["cases"][r.name] = {{"median_ms", std::round(r.median_ms * 1000) / 1000},
                          {"min_ms", std::round(r.min_ms * 1000) / 1000}};
  }
  fmt::print("{}\n", j.dump());
  return 0;
}
