// The fuzz targets as ordinary programs (the build without TESSEL_FUZZ): runs the target once on
// every file under the directories (or files) given, in a fixed order, so CTest replays the seed
// corpus and every regression input on each build and CI runs them under the sanitizers.
// Usage: fuzz_<name> DIR_OR_FILE...   Exit 0 when every input passed; a finding aborts.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const fs::path arg = argv[i];
    if (fs::is_directory(arg)) {
      for (const auto& e : fs::recursive_directory_iterator(arg))
        if (e.is_regular_file()) inputs.push_back(e.path());
    } else if (fs::is_regular_file(arg)) {
      inputs.push_back(arg);
    } else if (!fs::exists(arg)) {
      // A target without regressions yet has no such directory; an empty corpus is an error.
      std::fprintf(stderr, "note: %s does not exist\n", arg.c_str());
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr, "no inputs found; give the corpus and regression directories\n");
    return 1;
  }
  std::sort(inputs.begin(), inputs.end());
  for (const auto& p : inputs) {
    std::ifstream in(p, std::ios::binary);
    const std::string bytes(std::istreambuf_iterator<char>(in), {});
    // Named before it runs, so the input of a crash is the last line printed.
    std::fprintf(stderr, "%s\n", p.c_str());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::fprintf(stderr, "%zu inputs passed\n", inputs.size());
  return 0;
}
