#include "tessel/config/model_json.h"

#include "tessel/core/check.h"

namespace tessel::config {

nlohmann::json to_json(const model::ModelConfig& c) {
  return {{"name", c.name},
          {"family", std::string(model::family_name(c.family))},
          {"n_layer", c.n_layer},
          {"n_embd", c.n_embd},
          {"n_head", c.n_head},
          {"n_kv_head", c.n_kv_head},
          {"ffn_hidden", c.ffn_hidden},
          {"vocab_size", c.vocab_size},
          {"max_seq_len", c.max_seq_len},
          {"norm_eps", c.norm_eps},
          {"rope_theta", c.rope_theta},
          {"tie_embeddings", c.tie_embeddings},
          {"bias", c.bias}};
}

model::ModelConfig model_config_from_json(const nlohmann::json& j) {
  try {
    model::ModelConfig c;
    c.name = j.at("name").get<std::string>();
    c.family = model::parse_family(j.at("family").get<std::string>());
    c.n_layer = j.at("n_layer").get<int>();
    c.n_embd = j.at("n_embd").get<int>();
    c.n_head = j.at("n_head").get<int>();
    c.n_kv_head = j.at("n_kv_head").get<int>();
    c.ffn_hidden = j.at("ffn_hidden").get<int>();
    c.vocab_size = j.at("vocab_size").get<int>();
    c.max_seq_len = j.at("max_seq_len").get<int>();
    c.norm_eps = j.at("norm_eps").get<float>();
    c.rope_theta = j.at("rope_theta").get<float>();
    c.tie_embeddings = j.at("tie_embeddings").get<bool>();
    c.bias = j.at("bias").get<bool>();
    return c;
  } catch (const nlohmann::json::exception& e) {
    TESSEL_THROW(CorruptDataError, "model description is incomplete: {}", e.what());
  }
}

}  // namespace tessel::config
