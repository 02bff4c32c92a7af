#include "tessel/elastic/switch_marker.h"

#include <fmt/format.h>

#include "tessel/core/check.h"

namespace tessel::elastic {

nlohmann::json SwitchMarker::to_json() const {
  return {{"generation", generation},
          {"from", layout::to_json(from)},
          {"to", layout::to_json(to)},
          {"from_members", from_members},
          {"to_members", to_members},
          {"spawn", spawn},
          {"next_process_id", next_process_id},
          {"cause", cause},
          {"request", request},
          {"applied_request", applied_request},
          {"failures", failures},
          {"recovery", recovery},
          {"checkpoint", checkpoint},
          {"step", step},
          {"cursor", cursor},
          {"record", record}};
}

SwitchMarker SwitchMarker::from_json(const nlohmann::json& d, const std::string& what) {
  try {
    SwitchMarker m;
    m.generation = d.at("generation").get<int>();
    m.from = layout::plan_from_json(d.at("from"));
    m.to = layout::plan_from_json(d.at("to"));
    m.from_members = d.at("from_members").get<std::vector<int>>();
    m.to_members = d.at("to_members").get<std::vector<int>>();
    m.spawn = d.at("spawn").get<std::vector<int>>();
    m.next_process_id = d.at("next_process_id").get<int>();
    m.cause = d.at("cause").get<std::string>();
    m.request = d.at("request").get<int64_t>();
    m.applied_request = d.at("applied_request").get<int64_t>();
    m.failures = d.at("failures").get<int64_t>();
    m.recovery = d.at("recovery").get<bool>();
    m.checkpoint = d.at("checkpoint").get<std::string>();
    m.step = d.at("step").get<int64_t>();
    m.cursor = d.at("cursor").get<int64_t>();
    m.record = d.at("record");
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
          {"error", error}};
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
    return r;
  } catch (const nlohmann::json::exception& e) {
    TESSEL_THROW(CorruptDataError, "{} is not a valid failure report: {}", what, e.what());
  }
}

std::string scale_request_path(const std::string& store_dir, const std::string& job, int64_t r) {
  return fmt::format("{}/{}.request-{}.json", store_dir, job, r);
}

std::chrono::milliseconds recovery_deadline(double comm_timeout_s) {
  return std::chrono::milliseconds(int64_t(comm_timeout_s * 2000) + 30000);
}

std::string switch_marker_path(const std::string& store_dir, const std::string& job, int g) {
  return fmt::format("{}/{}.switch-{}.json", store_dir, job, g);
}

std::string prepare_marker_path(const std::string& store_dir, const std::string& job, int g) {
  return fmt::format("{}/{}.prepare-{}.json", store_dir, job, g);
}

std::string failure_report_path(const std::string& store_dir, const std::string& job,
                                int64_t failure, int process) {
  return fmt::format("{}/{}.report-{}-{}.json", store_dir, job, failure, process);
}

std::string recovery_path(const std::string& store_dir, const std::string& job, int64_t failure) {
  return fmt::format("{}/{}.recovery-{}.json", store_dir, job, failure);
}

}  // namespace tessel::elastic
