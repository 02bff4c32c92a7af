// The planning service (plan_service.h) over real HTTP on 127.0.0.1: a model in, the plan out;
// every kind of bad request one clear 4xx.
#include "tessel/planner/plan_service.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "tessel/core/error.h"

namespace tessel::planner {
namespace {

std::string gpt_block() {
  std::ifstream in(std::string(TESSEL_SOURCE_DIR) + "/src/tessel/planner/testdata/gpt_block.onnx",
                   std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class PlanServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PlanServiceOptions o;
    o.server.port = 0;
    o.max_model_bytes = 256 << 10;
    service_ = std::make_unique<PlanService>(o);
    port_ = service_->start();
  }
  httplib::Result post(const std::string& query, const std::string& body) {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60, 0);
    return c.Post(("/v1/plan" + query).c_str(), body, "application/octet-stream");
  }
  std::unique_ptr<PlanService> service_;
  int port_ = 0;
};

TEST_F(PlanServiceTest, PlansAPostedModel) {
  const auto model = gpt_block();
  ASSERT_GT(model.size(), 1000u);
  auto res =
      post("?tp=2&stages=2&balance=0.5&dim=batch:8&dp=2&micro_batches=4&schedule=zb-h1", model);
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  ASSERT_EQ(res->status, 200) << res->body;
  const auto doc = nlohmann::json::parse(res->body);
  EXPECT_EQ(doc["tp"], 2);
  EXPECT_EQ(doc["status"], "optimal");
  EXPECT_EQ(doc["operators"].size(), 33u);
  EXPECT_EQ(doc["cut"]["status"], "optimal");
  EXPECT_EQ(doc["cluster"], "dgx-a100");
  // The simulated step of the layout asked for.
  EXPECT_EQ(doc["schedule"], "zb-h1");
  EXPECT_GT(doc["step"]["step_s"].get<double>(), doc["step"]["pipeline_s"].get<double>());
  EXPECT_GT(doc["step"]["dp_s"].get<double>(), 0);
  EXPECT_EQ(doc["step"]["stages"].size(), 2u);

  // On a 2 x 2 mesh: a strategy per axis for every operator.
  res = post("?tp=2&outer=2&dim=batch:8&micro_batches=4", model);
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  ASSERT_EQ(res->status, 200) << res->body;
  const auto meshed = nlohmann::json::parse(res->body);
  EXPECT_EQ(meshed["mesh"], nlohmann::json::array({2, 2}));
  EXPECT_EQ(meshed["status"], "optimal");
  for (const auto& op : meshed["operators"])
    if (op["kind"] != "input") {
      EXPECT_NE(op["strategy"].get<std::string>().find(" x "), std::string::npos) << op.dump();
    }

  httplib::Client c("127.0.0.1", port_);
  auto health = c.Get("/v1/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

TEST_F(PlanServiceTest, BadRequestsAreOneClear4xx) {
  const auto model = gpt_block();
  auto error_of = [&](const std::string& query, const std::string& body, int want) {
    auto res = post(query, body);
    if (!res) return std::string("no response: ") + httplib::to_string(res.error());
    EXPECT_EQ(res->status, want) << query << ": " << res->body;
    const auto doc = nlohmann::json::parse(res->body, nullptr, false);
    return doc.is_object() && doc.contains("error") ? doc["error"].get<std::string>()
                                                    : "no error field: " + res->body;
  };
  EXPECT_NE(error_of("?tp=2", "not an onnx model at all", 400).find("not an ONNX model"),
            std::string::npos);
  EXPECT_NE(error_of("?tp=2", model.substr(0, model.size() / 2), 400).find("posted model"),
            std::string::npos);
  EXPECT_NE(error_of("?tp=2", model, 400).find("dim=batch:VALUE"), std::string::npos);
  EXPECT_NE(error_of("?tp=2&dim=batch", model, 400).find("NAME:VALUE"), std::string::npos);
  EXPECT_NE(error_of("?tp=two&dim=batch:8", model, 400).find("tp=two"), std::string::npos);
  EXPECT_NE(error_of("?tp=16&dim=batch:8", model, 400).find("tp 16"), std::string::npos);
  EXPECT_NE(error_of("?cluster=/etc/passwd&dim=batch:8", model, 400).find("dgx-a100"),
            std::string::npos);
  EXPECT_NE(error_of("?dim=batch:8", "", 400).find("no model"), std::string::npos);
  EXPECT_NE(error_of("?dim=batch:8&schedule=nope", model, 400).find("nope"), std::string::npos);
  EXPECT_NE(error_of("?dim=batch:8&dp=0", model, 400).find("dp=0"), std::string::npos);
  // Over max_model_bytes (and the envelope's 64 KiB): refused before it is read whole.
  auto big = post("?dim=batch:8", std::string(400 << 10, 'x'));
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
}

TEST(PlanServiceOptionsTest, AnotherAddressNeedsAToken) {
  PlanServiceOptions o;
  o.server.host = "0.0.0.0";
  EXPECT_THROW(PlanService{o}, ConfigError);
}

}  // namespace
}  // namespace tessel::planner
