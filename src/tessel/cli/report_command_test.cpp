// Runs `tessel report` the way a user does: on the files a run writes, on bad inputs, and with
// the page opened in headless Chromium to check that its charts render.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tessel/testing/testing.h"

namespace tessel::cli {
namespace {

using tessel::testing::run_command;
using tessel::testing::TempDir;
namespace fs = std::filesystem;

struct Result {
  int status;
  std::string output;
};

Result tessel(const std::string& args) {
  Result r;
  r.status = run_command(tessel::testing::tessel_binary().string() + " report " + args, &r.output);
  return r;
}

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool has(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

size_t count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + needle.size()))
    ++n;
  return n;
}

// What a run's output.metrics and output.events hold (the fields runtime/ writes): 60 steps of
// 2,048 tokens, the loss falling from 5.5 to about 1.5, evaluation every 20 steps; 4 workers,
// 2 from step 21 (a timeline switch at 20), 3 from step 41 (worker 3 killed at step 40).
void write_run(const fs::path& dir) {
  fs::create_directories(dir);
  std::ofstream metrics(dir / "metrics.jsonl");
  for (int s = 1; s <= 60; ++s) {
    const double loss = 1.5 + 4.0 * std::exp(-double(s) / 12.0) + 0.05 * std::sin(double(s));
    const int workers = s <= 20 ? 4 : s <= 40 ? 2 : 3;
    const double step_s = 0.02 * 4 / workers + 0.002 * (s % 3);
    metrics << fmt::format(
        "{{\"cursor\":{},\"elapsed_s\":{},\"grad_norm\":1.5,\"loss\":{},\"lr\":0.003,\"step\":{},"
        "\"step_s\":{},\"time\":{},\"tokens_per_s\":{},\"workers\":{}{}}}\n",
        32 * s, 0.03 * s, loss, s, step_s, 1795715787.0 + 0.03 * s, 2048 / step_s, workers,
        s % 20 == 0 ? fmt::format(",\"eval_loss\":{}", loss + 0.2) : "");
  }
  std::ofstream(dir / "events.jsonl")
      << "{\"bytes_moved\":592896,\"cause\":\"timeline (workers)\",\"detection_s\":0.0,"
         "\"event\":\"reconfigure\",\"generation\":1,\"new_plan\":\"dp=2 tp=1 pp=1 v=1 mb=16x1 "
         "1f1b zero0\",\"new_workers\":2,\"old_plan\":\"dp=4 tp=1 pp=1 v=1 mb=8x1 1f1b zero0\","
         "\"old_workers\":4,\"restored_from\":\"survivors\",\"step\":20,\"steps_lost\":0,"
         "\"total_pause_s\":0.286}\n"
         "{\"bytes_moved\":30034944,\"cause\":\"worker 3 was killed by signal 9 (SIGKILL)\","
         "\"dead\":[3],\"detection_s\":0.0407,\"event\":\"recover\",\"generation\":2,"
         "\"new_plan\":\"dp=1 tp=1 pp=3 v=1 mb=1x32 1f1b zero0 units=3,2,1\",\"new_workers\":3,"
         "\"old_plan\":\"dp=2 tp=1 pp=1 v=1 mb=16x1 1f1b zero0\",\"old_workers\":2,"
         "\"restored_from\":\"survivors\",\"step\":40,\"steps_lost\":0,\"total_pause_s\":0.171}\n";
}

// Nothing under the report's name, nor a temporary file beside it.
bool nothing_written(const fs::path& dir) {
  if (!fs::exists(dir)) return true;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().filename().string().rfind("report.html", 0) == 0) return false;
  return true;
}

TEST(ReportCommand, WritesTheReportOfARunDirectory) {
  TempDir tmp;
  const fs::path run = tmp / "run";
  write_run(run);
  auto r = tessel(run.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(has(r.output, "wrote " + (run / "report.html").string() +
                                ": 60 metrics lines, 2 "
                                "events"))
      << r.output;
  const std::string html = read(run / "report.html");
  EXPECT_EQ(count(html, "<svg"), 5u);
  EXPECT_EQ(count(html, "<g class=\"marker failure\">"), 3u);
  EXPECT_TRUE(has(html, "<dd>122,880 <small>(2,048 a step)</small></dd>")) << html;
  // Self-contained: nothing fetched, nothing run.
  EXPECT_FALSE(has(html, "http:"));
  EXPECT_FALSE(has(html, "https:"));
  EXPECT_FALSE(has(html, "<script"));
  EXPECT_FALSE(has(html, "<link"));
  // Its own page is replaced when run again; another file only with --force.
  EXPECT_EQ(tessel(run.string()).status, 0);
  std::ofstream(tmp / "mine.html") << "keep";
  r = tessel(run.string() + " --out " + (tmp / "mine.html").string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_TRUE(has(r.output, "exists; add --force to replace it")) << r.output;
  EXPECT_EQ(read(tmp / "mine.html"), "keep");
  r = tessel(run.string() + " --force --out " + (tmp / "mine.html").string());
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read(tmp / "mine.html"), read(run / "report.html"));
  // The inputs are never the output.
  r = tessel(run.string() + " --force --out " + (run / "metrics.jsonl").string());
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_EQ(count(read(run / "metrics.jsonl"), "\n"), 60u);
}

TEST(ReportCommand, ReadsTheFilesNamed) {
  TempDir tmp;
  write_run(tmp / "run");
  fs::rename(tmp / "run" / "metrics.jsonl", tmp / "m.jsonl");
  fs::rename(tmp / "run" / "events.jsonl", tmp / "e.jsonl");
  auto r = tessel("--metrics " + (tmp / "m.jsonl").string());
  ASSERT_EQ(r.status, 0) << r.output;
  // Beside the metrics, and no events unless named.
  EXPECT_TRUE(has(r.output, (tmp / "report.html").string() + ": 60 metrics lines, 0 events"))
      << r.output;
  r = tessel("--metrics " + (tmp / "m.jsonl").string() + " --events " + (tmp / "e.jsonl").string() +
             " --out " + (tmp / "out.html").string() + " --title 'Demo <run>'");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string html = read(tmp / "out.html");
  EXPECT_TRUE(has(html, "<h1>Demo &lt;run&gt;</h1>"));
  EXPECT_EQ(count(html, "<svg"), 5u);
  // A run without events.jsonl (one that kept its plan) is reported without.
  write_run(tmp / "quiet");
  fs::remove(tmp / "quiet" / "events.jsonl");
  r = tessel((tmp / "quiet").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(has(read(tmp / "quiet" / "report.html"), "No events"));
}

TEST(ReportCommand, BadInputsAreClearErrorsAndWriteNothing) {
  TempDir tmp;
  struct Case {
    std::string args;
    int status;
    std::string message;
    fs::path dir;  // where no report may appear
  };
  const fs::path run = tmp / "run";
  const fs::path empty = tmp / "empty", blank = tmp / "blank", bad = tmp / "bad",
                 bad_events = tmp / "bad-events";
  fs::create_directories(empty);
  write_run(blank);
  std::ofstream(blank / "metrics.jsonl", std::ios::trunc).flush();
  write_run(bad);
  {
    std::ofstream m(bad / "metrics.jsonl", std::ios::trunc);
    m << "{\"step\":1,\"loss\":5.0}\n{\"step\":2,\"loss\":4.9}\n{\"step\":3,\"loss\":4.\n";
  }
  write_run(bad_events);
  std::ofstream(bad_events / "events.jsonl", std::ios::app) << "not json\n";
  const std::vector<Case> cases = {
      {(tmp / "missing").string(), 2,
       "tessel: config error: run directory " + (tmp / "missing").string() + " does not exist",
       tmp / "missing"},
      {empty.string(), 2,
       "tessel: config error: the metrics file " + (empty / "metrics.jsonl").string() +
           " does not exist; is " + empty.string() + " the run's directory?",
       empty},
      {"--metrics " + (tmp / "nope.jsonl").string(), 2,
       "--metrics " + (tmp / "nope.jsonl").string() + " does not exist", tmp.path()},
      {blank.string(), 1,
       "tessel: corrupt data: " + (blank / "metrics.jsonl").string() +
           " holds no step records (it is empty)",
       blank},
      {bad.string(), 1,
       "tessel: corrupt data: " + (bad / "metrics.jsonl").string() + ":3: not a JSON line", bad},
      {bad_events.string(), 1,
       "tessel: corrupt data: " + (bad_events / "events.jsonl").string() + ":3: not a JSON line",
       bad_events},
      {"", 2, "needs a run directory (one holding metrics.jsonl) or --metrics FILE", tmp.path()},
  };
  for (const auto& c : cases) {
    const auto r = tessel(c.args);
    EXPECT_EQ(r.status, c.status) << c.args << ": " << r.output;
    EXPECT_TRUE(has(r.output, c.message)) << c.args << ": " << r.output;
    EXPECT_TRUE(nothing_written(c.dir)) << c.args;
  }
}

// ---- the page in a browser -------------------------------------------------------------------

// An RGB image.
struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  const uint8_t* at(int x, int y) const {
    return &rgb[(size_t(y) * size_t(width) + size_t(x)) * 3];
  }
};

uint32_t big_endian(const std::string& s, size_t at) {
  return uint32_t(uint8_t(s[at])) << 24 | uint32_t(uint8_t(s[at + 1])) << 16 |
         uint32_t(uint8_t(s[at + 2])) << 8 | uint32_t(uint8_t(s[at + 3]));
}

// Decodes the 8-bit RGB or RGBA PNG Chromium writes. Inflating uses the system's libz.so.1
// (Chromium itself needs it), loaded at run time: zlib is not a build dependency of tessel.
Image decode_png(const std::string& png) {
  Image img;
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << "not a PNG";
  std::string idat;
  int channels = 0;
  for (size_t at = 8; at + 8 <= png.size();) {
    const uint32_t length = big_endian(png, at);
    const std::string type = png.substr(at + 4, 4);
    if (at + 12 + length > png.size()) break;
    if (type == "IHDR") {
      img.width = int(big_endian(png, at + 8));
      img.height = int(big_endian(png, at + 12));
      const int depth = uint8_t(png[at + 16]), colour = uint8_t(png[at + 17]);
      const int interlace = uint8_t(png[at + 20]);
      EXPECT_TRUE(depth == 8 && (colour == 2 || colour == 6) && interlace == 0)
          << "a PNG of depth " << depth << ", colour type " << colour << ", interlace " << interlace
          << ": not what this decoder reads";
      channels = colour == 6 ? 4 : 3;
    } else if (type == "IDAT") {
      idat += png.substr(at + 8, length);
    }
    at += 12 + length;
  }
  if (channels == 0 || img.width <= 0 || img.height <= 0) {
    ADD_FAILURE() << "the PNG has no image header";
    return {};
  }
  using Uncompress = int (*)(unsigned char*, unsigned long*, const unsigned char*, unsigned long);
  void* zlib = ::dlopen("libz.so.1", RTLD_NOW | RTLD_LOCAL);
  if (zlib == nullptr) {
    ADD_FAILURE() << "cannot load libz.so.1 to decode the screenshot: " << ::dlerror();
    return {};
  }
  auto uncompress = reinterpret_cast<Uncompress>(::dlsym(zlib, "uncompress"));
  const size_t stride = size_t(img.width) * size_t(channels);
  std::vector<uint8_t> raw(size_t(img.height) * (stride + 1));
  unsigned long raw_size = raw.size();
  const int rc = uncompress
                     ? uncompress(raw.data(), &raw_size,
                                  reinterpret_cast<const unsigned char*>(idat.data()), idat.size())
                     : -1;
  ::dlclose(zlib);
  if (rc != 0 || raw_size != raw.size()) {
    ADD_FAILURE() << "the PNG's image data does not inflate to its size (zlib " << rc << ")";
    return {};
  }
  // Undo the per-row filters (PNG specification, section 9).
  std::vector<uint8_t> pixels(size_t(img.height) * stride);
  for (int y = 0; y < img.height; ++y) {
    const uint8_t filter = raw[size_t(y) * (stride + 1)];
    const uint8_t* in = &raw[size_t(y) * (stride + 1) + 1];
    uint8_t* out = &pixels[size_t(y) * stride];
    const uint8_t* up = y > 0 ? out - stride : nullptr;
    for (size_t i = 0; i < stride; ++i) {
      const int a = i >= size_t(channels) ? out[i - size_t(channels)] : 0;
      const int b = up ? up[i] : 0;
      const int c = up && i >= size_t(channels) ? up[i - size_t(channels)] : 0;
      int predicted = 0;
      switch (filter) {
        case 0:
          predicted = 0;
          break;
        case 1:
          predicted = a;
          break;
        case 2:
          predicted = b;
          break;
        case 3:
          predicted = (a + b) / 2;
          break;
        case 4: {
          const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
          predicted = pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
          break;
        }
        default:
          ADD_FAILURE() << "unknown PNG filter " << int(filter);
          return {};
      }
      out[i] = uint8_t(in[i] + predicted);
    }
  }
  img.rgb.resize(size_t(img.width) * size_t(img.height) * 3);
  for (size_t p = 0; p < size_t(img.width) * size_t(img.height); ++p)
    for (int k = 0; k < 3; ++k)
      img.rgb[p * 3 + size_t(k)] = pixels[p * size_t(channels) + size_t(k)];
  return img;
}

// Where pixels of one colour are: how many, and their bounding box.
struct Spread {
  int64_t pixels = 0;
  int x0 = 1 << 30, x1 = -1, y0 = 1 << 30, y1 = -1;
};

// Pixels within 10 of `rgb` in every channel: a line's own colour, anti-aliased edges aside (the
// page's other colours, backgrounds included, are farther from each series' colour than that).
Spread spread_of(const Image& img, uint32_t rgb) {
  const int want[3] = {int(rgb >> 16), int((rgb >> 8) & 0xff), int(rgb & 0xff)};
  Spread s;
  for (int y = 0; y < img.height; ++y)
    for (int x = 0; x < img.width; ++x) {
      const uint8_t* p = img.at(x, y);
      if (std::abs(p[0] - want[0]) > 10 || std::abs(p[1] - want[1]) > 10 ||
          std::abs(p[2] - want[2]) > 10)
        continue;
      ++s.pixels;
      s.x0 = std::min(s.x0, x);
      s.x1 = std::max(s.x1, x);
      s.y0 = std::min(s.y0, y);
      s.y1 = std::max(s.y1, y);
    }
  return s;
}

std::string find_chromium() {
  for (const char* name : {"chromium", "chromium-browser", "google-chrome"}) {
    std::string path;
    if (run_command(fmt::format("command -v {}", name), &path) == 0) {
      path.erase(path.find_last_not_of("\n ") + 1);
      if (!path.empty()) return path;
    }
  }
  return "";
}

TEST(ReportCommand, ChromiumRendersTheCharts) {
  const std::string chromium = find_chromium();
  if (chromium.empty())
    GTEST_SKIP() << "chromium is not installed (scripts/setup installs it): the rendered page "
                    "is not checked";
  TempDir tmp;
  const fs::path run = tmp / "run";
  write_run(run);
  auto r = tessel(run.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const auto t0 = std::chrono::steady_clock::now();
  // A private profile in the temp dir; no sandbox (tests may run as root, in containers).
  std::string log;
  const int rc = run_command(
      fmt::format("timeout 60 {} --headless=new --no-sandbox --disable-gpu --hide-scrollbars "
                  "--no-first-run --window-size=1200,2400 --user-data-dir={} --screenshot={} "
                  "file://{} > {} 2>&1",
                  chromium, (tmp / "profile").string(), (tmp / "shot.png").string(),
                  fs::absolute(run / "report.html").string(), (tmp / "chromium.log").string()),
      &log);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(rc, 0) << "chromium failed (" << rc << "): " << read(tmp / "chromium.log");
  std::printf("[ report  ] chromium rendered the page in %.1f s\n", seconds);
  const Image img = decode_png(read(tmp / "shot.png"));
  ASSERT_EQ(img.width, 1200);
  ASSERT_EQ(img.height, 2400);

  const Spread loss = spread_of(img, 0x1f77b4), rate = spread_of(img, 0x2ca02c),
               workers = spread_of(img, 0x9467bd), failure = spread_of(img, 0xd62728),
               bars = spread_of(img, 0x4e79a7);
  // Pixels that are not (near) white in the rows of the three step charts, from the top of the
  // loss line to the bottom of the workers line: grid lines, axes, tick labels, markers, plan
  // bands, series.
  int64_t ink = 0;
  for (int y = std::max(0, loss.y0); y <= std::min(img.height - 1, workers.y1); ++y)
    for (int x = 0; x < img.width; ++x) {
      const uint8_t* p = img.at(x, y);
      ink += p[0] < 235 || p[1] < 235 || p[2] < 235;
    }
  const auto describe = [](const Spread& s) {
    return fmt::format("{} pixels in x {}..{}, y {}..{}", s.pixels, s.x0, s.x1, s.y0, s.y1);
  };
  SCOPED_TRACE(fmt::format("ink {}; loss {}; tokens/s {}; workers {}; failure {}; bars {}", ink,
                           describe(loss), describe(rate), describe(workers), describe(failure),
                           describe(bars)));
  // Without charts these rows would hold two headings (about 2,000 pixels of ink); the charts'
  // axes, grids, tick labels, series, markers and bands make about 37,000 here.
  EXPECT_GT(ink, 15'000);
  // The loss line, 2 pixels wide: at least one pixel of its own colour in most of the 1,000
  // pixel columns of its plot (eval dots and markers cover some); across the plot's width and
  // falling over most of its height (from 5.5 to 1.5 on an axis from 1.5 to 5.5, 206 pixels).
  EXPECT_GT(loss.pixels, 800);
  EXPECT_GT(loss.x1 - loss.x0, 900);
  EXPECT_GT(loss.y1 - loss.y0, 150);
  // Tokens/s, 1.5 pixels wide and zigzagging (anti-aliased where steep: fewer exact pixels),
  // and the workers' step line, 2.5 pixels wide, likewise span their plots.
  EXPECT_GT(rate.pixels, 400);
  EXPECT_GT(rate.x1 - rate.x0, 900);
  EXPECT_GT(workers.pixels, 800);
  EXPECT_GT(workers.x1 - workers.x0, 900);
  // The charts in page order: loss above tokens/s above workers.
  EXPECT_LT(loss.y1, rate.y0);
  EXPECT_LT(rate.y1, workers.y0);
  // The failure's marker on the three step charts (dashed, 2 pixels wide, about 60% of each
  // 206-pixel plot height) and its bars below them; the reconfiguration's bars in their colour.
  EXPECT_GT(failure.pixels, 600);
  EXPECT_GT(failure.y1, workers.y1);
  EXPECT_GT(bars.pixels, 1500);
  EXPECT_GT(bars.y0, workers.y1);
}

}  // namespace
}  // namespace tessel::cli
