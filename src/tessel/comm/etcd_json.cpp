#include "tessel/comm/etcd_json.h"

#include <charconv>
#include <cstdint>
#include <string>

namespace tessel::comm {

std::optional<int64_t> gateway_integer(const nlohmann::json& object, const char* field) {
  const auto it = object.find(field);
  if (it == object.end() || it->is_null()) return 0;
  // nlohmann keeps a number above 2^63 - 1 as unsigned: read as int64 it would wrap negative.
  if (it->is_number_unsigned())
    return it->get<uint64_t>() <= uint64_t(INT64_MAX) ? std::optional<int64_t>(it->get<int64_t>())
                                                      : std::nullopt;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (!it->is_string()) return std::nullopt;
  const std::string& s = it->get_ref<const std::string&>();
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

}  // namespace tessel::comm
