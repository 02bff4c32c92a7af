// What etcd's v3 JSON gateway looks like on the wire, for both its sides here: the client
// (etcd_store.h) and the embedded server that speaks it (store_server.h).
#pragma once

#include <cstdint>
#include <optional>

#include <nlohmann/json.hpp>

namespace tessel::comm {

// The gateway writes 64-bit integers as JSON strings and reads either; an absent or null field is
// 0. Nothing when the field holds anything else (each side names that in its own error).
std::optional<int64_t> gateway_integer(const nlohmann::json& object, const char* field);

}  // namespace tessel::comm
