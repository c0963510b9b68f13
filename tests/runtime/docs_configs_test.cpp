// The complete configs that Accelerate's and Transformers' docs print (tests/data/config/docs_*)
// load unchanged on a CPU machine: only num_processes and use_cpu are overridden, as a user
// trying them on a laptop would.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/config.h"
#include "tests/runtime/config_test_util.h"

namespace accel {
namespace {

using config_test::has_notice;
using config_test::notices_text;
using config_test::spelled;

const std::string kData = std::string(ACCEL_TEST_DATA_DIR) + "/config/";

// Loads a docs config with the CPU overrides; the effective config loads back the same.
Config load_docs(const std::string& name, const std::vector<std::string>& overrides) {
  Config c = load_config(kData + name, overrides, {});
  const std::string yaml = config_to_yaml(c);
  const std::string back_path = ::testing::TempDir() + "/docs_back_" + name;
  std::ofstream(back_path) << yaml;
  EXPECT_EQ(config_to_yaml(load_config(back_path, {}, {})), yaml) << name;
  EXPECT_EQ(spelled(c.training.device), "cpu") << name;
  return c;
}

TEST(DocsConfigs, TransformersAccelerateFsdp2) {
  Config c = load_docs("docs_transformers_fsdp2.yaml", {"num_processes=2", "use_cpu=true"});
  EXPECT_EQ(spelled(c.distributed_type), "FSDP");
  EXPECT_EQ(c.fsdp.fsdp_version, 2);
  EXPECT_FALSE(c.fsdp.fsdp_offload_params);  // fsdp_cpu_offload: false
  EXPECT_TRUE(c.fsdp.fsdp_reshard_after_forward);
  EXPECT_TRUE(c.fsdp.fsdp_cpu_ram_efficient_loading);
  EXPECT_EQ(spelled(c.fsdp.fsdp_state_dict_type), "SHARDED_STATE_DICT");
  EXPECT_EQ(spelled(c.mixed_precision), "bf16");
  EXPECT_TRUE(c.notices.empty()) << notices_text(c);
}

TEST(DocsConfigs, AccelerateFp8TransformerEngine) {
  Config c = load_docs("docs_fp8_te.yaml", {"use_cpu=true"});
  EXPECT_EQ(spelled(c.mixed_precision), "fp8");
  EXPECT_EQ(spelled(c.fp8.backend), "TE");
  EXPECT_EQ(spelled(c.fp8.amax_compute_algo), "max");
  EXPECT_EQ(c.fp8.amax_history_len, 1024);
  EXPECT_FALSE(c.fp8.override_linear_precision_wgrad);
  EXPECT_TRUE(has_notice(c, "exact fp8 emulation")) << notices_text(c);
}

TEST(DocsConfigs, AccelerateFp8TorchaoUnderFsdp2) {
  Config c = load_docs("docs_fp8_ao_fsdp2.yaml", {"num_processes=2", "use_cpu=true"});
  EXPECT_EQ(spelled(c.distributed_type), "FSDP");
  EXPECT_EQ(spelled(c.fp8.backend), "AO");
  EXPECT_TRUE(c.fp8.pad_inner_dim);
  EXPECT_TRUE(c.fp8.enable_fsdp_float8_all_gather);
  EXPECT_FALSE(c.fsdp.fsdp_cpu_ram_efficient_loading);
  EXPECT_TRUE(has_notice(c, "key dynamo_config={dynamo_backend: INDUCTOR")) << notices_text(c);
  // As the guide prints it (no distributed_type), fsdp_config has no FSDP to apply to: the same
  // file Accelerate refuses for the missing distributed_type gets a message saying what to add.
  std::ifstream in(kData + "docs_fp8_ao_fsdp2.yaml");
  std::stringstream kept;
  for (std::string line; std::getline(in, line);)
    if (line.rfind("distributed_type", 0) != 0) kept << line << "\n";
  const std::string frag = ::testing::TempDir() + "/docs_fp8_ao_fragment.yaml";
  std::ofstream(frag) << kept.str();
  try {
    load_config(frag, {"use_cpu=true"}, {});
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("set distributed_type: FSDP"), std::string::npos)
        << e.what();
  }
}

TEST(DocsConfigs, AccelerateDeepSpeedZero3WithAJsonFile) {
  Config c = load_docs("docs_deepspeed_zero3.yaml", {"num_processes=2", "use_cpu=true"});
  EXPECT_EQ(spelled(c.distributed_type), "DEEPSPEED");
  EXPECT_EQ(c.deepspeed.zero_stage, 3);
  EXPECT_EQ(spelled(c.deepspeed.offload_optimizer_device), "cpu");
  EXPECT_EQ(spelled(c.deepspeed.offload_param_device), "cpu");
  EXPECT_EQ(spelled(c.mixed_precision), "fp16");
  EXPECT_DOUBLE_EQ(c.training.loss_scale_init, 65536);  // initial_scale_power 16
  EXPECT_TRUE(has_notice(c, "zero_optimization.overlap_comm")) << notices_text(c);
}

TEST(DocsConfigs, AccelerateWizardMultiGpu) {
  // use_cpu runs a MULTI_GPU config's processes on the CPU, as Accelerate does.
  Config c = load_docs("docs_multi_gpu.yaml", {"use_cpu=true"});
  EXPECT_EQ(spelled(c.distributed_type), "MULTI_CPU");
  EXPECT_EQ(c.num_processes, 2);
  EXPECT_EQ(spelled(c.mixed_precision), "fp16");
  EXPECT_TRUE(has_notice(c, "distributed_type MULTI_GPU runs as MULTI_CPU")) << notices_text(c);
}

}  // namespace
}  // namespace accel
