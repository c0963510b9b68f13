// Resuming refuses a sharded checkpoint whose shard layout differs from the run's
// (tools/trainer/checkpoint.h check_same_shard_layout).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "tools/trainer/checkpoint.h"

namespace accel {
namespace {

nlohmann::json manifest(const std::string& layout, int64_t shard_numel) {
  nlohmann::json group = {{"name", "group0"}, {"world", 2}, {"shard_numel", shard_numel}};
  if (!layout.empty()) group["layout"] = layout;
  return {{"strategy", "fsdp"}, {"sharded", true}, {"groups", nlohmann::json::array({group})}};
}

TEST(ShardLayoutCheck, SameLayoutResumes) {
  EXPECT_NO_THROW(check_same_shard_layout("ck", manifest("dim0", 64), manifest("dim0", 64)));
}

TEST(ShardLayoutCheck, NoManifestOnEitherSideIsNotChecked) {
  EXPECT_NO_THROW(check_same_shard_layout("ck", nlohmann::json::object(), manifest("dim0", 64)));
  EXPECT_NO_THROW(check_same_shard_layout("ck", manifest("dim0", 64), nullptr));
}

TEST(ShardLayoutCheck, OtherLayoutIsRefusedSayingWhatToDo) {
  for (const nlohmann::json& saved : {manifest("", 64), manifest("dim0", 80)}) {
    try {
      check_same_shard_layout("ck/step_5", saved, manifest("dim0", 64));
      FAIL() << "a checkpoint with another layout was accepted: " << saved.dump();
    } catch (const std::runtime_error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("ck/step_5"), std::string::npos) << msg;
      EXPECT_NE(msg.find("laid out differently"), std::string::npos) << msg;
      EXPECT_NE(msg.find("accel-checkpoint consolidate"), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace accel
