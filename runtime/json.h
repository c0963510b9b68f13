// JSON read from files we do not control (checkpoints, Hugging Face folders, tokenizer.json,
// DeepSpeed configs): one place that bounds the nesting depth before nlohmann parses the text, and
// that cuts values down for error messages.
#pragma once

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>

namespace accel {

// Real files nest a few levels; nlohmann's destructor and dump() recurse once per level, so a
// file nested 100,000 deep would overflow the stack.
constexpr int kMaxJsonDepth = 256;

// Invalid JSON, JSON nested deeper than kMaxJsonDepth, or an unreadable file. what() starts with
// the source (a path) and says what is wrong; never echoes the text.
class JsonError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Parses `text`; `source` names it in errors ("config.json", a path).
nlohmann::json parse_json(std::string_view text, const std::string& source);
// Reads and parses a whole file.
nlohmann::json read_json_file(const std::string& path);
// `v` as JSON text for an error message, at most `max_chars` characters (cut with "...").
std::string json_excerpt(const nlohmann::json& v, size_t max_chars = 80);
// A string from a file (a key, a name) cut like json_excerpt, for quoting in a message.
std::string text_excerpt(const std::string& s, size_t max_chars = 80);

}  // namespace accel
