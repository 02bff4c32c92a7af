#include "tessel/cli/run_report.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <map>
#include <utility>

#include "tessel/core/check.h"

namespace tessel::cli {

namespace {

using Json = nlohmann::json;

// ---- parsing ---------------------------------------------------------------------------------

// A line's start, for messages: enough to recognise it, not a whole record.
std::string excerpt(std::string_view line) {
  constexpr size_t kMax = 60;
  return line.size() <= kMax ? std::string(line) : std::string(line.substr(0, kMax)) + "...";
}

// Calls f(json, line_number) for every non-blank line of `text`.
template <typename F>
void for_each_json_line(std::string_view text, const std::string& source, F&& f) {
  int64_t number = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t end = std::min(text.find('\n', pos), text.size());
    std::string_view line = text.substr(pos, end - pos);
    const bool cut = end == text.size();  // no newline after it
    pos = end + 1;
    ++number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    Json j;
    try {
      j = Json::parse(line);
    } catch (const Json::parse_error& e) {
      TESSEL_THROW(CorruptDataError,
                   "{}:{}: not a JSON line ({}): '{}'{}; fix or delete that line and run the "
                   "report again",
                   source, number, e.what(), excerpt(line),
                   cut ? " (the last line, without its newline: cut off by a crash or a full "
                         "disk?)"
                       : "");
    }
    TESSEL_CHECK(j.is_object(), CorruptDataError,
                 "{}:{}: a JSON {} where a record (an object) belongs: '{}'", source, number,
                 j.type_name(), excerpt(line));
    f(j, number);
  }
}

std::optional<double> number_field(const Json& j, const char* key) {
  const auto it = j.find(key);
  // Absent, or null (JSON has no infinity: a rate over a zero interval is written as null).
  if (it == j.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
}

std::optional<int64_t> integer_field(const Json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) return std::nullopt;
  return it->get<int64_t>();
}

std::string text_field(const Json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return "";
  return it->is_string() ? it->get<std::string>() : it->dump();
}

int64_t required_step(const Json& j, const std::string& source, int64_t line) {
  const auto it = j.find("step");
  TESSEL_CHECK(it != j.end() && it->is_number_integer() && it->get<int64_t>() >= 0,
               CorruptDataError, "{}:{}: the record has no \"step\" (a whole number >= 0): {}",
               source, line, excerpt(j.dump()));
  return it->get<int64_t>();
}

// ---- numbers ---------------------------------------------------------------------------------

std::string with_thousands(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

// Three significant digits, at least; no exponent for the magnitudes a run has.
std::string format_value(double v) {
  const double a = std::fabs(v);
  if (a >= 100) return fmt::format("{:.0f}", v);
  if (a >= 10) return fmt::format("{:.1f}", v);
  if (a >= 1) return fmt::format("{:.2f}", v);
  return fmt::format("{:.3f}", v);
}

std::string format_loss(double v) {
  return fmt::format("{:.4f}", v);
}

std::string format_seconds(double s) {
  return fmt::format("{:.3f}", s);
}

std::string format_duration(double s) {
  if (s < 60) return fmt::format("{:.1f} s", s);
  const auto whole = int64_t(std::llround(s));
  if (whole < 3600) return fmt::format("{} min {:02} s", whole / 60, whole % 60);
  return fmt::format("{} h {:02} min", whole / 3600, (whole % 3600) / 60);
}

// Decimal units (1 MB = 1e6 bytes), as the demo's summary prints them.
struct ByteUnit {
  double divisor;
  const char* name;
};

ByteUnit byte_unit(double largest) {
  if (largest >= 1e9) return {1e9, "GB"};
  if (largest >= 1e6) return {1e6, "MB"};
  if (largest >= 1e3) return {1e3, "kB"};
  return {1, "B"};
}

std::string format_bytes(double b) {
  const auto u = byte_unit(b);
  return u.divisor == 1 ? fmt::format("{:.0f} B", b)
                        : fmt::format("{} {}", format_value(b / u.divisor), u.name);
}

std::string format_rate(double v) {
  if (v >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

template <typename T>
std::string or_dash(const std::optional<T>& v, std::string (*format)(T)) {
  return v ? format(*v) : "&#8211;";
}

std::string int_text(int64_t v) {
  return with_thousands(v);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const auto mid = v.begin() + std::ptrdiff_t(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

// ---- SVG charts ------------------------------------------------------------------------------

// Colours: the series' are distinct from each other and from the markers', so a reader (and the
// render test) can tell them apart.
constexpr const char* kLossColour = "#1f77b4";
constexpr const char* kEvalColour = "#ff7f0e";
constexpr const char* kRateColour = "#2ca02c";
constexpr const char* kWorkersColour = "#9467bd";
constexpr const char* kReconfigureColour = "#7f7f7f";
constexpr const char* kFailureColour = "#d62728";
constexpr const char* kBarColour = "#4e79a7";

struct Ticks {
  double lo = 0, hi = 1, step = 1;
  std::vector<double> at;
};

// Round-number ticks (1, 2 or 5 times a power of ten) covering [lo, hi], about `target` of them.
Ticks nice_ticks(double lo, double hi, int target, bool whole_numbers, bool expand) {
  if (!(hi > lo)) {
    const double pad = std::max(1.0, std::fabs(lo) * 0.05);
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / magnitude;
  double step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * magnitude;
  if (whole_numbers) step = std::max(1.0, std::round(step));
  Ticks t;
  t.step = step;
  t.lo = expand ? std::floor(lo / step) * step : lo;
  t.hi = expand ? std::ceil(hi / step) * step : hi;
  // Half a step of slack: the last tick survives the rounding of repeated additions.
  for (double v = std::ceil(t.lo / step - 1e-9) * step; v <= t.hi + step * 1e-6; v += step)
    t.at.push_back(std::fabs(v) < step * 1e-9 ? 0.0 : v);
  return t;
}

std::string tick_label(double v, double step) {
  if (v == 0) return "0";
  const double a = std::max(std::fabs(v), step);
  if (a >= 1e6 && step >= 1e4) return fmt::format("{:g}M", v / 1e6);
  if (a >= 1e4 && step >= 100) return fmt::format("{:g}k", v / 1e3);
  const int decimals = std::max(0, int(-std::floor(std::log10(step) + 1e-9)));
  return fmt::format("{:.{}f}", v, decimals);
}

// The plot area of one chart in SVG pixels, and the data ranges mapped onto it.
struct Frame {
  double width = 1100, height = 300;
  double left = 76, right = 24, top = 44, bottom = 50;
  double x0 = 0, x1 = 1, y0 = 0, y1 = 1;

  double plot_width() const { return width - left - right; }
  double px(double x) const { return left + (x - x0) / (x1 - x0) * plot_width(); }
  double py(double y) const { return top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom); }
  double bottom_y() const { return height - bottom; }
};

class Svg {
 public:
  Svg(const Frame& f, std::string_view label) {
    out_ = fmt::format(
        "<svg class=\"chart\" viewBox=\"0 0 {0:.0f} {1:.0f}\" width=\"{0:.0f}\" height=\"{1:.0f}\" "
        "role=\"img\" aria-label=\"{2}\">\n",
        f.width, f.height, html_escape(label));
  }
  Svg& operator<<(std::string_view s) {
    out_ += s;
    return *this;
  }
  std::string finish() && { return std::move(out_) + "</svg>\n"; }

 private:
  std::string out_;
};

void draw_axes(Svg& svg, const Frame& f, const Ticks& xt, const Ticks& yt, std::string_view x_title,
               std::string_view y_title) {
  std::string s = "<g class=\"axes\">\n";
  for (double y : yt.at) {
    const double py = f.py(y);
    s += fmt::format(
        "<line x1=\"{:.1f}\" x2=\"{:.1f}\" y1=\"{:.1f}\" y2=\"{:.1f}\" class=\"grid\"/>"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\" class=\"tick\">{}</text>\n",
        f.left, f.left + f.plot_width(), py, py, f.left - 8, py + 4,
        html_escape(tick_label(y, yt.step)));
  }
  for (double x : xt.at) {
    const double px = f.px(x);
    s += fmt::format(
        "<line x1=\"{0:.1f}\" x2=\"{0:.1f}\" y1=\"{1:.1f}\" y2=\"{2:.1f}\" class=\"axis\"/>"
        "<text x=\"{0:.1f}\" y=\"{3:.1f}\" text-anchor=\"middle\" class=\"tick\">{4}</text>\n",
        px, f.bottom_y(), f.bottom_y() + 5, f.bottom_y() + 19, html_escape(tick_label(x, xt.step)));
  }
  s += fmt::format(
      "<line x1=\"{0:.1f}\" x2=\"{0:.1f}\" y1=\"{1:.1f}\" y2=\"{2:.1f}\" class=\"axis\"/>"
      "<line x1=\"{0:.1f}\" x2=\"{3:.1f}\" y1=\"{2:.1f}\" y2=\"{2:.1f}\" class=\"axis\"/>\n",
      f.left, f.top, f.bottom_y(), f.left + f.plot_width());
  s += fmt::format(
      "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" class=\"title\">{}</text>\n"
      "<text transform=\"translate({:.1f},{:.1f}) rotate(-90)\" text-anchor=\"middle\" "
      "class=\"title\">{}</text>\n</g>\n",
      f.left + f.plot_width() / 2, f.height - 10, html_escape(x_title), 18.0,
      f.top + (f.bottom_y() - f.top) / 2, html_escape(y_title));
  svg << s;
}

// "x,y x,y ..." of the points in the frame; a series longer than a few points per pixel column
// keeps, per column, its first, lowest, highest and last point (spikes stay visible, the page
// stays small for a long run).
std::string polyline_points(const Frame& f, const std::vector<std::pair<double, double>>& pts) {
  std::vector<std::pair<double, double>> kept;
  if (pts.size() <= size_t(3 * f.plot_width())) {
    kept = pts;
  } else {
    size_t i = 0;
    while (i < pts.size()) {
      const auto column = int64_t(f.px(pts[i].first));
      size_t j = i, lo = i, hi = i;
      for (; j < pts.size() && int64_t(f.px(pts[j].first)) == column; ++j) {
        if (pts[j].second < pts[lo].second) lo = j;
        if (pts[j].second > pts[hi].second) hi = j;
      }
      std::vector<size_t> picks = {i, lo, hi, j - 1};
      std::sort(picks.begin(), picks.end());
      picks.erase(std::unique(picks.begin(), picks.end()), picks.end());
      for (size_t k : picks) kept.push_back(pts[k]);
      i = j;
    }
  }
  std::string s;
  for (const auto& [x, y] : kept)
    fmt::format_to(std::back_inserter(s), "{:.1f},{:.1f} ", f.px(x), f.py(y));
  if (!s.empty()) s.pop_back();
  return s;
}

std::string event_summary(const RunEvent& e, size_t number) {
  std::string s = fmt::format("#{} at step {}: {}", number, e.step,
                              e.kind.empty() ? std::string("event") : e.kind);
  if (!e.cause.empty()) s += " (" + e.cause + ")";
  if (e.old_workers || e.new_workers)
    s += fmt::format("; workers {} -> {}", e.old_workers ? std::to_string(*e.old_workers) : "?",
                     e.new_workers ? std::to_string(*e.new_workers) : "?");
  if (!e.new_plan.empty()) s += "; plan " + e.new_plan;
  if (e.total_pause_s) s += fmt::format("; pause {} s", format_seconds(*e.total_pause_s));
  if (e.bytes_moved) s += "; " + format_bytes(*e.bytes_moved) + " moved";
  if (e.steps_lost && *e.steps_lost > 0) s += fmt::format("; steps lost: {}", *e.steps_lost);
  return s;
}

// One vertical line per step at which events happened (red when one of them is a failure),
// labelled with the events' numbers, the summary of each in its hover title.
void draw_event_markers(Svg& svg, const Frame& f, const std::vector<RunEvent>& events) {
  std::map<int64_t, std::vector<size_t>> at_step;
  for (size_t i = 0; i < events.size(); ++i) at_step[events[i].step].push_back(i);
  std::string s = "<g class=\"events\">\n";
  for (const auto& [step, which] : at_step) {
    if (double(step) < f.x0 || double(step) > f.x1) continue;
    bool failure = false;
    std::string title, label;
    for (size_t i : which) {
      failure = failure || events[i].is_failure();
      title += (title.empty() ? "" : "\n") + event_summary(events[i], i + 1);
      label += fmt::format("{}#{}", label.empty() ? "" : ",", i + 1);
    }
    const char* colour = failure ? kFailureColour : kReconfigureColour;
    const double x = f.px(double(step));
    s += fmt::format(
        "<g class=\"marker {5}\"><title>{0}</title>"
        "<line x1=\"{1:.1f}\" x2=\"{1:.1f}\" y1=\"{2:.1f}\" y2=\"{3:.1f}\" stroke=\"{4}\" "
        "stroke-width=\"2\" stroke-dasharray=\"6 4\"/>"
        // A wide invisible line: the hover target (a 2-pixel line is hard to point at).
        "<line x1=\"{1:.1f}\" x2=\"{1:.1f}\" y1=\"{2:.1f}\" y2=\"{3:.1f}\" stroke=\"#000\" "
        "stroke-opacity=\"0\" stroke-width=\"10\"/>"
        "<text x=\"{1:.1f}\" y=\"{6:.1f}\" text-anchor=\"middle\" class=\"mark\" "
        "fill=\"{4}\">{7}</text></g>\n",
        html_escape(title), x, f.top, f.bottom_y(), colour, failure ? "failure" : "reconfigure",
        f.top - 8, html_escape(label));
  }
  svg << s << "</g>\n";
}

void draw_legend(Svg& svg, const Frame& f,
                 const std::vector<std::pair<std::string, const char*>>& entries) {
  double x = f.left + f.plot_width() - 10;
  std::string s;
  // Right to left, so the last entry ends at the plot's right edge.
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    const double w = 7.0 * double(it->first.size()) + 26;
    x -= w;
    s += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"14\" height=\"4\" fill=\"{}\"/>"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" class=\"legend\">{}</text>\n",
        x, 10.0, it->second, x + 18, 15.0, html_escape(it->first));
  }
  svg << s;
}

// The x axis of the step charts: from the boundary before the first step to the last step.
Frame step_frame(const std::vector<StepRecord>& steps) {
  Frame f;
  f.x0 = double(steps.front().step - 1);
  f.x1 = double(steps.back().step);
  return f;
}

Ticks step_ticks(const Frame& f) {
  return nice_ticks(f.x0, f.x1, 10, true, false);
}

std::string loss_chart(const std::vector<StepRecord>& steps, const std::vector<RunEvent>& events) {
  Frame f = step_frame(steps);
  double lo = steps.front().loss, hi = lo;
  std::vector<std::pair<double, double>> loss, eval;
  for (const auto& r : steps) {
    loss.emplace_back(double(r.step), r.loss);
    lo = std::min(lo, r.loss);
    hi = std::max(hi, r.loss);
    if (r.eval_loss) {
      eval.emplace_back(double(r.step), *r.eval_loss);
      lo = std::min(lo, *r.eval_loss);
      hi = std::max(hi, *r.eval_loss);
    }
  }
  const Ticks yt = nice_ticks(lo, hi, 6, false, true);
  f.y0 = yt.lo;
  f.y1 = yt.hi;
  Svg svg(f, "training loss by step");
  draw_axes(svg, f, step_ticks(f), yt, "step", "loss (nats/token)");
  svg << fmt::format(
      "<polyline class=\"series loss\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\" "
      "stroke-linejoin=\"round\" points=\"{}\"/>\n",
      kLossColour, polyline_points(f, loss));
  std::string dots;
  for (const auto& [x, y] : eval)
    dots += fmt::format(
        "<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4.5\" fill=\"{}\" stroke=\"#fff\" "
        "stroke-width=\"1\"><title>step {}: eval loss {}</title></circle>\n",
        f.px(x), f.py(y), kEvalColour, int64_t(x), format_loss(y));
  svg << "<g class=\"eval\">\n" << dots << "</g>\n";
  draw_event_markers(svg, f, events);
  std::vector<std::pair<std::string, const char*>> legend = {{"training loss", kLossColour}};
  if (!eval.empty()) legend.emplace_back("eval loss", kEvalColour);
  draw_legend(svg, f, legend);
  return std::move(svg).finish();
}

std::string rate_chart(const std::vector<StepRecord>& steps, const std::vector<RunEvent>& events) {
  Frame f = step_frame(steps);
  std::vector<std::pair<double, double>> rate;
  double hi = 0;
  for (const auto& r : steps)
    if (r.tokens_per_s && std::isfinite(*r.tokens_per_s)) {
      rate.emplace_back(double(r.step), *r.tokens_per_s);
      hi = std::max(hi, *r.tokens_per_s);
    }
  const Ticks yt = nice_ticks(0, hi > 0 ? hi : 1, 6, false, true);
  f.y0 = yt.lo;
  f.y1 = yt.hi;
  Svg svg(f, "training throughput (tokens per second) by step");
  draw_axes(svg, f, step_ticks(f), yt, "step", "tokens/s");
  if (rate.empty())
    svg << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" class=\"empty\">{}</text>\n", f.left + 20,
                       f.top + 30, "the metrics hold no tokens_per_s");
  svg << fmt::format(
      "<polyline class=\"series rate\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" "
      "stroke-linejoin=\"round\" points=\"{}\"/>\n",
      kRateColour, polyline_points(f, rate));
  draw_event_markers(svg, f, events);
  return std::move(svg).finish();
}

// A stretch of steps under one plan: between two event steps (or the ends of the run).
struct Segment {
  int64_t first = 0, last = 0;  // steps first..last
  std::string plan;             // empty: not known (no event names it)
  std::optional<int64_t> workers;
  std::vector<double> rates;
};

std::vector<Segment> plan_segments(const std::vector<StepRecord>& steps,
                                   const std::vector<RunEvent>& events) {
  std::vector<RunEvent> sorted = events;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const RunEvent& a, const RunEvent& b) { return a.step < b.step; });
  std::vector<Segment> segments;
  Segment current;
  current.first = steps.front().step;
  current.plan = sorted.empty() ? "" : sorted.front().old_plan;
  size_t next = 0;
  // Events before the first step charted set the plan it starts in.
  for (; next < sorted.size() && sorted[next].step < current.first; ++next)
    current.plan = sorted[next].new_plan;
  for (const auto& r : steps) {
    std::optional<std::string> plan;  // the plan from r on, when events before r switched
    for (; next < sorted.size() && sorted[next].step < r.step; ++next) plan = sorted[next].new_plan;
    if (plan) {
      segments.push_back(current);
      current = Segment{};
      current.first = r.step;
      current.plan = *plan;
    }
    current.last = r.step;
    if (r.workers && !current.workers) current.workers = r.workers;
    if (r.tokens_per_s) current.rates.push_back(*r.tokens_per_s);
  }
  segments.push_back(current);
  return segments;
}

std::string workers_chart(const std::vector<StepRecord>& steps, const std::vector<RunEvent>& events,
                          const std::vector<Segment>& segments) {
  Frame f = step_frame(steps);
  int64_t most = 1;
  for (const auto& r : steps)
    if (r.workers) most = std::max(most, *r.workers);
  const Ticks yt = nice_ticks(0, double(most + 1), std::min<int>(int(most) + 1, 6), true, true);
  f.y0 = yt.lo;
  f.y1 = yt.hi;
  Svg svg(f, "workers by step, with the plan of each segment");
  // The plan bands first, under everything else.
  std::string bands = "<g class=\"plans\">\n";
  for (size_t i = 0; i < segments.size(); ++i) {
    const auto& seg = segments[i];
    const double x0 = f.px(double(seg.first - 1)), x1 = f.px(double(seg.last));
    const std::string plan = seg.plan.empty() ? std::string("plan not recorded") : seg.plan;
    const std::string title =
        fmt::format("steps {}-{}: {}{}", seg.first, seg.last,
                    seg.workers ? fmt::format("{} workers, ", *seg.workers) : "", plan);
    bands += fmt::format(
        "<g><title>{}</title><rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
        "fill=\"{}\"/>",
        html_escape(title), x0, f.top, std::max(0.0, x1 - x0), f.bottom_y() - f.top,
        i % 2 == 0 ? "#eef3fa" : "#fbf6ee");
    // As much of the plan as fits the band (about 7 pixels a character at 12 px), clipped to
    // the band where the font is wider.
    const auto fits = size_t(std::max(0.0, (x1 - x0 - 10) / 7.0));
    if (fits >= 4) {
      std::string label = plan;
      if (label.size() > fits) {
        size_t cut = fits - 1;
        // Not inside a UTF-8 sequence (continuation bytes are 10xxxxxx).
        while (cut > 0 && (static_cast<unsigned char>(label[cut]) & 0xC0) == 0x80) --cut;
        label = label.substr(0, cut) + "\u2026";
      }
      bands += fmt::format(
          "<clipPath id=\"plan-band-{0}\"><rect x=\"{1:.1f}\" y=\"{2:.1f}\" width=\"{3:.1f}\" "
          "height=\"24\"/></clipPath><text x=\"{4:.1f}\" y=\"{5:.1f}\" class=\"plan\" "
          "clip-path=\"url(#plan-band-{0})\">{6}</text>",
          i, x0 + 2, f.top, std::max(0.0, x1 - x0 - 4), x0 + 5, f.top + 16, html_escape(label));
    }
    bands += "</g>\n";
  }
  svg << bands << "</g>\n";
  draw_axes(svg, f, step_ticks(f), yt, "step", "workers");
  // A step function: a step's count holds from the boundary before it to its end.
  std::vector<std::pair<double, double>> line;
  std::optional<int64_t> last;
  for (const auto& r : steps) {
    if (!r.workers) continue;
    if (!last) {
      line.emplace_back(double(r.step - 1), double(*r.workers));
    } else if (*r.workers != *last) {
      line.emplace_back(double(r.step - 1), double(*last));
      line.emplace_back(double(r.step - 1), double(*r.workers));
    }
    last = r.workers;
  }
  if (last) {
    for (auto it = steps.rbegin(); it != steps.rend(); ++it)
      if (it->workers) {
        line.emplace_back(double(it->step), double(*last));
        break;
      }
  } else {
    svg << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" class=\"empty\">{}</text>\n", f.left + 20,
                       f.top + 40, "the metrics hold no worker counts");
  }
  svg << fmt::format(
      "<polyline class=\"series workers\" fill=\"none\" stroke=\"{}\" stroke-width=\"2.5\" "
      "points=\"{}\"/>\n",
      kWorkersColour, polyline_points(f, line));
  draw_event_markers(svg, f, events);
  return std::move(svg).finish();
}

// Bars, one per event, of `value(event)` (events without it get none).
std::string event_bar_chart(const std::vector<RunEvent>& events, std::string_view label,
                            std::string_view y_title, double divisor,
                            std::optional<double> (*value)(const RunEvent&),
                            std::string (*value_text)(double)) {
  Frame f;
  f.width = 545;
  f.height = 300;
  f.left = 70;
  f.right = 16;
  f.x0 = 0;
  f.x1 = double(events.size());
  double hi = 0;
  for (const auto& e : events)
    if (auto v = value(e)) hi = std::max(hi, *v / divisor);
  const Ticks yt = nice_ticks(0, hi > 0 ? hi : 1, 5, false, true);
  f.y0 = yt.lo;
  f.y1 = yt.hi;
  Svg svg(f, label);
  Ticks none;  // categories, labelled below
  none.at.clear();
  draw_axes(svg, f, none, yt, "event (step)", y_title);
  const double slot = f.plot_width() / double(events.size());
  const double bar = std::min(56.0, slot * 0.7);
  // Label every k-th slot so the labels do not run into each other.
  const auto every = size_t(std::max(1.0, std::ceil(64.0 / slot)));
  std::string s = "<g class=\"bars\">\n";
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    const double cx = f.px(double(i) + 0.5);
    if (i % every == 0)
      s += fmt::format(
          "<text x=\"{0:.1f}\" y=\"{1:.1f}\" text-anchor=\"middle\" class=\"tick\">#{2}</text>"
          "<text x=\"{0:.1f}\" y=\"{3:.1f}\" text-anchor=\"middle\" class=\"tick\">{4}</text>\n",
          cx, f.bottom_y() + 15, i + 1, f.bottom_y() + 29, e.step);
    const auto v = value(e);
    if (!v) continue;
    const double y = f.py(*v / divisor);
    s += fmt::format(
        "<g><title>{}</title><rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
        "fill=\"{}\"/>",
        html_escape(event_summary(e, i + 1)), cx - bar / 2, y, bar, std::max(0.0, f.bottom_y() - y),
        e.is_failure() ? kFailureColour : kBarColour);
    if (slot >= 40)
      s += fmt::format(
          "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" class=\"value\">{}"
          "</text>",
          cx, y - 5, html_escape(value_text(*v)));
    s += "</g>\n";
  }
  svg << s << "</g>\n";
  return std::move(svg).finish();
}

// ---- the page --------------------------------------------------------------------------------

constexpr const char* kStyle = R"(
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: #222; background: #fff; margin: 0; }
main { max-width: 1140px; margin: 0 auto; padding: 16px 20px 40px; }
h1 { font-size: 24px; margin: 4px 0 10px; }
h2 { font-size: 18px; margin: 26px 0 6px; border-bottom: 1px solid #ddd; padding-bottom: 3px; }
.facts { display: grid; grid-template-columns: repeat(4, 1fr); gap: 8px 18px; margin: 0; }
.facts div { background: #f5f7fa; border-radius: 6px; padding: 6px 10px; }
.facts dt { font-size: 12px; color: #666; }
.facts dd { margin: 0; font-size: 17px; font-weight: 600; }
.note { color: #555; font-size: 13px; margin: 6px 0; }
svg.chart { display: block; max-width: 100%; height: auto;
            font-family: system-ui, "DejaVu Sans", sans-serif; }
svg .grid { stroke: #e6e6e6; stroke-width: 1; }
svg .axis { stroke: #555; stroke-width: 1; }
svg .tick { font-size: 12px; fill: #444; }
svg .title { font-size: 13px; fill: #222; }
svg .legend, svg .value, svg .plan { font-size: 12px; fill: #333; }
svg .mark { font-size: 12px; font-weight: 600; }
svg .empty { font-size: 14px; fill: #888; }
.pair { display: flex; gap: 10px; flex-wrap: wrap; }
.pair figure { margin: 0; }
.pair figcaption { font-size: 14px; font-weight: 600; margin: 0 0 2px 6px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 4px 7px; vertical-align: top; }
th { background: #f0f2f5; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.failure td:first-child { border-left: 4px solid #d62728; }
.plancell { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; }
.key span { display: inline-block; width: 18px; height: 0; border-top: 2px dashed; margin: 0 5px 3px 12px; }
)";

std::string fact(std::string_view name, std::string_view value_html) {
  return fmt::format("<div><dt>{}</dt><dd>{}</dd></div>\n", html_escape(name), value_html);
}

// Steps in step order, the last line of each step winning; returns how many lines lost.
size_t last_line_per_step(std::vector<StepRecord>& steps) {
  std::map<int64_t, StepRecord> by_step;
  for (auto& r : steps) by_step[r.step] = std::move(r);
  const size_t superseded = steps.size() - by_step.size();
  steps.clear();
  for (auto& [step, r] : by_step) steps.push_back(std::move(r));
  return superseded;
}

std::string facts(const RunRecords& run, const std::vector<StepRecord>& steps) {
  const auto& first = steps.front();
  const auto& last = steps.back();
  std::string s = "<dl class=\"facts\">\n";
  std::string model;
  for (const auto& r : steps)
    if (!r.model.empty()) model = r.model;
  if (!model.empty()) s += fact("model", html_escape(model));
  s += fact("steps", fmt::format("{} ({}&#8211;{})", with_thousands(int64_t(steps.size())),
                                 with_thousands(first.step), with_thousands(last.step)));
  s += fact("final training loss", fmt::format("{} <small>at step {}</small>",
                                               format_loss(last.loss), with_thousands(last.step)));
  for (auto it = steps.rbegin(); it != steps.rend(); ++it)
    if (it->eval_loss) {
      s += fact("final eval loss",
                fmt::format("{} <small>at step {}</small>", format_loss(*it->eval_loss),
                            with_thousands(it->step)));
      break;
    }
  // Every step trains on one global batch: its tokens are the rate times the step's time
  // (runtime/run_tracker.cpp computes the rate that way, so the product is exact to rounding).
  std::optional<int64_t> per_step;
  for (auto it = steps.rbegin(); it != steps.rend() && !per_step; ++it)
    if (it->tokens_per_s && it->step_s) per_step = std::llround(*it->tokens_per_s * *it->step_s);
  s += fact("tokens seen",
            per_step ? fmt::format("{} <small>({} a step)</small>",
                                   with_thousands(*per_step * last.step), with_thousands(*per_step))
                     : std::string("&#8211;"));
  // From the start of the first step charted to the end of the last (one clock for every
  // process and every resumed run: "time" is Unix time).
  std::optional<double> wall;
  if (first.time && last.time)
    wall = *last.time - (*first.time - first.step_s.value_or(0));
  else if (last.elapsed_s)
    wall = *last.elapsed_s;
  s += fact("wall time", wall ? format_duration(*wall) : std::string("&#8211;"));
  std::vector<double> rates;
  std::optional<int64_t> fewest, most;
  for (const auto& r : steps) {
    if (r.tokens_per_s) rates.push_back(*r.tokens_per_s);
    if (r.workers) {
      fewest = std::min(fewest.value_or(*r.workers), *r.workers);
      most = std::max(most.value_or(*r.workers), *r.workers);
    }
  }
  s += fact("median tokens/s", rates.empty() ? "&#8211;" : format_rate(median(rates)));
  if (most)
    s += fact("workers", *fewest == *most ? std::to_string(*most)
                                          : fmt::format("{}&#8211;{}", *fewest, *most));
  size_t failures = 0;
  double pause = 0;
  for (const auto& e : run.events) {
    failures += e.is_failure();
    pause += e.total_pause_s.value_or(0);
  }
  s +=
      fact("events", fmt::format("{} reconfiguration{}, {} failure{}", run.events.size() - failures,
                                 run.events.size() - failures == 1 ? "" : "s", failures,
                                 failures == 1 ? "" : "s"));
  if (!run.events.empty()) s += fact("total pause", format_seconds(pause) + " s");
  return s + "</dl>\n";
}

std::string segments_table(const std::vector<Segment>& segments) {
  std::string s =
      "<table class=\"segments\"><tr><th>steps</th><th>workers</th><th>plan</th>"
      "<th>median tokens/s</th></tr>\n";
  for (const auto& seg : segments)
    s += fmt::format(
        "<tr><td class=\"num\">{}&#8211;{}</td><td class=\"num\">{}</td>"
        "<td class=\"plancell\">{}</td><td class=\"num\">{}</td></tr>\n",
        with_thousands(seg.first), with_thousands(seg.last),
        seg.workers ? std::to_string(*seg.workers) : "&#8211;",
        seg.plan.empty() ? "&#8211;" : html_escape(seg.plan),
        seg.rates.empty() ? "&#8211;" : format_rate(median(seg.rates)));
  return s + "</table>\n";
}

std::string events_table(const std::vector<RunEvent>& events) {
  std::string s =
      "<table class=\"events\"><tr><th>#</th><th>step</th><th>event</th><th>cause</th>"
      "<th>workers</th><th>plan (new)</th><th>pause s</th><th>bytes moved</th>"
      "<th>steps lost</th><th>detect s</th></tr>\n";
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    std::string cause = html_escape(e.cause);
    if (!e.restored_from.empty() && e.restored_from != "survivors")
      cause += "<br><small>restored from " + html_escape(e.restored_from) + "</small>";
    if (!e.lost.empty()) cause += "<br><small>lost: " + html_escape(e.lost) + "</small>";
    const std::string old_plan =
        e.old_plan.empty() ? "" : fmt::format(" title=\"was: {}\"", html_escape(e.old_plan));
    s += fmt::format(
        "<tr class=\"{}\"><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td>"
        "<td>{}</td><td class=\"num\">{} &#8594; {}</td><td class=\"plancell\"{}>{}</td>"
        "<td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>"
        "<td class=\"num\">{}</td></tr>\n",
        e.is_failure() ? "failure" : "reconfigure", i + 1, with_thousands(e.step),
        html_escape(e.kind), cause,
        e.old_workers ? std::to_string(*e.old_workers) : std::string("?"),
        e.new_workers ? std::to_string(*e.new_workers) : std::string("?"), old_plan,
        html_escape(e.new_plan), or_dash<double>(e.total_pause_s, format_seconds),
        or_dash<double>(e.bytes_moved, format_bytes), or_dash<int64_t>(e.steps_lost, int_text),
        or_dash<double>(e.detection_s, format_seconds));
  }
  return s + "</table>\n";
}

std::string chart_section(std::string_view heading, std::string_view svg) {
  return fmt::format("<section><h2>{}</h2>\n{}</section>\n", html_escape(heading), svg);
}

}  // namespace

std::string html_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::vector<StepRecord> parse_metrics_lines(std::string_view text, const std::string& source) {
  std::vector<StepRecord> steps;
  for_each_json_line(text, source, [&](const Json& j, int64_t line) {
    StepRecord r;
    r.step = required_step(j, source, line);
    const auto loss = number_field(j, "loss");
    TESSEL_CHECK(loss.has_value(), CorruptDataError,
                 "{}:{}: the record has no \"loss\" (a number): {}; is this a metrics file "
                 "(output.metrics)?",
                 source, line, excerpt(j.dump()));
    r.loss = *loss;
    r.eval_loss = number_field(j, "eval_loss");
    r.tokens_per_s = number_field(j, "tokens_per_s");
    r.step_s = number_field(j, "step_s");
    r.time = number_field(j, "time");
    r.elapsed_s = number_field(j, "elapsed_s");
    r.workers = integer_field(j, "workers");
    r.cursor = integer_field(j, "cursor");
    r.model = text_field(j, "model");
    steps.push_back(std::move(r));
  });
  TESSEL_CHECK(!steps.empty(), CorruptDataError,
               "{} holds no step records{}: the run wrote no step yet, so there is nothing to "
               "report",
               source, text.empty() ? " (it is empty)" : "");
  return steps;
}

std::vector<RunEvent> parse_event_lines(std::string_view text, const std::string& source) {
  std::vector<RunEvent> events;
  for_each_json_line(text, source, [&](const Json& j, int64_t line) {
    RunEvent e;
    e.step = required_step(j, source, line);
    e.kind = text_field(j, "event");
    e.cause = text_field(j, "cause");
    e.old_workers = integer_field(j, "old_workers");
    e.new_workers = integer_field(j, "new_workers");
    e.old_plan = text_field(j, "old_plan");
    e.new_plan = text_field(j, "new_plan");
    e.total_pause_s = number_field(j, "total_pause_s");
    e.detection_s = number_field(j, "detection_s");
    e.bytes_moved = number_field(j, "bytes_moved");
    e.steps_lost = integer_field(j, "steps_lost");
    e.restored_from = text_field(j, "restored_from");
    e.lost = text_field(j, "lost");
    events.push_back(std::move(e));
  });
  return events;
}

std::string render_run_report(const RunRecords& run) {
  TESSEL_CHECK(!run.steps.empty(), InvalidArgumentError,
               "render_run_report: no step records to report on");
  std::vector<StepRecord> steps = run.steps;
  const size_t superseded = last_line_per_step(steps);
  const auto segments = plan_segments(steps, run.events);

  std::string page = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
      "<title>{0}</title>\n<style>{1}</style>\n</head>\n<body>\n<main>\n<h1>{0}</h1>\n",
      html_escape(run.title), kStyle);
  page += facts(run, steps);
  page += fmt::format(
      "<p class=\"note\">From {}{}.{}</p>\n", html_escape(run.metrics_source),
      run.events_source.empty() ? std::string(" (no events file)")
                                : " and " + html_escape(run.events_source),
      superseded == 0
          ? std::string()
          : fmt::format(" {} metrics line{} for steps already recorded (run "
                        "again after a recovery, or by a resumed run) replace "
                        "the earlier line{}.",
                        superseded, superseded == 1 ? "" : "s", superseded == 1 ? "" : "s"));
  if (!run.events.empty())
    page += fmt::format(
        "<p class=\"note key\">Markers: <span style=\"color:{}\"></span>reconfiguration "
        "<span style=\"color:{}\"></span>failure (recovery); hover a marker, a bar or a plan "
        "band for details.</p>\n",
        kReconfigureColour, kFailureColour);

  page += chart_section("Training loss", loss_chart(steps, run.events));
  page += chart_section("Throughput", rate_chart(steps, run.events));
  page += chart_section("Workers and plans", workers_chart(steps, run.events, segments));
  page += segments_table(segments);

  page += "<section><h2>Reconfigurations and failures</h2>\n";
  if (run.events.empty()) {
    page += "<p class=\"note\">No events: the run kept one plan throughout.</p>\n";
  } else {
    page += "<div class=\"pair\">\n<figure><figcaption>Pause per event (s)</figcaption>\n";
    page += event_bar_chart(
        run.events, "pause per event in seconds", "pause (s)", 1,
        [](const RunEvent& e) { return e.total_pause_s; },
        [](double v) { return format_seconds(v); });
    double most_bytes = 0;
    for (const auto& e : run.events) most_bytes = std::max(most_bytes, e.bytes_moved.value_or(0));
    const auto unit = byte_unit(most_bytes);
    page += fmt::format(
        "</figure>\n<figure><figcaption>Bytes moved between processes per event "
        "({})</figcaption>\n",
        unit.name);
    page += event_bar_chart(
        run.events, "bytes moved per event", fmt::format("moved ({})", unit.name), unit.divisor,
        [](const RunEvent& e) { return e.bytes_moved; }, [](double v) { return format_bytes(v); });
    page += "</figure>\n</div>\n";
    page += events_table(run.events);
  }
  page += "</section>\n</main>\n</body>\n</html>\n";
  return page;
}

}  // namespace tessel::cli
