#include "runtime/json.h"

#include <fstream>
#include <sstream>

namespace accel {

namespace {

// Throws when arrays/objects nest deeper than kMaxJsonDepth. Brackets inside strings do not count;
// the text need not be valid (the parser judges that afterwards).
void check_depth(std::string_view text, const std::string& source) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth)
        throw JsonError(source + ": JSON nests arrays/objects deeper than " +
                        std::to_string(kMaxJsonDepth) + " levels (at byte " + std::to_string(i) +
                        "); the file is corrupt or hostile");
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
}

}  // namespace

nlohmann::json parse_json(std::string_view text, const std::string& source) {
  check_depth(text, source);
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::parse_error& e) {
    throw JsonError(source + ": not valid JSON (" + e.what() + ")");
  }
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw JsonError(path + ": cannot open the file");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw JsonError(path + ": read error");
  return parse_json(ss.str(), path);
}

std::string text_excerpt(const std::string& s, size_t max_chars) {
  if (s.size() <= max_chars) return s;
  return s.substr(0, max_chars > 3 ? max_chars - 3 : 0) + "...";
}

std::string json_excerpt(const nlohmann::json& v, size_t max_chars) {
  return text_excerpt(v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), max_chars);
}

}  // namespace accel
