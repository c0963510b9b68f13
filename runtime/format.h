// Human-readable sizes for log lines and reports.
#pragma once

#include <cstdint>
#include <string>

namespace accel {

std::string format_bytes(int64_t bytes);  // "1.5 GiB", "512 B"

}  // namespace accel
