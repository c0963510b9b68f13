// Training checkpoints: OUTPUT_DIR/checkpoints/step_N/ holding
//   model.safetensors + config.json   full fp32 weights with Hugging Face names (transformers loads
//                                      it); ZeRO-3: 16-bit weights with zero3_save_16bit_model,
//                                      else no model.safetensors (the weights are in the shards)
//   optimizer.rank<R>.safetensors      each rank's optimizer state (whole, or its shards)
//   fp8_state.safetensors              fp8 delayed scaling (TE recipe) only: amax histories,
//                                      scales and the update count, written once by the run's
//                                      precision part (tools/trainer/precision.h)
//   trainer_state.json                 step, data position, seed, world size, the file manifest
//   config.yaml                        the effective run configuration
//   generation_config.json, tokenizer.json (+ tokenizer_config.json, special_tokens_map.json)
//                                      written by the run's save_extra hook
//                                      (tools/trainer/model_folder.h)
// A checkpoint is written into step_N.tmp and renamed when complete, so a crash mid-save never
// leaves a folder that looks complete; trainer_state.json is the last file written. With
// checkpoint.save_optimizer false there are no optimizer files ("optimizer_saved": false): such a
// checkpoint holds the weights only and cannot be resumed (model.init_from takes it).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/decoder.h"

namespace accel {

class Module;
class Strategy;

struct TrainerState {
  int64_t step = 0;  // optimizer steps completed
  int64_t optimizer_steps = 0;
  uint64_t seed = 0;
  int world_size = 1;
  nlohmann::json data_position;
  double loss_scale = 1.0;
  nlohmann::json extra;  // strategy-specific manifest (Strategy::checkpoint_manifest)
};

struct CheckpointWriter {
  int rank = 0;
  int world_size = 1;
  std::function<void()> barrier;  // all ranks meet here (no-op on one process)
  // State files of other parts of the run (precision's fp8 scaling state; null: none): every
  // rank calls it with the folder being written, before trainer_state.json; rank 0's returned
  // entries are added to trainer_state.json.
  std::function<nlohmann::json(const std::string& dir)> save_extra = nullptr;
  // checkpoint.save_optimizer: false writes no optimizer.rank<R>.safetensors; the weights must
  // then be whole (rank 0's full_weights not empty), else the save throws.
  bool save_optimizer = true;
};

// Every rank calls this with its own optimizer state; rank 0 writes the model and the state.
// keep_last > 0 then removes the oldest complete checkpoints (by step) beyond keep_last, never the
// one just written. Returns the final folder.
std::string save_checkpoint(const std::string& output_dir, const TrainerState& state,
                            const std::vector<std::pair<std::string, Tensor>>& full_weights,
                            const DecoderConfig& model_config,
                            const std::vector<std::pair<std::string, Tensor>>& optimizer_state,
                            const std::string& config_yaml, const CheckpointWriter& w,
                            int64_t keep_last);

struct LoadedCheckpoint {
  std::string dir;
  TrainerState state;
  std::vector<std::pair<std::string, Tensor>> weights;          // empty when only shards were saved
  std::vector<std::pair<std::string, Tensor>> optimizer_state;  // this rank's
  std::string optimizer_file;    // the file optimizer_state came from
  nlohmann::json trainer_state;  // the whole file, for the parts with state of their own
};

// "auto": the newest complete checkpoint under output_dir/checkpoints (nullopt when none);
// otherwise `spec` is a checkpoint folder. Errors name the folder and what is missing; a folder
// named step_<digits> whose number does not fit is refused (rename or remove it).
std::optional<std::string> find_checkpoint(const std::string& output_dir, const std::string& spec);
// Reads a checkpoint for a resume. trainer_state.json's values are checked (step 0..10^15 and,
// in a folder named step_N, equal to N; optimizer_steps 0..step; world_size; loss_scale), and a
// checkpoint saved without optimizer state is refused (it holds the weights only). Tensors are
// loaded as the files store them, not converted: check_checkpoint_matches_run checks them.
LoadedCheckpoint load_checkpoint(const std::string& dir, int rank, int world_size);

// Refuses a loaded checkpoint that does not fit this run, before anything is loaded into it:
// the weights (model.safetensors, or the shard manifest's parameters) against the model's
// parameters, through check_offered_weights (every one present with its shape and a
// floating-point dtype, nothing the model lacks: a change of num_hidden_layers or
// tie_word_embeddings is named by tensor), the shard layout (check_same_shard_layout), and this
// rank's optimizer state against the tensors `strategy` holds (names, shapes, dtypes). Weights or
// optimizer state holding NaN or Inf are refused, naming the tensor. Call after strategy setup.
void check_checkpoint_matches_run(const LoadedCheckpoint& ck, Module& model, Strategy& strategy);

// A resume at `step` into output_dir, whose checkpoints folder may hold newer checkpoints: those
// of the run that went on from there. Training beside them would mix two runs (keep_last prunes by
// step number, --resume auto picks the newest), so without `move_aside` this throws
// std::invalid_argument naming them and the choices. With it, `mover` (rank 0) renames each newer
// step_M to step_M.superseded (or .superseded.2, ...; nothing is deleted), and the notes say so.
std::vector<std::string> handle_newer_checkpoints(const std::string& output_dir, int64_t step,
                                                  bool move_aside, bool mover);
// Refuses to resume a sharded checkpoint whose shard layout (the strategy manifest's "groups")
// differs from the one this run's strategy built: the shards would load into the wrong places.
void check_same_shard_layout(const std::string& dir, const nlohmann::json& saved,
                             const nlohmann::json& now);

}  // namespace accel
