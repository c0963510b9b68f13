// Training checkpoints (format version 2): OUTPUT_DIR/checkpoints/step_N/ holding
//   model.safetensors + config.json   full weights with Hugging Face names (transformers loads
//                                      it): fp32 where the strategy gathers them (single, DDP,
//                                      ZeRO-1/2, FSDP FULL_STATE_DICT; these are then also the
//                                      master weights), 16-bit with ZeRO-3's
//                                      zero3_save_16bit_model, else absent
//   optimizer.rank<R>.safetensors      rank R's slices of the training state, layout-free: for
//                                      every parameter range [begin, end) the rank held, 1-D
//                                      tensors "<param>.master" (fp32; unless model.safetensors
//                                      holds the fp32 masters), "<param>.exp_avg",
//                                      "<param>.exp_avg_sq" (or ".momentum_buffer") in the
//                                      optimizer's state dtype (F32, or BF16 with
//                                      optimizer.state_dtype bf16; the index's "state" "dtypes"
//                                      names each kind's). DDP and single: rank 0's file only
//   fp8_state.safetensors              fp8 delayed scaling (TE recipe) only: amax histories,
//                                      scales and the update count (tools/trainer/precision.h)
//   trainer_state.json                 format_version, step, optimizer steps, seed, world size,
//                                      strategy, dtypes, global batch, data position, loss scaler,
//                                      RNG, "state": every parameter's full shape and which file
//                                      holds which slice (with a checksum per slice), "files":
//                                      every other file's size and checksum
//   config.yaml                        the effective run configuration
//   generation_config.json, tokenizer.json (+ tokenizer_config.json, special_tokens_map.json)
//                                      written by the run's save_extra hook
//                                      (tools/trainer/model_folder.h)
// Because the state is stored per parameter range, not in the strategy's flat buffers, a run at
// any world size with any strategy resumes it: each rank reads the ranges it holds now
// (CheckpointStateReader), from the files that hold them and nothing else.
//
// A save goes through a snapshot (host copies, taken at a step boundary, into one host buffer
// that the saver keeps from save to save: page-locked where the state is on a GPU, so that the
// device-to-host copy runs asynchronously at full bandwidth; tools/trainer/checkpoint_buffer.h)
// and a writer: every
// rank writes its file and a part index into step_N.tmp, rank 0 waits for every part, writes
// trainer_state.json last, fsyncs and renames the folder. CheckpointSaver runs the writer inline
// or on a background thread (checkpoint.async). A crash mid-save never leaves a folder that looks
// complete, and the newest complete checkpoint is never removed before its successor is.
// With checkpoint.save_optimizer false there is no state ("optimizer_saved": false): such a
// checkpoint holds the weights only and cannot be resumed (model.init_from takes it).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "models/decoder.h"
#include "parallel/strategy.h"
#include "runtime/host_copies.h"
#include "tools/trainer/checkpoint_buffer.h"

namespace accel {

class Module;
class SafetensorsReader;

constexpr int kCheckpointFormatVersion = 2;

struct TrainerState {
  int64_t step = 0;  // optimizer steps completed
  int64_t optimizer_steps = 0;
  uint64_t seed = 0;
  int world_size = 1;
  nlohmann::json data_position;
  double loss_scale = 1.0;
  nlohmann::json extra;  // the strategy's own description (Strategy::checkpoint_manifest)
};

// What one rank hands a save, taken at a step boundary: host copies, so training may go on
// while it is written.
struct CheckpointSnapshot {
  int rank = 0;
  int world_size = 1;
  TrainerState state;
  // Rank 0: entries added to trainer_state.json (strategy, dtypes, global batch, the files
  // other parts of the run wrote into the folder).
  nlohmann::json info = nlohmann::json::object();
  std::vector<std::pair<std::string, Tensor>> full_weights;  // rank 0; may be empty
  bool masters_in_model = false;        // full_weights are the fp32 masters: no "master" slices
  std::vector<ParamStateSlice> slices;  // this rank's, in host memory
  std::vector<std::string> kinds;       // Strategy::state_kinds()
  // Each kind's safetensors dtype ("F32", "BF16"), for the index; kinds not listed are F32.
  std::map<std::string, std::string> kind_dtypes;
  bool save_optimizer = true;
  // Rank 0 writes model.safetensors, config.json and config.yaml (false: the caller puts the
  // model files into the folder itself, as accel-checkpoint reshard copies them).
  bool model_files = true;
  DecoderConfig model_config;  // rank 0
  std::string config_yaml;     // rank 0
  bool pinned = false;         // the host copies are page-locked memory
  // The device-to-host copies still running when take_snapshot returned (pinned copies of GPU
  // state); write_checkpoint_part waits for them before it reads a byte. Null: all complete.
  // Last member: destroyed first, waiting for the copies before their destination goes.
  std::shared_ptr<cuda::HostCopies> copies;
};

// Copies `strategy`'s state into a snapshot (every rank; full_state_dict is collective), into
// `buffer`'s block (reused from the previous save; null: a pageable block of this snapshot's
// own). GPU state goes into a pinned block asynchronously (CheckpointSnapshot::copies): the
// host does not wait, and the GPU work queued after this call waits for the copies; into a
// pageable block (no CUDA, or the pinned allocation refused) the copies are synchronous.
CheckpointSnapshot take_snapshot(Strategy& strategy, int rank, int world_size, bool save_optimizer,
                                 SnapshotBuffer* buffer);

// What take_snapshot(strategy, rank, ..., save_optimizer, buffer) carves out of its buffer,
// known ahead: the shapes and dtypes of the snapshot's host tensors in its order, and whether a
// source is on a GPU (the block is then pinned). From Strategy::full_state_dict_layout and the
// views of param_state_slices: nothing is gathered or copied and no collective runs, so a rank
// may call it alone (the run reserves the block at setup with it). The fp8 scaling state is not
// in the block: Precision::save_state writes its few kilobytes itself.
struct SnapshotLayout {
  std::vector<HostTensorSpec> tensors;
  bool on_gpu = false;
  size_t bytes() const { return SnapshotBuffer::bytes_for(tensors); }
};
SnapshotLayout snapshot_layout(Strategy& strategy, int rank, bool save_optimizer);

// Every file's and slice's checksum: 64 bits over the bytes (not cryptographic), as 16 hex
// digits.
std::string checksum_bytes(const void* data, size_t n);
std::string checksum_file(const std::string& path);

// Where the save of `step` under output_dir goes while written and when complete.
std::string checkpoint_tmp_dir(const std::string& output_dir, int64_t step);
std::string checkpoint_final_dir(const std::string& output_dir, int64_t step);

// The writer of one rank: its file and part index into `tmp` (rank 0 also the model and config
// files). A failure leaves optimizer.rank<R>.failed naming the path and reason (so rank 0 stops
// waiting) and throws.
void write_checkpoint_part(const std::string& tmp, const CheckpointSnapshot& s);
// Rank 0, after its own part: waits up to timeout_s for every rank's part, merges them into
// trainer_state.json (written last, fsynced), renames tmp to its final name and prunes to
// keep_last (never the new one). Returns the final folder.
std::string finish_checkpoint(const std::string& tmp, const std::string& final_dir,
                              const CheckpointSnapshot& s, int64_t keep_last, double timeout_s);

// Saves snapshots, inline or in the background (at most one in flight: the next save waits for
// it). Every rank has one.
class CheckpointSaver {
 public:
  struct Options {
    bool async = false;
    int64_t keep_last = 0;
    double timeout_s = 300;  // rank 0's wait for the other ranks' parts
    // Test hook: called in the writer before anything is written (a slow disk, a failure).
    std::function<void(const std::string& tmp)> before_write;
    // The snapshots' host buffer (null: SnapshotBuffer::for_run(), pinned where there is CUDA).
    std::unique_ptr<SnapshotBuffer> buffer;
  };
  explicit CheckpointSaver(Options o);
  ~CheckpointSaver();  // waits for a save in flight (its failure is printed, not thrown)
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  // Writes `s` to output_dir's step_<s.state.step>. Inline: returns once this rank's part (rank
  // 0: the whole checkpoint) is written, throws when that failed, and leaves its folder to
  // wait() or poll(). Async: returns at once.
  void save(const std::string& output_dir, CheckpointSnapshot s);
  // Whether a background save is in flight.
  bool busy() const;
  // The folder of a background save that completed since the last call (nullopt: none, or
  // still writing); a failed one throws std::runtime_error naming the folder and the reason.
  std::optional<std::string> poll();
  // Waits for the save in flight; then as poll().
  std::optional<std::string> wait();
  // The host buffer of this rank's snapshots (take_snapshot's `buffer`), kept from save to
  // save and freed with the saver; taking a snapshot into it needs no save in flight.
  SnapshotBuffer* buffer() { return buffer_.get(); }
  // Of the last completed save: the seconds its writer took (its files, fsyncs and rename; with
  // pinned snapshots the wait for the device-to-host copies is not in it) and the seconds from
  // queuing the device-to-host copies to their completion (0: the copies were synchronous).
  double last_write_seconds() const { return last_write_s_; }
  double last_copy_seconds() const { return last_copy_s_; }

 private:
  struct Job;
  Options o_;
  std::unique_ptr<Job> job_;
  std::unique_ptr<SnapshotBuffer> buffer_;
  double last_write_s_ = 0, last_copy_s_ = 0;
};

// A whole save on every rank, inline: snapshot, write, barrier (tests and tools).
struct CheckpointWriter {
  int rank = 0;
  int world_size = 1;
  std::function<void()> barrier;  // all ranks meet here (no-op on one process)
  // State files of other parts of the run (precision's fp8 scaling state; null: none): every
  // rank calls it with the folder being written; rank 0's returned entries are added to
  // trainer_state.json.
  std::function<nlohmann::json(const std::string& dir)> save_extra = nullptr;
  bool save_optimizer = true;
  nlohmann::json info = nlohmann::json::object();  // more trainer_state.json entries (rank 0)
};
std::string save_checkpoint(const std::string& output_dir, const TrainerState& state,
                            Strategy& strategy, const DecoderConfig& model_config,
                            const std::string& config_yaml, const CheckpointWriter& w,
                            int64_t keep_last);

// One parameter in a checkpoint's index: its full shape and the slices that hold its state.
struct CheckpointSlice {
  std::string file;  // in the checkpoint folder
  int64_t begin = 0, end = 0;
  // By state kind: the tensor's name in `file` and its checksum.
  std::map<std::string, std::pair<std::string, std::string>> keys;
};
struct CheckpointParam {
  Shape shape;
  std::vector<CheckpointSlice> slices;
};

struct LoadedCheckpoint {
  std::string dir;
  TrainerState state;
  nlohmann::json trainer_state;  // the whole file, for the parts with state of their own
  std::vector<std::string> kinds;
  // Each kind's stored dtype ("F32" or "BF16"; checkpoints written before state_dtype: F32).
  std::map<std::string, std::string> dtypes;
  std::map<std::string, CheckpointParam> params;  // the index, by parameter name
  std::string dtype_of(const std::string& kind) const;
};

// "auto": the newest complete checkpoint under output_dir/checkpoints (nullopt when none);
// otherwise `spec` is a checkpoint folder. Errors name the folder and what is missing; a folder
// named step_<digits> whose number does not fit is refused (rename or remove it).
std::optional<std::string> find_checkpoint(const std::string& output_dir, const std::string& spec);
// Reads a checkpoint's trainer_state.json and index. Its values are checked (format_version,
// step 0..10^15 and, in a folder named step_N, equal to N; optimizer_steps 0..step; world_size;
// loss_scale; every slice inside its parameter), and a checkpoint saved without optimizer state
// is refused (it holds the weights only). No tensor is read here.
LoadedCheckpoint load_checkpoint(const std::string& dir);

// Reads parameter ranges out of a loaded checkpoint: each request opens only the files whose
// slices overlap it, verifies each slice's checksum the first time it is used (a corrupted
// slice is named with its file) and refuses NaN or Inf values.
class CheckpointStateReader {
 public:
  explicit CheckpointStateReader(const LoadedCheckpoint& ck);
  ~CheckpointStateReader();
  // As ParamStateReader; `dst` may also be BF16 (the slices, F32 or BF16 as stored, are
  // widened to fp32 and rounded to nearest even into it: exact where they were stored in BF16).
  void read(const std::string& name, const std::string& kind, int64_t begin, const Tensor& dst);
  // Every slice's checksum (accel-checkpoint verify); returns the number checked.
  int64_t verify_all();
  // The files opened so far (to show that a rank read only what it needs).
  std::vector<std::string> files_opened() const;

 private:
  const SafetensorsReader& file(const std::string& name);
  const LoadedCheckpoint& ck_;
  std::map<std::string, std::unique_ptr<SafetensorsReader>> files_;
  std::set<std::pair<std::string, std::string>> verified_;  // (file, tensor)
};

// Refuses a loaded checkpoint that does not fit this run, before anything is loaded: every
// parameter through check_offered_weights (present with its shape, nothing the model lacks: a
// change of num_hidden_layers or tie_word_embeddings is named by tensor) and the state kinds
// against this run's optimizer (AdamW's moments are not SGD's momentum).
void check_checkpoint_matches_run(const LoadedCheckpoint& ck, Module& model, Strategy& strategy);
// Loads the checkpoint's state into `strategy` (every rank; each reads only its ranges).
void restore_strategy_state(const LoadedCheckpoint& ck, Strategy& strategy);

// Checks every file the checkpoint lists against the size and checksum recorded at save, and
// every slice's checksum. Returns one line per problem (empty: intact).
std::vector<std::string> verify_checkpoint(const std::string& dir);

// A resume at `step` into output_dir, whose checkpoints folder may hold newer checkpoints: those
// of the run that went on from there. Training beside them would mix two runs (keep_last prunes by
// step number, --resume auto picks the newest), so without `move_aside` this throws
// std::invalid_argument naming them and the choices. With it, `mover` (rank 0) renames each newer
// step_M to step_M.superseded (or .superseded.2, ...; nothing is deleted), and the notes say so.
std::vector<std::string> handle_newer_checkpoints(const std::string& output_dir, int64_t step,
                                                  bool move_aside, bool mover);

}  // namespace accel
