#include "parallel/strategy.h"

#include <nlohmann/json.hpp>
#include <stdexcept>

#include "parallel/ddp.h"
#include "parallel/fsdp.h"
#include "parallel/process_group.h"
#include "parallel/zero.h"
#include "runtime/config.h"

namespace accel {

nlohmann::json Strategy::checkpoint_manifest() const { return nullptr; }
nlohmann::json Strategy::run_report() const { return nullptr; }

namespace {
[[noreturn]] void no_param_state(const std::string& strategy) {
  throw std::logic_error("strategy " + strategy +
                         " does not export layout-independent state for checkpoints");
}
}  // namespace

std::vector<ParamStateSlice> Strategy::param_state_slices() { no_param_state(name()); }
std::vector<std::string> Strategy::state_kinds() const { no_param_state(name()); }
void Strategy::import_param_state(const ParamStateReader&, int64_t) { no_param_state(name()); }

std::unique_ptr<Strategy> make_strategy(const Config& cfg, std::shared_ptr<ProcessGroup> pg,
                                        DType compute_dtype) {
  const DistributedType type = cfg.distributed_type;
  const int world = pg ? pg->size() : 1;
  if (type == DistributedType::No) {
    if (world > 1)
      throw std::invalid_argument(
          "distributed_type NO runs one process, but " + std::to_string(world) +
          " were launched; set distributed_type MULTI_GPU/MULTI_CPU (DDP) or DEEPSPEED (ZeRO)");
    return std::make_unique<SingleProcessStrategy>(compute_dtype);
  }
  if (type == DistributedType::MultiGpu || type == DistributedType::MultiCpu)
    return std::make_unique<DdpStrategy>(pg, compute_dtype, cfg.distributed.ddp_bucket_cap_mb,
                                         cfg.distributed.find_unused_parameters);
  if (type == DistributedType::DeepSpeed) {
    DataParallelOptions o;
    o.zero_stage = cfg.deepspeed.zero_stage;  // 1..3: validate_config refuses others
    o.compute_dtype = compute_dtype;
    o.bucket_cap_mb = cfg.distributed.ddp_bucket_cap_mb;
    o.find_unused_parameters = cfg.distributed.find_unused_parameters;
    o.offload_optimizer = cfg.deepspeed.offload_optimizer_device == OffloadDevice::Cpu;
    o.offload_params = cfg.deepspeed.offload_param_device == OffloadDevice::Cpu;
    o.save_16bit_model = cfg.deepspeed.zero3_save_16bit_model;
    // Stage 3 gathers one decoder layer at a time: the model family's layer class.
    o.unit_types = {hf_class_prefix(cfg.model.name) + "DecoderLayer"};
    return std::make_unique<ZeroStrategy>(pg, o);
  }
  return std::make_unique<FsdpStrategy>(pg, FsdpOptions::from_config(cfg, compute_dtype));
}

}  // namespace accel
