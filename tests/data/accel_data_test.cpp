// The accel-data command line, run as a process.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>

#include "runtime/data/loader.h"
#include "runtime/data/shard.h"
#include "tests/data/test_util.h"

namespace accel {
namespace {

using testing::TempDir;
using testing::write_bytes;

struct ToolRun {
  int code;
  std::string output;  // stdout and stderr
};

ToolRun run(const std::string& args) {
  const std::string cmd = std::string(ACCEL_BIN_DIR) + "/accel-data " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ToolRun r{-1, ""};
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class AccelData : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(std::string(ACCEL_BIN_DIR) + "/accel-data")) {
      GTEST_SKIP() << "accel-data is not built (ninja accel-data)";
    }
  }
};

TEST_F(AccelData, TokenizesTextIntoTrainAndEvalShards) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 200; ++i) text += "Fortune " + std::to_string(i) + ": all is well.\n%\n";
  write_bytes(dir.file("a.txt"), text);
  std::string other = text;  // the same size, not a duplicate (those are skipped)
  other[0] = 'f';
  write_bytes(dir.file("b.txt"), other);
  const std::string out = dir.file("shards");
  ToolRun r = run("--tokenizer byte --out " + out + " --eval-fraction 0.1 --shard-tokens 4000 '" +
                  dir.file("*.txt") + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("tokenizer: byte-level (vocab 256)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(out + "/train/train-00000.tok"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(out + "/eval/eval-00000.tok"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("manifest.json"), std::string::npos) << r.output;

  // The folders feed the loader directly.
  DataOptions o;
  o.files = {out + "/train"};
  o.eval_files = {out + "/eval"};
  o.seq_len = 64;
  o.micro_batch_size = 2;
  o.vocab_size = 256;
  auto d = make_data_sources(o);
  const int64_t total = 2 * static_cast<int64_t>(text.size());
  EXPECT_NEAR(d.train->position().num_samples + d.eval->position().num_samples, total / 64, 3);

  r = run("--info --tokenizer byte --decode 20 " + out + "/train");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("uint16, vocab_size 256"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("first 20 tokens: Fortune 0: all is we"), std::string::npos) << r.output;
}

TEST_F(AccelData, ErrorsAreClear) {
  TempDir dir;
  ToolRun r = run("--out " + dir.file("o") + " " + dir.file("missing.txt"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("missing.txt' does not exist"), std::string::npos) << r.output;

  write_bytes(dir.file("a.txt"), "hello");
  r = run("--tokenizer " + dir.file("nope.json") + " --out " + dir.file("o") + " " +
          dir.file("a.txt"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("nope.json': no such file"), std::string::npos) << r.output;

  r = run(dir.file("a.txt"));  // no --out
  EXPECT_EQ(r.code, 2);
  r = run("--out x --eval-fraction 2 " + dir.file("a.txt"));
  EXPECT_EQ(r.code, 2) << r.output;

  write_bytes(dir.file("bad.tok"),
              "NOTASHARD-------------------------------------------------------");
  r = run("--info " + dir.file("bad.tok"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("is not a token shard"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace accel
