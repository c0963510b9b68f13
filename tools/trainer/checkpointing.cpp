#include "tools/trainer/checkpointing.h"

#include <cstdio>

#include "tools/trainer/checkpoint.h"
#include "tools/trainer/model_folder.h"
#include "tools/trainer/run.h"
#include "tools/trainer/run_log.h"

namespace accel {

void save_run_checkpoint(Run& run, int64_t step, RunLog& log) {
  TrainerState st;
  st.step = step;
  st.optimizer_steps = run.strategy->optimizer_steps();
  st.seed = run.cfg.training.seed;
  st.world_size = run.dist.world();
  st.data_position = run.data.train->position();
  st.loss_scale = run.precision->loss_scale();
  st.extra = run.strategy->checkpoint_manifest();
  CheckpointWriter writer;
  writer.rank = run.dist.rank();
  writer.world_size = run.dist.world();
  writer.barrier = [&run] { run.dist.barrier(); };
  writer.save_optimizer = run.cfg.checkpoint.save_optimizer;
  writer.save_extra = [&run](const std::string& dir) {
    if (run.main_rank()) {  // a self-describing model folder (tools/trainer/model_folder.h)
      write_generation_config(dir, run.tokenizer.get(), run.cfg.data.tokenizer);
      if (run.tokenizer) copy_tokenizer_files(run.cfg.data.tokenizer, dir);
    }
    return run.precision->save_state(dir, run.dist.rank(), run.dist.pg.get());
  };
  const std::string dir = save_checkpoint(run.output_dir(), st, run.strategy->full_state_dict(),
                                          run.model_config, run.strategy->optimizer_state(),
                                          run.config_yaml, writer, run.cfg.checkpoint.keep_last);
  log.println("saved checkpoint " + dir);
}

int64_t resume_run(Run& run, const ResumeRequest& request) {
  const auto found = find_checkpoint(run.output_dir(), request.spec);
  if (!found) {
    if (run.main_rank())
      std::fprintf(stderr,
                   "--resume auto: no complete checkpoint in %s/checkpoints; starting fresh\n",
                   run.output_dir().c_str());
    return 0;
  }
  LoadedCheckpoint ck = load_checkpoint(*found, run.dist.rank(), run.dist.world());
  check_checkpoint_matches_run(ck, *run.model, *run.strategy);  // includes the shard layout
  for (const std::string& n : handle_newer_checkpoints(run.output_dir(), ck.state.step,
                                                       request.move_newer_aside, run.main_rank()))
    std::fprintf(stderr, "note: %s\n", n.c_str());
  run.strategy->load_state(ck.weights, ck.optimizer_state, ck.state.optimizer_steps);
  const std::string note = run.precision->restore_state(ck);
  if (run.main_rank() && !note.empty()) std::fprintf(stderr, "note: %s\n", note.c_str());
  DataPosition pos;
  from_json(ck.state.data_position, pos);
  run.data.train->restore(pos);
  if (run.main_rank())
    std::fprintf(stderr, "resumed from %s at step %lld\n", found->c_str(),
                 static_cast<long long>(ck.state.step));
  return ck.state.step;
}

}  // namespace accel
