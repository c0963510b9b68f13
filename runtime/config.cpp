#include "runtime/config.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>

#include "runtime/json.h"
#include "runtime/tensor.h"
#include "runtime/training_args.h"

extern char** environ;

namespace accel {

namespace {

namespace fs = std::filesystem;

// ---- small text helpers -----------------------------------------------------------------------

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

std::string upper(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return s;
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : s) {
    if (ch == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  out.push_back(cur);
  return out;
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

bool parses_as_number(const std::string& s) {
  if (s.empty()) return false;
  const char* b = s.c_str();
  char* e = nullptr;
  std::strtod(b, &e);
  return e == b + s.size();
}

// A string as a double-quoted YAML scalar, with escapes.
std::string double_quoted(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (ch < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\x%02x", ch);
          out += buf;
        } else {
          out += static_cast<char>(ch);
        }
    }
  }
  return out + "\"";
}

// A string as a YAML scalar: plain when it cannot be read as anything else (a boolean, a number,
// null, or YAML syntax), double-quoted otherwise. Accelerate's `mixed_precision: 'no'` stays a
// string for every YAML reader this way.
std::string yaml_quote(const std::string& s) {
  static const std::set<std::string> kReserved = {"true", "false", "yes",  "no", "on",   "off",
                                                  "y",    "n",     "null", "~",  ".inf", ".nan"};
  bool plain = !s.empty() && !kReserved.count(lower(s)) && !parses_as_number(s) && s[0] != '-' &&
               s[0] != '.';
  for (char ch : s)
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '.' || ch == '/' ||
          ch == '-'))
      plain = false;
  return plain ? s : double_quoted(s);
}

// Shortest text that reads back as the same double, always recognisably a float ("1.0",
// "0.0003", "1.0e-08").
std::string fmt_double(double v) {
  char buf[64];
  const double a = std::fabs(v);
  if (v == 0 || (a >= 1e-4 && a < 1e15)) {
    for (int d = 0; d <= 20; ++d) {
      std::snprintf(buf, sizeof buf, "%.*f", d, v);
      if (std::strtod(buf, nullptr) == v) break;
    }
    std::string s = buf;
    if (s.find('.') == std::string::npos) s += ".0";
    return s;
  }
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  size_t e = s.find('e');
  if (e != std::string::npos && s.find('.') == std::string::npos) s.insert(e, ".0");
  return s;
}

std::string fmt_bool(bool b) { return b ? "true" : "false"; }

std::string fmt_list(const std::vector<std::string>& v) {
  std::vector<std::string> q;
  for (const auto& s : v) q.push_back(yaml_quote(s));
  return "[" + join(q, ", ") + "]";
}

// A node as one line of YAML flow text, appended to `out`. Scalars keep their form: quoted in the
// source ('no') stays quoted, plain (false, 1024) stays plain unless it would not read back. Stops
// once `out` is longer than `max_chars`, so YAML aliases (a node repeated by reference, which can
// stand for exponentially many nodes) are never expanded past what is printed.
void flow_into(const YAML::Node& n, std::string& out, size_t max_chars) {
  if (out.size() > max_chars) return;
  if (!n.IsDefined() || n.IsNull()) {
    out += "null";
    return;
  }
  if (n.IsScalar()) {
    const std::string& s = n.Scalar();
    if (n.Tag() == "!") {
      out += double_quoted(s);
      return;
    }
    bool plain =
        !s.empty() && s.front() != ' ' && s.back() != ' ' && (s[0] != '-' || parses_as_number(s));
    for (char ch : s)
      if (!(std::isalnum(static_cast<unsigned char>(ch)) ||
            std::string("_./+-~ ").find(ch) != std::string::npos))
        plain = false;
    out += plain ? s : double_quoted(s);
    return;
  }
  const bool seq = n.IsSequence();
  out += seq ? "[" : "{";
  bool first = true;
  for (auto it = n.begin(); it != n.end() && out.size() <= max_chars; ++it) {
    if (!first) out += ", ";
    first = false;
    if (seq) {
      flow_into(*it, out, max_chars);
    } else {
      flow_into(it->first, out, max_chars);
      out += ": ";
      flow_into(it->second, out, max_chars);
    }
  }
  out += seq ? "]" : "}";
}

std::string flow(const YAML::Node& n) {
  std::string out;
  flow_into(n, out, std::string::npos - 1);
  return out;
}

// Records where the documents of a YAML stream start (YAML::Parser events; the content is not
// built): enough to tell a second document from the first.
struct DocumentStarts : YAML::EventHandler {
  int count = 0;
  YAML::Mark second;
  void OnDocumentStart(const YAML::Mark& mark) override {
    if (++count == 2) second = mark;
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

// What a value stands for once its aliases are expanded: nodes, bytes of scalar text and levels
// of nesting, counted while walking and stopping as soon as one passes its bound (a chain of
// aliases, or many aliases of one long scalar, stands for exponentially or quadratically more
// than the file; a chain of N anchors nests N deep; an alias inside its own anchor's value,
// `&a [*a]`, is a cycle).
struct Expansion {
  size_t nodes = 0, bytes = 0;
};
constexpr size_t kMaxKeptValueNodes = 10000, kMaxKeptValueBytes = 1 << 20, kMaxKeptValueDepth = 100;

// A loop over an explicit stack, not recursion: 10,000 nested calls over a cycle overflowed the
// stack under AddressSanitizer (fuzz_config). Every node on the stack will be counted, so the
// walk stops as soon as the counted and the waiting ones together pass the bound.
bool expands_past_bounds(const YAML::Node& root, Expansion& e) {
  std::vector<std::pair<YAML::Node, size_t>> todo{{root, 1}};  // node, its depth
  auto push = [&](const YAML::Node& n, size_t depth) {
    todo.emplace_back(n, depth);
    return depth > kMaxKeptValueDepth || e.nodes + todo.size() > kMaxKeptValueNodes;
  };
  while (!todo.empty()) {
    const auto [n, depth] = todo.back();
    todo.pop_back();
    ++e.nodes;
    if (n.IsScalar()) {
      if ((e.bytes += n.Scalar().size()) > kMaxKeptValueBytes) return true;
    } else if (n.IsSequence()) {
      for (const auto& child : n)
        if (push(child, depth + 1)) return true;
    } else if (n.IsMap()) {
      for (const auto& kv : n)
        if (push(kv.first, depth + 1) || push(kv.second, depth + 1)) return true;
    }
  }
  return false;
}

[[noreturn]] void fail(const std::string& where, const std::string& msg) {
  throw ConfigError(where + ": " + msg);
}

// Values that are walked whole (kept keys, training_args) must stay small once expanded.
void require_small_expansion(const YAML::Node& v, const std::string& where, const std::string& path,
                             const std::string& why) {
  Expansion e;
  if (expands_past_bounds(v, e))
    fail(where, path + ": the value stands for more than " + std::to_string(kMaxKeptValueNodes) +
                    " YAML nodes, " + std::to_string(kMaxKeptValueBytes >> 20) +
                    " MiB of text or " + std::to_string(kMaxKeptValueDepth) +
                    " levels of nesting once its aliases (*name) are expanded; " + why +
                    ", so give it a small value without alias chains");
}

// What a wrong value looked like, for messages.
std::string describe(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "nothing (null)";
  if (n.IsScalar()) {
    const std::string& s = n.Scalar();
    // Cut first (a huge value is never copied whole); a cut may split a UTF-8 sequence.
    return nlohmann::json(s.size() > 60 ? s.substr(0, 57) + "..." : s)
        .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  std::string f;
  flow_into(n, f, 60);
  if (f.size() > 60) f = f.substr(0, 57) + "...";
  return (n.IsSequence() ? "a list " : "a map ") + f;
}

// Optimal-string-alignment distance: insertions, deletions, substitutions and adjacent
// transpositions ("stpes" for "steps") each cost one.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min(
          {d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

// ---- the schema -------------------------------------------------------------------------------

enum class LayerKind { File, Env, Set };

struct Applier;
void apply_training_args(Applier& a, const YAML::Node& v, const std::string& where,
                         const std::string& file);

// What a setter knows about the value it parses.
struct Ctx {
  std::string path;   // the key as written ("fp8_config.amax_history_length")
  std::string where;  // "x.yaml:12", "environment variable ACCEL_X", "--set a=b"
  LayerKind kind;
  std::string base_dir;  // directory of the file being read ("" for env / --set)
  Applier* applier;
};

[[noreturn]] void type_error(const Ctx& c, const std::string& expected, const YAML::Node& n) {
  fail(c.where, c.path + ": expected " + expected + ", got " + describe(n));
}

const std::string& need_scalar(const Ctx& c, const YAML::Node& n, const std::string& expected) {
  if (!n.IsScalar()) type_error(c, expected, n);
  return n.Scalar();
}

int64_t parse_int(const Ctx& c, const YAML::Node& n, int64_t lo, int64_t hi) {
  std::string expected = "an integer";
  if (lo == hi) {
    expected += " equal to " + std::to_string(lo);
  } else if (lo > std::numeric_limits<int64_t>::min() && hi < std::numeric_limits<int64_t>::max()) {
    expected += " in " + std::to_string(lo) + ".." + std::to_string(hi);
  } else if (lo > std::numeric_limits<int64_t>::min()) {
    expected += " >= " + std::to_string(lo);
  }
  std::string s = trim(need_scalar(c, n, expected));
  const char* b = s.c_str();
  char* e = nullptr;
  errno = 0;
  long long v = std::strtoll(b, &e, 10);
  bool ok = !s.empty() && e == b + s.size() && errno == 0;
  if (!ok) {
    // Integral values written as floats ("1e8", "1024.0") are accepted.
    errno = 0;
    double d = std::strtod(b, &e);
    if (!s.empty() && e == b + s.size() && errno == 0 && std::isfinite(d) && d == std::floor(d) &&
        std::fabs(d) < 9.2e18) {
      v = static_cast<long long>(d);
      ok = true;
    }
  }
  if (!ok || v < lo || v > hi) type_error(c, expected, n);
  return v;
}

uint64_t parse_u64(const Ctx& c, const YAML::Node& n) {
  std::string s = trim(need_scalar(c, n, "a non-negative integer"));
  const char* b = s.c_str();
  char* e = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(b, &e, 10);
  bool ok = !s.empty() && s[0] != '-' && e == b + s.size() && errno == 0;
  if (!ok) {
    // Integral values written as floats ("1e3"), as parse_int accepts them.
    errno = 0;
    double d = std::strtod(b, &e);
    if (!s.empty() && e == b + s.size() && errno == 0 && d >= 0 && d == std::floor(d) &&
        d < 1.8e19) {
      v = static_cast<unsigned long long>(d);
      ok = true;
    }
  }
  if (!ok) type_error(c, "a non-negative integer", n);
  return v;
}

double parse_double(const Ctx& c, const YAML::Node& n, double lo, double hi, bool lo_open,
                    bool hi_open = false) {
  std::string expected = "a number";
  if (lo_open)
    expected += " > " + fmt_double(lo);
  else if (lo > -std::numeric_limits<double>::infinity())
    expected += " >= " + fmt_double(lo);
  if (hi < std::numeric_limits<double>::infinity())
    expected += std::string(expected == "a number" ? " " : " and ") + (hi_open ? "< " : "<= ") +
                fmt_double(hi);
  std::string s = trim(need_scalar(c, n, expected));
  const char* b = s.c_str();
  char* e = nullptr;
  errno = 0;
  double v = std::strtod(b, &e);
  if (s.empty() || e != b + s.size() || errno == ERANGE || !std::isfinite(v))
    type_error(c, expected, n);
  if (v < lo || (lo_open && v == lo) || v > hi || (hi_open && v == hi)) type_error(c, expected, n);
  return v;
}

// The boolean a spelling stands for (any case), if it is one.
std::optional<bool> boolean_spelling(const std::string& text) {
  const std::string s = lower(trim(text));
  if (s == "true" || s == "yes" || s == "on" || s == "1") return true;
  if (s == "false" || s == "no" || s == "off" || s == "0") return false;
  return std::nullopt;
}

bool parse_bool(const Ctx& c, const YAML::Node& n) {
  const std::optional<bool> b = boolean_spelling(need_scalar(c, n, "a boolean (true or false)"));
  if (!b) type_error(c, "a boolean (true or false)", n);
  return *b;
}

// Case-insensitive match against `choices`; returns the canonical spelling.
std::string parse_enum(const Ctx& c, const YAML::Node& n, const std::vector<std::string>& choices) {
  std::string expected = "one of " + join(choices, ", ");
  std::string s = trim(need_scalar(c, n, expected));
  for (const auto& ch : choices)
    if (lower(ch) == lower(s)) return ch;
  type_error(c, expected, n);
}

// A list of strings. Files may give one string for a one-element list; environment variables and
// --set give "[a, b]" (YAML flow) or "a,b".
std::vector<std::string> parse_str_list(const Ctx& c, const YAML::Node& n) {
  const std::string expected = "a list of strings";
  YAML::Node v = n;
  if (n.IsScalar() && c.kind != LayerKind::File) {
    std::string s = trim(n.Scalar());
    if (s.empty()) return {};
    if (s[0] == '[') {
      try {
        v = YAML::Load(s);
      } catch (const YAML::Exception&) {
        type_error(c, expected, n);
      }
    } else {
      std::vector<std::string> out;
      for (auto& p : split(s, ',')) out.push_back(trim(p));
      return out;
    }
  }
  if (v.IsScalar()) return {v.Scalar()};
  if (!v.IsSequence()) type_error(c, expected, n);
  std::vector<std::string> out;
  size_t bytes = 0;  // aliases of one long string could stand for far more than the file
  for (const auto& e : v) {
    if (!e.IsScalar()) type_error(c, expected, n);
    if ((bytes += e.Scalar().size()) > kMaxKeptValueBytes)
      fail(c.where, c.path + ": the list holds more than " +
                        std::to_string(kMaxKeptValueBytes >> 20) + " MiB of text");
    out.push_back(e.Scalar());
  }
  return out;
}

using Setter = std::function<void(Config&, const YAML::Node&, Ctx&)>;
using Getter = std::function<std::string(const Config&)>;

struct Field {
  std::string path, type, doc;
  Setter set;
  Getter get;         // value as YAML text; null for inert keys
  std::string group;  // canonical key of a set of spellings / mirrored keys ("" = none)
  bool accelerate = false, inert = false, alias = false;
  std::string why;                   // inert: why it has no effect
  std::vector<std::string> neutral;  // inert: values (lower case) that do nothing: no notice
  bool always_neutral = false;       // inert: never worth a notice
};

// Accessor for a member of Config given as `section.member` (works on const and non-const).
#define ACCEL_REF(member) \
  [](auto& c) -> auto& { return c.member; }

template <class A>
Field f_int(std::string path, A acc, int64_t lo, int64_t hi, std::string doc) {
  Field f;
  f.path = std::move(path);
  f.type = "integer";
  f.doc = std::move(doc);
  f.set = [acc, lo, hi](Config& c, const YAML::Node& n, Ctx& ctx) {
    auto& r = acc(c);
    r = static_cast<std::decay_t<decltype(r)>>(parse_int(ctx, n, lo, hi));
  };
  f.get = [acc](const Config& c) { return std::to_string(acc(c)); };
  return f;
}

template <class A>
Field f_double(std::string path, A acc, double lo, double hi, bool lo_open, std::string doc,
               bool hi_open = false) {
  Field f;
  f.path = std::move(path);
  f.type = "number";
  f.doc = std::move(doc);
  f.set = [acc, lo, hi, lo_open, hi_open](Config& c, const YAML::Node& n, Ctx& ctx) {
    acc(c) = parse_double(ctx, n, lo, hi, lo_open, hi_open);
  };
  f.get = [acc](const Config& c) { return fmt_double(acc(c)); };
  return f;
}

template <class A>
Field f_bool(std::string path, A acc, std::string doc) {
  Field f;
  f.path = std::move(path);
  f.type = "boolean";
  f.doc = std::move(doc);
  f.set = [acc](Config& c, const YAML::Node& n, Ctx& ctx) { acc(c) = parse_bool(ctx, n); };
  f.get = [acc](const Config& c) { return fmt_bool(acc(c)); };
  return f;
}

template <class A>
Field f_str(std::string path, A acc, std::string doc) {
  Field f;
  f.path = std::move(path);
  f.type = "string";
  f.doc = std::move(doc);
  f.set = [acc](Config& c, const YAML::Node& n, Ctx& ctx) {
    acc(c) = need_scalar(ctx, n, "a string");
  };
  f.get = [acc](const Config& c) { return yaml_quote(acc(c)); };
  return f;
}

template <class A>
Field f_enum(std::string path, A acc, std::vector<std::string> choices, std::string doc) {
  Field f;
  f.path = std::move(path);
  f.type = "one of: " + join(choices, ", ");
  f.doc = std::move(doc);
  f.set = [acc, choices](Config& c, const YAML::Node& n, Ctx& ctx) {
    acc(c) = parse_enum(ctx, n, choices);
  };
  f.get = [acc](const Config& c) { return yaml_quote(acc(c)); };
  return f;
}

// An enum-typed member: its choices are EnumNames<E>, parsed once into E.
template <class A>
Field f_enum(std::string path, A acc, std::string doc) {
  using E = std::decay_t<decltype(acc(std::declval<Config&>()))>;
  const std::vector<std::string> choices(std::begin(EnumNames<E>::names),
                                         std::end(EnumNames<E>::names));
  Field f;
  f.path = std::move(path);
  f.type = "one of: " + join(choices, ", ");
  f.doc = std::move(doc);
  f.set = [acc, choices](Config& c, const YAML::Node& n, Ctx& ctx) {
    const std::string v = parse_enum(ctx, n, choices);
    acc(c) = static_cast<E>(std::find(choices.begin(), choices.end(), v) - choices.begin());
  };
  f.get = [acc](const Config& c) { return yaml_quote(name_of(acc(c))); };
  return f;
}

template <class A>
Field f_list(std::string path, A acc, std::string doc) {
  Field f;
  f.path = std::move(path);
  f.type = "list of strings";
  f.doc = std::move(doc);
  f.set = [acc](Config& c, const YAML::Node& n, Ctx& ctx) { acc(c) = parse_str_list(ctx, n); };
  f.get = [acc](const Config& c) { return fmt_list(acc(c)); };
  return f;
}

template <class A>
Field f_int_list(std::string path, A acc, int64_t lo, std::string doc) {
  Field f;
  f.path = std::move(path);
  f.type = "list of integers";
  f.doc = std::move(doc);
  f.set = [acc, lo](Config& c, const YAML::Node& n, Ctx& ctx) {
    std::vector<int64_t> values;
    for (const std::string& s : parse_str_list(ctx, n))
      values.push_back(parse_int(ctx, YAML::Node(s), lo, std::numeric_limits<int64_t>::max()));
    acc(c) = values;
  };
  f.get = [acc](const Config& c) {
    std::string out = "[";
    for (size_t i = 0; i < acc(c).size(); ++i) out += (i ? ", " : "") + std::to_string(acc(c)[i]);
    return out + "]";
  };
  return f;
}

Field inert(std::string path, std::string why, std::vector<std::string> neutral = {}) {
  Field f;
  f.path = std::move(path);
  f.type = "any";
  f.inert = true;
  f.accelerate = true;
  f.why = std::move(why);
  f.neutral = std::move(neutral);
  f.doc = "Accepted and kept; no effect in accel-train (" + f.why + ").";
  return f;
}

Field acc_(Field f) {
  f.accelerate = true;
  return f;
}

Field grouped(Field f, std::string group, bool alias) {
  f.group = std::move(group);
  f.alias = alias;
  return f;
}

const std::vector<std::string> kSections = {
    "fsdp_config", "deepspeed_config", "fp8_config", "model",      "training", "optimizer",
    "data",        "checkpoint",       "logging",    "distributed"};

bool is_section(const std::string& p) {
  return std::find(kSections.begin(), kSections.end(), p) != kSections.end();
}

void apply_deepspeed_json(Config& c, const std::string& file, Ctx& ctx);

}  // namespace

std::string hf_class_prefix(const std::string& model_name) {
  if (model_name == "qwen2") return "Qwen2";
  if (model_name == "qwen3") return "Qwen3";
  if (model_name == "mistral") return "Mistral";
  if (model_name == "qwen3_moe") return "Qwen3Moe";
  if (model_name == "mixtral") return "Mixtral";
  return "Llama";
}

namespace {

// A YAML scalar as the JSON value it spells (config.json's types): true/false, null, an integer,
// a number, else a string.
nlohmann::json yaml_scalar_json(const std::string& raw) {
  const std::string text = trim(raw);
  if (text == "true" || text == "false") return text == "true";
  if (text == "null" || text == "~" || text.empty()) return nullptr;
  const char* b = text.c_str();
  char* e = nullptr;
  errno = 0;
  const long long i = std::strtoll(b, &e, 10);
  if (e == b + text.size() && errno == 0) return static_cast<int64_t>(i);
  errno = 0;
  const double d = std::strtod(b, &e);
  if (e == b + text.size() && errno == 0 && std::isfinite(d)) return d;
  return raw;
}

std::vector<Field> build_schema() {
  std::vector<Field> s;
  auto add = [&](Field f) { s.push_back(std::move(f)); };

  // ---- Accelerate top level ----
  add(acc_(f_enum("compute_environment", ACCEL_REF(compute_environment), {"LOCAL_MACHINE"},
                  "Where the job runs. Only LOCAL_MACHINE (your machines, launched by mpirun or "
                  "accel-train itself); AMAZON_SAGEMAKER is not supported.")));
  add(acc_(f_enum("distributed_type", ACCEL_REF(distributed_type),
                  "Data-parallel strategy: NO (one process), MULTI_CPU / MULTI_GPU (DDP), FSDP "
                  "(fsdp_config), DEEPSPEED (ZeRO, deepspeed_config).")));
  add(acc_(f_enum("mixed_precision", ACCEL_REF(mixed_precision),
                  "Compute precision: no (fp32), fp16 (with dynamic loss scaling), bf16, fp8 "
                  "(fp8_config). Master weights and optimizer state are fp32 unless "
                  "optimizer.master_weights / optimizer.state_dtype say bf16.")));
  add(acc_(f_int("num_processes", ACCEL_REF(num_processes), 1, std::numeric_limits<int64_t>::max(),
                 "Total processes over all machines (one per GPU); must equal the launched "
                 "world size.")));
  add(acc_(f_int("num_machines", ACCEL_REF(num_machines), 1, std::numeric_limits<int64_t>::max(),
                 "Number of machines.")));
  add(acc_(f_int("machine_rank", ACCEL_REF(machine_rank), 0, std::numeric_limits<int64_t>::max(),
                 "This machine's index, 0..num_machines-1 (the launcher's environment wins when "
                 "it says otherwise).")));
  add(grouped(acc_(f_int("gradient_accumulation_steps", ACCEL_REF(gradient_accumulation_steps), 1,
                         std::numeric_limits<int64_t>::max(), "Micro-batches per optimizer step.")),
              "gradient_accumulation_steps", false));
  add(acc_(f_str("main_process_ip", ACCEL_REF(main_process_ip),
                 "Address of rank 0's rendezvous store (MASTER_ADDR overrides).")));
  add(acc_(f_int("main_process_port", ACCEL_REF(main_process_port), 1, 65535,
                 "Port of rank 0's rendezvous store (MASTER_PORT overrides).")));
  add(acc_(f_bool("use_cpu", ACCEL_REF(use_cpu),
                  "Train on the CPU even when GPUs are present (sets training.device: cpu).")));
  {
    Field f;
    f.path = "gpu_ids";
    f.type = "string";
    f.accelerate = true;
    f.doc =
        "GPUs this machine may use: all, or a comma list such as \"0,1\" (a YAML list [0, 1] "
        "in a file; local rank r uses the r-th id).";
    f.set = [](Config& c, const YAML::Node& n, Ctx& ctx) {
      const std::string expected = "all or a comma-separated list of GPU ids such as \"0,1\"";
      std::vector<std::string> ids;
      if (n.IsSequence()) {
        for (const auto& e : n) {
          if (!e.IsScalar()) type_error(ctx, expected, n);
          ids.push_back(trim(e.Scalar()));
        }
      } else {
        std::string s = trim(need_scalar(ctx, n, expected));
        if (lower(s) == "all" || s.empty()) {
          c.gpu_ids = "all";
          return;
        }
        for (auto& p : split(s, ',')) ids.push_back(trim(p));
      }
      for (auto& id : ids) {
        char* e = nullptr;
        long v = std::strtol(id.c_str(), &e, 10);
        if (id.empty() || *e != '\0' || v < 0) type_error(ctx, expected, n);
      }
      c.gpu_ids = join(ids, ",");
    };
    f.get = [](const Config& c) { return yaml_quote(c.gpu_ids); };
    add(f);
  }
  add(inert("main_training_function", "accel-train runs its own training loop", {"main"}));
  add(inert("downcast_bf16", "a TPU-only setting"));
  add(inert("rdzv_backend",
            "ranks meet through accel-train's own TCP store at main_process_ip:main_process_port",
            {"static"}));
  {
    Field f = inert("same_network", "multi-node rendezvous always goes through main_process_ip");
    f.always_neutral = true;
    add(f);
  }
  add(inert("enable_cpu_affinity",
            "CPU/NUMA binding is left to the launcher, e.g. mpirun "
            "--bind-to"));
  add(inert("debug", "accel-train has no separate debug mode"));
  for (const char* k : {"tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_env",
                        "tpu_vm", "command_file", "commands"})
    add(inert(k, "TPUs are not supported"));
  add(inert("dynamo_config", "torch.compile is not used; the kernels are fused by hand"));
  add(inert("megatron_lm_config", "Megatron-LM is not used; distributed_type picks the strategy"));
  add(inert("ipex_config", "Intel Extension for PyTorch is not used"));
  add(inert("mpirun_config",
            "accel-train is started by mpirun directly: mpirun -np N accel-train --config ..."));
  add(inert("tp_config", "tensor parallelism is not implemented; tp_size above 1 is rejected"));
  add(inert("parallelism_config",
            "only data parallelism (distributed_type) is implemented; tensor and context "
            "parallel sizes above 1 are rejected"));

  // ---- fsdp_config ----
  add(acc_(
      f_int("fsdp_config.fsdp_version", ACCEL_REF(fsdp.fsdp_version), 1, 2,
            "2: per-parameter (dim-0) sharding as in PyTorch FSDP2. 1 is accepted and runs the "
            "same FSDP2-style sharding (with a notice).")));
  {
    Field f;
    f.path = "fsdp_config.fsdp_reshard_after_forward";
    f.type = "boolean";
    f.accelerate = true;
    f.group = f.path;
    f.doc =
        "Free gathered parameters after each unit's forward and gather them again in backward "
        "(FULL_SHARD); false keeps them until backward (SHARD_GRAD_OP). FSDP1 strategy names "
        "are accepted too.";
    f.set = [](Config& c, const YAML::Node& n, Ctx& ctx) {
      if (n.IsScalar()) {
        std::string s = upper(trim(n.Scalar()));
        if (s == "FULL_SHARD") {
          c.fsdp.fsdp_reshard_after_forward = true;
          return;
        }
        if (s == "SHARD_GRAD_OP") {
          c.fsdp.fsdp_reshard_after_forward = false;
          return;
        }
        if (s == "NO_SHARD" || s == "HYBRID_SHARD" || s == "HYBRID_SHARD_ZERO2")
          fail(ctx.where, ctx.path + ": " + s +
                              " is not supported (use true/FULL_SHARD or false/SHARD_GRAD_OP; "
                              "for no sharding use distributed_type: MULTI_GPU)");
      }
      c.fsdp.fsdp_reshard_after_forward = parse_bool(ctx, n);
    };
    f.get = [](const Config& c) { return fmt_bool(c.fsdp.fsdp_reshard_after_forward); };
    add(f);
  }
  {
    Field f;
    f.path = "fsdp_config.fsdp_sharding_strategy";
    f.type = "one of: FULL_SHARD, SHARD_GRAD_OP (or 1, 2)";
    f.accelerate = true;
    f.alias = true;
    f.group = "fsdp_config.fsdp_reshard_after_forward";
    f.doc =
        "FSDP1 spelling of fsdp_reshard_after_forward: FULL_SHARD (1) = true, SHARD_GRAD_OP "
        "(2) = false. NO_SHARD (3) and HYBRID_SHARD* (4, 5) are rejected.";
    f.set = [](Config& c, const YAML::Node& n, Ctx& ctx) {
      std::string s = upper(trim(need_scalar(ctx, n, "FULL_SHARD or SHARD_GRAD_OP")));
      if (s == "FULL_SHARD" || s == "1") {
        c.fsdp.fsdp_reshard_after_forward = true;
      } else if (s == "SHARD_GRAD_OP" || s == "2") {
        c.fsdp.fsdp_reshard_after_forward = false;
      } else if (s == "NO_SHARD" || s == "3") {
        fail(ctx.where, ctx.path +
                            ": NO_SHARD is plain data parallelism: use distributed_type: "
                            "MULTI_GPU instead of FSDP");
      } else if (s == "HYBRID_SHARD" || s == "HYBRID_SHARD_ZERO2" || s == "4" || s == "5") {
        fail(ctx.where, ctx.path + ": hybrid sharding (" + s +
                            ") is not implemented; use FULL_SHARD or SHARD_GRAD_OP");
      } else {
        type_error(ctx, "one of FULL_SHARD, SHARD_GRAD_OP (or 1, 2)", n);
      }
    };
    add(f);
  }
  add(grouped(acc_(f_bool("fsdp_config.fsdp_offload_params", ACCEL_REF(fsdp.fsdp_offload_params),
                          "Keep parameter shards, gradients and optimizer state in host memory; "
                          "the optimizer steps on the CPU.")),
              "fsdp_config.fsdp_offload_params", false));
  add(grouped(acc_(f_bool("fsdp_config.fsdp_cpu_offload", ACCEL_REF(fsdp.fsdp_offload_params),
                          "The spelling Transformers' docs use for fsdp_offload_params.")),
              "fsdp_config.fsdp_offload_params", true));
  add(acc_(f_bool("fsdp_config.fsdp_activation_checkpointing",
                  ACCEL_REF(fsdp.fsdp_activation_checkpointing),
                  "Recompute each decoder layer's activations in backward (true: "
                  "training.activation_checkpointing full unless that key chose a mode).")));
  add(acc_(f_bool("fsdp_config.fsdp_cpu_ram_efficient_loading",
                  ACCEL_REF(fsdp.fsdp_cpu_ram_efficient_loading),
                  "FSDP with model.init_from: only rank 0 reads the weight files; setup "
                  "broadcasts each unit from rank 0 and every rank keeps its shard.")));
  add(acc_(f_enum("fsdp_config.fsdp_auto_wrap_policy", ACCEL_REF(fsdp.fsdp_auto_wrap_policy),
                  "How parameters are grouped into units (one all-gather each): per decoder layer, "
                  "by fsdp_min_num_params, or the whole model as one unit.")));
  {
    Field f = acc_(f_str("fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                         ACCEL_REF(fsdp.fsdp_transformer_layer_cls_to_wrap),
                         "Layer class(es) that form units under TRANSFORMER_BASED_WRAP (comma "
                         "list or YAML list). The unit is always the model family's decoder "
                         "layer (LlamaDecoderLayer, Qwen3DecoderLayer, ...); other names given "
                         "here get a notice."));
    f.set = [](Config& c, const YAML::Node& n, Ctx& ctx) {
      if (n.IsSequence()) {
        c.fsdp.fsdp_transformer_layer_cls_to_wrap = join(parse_str_list(ctx, n), ",");
      } else {
        c.fsdp.fsdp_transformer_layer_cls_to_wrap =
            trim(need_scalar(ctx, n, "a class name or comma list"));
      }
    };
    add(f);
  }
  add(acc_(f_enum("fsdp_config.fsdp_state_dict_type", ACCEL_REF(fsdp.fsdp_state_dict_type),
                  "Checkpoints: one file of shards per rank plus a manifest, or one full Hugging "
                  "Face model.safetensors written by rank 0.")));
  add(acc_(f_int("fsdp_config.fsdp_min_num_params", ACCEL_REF(fsdp.fsdp_min_num_params), 0,
                 std::numeric_limits<int64_t>::max(),
                 "SIZE_BASED_WRAP: smallest parameter count of a unit.")));
  add(inert("fsdp_config.fsdp_sync_module_states",
            "parameters are always made identical across ranks at start", {"true"}));
  add(inert("fsdp_config.fsdp_use_orig_params",
            "parameters always keep their own names and shapes (FSDP2 style)", {"true"}));
  add(inert("fsdp_config.fsdp_forward_prefetch",
            "the next unit's all-gather is always prefetched in forward", {"true"}));
  add(inert("fsdp_config.fsdp_backward_prefetch",
            "the next unit's all-gather is always prefetched in backward", {"backward_pre"}));
  add(inert("fsdp_config.fsdp_backward_prefetch_policy",
            "the next unit's all-gather is always prefetched in backward", {"backward_pre"}));

  // ---- deepspeed_config ----
  add(acc_(f_int("deepspeed_config.zero_stage", ACCEL_REF(deepspeed.zero_stage), 0, 3,
                 "ZeRO stage: 1 partitions optimizer state, 2 also gradients, 3 also parameters. "
                 "0 is rejected (use MULTI_GPU).")));
  add(acc_(f_enum("deepspeed_config.offload_optimizer_device",
                  ACCEL_REF(deepspeed.offload_optimizer_device),
                  "cpu keeps optimizer state in host memory and steps there; nvme is rejected.")));
  add(acc_(f_enum("deepspeed_config.offload_param_device",
                  ACCEL_REF(deepspeed.offload_param_device),
                  "cpu keeps ZeRO-3 parameter partitions in host memory (stage 3 only); nvme is "
                  "rejected.")));
  add(grouped(acc_(f_double("deepspeed_config.gradient_clipping", ACCEL_REF(optimizer.grad_clip), 0,
                            std::numeric_limits<double>::infinity(), false,
                            "Global-norm clipping threshold: the same setting as "
                            "optimizer.grad_clip (they must agree when both are given).")),
              "optimizer.grad_clip", false));
  add(grouped(
      acc_(f_int("deepspeed_config.gradient_accumulation_steps",
                 ACCEL_REF(gradient_accumulation_steps), 1, std::numeric_limits<int64_t>::max(),
                 "The same setting as the top-level gradient_accumulation_steps (they "
                 "must agree when both are given).")),
      "gradient_accumulation_steps", false));
  add(acc_(f_bool("deepspeed_config.zero3_save_16bit_model",
                  ACCEL_REF(deepspeed.zero3_save_16bit_model),
                  "ZeRO-3: also write a consolidated 16-bit Hugging Face model.safetensors at "
                  "each checkpoint.")));
  {
    Field f;
    f.path = "deepspeed_config.deepspeed_config_file";
    f.type = "string (path)";
    f.accelerate = true;
    f.doc =
        "A DeepSpeed JSON config (path relative to the YAML file, else to the working "
        "directory). Its zero_optimization "
        "stage/offload devices, gradient_clipping, gradient_accumulation_steps, "
        "train_micro_batch_size_per_gpu, fp16/bf16 and AdamW optimizer params are applied; "
        "\"auto\" values are skipped; other keys get a notice.";
    f.set = [](Config& c, const YAML::Node& n, Ctx& ctx) {
      std::string p = trim(need_scalar(ctx, n, "a path to a DeepSpeed JSON file"));
      if (p.empty()) {
        c.deepspeed.deepspeed_config_file.clear();
        return;
      }
      // Relative to the YAML file; Accelerate reads it relative to the working directory, so
      // that is the fallback.
      fs::path fp(p);
      std::error_code ec;
      if (fp.is_relative() && !ctx.base_dir.empty() &&
          (fs::exists(fs::path(ctx.base_dir) / fp, ec) || !fs::exists(fp, ec)))
        fp = fs::path(ctx.base_dir) / fp;
      apply_deepspeed_json(c, fp.lexically_normal().string(), ctx);
    };
    add(f);
  }
  add(inert("deepspeed_config.zero3_init_flag",
            "deepspeed.zero.Init is a DeepSpeed/transformers mechanism; accel-train partitions "
            "parameters itself"));
  add(inert("deepspeed_config.deepspeed_multinode_launcher",
            "multi-node runs are launched with mpirun"));
  add(inert("deepspeed_config.deepspeed_hostfile", "multi-node runs are launched with mpirun"));
  add(inert("deepspeed_config.deepspeed_exclusion_filter",
            "multi-node runs are launched with mpirun"));
  add(inert("deepspeed_config.deepspeed_inclusion_filter",
            "multi-node runs are launched with mpirun"));
  add(inert("deepspeed_config.offload_optimizer_nvme_path", "NVMe offload is not supported"));
  add(inert("deepspeed_config.offload_param_nvme_path", "NVMe offload is not supported"));
  add(inert("deepspeed_config.deepspeed_moe_layer_cls_names",
            "ZeRO shards the experts of qwen3_moe and mixtral like any other parameter; "
            "distributed.expert_parallel_size places experts on ranks"));

  // ---- fp8_config ----
  {
    Field f = acc_(
        f_enum("fp8_config.backend", ACCEL_REF(fp8.backend),
               "TE: TransformerEngine-style delayed scaling; AO: torchao-style dynamic "
               "per-tensor scaling. MSAMP (or ms-amp) is rejected with mixed_precision: fp8."));
    auto base = f.set;
    f.set = [base](Config& c, const YAML::Node& n, Ctx& ctx) {
      if (n.IsScalar() && lower(trim(n.Scalar())) == "ms-amp") {
        c.fp8.backend = Fp8Backend::MSAMP;
        return;
      }
      base(c, n, ctx);
    };
    add(f);
  }
  add(f_enum("fp8_config.recipe_name", ACCEL_REF(fp8.recipe_name),
             "AO: the scaling recipe, by torchao's Float8LinearRecipeName: tensorwise (one dynamic "
             "scale per tensor, e4m3 forward, e5m2 gradients); rowwise (one scale per row along "
             "each GEMM's contraction dimension, power-of-2 scales, e4m3 everywhere); "
             "rowwise_with_gw_hp (rowwise output and input-gradient GEMMs with the weight "
             "tensorwise in the latter, weight gradient in bf16); blockwise (DeepSeek-V3: 1x128 "
             "tiles for activations and gradients, 128x128 blocks for weights, e4m3, fp32 "
             "scales). Refused with backend TE."));
  add(acc_(f_enum("fp8_config.fp8_format", ACCEL_REF(fp8.fp8_format),
                  "HYBRID: e4m3 forward, e5m2 gradients; E4M3: e4m3 everywhere. E5M2 alone is "
                  "rejected (too little precision for weights and activations).")));
  add(grouped(acc_(f_int("fp8_config.amax_history_len", ACCEL_REF(fp8.amax_history_len), 1,
                         std::numeric_limits<int64_t>::max(),
                         "TE: steps of amax history kept per tensor.")),
              "fp8_config.amax_history_len", false));
  add(grouped(acc_(f_int("fp8_config.amax_history_length", ACCEL_REF(fp8.amax_history_len), 1,
                         std::numeric_limits<int64_t>::max(),
                         "The spelling Accelerate's wizard writes for amax_history_len.")),
              "fp8_config.amax_history_len", true));
  add(grouped(acc_(f_enum("fp8_config.amax_compute_algo", ACCEL_REF(fp8.amax_compute_algo),
                          "TE: scale from the max of the history or the most recent amax.")),
              "fp8_config.amax_compute_algo", false));
  add(grouped(acc_(f_enum("fp8_config.amax_compute_algorithm", ACCEL_REF(fp8.amax_compute_algo),
                          "The spelling Accelerate's wizard writes for amax_compute_algo.")),
              "fp8_config.amax_compute_algo", true));
  add(acc_(f_int("fp8_config.margin", ACCEL_REF(fp8.margin), 0, 64,
                 "TE: scale = fp8_max / amax / 2^margin.")));
  add(acc_(f_int("fp8_config.interval", ACCEL_REF(fp8.interval), 1,
                 std::numeric_limits<int64_t>::max(), "TE: recompute scales every N steps.")));
  {
    Field f;
    f.path = "fp8_config.override_linear_precision";
    f.type = "list of 3 booleans";
    f.accelerate = true;
    f.doc =
        "[fprop, dgrad, wgrad]: true runs that GEMM in bf16 instead of fp8. Also accepts "
        "Accelerate's forms \"(false, false, false)\" and a plain false.";
    f.set = [](Config& c, const YAML::Node& n, Ctx& ctx) {
      const std::string expected = "a list of three booleans [fprop, dgrad, wgrad]";
      std::vector<YAML::Node> items;
      if (n.IsSequence()) {
        for (const auto& e : n) items.push_back(e);
      } else if (n.IsScalar()) {
        std::string s = trim(n.Scalar());
        // Accelerate's wizard writes a plain `false` when no GEMM is overridden.
        std::string ls = lower(s);
        if (ls == "false" || ls == "no") {
          c.fp8.override_linear_precision_fprop = c.fp8.override_linear_precision_dgrad =
              c.fp8.override_linear_precision_wgrad = false;
          return;
        }
        if (!s.empty() && (s.front() == '(' || s.front() == '[')) s = s.substr(1);
        if (!s.empty() && (s.back() == ')' || s.back() == ']')) s.pop_back();
        for (auto& p : split(s, ',')) items.push_back(YAML::Node(trim(p)));
      } else {
        type_error(ctx, expected, n);
      }
      if (items.size() != 3) type_error(ctx, expected, n);
      bool v[3];
      for (int i = 0; i < 3; ++i) {
        if (!items[i].IsScalar()) type_error(ctx, expected, n);
        std::string t = lower(trim(items[i].Scalar()));
        if (t == "true" || t == "yes" || t == "1")
          v[i] = true;
        else if (t == "false" || t == "no" || t == "0")
          v[i] = false;
        else
          type_error(ctx, expected, n);
      }
      c.fp8.override_linear_precision_fprop = v[0];
      c.fp8.override_linear_precision_dgrad = v[1];
      c.fp8.override_linear_precision_wgrad = v[2];
    };
    f.get = [](const Config& c) {
      return "[" + fmt_bool(c.fp8.override_linear_precision_fprop) + ", " +
             fmt_bool(c.fp8.override_linear_precision_dgrad) + ", " +
             fmt_bool(c.fp8.override_linear_precision_wgrad) + "]";
    };
    add(f);
  }
  add(acc_(f_bool("fp8_config.use_autocast_during_eval", ACCEL_REF(fp8.use_autocast_during_eval),
                  "Run evaluation in fp8 too (default: eval in bf16).")));
  add(acc_(f_bool("fp8_config.use_mxfp8_block_scaling", ACCEL_REF(fp8.use_mxfp8_block_scaling),
                  "MXFP8 block scaling (32-element blocks with e8m0 scales). Hopper (sm_90) has "
                  "no MX GEMMs.")));
  add(acc_(f_bool("fp8_config.pad_inner_dim", ACCEL_REF(fp8.pad_inner_dim),
                  "AO: pad GEMM inner dimensions to a multiple of 16 instead of keeping such "
                  "layers in bf16.")));
  add(acc_(f_bool("fp8_config.enable_fsdp_float8_all_gather",
                  ACCEL_REF(fp8.enable_fsdp_float8_all_gather),
                  "FSDP with mixed_precision fp8 and backend AO: all-gather the fp8 layers' "
                  "weights as e4m3 cast with global dynamic scales (one amax all-reduce per "
                  "step; about half of bf16's bytes). Refused with backend TE.")));
  add(f_list("fp8_config.exclude_modules", ACCEL_REF(fp8.exclude_modules),
             "AO: parameter-name patterns (substring match, e.g. lm_head) whose linear layers "
             "stay in bf16, in addition to the first and last layers. A mixture-of-experts "
             "block's experts of one projection stay all or none (e.g. experts)."));
  add(inert("fp8_config.opt_level", "MS-AMP is not supported"));
  add(inert("fp8_config.optimization_level", "MS-AMP is not supported"));

  // ---- model ----
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  add(f_enum("model.name", ACCEL_REF(model.name),
             {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"},
             "Model family: Hugging Face's model_type (LlamaForCausalLM, Qwen2ForCausalLM, "
             "Qwen3ForCausalLM, MistralForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM); "
             "the families differ in the options below."));
  add(f_int("model.hidden_size", ACCEL_REF(model.hidden_size), 1, kMax, "Model width."));
  add(f_int("model.num_hidden_layers", ACCEL_REF(model.num_hidden_layers), 1, kMax,
            "Decoder layers."));
  add(f_int("model.num_attention_heads", ACCEL_REF(model.num_attention_heads), 1, kMax,
            "Query heads."));
  add(f_int("model.num_key_value_heads", ACCEL_REF(model.num_key_value_heads), 0, kMax,
            "Key/value heads (grouped-query attention); 0 = num_attention_heads."));
  add(f_int("model.intermediate_size", ACCEL_REF(model.intermediate_size), 1, kMax,
            "MLP hidden width (gate/up projections)."));
  add(f_int("model.vocab_size", ACCEL_REF(model.vocab_size), 1, kMax,
            "Vocabulary size (must cover the tokenizer's ids)."));
  add(f_int("model.max_position_embeddings", ACCEL_REF(model.max_position_embeddings), 1, kMax,
            "Longest sequence the model is defined for (training.seq_len must not exceed it, "
            "except with rope_type dynamic)."));
  add(f_int("model.head_dim", ACCEL_REF(model.head_dim), 0, kMax,
            "Per-head width; 0 = hidden_size / num_attention_heads (Qwen3 sets it apart)."));
  add(f_double("model.rope_theta", ACCEL_REF(model.rope_theta), 0,
               std::numeric_limits<double>::infinity(), true, "RoPE base frequency."));
  {
    // RoPE scaling as a map in config.json's spelling; rope_parameters (transformers 5) may hold
    // rope_theta too.
    auto rope_field = [](const std::string& path, bool with_theta, std::string doc) {
      Field f;
      f.path = path;
      f.type = "map";
      f.doc = std::move(doc);
      f.set = [with_theta, path](Config& c, const YAML::Node& n, Ctx& ctx) {
        YAML::Node v = n;
        if (n.IsScalar() && ctx.kind != LayerKind::File) {
          try {
            v = YAML::Load(n.Scalar());
          } catch (const YAML::Exception&) {
            type_error(ctx, "a map such as {rope_type: llama3, factor: 32, ...}", n);
          }
        }
        if (v.IsNull()) {
          c.model.rope_scaling = RopeScaling();
          return;
        }
        if (!v.IsMap()) type_error(ctx, "a map such as {rope_type: llama3, factor: 32, ...}", v);
        nlohmann::json j = nlohmann::json::object();
        for (auto it = v.begin(); it != v.end(); ++it) {
          if (!it->first.IsScalar() || !it->second.IsScalar())
            type_error(ctx, "a map of plain values", v);
          j[it->first.Scalar()] = yaml_scalar_json(it->second.Scalar());
        }
        double theta = c.model.rope_theta;
        try {
          c.model.rope_scaling = parse_rope_scaling(j, path, with_theta ? &theta : nullptr);
        } catch (const std::invalid_argument& e) {
          fail(ctx.where, e.what());
        }
        c.model.rope_theta = theta;
      };
      f.get = [](const Config& c) { return c.model.rope_scaling.to_json().dump(); };
      return f;
    };
    add(rope_field("model.rope_scaling", false,
                   "RoPE scaling, as config.json's rope_scaling: {rope_type: default | linear | "
                   "dynamic | llama3 | yarn, factor, ...} (llama3: low_freq_factor, "
                   "high_freq_factor, original_max_position_embeddings; yarn: "
                   "original_max_position_embeddings, beta_fast, beta_slow, attention_factor, "
                   "mscale, mscale_all_dim, truncate); `type` is read as rope_type."));
    add(grouped(rope_field("model.rope_parameters", true,
                           "Transformers 5's spelling of rope_scaling, which may hold rope_theta "
                           "too."),
                "model.rope_scaling", true));
  }
  add(f_double("model.rms_norm_eps", ACCEL_REF(model.rms_norm_eps), 0,
               std::numeric_limits<double>::infinity(), true, "RMSNorm epsilon."));
  add(f_double("model.initializer_range", ACCEL_REF(model.initializer_range), 0,
               std::numeric_limits<double>::infinity(), false,
               "Std of the normal initialization of weights."));
  add(f_bool("model.tie_word_embeddings", ACCEL_REF(model.tie_word_embeddings),
             "lm_head shares the embedding matrix."));
  add(f_bool("model.attention_bias", ACCEL_REF(model.attention_bias),
             "llama, qwen3: biases on q/k/v/o_proj. Not an option of qwen2 (q/k/v always have "
             "biases there) or mistral."));
  add(f_int("model.sliding_window", ACCEL_REF(model.sliding_window), 0, kMax,
            "Sliding-window attention: each query sees this many keys, its own included (0 = "
            "none). mistral: every layer; qwen2/qwen3: with use_sliding_window."));
  add(f_bool("model.use_sliding_window", ACCEL_REF(model.use_sliding_window),
             "qwen2, qwen3: layers from max_window_layers on use sliding_window."));
  add(f_int("model.max_window_layers", ACCEL_REF(model.max_window_layers), 0, kMax,
            "qwen2, qwen3: the first layer that uses the sliding window (those before it attend "
            "fully)."));
  add(f_list("model.layer_types", ACCEL_REF(model.layer_types),
             "qwen2, qwen3: full_attention or sliding_attention per layer (transformers 5); "
             "replaces the use_sliding_window / max_window_layers rule. Empty = that rule."));
  add(f_int("model.num_experts", ACCEL_REF(model.num_experts), 0, kMax,
            "qwen3_moe, mixtral: experts per mixture-of-experts layer (mixtral's "
            "num_local_experts). 0 elsewhere."));
  add(grouped(f_int("model.num_local_experts", ACCEL_REF(model.num_experts), 0, kMax,
                    "Mixtral's spelling of num_experts."),
              "model.num_experts", true));
  add(f_int("model.num_experts_per_tok", ACCEL_REF(model.num_experts_per_tok), 0, kMax,
            "qwen3_moe, mixtral: experts each token is routed to (top-k)."));
  add(f_int(
      "model.moe_intermediate_size", ACCEL_REF(model.moe_intermediate_size), 0, kMax,
      "qwen3_moe: each expert's MLP width (intermediate_size is the dense layers'). mixtral's "
      "experts take intermediate_size."));
  add(f_bool("model.norm_topk_prob", ACCEL_REF(model.norm_topk_prob),
             "qwen3_moe: renormalize the top-k routing weights to sum to 1 (default false, as "
             "transformers; Qwen3-30B-A3B sets true). mixtral always renormalizes."));
  add(f_int("model.decoder_sparse_step", ACCEL_REF(model.decoder_sparse_step), 1, kMax,
            "qwen3_moe: layer i is a mixture-of-experts layer when (i + 1) % decoder_sparse_step "
            "== 0 and i is not in mlp_only_layers (default 1)."));
  add(f_int_list("model.mlp_only_layers", ACCEL_REF(model.mlp_only_layers), 0,
                 "qwen3_moe: layer indices that keep a dense MLP."));
  add(f_double("model.router_aux_loss_coef", ACCEL_REF(model.router_aux_loss_coef), 0,
               std::numeric_limits<double>::infinity(), false,
               "qwen3_moe, mixtral: weight of the router's load-balancing loss in the training "
               "loss (default 0.001), added only with output_router_logits."));
  add(f_bool("model.output_router_logits", ACCEL_REF(model.output_router_logits),
             "qwen3_moe, mixtral: add router_aux_loss_coef x the load-balancing loss to the "
             "loss, as transformers does with output_router_logits (default false)."));
  add(f_enum("model.hidden_act", ACCEL_REF(model.hidden_act), {"silu"},
             "MLP activation: silu (SwiGLU), the only one these families use."));
  add(f_bool("model.mlp_bias", ACCEL_REF(model.mlp_bias),
             "Llama's MLP biases: only false is supported."));
  add(f_double("model.attention_dropout", ACCEL_REF(model.attention_dropout), 0, 1, false,
               "Only 0 is supported (no dropout)."));
  add(f_str("model.init_from", ACCEL_REF(model.init_from),
            "A Hugging Face model folder (config.json + safetensors) of a supported family: its "
            "config.json replaces the model.* keys and its weights initialize the model (F32, or "
            "BF16/F16 widened to fp32; other dtypes are refused)."));

  // ---- training ----
  {
    Field f;
    f.path = "training.seed";
    f.type = "integer";
    f.doc = "Seed for initialization, data order and sampling; the same seed gives the same run.";
    f.set = [](Config& c, const YAML::Node& n, Ctx& ctx) { c.training.seed = parse_u64(ctx, n); };
    f.get = [](const Config& c) { return std::to_string(c.training.seed); };
    add(f);
  }
  add(f_int("training.max_steps", ACCEL_REF(training.max_steps), 0, kMax,
            "Optimizer steps to run (wins over training.num_epochs when both are given)."));
  add(f_double("training.num_epochs", ACCEL_REF(training.num_epochs), 0,
               std::numeric_limits<double>::infinity(), false,
               "Epochs over the training data instead of max_steps (0 = off): the run takes "
               "ceil(num_epochs x batches per epoch / gradient_accumulation_steps) steps."));
  add(f_int("training.micro_batch_size", ACCEL_REF(training.micro_batch_size), 1, kMax,
            "Sequences per micro-batch per process."));
  add(f_int("training.seq_len", ACCEL_REF(training.seq_len), 1, kMax, "Tokens per sequence."));
  add(f_int("training.eval_every", ACCEL_REF(training.eval_every), 0, kMax,
            "Evaluate every N steps (0 = off); needs an evaluation split (data.eval_fraction, "
            "or data.eval_path for shards)."));
  add(f_int("training.eval_batches", ACCEL_REF(training.eval_batches), 1, kMax,
            "Micro-batches per evaluation."));
  add(f_int("training.log_every", ACCEL_REF(training.log_every), 1, kMax,
            "Log a metrics line every N steps."));
  add(f_int("training.sample_tokens", ACCEL_REF(training.sample_tokens), 0, kMax,
            "Greedy-sample this many tokens at the end (0 = no sample)."));
  add(f_str("training.sample_prompt", ACCEL_REF(training.sample_prompt),
            "Prompt for the final sample."));
  add(f_enum("training.device", ACCEL_REF(training.device),
             "auto: CUDA when a GPU is visible, else CPU."));
  add(f_bool("training.allow_tf32", ACCEL_REF(training.allow_tf32),
             "Allow TF32 tensor-core math for fp32 GEMMs on the GPU."));
  {
    // A boolean before the modes existed: its spellings stay (true is full, false none).
    Field f =
        f_enum("training.activation_checkpointing", ACCEL_REF(training.activation_checkpointing),
               "What backward recomputes of each decoder layer to save memory: none; full "
               "(the whole layer from its input); selective (keeps the GEMM and attention "
               "outputs and recomputes only the norms, RoPE, SwiGLU, casts and bias adds "
               "between them). true means full, false none.");
    f.type += " (or true = full, false = none)";
    f.set = [](Config& c, const YAML::Node& n, Ctx& ctx) {
      const std::string expected = "one of none, full, selective (or true = full, false = none)";
      const std::string& text = need_scalar(ctx, n, expected);
      ActivationCheckpointing& mode = c.training.activation_checkpointing;
      if (const std::optional<bool> b = boolean_spelling(text)) {
        mode = *b ? ActivationCheckpointing::Full : ActivationCheckpointing::None;
        return;
      }
      const auto& names = EnumNames<ActivationCheckpointing>::names;
      const auto* found = std::find(std::begin(names), std::end(names), lower(trim(text)));
      if (found == std::end(names)) type_error(ctx, expected, n);
      mode = static_cast<ActivationCheckpointing>(found - std::begin(names));
    };
    add(f);
  }
  add(f_enum("training.nan_policy", ACCEL_REF(training.nan_policy),
             "On a non-finite loss or gradient: stop with an error, or skip the step."));
  add(f_double("training.loss_scale_init", ACCEL_REF(training.loss_scale_init), 0,
               std::numeric_limits<double>::infinity(), true, "fp16: initial dynamic loss scale."));
  add(f_int("training.loss_scale_window", ACCEL_REF(training.loss_scale_window), 1, kMax,
            "fp16: steps without overflow before the loss scale doubles."));
  add(f_str("training.output_dir", ACCEL_REF(training.output_dir),
            "Folder for metrics, checkpoints and the effective config."));
  add(f_enum("training.progress", ACCEL_REF(training.progress),
             "auto: a progress bar on a terminal, plain lines otherwise."));

  // ---- optimizer ----
  const double kInf = std::numeric_limits<double>::infinity();
  add(f_enum("optimizer.name", ACCEL_REF(optimizer.name), "Optimizer."));
  add(f_double("optimizer.lr", ACCEL_REF(optimizer.lr), 0, kInf, false, "Peak learning rate."));
  // Below 1: AdamW's bias corrections divide by 1 - beta^step.
  add(f_double("optimizer.beta1", ACCEL_REF(optimizer.beta1), 0, 1, false, "AdamW beta1 (< 1).",
               true));
  add(f_double("optimizer.beta2", ACCEL_REF(optimizer.beta2), 0, 1, false, "AdamW beta2 (< 1).",
               true));
  add(f_double("optimizer.eps", ACCEL_REF(optimizer.eps), 0, kInf, true, "AdamW epsilon."));
  add(f_double("optimizer.weight_decay", ACCEL_REF(optimizer.weight_decay), 0, kInf, false,
               "Decoupled weight decay (AdamW) / L2 (SGD)."));
  add(f_double("optimizer.momentum", ACCEL_REF(optimizer.momentum), 0, 1, false, "SGD momentum."));
  add(grouped(f_double("optimizer.grad_clip", ACCEL_REF(optimizer.grad_clip), 0, kInf, false,
                       "Clip the global gradient norm to this value (0 = off)."),
              "optimizer.grad_clip", false));
  add(f_enum("optimizer.lr_schedule", ACCEL_REF(optimizer.lr_schedule), "Decay after warmup."));
  add(f_int("optimizer.warmup_steps", ACCEL_REF(optimizer.warmup_steps), 0, kMax,
            "Linear warmup steps from 0 to lr."));
  add(f_double("optimizer.min_lr_ratio", ACCEL_REF(optimizer.min_lr_ratio), 0, 1, false,
               "linear/cosine: final lr = lr * min_lr_ratio."));
  add(f_enum("optimizer.state_dtype", ACCEL_REF(optimizer.state_dtype),
             "dtype of AdamW's exp_avg and exp_avg_sq (SGD's momentum buffer): bf16 halves their "
             "memory; the update is computed in fp32 and the moments rounded to nearest even."));
  add(f_enum("optimizer.master_weights", ACCEL_REF(optimizer.master_weights),
             "dtype of the master weights: fp32 keeps an fp32 copy beside the 16-bit compute "
             "weights; bf16 (mixed_precision bf16 or fp8) makes the bf16 weights the master, "
             "updated in fp32 and stochastically rounded (saves 4 bytes per parameter)."));

  // ---- data ----
  add(f_enum("data.source", ACCEL_REF(data.source),
             "text: tokenize data.text_files at start; shards: pre-tokenized token shards "
             "(accel-data); synthetic: random tokens (benchmarks); jsonl: tokenize "
             "data.jsonl_files at start (text, prompt/completion or chat samples)."));
  add(f_list("data.jsonl_files", ACCEL_REF(data.jsonl_files),
             "source jsonl: JSONL files or glob patterns, plain, .gz or .zst (one JSON object "
             "per line)."));
  add(f_enum("data.format", ACCEL_REF(data.format),
             "JSONL sample format; auto: from the first line (messages, prompt + completion, or "
             "data.text_field), printed at start."));
  add(f_str("data.text_field", ACCEL_REF(data.text_field), "format text: the field to train on."));
  add(f_enum("data.chat_template", ACCEL_REF(data.chat_template),
             "format messages: the chat template; auto: the one of the tokenizer_config.json "
             "beside data.tokenizer (refused by name when it is not one of the others)."));
  add(f_bool("data.packing", ACCEL_REF(data.packing),
             "Documents (JSONL, document shards): pack several into each seq_len row, attention "
             "kept within each; false: one per row, padded."));
  add(f_bool("data.reset_position_ids", ACCEL_REF(data.reset_position_ids),
             "Packing: positions restart at 0 in each document."));
  add(f_int("data.pad_to_multiple_of", ACCEL_REF(data.pad_to_multiple_of), 0, kMax,
            "Without packing: pad rows to the longest in the batch rounded up to a multiple of "
            "this (0 = the longest; at most seq_len)."));
  add(f_enum("data.overlong", ACCEL_REF(data.overlong),
             "A document longer than training.seq_len: cut to seq_len, left out, or an error "
             "naming its file and line (counts are printed and written to metrics.jsonl)."));
  add(f_list("data.text_files", ACCEL_REF(data.text_files),
             "source text: UTF-8 text files (paths relative to the working directory)."));
  add(f_str("data.train_path", ACCEL_REF(data.train_path), "source shards: training shards."));
  add(f_str("data.eval_path", ACCEL_REF(data.eval_path),
            "source shards: evaluation shards (empty = hold out eval_fraction)."));
  add(f_str("data.tokenizer", ACCEL_REF(data.tokenizer),
            "byte (256 byte tokens) or the path of a Hugging Face tokenizer.json."));
  add(f_double("data.eval_fraction", ACCEL_REF(data.eval_fraction), 0, 0.9, false,
               "Fraction of the data held out for evaluation when no eval set is given (at most "
               "0.9)."));
  add(f_bool("data.shuffle", ACCEL_REF(data.shuffle), "Shuffle sequences (seeded)."));

  // ---- checkpoint ----
  add(f_int("checkpoint.every_steps", ACCEL_REF(checkpoint.every_steps), 0, kMax,
            "Save every N steps (0 = only at the end)."));
  add(f_int("checkpoint.keep_last", ACCEL_REF(checkpoint.keep_last), 0, kMax,
            "Keep the newest N checkpoints (0 = keep all)."));
  add(f_bool("checkpoint.save_optimizer", ACCEL_REF(checkpoint.save_optimizer),
             "Include optimizer state (needed to resume; without it, start a new run from the "
             "checkpoint with model.init_from)."));
  add(f_bool("checkpoint.at_end", ACCEL_REF(checkpoint.at_end), "Save after the last step."));
  add(f_bool("checkpoint.async", ACCEL_REF(checkpoint.async),
             "Copy the state to host memory at the step boundary and write it in the background "
             "while training goes on (one save in flight; a failure stops the run at the next "
             "step). With every_steps > 0 the host block of the snapshots (pinned for GPU state, "
             "the size of what a save writes) is reserved at setup, before the first step "
             "(docs/checkpoints.md)."));

  // ---- logging ----
  add(f_str("logging.metrics_file", ACCEL_REF(logging.metrics_file),
            "JSON-lines metrics file, relative to training.output_dir."));
  add(f_bool("logging.tensorboard", ACCEL_REF(logging.tensorboard),
             "TensorBoard event files in training.output_dir/tb/ (every number of "
             "metrics.jsonl as a scalar; `tensorboard --logdir OUTPUT_DIR/tb`)."));

  // ---- distributed ----
  add(f_enum("distributed.backend", ACCEL_REF(distributed.backend),
             "Collectives: nccl for GPU tensors, cpu (TCP) for host tensors, auto by device."));
  // Bounds: parallel/store.h's kMinUserTimeout and kMaxTimeout (30 days; deadlines overflow).
  add(f_double("distributed.timeout_s", ACCEL_REF(distributed.timeout_s), 0.1, 2592000, false,
               "Seconds a collective or rendezvous may wait before the run fails naming the "
               "missing rank (0.1 to 2592000, 30 days)."));
  add(f_double("distributed.ddp_bucket_cap_mb", ACCEL_REF(distributed.ddp_bucket_cap_mb), 0, kInf,
               true, "Gradient bucket size (MiB) for DDP/ZeRO reductions."));
  add(f_bool("distributed.find_unused_parameters", ACCEL_REF(distributed.find_unused_parameters),
             "Tolerate parameters that get no gradient (otherwise that is an error)."));
  add(f_int("distributed.expert_parallel_size", ACCEL_REF(distributed.expert_parallel_size), 1,
            std::numeric_limits<int>::max(),
            "Expert parallelism (mixture-of-experts models): each layer's experts are split over "
            "this many consecutive ranks and tokens travel to them by all-to-all; must divide "
            "num_processes and the model's number of experts. 1 = off."));

  for (auto& f : s)
    if (!f.group.empty() && f.group == f.path) f.alias = false;
  return s;
}

const std::vector<Field>& schema() {
  static const std::vector<Field> s = build_schema();
  return s;
}

const Field* find_field(const std::string& path) {
  static const std::map<std::string, size_t> index = [] {
    std::map<std::string, size_t> m;
    for (size_t i = 0; i < schema().size(); ++i) m[schema()[i].path] = i;
    return m;
  }();
  auto it = index.find(path);
  return it == index.end() ? nullptr : &schema()[it->second];
}

std::string parent_of(const std::string& p) {
  auto d = p.rfind('.');
  return d == std::string::npos ? "" : p.substr(0, d);
}
std::string leaf_of(const std::string& p) {
  auto d = p.rfind('.');
  return d == std::string::npos ? p : p.substr(d + 1);
}

// Hugging Face Trainer (TrainingArguments) and Accelerate names people type for our keys, tried
// before edit distance: by full path first, then by the last name anywhere. `key` is our key
// ("" when there is none); `hint` says how the setting is spelled here.
struct Synonym {
  const char* name;
  const char* key;
  const char* hint;
};
const std::vector<Synonym>& key_synonyms() {
  static const std::vector<Synonym> s = {
      {"learning_rate", "optimizer.lr", "Trainer's learning_rate"},
      {"lr", "optimizer.lr", "the peak learning rate"},
      {"num_train_epochs", "training.num_epochs", "Trainer's num_train_epochs"},
      {"epochs", "training.num_epochs", "epochs over the training data"},
      {"report_to", "logging.tensorboard",
       "TensorBoard files are written to training.output_dir/tb (on by default); metrics also go "
       "to metrics.jsonl (logging.metrics_file)"},
      {"log_with", "logging.tensorboard",
       "TensorBoard files are written to training.output_dir/tb (on by default); metrics also go "
       "to metrics.jsonl (logging.metrics_file)"},
      {"per_device_train_batch_size", "training.micro_batch_size", "sequences per process"},
      {"train_micro_batch_size_per_gpu", "training.micro_batch_size", "sequences per process"},
      {"train_batch_size", "training.micro_batch_size", "sequences per process"},
      {"batch_size", "training.micro_batch_size", "sequences per process"},
      {"per_device_eval_batch_size", "training.eval_batches",
       "evaluation runs training.eval_batches micro-batches of training.micro_batch_size"},
      {"warmup_ratio", "optimizer.warmup_steps", "a number of steps, not a ratio"},
      {"lr_scheduler_type", "optimizer.lr_schedule", "constant, linear or cosine"},
      {"lr_scheduler", "optimizer.lr_schedule", "constant, linear or cosine"},
      {"scheduler", "optimizer.lr_schedule", "constant, linear or cosine"},
      {"adam_beta1", "optimizer.beta1", "Trainer's adam_beta1"},
      {"adam_beta2", "optimizer.beta2", "Trainer's adam_beta2"},
      {"adam_epsilon", "optimizer.eps", "Trainer's adam_epsilon"},
      {"max_grad_norm", "optimizer.grad_clip", "the global gradient-norm limit"},
      {"clip_grad_norm", "optimizer.grad_clip", "the global gradient-norm limit"},
      {"optim", "optimizer.name", "adamw or sgd"},
      {"bf16", "mixed_precision", "mixed_precision: bf16"},
      {"fp16", "mixed_precision", "mixed_precision: fp16"},
      {"logging_steps", "training.log_every", "a metrics line every N steps"},
      {"save_steps", "checkpoint.every_steps", "a checkpoint every N steps"},
      {"save_total_limit", "checkpoint.keep_last", "checkpoints kept"},
      {"save_only_model", "checkpoint.save_optimizer", "false saves the model only"},
      {"eval_steps", "training.eval_every", "an evaluation every N steps"},
      {"eval_strategy", "training.eval_every", "an evaluation every N steps (0 = off)"},
      {"gradient_checkpointing", "training.activation_checkpointing", "recompute activations"},
      {"tf32", "training.allow_tf32", "TF32 for fp32 GEMMs"},
      {"ddp_backend", "distributed.backend", "nccl, cpu or auto"},
      {"ddp_find_unused_parameters", "distributed.find_unused_parameters", "as in DDP"},
      {"ddp_timeout", "distributed.timeout_s", "seconds"},
      {"cpu", "use_cpu", "Accelerate's use_cpu"},
      {"project_dir", "training.output_dir", "the output folder"},
      {"logging_dir", "training.output_dir", "metrics.jsonl is written there"},
      {"dynamo_backend", "dynamo_config", "accepted without effect"},
      {"resume_from_checkpoint", "", "resume with accel-train --resume auto or --resume PATH"},
      {"fsdp_config.cpu_offload", "fsdp_config.fsdp_offload_params", "FSDP's cpu_offload"},
      {"deepspeed_config.stage", "deepspeed_config.zero_stage", "the ZeRO stage"},
      {"deepspeed_config.offload_optimizer", "deepspeed_config.offload_optimizer_device",
       "none or cpu"},
      {"deepspeed_config.offload_param", "deepspeed_config.offload_param_device", "none or cpu"},
  };
  return s;
}

// "unknown key 'training.max_stpes'; did you mean 'training.max_steps'?"
std::string unknown_key_message(const std::string& path) {
  // No valid key is this long; comparing a hostile 256 KB key with every key took seconds.
  if (path.size() > 200)
    return "unknown key '" + text_excerpt(path) + "' (" + std::to_string(path.size()) +
           " characters)";
  const std::string parent = parent_of(path), leaf = lower(leaf_of(path));
  {
    const Synonym* hit = nullptr;
    for (const auto& syn : key_synonyms())
      if (lower(path) == syn.name) hit = &syn;
    if (!hit)
      for (const auto& syn : key_synonyms())
        if (leaf == syn.name) hit = &syn;
    if (hit && std::string(hit->key) != path) {
      std::string msg = "unknown key '" + path + "'";
      if (*hit->key)
        return msg + "; did you mean '" + hit->key + "'? (" + hit->hint +
               "; a whole Hugging Face TrainingArguments set goes in training_args:)";
      return msg + ": " + hit->hint;
    }
  }
  // Accelerate's plugin names without the fsdp_ prefix ("fsdp_config.sharding_strategy").
  if (parent == "fsdp_config" && find_field("fsdp_config.fsdp_" + leaf))
    return "unknown key '" + path + "'; did you mean 'fsdp_config.fsdp_" + leaf + "'?";
  std::vector<std::string> siblings;
  for (const auto& f : schema())
    if (parent_of(f.path) == parent) siblings.push_back(f.path);
  if (parent.empty())
    for (const auto& sec : kSections) siblings.push_back(sec);
  if (parent.empty()) siblings.push_back("extends");
  if (parent.empty()) siblings.push_back("training_args");
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& cand : siblings) {
    std::string cl = lower(leaf_of(cand));
    size_t d = edit_distance(leaf, cl);
    // "fsdp" for "fsdp_config", "fp8" for "fp8_config".
    if (leaf.size() >= 3 && cl != leaf && (starts_with(cl, leaf) || starts_with(leaf, cl)))
      d = std::min<size_t>(d, 1);
    if (d < best_d || (d == best_d && cand.size() < best.size())) {
      best_d = d;
      best = cand;
    }
  }
  // The same key name in another section ("max_steps" at the top -> "training.max_steps").
  if (best_d > 0) {
    for (const auto& f : schema()) {
      if (lower(leaf_of(f.path)) == leaf && parent_of(f.path) != parent) {
        return "unknown key '" + path + "'; did you mean '" + f.path + "'?";
      }
    }
  }
  std::string msg = "unknown key '" + path + "'";
  if (best.empty()) return msg;
  if (best_d <= std::max<size_t>(2, leaf.size() / 3)) return msg + "; did you mean '" + best + "'?";
  std::vector<std::string> names;
  for (const auto& s : siblings) names.push_back(leaf_of(s));
  return msg + "; the closest valid key is '" + best + "' (valid keys" +
         (parent.empty() ? "" : " in " + parent) + ": " + join(names, ", ") + ")";
}

// ---- applying one layer (a file, the environment, or the --set list) --------------------------

struct Applier {
  Config& cfg;
  LayerKind kind;
  std::string base_dir;
  struct Seen {
    std::string path, value, where;
  };
  std::map<std::string, Seen> seen;  // by canonical key, within this layer

  void apply_map(const YAML::Node& m, const std::string& prefix, const std::string& file) {
    std::map<std::string, std::string> line_of;  // keys of this map already read
    for (auto it = m.begin(); it != m.end(); ++it) {
      const std::string line = std::to_string(it->first.Mark().line + 1);
      std::string where = file + ":" + line;
      if (!it->first.IsScalar())
        fail(where, (prefix.empty() ? std::string("top level") : prefix) +
                        ": keys must be plain names, got " + describe(it->first));
      std::string key = it->first.Scalar();
      // YAML forbids a repeated key; yaml-cpp keeps both, which would merge two sections.
      auto [first, fresh] = line_of.emplace(key, line);
      if (!fresh)
        fail(where, "'" + (prefix.empty() ? key : prefix + "." + key) +
                        "' is given twice in this map (first at line " + first->second +
                        "): give each key once");
      if (prefix.empty() && key == "extends") continue;  // handled by the file loader
      if (prefix.empty() && key == "training_args") {
        apply_training_args(*this, it->second, where, file);
        continue;
      }
      apply_key(prefix.empty() ? key : prefix + "." + key, it->second, where, file);
    }
  }

  void apply_key(const std::string& path, const YAML::Node& v, const std::string& where,
                 const std::string& file = "") {
    const Field* f = find_field(path);
    if (!f && (path == "training_args" || starts_with(path, "training_args.")))
      fail(where,
           "training_args is read from a config file (training_args:) or from accel-train "
           "--training-args FILE.json; here set our own key instead (e.g. optimizer.lr for "
           "learning_rate)");
    if (!f) {
      if (is_section(path)) {
        if (!v.IsDefined() || v.IsNull()) return;
        if (v.IsMap() && kind == LayerKind::File) {
          apply_map(v, path, file);
          return;
        }
        Ctx c{path, where, kind, base_dir, this};
        type_error(c, "a map of " + path + " keys", v);
      }
      // A key inside a map that is accepted as a whole (dynamo_config.dynamo_backend).
      const Field* p = find_field(parent_of(path));
      if (p && p->inert)
        fail(where, "'" + path + "' is part of " + p->path +
                        ", which accel-train keeps as a whole; "
                        "set " +
                        p->path + " in a config file instead");
      if (p) fail(where, "'" + p->path + "' is a single value (" + p->type + "), not a section");
      fail(where, unknown_key_message(path));
    }
    Ctx c{path, where, kind, base_dir, this};
    if (f->inert) {
      YAML::Node val = v;
      if (v.IsScalar() && kind != LayerKind::File) {
        try {
          val = YAML::Load(v.Scalar());
        } catch (const YAML::Exception&) {
          val = v;
        }
      }
      require_small_expansion(val, where, path, "accel-train keeps this key as written");
      cfg.inert[path] = flow(val);
      cfg.origins[path] = where;
      mark_present(path);
      if (path == "tp_config" || path == "parallelism_config") check_parallel_sizes(c, val);
      return;
    }
    const Field* canon = f->group.empty() ? f : find_field(f->group);
    if (!v.IsDefined() || v.IsNull()) {
      // An empty value means "the built-in default".
      static const Config defaults;
      YAML::Node dn = YAML::Load(canon->get(defaults));
      Ctx dc{canon->path, "built-in default", LayerKind::File, "", this};
      canon->set(cfg, dn, dc);
      cfg.origins.erase(path);
      return;
    }
    f->set(cfg, v, c);
    cfg.origins[path] = where;
    if (canon != f) cfg.origins[canon->path] = where;
    mark_present(path);
    // One layer must not give one setting two different values: two spellings
    // (amax_history_len / amax_history_length), mirrored keys (deepspeed_config.gradient_clipping
    // / optimizer.grad_clip), or a YAML key and the same key from its deepspeed_config_file. A
    // repeated --set of the same key simply wins.
    if (!canon->get) return;
    const std::string value = canon->get(cfg);
    auto it = seen.find(canon->path);
    if (it != seen.end() && it->second.value != value &&
        (it->second.path != path || kind == LayerKind::File))
      fail(where, path + " = " + value + " conflicts with " + it->second.path + " = " +
                      it->second.value + " (" + it->second.where + "): both set " + canon->path +
                      "; give it once");
    seen[canon->path] = {path, value, where};
  }

  void mark_present(const std::string& path) {
    if (starts_with(path, "fsdp_config.")) cfg.fsdp.present = true;
    if (starts_with(path, "deepspeed_config.")) cfg.deepspeed.present = true;
    if (starts_with(path, "fp8_config.")) cfg.fp8.present = true;
  }

  // tp_config / parallelism_config: sizes above 1 ask for parallelism we do not have.
  void check_parallel_sizes(const Ctx& c, const YAML::Node& v) {
    if (!v.IsMap()) return;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!it->first.IsScalar() || !it->second.IsScalar()) continue;
      std::string k = it->first.Scalar();
      bool tp_or_cp =
          k.find("tp_size") != std::string::npos || k.find("cp_size") != std::string::npos;
      if (!tp_or_cp) continue;
      char* e = nullptr;
      long n = std::strtol(it->second.Scalar().c_str(), &e, 10);
      if (*e == '\0' && n > 1)
        fail(c.where, c.path + "." + k + " = " + std::to_string(n) +
                          ": tensor and context parallelism are not implemented in accel-train "
                          "(only data parallelism via distributed_type)");
    }
  }
};

// DeepSpeed JSON config: the keys with an accel-train meaning are applied through the normal key
// setters (so they conflict-check against the YAML), the rest get a notice.
void apply_deepspeed_json(Config& c, const std::string& file, Ctx& ctx) {
  std::ifstream in(file);
  if (!in) fail(ctx.where, ctx.path + ": cannot open the DeepSpeed config file '" + file + "'");
  nlohmann::json j;
  try {
    j = read_json_file(file);
  } catch (const JsonError& e) {
    fail(ctx.where, ctx.path + ": " + e.what());
  }
  if (!j.is_object()) fail(ctx.where, ctx.path + ": '" + file + "' must hold a JSON object");
  c.deepspeed.deepspeed_config_file = file;
  Applier& a = *ctx.applier;
  std::vector<std::string> unused;
  auto text = [](const nlohmann::json& v) {
    return v.is_string() ? v.get<std::string>() : v.dump();
  };
  auto is_auto = [](const nlohmann::json& v) { return v.is_string() && v == "auto"; };
  auto put = [&](const std::string& path, const nlohmann::json& v, const std::string& ptr) {
    if (is_auto(v)) return;
    YAML::Node n = v.is_array() ? YAML::Load(v.dump()) : YAML::Node(text(v));
    a.apply_key(path, n, file + " (" + ptr + ")");
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    const nlohmann::json& v = it.value();
    if (k == "gradient_clipping") {
      put("deepspeed_config.gradient_clipping", v, k);
    } else if (k == "gradient_accumulation_steps") {
      put("deepspeed_config.gradient_accumulation_steps", v, k);
    } else if (k == "train_micro_batch_size_per_gpu") {
      put("training.micro_batch_size", v, k);
    } else if ((k == "bf16" || k == "fp16") && v.is_object()) {
      for (auto f = v.begin(); f != v.end(); ++f) {
        if (f.key() == "enabled") {
          if (f.value().is_boolean() && f.value().get<bool>()) put("mixed_precision", k, k);
        } else if (k == "fp16" && f.key() == "initial_scale_power" && f.value().is_number()) {
          put("training.loss_scale_init", std::pow(2.0, f.value().get<double>()),
              k + "." + f.key());
        } else if (k == "fp16" && f.key() == "loss_scale_window") {
          put("training.loss_scale_window", f.value(), k + "." + f.key());
        } else {
          unused.push_back(k + "." + f.key());
        }
      }
    } else if (k == "zero_optimization" && v.is_object()) {
      for (auto z = v.begin(); z != v.end(); ++z) {
        const std::string zk = z.key(), ptr = k + "." + zk;
        if (zk == "stage") {
          put("deepspeed_config.zero_stage", z.value(), ptr);
        } else if ((zk == "offload_optimizer" || zk == "offload_param") && z.value().is_object()) {
          for (auto o = z.value().begin(); o != z.value().end(); ++o) {
            if (o.key() == "device")
              put("deepspeed_config." + zk + "_device", o.value(), ptr + ".device");
            else
              unused.push_back(ptr + "." + o.key());
          }
        } else if (zk == "stage3_gather_16bit_weights_on_model_save" ||
                   zk == "stage3_gather_fp16_weights_on_model_save") {
          put("deepspeed_config.zero3_save_16bit_model", z.value(), ptr);
        } else {
          unused.push_back(ptr);
        }
      }
    } else if (k == "optimizer" && v.is_object()) {
      if (v.contains("type")) {
        std::string t = lower(text(v["type"]));
        if (t == "adamw" || t == "adam")
          put("optimizer.name", "adamw", "optimizer.type");
        else
          fail(ctx.where, ctx.path + ": '" + file + "' asks for optimizer " + text(v["type"]) +
                              "; accel-train implements AdamW (and SGD via optimizer.name)");
      }
      if (v.contains("params") && v["params"].is_object()) {
        for (auto p = v["params"].begin(); p != v["params"].end(); ++p) {
          const std::string ptr = "optimizer.params." + p.key();
          if (p.key() == "lr" || p.key() == "eps" || p.key() == "weight_decay") {
            put("optimizer." + p.key(), p.value(), ptr);
          } else if (p.key() == "betas" && p.value().is_array() && p.value().size() == 2) {
            put("optimizer.beta1", p.value()[0], ptr + "[0]");
            put("optimizer.beta2", p.value()[1], ptr + "[1]");
          } else {
            unused.push_back(ptr);
          }
        }
      }
    } else if (is_auto(v)) {
      // "auto" asks the launcher to fill the value in: nothing to carry over.
    } else {
      unused.push_back(k);
    }
  }
  if (!unused.empty())
    c.notices.push_back("deepspeed_config_file " + file + ": " + join(unused, ", ") +
                        (unused.size() == 1 ? " has" : " have") +
                        " no effect in accel-train (only ZeRO stage/offload devices, clipping, "
                        "accumulation, micro-batch size, precision and AdamW settings are used)");
}

// ---- training_args: Hugging Face TrainingArguments (runtime/training_args.h) -----------------

// YAML as JSON, with TrainingArguments' types: quoted scalars stay strings; plain true/false,
// null and numbers are typed (plain `no` stays the string Trainer's strategies use).
nlohmann::json yaml_to_json(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return nullptr;
  if (n.IsSequence()) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& e : n) a.push_back(yaml_to_json(e));
    return a;
  }
  if (n.IsMap()) {
    nlohmann::json o = nlohmann::json::object();
    for (auto it = n.begin(); it != n.end(); ++it)
      o[it->first.IsScalar() ? it->first.Scalar() : flow(it->first)] = yaml_to_json(it->second);
    return o;
  }
  const std::string& s = n.Scalar();
  if (n.Tag() == "!") return s;
  const std::string l = lower(trim(s));
  if (l == "true" || l == "false") return l == "true";
  if (l == "null" || l == "~") return nullptr;
  const char* b = s.c_str();
  char* e = nullptr;
  errno = 0;
  long long i = std::strtoll(b, &e, 10);
  if (!s.empty() && e == b + s.size() && errno == 0) return i;
  if (parses_as_number(s)) return std::strtod(b, nullptr);
  return s;
}

// Applies the keys a TrainingArguments object maps to through the layer's own applier, so a
// value that disagrees with the YAML's is an error naming both; prints the mapping as notices.
void apply_training_args_json(Applier& a, const nlohmann::json& args,
                              const std::function<std::string(const std::string&)>& at,
                              const std::string& base_dir) {
  TrainingArgsMapping m = map_training_args(args, at, base_dir);
  for (const auto& k : m.keys) {
    a.apply_key(k.key, YAML::Load(k.value.dump()), at(k.arg) + " (training_args " + k.from + ")");
    std::string v = k.value.is_string() ? k.value.get<std::string>() : k.value.dump();
    if (v.size() > 60) v = v.substr(0, 57) + "...";
    a.cfg.notices.push_back("training_args " + k.from + " -> " + k.key + ": " + v);
  }
  for (auto& n : m.notices) a.cfg.notices.push_back(std::move(n));
}

void apply_training_args_file(Applier& a, const std::string& path, const std::string& where) {
  nlohmann::json args = read_json_object_file(path, where);
  apply_training_args_json(
      a, args, [path](const std::string&) { return path; }, fs::path(path).parent_path().string());
}

// `training_args:` in a file: a map of TrainingArguments names, or the path of a JSON dump
// (relative to this file, else to the working directory).
void apply_training_args(Applier& a, const YAML::Node& v, const std::string& where,
                         const std::string& file) {
  if (!v.IsDefined() || v.IsNull()) return;
  if (v.IsScalar()) {
    fs::path p(trim(v.Scalar()));
    std::error_code ec;
    if (p.is_relative() && fs::exists(fs::path(a.base_dir) / p, ec)) p = fs::path(a.base_dir) / p;
    apply_training_args_file(a, p.lexically_normal().string(), where + ": training_args");
    return;
  }
  if (!v.IsMap()) {
    Ctx c{"training_args", where, a.kind, a.base_dir, &a};
    type_error(c, "a map of TrainingArguments names or the path of a TrainingArguments JSON", v);
  }
  require_small_expansion(v, where, "training_args", "it is read as one JSON object");
  std::map<std::string, std::string> lines;
  for (auto it = v.begin(); it != v.end(); ++it)
    if (it->first.IsScalar())
      lines[it->first.Scalar()] = file + ":" + std::to_string(it->first.Mark().line + 1);
  apply_training_args_json(
      a, yaml_to_json(v),
      [lines, where](const std::string& name) {
        auto it = lines.find(name);
        return it == lines.end() ? where : it->second;
      },
      a.base_dir);
}

// ---- files and extends ------------------------------------------------------------------------

// `training_args` (the top-level file only): a TrainingArguments JSON applied with this file's
// keys.
void apply_file(Config& cfg, const std::string& path, const std::string& included_from,
                std::vector<std::string>& chain, const std::string& training_args = "") {
  std::error_code ec;
  fs::path canon = fs::weakly_canonical(fs::path(path), ec);
  std::string key = ec ? path : canon.string();
  if (std::find(chain.begin(), chain.end(), key) != chain.end()) {
    std::vector<std::string> cycle(std::find(chain.begin(), chain.end(), key), chain.end());
    cycle.push_back(key);
    fail(included_from, "extends cycle: " + join(cycle, " -> "));
  }
  if (!fs::is_regular_file(path, ec))
    fail(included_from.empty() ? path : included_from,
         "cannot open config file '" + path + "' (" +
             (fs::is_directory(path, ec) ? "it is a folder, not a YAML file"
              : fs::exists(path, ec)     ? "not a regular file"
                                         : "no such file") +
             ")");
  YAML::Node root;
  try {
    std::ifstream in(path, std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    // An unreadable file must not load as an empty config (YAML::LoadAllFromFile used to throw).
    if (!in) fail(path, "cannot read: " + std::string(std::strerror(errno)));
    const std::string text = buffer.str();
    // A second document would be ignored: refuse it rather than drop its keys. Documents are
    // counted by an event pass that stops at the second, never by YAML::LoadAll: on a ',' outside
    // any [...] or {...} (",", "- x\n,") yaml-cpp 0.7 yields empty documents without consuming
    // input, so LoadAll allocates until memory runs out (found by fuzz_config).
    std::istringstream events(text);
    YAML::Parser parser(events);
    DocumentStarts starts;
    if (parser.HandleNextDocument(starts) && parser.HandleNextDocument(starts)) {
      const int line = starts.second.line;
      fail(line >= 0 ? path + ":" + std::to_string(line + 1) : path,
           "the file holds more than one YAML document (a '---' line after the first, or a ',' "
           "outside any [...] or {...}); put every key in one document");
    }
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    fail(path + ":" + std::to_string(e.mark.line + 1) + ":" + std::to_string(e.mark.column + 1),
         "invalid YAML: " + e.msg);
  } catch (const YAML::Exception& e) {
    fail(path, std::string("cannot read: ") + e.what());
  }
  if (!root.IsDefined() || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);  // sets nothing
  if (!root.IsMap()) fail(path, "the top level must be a map of keys, got " + describe(root));

  chain.push_back(key);
  const std::string dir = fs::path(path).parent_path().string();
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (!it->first.IsScalar() || it->first.Scalar() != "extends") continue;
    const std::string where = path + ":" + std::to_string(it->first.Mark().line + 1);
    std::vector<std::string> bases;
    Ctx c{"extends", where, LayerKind::File, dir, nullptr};
    if (it->second.IsScalar()) {
      bases.push_back(it->second.Scalar());
    } else if (it->second.IsSequence()) {
      bases = parse_str_list(c, it->second);
    } else if (!it->second.IsNull()) {
      type_error(c, "a file path or a list of paths", it->second);
    }
    for (const auto& b : bases) {
      fs::path bp(b);
      if (bp.is_relative()) bp = fs::path(dir.empty() ? "." : dir) / bp;
      apply_file(cfg, bp.lexically_normal().string(), where, chain);
    }
  }
  Applier a{cfg, LayerKind::File, dir.empty() ? "." : dir, {}};
  a.apply_map(root, "", path);
  if (!training_args.empty()) apply_training_args_file(a, training_args, "--training-args");
  chain.pop_back();
}

// ---- after all layers: resolve, check combinations, collect notices ---------------------------

std::string origin(const Config& c, const std::string& path) {
  auto it = c.origins.find(path);
  return it == c.origins.end() ? "the default" : it->second;
}

// The first key given under `prefix` ("fsdp_config."), for messages.
std::string first_key_under(const Config& c, const std::string& prefix) {
  for (const auto& [k, v] : c.origins)
    if (starts_with(k, prefix)) return k + " (" + v + ")";
  return prefix + "*";
}

// Whether an inert key's value would have done nothing in Accelerate either (no notice then).
// `extra`, when given, lists the only neutral scalar values (lower case); otherwise empty, false,
// no, none and 0 are neutral, and a list or map is neutral when all its values are.
bool is_neutral_value(const YAML::Node& n, const std::vector<std::string>& extra) {
  if (!n.IsDefined() || n.IsNull()) return true;
  if (n.IsScalar()) {
    std::string s = lower(trim(n.Scalar()));
    static const std::set<std::string> kNeutral = {"", "false", "no", "none", "null", "~", "0"};
    if (!extra.empty()) return std::find(extra.begin(), extra.end(), s) != extra.end();
    return kNeutral.count(s) > 0;
  }
  for (auto it = n.begin(); it != n.end(); ++it) {
    const YAML::Node& v = n.IsMap() ? it->second : *it;
    if (!is_neutral_value(v, {})) return false;
  }
  return true;
}

void resolve(Config& c) {
  c.deepspeed.gradient_clipping = c.optimizer.grad_clip;
  c.deepspeed.gradient_accumulation_steps = c.gradient_accumulation_steps;

  // Accelerate runs a MULTI_GPU config's processes on the CPU when use_cpu is set.
  if (c.use_cpu && c.distributed_type == DistributedType::MultiGpu) {
    c.notices.push_back("use_cpu is true (" + origin(c, "use_cpu") +
                        "): distributed_type MULTI_GPU runs as MULTI_CPU (DDP over CPU "
                        "processes), as in Accelerate");
    c.distributed_type = DistributedType::MultiCpu;
  }
  if (c.use_cpu) {
    if (c.training.device == DeviceChoice::Cuda)
      throw ConfigError(origin(c, "training.device") +
                        ": training.device is cuda but use_cpu is true (" + origin(c, "use_cpu") +
                        "): drop one of them");
    c.training.device = DeviceChoice::Cpu;
  }
  if (c.distributed_type == DistributedType::MultiCpu) {
    if (c.training.device == DeviceChoice::Cuda)
      throw ConfigError(origin(c, "training.device") +
                        ": training.device is cuda but distributed_type is MULTI_CPU (" +
                        origin(c, "distributed_type") + "): use MULTI_GPU for GPUs");
    c.training.device = DeviceChoice::Cpu;
  }

  c.gpu_id_list.clear();
  if (c.gpu_ids != "all")
    for (auto& p : split(c.gpu_ids, ',')) c.gpu_id_list.push_back(std::stoi(p));

  // Accelerate's boolean turns on full recomputation unless training.activation_checkpointing
  // chose a mode (none included); under FSDP the two keys then agree.
  if (c.fsdp.fsdp_activation_checkpointing &&
      c.training.activation_checkpointing == ActivationCheckpointing::None) {
    if (c.origins.count("training.activation_checkpointing"))
      c.notices.push_back(
          "key fsdp_config.fsdp_activation_checkpointing=true has no effect: "
          "training.activation_checkpointing is none (" +
          origin(c, "training.activation_checkpointing") + ") and wins");
    else
      c.training.activation_checkpointing = ActivationCheckpointing::Full;
  }
  if (c.distributed_type == DistributedType::Fsdp) {
    if (c.fsdp.fsdp_version == 1) {
      c.notices.push_back(
          "key fsdp_config.fsdp_version=1 runs as fsdp_version 2 in accel-train (only FSDP2-style "
          "per-parameter sharding is implemented; the training math is the same)");
      c.fsdp.fsdp_version = 2;
    }
    if (c.fsdp.fsdp_auto_wrap_policy == FsdpWrapPolicy::TransformerBased) {
      // Every family's model has one layer class to wrap: its decoder layer (model.init_from's
      // family replaces model.name's once the folder is read).
      const std::string layer = hf_class_prefix(c.model.name) + "DecoderLayer";
      std::vector<std::string> names;
      for (auto& p : split(c.fsdp.fsdp_transformer_layer_cls_to_wrap, ','))
        if (!trim(p).empty()) names.push_back(trim(p));
      // Only a name given in the config is worth a notice: the default is Llama's, and every
      // family wraps its own layer.
      std::vector<std::string> others;
      if (c.origins.count("fsdp_config.fsdp_transformer_layer_cls_to_wrap"))
        for (auto& n : names)
          if (n != layer) others.push_back(n);
      if (!others.empty())
        c.notices.push_back("key fsdp_config.fsdp_transformer_layer_cls_to_wrap=" +
                            c.fsdp.fsdp_transformer_layer_cls_to_wrap + " names no layer of the " +
                            c.model.name + " model (" + join(others, ", ") + "); each " + layer +
                            " is wrapped");
      c.fsdp.fsdp_transformer_layer_cls_to_wrap = layer;
    }
    c.fsdp.fsdp_activation_checkpointing =
        c.training.activation_checkpointing != ActivationCheckpointing::None;
  }
}

void collect_notices(Config& c) {
  for (const auto& [path, text] : c.inert) {
    const Field* f = find_field(path);
    if (!f || f->always_neutral) continue;
    YAML::Node v;
    try {
      v = YAML::Load(text);
    } catch (const YAML::Exception&) {
    }
    if (is_neutral_value(v, f->neutral)) continue;
    c.notices.push_back("key " + path + "=" + text + " has no effect in accel-train (" + f->why +
                        ")");
  }
  auto given = [&](const std::string& p) { return c.origins.count(p) > 0; };
  // bf16 keeps 8 significant bits: with round-to-nearest, exp_avg_sq's decay by beta2 is lost
  // where 1 - beta2 is below half a bf16 ulp (2^-9 relative, at worst), so the moment cannot
  // shrink (docs/config.md).
  if (c.optimizer.state_dtype == StateDType::Bf16 && c.optimizer.name == OptimizerName::AdamW &&
      1.0 - c.optimizer.beta2 < 1.0 / 256)
    c.notices.push_back(
        "optimizer.state_dtype bf16 with optimizer.beta2=" + fmt_double(c.optimizer.beta2) +
        ": 1 - beta2 is below bf16's resolution (1/256), so exp_avg_sq rounded "
        "to nearest cannot follow a shrinking gradient (it only grows); keep "
        "beta2 <= 0.996 with bf16 state, or use state_dtype fp32");
  if (c.training.num_epochs > 0 && given("training.max_steps"))
    c.notices.push_back("key training.num_epochs=" + fmt_double(c.training.num_epochs) +
                        " has no effect: training.max_steps (" + origin(c, "training.max_steps") +
                        ") is given too and wins (" + std::to_string(c.training.max_steps) +
                        " steps)");
  if (c.data.source == DataSource::Text || c.data.source == DataSource::Synthetic) {
    for (const char* k :
         {"data.jsonl_files", "data.format", "data.text_field", "data.chat_template",
          "data.packing", "data.reset_position_ids", "data.pad_to_multiple_of", "data.overlong"})
      if (given(k))
        c.notices.push_back(std::string("key ") + k + " has no effect with data.source " +
                            name_of(c.data.source) + " (it applies to JSONL documents)");
  } else {
    if (!c.data.packing && given("data.reset_position_ids"))
      c.notices.push_back(
          "key data.reset_position_ids has no effect because data.packing is false");
    if (c.data.packing && given("data.pad_to_multiple_of"))
      c.notices.push_back(
          "key data.pad_to_multiple_of has no effect because data.packing is true (packed rows "
          "are seq_len long)");
    if (c.data.source == DataSource::Shards && given("data.jsonl_files"))
      c.notices.push_back("key data.jsonl_files has no effect with data.source shards");
    if (c.data.format != DataFormat::Auto && c.data.format != DataFormat::Messages &&
        given("data.chat_template"))
      c.notices.push_back(std::string("key data.chat_template has no effect with data.format ") +
                          name_of(c.data.format));
    if (c.data.format != DataFormat::Auto && c.data.format != DataFormat::Text &&
        given("data.text_field"))
      c.notices.push_back(std::string("key data.text_field has no effect with data.format ") +
                          name_of(c.data.format));
  }
  if (c.fp8.present && c.mixed_precision != MixedPrecision::Fp8)
    c.notices.push_back("fp8_config (" + first_key_under(c, "fp8_config.") +
                        ") has no effect because mixed_precision is " + name_of(c.mixed_precision));
  if (c.mixed_precision == MixedPrecision::Fp8) {
    if (c.training.device == DeviceChoice::Cpu)
      c.notices.push_back(
          "mixed_precision fp8 on the CPU runs the exact fp8 emulation (slow; "
          "meant for tests)");
    if (c.fp8.backend == Fp8Backend::AO) {
      for (const char* k :
           {"fp8_config.fp8_format", "fp8_config.amax_history_len", "fp8_config.amax_compute_algo",
            "fp8_config.margin", "fp8_config.interval", "fp8_config.override_linear_precision"})
        if (given(k))
          c.notices.push_back(std::string("key ") + k +
                              " has no effect with fp8 backend AO (its recipe is "
                              "fp8_config.recipe_name: " +
                              name_of(c.fp8.recipe_name) + ")");
    } else {
      for (const char* k : {"fp8_config.pad_inner_dim", "fp8_config.exclude_modules"})
        if (given(k))
          c.notices.push_back(std::string("key ") + k + " has no effect with fp8 backend " +
                              name_of(c.fp8.backend) + " (it applies to backend AO)");
    }
    if (c.fp8.enable_fsdp_float8_all_gather && c.distributed_type != DistributedType::Fsdp)
      c.notices.push_back(
          std::string("key fp8_config.enable_fsdp_float8_all_gather=true has no effect "
                      "because distributed_type is ") +
          name_of(c.distributed_type));
  }
  if (c.distributed_type == DistributedType::DeepSpeed && c.deepspeed.zero3_save_16bit_model &&
      c.deepspeed.zero_stage != 3)
    c.notices.push_back(
        "key deepspeed_config.zero3_save_16bit_model=true has no effect at "
        "zero_stage " +
        std::to_string(c.deepspeed.zero_stage) + " (checkpoints already hold the full model)");
  if (c.distributed_type == DistributedType::Fsdp && given("fsdp_config.fsdp_min_num_params") &&
      c.fsdp.fsdp_auto_wrap_policy != FsdpWrapPolicy::SizeBased)
    c.notices.push_back(
        "key fsdp_config.fsdp_min_num_params has no effect with "
        "fsdp_auto_wrap_policy " +
        std::string(name_of(c.fsdp.fsdp_auto_wrap_policy)));
  if (c.use_cpu && c.gpu_ids != "all")
    c.notices.push_back("key gpu_ids=" + c.gpu_ids + " has no effect because use_cpu is true");
}

}  // namespace

// ---- public API -------------------------------------------------------------------------------

namespace {
// The MoE fields are the model section's (written apart from the distributed code); whichever of
// the two Hugging Face spellings ModelConfig has is read, so this needs no change when they come.
template <class M>
auto experts_field(const M& m, int) -> decltype(static_cast<int64_t>(m.num_experts)) {
  return m.num_experts;
}
template <class M>
int64_t experts_field(const M&, long) {
  return 0;
}
template <class M>
auto local_experts_field(const M& m, int) -> decltype(static_cast<int64_t>(m.num_local_experts)) {
  return m.num_local_experts;
}
template <class M>
int64_t local_experts_field(const M&, long) {
  return 0;
}
}  // namespace

int64_t model_num_experts(const ModelConfig& m) {
  return std::max(experts_field(m, 0), local_experts_field(m, 0));
}

void validate_config(const Config& c) {
  auto err = [&](const std::string& key, const std::string& msg) {
    throw ConfigError(origin(c, key) + ": " + msg);
  };
  if (c.training.eval_every > 0) {
    const std::string every = "training.eval_every is " + std::to_string(c.training.eval_every);
    if (c.data.source == DataSource::Synthetic)
      err("training.eval_every", every +
                                     " but data.source synthetic has no evaluation data: set "
                                     "training.eval_every: 0, or train on text or shards");
    if (c.data.eval_fraction <= 0 && c.data.eval_path.empty())
      err("training.eval_every",
          every +
              " but the data has no evaluation split (data.eval_fraction is 0 and "
              "data.eval_path is empty): hold some out (e.g. data.eval_fraction: 0.05) or "
              "set training.eval_every: 0");
  }
  const DistributedType dt = c.distributed_type;
  const std::string dt_name = name_of(dt);
  if (c.compute_environment != "LOCAL_MACHINE")
    err("compute_environment",
        "compute_environment " + c.compute_environment + " is not supported (use LOCAL_MACHINE)");
  if (c.num_processes < 1) err("num_processes", "num_processes must be at least 1");
  if (c.num_machines < 1) err("num_machines", "num_machines must be at least 1");
  if (c.machine_rank < 0 || c.machine_rank >= c.num_machines)
    err("machine_rank", "machine_rank " + std::to_string(c.machine_rank) + " is outside 0.." +
                            std::to_string(c.num_machines - 1) + " (num_machines " +
                            std::to_string(c.num_machines) + ")");
  if (c.num_processes % c.num_machines != 0)
    err("num_processes", "num_processes " + std::to_string(c.num_processes) +
                             " is not a multiple of num_machines " +
                             std::to_string(c.num_machines) +
                             " (num_processes counts all processes on all machines)");
  if (dt == DistributedType::No && c.num_processes > 1)
    err("num_processes", "num_processes is " + std::to_string(c.num_processes) +
                             " but distributed_type is NO (" + origin(c, "distributed_type") +
                             "), which runs one process: set distributed_type to MULTI_GPU, "
                             "MULTI_CPU, FSDP or DEEPSPEED");
  if (c.fsdp.present && dt != DistributedType::Fsdp)
    throw ConfigError(first_key_under(c, "fsdp_config.") +
                      ": fsdp_config applies only to distributed_type FSDP, but distributed_type "
                      "is " +
                      dt_name + " (" + origin(c, "distributed_type") +
                      "): remove the fsdp_config section or set distributed_type: FSDP");
  if (c.deepspeed.present && dt != DistributedType::DeepSpeed)
    throw ConfigError(first_key_under(c, "deepspeed_config.") +
                      ": deepspeed_config applies only to distributed_type DEEPSPEED, but "
                      "distributed_type is " +
                      dt_name + " (" + origin(c, "distributed_type") +
                      "): remove the deepspeed_config section or set distributed_type: DEEPSPEED");
  if (dt == DistributedType::DeepSpeed) {
    if (c.deepspeed.zero_stage < 1 || c.deepspeed.zero_stage > 3)
      err("deepspeed_config.zero_stage",
          "deepspeed_config.zero_stage " + std::to_string(c.deepspeed.zero_stage) +
              " is not supported: use 1, 2 or 3 (for plain data parallelism use distributed_type "
              "MULTI_GPU)");
    if (c.deepspeed.offload_optimizer_device == OffloadDevice::Nvme)
      err("deepspeed_config.offload_optimizer_device",
          "deepspeed_config.offload_optimizer_device nvme is not supported (use cpu or none)");
    if (c.deepspeed.offload_param_device == OffloadDevice::Nvme)
      err("deepspeed_config.offload_param_device",
          "deepspeed_config.offload_param_device nvme is not supported (use cpu or none)");
    if (c.deepspeed.offload_param_device == OffloadDevice::Cpu && c.deepspeed.zero_stage != 3)
      err("deepspeed_config.offload_param_device",
          "deepspeed_config.offload_param_device cpu needs zero_stage 3 (parameters are only "
          "partitioned at stage 3), but zero_stage is " +
              std::to_string(c.deepspeed.zero_stage));
  }
  // Without optimizer files a checkpoint's weights must be whole: sharded ones live there.
  if (!c.checkpoint.save_optimizer && (c.checkpoint.every_steps > 0 || c.checkpoint.at_end)) {
    if (dt == DistributedType::DeepSpeed && c.deepspeed.zero_stage == 3 &&
        !c.deepspeed.zero3_save_16bit_model)
      err("checkpoint.save_optimizer",
          "checkpoint.save_optimizer is false, but ZeRO-3 keeps the weights only in the optimizer "
          "shards: set deepspeed_config.zero3_save_16bit_model: true (16-bit weights in "
          "model.safetensors) or checkpoint.save_optimizer: true");
    if (dt == DistributedType::Fsdp && c.fsdp.fsdp_state_dict_type == FsdpStateDictType::Sharded)
      err("checkpoint.save_optimizer",
          "checkpoint.save_optimizer is false, but fsdp_state_dict_type SHARDED_STATE_DICT keeps "
          "the weights only in the optimizer shards: set fsdp_config.fsdp_state_dict_type: "
          "FULL_STATE_DICT or checkpoint.save_optimizer: true");
  }
  if (c.use_cpu && dt == DistributedType::MultiGpu)
    err("use_cpu", "use_cpu is true but distributed_type is MULTI_GPU (" +
                       origin(c, "distributed_type") + "): use MULTI_CPU for CPU processes");
  if (!c.use_cpu && c.gpu_ids != "all") {
    int64_t per_machine = c.num_processes / std::max<int64_t>(1, c.num_machines);
    int64_t n = static_cast<int64_t>(split(c.gpu_ids, ',').size());
    if (n < per_machine)
      err("gpu_ids", "gpu_ids " + c.gpu_ids + " lists " + std::to_string(n) + " GPU(s) but " +
                         std::to_string(per_machine) + " processes run on each machine");
  }

  if (const int64_t ep = c.distributed.expert_parallel_size; ep != 1) {
    const std::string what = "distributed.expert_parallel_size " + std::to_string(ep);
    // model.init_from: the folder's config.json gives the experts, read after this check (the
    // trainer's make_expert_parallel checks the count then, naming this key).
    const bool from_folder = !c.model.init_from.empty();
    const int64_t experts = model_num_experts(c.model);
    if (experts == 0 && !from_folder)
      err("distributed.expert_parallel_size",
          what + " splits a mixture-of-experts model's experts over ranks, but the model (" +
              c.model.name +
              ") has no experts (model.num_experts / model.num_local_experts): set "
              "distributed.expert_parallel_size: 1 or train a MoE model");
    if (c.num_processes % ep != 0)
      err("distributed.expert_parallel_size",
          what + " does not divide num_processes " + std::to_string(c.num_processes) +
              ": expert-parallel groups are blocks of " + std::to_string(ep) +
              " consecutive ranks; launch a multiple of " + std::to_string(ep) +
              " processes or pick a divisor of num_processes");
    if (experts % ep != 0 && !from_folder)
      err("distributed.expert_parallel_size",
          what + " does not divide the model's " + std::to_string(experts) +
              " experts: every rank of an expert-parallel group holds the same number of them; "
              "pick a divisor of " +
              std::to_string(experts));
    if (dt == DistributedType::Fsdp && c.fsdp.fsdp_cpu_ram_efficient_loading)
      err("distributed.expert_parallel_size",
          what +
              " with fsdp_config.fsdp_cpu_ram_efficient_loading: only rank 0 would read the "
              "weights, but the experts of the other expert-parallel ranks live elsewhere; set "
              "fsdp_cpu_ram_efficient_loading: false");
  }

  const ModelConfig& m = c.model;
  if (m.head_dim == 0 && m.hidden_size % m.num_attention_heads != 0)
    err("model.hidden_size", "model.hidden_size " + std::to_string(m.hidden_size) +
                                 " is not divisible by model.num_attention_heads " +
                                 std::to_string(m.num_attention_heads) +
                                 " (or set model.head_dim explicitly)");
  if (m.num_key_value_heads > 0) {
    if (m.num_key_value_heads > m.num_attention_heads ||
        m.num_attention_heads % m.num_key_value_heads != 0)
      err("model.num_key_value_heads",
          "model.num_attention_heads " + std::to_string(m.num_attention_heads) +
              " is not divisible by model.num_key_value_heads " +
              std::to_string(m.num_key_value_heads) +
              " (each key/value head serves a whole group of query heads)");
  }
  // Size products must fit in a tensor's element count: an overflowed count would allocate too
  // little and be written past its end. Each check names its keys.
  auto fits = [&](const std::vector<std::pair<const char*, int64_t>>& keys, const char* what) {
    Shape sizes;
    std::string terms;
    for (const auto& [key, value] : keys) {
      sizes.push_back(value);
      terms += (terms.empty() ? "" : " x ") + std::string(key) + " " + std::to_string(value);
    }
    // Name the key given last among the layers (--set, then the environment, then a file).
    const char* named = keys.front().first;
    int rank = 0;
    for (const auto& kv : keys) {
      auto it = c.origins.find(kv.first);
      if (it == c.origins.end()) continue;
      const int r = starts_with(it->second, "--set")         ? 3
                    : starts_with(it->second, "environment") ? 2
                                                             : 1;
      if (r > rank) named = kv.first, rank = r;
    }
    if (checked_numel(sizes) < 0)
      err(named,
          terms + " (" + what + ") is more elements than a tensor can hold (2^60): lower them");
  };
  fits({{"training.micro_batch_size", c.training.micro_batch_size},
        {"training.seq_len", c.training.seq_len},
        {"gradient_accumulation_steps", c.gradient_accumulation_steps},
        {"num_processes", c.num_processes}},
       "tokens per step");
  if (m.init_from.empty()) {
    const int64_t head_dim = m.head_dim ? m.head_dim : m.hidden_size / m.num_attention_heads;
    fits({{"model.vocab_size", m.vocab_size}, {"model.hidden_size", m.hidden_size}},
         "the embedding");
    fits({{"model.intermediate_size", m.intermediate_size}, {"model.hidden_size", m.hidden_size}},
         "an MLP weight");
    fits({{"model.num_attention_heads", m.num_attention_heads},
          {"model.head_dim", head_dim},
          {"model.hidden_size", m.hidden_size}},
         "q_proj's weight");
    fits({{"training.micro_batch_size", c.training.micro_batch_size},
          {"training.seq_len", c.training.seq_len},
          {"model.vocab_size", m.vocab_size}},
         "one micro-batch's logits");
    fits({{"training.micro_batch_size", c.training.micro_batch_size},
          {"training.seq_len", c.training.seq_len},
          {"model.intermediate_size", m.intermediate_size}},
         "one micro-batch's MLP activations");
  }
  if (m.mlp_bias)
    err("model.mlp_bias", "model.mlp_bias true is not supported (MLPs without biases)");
  if (m.attention_dropout != 0)
    err("model.attention_dropout", "model.attention_dropout " + fmt_double(m.attention_dropout) +
                                       " is not supported: accel-train has no dropout (set 0)");
  try {
    validate_rope_scaling(m.rope_scaling, m.max_position_embeddings, "model.rope_scaling");
  } catch (const std::invalid_argument& e) {
    err("model.rope_scaling", e.what());
  }
  // Dynamic RoPE scaling is made for sequences past max_position_embeddings.
  if (m.init_from.empty() && c.training.seq_len > m.max_position_embeddings &&
      m.rope_scaling.rope_type != "dynamic")
    err("training.seq_len", "training.seq_len " + std::to_string(c.training.seq_len) +
                                " exceeds model.max_position_embeddings " +
                                std::to_string(m.max_position_embeddings));

  if (c.fp8.fp8_format == Fp8Format::E5M2)
    err("fp8_config.fp8_format",
        "fp8_config.fp8_format E5M2 is rejected for training: e5m2 has only 2 mantissa bits, too "
        "coarse for weights and activations; use HYBRID (e4m3 forward, e5m2 gradients) or E4M3");
  if (c.mixed_precision == MixedPrecision::Fp8 && c.fp8.backend != Fp8Backend::AO &&
      c.fp8.recipe_name != Fp8RecipeName::Tensorwise)
    err("fp8_config.recipe_name",
        std::string("fp8_config.recipe_name ") + name_of(c.fp8.recipe_name) +
            " needs fp8_config.backend: AO (the recipes are torchao's and DeepSeek-V3's dynamic "
            "scalings); backend " +
            name_of(c.fp8.backend) +
            " has its own recipe keys. Set fp8_config.backend: AO, or remove recipe_name (valid "
            "values: tensorwise, rowwise, rowwise_with_gw_hp, blockwise)");
  if (c.mixed_precision == MixedPrecision::Fp8 && dt == DistributedType::Fsdp &&
      c.fp8.enable_fsdp_float8_all_gather && c.fp8.backend == Fp8Backend::AO &&
      c.fp8.recipe_name != Fp8RecipeName::Tensorwise)
    err("fp8_config.enable_fsdp_float8_all_gather",
        std::string("fp8_config.enable_fsdp_float8_all_gather needs fp8_config.recipe_name: "
                    "tensorwise: the fp8 all-gather carries one scale per weight, recipe ") +
            name_of(c.fp8.recipe_name) +
            " scales weights per row or block (torchao refuses the same combination). Set "
            "recipe_name: tensorwise or enable_fsdp_float8_all_gather: false");
  if (c.mixed_precision == MixedPrecision::Fp8 && c.fp8.backend == Fp8Backend::AO &&
      c.fp8.use_mxfp8_block_scaling)
    err("fp8_config.use_mxfp8_block_scaling",
        "fp8_config.use_mxfp8_block_scaling is a TE option (MXFP8BlockScaling): with backend AO "
        "set it to false, or use backend TE");
  if (c.mixed_precision == MixedPrecision::Fp8 && dt == DistributedType::Fsdp &&
      c.fp8.enable_fsdp_float8_all_gather && c.fp8.backend != Fp8Backend::AO)
    err("fp8_config.enable_fsdp_float8_all_gather",
        std::string(
            "fp8_config.enable_fsdp_float8_all_gather needs fp8_config.backend: AO. The fp8 "
            "all-gather casts every weight shard with a scale from the weight's current global "
            "amax (torchao's dynamic tensorwise scaling, one amax all-reduce after each optimizer "
            "step); backend ") +
            name_of(c.fp8.backend) + " scales weights " +
            (c.fp8.use_mxfp8_block_scaling ? "per 32-element block (MXFP8)"
                                           : "from an amax history (delayed scaling)") +
            ", which a gathered e4m3 weight cannot follow. Set fp8_config.backend: AO, or "
            "enable_fsdp_float8_all_gather: false (the weights are then gathered in bf16 and "
            "cast to fp8 by each layer)");
  if (c.mixed_precision == MixedPrecision::Fp8 && c.fp8.backend == Fp8Backend::MSAMP)
    err("fp8_config.backend", std::string("fp8_config.backend ") + name_of(c.fp8.backend) +
                                  " is not supported with mixed_precision fp8: use TE "
                                  "(delayed scaling) or AO (dynamic scaling)");

  // bf16 masters are the bf16 compute weights themselves (fp8 computes in bf16 too and casts its
  // linear layers' weights from them, FSDP's fp8 all-gather from their shards).
  if (c.optimizer.master_weights == StateDType::Bf16 && c.mixed_precision != MixedPrecision::Bf16 &&
      c.mixed_precision != MixedPrecision::Fp8)
    err("optimizer.master_weights",
        std::string("optimizer.master_weights bf16 makes the bf16 compute weights the master "
                    "copy, but mixed_precision is ") +
            name_of(c.mixed_precision) + " (" + origin(c, "mixed_precision") + "): " +
            (c.mixed_precision == MixedPrecision::No
                 ? "fp32 training computes on its fp32 masters, there is no copy to drop"
                 : "fp16 compute weights cannot be bf16 masters") +
            ". Set mixed_precision: bf16 (or fp8), or optimizer.master_weights: fp32");
  if (c.distributed.backend == CommBackend::Nccl && c.training.device == DeviceChoice::Cpu)
    err("distributed.backend",
        "distributed.backend nccl needs GPU tensors but training.device "
        "is cpu (" +
            origin(c, "training.device") + "): use backend cpu or auto");
  if (c.data.source == DataSource::Jsonl && c.data.jsonl_files.empty())
    err("data.source",
        "data.source is jsonl but data.jsonl_files is empty: list the JSONL files (or glob "
        "patterns)");
  if (c.data.source == DataSource::Shards && c.data.train_path.empty())
    err("data.source",
        "data.source is shards but data.train_path is empty: give the training "
        "shard path (made by accel-data)");
}

Config default_config() { return Config(); }

size_t config_edit_distance(const std::string& a, const std::string& b) {
  return edit_distance(a, b);
}

std::map<std::string, std::string> environment_variables() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string s = *e;
    auto eq = s.find('=');
    if (eq != std::string::npos) env[s.substr(0, eq)] = s.substr(eq + 1);
  }
  return env;
}

Config load_config(const std::string& path, const std::vector<std::string>& set_overrides,
                   const std::map<std::string, std::string>& env,
                   const std::string& training_args_path) {
  Config cfg;
  if (!path.empty()) {
    cfg.source_path = path;
    std::vector<std::string> chain;
    apply_file(cfg, path, "", chain, training_args_path);
  } else if (!training_args_path.empty()) {
    Applier a{cfg, LayerKind::File, ".", {}};
    apply_training_args_file(a, training_args_path, "--training-args");
  }

  // Environment: ACCEL_<PATH> with '.' spelled "__" ("ACCEL_TRAINING__MAX_STEPS"). Variables
  // without "__" that name no top-level key belong to something else and are ignored.
  {
    Applier a{cfg, LayerKind::Env, "", {}};
    for (const auto& [name, value] : env) {
      if (!starts_with(name, "ACCEL_") || name.size() == 6) continue;
      std::string rest = lower(name.substr(6));
      std::string p;
      for (size_t i = 0; i < rest.size(); ++i) {
        if (rest.compare(i, 2, "__") == 0) {
          p += '.';
          ++i;
        } else {
          p += rest[i];
        }
      }
      bool structured = rest.find("__") != std::string::npos;
      if (!structured && !find_field(p)) continue;
      const std::string where = "environment variable " + text_excerpt(name);
      if (p == "extends") fail(where, "extends can only be used inside a config file");
      a.apply_key(p, YAML::Node(value), where);
    }
  }

  {
    Applier a{cfg, LayerKind::Set, "", {}};
    for (const auto& s : set_overrides) {
      const std::string where = "--set " + text_excerpt(s);
      auto eq = s.find('=');
      if (eq == std::string::npos || trim(s.substr(0, eq)).empty())
        fail(where, "expected KEY=VALUE, e.g. --set training.max_steps=100");
      std::string key = trim(s.substr(0, eq));
      if (key == "extends") fail(where, "extends can only be used inside a config file");
      a.apply_key(key, YAML::Node(s.substr(eq + 1)), where);
    }
  }

  resolve(cfg);
  validate_config(cfg);
  collect_notices(cfg);
  return cfg;
}

std::string config_to_yaml(const Config& c) {
  std::ostringstream o;
  o << "# accel-train effective configuration (load it back with --config)\n";
  auto emit_keys = [&](const std::string& section, const std::string& indent) {
    for (const auto& f : schema()) {
      if (parent_of(f.path) != section || f.alias || f.inert || !f.get) continue;
      // Its values are already in the keys it set; reading it again could contradict a later
      // override.
      if (f.path == "deepspeed_config.deepspeed_config_file") continue;
      // Before the data is read, an epoch run's max_steps is only the default: written out, it
      // would count as given when loaded back and win over num_epochs.
      if (f.path == "training.max_steps" && c.training.num_epochs > 0 &&
          !c.origins.count("training.max_steps")) {
        o << indent << "# max_steps: from num_epochs once the data is read\n";
        continue;
      }
      o << indent << leaf_of(f.path) << ": " << f.get(c) << "\n";
    }
    for (const auto& [path, text] : c.inert)
      if (parent_of(path) == section) o << indent << leaf_of(path) << ": " << text << "\n";
  };
  emit_keys("", "");
  auto section = [&](const std::string& name) {
    o << name << ":\n";
    emit_keys(name, "  ");
  };
  if (c.distributed_type == DistributedType::Fsdp) section("fsdp_config");
  if (c.distributed_type == DistributedType::DeepSpeed) section("deepspeed_config");
  if (c.mixed_precision == MixedPrecision::Fp8 || c.fp8.present) section("fp8_config");
  for (const char* s :
       {"model", "training", "optimizer", "data", "checkpoint", "logging", "distributed"})
    section(s);
  return o.str();
}

std::vector<ConfigKeyInfo> config_keys() {
  const Config d;
  std::vector<ConfigKeyInfo> out;
  for (const auto& f : schema()) {
    ConfigKeyInfo k;
    k.path = f.path;
    k.type = f.type;
    k.doc = f.doc;
    k.accelerate = f.accelerate;
    k.inert = f.inert;
    k.alias = f.alias;
    const Field* canon = f.group.empty() ? &f : find_field(f.group);
    if (canon->get) k.default_value = canon->get(d);
    if (f.path == "deepspeed_config.deepspeed_config_file") k.default_value = "\"\"";
    out.push_back(k);
  }
  return out;
}

std::string config_reference_markdown() {
  std::ostringstream o;
  std::vector<std::string> sections = {""};
  sections.insert(sections.end(), kSections.begin(), kSections.end());
  for (const auto& sec : sections) {
    o << "### " << (sec.empty() ? "Top level (Accelerate)" : "`" + sec + ":`") << "\n\n";
    o << "| key | type | default | meaning |\n|---|---|---|---|\n";
    for (const auto& k : config_keys()) {
      if (parent_of(k.path) != sec) continue;
      std::string doc = k.doc;
      if (k.alias) doc = "Alias. " + doc;
      std::string def = (k.inert || k.alias) ? "-" : "`" + k.default_value + "`";
      std::string type = k.type;
      for (auto& ch : type)
        if (ch == '|') ch = '/';
      o << "| `" << leaf_of(k.path) << "` | " << type << " | " << def << " | " << doc << " |\n";
    }
    if (sec.empty())
      o << "| `extends` | path or list of paths | - | Files this one builds on, relative to this "
           "file; applied first, in order (cycles are an error). |\n";
    o << "\n";
  }
  return o.str();
}

}  // namespace accel
