// A small real checkpoint for the checkpoint targets: written once per process by the store's own
// writer (two rank files, a tensor whole and one split in two pieces, checksum chunks of 16
// bytes), so a fuzzed index or manifest meets rank files that are valid.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "tessel/store/checkpoint_format.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/store/checksum.h"

namespace tessel::fuzz {

struct CheckpointFixture {
  std::string dir;
  nlohmann::json manifest;  // as written
  std::string index_text;   // as written

  static const CheckpointFixture& get() {
    static const CheckpointFixture f;
    return f;
  }

  // Rewrites manifest.json for an index of `index_text` (size and xxh3 as the writer records
  // them) and writes the index, so the reader gets past those checks to the index itself.
  void write_index(std::string_view index_text_in) const {
    const ScratchDir& scratch = ScratchDir::get();
    scratch.write("checkpoint/index.json", index_text_in);
    nlohmann::json m = manifest;
    m["index"]["bytes"] = index_text_in.size();
    m["index"]["xxh3"] =
        store::checksum_hex(store::xxh3(index_text_in.data(), index_text_in.size()));
    write_manifest(std::move(m));
  }

  // Writes `m` as manifest.json with its own checksum made right.
  void write_manifest(nlohmann::json m) const {
    m["checksum"] = store::checksum_hex(store::detail::manifest_checksum(m));
    ScratchDir::get().write("checkpoint/manifest.json", m.dump());
  }

  // Opens the checkpoint and reads everything in it, verifying every chunk.
  static void read_all(const std::string& dir) {
    store::CheckpointReader r(dir);
    r.verify();
    for (const auto& t : r.tensors()) {
      // Tensors of the fixture's files hold a few bytes; a fuzzed shape may claim more.
      if (t.nbytes() > (1u << 20)) continue;
      r.read(t.name);
      if (t.shape.rank() == 0 || t.shape[0] == 0) continue;
      std::vector<int64_t> lo(t.shape.rank(), 0), hi = t.shape.dims();
      lo[0] = t.shape[0] / 2;
      r.read(t.name, Box(lo, hi));
    }
  }

 private:
  CheckpointFixture() {
    const ScratchDir& scratch = ScratchDir::get();
    dir = scratch.path() + "/checkpoint";
    std::vector<float> w(12);
    std::iota(w.begin(), w.end(), 0.5f);
    std::vector<uint16_t> b = {1, 2, 3, 4, 5, 6};
    store::CheckpointWriterOptions opt;
    opt.save_id = "fuzz";
    opt.chunk_bytes = 16;
    store::CheckpointWriter r0(dir, 0, opt), r1(dir, 1, opt);
    r0.add("w", DType::f32, Shape{4, 3}, Box({0, 0}, {4, 3}), w.data());
    r0.add("b", DType::bf16, Shape{6}, Box({0}, {4}), b.data());
    r1.add("b", DType::bf16, Shape{6}, Box({4}, {6}), b.data() + 4);
    r0.write_rank_file();
    r1.write_rank_file();
    r0.commit(2, {{"step", 7}});
    std::ifstream m(dir + "/manifest.json"), i(dir + "/index.json");
    manifest = nlohmann::json::parse(m);
    index_text.assign(std::istreambuf_iterator<char>(i), {});
    // The valid seeds of the checkpoint targets are these files (fuzz/make_seeds.py varies them).
    if (const char* out = std::getenv("TESSEL_FUZZ_DUMP_FIXTURE")) {
      std::ofstream(std::string(out) + "/valid-index.json") << index_text;
      std::ofstream(std::string(out) + "/valid-manifest.json") << manifest.dump(2) << "\n";
    }
  }
};

}  // namespace tessel::fuzz
