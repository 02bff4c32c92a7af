#include "tessel/model/recompute.h"

#include "tessel/core/check.h"

namespace tessel::model {

std::string_view recompute_name(Recompute r) {
  switch (r) {
    case Recompute::none:
      return "none";
    case Recompute::selective:
      return "selective";
    case Recompute::full:
      return "full";
  }
  return "?";
}

Recompute parse_recompute(std::string_view name) {
  for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
    if (name == recompute_name(r)) return r;
  }
  TESSEL_THROW(ConfigError, "unknown activation recompute mode '{}' (known: none, selective, full)",
               name);
}

}  // namespace tessel::model
