// Helpers the config tests share: config values as the YAML spells them, and the notices.
#pragma once

#include <string>
#include <type_traits>

#include "runtime/config.h"

namespace accel::config_test {

// A config value as the YAML spells it (enums through name_of), for comparisons with literals.
template <class T>
std::string spelled(const T& v) {
  if constexpr (std::is_enum_v<T>)
    return accel::name_of(v);
  else
    return v;
}

inline bool has_notice(const Config& c, const std::string& piece) {
  for (const auto& n : c.notices)
    if (n.find(piece) != std::string::npos) return true;
  return false;
}

inline std::string notices_text(const Config& c) {
  std::string s;
  for (const auto& n : c.notices) s += n + "\n";
  return s;
}

}  // namespace accel::config_test
