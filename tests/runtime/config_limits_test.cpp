// Hostile config files (issue 26): sizes whose products overflow, YAML alias bombs, a second
// document or a repeated key, a folder given as the config. Each is a ConfigError naming the file,
// the line or the key.
#include <gtest/gtest.h>
#include <pthread.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "runtime/config.h"

namespace accel {
namespace {

namespace fs = std::filesystem;

class ConfigLimits : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/accel_config_limits_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    std::string p = dir_ + "/" + name;
    std::ofstream(p) << text;
    return p;
  }
  std::string dir_;
};

// The ConfigError message of fn ("" when it throws none), each piece checked.
std::string config_error(const std::function<void()>& fn, const std::vector<std::string>& pieces) {
  std::string msg;
  try {
    fn();
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  EXPECT_FALSE(msg.empty()) << "expected a ConfigError";
  for (const auto& p : pieces)
    EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  return msg;
}

const std::string kSmall =
    "model: {hidden_size: 64, num_hidden_layers: 1, num_attention_heads: 2,\n"
    "        intermediate_size: 128, vocab_size: 256, max_position_embeddings: 64}\n"
    "training: {seq_len: 32, micro_batch_size: 2}\n";

TEST_F(ConfigLimits, SizesWhoseProductsOverflowNameTheKey) {
  const std::string path = write("c.yaml", kSmall);
  const std::string huge = "4611686018427387904";  // 2^62
  config_error([&] { load_config(path, {"model.hidden_size=" + huge}, {}); },
               {"--set model.hidden_size=" + huge, "model.hidden_size " + huge, "2^60"});
  config_error([&] { load_config(path, {"model.vocab_size=" + huge}, {}); },
               {"--set model.vocab_size=", "model.vocab_size " + huge, "the embedding"});
  config_error([&] { load_config(path, {"training.micro_batch_size=" + huge}, {}); },
               {"--set training.micro_batch_size=", "tokens per step"});
  config_error([&] { load_config(path, {"model.intermediate_size=" + huge}, {}); },
               {"model.intermediate_size " + huge});
  // No single product overflows, the logits of one micro-batch do.
  config_error(
      [&] { load_config(path, {"training.micro_batch_size=1125899906842624"}, {}); },
      {"training.micro_batch_size 1125899906842624 x training.seq_len 32 x model.vocab_size"});
  // From the file too, naming its line.
  const std::string big = write("big.yaml", "model:\n  vocab_size: " + huge + "\n");
  config_error([&] { load_config(big, {}, {}); }, {big + ":2", "model.vocab_size"});
  EXPECT_NO_THROW(load_config(path, {}, {}));
}

// A chain of 8 aliases, each a list of 9 references to the one before: 453 bytes that stand for
// 9^8 (43 million) nodes.
std::string alias_bomb(const std::string& indent) {
  std::string s = indent + "a0: &a0 [x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i <= 8; ++i) {
    const std::string prev = "*a" + std::to_string(i - 1);
    s += indent + "a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
    for (int k = 0; k < 9; ++k) s += (k ? ", " : "") + prev;
    s += "]\n";
  }
  return s;
}

TEST_F(ConfigLimits, AliasBombsAreRefusedWithoutExpanding) {
  const auto start = std::chrono::steady_clock::now();
  for (const char* key : {"debug", "dynamo_config"}) {
    const std::string path =
        write(std::string(key) + ".yaml", std::string(key) + ":\n" + alias_bomb("  "));
    config_error([&] { load_config(path, {}, {}); },
                 {path + ":1", key, "more than 10000 YAML nodes", "aliases"});
  }
  // The same in an environment variable (a YAML flow value).
  std::string flow = "{a0: &a0 [x, x, x, x, x, x, x, x, x]";
  for (int i = 1; i <= 8; ++i) {
    flow += ", a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
    for (int k = 0; k < 9; ++k) flow += (k ? ", *a" : "*a") + std::to_string(i - 1);
    flow += "]";
  }
  flow += "}";
  config_error(
      [&] {
        load_config("", {}, {{"ACCEL_DYNAMO_CONFIG", flow}});
      },
      {"environment variable ACCEL_DYNAMO_CONFIG", "more than 10000 YAML nodes"});
  // A bomb where a single value is expected: the message shows a short excerpt, not the
  // expansion.
  const std::string typed = write("typed.yaml", "training:\n  max_steps: " + flow + "\n");
  const std::string msg = config_error([&] { load_config(typed, {}, {}); },
                                       {typed + ":2", "training.max_steps: expected an integer"});
  EXPECT_LT(msg.size(), 400u) << msg;
  // Each of these used to expand to 43 million nodes (minutes, then std::bad_alloc).
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  // Many aliases of one long scalar: 5000 x 200 KB (it took a minute and 2.4 GB).
  std::string many = "debug:\n  s: &s " + std::string(200000, 'y') + "\n  l: [*s";
  for (int i = 1; i < 5000; ++i) many += ", *s";
  const std::string wide = write("wide.yaml", many + "]\n");
  config_error([&] { load_config(wide, {}, {}); }, {wide + ":1", "debug", "1 MiB of text"});
  std::string list = "data:\n  text_files: [&f " + std::string(200000, 'y');
  for (int i = 0; i < 10; ++i) list += ", *f";
  const std::string files = write("files.yaml", list + "]\n");
  config_error([&] { load_config(files, {}, {}); }, {"data.text_files", "1 MiB of text"});
  // Aliases that stay small are fine.
  const std::string ok = write("ok.yaml", "debug:\n  a: &v [1, 2]\n  b: *v\n");
  EXPECT_NO_THROW(load_config(ok, {}, {}));
}

// Runs fn on a thread with a stack of `bytes` (the main thread's 8 MiB hides deep recursion).
void run_on_small_stack(size_t bytes, std::function<void()> fn) {
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, bytes), 0);
  pthread_t thread;
  auto body = [](void* arg) -> void* {
    (*static_cast<std::function<void()>*>(arg))();
    return nullptr;
  };
  ASSERT_EQ(pthread_create(&thread, &attr, body, &fn), 0);
  pthread_join(thread, nullptr);
  pthread_attr_destroy(&attr);
}

// 512 KiB, or 4 MiB under AddressSanitizer, whose frames are several times larger (the old
// recursive walk overflowed ASan's 8 MiB main stack).
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kSmallStack = 4 << 20;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr size_t kSmallStack = 4 << 20;
#else
constexpr size_t kSmallStack = 512 << 10;
#endif
#else
constexpr size_t kSmallStack = 512 << 10;
#endif

// An alias inside its own anchor's value (`&a [*a]`) makes the value a cycle. fuzz_config found
// that walking it recursively, 10,000 calls deep, overflowed the stack under AddressSanitizer; on
// a small stack it overflows in any build.
TEST_F(ConfigLimits, ASelfReferencingAliasIsRefusedWithoutDeepRecursion) {
  // And a chain of anchors that nests 150 deep without a cycle, and the same shapes under
  // training_args (read as one JSON object: a cycle there recursed without end).
  std::string chain = "debug:\n  a0: &a0 x\n";
  for (int i = 1; i <= 150; ++i)
    chain += "  a" + std::to_string(i) + ": &a" + std::to_string(i) + " [*a" +
             std::to_string(i - 1) + "]\n";
  for (const std::string& text :
       {std::string("debug:\n  a: &a [*a, x]\n"), std::string("debug:\n  m: &m {k: *m}\n"),
        std::string("dynamo_config: &d {a: [*d]}\n"), chain,
        std::string("training_args: &t {learning_rate: 0.1, x: *t}\n"),
        "training_args:\n" + alias_bomb("  ")}) {
    const std::string path = write("cycle.yaml", text);
    std::string msg;
    run_on_small_stack(kSmallStack, [&] {
      try {
        load_config(path, {}, {});
      } catch (const ConfigError& e) {
        msg = e.what();
      }
    });
    EXPECT_NE(msg.find("more than 10000 YAML nodes, 1 MiB of text or 100 levels of nesting"),
              std::string::npos)
        << text.substr(0, 80) << ": " << msg;
  }
}

TEST_F(ConfigLimits, ASecondDocumentOrARepeatedKeyIsRefused) {
  const std::string two = write("two.yaml", kSmall + "---\ntraining: {max_steps: 5}\n");
  // The line of the second document's "---".
  config_error([&] { load_config(two, {}, {}); }, {two + ":4", "more than one YAML document"});
  // A ',' outside any flow collection: yaml-cpp's LoadAll never ends on these (it ran out of
  // memory under fuzz_config); the loader stops at the second document.
  for (const char* text : {",", ",x\n", "# c\n,", "- x\n,", "---\n,"}) {
    const std::string comma = write("comma.yaml", text);
    config_error([&] { load_config(comma, {}, {}); }, {comma, "more than one YAML document"});
  }
  const std::string twice =
      write("twice.yaml", kSmall + "optimizer: {lr: 0.1}\ntraining:\n  max_steps: 5\n");
  config_error([&] { load_config(twice, {}, {}); },
               {twice + ":5", "'training' is given twice", "first at line 3"});
  const std::string inner =
      write("inner.yaml", "training:\n  max_steps: 5\n  seed: 1\n  max_steps: 5\n");
  config_error([&] { load_config(inner, {}, {}); },
               {inner + ":4", "'training.max_steps' is given twice", "first at line 2"});
}

// Found by fuzz_config: an unknown key of 256 KB was echoed whole and compared with every valid
// key (2 s in a release build, 20 s under ASan).
TEST_F(ConfigLimits, AHugeUnknownKeyIsCutAndQuick) {
  // The process's CPU time, not the wall clock: a loaded CI machine stretches the latter.
  const std::clock_t start = std::clock();
  const std::string key = "x" + std::string(256 << 10, '_');
  const std::string msg = config_error([&] { load_config("", {key + "=1"}, {}); },
                                       {"unknown key 'x___", "(262145 characters)"});
  EXPECT_LT(msg.size(), 300u) << msg.substr(0, 300);
  EXPECT_LT(static_cast<double>(std::clock() - start) / CLOCKS_PER_SEC, 0.5);
}

TEST_F(ConfigLimits, AFolderAsTheConfigIsNamedAsSuch) {
  config_error([&] { load_config(dir_, {}, {}); }, {dir_, "it is a folder, not a YAML file"});
  config_error([&] { load_config(dir_ + "/none.yaml", {}, {}); }, {"no such file"});
}

}  // namespace
}  // namespace accel
