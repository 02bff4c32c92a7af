#include "tessel/elastic/reconfiguration.h"

#include <fmt/format.h>

#include "tessel/core/check.h"

namespace tessel::elastic {

nlohmann::json Reconfiguration::to_json() const {
  return {{"generation", generation},
          {"from", layout::to_json(from)},
          {"to", layout::to_json(to)},
          {"from_members", from_members},
          {"to_members", to_members},
          {"from_hosts", from_hosts},
          {"to_hosts", to_hosts},
          {"spawn", spawn},
          {"next_process_id", next_process_id},
          {"cause", cause},
          {"request", request},
          {"applied_request", applied_request},
          {"failures", failures},
          {"at_step", at_step},
          {"timeline", timeline},
          {"decided_at", decided_at},
          {"recovery", recovery},
          {"checkpoint", checkpoint},
          {"step", step},
          {"cursor", cursor},
          {"record", record}};
}

Reconfiguration Reconfiguration::from_json(const nlohmann::json& d, const std::string& what) {
  try {
    Reconfiguration m;
    m.generation = d.at("generation").get<int>();
    m.from = layout::plan_from_json(d.at("from"));
    m.to = layout::plan_from_json(d.at("to"));
    m.from_members = d.at("from_members").get<std::vector<int>>();
    m.to_members = d.at("to_members").get<std::vector<int>>();
    // Absent in records of a job on one host.
    m.from_hosts = d.value("from_hosts", std::vector<int>{});
    m.to_hosts = d.value("to_hosts", std::vector<int>{});
    m.spawn = d.at("spawn").get<std::vector<int>>();
    m.next_process_id = d.at("next_process_id").get<int>();
    m.cause = d.at("cause").get<std::string>();
    m.request = d.at("request").get<int64_t>();
    m.applied_request = d.at("applied_request").get<int64_t>();
    m.failures = d.at("failures").get<int64_t>();
    m.at_step = d.at("at_step").get<int64_t>();
    m.timeline = d.at("timeline").get<bool>();
    m.decided_at = d.at("decided_at").get<double>();
    m.recovery = d.at("recovery").get<bool>();
    m.checkpoint = d.at("checkpoint").get<std::string>();
    m.step = d.at("step").get<int64_t>();
    m.cursor = d.at("cursor").get<int64_t>();
    m.record = d.at("record");
    TESSEL_CHECK((m.from_hosts.empty() || m.from_hosts.size() == m.from_members.size()) &&
                     (m.to_hosts.empty() || m.to_hosts.size() == m.to_members.size()),
                 CorruptDataError,
                 "{} is not a valid switch description: {} hosts for {} old ranks, {} for {} new "
                 "ones",
                 what, m.from_hosts.size(), m.from_members.size(), m.to_hosts.size(),
                 m.to_members.size());
    return m;
  } catch (const nlohmann::json::exception& e) {
    TESSEL_THROW(CorruptDataError, "{} is not a valid switch description: {}", what, e.what());
  }
}

nlohmann::json FailureReport::to_json() const {
  return {{"process", process},
          {"valid", valid},
          {"generation", generation},
          {"plan", layout::to_json(plan)},
          {"members", members},
          {"rank", rank},
          {"step", step},
          {"cursor", cursor},
          {"applied_request", applied_request},
          {"error", error},
          {"kind", kind}};
}

FailureReport FailureReport::from_json(const nlohmann::json& d, const std::string& what) {
  try {
    FailureReport r;
    r.process = d.at("process").get<int>();
    r.valid = d.at("valid").get<bool>();
    r.generation = d.at("generation").get<int>();
    r.plan = layout::plan_from_json(d.at("plan"));
    r.members = d.at("members").get<std::vector<int>>();
    r.rank = d.at("rank").get<int>();
    r.step = d.at("step").get<int64_t>();
    r.cursor = d.at("cursor").get<int64_t>();
    r.applied_request = d.at("applied_request").get<int64_t>();
    r.error = d.at("error").get<std::string>();
    r.kind = d.value("kind", std::string());
    return r;
  } catch (const nlohmann::json::exception& e) {
    TESSEL_THROW(CorruptDataError, "{} is not a valid failure report: {}", what, e.what());
  }
}

nlohmann::json Progress::to_json() const {
  return {{"generation", generation}, {"step", step}, {"entering", entering}};
}

Progress Progress::from_json(const nlohmann::json& d, const std::string& what) {
  try {
    return Progress{d.at("generation").get<int>(), d.at("step").get<int64_t>(),
                    d.at("entering").get<int>()};
  } catch (const nlohmann::json::exception& e) {
    TESSEL_THROW(CorruptDataError, "{} is not a valid progress report: {}", what, e.what());
  }
}

std::vector<int> first_members(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[size_t(i)] = i;
  return v;
}

std::chrono::milliseconds recovery_deadline(double comm_timeout_s) {
  return std::chrono::milliseconds(int64_t(comm_timeout_s * 2000) + 30000);
}

std::string job_prefix(const std::string& job) {
  return "/tessel/" + job + "/";
}

std::string generation_key(const std::string& job) {
  return job_prefix(job) + "decisions/generation";
}

std::string records_prefix(const std::string& job) {
  return job_prefix(job) + "decisions/records/";
}

std::string record_key(const std::string& job, int g) {
  // Zero-padded: list() returns records in generation order.
  return fmt::format("{}{:08d}", records_prefix(job), g);
}

std::string failure_key(const std::string& job) {
  return job_prefix(job) + "decisions/failure";
}

std::string progress_key(const std::string& job) {
  return job_prefix(job) + "reports/progress";
}

std::string reports_prefix(const std::string& job, int64_t failure) {
  return fmt::format("{}reports/failures/{:06d}/", job_prefix(job), failure);
}

std::string report_key(const std::string& job, int64_t failure, int process) {
  return fmt::format("{}{}", reports_prefix(job, failure), process);
}

std::string alive_prefix(const std::string& job) {
  return job_prefix(job) + "reports/alive/";
}

std::string alive_key(const std::string& job, int process) {
  return alive_prefix(job) + std::to_string(process);
}

std::string leaving_prefix(const std::string& job) {
  return job_prefix(job) + "reports/leaving/";
}

std::string leaving_key(const std::string& job, int process) {
  return leaving_prefix(job) + std::to_string(process);
}

namespace {

std::string prepared_root(const std::string& job) {
  return job_prefix(job) + "reports/prepared/";
}

}  // namespace

std::string prepared_prefix(const std::string& job, int generation) {
  return prepared_root(job) + std::to_string(generation) + "/";
}

std::string prepared_key(const std::string& job, int generation, int process) {
  return prepared_prefix(job, generation) + std::to_string(process);
}

std::string stop_key(const std::string& job) {
  return job_prefix(job) + "decisions/stop";
}

int key_number(const std::string& prefix, const std::string& key) {
  if (key.size() <= prefix.size() || key.size() > prefix.size() + 9 ||
      key.compare(0, prefix.size(), prefix) != 0)
    return -1;
  int n = 0;
  for (size_t i = prefix.size(); i < key.size(); ++i) {
    if (key[i] < '0' || key[i] > '9') return -1;
    n = n * 10 + (key[i] - '0');
  }
  return n;
}

int record_generation(const std::string& job, const std::string& key) {
  // Always 8 digits (record_key).
  const std::string prefix = records_prefix(job);
  return key.size() == prefix.size() + 8 ? key_number(prefix, key) : -1;
}

std::optional<std::pair<int, int>> prepared_report(const std::string& job, const std::string& key) {
  const std::string root = prepared_root(job);
  if (key.compare(0, root.size(), root) != 0) return std::nullopt;
  // reports/prepared/<g>/<process>
  const auto slash = key.find('/', root.size());
  const int g = slash == std::string::npos ? -1 : key_number(root, key.substr(0, slash));
  const int process = g < 0 ? -1 : key_number(prepared_prefix(job, g), key);
  if (process < 0) return std::pair{-1, -1};
  return std::pair{g, process};
}

}  // namespace tessel::elastic
