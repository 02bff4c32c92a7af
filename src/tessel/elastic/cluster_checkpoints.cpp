#include "tessel/elastic/cluster_checkpoints.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <thread>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/elastic/cluster.h"
#include "tessel/store/checkpoint_root_server.h"
#include "tessel/store/checksum.h"
#include "tessel/store/remote_pieces.h"

namespace tessel::elastic {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

std::string rank_segment(int rank) {
  return fmt::format("{:05d}", rank);
}

// The checkpoint's own keys (its record and its entries), for removal.
void erase_prefix(comm::ControlStore& store, const std::string& prefix) {
  for (const auto& kv : store.list(prefix)) store.erase(kv.key);
}

// An exclusive flock on root/.publish.lock while it lives: the agent and a worker of one host
// may both publish a checkpoint there.
class PublishLock {
 public:
  // Waits at most `timeout` for the other publisher (a publish is a few small writes).
  PublishLock(const std::string& root, std::chrono::milliseconds timeout) {
    fs::create_directories(root);
    const std::string path = (fs::path(root) / ".publish.lock").string();
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    TESSEL_CHECK(fd_ >= 0, IoError, "cannot open '{}': {}", path, std::strerror(errno));
    const auto deadline = Clock::now() + timeout;
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == EWOULDBLOCK && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      ::close(fd_);
      TESSEL_CHECK(err != EWOULDBLOCK, TimeoutError,
                   "'{}' stayed locked for {} s: another process publishing this host's "
                   "checkpoints is stuck (see the agent's and the workers' logs)",
                   path, timeout.count() / 1000);
      TESSEL_THROW(IoError, "cannot lock '{}': {}", path, std::strerror(err));
    }
  }
  ~PublishLock() { ::close(fd_); }
  PublishLock(const PublishLock&) = delete;
  PublishLock& operator=(const PublishLock&) = delete;

 private:
  int fd_ = -1;
};

// The save id of the checkpoint published in `dir`, if one is.
std::string published_save_id(const fs::path& dir) {
  std::ifstream in(dir / "manifest.json");
  if (!in) return "";
  try {
    return json::parse(in).value("save_id", "");
  } catch (const json::exception&) {
    return "";
  }
}

std::map<int, StoreRecord> list_stores(comm::ControlStore& store, const std::string& job) {
  std::map<int, StoreRecord> out;
  for (const auto& kv : store.list(stores_prefix(job))) try {
      auto r = StoreRecord::from_json(json::parse(kv.value), kv.key);
      out[r.host] = r;
    } catch (const std::exception& e) {
      spdlog::warn("{}: {}", kv.key, e.what());
    }
  return out;
}

}  // namespace

json StoreRecord::to_json() const {
  return {{"host", host}, {"url", url}, {"dir", dir}, {"published", published}};
}

StoreRecord StoreRecord::from_json(const json& d, const std::string& what) {
  return parse_record(what, "store record", [&] {
    StoreRecord r;
    r.host = d.at("host").get<int>();
    r.url = d.at("url").get<std::string>();
    r.dir = d.at("dir").get<std::string>();
    r.published = d.value("published", "");
    return r;
  });
}

json CheckpointCommit::to_json() const {
  return {{"name", name},           {"save_id", save_id}, {"step", step},
          {"num_ranks", num_ranks}, {"meta", meta},       {"holders", holders}};
}

CheckpointCommit CheckpointCommit::from_json(const json& d, const std::string& what) {
  return parse_record(what, "checkpoint commit", [&] {
    CheckpointCommit c;
    c.name = d.at("name").get<std::string>();
    c.save_id = d.at("save_id").get<std::string>();
    c.step = d.at("step").get<int64_t>();
    c.num_ranks = d.at("num_ranks").get<int>();
    c.meta = d.at("meta");
    c.holders = d.at("holders").get<std::map<std::string, std::vector<int>>>();
    return c;
  });
}

std::string stores_prefix(const std::string& job) {
  return fmt::format("/tessel/{}/stores/", job);
}
std::string store_key(const std::string& job, int host) {
  return stores_prefix(job) + std::to_string(host);
}
std::string saves_prefix(const std::string& job) {
  return fmt::format("/tessel/{}/saves/", job);
}
std::string save_prefix(const std::string& job, const std::string& save_id) {
  return saves_prefix(job) + save_id + "/";
}
std::string checkpoints_prefix(const std::string& cluster, const std::string& checkpoint_dir) {
  return fmt::format(
      "{}checkpoints/{}/", cluster_prefix(cluster),
      store::checksum_hex(store::xxh3(checkpoint_dir.data(), checkpoint_dir.size())));
}

std::vector<CheckpointCommit> list_commits(comm::ControlStore& store,
                                           const ClusterCheckpointsConfig& c) {
  std::vector<CheckpointCommit> out;
  for (const auto& kv : store.list(checkpoints_prefix(c.cluster, c.checkpoint_dir) + "commits/")) {
    try {
      out.push_back(CheckpointCommit::from_json(json::parse(kv.value), kv.key));
    } catch (const std::exception& e) {
      spdlog::warn("{}: {}", kv.key, e.what());
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

std::string publish_locally(comm::ControlStore& store, const ClusterCheckpointsConfig& c,
                            const CheckpointCommit& commit) {
  const fs::path dir = fs::path(c.root) / commit.name;
  PublishLock lock(c.root, c.timeout);
  if (published_save_id(dir) != commit.save_id) {
    const std::string prefix =
        checkpoints_prefix(c.cluster, c.checkpoint_dir) + "entries/" + commit.name + "/";
    std::vector<json> entries;
    for (const auto& kv : store.list(prefix)) entries.push_back(json::parse(kv.value));
    TESSEL_CHECK(int(entries.size()) == commit.num_ranks, CorruptDataError,
                 "checkpoint {} of the cluster lists {} of its {} rank files under {} (removed "
                 "by hand?)",
                 commit.name, entries.size(), commit.num_ranks, prefix);
    // A host that holds none of the rank files publishes the index and manifest alone: its
    // workers read every piece from the hosts that hold them.
    fs::create_directories(store::staging_dir_for(dir.string(), commit.save_id));
    store::commit_checkpoint(dir.string(), commit.save_id, entries, commit.meta, commit.num_ranks);
  }
  // `latest` never moves back to an older step.
  std::string latest;
  std::ifstream(fs::path(c.root) / "latest") >> latest;
  if (latest.empty() || latest <= commit.name)
    checkpoint::point_latest_and_prune(c.root, commit.name, c.keep);
  return dir.string();
}

// --- the worker's side ---------------------------------------------------------------------

ClusterSaves::ClusterSaves(std::shared_ptr<comm::ControlStore> store,
                           ClusterCheckpointsConfig config, int host)
    : store_(std::move(store)), c_(std::move(config)), host_(host) {}

void ClusterSaves::announce(const std::string& save_id, const std::string& name, int rank,
                            const json& entry) {
  int copy_to = -1;
  if (c_.copies >= 2) {
    const auto stores = list_stores(*store_, c_.job);
    // The host before this one by id, around: every host copies for one other. (Not the next:
    // processes are placed filling hosts in id order, so after a loss the next host is where
    // the lost host's ranks tend to go -- a copy there would rarely be read from elsewhere,
    // which is fine, but the previous host spreads the reads.)
    for (auto it = stores.rbegin(); it != stores.rend(); ++it)
      if (it->first < host_) {
        copy_to = it->first;
        break;
      }
    if (copy_to < 0 && !stores.empty() && stores.rbegin()->first != host_)
      copy_to = stores.rbegin()->first;
  }
  store_->set(save_prefix(c_.job, save_id) + "files/" + rank_segment(rank),
              json{{"entry", entry}, {"host", host_}, {"copy_to", copy_to}, {"dir", name}}.dump());
}

void ClusterSaves::commit(const std::string& save_id, const std::string& name, int64_t step,
                          int num_ranks, const json& meta, const std::atomic<bool>& cancelled) {
  const std::string prefix = save_prefix(c_.job, save_id);
  const auto deadline = Clock::now() + c_.timeout;
  std::map<int, json> files;
  std::map<int, int> copies;
  try {
    for (;;) {
      files.clear();
      copies.clear();
      for (const auto& kv : store_->list(prefix + "files/"))
        files[std::stoi(kv.key.substr(kv.key.rfind('/') + 1))] = json::parse(kv.value);
      for (const auto& kv : store_->list(prefix + "copies/"))
        copies[std::stoi(kv.key.substr(kv.key.rfind('/') + 1))] =
            json::parse(kv.value).at("host").get<int>();
      std::vector<std::string> missing;
      for (int r = 0; r < num_ranks; ++r) {
        const auto f = files.find(r);
        if (f == files.end())
          missing.push_back(fmt::format("rank {}'s file", r));
        else if (f->second.at("copy_to").get<int>() >= 0 && !copies.contains(r))
          missing.push_back(fmt::format("the copy of rank {}'s file on host {}", r,
                                        f->second.at("copy_to").get<int>()));
      }
      if (missing.empty()) break;
      TESSEL_CHECK(!cancelled, IoError, "the save of {} was cancelled", name);
      TESSEL_CHECK(Clock::now() < deadline, TimeoutError,
                   "checkpoint {} not committed within {} s: still missing {}", name,
                   c_.timeout.count() / 1000, fmt::join(missing, ", "));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    CheckpointCommit commit;
    commit.name = name;
    commit.save_id = save_id;
    commit.step = step;
    commit.num_ranks = num_ranks;
    commit.meta = meta;
    const std::string ck = checkpoints_prefix(c_.cluster, c_.checkpoint_dir);
    // A commit of the same step by an earlier world is replaced whole.
    erase_prefix(*store_, ck + "entries/" + name + "/");
    for (const auto& [r, f] : files) {
      const std::string file = f.at("entry").at("file").get<std::string>();
      auto& h = commit.holders[file];
      h.push_back(f.at("host").get<int>());
      if (const auto c = copies.find(r); c != copies.end()) h.push_back(c->second);
      store_->set(ck + "entries/" + name + "/" + rank_segment(r), f.at("entry").dump());
    }
    store_->set(ck + "commits/" + name, commit.to_json().dump());  // the commit point
  } catch (...) {
    erase_prefix(*store_, prefix);
    throw;
  }
  erase_prefix(*store_, prefix);
  const auto all = list_commits(*store_, c_);
  const std::string ck = checkpoints_prefix(c_.cluster, c_.checkpoint_dir);
  for (size_t i = 0; i + size_t(std::max(c_.keep, 1)) < all.size(); ++i) {
    store_->erase(ck + "commits/" + all[i].name);
    erase_prefix(*store_, ck + "entries/" + all[i].name + "/");
  }
}

int64_t ClusterSaves::newest_step() {
  const auto all = list_commits(*store_, c_);
  return all.empty() ? -1 : all.back().step;
}

ClusterSaves::Opened ClusterSaves::open(const std::string& name) {
  std::optional<CheckpointCommit> commit;
  for (auto& c : list_commits(*store_, c_))
    if (c.name == name) commit = std::move(c);
  TESSEL_CHECK(commit.has_value(), CorruptDataError,
               "checkpoint {} is not among the cluster's committed checkpoints of '{}' (under {})",
               name, c_.checkpoint_dir, checkpoints_prefix(c_.cluster, c_.checkpoint_dir));
  const std::string dir = publish_locally(*store_, c_, *commit);
  // The hosts holding what this one lacks serve it once they have published it too (their
  // agents do so as soon as they see the commit): wait for them, within the timeout.
  const auto deadline = Clock::now() + c_.timeout;
  auto stores = list_stores(*store_, c_.job);
  for (;;) {
    bool behind = false;
    for (const auto& [file, hosts] : commit->holders)
      for (int h : hosts)
        if (const auto s = stores.find(h);
            h != host_ && s != stores.end() && s->second.published < name)
          behind = true;
    if (!behind || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    stores = list_stores(*store_, c_.job);
  }
  Opened o;
  store::CheckpointReaderOptions ro;
  ro.allow_missing_files = true;
  o.reader = std::make_unique<store::CheckpointReader>(dir, ro);
  store::FileHosts hosts;
  for (const auto& file : o.reader->missing_files()) {
    o.remote_files.push_back(file);
    auto& urls = hosts[file];
    if (const auto h = commit->holders.find(file); h != commit->holders.end())
      for (int host : h->second)
        if (const auto s = stores.find(host); s != stores.end() && host != host_)
          urls.push_back(s->second.url);
  }
  store::RemoteOptions ro2;
  ro2.timeout = c_.timeout;
  ro2.bearer_token = c_.secret;
  if (!hosts.empty()) o.fetch = store::http_piece_fetcher(name, std::move(hosts), ro2);
  return o;
}

// --- the agent's side ----------------------------------------------------------------------

CheckpointKeeper::CheckpointKeeper(std::shared_ptr<comm::ControlStore> store,
                                   ClusterCheckpointsConfig config, int host,
                                   const std::string& address, const std::string& token_file,
                                   comm::LeaseId lease)
    : store_(std::move(store)), c_(std::move(config)), host_(host) {
  fs::create_directories(c_.root);
  store::CheckpointRootServerOptions so;
  so.server.host = address;
  so.server.port = 0;
  so.server.token_file = token_file;
  server_ = std::make_unique<store::CheckpointRootServer>(c_.root, so);
  const int port = server_->start();
  record_ = StoreRecord{host_, fmt::format("http://{}:{}", address, port), c_.root, ""};
  lease_ = lease;
  store_->set(store_key(c_.job, host_), record_.to_json().dump(), lease_);
  spdlog::info("agent: serving job {}'s checkpoints in {} at {}", c_.job, c_.root, record_.url);
  thread_ = std::thread([this] { run(); });
}

CheckpointKeeper::~CheckpointKeeper() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  // The job's last save is on this host's disk as a checkpoint too, not only in etcd.
  try {
    publish_what_is_committed();
  } catch (const std::exception& e) {
    spdlog::warn("agent: job {}'s last checkpoints not published here: {}", c_.job, e.what());
  }
  if (server_) server_->stop();
}

void CheckpointKeeper::run() {
  while (!stop_) {
    try {
      copy_what_is_asked();
      publish_what_is_committed();
    } catch (const std::exception& e) {
      spdlog::warn("agent: job {}'s checkpoints: {}", c_.job, e.what());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void CheckpointKeeper::copy_what_is_asked() {
  const std::string saves = saves_prefix(c_.job);
  std::optional<std::map<int, StoreRecord>> stores;  // read once there is something to copy
  std::set<std::string> announced;
  for (const auto& kv : store_->list(saves)) {
    // .../saves/<save_id>/files/<rank>
    const auto rest = kv.key.substr(saves.size());
    const auto slash = rest.find("/files/");
    if (slash == std::string::npos) continue;
    announced.insert(rest);
    if (copied_.contains(rest)) continue;
    const json f = json::parse(kv.value);
    if (f.at("copy_to").get<int>() != host_) continue;
    copied_.insert(rest);  // tried once: a copy that fails leaves the save incomplete
    const std::string save_id = rest.substr(0, slash);
    const int from = f.at("host").get<int>();
    if (!stores) stores = list_stores(*store_, c_.job);
    const auto src = stores->find(from);
    if (src == stores->end()) {
      spdlog::warn("agent: cannot copy {} of save {}: host {} serves no checkpoints",
                   f.at("entry").value("file", "?"), save_id, from);
      continue;
    }
    const json& entry = f.at("entry");
    // The writer's staging directory, and the same one here.
    const std::string step_dir = f.value("dir", "");
    const std::string rel = fs::path(store::staging_dir_for(step_dir, save_id)).string();
    const std::string dest = (fs::path(c_.root) / rel).string();
    try {
      fs::create_directories(dest);
      store::RemoteOptions ro;
      ro.timeout = c_.timeout;
      ro.bearer_token = c_.secret;
      const auto t0 = Clock::now();
      store::download_rank_file(src->second.url, rel, entry, dest, ro);
      store_->set(save_prefix(c_.job, save_id) + "copies/" + rest.substr(slash + 7),
                  json{{"host", host_}}.dump());
      spdlog::info("agent: kept a copy of {} of save {} from host {} ({:.1f} MB in {:.2f} s)",
                   entry.value("file", "?"), save_id, from,
                   double(entry.value("bytes", uint64_t(0))) / 1e6,
                   std::chrono::duration<double>(Clock::now() - t0).count());
    } catch (const std::exception& e) {
      spdlog::warn("agent: could not copy {} of save {} from host {}: {}", entry.value("file", "?"),
                   save_id, from, e.what());
    }
  }
  // Saves committed or abandoned are gone from etcd: forget them.
  std::erase_if(copied_, [&](const std::string& k) { return !announced.contains(k); });
}

// Every commit newer than the last one published here, in order: each is a checkpoint the
// job may roll back to, or resume from.
void CheckpointKeeper::publish_what_is_committed() {
  for (const auto& c : list_commits(*store_, c_)) {
    if (!published_.empty() && c.name <= published_) continue;
    publish_locally(*store_, c_, c);
    published_ = c.name;
    record_.published = c.name;
    store_->set(store_key(c_.job, host_), record_.to_json().dump(), lease_);
  }
}

// The newest commit that can still be read: every rank file on a host that serves the job
// (this one included). One whose only holders are gone would fail every restore from it, and a
// rollback would choose it again and again.
std::optional<std::pair<std::string, int64_t>> CheckpointKeeper::newest() {
  const auto all = list_commits(*store_, c_);
  const auto stores = list_stores(*store_, c_.job);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    std::string lost;
    for (const auto& [file, hosts] : it->holders)
      if (std::none_of(hosts.begin(), hosts.end(),
                       [&](int h) { return h == host_ || stores.contains(h); }))
        lost = file;
    if (lost.empty()) return std::make_pair(publish_locally(*store_, c_, *it), it->step);
    spdlog::warn("checkpoint {} cannot be read: every host holding {} is gone; trying an older one",
                 it->name, lost);
  }
  return std::nullopt;
}

}  // namespace tessel::elastic
