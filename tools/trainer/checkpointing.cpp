#include "tools/trainer/checkpointing.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <thread>

#include "tools/trainer/checkpoint.h"
#include "tools/trainer/model_folder.h"
#include "tools/trainer/run.h"
#include "tools/trainer/run_log.h"
#include "tools/trainer/stop_signals.h"

namespace accel {
namespace fs = std::filesystem;

namespace {

// The global batch: what must stay the same for a resumed run to continue the same trajectory.
nlohmann::json global_batch(const Run& run) {
  const Config& c = run.cfg;
  return {
      {"samples", c.training.micro_batch_size * c.gradient_accumulation_steps * run.dist.world()},
      {"seq_len", c.training.seq_len},
      {"micro_batch_size", c.training.micro_batch_size},
      {"gradient_accumulation_steps", c.gradient_accumulation_steps},
      {"world_size", run.dist.world()}};
}

std::string describe_batch(const nlohmann::json& b) {
  return std::to_string(b.value("samples", int64_t{0})) + " samples of " +
         std::to_string(b.value("seq_len", int64_t{0})) + " tokens (micro_batch_size " +
         std::to_string(b.value("micro_batch_size", int64_t{0})) +
         " x gradient_accumulation_steps " +
         std::to_string(b.value("gradient_accumulation_steps", int64_t{0})) + " x " +
         std::to_string(b.value("world_size", 0)) + " processes)";
}

// trainer_state.json's description of the run that saved (for inspect and for the messages).
nlohmann::json run_info(const Run& run) {
  return {
      {"strategy", run.strategy->name()},
      {"mixed_precision", run.precision->name()},
      {"compute_dtype", dtype_name(run.precision->compute_dtype())},
      // The optimizer moments' dtype (safetensors spelling; the masters are always F32).
      {"state_dtype", run.cfg.optimizer.state_dtype == StateDType::Bf16 ? "BF16" : "F32"},
      {"activation_checkpointing", run.cfg.training.activation_checkpointing},
      {"bucket_cap_mb", run.cfg.distributed.ddp_bucket_cap_mb},
      {"global_batch", global_batch(run)},
      // Training draws no random numbers after initialization except the data order, a
      // function of (seed, epoch) and the data position: these are the whole RNG state.
      {"rng", {{"generator", "philox4x32-10 (counter-based)"}, {"seed", run.cfg.training.seed}}}};
}

// Test hooks of the background writer (docs/fault_tolerance.md):
// ACCEL_TEST_CHECKPOINT_WRITE_DELAY_MS=N sleeps N ms before writing (a slow disk);
// ACCEL_TEST_CHECKPOINT_WRITE_FAIL_STEP=S removes step_S.tmp before its writer starts, so that
// its writes fail as on a vanished disk.
std::function<void(const std::string&)> test_write_hook() {
  const char* delay = std::getenv("ACCEL_TEST_CHECKPOINT_WRITE_DELAY_MS");
  const char* fail = std::getenv("ACCEL_TEST_CHECKPOINT_WRITE_FAIL_STEP");
  if (!delay && !fail) return nullptr;
  const int64_t ms = delay ? std::atoll(delay) : 0;
  const std::string fail_dir = fail ? "step_" + std::string(fail) + ".tmp" : "";
  return [ms, fail_dir](const std::string& tmp) {
    if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    if (!fail_dir.empty() && fs::path(tmp).filename() == fail_dir) fs::remove_all(tmp);
  };
}

}  // namespace

bool reserves_snapshot_at_setup(const CheckpointConfig& c, int64_t first_step, int64_t max_steps) {
  if (!c.async || c.every_steps <= 0 || first_step + 1 >= max_steps) return false;
  // A periodic save at a step s with first_step < s < max_steps, s a multiple of every_steps.
  return (max_steps - 1) / c.every_steps > first_step / c.every_steps;
}

namespace {

std::string gibibytes(size_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GiB", static_cast<double>(bytes) / (1u << 30));
  return s;
}

// "1.2 GB" for the log.
std::string gigabytes(uintmax_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.3g GB", static_cast<double>(bytes) / 1e9);
  return s;
}

std::string seconds(double s) {
  char t[32];
  std::snprintf(t, sizeof t, "%.2f s", s);
  return t;
}

}  // namespace

RunCheckpoints::RunCheckpoints(Run& run, int64_t first_step) : run_(run) {
  const CheckpointConfig& cc = run.cfg.checkpoint;
  CheckpointSaver::Options o;
  o.async = cc.async;
  o.keep_last = cc.keep_last;
  o.timeout_s = run.cfg.distributed.timeout_s;
  o.before_write = test_write_hook();
  saver_ = std::make_unique<CheckpointSaver>(std::move(o));
  if (!reserves_snapshot_at_setup(cc, first_step, run.cfg.training.max_steps)) return;
  // On the H200 the first background save blocked the loop for 7.24 s, of which 0.33 s was its
  // copy; the rest is put down to allocating and page-locking the block (docs/checkpoints.md). Done
  // here, before the first step, instead. Each rank sizes its own block from metadata (its snapshot
  // holds its own slices, rank 0's the full weights too): nothing to agree on, no collective.
  const auto start = std::chrono::steady_clock::now();
  const SnapshotLayout layout = snapshot_layout(*run.strategy, run.dist.rank(), cc.save_optimizer);
  try {
    saver_->buffer()->reserve(layout.tensors, layout.on_gpu);
  } catch (const std::exception& e) {
    throw std::runtime_error(
        "checkpoint.async with checkpoint.every_steps " + std::to_string(cc.every_steps) +
        " reserves the host memory of the background saves' snapshots before the first step; "
        "on rank " +
        std::to_string(run.dist.rank()) + " " + e.what() +
        ". Free host memory, shard the state over more ranks (ZeRO/FSDP: each rank then "
        "reserves less), or set checkpoint.async: false (synchronous saves, which allocate "
        "their block at the first save and fall back to pageable memory, with a warning, when "
        "pinned memory is refused)");
  }
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (run.main_rank() && layout.bytes() > 0)  // always shown, like the run's summary line
    std::fprintf(stderr,
                 "checkpoint: reserved %s (%zu bytes) of %s host memory for background saves in "
                 "%s%s\n",
                 gibibytes(layout.bytes()).c_str(), layout.bytes(),
                 saver_->buffer()->pinned() ? "pinned" : "pageable", seconds(took).c_str(),
                 run.dist.world() > 1 ? " (rank 0's block; every rank reserves its own)" : "");
}

RunCheckpoints::~RunCheckpoints() = default;

void RunCheckpoints::report(const std::optional<std::string>& dir, int64_t step, RunLog& log) {
  if (!dir) return;
  std::string line = "saved checkpoint " + *dir;
  if (run_.main_rank()) {  // what this save cost (tools/reference/checkpoint_bench.sh reads it)
    uintmax_t bytes = 0;
    for (const auto& e : fs::directory_iterator(*dir))
      if (e.is_regular_file()) bytes += e.file_size();
    const double write_s = saver_->last_write_seconds(), copy_s = saver_->last_copy_seconds();
    // The training loop waits until it is back from save() and, with pinned snapshots, until
    // the GPU is past the copies (its stream waits for them): whichever comes later.
    const double stall_s = std::max(host_s_, before_copies_s_ + copy_s);
    char gib[96];
    std::snprintf(gib, sizeof gib, " (%.2f GiB, %.2f GiB/s)",
                  static_cast<double>(bytes) / (1u << 30),
                  write_s > 0 ? static_cast<double>(bytes) / (1u << 30) / write_s : 0.0);
    line += ": " + gigabytes(bytes) + gib + ", training blocked " + seconds(stall_s) + " (" +
            (pinned_ ? "pinned" : "pageable") + " snapshot" +
            (copy_s > 0 ? ", device-to-host " + seconds(copy_s) : std::string()) +
            "), written in " + seconds(write_s);
    if (waited_s_ > 0)
      line += ", after waiting " + seconds(waited_s_) + " for the previous save to be written";
  }
  if (run_.cfg.checkpoint.async && step > in_flight_step_)
    line += " (in the background during step" +
            (step == in_flight_step_ + 1
                 ? " " + std::to_string(step)
                 : "s " + std::to_string(in_flight_step_ + 1) + "-" + std::to_string(step)) +
            ")";
  log.println(line);
}

void RunCheckpoints::save(int64_t step, RunLog& log) {
  const bool busy = saver_->busy();
  const auto wait_start = std::chrono::steady_clock::now();
  report(saver_->wait(), step, log);  // at most one save in flight
  const auto start = std::chrono::steady_clock::now();
  waited_s_ = busy ? std::chrono::duration<double>(start - wait_start).count() : 0;
  auto since = [&start] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const std::string tmp = checkpoint_tmp_dir(run_.output_dir(), step);
  if (run_.main_rank()) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  run_.dist.barrier();
  // Before the snapshot: its small device-to-host copies run on the compute stream, which waits
  // for the snapshot's copies once they are queued.
  const nlohmann::json precision_info =
      run_.precision->save_state(tmp, run_.dist.rank(), run_.dist.pg.get());
  // rope_type dynamic: each rank's frequency state (transformers' max_seq_len_cached, which
  // depends on the lengths of the forwards so far when packed documents vary them).
  nlohmann::json dynamic_rope;
  if (const int64_t cached = run_.model->dynamic_rope_max_seq_len_cached(); cached >= 0) {
    dynamic_rope = nlohmann::json::array();
    for (double v : run_.dist.all_gather({static_cast<double>(cached)}, run_.device))
      dynamic_rope.push_back(static_cast<int64_t>(v));
  }
  before_copies_s_ = since();
  CheckpointSnapshot s = take_snapshot(*run_.strategy, run_.dist.rank(), run_.dist.world(),
                                       run_.cfg.checkpoint.save_optimizer, saver_->buffer());
  pinned_ = s.pinned;
  s.state.step = step;
  s.state.optimizer_steps = run_.strategy->optimizer_steps();
  s.state.seed = run_.cfg.training.seed;
  s.state.world_size = run_.dist.world();
  s.state.data_position = run_.data.train->position();
  s.state.loss_scale = run_.precision->loss_scale();
  // The strategy's own description; its flat layout ("groups") is not needed to read the state.
  s.state.extra = run_.strategy->checkpoint_manifest();
  if (s.state.extra.is_object()) s.state.extra.erase("groups");
  s.info = run_info(run_);
  s.model_config = run_.model_config;
  s.config_yaml = run_.config_yaml;
  if (run_.main_rank()) {  // a self-describing model folder (tools/trainer/model_folder.h)
    write_generation_config(tmp, run_.tokenizer.get(), run_.cfg.data.tokenizer);
    if (run_.tokenizer) copy_tokenizer_files(run_.cfg.data.tokenizer, tmp);
  }
  s.info.update(precision_info);
  if (!dynamic_rope.is_null()) s.info["dynamic_rope_max_seq_len_cached"] = dynamic_rope;
  last_saved_step_ = step;
  in_flight_step_ = step;
  saver_->save(run_.output_dir(), std::move(s));
  host_s_ = since();
  if (!run_.cfg.checkpoint.async) {
    run_.dist.barrier();  // rank 0 has renamed the folder
    host_s_ = since();    // a synchronous save blocks the loop for all of it
    report(saver_->wait(), step, log);
  }
}

bool RunCheckpoints::after_step(int64_t step, int64_t max_steps, RunLog& log) {
  report(saver_->poll(), step, log);
  const CheckpointConfig& cc = run_.cfg.checkpoint;
  if (cc.every_steps > 0 && step % cc.every_steps == 0 && step < max_steps) save(step, log);
  bool stop = stop_requested();
  // Every rank stops after the same step, whichever got the signal.
  if (run_.dist.world() > 1) stop = run_.dist.mean_across_ranks(stop ? 1.0 : 0.0, run_.device) > 0;
  if (!stop) return false;
  if (last_saved_step_ != step) save(step, log);
  report(saver_->wait(), step, log);
  run_.dist.barrier();
  log.end_of_steps();
  if (run_.main_rank())  // always shown (log lines are not with training.progress none)
    std::fprintf(stderr,
                 "accel-train: stopped by SIGTERM after step %lld with its checkpoint written "
                 "(exit code %d); --resume auto continues from it\n",
                 static_cast<long long>(step), kExitPreempted);
  return true;
}

void RunCheckpoints::at_end(int64_t step, RunLog& log) {
  if (run_.cfg.checkpoint.at_end && step > 0 && last_saved_step_ != step) save(step, log);
  report(saver_->wait(), step, log);
  run_.dist.barrier();
}

namespace {

// rope_type dynamic: each rank continues with the frequency state its rank had at the save. At
// another world size every rank's batches differ from the saved ranks', so no state is exact;
// the ranks then start afresh (as a new model instance), with a note.
void restore_dynamic_rope_state(const LoadedCheckpoint& ck, Run& run) {
  if (run.model->dynamic_rope_max_seq_len_cached() < 0) return;
  const nlohmann::json saved =
      ck.trainer_state.value("dynamic_rope_max_seq_len_cached", nlohmann::json());
  if (!saved.is_array()) return;  // written before the state was saved: as a fresh instance
  if (static_cast<int64_t>(saved.size()) == run.dist.world()) {
    run.model->restore_dynamic_rope(saved.at(run.dist.rank()).get<int64_t>());
    return;
  }
  if (run.main_rank())
    std::fprintf(stderr,
                 "note: %s: the dynamic RoPE frequencies were saved for %zu ranks, this run has "
                 "%d; every rank starts from the original frequencies (transformers' "
                 "max_seq_len_cached = max_position_embeddings)\n",
                 ck.dir.c_str(), saved.size(), run.dist.world());
}

}  // namespace

int64_t resume_run(Run& run, const ResumeRequest& request) {
  const auto found = find_checkpoint(run.output_dir(), request.spec);
  if (!found) {
    if (run.main_rank())
      std::fprintf(stderr,
                   "--resume auto: no complete checkpoint in %s/checkpoints; starting fresh\n",
                   run.output_dir().c_str());
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  LoadedCheckpoint ck = load_checkpoint(*found);
  const nlohmann::json saved_batch = ck.trainer_state.value("global_batch", nlohmann::json());
  const nlohmann::json batch = global_batch(run);
  const bool same_batch = saved_batch.value("samples", int64_t{-1}) == batch["samples"] &&
                          saved_batch.value("seq_len", int64_t{-1}) == batch["seq_len"];
  if (!same_batch && !request.allow_batch_change)
    throw std::invalid_argument(
        "--resume " + *found + ": the checkpoint was trained with a global batch of " +
        describe_batch(saved_batch) + ", this run's is " + describe_batch(batch) +
        ". A different global batch changes the trajectory; set training.micro_batch_size and "
        "gradient_accumulation_steps so that the product with num_processes matches, or pass "
        "--resume-allow-batch-change to continue with the new one");
  check_checkpoint_matches_run(ck, *run.model, *run.strategy);
  for (const std::string& n : handle_newer_checkpoints(run.output_dir(), ck.state.step,
                                                       request.move_newer_aside, run.main_rank()))
    std::fprintf(stderr, "note: %s\n", n.c_str());
  // A checkpoint whose moments are in another dtype than optimizer.state_dtype is converted as
  // it is read (bf16 -> fp32 exactly, fp32 -> bf16 rounded to nearest even): say so.
  const std::string want = run.cfg.optimizer.state_dtype == StateDType::Bf16 ? "BF16" : "F32";
  std::string converted;
  for (const std::string& kind : ck.kinds)
    if (kind != "master" && ck.dtype_of(kind) != want)
      converted += (converted.empty() ? "" : ", ") + kind + " " + ck.dtype_of(kind);
  if (run.main_rank() && !converted.empty())
    std::fprintf(stderr,
                 "note: the checkpoint's optimizer state is stored as %s; optimizer.state_dtype is "
                 "%s, so it is converted to %s on load (%s)\n",
                 converted.c_str(), name_of(run.cfg.optimizer.state_dtype), want.c_str(),
                 want == "F32" ? "exact" : "rounded to nearest even");
  restore_strategy_state(ck, *run.strategy);
  const std::string note = run.precision->restore_state(ck);
  if (run.main_rank() && !note.empty()) std::fprintf(stderr, "note: %s\n", note.c_str());
  restore_dynamic_rope_state(ck, run);
  DataPosition pos;
  from_json(ck.state.data_position, pos);
  run.data.train->restore(pos);
  run.dist.barrier();  // every rank has its state
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (run.main_rank()) {
    const std::string from = ck.trainer_state.value("strategy", std::string("?")) + " x " +
                             std::to_string(ck.state.world_size);
    const std::string now = run.strategy->name() + " x " + std::to_string(run.dist.world());
    std::fprintf(stderr, "resumed from %s at step %lld (saved by %s%s) in %s%s\n", found->c_str(),
                 static_cast<long long>(ck.state.step), from.c_str(),
                 from == now ? "" : (", resharded for " + now).c_str(), seconds(took).c_str(),
                 same_batch ? ""
                            : ("; global batch changed from " + describe_batch(saved_batch) +
                               " to " + describe_batch(batch))
                                  .c_str());
  }
  return ck.state.step;
}

}  // namespace accel
