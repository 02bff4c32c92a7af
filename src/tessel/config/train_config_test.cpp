#include "tessel/config/train_config.h"

#include <gtest/gtest.h>

#include <fstream>

#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"

namespace tessel::config {
namespace {

using tessel::testing::TempDir;

std::string write(const TempDir& dir, const std::string& text) {
  std::string path = (dir / "c.yaml").string();
  std::ofstream(path) << text;
  return path;
}

// Loads the config and returns the error message (empty when it loads).
template <typename E>
std::string error_of(const std::string& path) {
  try {
    TrainConfig::load(path);
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

TEST(TrainConfig, ReadsSectionsAndResolvesPathsAgainstTheConfigFile) {
  TempDir dir;
  auto cfg = TrainConfig::load(write(dir,
                                     "model: {preset: llama-tiny, n_layer: 2}\n"
                                     "data: {path: data/x.tok, seq_len: 32}\n"
                                     "training: {steps: 7, global_batch: 8, micro_batch: 4}\n"
                                     "optimizer: {lr: 0.01}\n"
                                     "checkpoint: {dir: ck, every: 3}\n"));
  EXPECT_EQ(cfg.model.n_layer, 2);
  // Host settings default to what a user expects without writing them.
  EXPECT_EQ(cfg.training.gemm, "auto");
  EXPECT_TRUE(cfg.training.huge_pages);
  EXPECT_EQ(cfg.reshard_transport, "direct");
  EXPECT_TRUE(cfg.rank_params_dir.empty());
  EXPECT_EQ(cfg.model.family, model::Family::llama);
  EXPECT_EQ(cfg.data.path, (dir.path() / "data/x.tok").string());
  EXPECT_EQ(cfg.checkpoint.dir, (dir.path() / "ck").string());
  EXPECT_EQ(cfg.micro_steps(), 2);
  EXPECT_DOUBLE_EQ(cfg.optimizer.min_lr, 0.001);  // defaults to lr / 10
  // Evaluation reads batches of the micro-batch as written, whatever the plan makes of it.
  EXPECT_EQ(cfg.training.eval_batch_size(), 4);
}

// training.precision: fp32 unless set; bf16 turns on the model's bf16 linear layers; anything
// else (fp16 is not there yet) is one message naming the key and the choices.
TEST(TrainConfig, PrecisionIsFp32OrBf16) {
  TempDir dir;
  const std::string base = "model: {preset: gpt2-tiny}\ndata: {path: x.tok}\n";
  auto cfg = TrainConfig::load(write(dir, base));
  EXPECT_EQ(cfg.training.precision, "fp32");
  EXPECT_FALSE(cfg.training.bf16());
  cfg = TrainConfig::load(write(dir, base + "training: {precision: bf16}\n"));
  EXPECT_TRUE(cfg.training.bf16());
  const auto msg = error_of<ConfigError>(write(dir, base + "training: {precision: fp16}\n"));
  EXPECT_NE(msg.find("'training.precision'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bf16"), std::string::npos) << msg;
}

// What used to be environment variables (TESSEL_GEMM for a run, TESSEL_HUGEPAGES,
// TESSEL_RESHARD_DIRECT, TESSEL_DUMP_PARAMS) is config a user can see.
TEST(TrainConfig, HostSettingsAndOutputsAreConfigKeys) {
  TempDir dir;
  auto cfg = TrainConfig::load(write(dir,
                                     "model: {preset: gpt2-tiny}\n"
                                     "data: {path: x.tok}\n"
                                     "training: {gemm: openblas, huge_pages: false}\n"
                                     "output: {rank_params: dump}\n"
                                     "elastic: {reshard_transport: network}\n"));
  EXPECT_EQ(cfg.training.gemm, "openblas");
  EXPECT_FALSE(cfg.training.huge_pages);
  EXPECT_EQ(cfg.reshard_transport, "network");
  EXPECT_EQ(cfg.rank_params_dir, (dir.path() / "dump").string());
  auto msg = error_of<ConfigError>(
      write(dir, "model: {preset: gpt2-tiny}\ndata: {path: x.tok}\ntraining: {gemm: cublas}\n"));
  EXPECT_NE(msg.find("'training.gemm'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("onednn"), std::string::npos) << msg;
  msg = error_of<ConfigError>(write(
      dir,
      "model: {preset: gpt2-tiny}\ndata: {path: x.tok}\nelastic: {reshard_transport: rdma}\n"));
  EXPECT_NE(msg.find("reshard_transport"), std::string::npos) << msg;
  EXPECT_NE(msg.find("network"), std::string::npos) << msg;
  // Streams per pair for state moved over the network: 2 unless set, 1..16.
  EXPECT_EQ(cfg.transfer_streams, 2);
  EXPECT_EQ(TrainConfig::load(write(dir,
                                    "model: {preset: gpt2-tiny}\ndata: {path: x.tok}\n"
                                    "elastic: {transfer_streams: 4}\n"))
                .transfer_streams,
            4);
  for (const char* bad : {"0", "17", "-1"}) {
    msg = error_of<ConfigError>(write(dir, std::string("model: {preset: gpt2-tiny}\ndata: {path: "
                                                       "x.tok}\nelastic: {transfer_streams: ") +
                                               bad + "}\n"));
    EXPECT_NE(msg.find("transfer_streams"), std::string::npos) << bad << ": " << msg;
  }
}

// The stall, stop and failed-save settings: read, and refused out of range with their key named.
TEST(TrainConfig, HeartbeatStopGraceAndSaveFailurePolicyAreCheckedKeys) {
  TempDir dir;
  const std::string head = "model: {preset: gpt2-tiny}\ndata: {path: x.tok}\n";
  auto cfg =
      TrainConfig::load(write(dir, head + "elastic: {heartbeat_timeout_s: 3, stop_grace_s: 0}\n"
                                          "checkpoint: {dir: ck, on_error: stop}\n"));
  EXPECT_EQ(cfg.heartbeat_timeout_s, 3);
  EXPECT_EQ(cfg.stop_grace_s, 0);
  EXPECT_EQ(cfg.checkpoint.on_error, "stop");
  EXPECT_EQ(TrainConfig::load(write(dir, head)).checkpoint.on_error, "continue");
  for (const char* bad :
       {"elastic: {heartbeat_timeout_s: 0.5}\n", "elastic: {heartbeat_timeout_s: 5000}\n",
        "elastic: {stop_grace_s: -1}\n", "checkpoint: {on_error: ignore}\n"}) {
    const auto msg = error_of<ConfigError>(write(dir, head + bad));
    const std::string key = std::string(bad).find("heartbeat") != std::string::npos
                                ? "heartbeat_timeout_s"
                            : std::string(bad).find("grace") != std::string::npos ? "stop_grace_s"
                                                                                  : "on_error";
    EXPECT_NE(msg.find(key), std::string::npos) << bad << ": " << msg;
  }
}

// output.trace: a path resolved against the config file, and 1..1000 steps (3 unless set).
TEST(TrainConfig, TraceIsAPathAndABoundedStepCount) {
  TempDir dir;
  const std::string head = "model: {preset: gpt2-tiny}\ndata: {path: x.tok}\n";
  auto cfg = TrainConfig::load(write(dir, head + "output: {trace: t.json}\n"));
  EXPECT_EQ(cfg.trace_path, (dir.path() / "t.json").string());
  EXPECT_EQ(cfg.trace_steps, 3);
  EXPECT_TRUE(TrainConfig::load(write(dir, head)).trace_path.empty());
  for (const char* bad : {"0", "1001", "-2"}) {
    const auto msg = error_of<ConfigError>(
        write(dir, head + "output: {trace: t.json, trace_steps: " + bad + "}\n"));
    EXPECT_NE(msg.find("trace_steps"), std::string::npos) << bad << ": " << msg;
  }
}

TEST(TrainConfig, MalformedYamlNamesFileAndLine) {
  TempDir dir;
  auto msg = error_of<ConfigError>(write(dir, "model: {preset: gpt2-tiny\ndata: [1, 2\n"));
  EXPECT_NE(msg.find("malformed YAML"), std::string::npos) << msg;
  EXPECT_NE(msg.find("c.yaml"), std::string::npos) << msg;
}

TEST(TrainConfig, UnknownKeyIsNamedWithItsSection) {
  TempDir dir;
  auto msg = error_of<ConfigError>(write(dir,
                                         "model: {preset: gpt2-tiny}\n"
                                         "data: {path: x.tok}\n"
                                         "training: {stepz: 10}\n"));
  EXPECT_NE(msg.find("unknown key 'training.stepz'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("steps"), std::string::npos) << msg;  // lists the allowed keys
  msg =
      error_of<ConfigError>(write(dir, "model: {preset: gpt2-tiny}\ndata: {path: x}\nextra: 1\n"));
  EXPECT_NE(msg.find("unknown key 'extra'"), std::string::npos) << msg;
}

TEST(TrainConfig, HeadsThatDoNotDivideHiddenAreRejected) {
  TempDir dir;
  auto msg = error_of<ConfigError>(
      write(dir, "model: {preset: gpt2-tiny, n_head: 5}\ndata: {path: x.tok}\n"));
  EXPECT_NE(msg.find("n_head"), std::string::npos) << msg;
}

// A model section without a preset takes its family's defaults: a llama has no biases and no
// tied head, and is MHA with Meta's MLP width unless the section says otherwise.
TEST(TrainConfig, AModelWithoutAPresetFollowsItsFamily) {
  TempDir dir;
  auto model = [&](const std::string& section) {
    return TrainConfig::load(write(dir, "model: {" + section +
                                            ", n_layer: 2, n_embd: 64, n_head: 4, vocab_size: "
                                            "300, max_seq_len: 128}\ndata: {path: x.tok}\n"))
        .model;
  };
  const auto llama = model("family: llama");
  EXPECT_FALSE(llama.bias);
  EXPECT_FALSE(llama.tie_embeddings);
  EXPECT_EQ(llama.n_kv_head, 4);
  EXPECT_EQ(llama.ffn_hidden, 256);  // 2/3 of 4 x 64 = 171, up to a multiple of 256
  EXPECT_EQ(model::ModelConfig::default_ffn_hidden(model::Family::llama, 4096), 11008);
  const auto gqa = model("family: llama, n_kv_head: 2, ffn_hidden: 96, tie_embeddings: true");
  EXPECT_EQ(gqa.n_kv_head, 2);
  EXPECT_EQ(gqa.ffn_hidden, 96);
  EXPECT_TRUE(gqa.tie_embeddings);
  const auto gpt2 = model("family: gpt2");
  EXPECT_TRUE(gpt2.bias);
  EXPECT_TRUE(gpt2.tie_embeddings);
  EXPECT_EQ(gpt2.ffn_hidden, 256);
  // Asked for explicitly, a llama's biases are still refused, by name.
  try {
    model("family: llama, bias: true");
    ADD_FAILURE() << "a llama with biases loaded";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("bias"), std::string::npos) << e.what();
  }
}

TEST(TrainConfig, MicroBatchMustDivideGlobalBatch) {
  TempDir dir;
  auto msg = error_of<ConfigError>(write(dir,
                                         "model: {preset: gpt2-tiny}\ndata: {path: "
                                         "x.tok}\ntraining: {global_batch: 10, micro_batch: 4}\n"));
  EXPECT_NE(msg.find("micro_batch"), std::string::npos) << msg;
  EXPECT_NE(msg.find("global_batch"), std::string::npos) << msg;
}

TEST(TrainConfig, WrongTypesAndRangesAreRejected) {
  TempDir dir;
  auto msg = error_of<ConfigError>(
      write(dir, "model: {preset: gpt2-tiny}\ndata: {path: x.tok}\ntraining: {steps: many}\n"));
  EXPECT_NE(msg.find("'training.steps'"), std::string::npos) << msg;
  msg = error_of<ConfigError>(
      write(dir, "model: {preset: gpt2-tiny}\ndata: {path: x.tok, seq_len: 100000}\n"));
  EXPECT_NE(msg.find("seq_len"), std::string::npos) << msg;
  msg = error_of<ConfigError>(write(dir, "model: {preset: gpt-17}\ndata: {path: x.tok}\n"));
  EXPECT_NE(msg.find("gpt-17"), std::string::npos) << msg;
  msg = error_of<ConfigError>(write(dir, "data: {path: x.tok}\n"));
  EXPECT_NE(msg.find("'model'"), std::string::npos) << msg;
  msg = error_of<ConfigError>(write(dir, "model: {preset: gpt2-tiny}\n"));
  EXPECT_NE(msg.find("data.path"), std::string::npos) << msg;
  msg = error_of<ConfigError>(write(
      dir, "model: {preset: gpt2-tiny}\ndata: {path: x.tok}\nelastic: {prepare_steps: -1}\n"));
  EXPECT_NE(msg.find("prepare_steps"), std::string::npos) << msg;
  EXPECT_NE(msg.find(">= 0"), std::string::npos) << msg;
}

// What the YAML reader used to let through: a key given twice (the first silently won), a key
// that is not a name ("internal error: bad conversion"), non-finite numbers (an infinite
// epsilon trained to nothing, a NaN clip disabled clipping), and a thread count that crashed.
TEST(TrainConfig, DuplicatesOddKeysNonFiniteNumbersAndHugeThreadCountsAreRejected) {
  TempDir dir;
  const std::string head = "model: {preset: gpt2-tiny}\ndata: {path: x.tok}\n";
  auto msg = error_of<ConfigError>(
      write(dir, head + "training: {steps: 20, global_batch: 4, steps: 3}\n"));
  EXPECT_NE(msg.find("'training.steps' is given twice"), std::string::npos) << msg;
  msg = error_of<ConfigError>(write(dir, head + "training: {steps: 20}\ntraining: {steps: 3}\n"));
  EXPECT_NE(msg.find("'training' is given twice (lines 3 and 4)"), std::string::npos) << msg;
  msg = error_of<ConfigError>(write(dir, head + "training: {[a, b]: 3}\n"));
  EXPECT_NE(msg.find("is not a name"), std::string::npos) << msg;
  msg = error_of<ConfigError>(write(dir, head + "optimizer: {eps: .inf}\n"));
  EXPECT_NE(msg.find("'optimizer.eps': '.inf' is not a finite number"), std::string::npos) << msg;
  msg = error_of<ConfigError>(write(dir, head + "training: {grad_clip: .nan}\n"));
  EXPECT_NE(msg.find("'training.grad_clip': '.nan' is not a finite number"), std::string::npos)
      << msg;
  msg = error_of<ConfigError>(write(dir, head + "training: {threads: 100000}\n"));
  EXPECT_NE(msg.find("'training.threads' is 100000"), std::string::npos) << msg;
}

TEST(TrainConfig, MissingConfigFileIsAnIoError) {
  EXPECT_THROW(TrainConfig::load("/nonexistent/tessel.yaml"), IoError);
}

}  // namespace
}  // namespace tessel::config
