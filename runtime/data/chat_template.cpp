#include "runtime/data/chat_template.h"

#include <cstdint>
#include <cstdio>
#include <ctime>
#include <string_view>

#include "runtime/data/random.h"
#include "runtime/data/unicode.h"
#include "runtime/json.h"

namespace accel {
namespace {

constexpr const char* kNamesList = "llama3|chatml|qwen3|mistral";

// What jinja's `trim` (Python's str.strip()) removes: Unicode White_Space plus U+001C..U+001F,
// which Python's str.isspace() also counts.
bool is_python_space(uint32_t cp) { return is_whitespace(cp) || (cp >= 0x1C && cp <= 0x1F); }

// Python's s.strip() on valid UTF-8.
std::string_view python_strip(std::string_view s) {
  size_t begin = s.size(), end = 0;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const size_t n = utf8_decode(s.data() + i, s.size() - i, &cp);
    if (!is_python_space(cp)) {
      if (begin == s.size()) begin = i;
      end = i + n;
    }
    i += n;
  }
  return begin < end ? s.substr(begin, end - begin) : std::string_view();
}

// Python's s.lstrip(c) / s.rstrip(c) / s.strip(c) for a one-character c.
std::string_view lstrip_char(std::string_view s, char c) {
  while (!s.empty() && s.front() == c) s.remove_prefix(1);
  return s;
}
std::string_view rstrip_char(std::string_view s, char c) {
  while (!s.empty() && s.back() == c) s.remove_suffix(1);
  return s;
}
std::string_view strip_char(std::string_view s, char c) {
  return lstrip_char(rstrip_char(s, c), c);
}

// Python's s.split(sep)[0] and s.split(sep)[-1].
std::string_view before_first(std::string_view s, std::string_view sep) {
  const size_t at = s.find(sep);
  return at == std::string_view::npos ? s : s.substr(0, at);
}
std::string_view after_last(std::string_view s, std::string_view sep) {
  const size_t at = s.rfind(sep);
  return at == std::string_view::npos ? s : s.substr(at + sep.size());
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    i += utf8_decode(s.data() + i, s.size() - i, &cp);
    if (cp >= kInvalidCodePointBase) return false;
  }
  return true;
}

// Builds the text and its trained spans.
class Output {
 public:
  void add(std::string_view s) { chat_.text.append(s); }
  void begin_trained() { begin_ = chat_.text.size(); }
  void end_trained() { chat_.trained.emplace_back(begin_, chat_.text.size()); }
  RenderedChat take() { return std::move(chat_); }

 private:
  RenderedChat chat_;
  size_t begin_ = 0;
};

bool has_system(const std::vector<ChatMessage>& msgs) {
  return !msgs.empty() && msgs[0].role == "system";
}

RenderedChat render_llama3(const std::vector<ChatMessage>& msgs, const std::string& date) {
  Output out;
  out.add("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n");
  out.add("Cutting Knowledge Date: December 2023\nToday Date: ");
  out.add(date);
  out.add("\n\n");
  if (has_system(msgs)) out.add(python_strip(msgs[0].content));
  out.add("<|eot_id|>");
  for (size_t i = has_system(msgs) ? 1 : 0; i < msgs.size(); ++i) {
    out.add("<|start_header_id|>");
    out.add(msgs[i].role);
    out.add("<|end_header_id|>\n\n");
    const bool assistant = msgs[i].role == "assistant";
    if (assistant) out.begin_trained();
    out.add(python_strip(msgs[i].content));
    out.add("<|eot_id|>");
    if (assistant) out.end_trained();
  }
  return out.take();
}

RenderedChat render_chatml(const std::vector<ChatMessage>& msgs) {
  Output out;
  out.add("<|im_start|>system\n");
  out.add(has_system(msgs)
              ? msgs[0].content
              : "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  out.add("<|im_end|>\n");
  for (size_t i = has_system(msgs) ? 1 : 0; i < msgs.size(); ++i) {
    const bool assistant = msgs[i].role == "assistant";
    out.add("<|im_start|>");
    out.add(msgs[i].role);
    if (assistant) out.begin_trained();
    out.add("\n");
    out.add(msgs[i].content);
    out.add("<|im_end|>\n");
    if (assistant) out.end_trained();
  }
  return out.take();
}

RenderedChat render_qwen3(const std::vector<ChatMessage>& msgs) {
  Output out;
  if (has_system(msgs)) {
    out.add("<|im_start|>system\n");
    out.add(msgs[0].content);
    out.add("<|im_end|>\n");
  }
  // The last user turn that is a query (not a tool response written as a user turn): assistant
  // turns after it show their reasoning; earlier ones lose it.
  size_t last_query = msgs.size() - 1;
  for (size_t i = msgs.size(); i-- > 0;) {
    const std::string& c = msgs[i].content;
    const bool tool_response = c.rfind("<tool_response>", 0) == 0 && c.size() >= 16 &&
                               c.compare(c.size() - 16, 16, "</tool_response>") == 0;
    if (msgs[i].role == "user" && !tool_response) {
      last_query = i;
      break;
    }
  }
  for (size_t i = has_system(msgs) ? 1 : 0; i < msgs.size(); ++i) {
    std::string_view content = msgs[i].content;
    if (msgs[i].role != "assistant") {
      out.add("<|im_start|>");
      out.add(msgs[i].role);
      out.add("\n");
      out.add(content);
      out.add("<|im_end|>\n");
      continue;
    }
    std::string_view reasoning;
    if (content.find("</think>") != std::string_view::npos) {
      reasoning = lstrip_char(
          after_last(rstrip_char(before_first(content, "</think>"), '\n'), "<think>"), '\n');
      content = lstrip_char(after_last(content, "</think>"), '\n');
    }
    out.add("<|im_start|>assistant\n");
    out.begin_trained();
    const bool last = i + 1 == msgs.size();
    if (i > last_query && (last || !reasoning.empty())) {
      out.add("<think>\n");
      out.add(strip_char(reasoning, '\n'));
      out.add("\n</think>\n\n");
      out.add(lstrip_char(content, '\n'));
    } else {
      out.add(content);
    }
    out.add("<|im_end|>\n");
    out.end_trained();
  }
  return out.take();
}

RenderedChat render_mistral(const std::vector<ChatMessage>& msgs) {
  Output out;
  out.add("<s>");
  const size_t first = has_system(msgs) ? 1 : 0;
  for (size_t i = first; i < msgs.size(); ++i) {
    if (msgs[i].role == "user") {
      out.add("[INST] ");
      // The template places the system prompt before the last message only when that message is
      // a user turn; a conversation ending with an assistant turn renders without it.
      if (first == 1 && i + 1 == msgs.size()) {
        out.add(msgs[0].content);
        out.add("\n\n");
      }
      out.add(msgs[i].content);
      out.add("[/INST]");
    } else {
      out.begin_trained();
      out.add(" ");
      out.add(python_strip(msgs[i].content));
      out.add("</s>");
      out.end_trained();
    }
  }
  return out.take();
}

std::string local_date() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%d %b %Y", &tm);
  return buf;
}

// A template as the renderer recognizes it: its byte length and FNV-1a 64 after one trailing
// newline is dropped (tools/reference/make_chat_template_fixture.py --fingerprints prints them).
struct KnownTemplate {
  size_t bytes;
  uint64_t fnv;
  const char* family;  // a by_name name
  const char* origin;
  const char* bos_token;  // what the template reads as bos_token / eos_token (nullptr: unused)
  const char* eos_token;
  bool date_from_clock;  // Llama 3.2's strftime_now default instead of "26 Jul 2024"
};

constexpr KnownTemplate kKnownTemplates[] = {
    {4613, 0x20d2eb6b6cfa618aull, "llama3", "Llama 3.1 Instruct", "<|begin_of_text|>", nullptr,
     false},
    {3826, 0x67fd6bd9cc9cd066ull, "llama3", "Llama 3.2 Instruct", "<|begin_of_text|>", nullptr,
     true},
    {2506, 0x81caee86d484f13full, "chatml", "Qwen2.5 Instruct", nullptr, nullptr, false},
    {4168, 0x3780662234a55403ull, "qwen3", "Qwen3", nullptr, nullptr, false},
    {3958, 0xeaef67b8de3feed9ull, "mistral", "Mistral-7B-Instruct-v0.3", "<s>", "</s>", false},
};

// A special token of tokenizer_config.json: a string or an AddedToken object with "content".
std::string special_token(const nlohmann::json& config, const char* key) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

std::string hex64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

const std::vector<std::string>& ChatTemplate::names() {
  static const std::vector<std::string> names = {"llama3", "chatml", "qwen3", "mistral"};
  return names;
}

ChatTemplate ChatTemplate::by_name(const std::string& name) { return by_name(name, {}); }

ChatTemplate ChatTemplate::by_name(const std::string& name, const ChatTemplateOptions& options) {
  const std::string date = options.date_string.empty() ? "26 Jul 2024" : options.date_string;
  if (name == "llama3") return ChatTemplate(Family::kLlama3, name, "Llama 3.1 Instruct", date);
  if (name == "chatml") return ChatTemplate(Family::kChatml, name, "Qwen2.5 Instruct", "");
  if (name == "qwen3") return ChatTemplate(Family::kQwen3, name, "Qwen3", "");
  if (name == "mistral") {
    return ChatTemplate(Family::kMistral, name, "Mistral-7B-Instruct-v0.3", "");
  }
  throw ChatTemplateError("unknown chat template '" + text_excerpt(name) + "': use one of " +
                          kNamesList +
                          ", or auto to take it from the model's tokenizer_config.json");
}

ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& path) {
  return from_tokenizer_config(path, {});
}

ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& path,
                                                 const ChatTemplateOptions& options) {
  const nlohmann::json config = read_json_file(path);
  const std::string choose = std::string("; set data.chat_template to one of ") + kNamesList +
                             " explicitly if the data is meant to be rendered in that format";
  if (!config.is_object()) {
    throw ChatTemplateError("'" + path + "' is not a JSON object (a tokenizer_config.json)" +
                            choose);
  }
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) {
    throw ChatTemplateError("'" + path + "' has no chat_template" + choose);
  }
  std::string text;
  if (it->is_string()) {
    text = it->get<std::string>();
  } else if (it->is_array()) {
    // The list-of-named form: apply_chat_template without tools renders the "default" entry.
    bool found = false;
    for (const auto& entry : *it) {
      if (entry.is_object() && entry.value("name", nlohmann::json()) == "default" &&
          entry.contains("template") && entry["template"].is_string()) {
        text = entry["template"].get<std::string>();
        found = true;
        break;
      }
    }
    if (!found) {
      throw ChatTemplateError("'" + path +
                              "': chat_template is a list without a \"default\" entry" + choose);
    }
  } else {
    throw ChatTemplateError("'" + path + "': chat_template is " + json_excerpt(*it) +
                            ", not a string or a list of {name, template}" + choose);
  }
  if (!text.empty() && text.back() == '\n') text.pop_back();
  const uint64_t fnv = fnv1a64(text);
  for (const KnownTemplate& known : kKnownTemplates) {
    if (known.bytes != text.size() || known.fnv != fnv) continue;
    for (const auto& [key, expected] :
         {std::pair{"bos_token", known.bos_token}, std::pair{"eos_token", known.eos_token}}) {
      if (expected == nullptr) continue;
      const std::string got = special_token(config, key);
      if (got != expected) {
        throw ChatTemplateError("'" + path + "': the chat_template is " + known.origin +
                                "'s, which writes " + key + ", but " + key + " is '" +
                                text_excerpt(got) + "' instead of '" + expected +
                                "'; the built-in renderer writes '" + expected + "'" + choose);
      }
    }
    std::string date = options.date_string;
    if (date.empty()) date = known.date_from_clock ? local_date() : "26 Jul 2024";
    const ChatTemplate t = by_name(known.family, {date});
    return ChatTemplate(t.family_, t.name_, known.origin, t.date_string_);
  }
  throw ChatTemplateError(
      "'" + path + "': its chat_template (" + std::to_string(text.size()) + " bytes, FNV-1a " +
      hex64(fnv) +
      ") is none of the official templates rendered here exactly (Llama 3.1 and 3.2 Instruct, "
      "Qwen2.5 Instruct, Qwen3, Mistral-7B-Instruct-v0.3), and a modified template is not "
      "rendered approximately" +
      choose);
}

std::string ChatTemplate::description() const {
  std::string s = name_ + " (" + origin_;
  if (family_ == Family::kLlama3) s += ", date " + date_string_;
  return s + ")";
}

void ChatTemplate::check_roles(const std::vector<ChatMessage>& msgs) const {
  const std::string who = "chat template " + name_ + ": ";
  if (msgs.empty()) throw ChatTemplateError(who + "the conversation has no messages");
  bool any_turn = false;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const std::string& role = msgs[i].role;
    const std::string at = "message " + std::to_string(i) + " (role '" + text_excerpt(role) + "')";
    if (role == "system") {
      if (i != 0) {
        throw ChatTemplateError(who + at + ": a system message may only be the first message");
      }
    } else if (role == "user" || role == "assistant") {
      any_turn = true;
    } else {
      throw ChatTemplateError(who + at +
                              ": unsupported role; the roles are system (first message only), "
                              "user and assistant");
    }
    if (!valid_utf8(msgs[i].content)) {
      throw ChatTemplateError(who + at + ": the content is not valid UTF-8");
    }
  }
  if (!any_turn) {
    throw ChatTemplateError(who + "the conversation has no user or assistant message");
  }
  if (family_ == Family::kMistral) {
    const size_t first = has_system(msgs) ? 1 : 0;
    for (size_t i = first; i < msgs.size(); ++i) {
      const char* expected = (i - first) % 2 == 0 ? "user" : "assistant";
      if (msgs[i].role != expected) {
        throw ChatTemplateError(who + "message " + std::to_string(i) + " has role '" +
                                msgs[i].role + "' where '" + expected +
                                "' is needed: after the optional system message, Mistral's "
                                "template requires user/assistant/user/... alternating");
      }
    }
  }
}

RenderedChat ChatTemplate::render(const std::vector<ChatMessage>& msgs) const {
  check_roles(msgs);
  switch (family_) {
    case Family::kLlama3:
      return render_llama3(msgs, date_string_);
    case Family::kChatml:
      return render_chatml(msgs);
    case Family::kQwen3:
      return render_qwen3(msgs);
    case Family::kMistral:
      return render_mistral(msgs);
  }
  throw ChatTemplateError("chat template: unknown family");
}

}  // namespace accel
