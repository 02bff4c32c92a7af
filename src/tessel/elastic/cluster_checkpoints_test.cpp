// The choice of the checkpoint a cluster job resumes from or rolls back to: the newest one whose
// every rank file is still on a host that serves the job. (The whole save and restore path, with
// hosts dying, is in cluster_test.cpp, in network namespaces.)
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "tessel/comm/memory_store.h"
#include "tessel/elastic/cluster.h"
#include "tessel/elastic/cluster_checkpoints.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/testing/testing.h"

namespace tessel::elastic {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using tessel::testing::TempDir;

// The entries of a two-rank save of one tensor (each rank a half), as the ranks announce them.
std::vector<nlohmann::json> two_rank_entries(const fs::path& scratch, const std::string& save_id) {
  std::vector<float> values(8);
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(i);
  std::vector<nlohmann::json> entries;
  for (int r = 0; r < 2; ++r) {
    store::CheckpointWriterOptions o;
    o.save_id = save_id;
    store::CheckpointWriter w((scratch / "step").string(), r, o);
    w.add("w", DType::f32, Shape{8}, Box({int64_t(r) * 4}, {int64_t(r) * 4 + 4}),
          values.data() + r * 4);
    w.write_rank_file();
    entries.push_back(w.rank_file_entry());
  }
  return entries;
}

TEST(ClusterCheckpoints, TheNewestCommitWhoseFilesAreAllOnLiveHostsIsChosen) {
  TempDir dir;
  auto store = std::make_shared<comm::MemoryStore>();
  const auto token = dir.path() / "token";
  std::ofstream(token) << "cluster-checkpoints-test-token\n";
  fs::permissions(token, fs::perms::owner_read | fs::perms::owner_write);

  ClusterCheckpointsConfig c;
  c.cluster = "c";
  c.job = "j";
  c.checkpoint_dir = "/data/ck";
  c.root = (dir.path() / "host0").string();
  c.keep = 5;
  c.secret = "cluster-checkpoints-test-token";
  c.timeout = 5s;
  // Host 1 serves the job (its store key on a live lease); host 2 is gone.
  store->set(store_key("j", 1),
             StoreRecord{1, "http://127.0.0.1:1", "/elsewhere", ""}.to_json().dump());
  // Step 1: each file on a live host. Step 2: rank 1's only on host 2.
  const std::string ck = checkpoints_prefix("c", "/data/ck");
  for (int step : {1, 2}) {
    const std::string name = fmt::format("step-{:08d}", step);
    const std::string save_id = fmt::format("j-g0-{}", step);
    const auto entries = two_rank_entries(dir.path() / name, save_id);
    CheckpointCommit commit;
    commit.name = name;
    commit.save_id = save_id;
    commit.step = step;
    commit.num_ranks = 2;
    commit.meta = {{"step", step}};
    commit.holders["rank-00000.safetensors"] = {0, 1};
    commit.holders["rank-00001.safetensors"] =
        step == 1 ? std::vector<int>{1, 2} : std::vector<int>{2};
    for (int r = 0; r < 2; ++r)
      store->set(ck + "entries/" + name + fmt::format("/{:05d}", r), entries[size_t(r)].dump());
    store->set(ck + "commits/" + name, commit.to_json().dump());
  }
  EXPECT_EQ(list_commits(*store, c).size(), 2u);

  CheckpointKeeper keeper(store, c, 0, "127.0.0.1", token.string(), store->grant_lease(60s));
  const auto newest = keeper.newest();
  ASSERT_TRUE(newest.has_value());
  EXPECT_EQ(newest->second, 1);
  EXPECT_EQ(newest->first, (fs::path(c.root) / "step-00000001").string());
  // Published here although this host holds none of its files: the index and manifest alone.
  store::CheckpointReaderOptions partial;
  partial.allow_missing_files = true;
  store::CheckpointReader reader(newest->first, partial);
  EXPECT_EQ(reader.meta().at("step"), 1);
  EXPECT_EQ(reader.missing_files().size(), 2u);

  // Host 1 gone too: rank 0's file of step 1 is still here (host 0), rank 1's is not.
  store->erase(store_key("j", 1));
  EXPECT_FALSE(keeper.newest().has_value());
}

}  // namespace
}  // namespace tessel::elastic
