// What the command-line tools share around CLI11.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>

namespace accel {

// Parses argv into `app`. An exit code when the tool should stop now (0 after --help, 2 for a
// usage error, which CLI11 has printed), nothing when it should go on.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return std::nullopt;
}

}  // namespace accel
