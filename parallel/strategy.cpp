#include "parallel/strategy.h"

#include <nlohmann/json.hpp>
#include <stdexcept>

#include "parallel/ddp.h"
#include "parallel/expert_parallel_strategy.h"
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

std::vector<StateDictEntry> Strategy::full_state_dict_layout() const {
  throw std::logic_error("strategy " + name() +
                         " does not describe its full_state_dict without gathering it");
}

std::vector<ParamStateSlice> Strategy::param_state_slices() { no_param_state(name()); }
std::vector<std::string> Strategy::state_kinds() const { no_param_state(name()); }
void Strategy::import_param_state(const ParamStateReader&, int64_t) { no_param_state(name()); }

namespace {
// The engine distributed_type names over `pg`, taking the parameters `filter` accepts (all when
// empty): the whole strategy without expert parallelism, either part of it with.
std::unique_ptr<FlatDataParallel> make_engine(const Config& cfg, std::shared_ptr<ProcessGroup> pg,
                                              DType compute_dtype, ParamFilter filter) {
  const DistributedType type = cfg.distributed_type;
  if (type == DistributedType::MultiGpu || type == DistributedType::MultiCpu)
    return std::make_unique<DdpStrategy>(pg, compute_dtype, cfg.distributed.ddp_bucket_cap_mb,
                                         cfg.distributed.find_unused_parameters, std::move(filter));
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
    o.param_filter = std::move(filter);
    return std::make_unique<ZeroStrategy>(pg, o);
  }
  FsdpOptions o = FsdpOptions::from_config(cfg, compute_dtype);
  o.param_filter = std::move(filter);
  return std::make_unique<FsdpStrategy>(pg, o);
}
}  // namespace

std::unique_ptr<Strategy> make_strategy(const Config& cfg, std::shared_ptr<ProcessGroup> pg,
                                        DType compute_dtype, const ExpertParallelContext* ep) {
  const DistributedType type = cfg.distributed_type;
  const int world = pg ? pg->size() : 1;
  if (type == DistributedType::No) {
    if (world > 1)
      throw std::invalid_argument(
          "distributed_type NO runs one process, but " + std::to_string(world) +
          " were launched; set distributed_type MULTI_GPU/MULTI_CPU (DDP) or DEEPSPEED (ZeRO)");
    if (cfg.distributed.expert_parallel_size > 1)
      throw std::invalid_argument("distributed.expert_parallel_size " +
                                  std::to_string(cfg.distributed.expert_parallel_size) +
                                  " needs several processes (distributed_type is NO)");
    return std::make_unique<SingleProcessStrategy>(compute_dtype);
  }
  if (cfg.distributed.expert_parallel_size > 1) {
    if (!ep || ep->ep_size != cfg.distributed.expert_parallel_size)
      throw std::logic_error(
          "make_strategy: distributed.expert_parallel_size > 1 needs the expert-parallel mesh "
          "(make_expert_parallel) that the model was built with");
    return std::make_unique<ExpertParallelStrategy>(
        pg, *ep, [&](std::shared_ptr<ProcessGroup> g, ParamFilter f) {
          return make_engine(cfg, std::move(g), compute_dtype, std::move(f));
        });
  }
  return make_engine(cfg, std::move(pg), compute_dtype, {});
}

}  // namespace accel
