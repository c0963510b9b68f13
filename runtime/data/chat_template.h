// Chat templates for `messages` SFT data: a conversation rendered to the text the model trains on,
// with the byte spans of that text an assistant-only loss trains.
//
// Built-in renderers, one per template family, each producing exactly the text transformers'
// `tokenizer.apply_chat_template(messages, tokenize=False)` produces with that family's official
// template (string contents, no tools, no generation prompt):
//   llama3   meta-llama/Llama-3.1-8B-Instruct (also Llama 3.2 Instruct through `auto`): the system
//            header with "Cutting Knowledge Date: December 2023" and "Today Date: <date_string>"
//   chatml   Qwen2.5 Instruct: ChatML with Qwen's default system prompt when none is given
//   qwen3    Qwen3: ChatML with the <think> block handling of assistant turns
//   mistral  mistralai/Mistral-7B-Instruct-v0.3: [INST] ... [/INST], the system prompt put before
//            the last user message (and so dropped when the conversation ends with an assistant)
// `trained` follows TRL's assistant-only loss (the {% generation %} blocks of its training copies
// of these templates): llama3 content|trim + <|eot_id|>; chatml "\n" + content + "<|im_end|>\n";
// qwen3 everything after "<|im_start|>assistant\n" through "<|im_end|>\n" (the think block
// included); mistral " " + content|trim + "</s>". docs/data.md ("Chat templates") has the details;
// tests/data/chat holds transformers' renderings (tools/reference/make_chat_template_fixture.py).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace accel {

struct RenderedChat {
  std::string text;
  std::vector<std::pair<size_t, size_t>> trained;  // [begin, end) byte offsets into text, in order
};

struct ChatMessage {
  std::string role, content;
};

// A conversation or tokenizer_config.json the renderer refuses; what() says what and what to do.
class ChatTemplateError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ChatTemplateOptions {
  // llama3 only: the "Today Date:" line, e.g. "26 Jul 2024". Empty: the template's own default,
  // "26 Jul 2024" for Llama 3.1 (and by_name("llama3")); for a Llama 3.2 template (auto) the
  // local date at construction, "%d %b %Y", as transformers' strftime_now gives it.
  std::string date_string;
};

class ChatTemplate {
 public:
  // llama3 | chatml | qwen3 | mistral (names()); anything else is a ChatTemplateError.
  static ChatTemplate by_name(const std::string& name);
  static ChatTemplate by_name(const std::string& name, const ChatTemplateOptions& options);
  // "auto": the renderer whose official template tokenizer_config.json's `chat_template` is (the
  // string, or the "default" entry of the list-of-named form), compared byte for byte after
  // dropping one trailing newline (jinja drops it too). Any other template is refused: this
  // renderer never renders approximately.
  static ChatTemplate from_tokenizer_config(const std::string& path);
  static ChatTemplate from_tokenizer_config(const std::string& path,
                                            const ChatTemplateOptions& options);
  // The names by_name accepts, for messages.
  static const std::vector<std::string>& names();

  // Roles: an optional "system" first, then "user" and "assistant" (strictly alternating from
  // "user" for mistral, as its template demands). Contents must be UTF-8. Throws
  // ChatTemplateError naming the message index and role otherwise.
  RenderedChat render(const std::vector<ChatMessage>& msgs) const;
  const std::string& name() const { return name_; }
  // What `auto` found or by_name chose, for the log: "llama3 (Llama 3.1 Instruct, date 26 Jul
  // 2024)".
  std::string description() const;

 private:
  enum class Family { kLlama3, kChatml, kQwen3, kMistral };
  ChatTemplate(Family family, std::string name, std::string origin, std::string date_string)
      : family_(family),
        name_(std::move(name)),
        origin_(std::move(origin)),
        date_string_(std::move(date_string)) {}
  void check_roles(const std::vector<ChatMessage>& msgs) const;

  Family family_;
  std::string name_;
  std::string origin_;       // the official template it reproduces
  std::string date_string_;  // llama3's "Today Date:"
};

}  // namespace accel
