// JSON from files (issue 26 #2): nesting is bounded before parsing, so a file nested 100,000
// levels deep is an error instead of a stack overflow; messages never echo a whole value.
#include "runtime/json.h"

#include <gtest/gtest.h>

#include <string>

namespace accel {
namespace {

std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

std::string error_of(const std::string& text) {
  try {
    parse_json(text, "x.json");
  } catch (const JsonError& e) {
    return e.what();
  }
  return "";
}

TEST(Json, DeepNestingIsRefusedBeforeParsing) {
  const std::string msg = error_of("{\"a\": " + nested(100000) + "}");
  EXPECT_NE(msg.find("x.json: JSON nests arrays/objects deeper than 256 levels"), std::string::npos)
      << msg;
  EXPECT_LT(msg.size(), 200u);
  EXPECT_NE(error_of(std::string(100000, '{')).find("deeper than"), std::string::npos);
  // At the limit it parses; brackets inside strings do not count.
  EXPECT_EQ(parse_json(nested(kMaxJsonDepth), "x").dump().size(), 2u * kMaxJsonDepth);
  EXPECT_EQ(parse_json("\"" + std::string(1000, '[') + "\\\"\"", "x").get<std::string>().size(),
            1001u);
  EXPECT_NE(error_of(nested(kMaxJsonDepth + 1)), "");
}

TEST(Json, InvalidJsonNamesTheSource) {
  EXPECT_NE(error_of("{\"a\": ").find("x.json: not valid JSON"), std::string::npos);
  try {
    read_json_file("/nonexistent/dir/f.json");
    FAIL();
  } catch (const JsonError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/f.json: cannot open"),
              std::string::npos);
  }
}

TEST(Json, ExcerptsAreShort) {
  nlohmann::json big = nlohmann::json::array();
  for (int i = 0; i < 100000; ++i) big.push_back(i);
  const std::string e = json_excerpt(big);
  EXPECT_EQ(e.size(), 80u);
  EXPECT_EQ(e.substr(e.size() - 3), "...");
  EXPECT_EQ(json_excerpt(nlohmann::json{1, 2}), "[1,2]");
  EXPECT_EQ(text_excerpt(std::string(1000, 'x'), 10), "xxxxxxx...");
}

}  // namespace
}  // namespace accel
