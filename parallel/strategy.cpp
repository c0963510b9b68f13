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

std::unique_ptr<Strategy> make_strategy(const Config& cfg, std::shared_ptr<ProcessGroup> pg,
                                        DType compute_dtype) {
  const std::string& type = cfg.distributed_type;
  const int world = pg ? pg->size() : 1;
  if (type == "NO") {
    if (world > 1)
      throw std::invalid_argument(
          "distributed_type NO runs one process, but " + std::to_string(world) +
          " were launched; set distributed_type MULTI_GPU/MULTI_CPU (DDP) or DEEPSPEED (ZeRO)");
    return std::make_unique<SingleProcessStrategy>(compute_dtype);
  }
  if (type == "MULTI_GPU" || type == "MULTI_CPU")
    return std::make_unique<DdpStrategy>(pg, compute_dtype, cfg.distributed.ddp_bucket_cap_mb,
                                         cfg.distributed.find_unused_parameters);
  if (type == "DEEPSPEED") {
    DataParallelOptions o;
    o.zero_stage = cfg.deepspeed.zero_stage;
    if (o.zero_stage < 1 || o.zero_stage > 3)
      throw std::invalid_argument("deepspeed_config.zero_stage must be 1, 2 or 3, got " +
                                  std::to_string(o.zero_stage) + " (use MULTI_GPU for plain DDP)");
    o.compute_dtype = compute_dtype;
    o.bucket_cap_mb = cfg.distributed.ddp_bucket_cap_mb;
    o.find_unused_parameters = cfg.distributed.find_unused_parameters;
    o.offload_optimizer = cfg.deepspeed.offload_optimizer_device == "cpu";
    o.offload_params = cfg.deepspeed.offload_param_device == "cpu";
    o.save_16bit_model = cfg.deepspeed.zero3_save_16bit_model;
    return std::make_unique<ZeroStrategy>(pg, o);
  }
  if (type == "FSDP")
    return std::make_unique<FsdpStrategy>(pg, FsdpOptions::from_config(cfg, compute_dtype));
  throw std::invalid_argument("distributed_type " + type +
                              " is not implemented yet in accel-train (use NO, MULTI_CPU, "
                              "MULTI_GPU, FSDP or DEEPSPEED)");
}

}  // namespace accel
