#include "tessel/elastic/cluster.h"

#include <fmt/format.h>

#include "tessel/comm/etcd_store.h"
#include "tessel/comm/signed_store.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/elastic/reconfiguration.h"
#include "tessel/net/bearer_token.h"

namespace tessel::elastic {

nlohmann::json HostRecord::to_json() const {
  return {{"id", id},       {"name", name},           {"address", address}, {"slots", slots},
          {"iface", iface}, {"agent_pid", agent_pid}, {"started", started}};
}

HostRecord HostRecord::from_json(const nlohmann::json& d, const std::string& what) {
  return parse_record(what, "host record", [&] {
    HostRecord h;
    h.id = d.at("id").get<int>();
    h.name = d.at("name").get<std::string>();
    h.address = d.at("address").get<std::string>();
    h.slots = d.at("slots").get<int>();
    h.iface = d.at("iface").get<std::string>();
    h.agent_pid = d.at("agent_pid").get<int64_t>();
    h.started = d.at("started").get<double>();
    TESSEL_CHECK(h.id >= 0 && h.slots >= 1, CorruptDataError,
                 "{} is not a valid host record: id {} and slots {} must be >= 0 and >= 1", what,
                 h.id, h.slots);
    return h;
  });
}

nlohmann::json JobSubmission::to_json() const {
  return {{"job", job},
          {"config_yaml", config_yaml},
          {"config_path", config_path},
          {"steps", steps},
          {"submitted", submitted}};
}

JobSubmission JobSubmission::from_json(const nlohmann::json& d, const std::string& what) {
  return parse_record(what, "job submission", [&] {
    JobSubmission j;
    j.job = d.at("job").get<std::string>();
    j.config_yaml = d.at("config_yaml").get<std::string>();
    j.config_path = d.at("config_path").get<std::string>();
    j.steps = d.at("steps").get<int64_t>();
    j.submitted = d.at("submitted").get<double>();
    check_key_segment(j.job, what + ": job");
    return j;
  });
}

nlohmann::json Placement::to_json() const {
  return {
      {"process", process}, {"host", host}, {"generation", generation}, {"host_name", host_name}};
}

Placement Placement::from_json(const nlohmann::json& d, const std::string& what) {
  return parse_record(what, "placement", [&] {
    return Placement{d.at("process").get<int>(), d.at("host").get<int>(),
                     d.at("generation").get<int>(), d.at("host_name").get<std::string>()};
  });
}

nlohmann::json ExitReport::to_json() const {
  return {{"process", process},   {"host", host}, {"ok", ok},
          {"signaled", signaled}, {"how", how},   {"crashed", crashed}};
}

ExitReport ExitReport::from_json(const nlohmann::json& d, const std::string& what) {
  return parse_record(what, "exit report", [&] {
    return ExitReport{d.at("process").get<int>(),     d.at("host").get<int>(),
                      d.at("ok").get<bool>(),         d.at("signaled").get<bool>(),
                      d.at("how").get<std::string>(), d.value("crashed", false)};
  });
}

nlohmann::json StartRecord::to_json() const {
  return {{"plan", layout::to_json(plan)},
          {"members", members},
          {"hosts", hosts},
          {"step", step},
          {"resume_from", resume_from}};
}

StartRecord StartRecord::from_json(const nlohmann::json& d, const std::string& what) {
  return parse_record(what, "start record", [&] {
    StartRecord s;
    s.plan = layout::plan_from_json(d.at("plan"));
    s.members = d.at("members").get<std::vector<int>>();
    s.hosts = d.at("hosts").get<std::vector<int>>();
    s.step = d.at("step").get<int64_t>();
    s.resume_from = d.at("resume_from").get<std::string>();
    TESSEL_CHECK(int(s.members.size()) == s.plan.world() && s.hosts.size() == s.members.size(),
                 CorruptDataError,
                 "{} is not a valid start record: {} members and {} hosts for {} ranks", what,
                 s.members.size(), s.hosts.size(), s.plan.world());
    return s;
  });
}

nlohmann::json JobEnd::to_json() const {
  return {{"exit_code", exit_code}, {"reason", reason}};
}

JobEnd JobEnd::from_json(const nlohmann::json& d, const std::string& what) {
  return parse_record(what, "job end", [&] {
    return JobEnd{d.at("exit_code").get<int>(), d.at("reason").get<std::string>()};
  });
}

void check_key_segment(const std::string& name, const std::string& what) {
  bool ok = !name.empty() && name.size() <= 64 && name != "." && name != "..";
  for (char c : name)
    ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.');
  TESSEL_CHECK(ok, ConfigError,
               "{} '{}' is not a valid name: use 1-64 letters, digits, '-', '_' or '.'", what,
               name);
}

std::string cluster_prefix(const std::string& cluster) {
  return "/tessel/clusters/" + cluster + "/";
}
std::string next_host_key(const std::string& cluster) {
  return cluster_prefix(cluster) + "next-host";
}
std::string hosts_prefix(const std::string& cluster) {
  return cluster_prefix(cluster) + "hosts/";
}
std::string host_key(const std::string& cluster, int host) {
  return fmt::format("{}{:08d}", hosts_prefix(cluster), host);
}
std::string submission_key(const std::string& cluster) {
  return cluster_prefix(cluster) + "job";
}
std::string coordinator_key(const std::string& job) {
  return job_prefix(job) + "coordinator";
}
std::string placement_prefix(const std::string& job) {
  return job_prefix(job) + "placement/";
}
std::string placement_key(const std::string& job, int process) {
  return fmt::format("{}{:08d}", placement_prefix(job), process);
}
std::string fence_prefix(const std::string& job) {
  return job_prefix(job) + "fence/";
}
std::string fence_key(const std::string& job, int process) {
  return fmt::format("{}{:08d}", fence_prefix(job), process);
}
std::string exits_prefix(const std::string& job) {
  return job_prefix(job) + "reports/exits/";
}
std::string exit_key(const std::string& job, int process) {
  return fmt::format("{}{:08d}", exits_prefix(job), process);
}
std::string start_key(const std::string& job) {
  return job_prefix(job) + "decisions/start";
}
std::string done_key(const std::string& job) {
  return job_prefix(job) + "decisions/done";
}
std::string stop_request_key(const std::string& job) {
  return job_prefix(job) + "requests/stop";
}

std::vector<HostRecord> list_hosts(comm::ControlStore& store, const std::string& cluster) {
  std::vector<HostRecord> out;
  for (const auto& kv : store.list(hosts_prefix(cluster))) {
    try {
      out.push_back(HostRecord::from_json(nlohmann::json::parse(kv.value), kv.key));
    } catch (const std::exception& e) {
      spdlog::warn("ignoring {}: {}", kv.key, e.what());
    }
  }
  return out;
}

int take_host_id(comm::ControlStore& store, const std::string& cluster) {
  const int64_t id = store.add(next_host_key(cluster), 1) - 1;
  TESSEL_CHECK(id >= 0 && id < (int64_t(1) << 30), CorruptDataError,
               "{} holds {}, not a host counter; remove it (etcdctl del {})",
               next_host_key(cluster), id + 1, next_host_key(cluster));
  return int(id);
}

std::string read_cluster_secret(const std::string& token_file, const std::string& who) {
  TESSEL_CHECK(!token_file.empty(), ConfigError,
               "{} needs the cluster's token file: pass --token-file FILE or set {} (the same "
               "secret on every host and for the submitter; make one with `openssl rand -hex 32 "
               "> FILE && chmod 600 FILE` and copy it to each host)",
               who, kClusterTokenEnv);
  return net::read_token_file(token_file, "the cluster's token file");
}

std::shared_ptr<comm::ControlStore> open_cluster_store(const std::string& endpoint,
                                                       std::chrono::milliseconds timeout,
                                                       const std::string& secret,
                                                       const std::string& cluster) {
  return std::make_shared<comm::SignedStore>(std::make_shared<comm::EtcdStore>(endpoint, timeout),
                                             secret, fmt::format("cluster '{}'", cluster));
}

std::shared_ptr<comm::ControlStore> open_cluster_store(const std::string& endpoint,
                                                       const std::string& secret,
                                                       const std::string& cluster) {
  return std::make_shared<comm::SignedStore>(std::make_shared<comm::EtcdStore>(endpoint), secret,
                                             fmt::format("cluster '{}'", cluster));
}

std::string members_key(const std::string& cluster) {
  return cluster_prefix(cluster) + "members";
}

void check_cluster_secret(comm::ControlStore& store, const std::string& cluster, bool create) {
  const std::string key = members_key(cluster);
  if (create) store.compare_and_set(key, 0, fmt::format("tessel cluster '{}'", cluster));
  try {
    store.get(key);
  } catch (const MembershipError&) {
    TESSEL_THROW(MembershipError,
                 "cluster '{}' is signed with another secret: this process's token file is not "
                 "the one its agents hold (give every agent and `tessel train --cluster` the same "
                 "--token-file)",
                 cluster);
  }
}

}  // namespace tessel::elastic
