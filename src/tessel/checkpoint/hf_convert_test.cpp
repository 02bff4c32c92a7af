#include "tessel/checkpoint/hf_convert.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>

#include "tessel/checkpoint/model_weights.h"
#include "tessel/config/config_test_util.h"
#include "tessel/config/hf_model_config.h"
#include "tessel/config/model_json.h"
#include "tessel/core/error.h"
#include "tessel/layout/training_state.h"
#include "tessel/model/init.h"
#include "tessel/model/model_spec.h"
#include "tessel/runtime/reference_trainer.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/store/safetensors.h"
#include "tessel/testing/testing.h"

namespace tessel::checkpoint {

using config::TrainConfig;
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using model::ModelConfig;
using tessel::testing::TempDir;
using ::testing::HasSubstr;

using tessel::testing::error_of;

// A freshly initialised model saved as a tessel checkpoint of the parameter convention, each
// tensor split by rows over two rank files (export must reassemble pieces), with Adam state.
// Returns the parameters by name.
std::map<std::string, std::vector<float>> write_tessel_checkpoint(const fs::path& dir,
                                                                  const ModelConfig& cfg,
                                                                  uint64_t seed) {
  const auto spec = model::ModelSpec::from(cfg);
  std::map<std::string, std::vector<float>> params, moments;
  store::CheckpointWriterOptions opt;
  opt.save_id = "test";
  store::CheckpointWriter w0(dir.string(), 0, opt), w1(dir.string(), 1, opt);
  for (const auto& p : spec) {
    auto& v = params[p.name];
    v.resize(size_t(p.numel()));
    model::init_full(p, seed, v.data());
    const int64_t rows = p.shape[0], half = rows / 2, row_size = p.numel() / rows;
    std::vector<int64_t> lo(p.shape.rank(), 0), mid = p.shape.dims(), hi = p.shape.dims();
    mid[0] = half;
    std::vector<int64_t> lo1 = lo;
    lo1[0] = half;
    w0.add(p.name, DType::f32, p.shape, Box(lo, mid), v.data());
    w1.add(p.name, DType::f32, p.shape, Box(lo1, hi), v.data() + half * row_size);
    auto& m = moments[p.name];
    m.assign(size_t(p.numel()), 0.25f);
    w0.add(layout::state_name(p.name, layout::StateKind::adam_m), DType::f32, p.shape,
           Box::of(p.shape), m.data());
  }
  w0.write_rank_file();
  w1.write_rank_file();
  w0.commit(2, {{"model", config::to_json(cfg)}, {"step", 7}});
  return params;
}

// Every tensor of a safetensors file: dtype, shape and bytes.
struct RawTensor {
  DType dtype;
  Shape shape;
  std::vector<char> bytes;
};
std::map<std::string, RawTensor> read_safetensors(const fs::path& path) {
  auto r = store::SafetensorsReader::open(path.string());
  std::map<std::string, RawTensor> out;
  for (const auto& e : r.tensors()) {
    RawTensor t{e.dtype, e.shape, std::vector<char>(e.nbytes)};
    r.read(e.name, t.bytes.data());
    out.emplace(e.name, std::move(t));
  }
  return out;
}

void write_safetensors(const fs::path& path, const std::map<std::string, RawTensor>& tensors) {
  std::vector<store::SafetensorsTensor> list;
  for (const auto& [name, t] : tensors) list.push_back({name, t.dtype, t.shape, t.bytes.data()});
  store::write_safetensors(path.string(), list, {{"format", "pt"}});
}

json read_json(const fs::path& path) {
  std::ifstream in(path);
  return json::parse(in);
}
void write_json(const fs::path& path, const json& j) {
  std::ofstream(path) << j.dump(2);
}

std::vector<float> read_param(const fs::path& ckpt, const std::string& name) {
  store::CheckpointReader r(ckpt.string());
  Tensor t = r.read(name);
  EXPECT_EQ(t.dtype(), DType::f32) << name;
  auto s = t.span<float>();
  return {s.begin(), s.end()};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

ModelConfig tiny(const std::string& preset, bool tied) {
  ModelConfig c = ModelConfig::preset(preset);
  c.n_layer = 2;
  c.tie_embeddings = tied;
  return c;
}

// ---- round trips ----------------------------------------------------------------------------

struct RoundTripCase {
  std::string preset;
  bool tied;
};

void PrintTo(const RoundTripCase& c, std::ostream* os) {
  *os << c.preset << (c.tied ? " tied" : " untied");
}

class HfRoundTrip : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(HfRoundTrip, TesselToHfToTesselIsBitExactAndHfHasTransformersLayout) {
  const auto [preset, tied] = GetParam();
  const ModelConfig cfg = tiny(preset, tied);
  const bool gpt2 = cfg.family == model::Family::gpt2;
  TempDir tmp;
  const auto params = write_tessel_checkpoint(tmp / "ckpt", cfg, 42);

  const auto exported = export_hf((tmp / "ckpt").string(), (tmp / "hf").string());
  EXPECT_EQ(exported.tensors, params.size());
  EXPECT_EQ(exported.skipped, params.size());  // one adam_m per parameter
  EXPECT_EQ(exported.architecture, gpt2 ? "GPT2LMHeadModel" : "LlamaForCausalLM");

  // model.safetensors: transformers' names and layouts, the real vocabulary only.
  const auto hf = read_safetensors(tmp / "hf" / "model.safetensors");
  EXPECT_EQ(store::SafetensorsReader::open((tmp / "hf" / "model.safetensors").string())
                .metadata()
                .at("format"),
            "pt");
  EXPECT_EQ(hf.size(), params.size());
  EXPECT_EQ(hf.contains("lm_head.weight"), !tied);
  const int64_t C = cfg.n_embd, V = cfg.vocab_size;
  const std::string wte = gpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight";
  EXPECT_EQ(hf.at(wte).shape, (Shape{V, C}));
  if (gpt2) {
    EXPECT_EQ(hf.at("transformer.h.1.attn.c_attn.weight").shape, (Shape{C, 3 * C}));
    EXPECT_EQ(hf.at("transformer.h.1.mlp.c_fc.weight").shape, (Shape{C, cfg.ffn_hidden}));
    EXPECT_EQ(hf.at("transformer.h.1.mlp.c_proj.weight").shape, (Shape{cfg.ffn_hidden, C}));
    // Conv1D: HF [in, out][i][o] is tessel's [out, in][o][i].
    const auto& t = params.at("transformer.h.1.mlp.c_fc.weight");
    const auto* h =
        reinterpret_cast<const float*>(hf.at("transformer.h.1.mlp.c_fc.weight").bytes.data());
    for (int64_t o = 0; o < cfg.ffn_hidden; o += 7)
      for (int64_t i = 0; i < C; i += 3) ASSERT_EQ(h[i * cfg.ffn_hidden + o], t[size_t(o * C + i)]);
  } else {
    const int64_t kv = int64_t(cfg.n_kv_head) * cfg.head_dim();
    EXPECT_EQ(hf.at("model.layers.1.self_attn.k_proj.weight").shape, (Shape{kv, C}));
    EXPECT_EQ(hf.at("model.layers.1.mlp.gate_proj.weight").shape, (Shape{cfg.ffn_hidden, C}));
  }
  for (const auto& [name, t] : hf) EXPECT_EQ(t.dtype, DType::f32) << name;

  const json config = read_json(tmp / "hf" / "config.json");
  EXPECT_EQ(config.at("architectures"), json::array({exported.architecture}));
  EXPECT_EQ(config.at("vocab_size"), V);
  EXPECT_EQ(config.at("tie_word_embeddings"), tied);
  EXPECT_EQ(config.at("torch_dtype"), "float32");
  EXPECT_EQ(config.at(gpt2 ? "n_embd" : "hidden_size"), C);

  const auto imported = import_hf((tmp / "hf").string(), (tmp / "back").string());
  EXPECT_EQ(imported.tensors, params.size());
  EXPECT_EQ(imported.source_dtypes, "f32");
  auto a = config::to_json(cfg), b = config::to_json(imported.model);
  a.erase("name");
  b.erase("name");
  EXPECT_EQ(a, b);
  store::CheckpointReader back((tmp / "back").string());
  EXPECT_EQ(back.tensors().size(), params.size());
  EXPECT_EQ(back.meta().at("step"), 0);
  EXPECT_EQ(back.meta().at("source").at("format"), "huggingface");
  for (const auto& [name, values] : params)
    EXPECT_TRUE(same_bits(read_param(tmp / "back", name), values)) << name;
}

INSTANTIATE_TEST_SUITE_P(
    Models, HfRoundTrip,
    ::testing::Values(RoundTripCase{"gpt2-tiny", true}, RoundTripCase{"gpt2-tiny", false},
                      RoundTripCase{"llama-tiny", false}, RoundTripCase{"llama-tiny", true}),
    [](const auto& info) {
      std::string n = info.param.preset + (info.param.tied ? "_tied" : "_untied");
      for (auto& ch : n)
        if (ch == '-') ch = '_';
      return n;
    });

// ---- a hand-built Hugging Face GPT-2 --------------------------------------------------------

// GPT-2 with C = 4, 2 heads, F = 8, vocab 5 (padded to 128), 3 positions, one layer.
json small_gpt2_config() {
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"n_layer", 1},
          {"n_embd", 4},
          {"n_head", 2},
          {"n_inner", 8},
          {"n_positions", 3},
          {"vocab_size", 5},
          {"layer_norm_epsilon", 1e-5},
          {"activation_function", "gelu_new"},
          {"bos_token_id", 4},
          {"eos_token_id", 4}};
}

RawTensor f32_tensor(const Shape& shape, float base) {
  RawTensor t{DType::f32, shape, std::vector<char>(size_t(shape.numel()) * 4)};
  auto* f = reinterpret_cast<float*>(t.bytes.data());
  for (int64_t i = 0; i < shape.numel(); ++i) f[i] = base + 0.001f * float(i);
  return t;
}

// The hub's original gpt2 files: names without "transformer.", and the attention mask buffer.
std::map<std::string, RawTensor> small_gpt2_weights() {
  std::map<std::string, RawTensor> w;
  w["wte.weight"] = f32_tensor({5, 4}, 1);
  w["wpe.weight"] = f32_tensor({3, 4}, 2);
  w["h.0.ln_1.weight"] = f32_tensor({4}, 3);
  w["h.0.ln_1.bias"] = f32_tensor({4}, 4);
  w["h.0.attn.c_attn.weight"] = f32_tensor({4, 12}, 5);
  w["h.0.attn.c_attn.bias"] = f32_tensor({12}, 6);
  w["h.0.attn.c_proj.weight"] = f32_tensor({4, 4}, 7);
  w["h.0.attn.c_proj.bias"] = f32_tensor({4}, 8);
  w["h.0.ln_2.weight"] = f32_tensor({4}, 9);
  w["h.0.ln_2.bias"] = f32_tensor({4}, 10);
  w["h.0.mlp.c_fc.weight"] = f32_tensor({4, 8}, 11);
  w["h.0.mlp.c_fc.bias"] = f32_tensor({8}, 12);
  w["h.0.mlp.c_proj.weight"] = f32_tensor({8, 4}, 13);
  w["h.0.mlp.c_proj.bias"] = f32_tensor({4}, 14);
  w["ln_f.weight"] = f32_tensor({4}, 15);
  w["ln_f.bias"] = f32_tensor({4}, 16);
  w["h.0.attn.bias"] = f32_tensor({1, 1, 3, 3}, 0);
  return w;
}

void write_hf(const fs::path& dir, const json& config, const std::map<std::string, RawTensor>& w) {
  fs::create_directories(dir);
  write_json(dir / "config.json", config);
  write_safetensors(dir / "model.safetensors", w);
}

const float* floats(const RawTensor& t) {
  return reinterpret_cast<const float*>(t.bytes.data());
}

TEST(HfImport, TransposesConv1DWeightsAndPadsTheVocabulary) {
  TempDir tmp;
  const auto w = small_gpt2_weights();
  write_hf(tmp / "hf", small_gpt2_config(), w);
  const auto r = import_hf((tmp / "hf").string(), (tmp / "ckpt").string());
  EXPECT_EQ(r.ignored, 1u);  // h.0.attn.bias
  EXPECT_EQ(r.model.padded_vocab(), 128);
  EXPECT_EQ(r.model.ffn_hidden, 8);

  for (const auto& [hf_name, rows, cols] :
       {std::tuple<std::string, int, int>{"h.0.attn.c_attn.weight", 4, 12},
        {"h.0.attn.c_proj.weight", 4, 4},
        {"h.0.mlp.c_fc.weight", 4, 8},
        {"h.0.mlp.c_proj.weight", 8, 4}}) {
    const auto t = read_param(tmp / "ckpt", "transformer." + hf_name);
    ASSERT_EQ(t.size(), size_t(rows * cols));
    const float* h = floats(w.at(hf_name));
    for (int i = 0; i < rows; ++i)
      for (int o = 0; o < cols; ++o)
        EXPECT_EQ(t[size_t(o * rows + i)], h[i * cols + o])
            << hf_name << " [" << o << ", " << i << "]";
  }
  const auto wte = read_param(tmp / "ckpt", "transformer.wte.weight");
  ASSERT_EQ(wte.size(), size_t(128 * 4));
  for (size_t i = 0; i < wte.size(); ++i)
    EXPECT_EQ(wte[i], i < 20 ? floats(w.at("wte.weight"))[i] : 0.0f) << i;
  EXPECT_EQ(read_param(tmp / "ckpt", "transformer.h.0.ln_2.bias"),
            std::vector<float>(floats(w.at("h.0.ln_2.bias")), floats(w.at("h.0.ln_2.bias")) + 4));

  // And back: every tensor byte for byte, under transformers' current (prefixed) names; the
  // config keeps the source's token ids.
  export_hf((tmp / "ckpt").string(), (tmp / "out").string());
  const auto out = read_safetensors(tmp / "out" / "model.safetensors");
  EXPECT_EQ(out.size(), w.size() - 1);
  for (const auto& [name, t] : w) {
    if (name == "h.0.attn.bias") continue;
    const auto& o = out.at("transformer." + name);
    EXPECT_EQ(o.shape, t.shape) << name;
    EXPECT_EQ(o.bytes, t.bytes) << name;
  }
  const json config = read_json(tmp / "out" / "config.json");
  EXPECT_EQ(config.at("eos_token_id"), 4);
  EXPECT_EQ(config.at("n_inner"), 8);
  EXPECT_EQ(config.at("layer_norm_epsilon").dump(), "1e-05");
}

TEST(HfImport, Bf16AndF16WeightsBecomeExactF32AndExportBackToTheSameBytes) {
  for (DType dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    TempDir tmp;
    // A llama in bf16 / f16, as published checkpoints are: export a fresh one in that dtype.
    const ModelConfig cfg = tiny("llama-tiny", false);
    write_tessel_checkpoint(tmp / "ckpt", cfg, 3);
    export_hf((tmp / "ckpt").string(), (tmp / "hf").string(), {dtype});
    const auto hf = read_safetensors(tmp / "hf" / "model.safetensors");
    EXPECT_EQ(read_json(tmp / "hf" / "config.json").at("torch_dtype"),
              dtype == DType::bf16 ? "bfloat16" : "float16");

    const auto r = import_hf((tmp / "hf").string(), (tmp / "tessel").string());
    EXPECT_EQ(r.source_dtypes, dtype_name(dtype));
    const auto& q = hf.at("model.layers.0.self_attn.q_proj.weight");
    ASSERT_EQ(q.dtype, dtype);
    std::vector<float> expect(size_t(q.shape.numel()));
    convert(q.bytes.data(), dtype, expect.data(), DType::f32, expect.size());
    EXPECT_TRUE(
        same_bits(read_param(tmp / "tessel", "model.layers.0.self_attn.q_proj.weight"), expect));

    export_hf((tmp / "tessel").string(), (tmp / "again").string(), {dtype});
    const auto again = read_safetensors(tmp / "again" / "model.safetensors");
    ASSERT_EQ(again.size(), hf.size());
    for (const auto& [name, t] : hf) {
      EXPECT_EQ(again.at(name).dtype, dtype) << name;
      EXPECT_EQ(again.at(name).bytes, t.bytes) << name;
    }
  }
}

TEST(HfImport, ReadsShardedModelsThroughTheIndex) {
  TempDir tmp;
  const ModelConfig cfg = tiny("gpt2-tiny", true);
  const auto params = write_tessel_checkpoint(tmp / "ckpt", cfg, 5);
  export_hf((tmp / "ckpt").string(), (tmp / "one").string());
  const auto all = read_safetensors(tmp / "one" / "model.safetensors");
  // Two shards, alternating tensors, as save_pretrained(max_shard_size=...) would.
  std::map<std::string, RawTensor> a, b;
  json weight_map = json::object();
  int i = 0;
  for (const auto& [name, t] : all) {
    const bool first = i++ % 2 == 0;
    (first ? a : b).emplace(name, t);
    weight_map[name] =
        first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  fs::create_directories(tmp / "sharded");
  fs::copy_file(tmp / "one" / "config.json", tmp / "sharded" / "config.json");
  write_safetensors(tmp / "sharded" / "model-00001-of-00002.safetensors", a);
  write_safetensors(tmp / "sharded" / "model-00002-of-00002.safetensors", b);
  write_json(tmp / "sharded" / "model.safetensors.index.json",
             {{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}});
  import_hf((tmp / "sharded").string(), (tmp / "back").string());
  for (const auto& [name, values] : params)
    EXPECT_TRUE(same_bits(read_param(tmp / "back", name), values)) << name;

  // A shard named outside the model's directory is refused.
  weight_map["transformer.wte.weight"] = "../one/model.safetensors";
  write_json(tmp / "sharded" / "model.safetensors.index.json", {{"weight_map", weight_map}});
  EXPECT_THAT(error_of<CorruptDataError>(
                  [&] { import_hf((tmp / "sharded").string(), (tmp / "x").string()); }),
              HasSubstr("not a file in"));
}

TEST(HfImport, TiedHeadStoredBesideTheEmbeddingIsAcceptedOnlyWhenEqual) {
  TempDir tmp;
  auto w = small_gpt2_weights();
  w["lm_head.weight"] = w.at("wte.weight");
  write_hf(tmp / "hf", small_gpt2_config(), w);
  const auto r = import_hf((tmp / "hf").string(), (tmp / "ckpt").string());
  EXPECT_EQ(r.ignored, 2u);
  EXPECT_FALSE(store::CheckpointReader((tmp / "ckpt").string()).find("lm_head.weight"));

  w["lm_head.weight"] = f32_tensor({5, 4}, 99);
  write_hf(tmp / "hf", small_gpt2_config(), w);
  EXPECT_THAT(
      error_of<ConfigError>([&] { import_hf((tmp / "hf").string(), (tmp / "c2").string()); }),
      HasSubstr("tie_word_embeddings"));
  // Untied, it is the head.
  json config = small_gpt2_config();
  config["tie_word_embeddings"] = false;
  write_hf(tmp / "hf", config, w);
  import_hf((tmp / "hf").string(), (tmp / "c3").string());
  const auto head = read_param(tmp / "c3", "lm_head.weight");
  EXPECT_EQ(head[0], 99.0f);
  EXPECT_EQ(head[127 * 4], 0.0f);
}

// ---- configs ----------------------------------------------------------------------------------

TEST(HfConfig, EveryPresetSurvivesConfigJson) {
  for (const auto& name : ModelConfig::preset_names()) {
    ModelConfig c = ModelConfig::preset(name);
    for (bool tied : {true, false}) {
      c.tie_embeddings = tied;
      const json j = config::hf_config_from_model(c, DType::bf16);
      EXPECT_EQ(j.at("torch_dtype"), "bfloat16");
      auto back = config::to_json(config::model_config_from_hf(j, "x")), want = config::to_json(c);
      back.erase("name");
      want.erase("name");
      if (c.family == model::Family::gpt2) {  // rope_theta means nothing for gpt2
        back.erase("rope_theta");
        want.erase("rope_theta");
      }
      EXPECT_EQ(back, want) << name;
    }
  }
}

TEST(HfConfig, ReadsPublishedConfigs) {
  // openai-community/gpt2's config.json (n_inner absent: 4 n_embd; tie_word_embeddings absent:
  // tied).
  const json gpt2 = json::parse(R"({"activation_function": "gelu_new", "architectures": [
    "GPT2LMHeadModel"], "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1,
    "eos_token_id": 50256, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
    "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null,
    "summary_first_dropout": 0.1, "summary_proj_to_labels": true, "summary_type": "cls_index",
    "summary_use_proj": true, "vocab_size": 50257})");
  // meta-llama/Llama-2-7b-hf and Meta-Llama-3-8B.
  const json llama2 = json::parse(R"({"architectures": ["LlamaForCausalLM"], "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
    "tie_word_embeddings": false, "torch_dtype": "float16", "use_cache": true,
    "vocab_size": 32000})");
  const json llama3 = json::parse(R"({"architectures": ["LlamaForCausalLM"],
    "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": null, "rope_theta": 500000.0, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 128256})");
  for (const auto& [j, preset] : {std::pair<json, std::string>{gpt2, "gpt2-124m"},
                                  {llama2, "llama2-7b"},
                                  {llama3, "llama3-8b"}}) {
    auto got = config::to_json(config::model_config_from_hf(j, preset)),
         want = config::to_json(ModelConfig::preset(preset));
    if (preset == "gpt2-124m") {
      got.erase("rope_theta");
      want.erase("rope_theta");
    }
    EXPECT_EQ(got, want) << preset;
  }
  // Export keeps what does not describe the architecture and overwrites what does.
  ModelConfig c = config::model_config_from_hf(gpt2, "gpt2");
  c.n_layer = 2;
  const json out = config::hf_config_from_model(c, DType::f32, gpt2);
  EXPECT_EQ(out.at("n_layer"), 2);
  EXPECT_EQ(out.at("bos_token_id"), 50256);
  EXPECT_EQ(out.at("summary_type"), "cls_index");
  EXPECT_EQ(out.at("n_ctx"), 1024);
  EXPECT_EQ(out.at("torch_dtype"), "float32");
}

TEST(HfConfig, RejectsWhatTesselCannotCompute) {
  json j = small_gpt2_config();
  j["model_type"] = "mistral";
  j["architectures"] = {"MistralForCausalLM"};
  EXPECT_THAT(error_of<UnsupportedError>([&] { config::model_config_from_hf(j, "m"); }),
              HasSubstr("model_type 'mistral' (architectures [MistralForCausalLM])"));
  j = small_gpt2_config();
  j["activation_function"] = "gelu";
  EXPECT_THAT(error_of<UnsupportedError>([&] { config::model_config_from_hf(j, "m"); }),
              HasSubstr("activation_function 'gelu'"));
  j = small_gpt2_config();
  j["scale_attn_by_inverse_layer_idx"] = true;
  EXPECT_THAT(error_of<UnsupportedError>([&] { config::model_config_from_hf(j, "m"); }),
              HasSubstr("scale_attn_by_inverse_layer_idx"));
  j = small_gpt2_config();
  j.erase("n_embd");
  EXPECT_THAT(error_of<CorruptDataError>([&] { config::model_config_from_hf(j, "m"); }),
              HasSubstr("has no 'n_embd'"));
  json l = config::hf_config_from_model(ModelConfig::preset("llama-tiny"), DType::f32);
  l["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  EXPECT_THAT(error_of<UnsupportedError>([&] { config::model_config_from_hf(l, "m"); }),
              HasSubstr("rope_scaling"));
  l = config::hf_config_from_model(ModelConfig::preset("llama-tiny"), DType::f32);
  l["attention_bias"] = true;
  EXPECT_THAT(error_of<UnsupportedError>([&] { config::model_config_from_hf(l, "m"); }),
              HasSubstr("attention_bias"));
  ModelConfig nobias = ModelConfig::preset("gpt2-tiny");
  nobias.bias = false;
  EXPECT_THAT(error_of<UnsupportedError>([&] { config::hf_config_from_model(nobias, DType::f32); }),
              HasSubstr("without biases"));
  EXPECT_THAT(error_of<UnsupportedError>([&] {
                config::hf_config_from_model(ModelConfig::preset("gpt2-tiny"), DType::i32);
              }),
              HasSubstr("f32, bf16 or f16"));
}

// ---- import errors ----------------------------------------------------------------------------

class HfImportErrors : public ::testing::Test {
 protected:
  void SetUp() override { write_hf(dir(), small_gpt2_config(), small_gpt2_weights()); }
  fs::path dir() const { return tmp_ / "hf"; }
  std::string import_error_config(const json& config) {
    write_json(dir() / "config.json", config);
    return error_of<ConfigError>([&] { import_hf(dir().string(), (tmp_ / "ckpt").string()); });
  }
  std::string import_error_weights(const std::map<std::string, RawTensor>& w) {
    write_safetensors(dir() / "model.safetensors", w);
    return error_of<ConfigError>([&] { import_hf(dir().string(), (tmp_ / "ckpt").string()); });
  }
  TempDir tmp_;
};

TEST_F(HfImportErrors, MissingTensorIsNamed) {
  auto w = small_gpt2_weights();
  w.erase("h.0.mlp.c_fc.bias");
  const auto msg = import_error_weights(w);
  EXPECT_THAT(msg, HasSubstr("lacks 1 tensor(s)"));
  EXPECT_THAT(msg, HasSubstr("transformer.h.0.mlp.c_fc.bias"));
  EXPECT_FALSE(fs::exists(tmp_ / "ckpt"));
}

TEST_F(HfImportErrors, WrongShapeNamesTensorShapesAndModel) {
  auto w = small_gpt2_weights();
  w["h.0.mlp.c_fc.weight"] = f32_tensor({8, 4}, 11);  // [out, in]: not Conv1D's layout
  const auto msg = import_error_weights(w);
  EXPECT_THAT(msg, HasSubstr("tensor 'h.0.mlp.c_fc.weight' has shape [8, 4] but gpt2 model"));
  EXPECT_THAT(msg, HasSubstr("n_embd 4"));
  EXPECT_THAT(msg, HasSubstr("expects [4, 8] (Conv1D layout [in, out])"));
}

TEST_F(HfImportErrors, VocabularyMismatch) {
  json config = small_gpt2_config();
  config["vocab_size"] = 6;
  const auto msg = import_error_config(config);
  EXPECT_THAT(msg, HasSubstr("vocabulary mismatch"));
  EXPECT_THAT(msg, HasSubstr("'wte.weight' has shape [5, 4] (5 rows)"));
  EXPECT_THAT(msg, HasSubstr("vocab_size 6"));
}

TEST_F(HfImportErrors, UnexpectedAndAmbiguousTensors) {
  auto w = small_gpt2_weights();
  w["h.1.ln_1.weight"] = f32_tensor({4}, 0);
  EXPECT_THAT(import_error_weights(w), HasSubstr("not parameters of gpt2 model"));
  w = small_gpt2_weights();
  w["transformer.ln_f.bias"] = w.at("ln_f.bias");
  EXPECT_THAT(import_error_weights(w), HasSubstr("both 'transformer.ln_f.bias' and 'ln_f.bias'"));
}

TEST_F(HfImportErrors, ModelOverride) {
  ModelConfig c = config::model_config_from_hf(small_gpt2_config(), "mine");
  // The same model: config.json agrees, name from the override.
  EXPECT_EQ(import_hf(dir().string(), (tmp_ / "a").string(), {c, ""}).model.name, "mine");
  // Disagreeing: every difference listed.
  c.vocab_size = 7;
  c.norm_eps = 1e-6f;
  const auto msg = error_of<ConfigError>([&] {
    import_hf(dir().string(), (tmp_ / "b").string(), {c, ""});
  });
  EXPECT_THAT(msg, HasSubstr("vocab_size"));
  EXPECT_THAT(msg, HasSubstr("norm_eps"));
  // Without config.json the override alone describes the model; the weights must fit it.
  fs::remove(dir() / "config.json");
  EXPECT_THAT(error_of<ConfigError>([&] {
                import_hf(dir().string(), (tmp_ / "c").string(), {c, ""});
              }),
              HasSubstr("vocabulary mismatch"));
  EXPECT_THAT(error_of<IoError>([&] { import_hf(dir().string(), (tmp_ / "d").string()); }),
              HasSubstr("no config.json"));
}

TEST_F(HfImportErrors, MissingFiles) {
  fs::remove(dir() / "model.safetensors");
  EXPECT_THAT(error_of<IoError>([&] { import_hf(dir().string(), (tmp_ / "ckpt").string()); }),
              HasSubstr("no model.safetensors"));
  EXPECT_THAT(
      error_of<IoError>([&] { import_hf((tmp_ / "nowhere").string(), (tmp_ / "ckpt").string()); }),
      HasSubstr("not a directory"));
}

TEST_F(HfImportErrors, NonFloatTensor) {
  auto w = small_gpt2_weights();
  RawTensor t{DType::i32, Shape{4}, std::vector<char>(16)};
  w["ln_f.bias"] = t;
  EXPECT_THAT(import_error_weights(w), HasSubstr("'ln_f.bias' has dtype i32"));
}

// ---- a real training run ------------------------------------------------------------------------

TEST(HfExport, ExportsTheNewestCheckpointOfATrainingRun) {
  for (std::string preset : {"gpt2-tiny", "llama-tiny"}) {
    SCOPED_TRACE(preset);
    TempDir dir;
    auto corpus = config::testing::make_corpus(dir);
    auto cfg = TrainConfig::load(config::testing::write_config(
        dir, corpus,
        "training: {steps: 2, global_batch: 4, micro_batch: 2, threads: 1}\n"
        "optimizer: {lr: 0.01, warmup_steps: 1}\ncheckpoint: {dir: ck}\n",
        "cfg.yaml", preset));
    cfg.model.n_layer = 2;
    cfg.metrics_path.clear();
    runtime::ReferenceTrainer(cfg).run();
    const auto r = export_hf((dir / "ck").string(), (dir / "hf").string());
    EXPECT_EQ(fs::path(r.checkpoint).filename(), "step-00000002");
    EXPECT_EQ(r.skipped, 2 * r.tensors);  // Adam's moments
    import_hf((dir / "hf").string(), (dir / "back").string());
    // Trained parameters come back bit for bit (vocabulary padding rows included: training
    // keeps them zero).
    for (const auto& p : model::ModelSpec::from(cfg.model))
      EXPECT_TRUE(same_bits(read_param(dir / "back", p.name), read_param(r.checkpoint, p.name)))
          << p.name;
  }
}

// ---- export errors ----------------------------------------------------------------------------

TEST(HfExport, CheckpointWithoutModelOrParameter) {
  TempDir tmp;
  float x[4] = {1, 2, 3, 4};
  {
    store::CheckpointWriter w((tmp / "nomodel").string(), 0);
    w.add("transformer.ln_f.weight", Tensor::wrap(x, Shape{4}));
    w.write_rank_file();
    w.commit(1, {{"step", 1}});
  }
  EXPECT_THAT(error_of<CorruptDataError>(
                  [&] { export_hf((tmp / "nomodel").string(), (tmp / "out").string()); }),
              HasSubstr("no model description"));
  {
    store::CheckpointWriter w((tmp / "partial").string(), 0);
    w.add("transformer.ln_f.weight", Tensor::wrap(x, Shape{4}));
    w.write_rank_file();
    w.commit(1,
             {{"model", config::to_json(config::model_config_from_hf(small_gpt2_config(), "s"))}});
  }
  EXPECT_THAT(error_of<CorruptDataError>(
                  [&] { export_hf((tmp / "partial").string(), (tmp / "out").string()); }),
              HasSubstr("has no tensor 'transformer.wte.weight'"));
  EXPECT_FALSE(fs::exists(tmp / "out" / "model.safetensors"));
}

}  // namespace
}  // namespace tessel::checkpoint

namespace tessel::checkpoint {
namespace {

// A model larger than the shard limit is written as transformers shards it: files
// model-0000k-of-0000n.safetensors, each within the limit unless one tensor alone exceeds it,
// and an index whose weight_map names each tensor's file and whose total_size is the data's.
// It reads back (import, ModelWeights) bit for bit, and a later unsharded export into the same
// directory removes the shards and the index.
TEST(HfConvert, ExportShardsAModelLargerThanTheLimitAndReadsItBack) {
  for (std::string preset : {"gpt2-tiny", "llama-tiny"}) {
    SCOPED_TRACE(preset);
    TempDir dir;
    const ModelConfig cfg = ModelConfig::preset(preset);
    const auto params = write_tessel_checkpoint(dir / "ck", cfg, 5);
    HfExportOptions opt;
    opt.max_shard_bytes = 40'000;
    const auto r = export_hf((dir / "ck").string(), (dir / "hf").string(), opt);
    ASSERT_GT(r.shards, 2u);
    EXPECT_FALSE(fs::exists(dir / "hf" / "model.safetensors"));
    const json index = read_json(dir / "hf" / "model.safetensors.index.json");
    const auto& map = index.at("weight_map");
    EXPECT_EQ(map.size(), params.size());
    uint64_t total = 0;
    std::map<std::string, uint64_t> per_file;
    for (size_t k = 1; k <= r.shards; ++k) {
      const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", k, r.shards);
      auto f = store::SafetensorsReader::open((dir / "hf" / file).string());
      uint64_t data = 0;
      for (const auto& e : f.tensors()) {
        EXPECT_EQ(map.at(e.name), file) << e.name;
        data += e.nbytes;
      }
      // Over the limit only as one tensor alone.
      EXPECT_TRUE(data <= opt.max_shard_bytes || f.tensors().size() == 1) << file;
      total += data;
    }
    EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), total);
    EXPECT_GT(r.bytes, total);  // the files: data and headers

    import_hf((dir / "hf").string(), (dir / "back").string());
    const auto weights = ModelWeights::open((dir / "hf").string());
    for (const auto& [name, want] : params) {
      EXPECT_TRUE(same_bits(read_param(dir / "back", name), want)) << name;
      std::vector<float> got(want.size());
      weights->read(weights->spec().at(name), got.data());
      EXPECT_TRUE(same_bits(got, want)) << name;
    }

    // One file again: the shards and the index of the earlier export go.
    export_hf((dir / "ck").string(), (dir / "hf").string());
    EXPECT_TRUE(fs::exists(dir / "hf" / "model.safetensors"));
    EXPECT_FALSE(fs::exists(dir / "hf" / "model.safetensors.index.json"));
    for (const auto& e : fs::directory_iterator(dir / "hf"))
      EXPECT_FALSE(e.path().filename().string().starts_with("model-")) << e.path();
  }
}

}  // namespace
}  // namespace tessel::checkpoint
