// The format helpers the checkpoint writer and reader share (checkpoint_format.h), and the names
// of a checkpoint's files and staging directory (checkpoint_store.h).
#include "tessel/store/checkpoint_format.h"

#include <algorithm>

#include "tessel/core/check.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/store/checksum.h"

namespace tessel::store {

namespace detail {

using nlohmann::json;

std::string normalize_dir(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  TESSEL_CHECK(!dir.empty(), InvalidArgumentError, "checkpoint directory name is empty");
  return dir;
}

std::string tiling_problem(const Shape& shape, const std::vector<Box>& boxes) {
  const Box whole = Box::of(shape);
  int64_t volume = 0;
  for (size_t i = 0; i < boxes.size(); ++i) {
    if (boxes[i].rank() != shape.rank() || !whole.contains(boxes[i]))
      return fmt::format("piece {} lies outside the shape {}", boxes[i].str(), shape.str());
    volume += boxes[i].volume();
    for (size_t j = 0; j < i; ++j)
      if (!boxes[i].intersect(boxes[j]).empty())
        return fmt::format("pieces {} and {} overlap", boxes[j].str(), boxes[i].str());
  }
  if (volume != shape.numel())
    return fmt::format("its pieces cover {} of its {} elements", volume, shape.numel());
  return "";
}

uint64_t manifest_checksum(json m) {
  m.erase("checksum");
  const std::string text = m.dump();
  return xxh3(text.data(), text.size());
}

uint64_t json_u64(const json& v, const std::string& what) {
  if (!v.is_number_unsigned())
    TESSEL_THROW(CorruptDataError, "{} is not a non-negative integer", what);
  return v.get<uint64_t>();
}

std::string json_str(const json& obj, const char* key, const std::string& what) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_string())
    TESSEL_THROW(CorruptDataError, "{}: \"{}\" is missing or not a string", what, key);
  return it->get<std::string>();
}

DType json_dtype(const json& obj, const char* key, const std::string& what) {
  try {
    return parse_dtype(json_str(obj, key, what));
  } catch (const ConfigError& e) {
    TESSEL_THROW(CorruptDataError, "{}: {}", what, e.what());
  }
}

const json& json_field(const json& obj, const char* key, const std::string& what) {
  auto it = obj.find(key);
  if (it == obj.end()) TESSEL_THROW(CorruptDataError, "{}: \"{}\" is missing", what, key);
  return *it;
}

uint64_t json_hash(const json& obj, const char* key, const std::string& what) {
  auto h = parse_checksum_hex(json_str(obj, key, what));
  if (!h) TESSEL_THROW(CorruptDataError, "{}: \"{}\" is not 16 hex digits", what, key);
  return *h;
}

Box json_box(const json& v, const std::string& what) {
  if (!v.is_array()) TESSEL_THROW(CorruptDataError, "{}: box is not a list", what);
  std::vector<int64_t> lo, hi;
  for (const auto& r : v) {
    if (!r.is_array() || r.size() != 2 || !r[0].is_number_unsigned() || !r[1].is_number_unsigned())
      TESSEL_THROW(CorruptDataError, "{}: box {} is not a list of [lo, hi] pairs", what, v.dump());
    lo.push_back(int64_t(std::min<uint64_t>(r[0].get<uint64_t>(), uint64_t(1) << 62)));
    hi.push_back(int64_t(std::min<uint64_t>(r[1].get<uint64_t>(), uint64_t(1) << 62)));
  }
  return Box(std::move(lo), std::move(hi));
}

}  // namespace detail

std::string rank_file_name(int rank) {
  return fmt::format("rank-{:05d}.safetensors", rank);
}

std::optional<int> rank_of_file_name(std::string_view name) {
  constexpr std::string_view prefix = "rank-", suffix = ".safetensors";
  if (name.size() != prefix.size() + 5 + suffix.size() || !name.starts_with(prefix) ||
      !name.ends_with(suffix))
    return std::nullopt;
  int rank = 0;
  for (char c : name.substr(prefix.size(), 5)) {
    if (c < '0' || c > '9') return std::nullopt;
    rank = rank * 10 + (c - '0');
  }
  return rank;
}

std::string rank_failed_name(int rank) {
  return fmt::format("rank-{:05d}.failed", rank);
}

std::string staging_dir_for(const std::string& dir, const std::string& save_id) {
  return detail::normalize_dir(dir) + ".tmp-" + save_id;
}

}  // namespace tessel::store
