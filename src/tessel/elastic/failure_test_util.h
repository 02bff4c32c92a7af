// What the failure tests share: `tessel train` run beside a bash script that kills, stops or
// signals its workers, and the checks that the job still computed what an uninterrupted
// single-process run computes.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/config/config_test_util.h"
#include "tessel/runtime/step_check_test_util.h"
#include "tessel/testing/testing.h"

namespace tessel::elastic::testing {

using tessel::testing::TempDir;

inline std::vector<nlohmann::json> read_lines(const std::filesystem::path& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// A cluster job's checkpoints as the test reads them: each host (its agent's --checkpoint-dir,
// `hosts`) holds its ranks' files and a copy of another host's, never all of them. Gathers every
// step directory published on any host into `into` (the union of their rank files; the index
// and manifest are the same on every host), points its `latest` at the newest, and checks what
// the copies are for: every rank file is on `copies` hosts (2 while two hosts served the job:
// the others then still hold every file when any one host is lost).
inline void gather_host_checkpoints(const std::vector<std::filesystem::path>& hosts,
                                    const std::filesystem::path& into, size_t copies) {
  namespace fs = std::filesystem;
  std::map<std::string, std::map<std::string, std::set<size_t>>> held;  // step -> file -> hosts
  std::map<std::string, fs::path> published;  // step -> one host's copy of the directory
  for (size_t h = 0; h < hosts.size(); ++h) {
    if (!fs::is_directory(hosts[h])) continue;
    for (const auto& d : fs::directory_iterator(hosts[h])) {
      const std::string name = d.path().filename().string();
      if (name.rfind("step-", 0) != 0 || name.find('.') != std::string::npos ||
          !fs::exists(d.path() / "manifest.json"))
        continue;
      published[name] = d.path();
      held[name];
      for (const auto& f : fs::directory_iterator(d.path()))
        if (f.path().extension() == ".safetensors")
          held[name][f.path().filename().string()].insert(h);
    }
  }
  // A host that died before it published a step still held its files of that save on its disk
  // (in the save's staging directory): they count as held.
  for (size_t h = 0; h < hosts.size(); ++h)
    for (const auto& [name, dir] : published) {
      const auto manifest = nlohmann::json::parse(read_text(dir / "manifest.json"));
      const auto staging = hosts[h] / (name + ".tmp-" + manifest.at("save_id").get<std::string>());
      if (fs::is_directory(staging))
        for (const auto& f : fs::directory_iterator(staging))
          if (f.path().extension() == ".safetensors")
            held[name][f.path().filename().string()].insert(h);
    }
  for (const auto& [name, dir] : published) {
    const auto index = nlohmann::json::parse(read_text(dir / "index.json"));
    for (const auto& [file, info] : index.at("files").items()) {
      const auto& where = held[name][file];
      ASSERT_FALSE(where.empty()) << name << ": no host holds " << file;
      EXPECT_GE(where.size(), copies) << name << ": " << file << " is on too few hosts";
      fs::create_directories(into / name);
      for (size_t h : where)
        if (fs::exists(hosts[h] / name / file)) {
          fs::copy_file(hosts[h] / name / file, into / name / file,
                        fs::copy_options::overwrite_existing);
          break;
        }
    }
    for (const char* f : {"index.json", "manifest.json"})
      fs::copy_file(dir / f, into / name / f, fs::copy_options::overwrite_existing);
  }
  if (!published.empty()) std::ofstream(into / "latest") << published.rbegin()->first << "\n";
}

// A cluster's token file (elastic/cluster.h) holding `token`, readable by its owner only.
inline std::string write_cluster_token(const TempDir& dir, const std::string& name,
                                       const std::string& token) {
  const auto path = dir.path() / name;
  std::ofstream(path) << token << "\n";
  std::filesystem::permissions(
      path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  return path.string();
}

// The data-order log: for every step, the entries of the last generation that ran it split the
// step's window [(s-1) * batch, s * batch) of the global sample order exactly (no sample
// repeated or skipped in the history the final state comes from).
inline void expect_exact_data_order(const std::filesystem::path& log, int64_t steps,
                                    int64_t batch) {
  std::map<int64_t, std::map<int, std::vector<nlohmann::json>>> by_step;  // step -> gen -> lines
  for (const auto& l : read_lines(log))
    by_step[l.at("step").get<int64_t>()][l.at("generation").get<int>()].push_back(l);
  ASSERT_EQ(int64_t(by_step.size()), steps);
  for (const auto& [step, gens] : by_step) {
    const auto& lines = gens.rbegin()->second;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (const auto& l : lines)
      ranges.emplace_back(l.at("first").get<int64_t>(),
                          l.at("first").get<int64_t>() + l.at("count").get<int64_t>());
    std::sort(ranges.begin(), ranges.end());
    int64_t at = (step - 1) * batch;
    for (const auto& [lo, hi] : ranges) {
      EXPECT_EQ(lo, at) << "step " << step << ": a gap or an overlap in the samples";
      at = hi;
    }
    EXPECT_EQ(at, step * batch) << "step " << step;
  }
}

// The training, output and checkpoint sections every job here (and the single-process config it
// is checked against) shares: checkpoints after every step, the step-by-step check needs them.
struct Job {
  int64_t steps;
  std::string training() const {
    return fmt::format(
        "training: {{steps: {}, global_batch: 12, micro_batch: 2, threads: 1}}\n"
        "optimizer: {{lr: 0.003, warmup_steps: 1}}\n",
        steps);
  }
  std::string config() const {
    return training() + runtime::testing::every_step_checkpoints(steps, "ck") +
           "output: {metrics: metrics.jsonl, events: events.jsonl, data_order: order.jsonl}\n";
  }
};

// Runs `tessel train` on `cfg` in the background with `killer` (bash; $L is the launcher's pid,
// and "echo killed $k" marks each kill) running beside it, then waits for the job and prints
// "train exit <code>"; returns the script's exit code, its output in *out. Bounded by `timeout`: a
// hang fails the test instead of blocking it.
inline int train_with_killer(const TempDir& dir, const std::string& cfg, const std::string& killer,
                             std::string* out) {
  const auto bin = tessel::testing::tessel_binary().string();
  std::ofstream(dir / "kill.sh") << fmt::format(
      "cd {dir}\nexport TESSEL_CTL_DIR={dir}/ctl OMP_NUM_THREADS=1\n"
      "{bin} train {cfg} > train.out 2>&1 &\n"
      "L=$!\n"
      "lines() {{ [ -f metrics.jsonl ] && wc -l < metrics.jsonl || echo 0; }}\n"
      "{killer}"
      "wait $L\n"
      "echo train exit $?\n",
      fmt::arg("dir", dir.path().string()), fmt::arg("bin", bin), fmt::arg("cfg", cfg),
      fmt::arg("killer", killer));
  return tessel::testing::run_command(
      fmt::format("timeout 400 bash {}", (dir / "kill.sh").string()), out);
}

// SIGKILLs `kills` random workers at random moments, each once the job has trained two steps
// since the previous recovery (the first not before `first_after` steps).
inline int train_and_kill(const TempDir& dir, const std::string& cfg, int kills, std::string* out,
                          int first_after = 0) {
  const std::string killer = fmt::format(
      "RANDOM=7\n"
      "recovered() {{ [ -f events.jsonl ] && grep -c '\"event\":\"recover\"' events.jsonl || "
      "echo 0; }}\n"
      "for k in $(seq {kills}); do\n"
      "  n=$(lines); [ $n -lt {first} ] && n={first}\n"
      "  for i in $(seq 2000); do [ $(lines) -ge $((n + 2)) ] && break; kill -0 $L || break; "
      "sleep 0.01; done\n"
      "  sleep 0.0$((RANDOM % 10))\n"
      "  pids=($(pgrep -P $L))\n"
      "  [ ${{#pids[@]}} -gt 0 ] || break\n"
      "  victim=${{pids[$((RANDOM % ${{#pids[@]}}))]}}\n"
      "  kill -9 $victim && echo killed $k\n"
      "  for i in $(seq 3000); do [ $(recovered) -ge $k ] && break; kill -0 $L 2>/dev/null || "
      "break; sleep 0.01; done\n"
      "done\n",
      fmt::arg("kills", kills), fmt::arg("first", std::max(0, first_after - 2)));
  return train_with_killer(dir, cfg, killer, out);
}

// What every surviving run must show: each step, as last recorded, equals one single-process
// step from the state saved before it, with at most `unlogged` steps missing from the metrics (a
// step whose loss was being reduced when a worker died has no record); the data order is exact;
// the final checkpoint is at the last step.
inline void expect_like_one_process(const TempDir& dir, const std::string& corpus, const Job& job,
                                    int64_t unlogged) {
  const auto checked = runtime::testing::expect_steps_match_one_process(
      config::testing::write_config(dir, corpus, job.training(), "single.yaml"), dir / "ck",
      runtime::testing::read_step_losses(dir / "metrics.jsonl"), 1, job.steps);
  EXPECT_EQ(checked.steps, job.steps);
  EXPECT_LE(checked.unlogged, unlogged);
  expect_exact_data_order(dir / "order.jsonl", job.steps, 12);
  EXPECT_EQ(checkpoint::latest_sharded_checkpoint((dir / "ck").string()),
            (dir / "ck" / checkpoint::checkpoint_step_name(job.steps)).string());
}

}  // namespace tessel::elastic::testing
