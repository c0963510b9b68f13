// STUB (branch data): the interface agreed with branch `chat`, which implements it; this file is
// replaced by theirs when `chat` is merged. Every renderer refuses until then.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace accel {

struct RenderedChat {
  std::string text;
  std::vector<std::pair<size_t, size_t>> trained;  // [begin, end) bytes of text
};
struct ChatMessage {
  std::string role, content;
};

class ChatTemplate {
 public:
  static ChatTemplate by_name(const std::string& name);  // llama3|chatml|qwen3|mistral
  static ChatTemplate from_tokenizer_config(const std::string& path);
  RenderedChat render(const std::vector<ChatMessage>& msgs) const;
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

}  // namespace accel
