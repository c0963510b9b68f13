// STUB (branch data): replaced by branch `chat`'s renderers when it is merged.
#include "runtime/data/chat_template.h"

#include <stdexcept>

namespace accel {

ChatTemplate ChatTemplate::by_name(const std::string& name) {
  throw std::runtime_error("chat template '" + name +
                           "': chat templates are not in this build yet");
}
ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& path) {
  throw std::runtime_error(path + ": chat templates are not in this build yet");
}
RenderedChat ChatTemplate::render(const std::vector<ChatMessage>&) const {
  throw std::runtime_error("chat templates are not in this build yet");
}

}  // namespace accel
