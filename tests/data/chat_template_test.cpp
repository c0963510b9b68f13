// Chat templates against transformers: tests/data/chat/<family>/expected.json holds what
// apply_chat_template(messages, tokenize=False) rendered with the official template in
// <family>/tokenizer_config.json, and the assistant spans TRL's assistant-only loss trains
// (tools/reference/make_chat_template_fixture.py).
#include "runtime/data/chat_template.h"

#include <gtest/gtest.h>

#include <ctime>
#include <string>
#include <vector>

#include "runtime/json.h"
#include "tests/data/test_util.h"

namespace accel {
namespace {

using testing::TempDir;
using testing::write_bytes;

const char* const kFamilies[] = {"llama3", "llama3_2", "chatml", "qwen3", "mistral"};

std::string fixture_dir(const std::string& family) {
  return std::string(ACCEL_TEST_DATA_DIR) + "/chat/" + family;
}
std::string config_path(const std::string& family) {
  return fixture_dir(family) + "/tokenizer_config.json";
}

std::vector<ChatMessage> messages_of(const nlohmann::json& c) {
  std::vector<ChatMessage> msgs;
  for (const auto& m : c.at("messages")) {
    msgs.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
  }
  return msgs;
}

ChatTemplateOptions options_of(const nlohmann::json& c) {
  ChatTemplateOptions options;
  if (c.contains("kwargs")) options.date_string = c["kwargs"].value("date_string", "");
  return options;
}

std::vector<std::pair<size_t, size_t>> spans_of(const nlohmann::json& c) {
  std::vector<std::pair<size_t, size_t>> spans;
  for (const auto& s : c.at("trained")) spans.emplace_back(s.at(0), s.at(1));
  return spans;
}

// `expect` with the message of the ChatTemplateError `fn` throws.
template <class Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const ChatTemplateError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ChatTemplateError";
  return "";
}

// Each conversation of each family through `auto`: the text and trained spans transformers gave,
// or an error where the official template raised one.
TEST(ChatTemplate, MatchesTransformersForEveryFixture) {
  int rendered = 0, refused = 0;
  for (const std::string family : kFamilies) {
    const nlohmann::json expected = read_json_file(fixture_dir(family) + "/expected.json");
    ASSERT_GE(expected.at("cases").size(), 20u) << family;
    for (const auto& c : expected.at("cases")) {
      SCOPED_TRACE(family + " / " + c.at("name").get<std::string>());
      const ChatTemplate t =
          ChatTemplate::from_tokenizer_config(config_path(family), options_of(c));
      const std::vector<ChatMessage> msgs = messages_of(c);
      if (c.contains("error")) {
        EXPECT_FALSE(error_of([&] { t.render(msgs); }).empty());
        ++refused;
        continue;
      }
      const RenderedChat r = t.render(msgs);
      EXPECT_EQ(r.text, c.at("text").get<std::string>());
      EXPECT_EQ(r.trained, spans_of(c));
      ++rendered;
    }
  }
  EXPECT_GE(rendered, 100);
  EXPECT_GE(refused, 3);  // mistral's alternation check
}

// by_name renders as auto does for the family's template (llama3 is Llama 3.1's).
TEST(ChatTemplate, ByNameEqualsAuto) {
  for (const std::string family : {"llama3", "chatml", "qwen3", "mistral"}) {
    const nlohmann::json expected = read_json_file(fixture_dir(family) + "/expected.json");
    for (const auto& c : expected.at("cases")) {
      if (c.contains("error")) continue;
      SCOPED_TRACE(family + " / " + c.at("name").get<std::string>());
      const ChatTemplate t = ChatTemplate::by_name(family, options_of(c));
      EXPECT_EQ(t.name(), family);
      const RenderedChat r = t.render(messages_of(c));
      EXPECT_EQ(r.text, c.at("text").get<std::string>());
      EXPECT_EQ(r.trained, spans_of(c));
    }
  }
}

TEST(ChatTemplate, AutoNamesTheRenderer) {
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(config_path("llama3")).description(),
            "llama3 (Llama 3.1 Instruct, date 26 Jul 2024)");
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(config_path("llama3_2")).name(), "llama3");
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(config_path("chatml")).description(),
            "chatml (Qwen2.5 Instruct)");
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(config_path("qwen3")).name(), "qwen3");
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(config_path("mistral")).description(),
            "mistral (Mistral-7B-Instruct-v0.3)");
}

// Llama 3.2's template takes the day's date (transformers' strftime_now) unless date_string is
// given; Llama 3.1's has a fixed default.
TEST(ChatTemplate, Llama32DefaultsToTheLocalDate) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char today[32];
  std::strftime(today, sizeof today, "%d %b %Y", &tm);
  const RenderedChat r =
      ChatTemplate::from_tokenizer_config(config_path("llama3_2")).render({{"user", "hi"}});
  EXPECT_NE(r.text.find(std::string("Today Date: ") + today + "\n\n"), std::string::npos) << r.text;
  const RenderedChat fixed =
      ChatTemplate::from_tokenizer_config(config_path("llama3_2"), {"02 Jan 2025"})
          .render({{"user", "hi"}});
  EXPECT_NE(fixed.text.find("Today Date: 02 Jan 2025\n\n"), std::string::npos);
}

// The fixture configs with their template changed in ways that do or do not change the output.
class AutoDetection : public ::testing::Test {
 protected:
  std::string with_template(const std::string& family, const nlohmann::json& chat_template) {
    nlohmann::json config = read_json_file(config_path(family));
    config["chat_template"] = chat_template;
    const std::string path = dir_.file(family + "_tokenizer_config.json");
    write_bytes(path, config.dump());
    return path;
  }
  std::string official(const std::string& family) {
    return read_json_file(config_path(family)).at("chat_template").get<std::string>();
  }
  TempDir dir_;
};

TEST_F(AutoDetection, AcceptsOneTrailingNewlineMore) {
  for (const std::string family : kFamilies) {
    std::string t = official(family);
    // jinja drops one trailing newline: a template with or without it renders the same.
    if (!t.empty() && t.back() == '\n') {
      t.pop_back();
    } else {
      t.push_back('\n');
    }
    EXPECT_NO_THROW(ChatTemplate::from_tokenizer_config(with_template(family, t))) << family;
  }
}

TEST_F(AutoDetection, RefusesAModifiedTemplate) {
  for (const std::string family : kFamilies) {
    SCOPED_TRACE(family);
    const std::string t = official(family);
    // An X after the first end-of-turn marker, inside a string literal: the output changes.
    std::string changed = t;
    size_t at = std::string::npos;
    for (const char* marker : {"<|eot_id|>", "<|im_end|>", "[/INST]"}) {
      if (at == std::string::npos && changed.find(marker) != std::string::npos) {
        at = changed.find(marker) + std::string(marker).size();
      }
    }
    ASSERT_NE(at, std::string::npos);
    changed.insert(at, "X");
    const std::string path = with_template(family, changed);
    const std::string msg = error_of([&] { ChatTemplate::from_tokenizer_config(path); });
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("data.chat_template"), std::string::npos) << msg;
    EXPECT_NE(msg.find("not rendered approximately"), std::string::npos) << msg;
    // Two trailing newlines: jinja keeps the second one, so the output changes.
    EXPECT_FALSE(error_of([&] {
                   ChatTemplate::from_tokenizer_config(with_template(family, t + "\n\n"));
                 }).empty());
  }
}

TEST_F(AutoDetection, ListOfNamedTemplatesUsesDefault) {
  const nlohmann::json list = {{{"name", "tool_use"}, {"template", "{{ messages }}"}},
                               {{"name", "default"}, {"template", official("qwen3")}}};
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(with_template("qwen3", list)).name(), "qwen3");
  const nlohmann::json no_default = {{{"name", "tool_use"}, {"template", official("qwen3")}}};
  const std::string msg =
      error_of([&] { ChatTemplate::from_tokenizer_config(with_template("qwen3", no_default)); });
  EXPECT_NE(msg.find("without a \"default\" entry"), std::string::npos) << msg;
}

TEST_F(AutoDetection, MissingOrMalformedTemplate) {
  nlohmann::json config = read_json_file(config_path("chatml"));
  config.erase("chat_template");
  const std::string path = dir_.file("tokenizer_config.json");
  write_bytes(path, config.dump());
  std::string msg = error_of([&] { ChatTemplate::from_tokenizer_config(path); });
  EXPECT_NE(msg.find("'" + path + "' has no chat_template"), std::string::npos) << msg;
  EXPECT_NE(msg.find("llama3|chatml|qwen3|mistral"), std::string::npos) << msg;

  msg = error_of([&] { ChatTemplate::from_tokenizer_config(with_template("chatml", 7)); });
  EXPECT_NE(msg.find("not a string or a list"), std::string::npos) << msg;
  EXPECT_THROW(ChatTemplate::from_tokenizer_config(dir_.file("absent.json")), JsonError);
}

// A template that writes bos_token / eos_token renders the official tokens; a config that names
// others would render differently, so it is refused.
TEST_F(AutoDetection, RefusesOtherSpecialTokens) {
  nlohmann::json config = read_json_file(config_path("mistral"));
  config["eos_token"] = {{"content", "<|end|>"}, {"lstrip", false}};
  const std::string path = dir_.file("tokenizer_config.json");
  write_bytes(path, config.dump());
  const std::string msg = error_of([&] { ChatTemplate::from_tokenizer_config(path); });
  EXPECT_NE(msg.find("eos_token is '<|end|>' instead of '</s>'"), std::string::npos) << msg;
  config["eos_token"] = {{"content", "</s>"}};  // the AddedToken form of the official token
  write_bytes(path, config.dump());
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(path).name(), "mistral");
}

TEST(ChatTemplate, UnknownNameListsTheNames) {
  const std::string msg = error_of([] { ChatTemplate::by_name("llama2"); });
  EXPECT_NE(msg.find("'llama2'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("llama3|chatml|qwen3|mistral"), std::string::npos) << msg;
  EXPECT_EQ(ChatTemplate::names(),
            (std::vector<std::string>{"llama3", "chatml", "qwen3", "mistral"}));
}

TEST(ChatTemplate, BadConversationsNameIndexAndRole) {
  for (const std::string& name : ChatTemplate::names()) {
    SCOPED_TRACE(name);
    const ChatTemplate t = ChatTemplate::by_name(name);
    EXPECT_NE(error_of([&] { t.render({}); }).find("no messages"), std::string::npos);
    std::string msg = error_of([&] { t.render({{"user", "q"}, {"tool", "x"}}); });
    EXPECT_NE(msg.find("message 1 (role 'tool'): unsupported role"), std::string::npos) << msg;
    msg = error_of([&] { t.render({{"user", "q"}, {"system", "s"}, {"assistant", "a"}}); });
    EXPECT_NE(msg.find("message 1 (role 'system'): a system message may only be the first"),
              std::string::npos)
        << msg;
    msg = error_of([&] { t.render({{"system", "s"}}); });
    EXPECT_NE(msg.find("no user or assistant message"), std::string::npos) << msg;
    msg = error_of([&] { t.render({{"user", "q"}, {"assistant", "a\xff"}}); });
    EXPECT_NE(msg.find("message 1 (role 'assistant'): the content is not valid UTF-8"),
              std::string::npos)
        << msg;
  }
  const ChatTemplate mistral = ChatTemplate::by_name("mistral");
  const std::string msg = error_of([&] {
    mistral.render({{"system", "s"}, {"user", "a"}, {"user", "b"}});
  });
  EXPECT_NE(msg.find("message 2 has role 'user' where 'assistant' is needed"), std::string::npos)
      << msg;
}

// Every trained span ends with the family's end-of-turn marker and lies inside the text, in order.
TEST(ChatTemplate, SpansEndWithTheEndOfTurnMarker) {
  const std::vector<ChatMessage> msgs = {
      {"system", "s"}, {"user", "q1"}, {"assistant", " a1 "}, {"user", "q2"}, {"assistant", ""}};
  const std::pair<const char*, const char*> markers[] = {{"llama3", "<|eot_id|>"},
                                                         {"chatml", "<|im_end|>\n"},
                                                         {"qwen3", "<|im_end|>\n"},
                                                         {"mistral", "</s>"}};
  for (const auto& [name, marker] : markers) {
    const RenderedChat r = ChatTemplate::by_name(name).render(msgs);
    ASSERT_EQ(r.trained.size(), 2u) << name;
    size_t previous_end = 0;
    for (const auto& [b, e] : r.trained) {
      ASSERT_LE(previous_end, b);
      ASSERT_LE(e, r.text.size());
      EXPECT_EQ(r.text.substr(0, e).substr(e - std::string(marker).size()), marker) << name;
      previous_end = e;
    }
  }
}

}  // namespace
}  // namespace accel
