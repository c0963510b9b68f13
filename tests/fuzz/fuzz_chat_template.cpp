// libFuzzer: the chat template renderers on random conversations. The input is split at 0x00 bytes
// into messages; a message's first byte picks its role (0 system, 1 user, 2 assistant, 3 tool,
// else user) and the rest is its content. Rendering either succeeds or throws ChatTemplateError;
// a success must have one trained span per assistant message, in order, inside the text, each
// ending with the family's end-of-turn marker.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "runtime/data/chat_template.h"

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

const char* end_marker(const std::string& name) {
  if (name == "llama3") return "<|eot_id|>";
  if (name == "mistral") return "</s>";
  return "<|im_end|>\n";  // chatml, qwen3
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const char* const kRoles[] = {"system", "user", "assistant", "tool"};
  std::vector<accel::ChatMessage> msgs;
  size_t assistants = 0;
  for (size_t i = 0; i <= size && msgs.size() < 64;) {
    size_t end = i;
    while (end < size && data[end] != 0) ++end;
    if (end > i) {
      const std::string role = data[i] < 4 ? kRoles[data[i]] : "user";
      assistants += role == "assistant";
      msgs.push_back({role, std::string(reinterpret_cast<const char*>(data) + i + 1, end - i - 1)});
    }
    i = end + 1;
  }
  for (const std::string& name : accel::ChatTemplate::names()) {
    accel::RenderedChat r;
    try {
      r = accel::ChatTemplate::by_name(name).render(msgs);
    } catch (const accel::ChatTemplateError&) {
      continue;
    }
    check(r.trained.size() == assistants);
    const std::string marker = end_marker(name);
    size_t previous_end = 0;
    for (const auto& [begin, end] : r.trained) {
      check(previous_end <= begin && begin <= end && end <= r.text.size());
      check(end - begin >= marker.size() &&
            r.text.compare(end - marker.size(), marker.size(), marker) == 0);
      previous_end = end;
    }
  }
  return 0;
}
