// TensorBoard event files: CRC-32C against published check values, the TFRecord framing read back
// byte by byte, and the scalars of metrics.jsonl objects. (The real reader, the tensorboard Python
// package, reads these files in tools/reference/check_tensorboard.py where it is installed.)
#include "tools/trainer/tensorboard.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tensorboard.pb.h"  // generated from tools/trainer/tensorboard.proto
#include "tests/data/test_util.h"
#include "tests/tools/run_tool.h"

namespace fs = std::filesystem;

namespace {

uint64_t get_u64(const std::string& s, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

uint32_t get_u32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

// Every record of an event file, checking both CRCs of each.
std::vector<tensorflow::Event> read_events(const std::string& path) {
  const std::string bytes = accel::testing::read_bytes(path);
  std::vector<tensorflow::Event> events;
  size_t at = 0;
  while (at < bytes.size()) {
    EXPECT_LE(at + 12, bytes.size());
    const uint64_t len = get_u64(bytes, at);
    EXPECT_EQ(get_u32(bytes, at + 8), accel::masked_crc32c(bytes.data() + at, 8));
    EXPECT_LE(at + 12 + len + 4, bytes.size());
    const std::string payload = bytes.substr(at + 12, len);
    EXPECT_EQ(get_u32(bytes, at + 12 + len), accel::masked_crc32c(payload.data(), payload.size()));
    tensorflow::Event e;
    EXPECT_TRUE(e.ParseFromString(payload));
    events.push_back(e);
    at += 12 + len + 4;
  }
  return events;
}

TEST(TensorBoard, Crc32cMatchesPublishedCheckValues) {
  EXPECT_EQ(accel::crc32c("123456789", 9), 0xE3069283u);  // the CRC catalogue's check value
  const std::vector<unsigned char> zeros(32, 0), ones(32, 0xff);
  EXPECT_EQ(accel::crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4
  EXPECT_EQ(accel::crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  // The mask: rotate right 15, add 0xa282ead8.
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(accel::masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TensorBoard, MetricsObjectsBecomeTaggedScalars) {
  const nlohmann::json line = nlohmann::json::parse(
      R"({"step": 7, "loss": 2.5, "lr": 0.001, "mfu": null, "strategy": "ddp",
          "host_busy_ms_per_step": {"forward": 1.5, "backward": 3}, "skipped_steps": 0})");
  const auto s = accel::metrics_scalars(line);
  const std::vector<std::pair<std::string, double>> want = {{"host_busy_ms_per_step/backward", 3},
                                                            {"host_busy_ms_per_step/forward", 1.5},
                                                            {"loss", 2.5},
                                                            {"lr", 0.001},
                                                            {"skipped_steps", 0}};
  EXPECT_EQ(s, want);
}

TEST(TensorBoard, EventFileHoldsTheVersionThenEachStepsScalars) {
  const fs::path dir = fs::temp_directory_path() / ("accel_tb_test_" + std::to_string(getpid()));
  fs::remove_all(dir);
  std::string path;
  {
    accel::TensorBoardWriter w((dir / "tb").string());
    path = w.path();
    w.add_metrics(nlohmann::json::parse(R"({"step": 1, "loss": 5.5, "lr": 1e-4})"), 100.5);
    w.add_metrics(nlohmann::json::parse(R"({"step": 2, "eval_loss": 4.25})"), 101.0);
    w.add_metrics(nlohmann::json::parse(R"({"summary": true, "steps": 2})"), 102.0);  // no step
    w.flush();
  }
  EXPECT_EQ(fs::path(path).parent_path(), dir / "tb");
  EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u);
  const std::vector<tensorflow::Event> ev = read_events(path);
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0].file_version(), "brain.Event:2");
  EXPECT_EQ(ev[1].step(), 1);
  EXPECT_DOUBLE_EQ(ev[1].wall_time(), 100.5);
  ASSERT_EQ(ev[1].summary().value_size(), 2);
  EXPECT_EQ(ev[1].summary().value(0).tag(), "loss");
  EXPECT_EQ(ev[1].summary().value(0).simple_value(), 5.5f);
  EXPECT_EQ(ev[1].summary().value(1).tag(), "lr");
  EXPECT_EQ(ev[1].summary().value(1).simple_value(), 1e-4f);
  EXPECT_EQ(ev[2].step(), 2);
  ASSERT_EQ(ev[2].summary().value_size(), 1);
  EXPECT_EQ(ev[2].summary().value(0).tag(), "eval_loss");
  EXPECT_EQ(ev[2].summary().value(0).simple_value(), 4.25f);
  fs::remove_all(dir);
}

TEST(TensorBoard, AFolderThatCannotBeMadeIsAnErrorNamingIt) {
  const fs::path file = fs::temp_directory_path() / ("accel_tb_file_" + std::to_string(getpid()));
  accel::testing::write_bytes(file.string(), "x");
  try {
    accel::TensorBoardWriter w((file / "tb").string());
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(file.string()), std::string::npos) << e.what();
  }
  fs::remove(file);
}

// The scalars of every event file in `dir`, by (tag, step); each (tag, step) at most once.
std::map<std::pair<std::string, int64_t>, float> scalars_in(const fs::path& dir) {
  std::map<std::pair<std::string, int64_t>, float> out;
  for (const auto& e : fs::directory_iterator(dir))
    for (const tensorflow::Event& ev : read_events(e.path().string()))
      for (const auto& v : ev.summary().value()) {
        const auto key = std::make_pair(v.tag(), ev.step());
        EXPECT_EQ(out.count(key), 0u) << v.tag() << " at step " << ev.step() << " twice";
        out[key] = v.simple_value();
      }
  return out;
}

// What metrics.jsonl says, in the same form (numbers as float32, as TensorBoard keeps them).
std::map<std::pair<std::string, int64_t>, float> scalars_of_metrics(const fs::path& file) {
  std::map<std::pair<std::string, int64_t>, float> out;
  for (const nlohmann::json& j : accel::tool_test::read_metrics(file))
    if (j.contains("step"))
      for (const auto& [tag, v] : accel::metrics_scalars(j))
        out[{tag, j["step"].get<int64_t>()}] = static_cast<float>(v);
  return out;
}

const char* kTiny = R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 64, max_position_embeddings: 64}
training: {seed: 7, max_steps: 8, micro_batch_size: 2, seq_len: 16, log_every: 2, progress: plain,
           device: cpu}
data: {source: synthetic}
checkpoint: {every_steps: 4, keep_last: 0}
)";

TEST(TensorBoard, ARunsEventFilesHoldEveryMetricsScalarOnceAlsoAfterAResume) {
  const fs::path d = accel::tool_test::fresh_temp_dir("accel_tb_run", "resume");
  const fs::path cfg = accel::tool_test::write_config(d, kTiny);
  const std::string out = (d / "out").string();
  auto r = accel::tool_test::run_accel_train("--config " + cfg.string() + " --output-dir " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto want = scalars_of_metrics(d / "out" / "metrics.jsonl");
  EXPECT_GT(want.size(), 20u);
  EXPECT_EQ(scalars_in(d / "out" / "tb"), want);
  // Resume from step 4: steps 5-8 run again; the event files still hold each step once.
  r = accel::tool_test::run_accel_train("--config " + cfg.string() + " --output-dir " + out +
                                        " --resume " + out + "/checkpoints/step_4" +
                                        " --move-newer-checkpoints-aside");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto resumed = scalars_of_metrics(d / "out" / "metrics.jsonl");
  EXPECT_EQ(scalars_in(d / "out" / "tb"), resumed);
  EXPECT_EQ(resumed.count({"loss", 8}), 1u);
  // logging.tensorboard: false writes none.
  r = accel::tool_test::run_accel_train("--config " + cfg.string() + " --output-dir " + out +
                                        "2 --set logging.tensorboard=false");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(fs::exists(d / "out2" / "tb"));
}

}  // namespace
