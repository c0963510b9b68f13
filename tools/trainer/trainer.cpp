#include "tools/trainer/trainer.h"

#include <cstdio>
#include <iostream>

#include "parallel/launch_env.h"
#include "parallel/launcher.h"
#include "parallel/process_group.h"  // DistributedError, kExitAfterPeerFailure
#include "runtime/config.h"
#include "tools/trainer/checkpointing.h"  // ResumeRequest
#include "tools/trainer/run.h"
#include "tools/trainer/train.h"

namespace accel {

namespace {
int run(const TrainOptions& options, int argc, char** argv) {
  // The config is loaded and the launch environment detected once, here.
  Config cfg = load_config(options.config_path, options.overrides, environment_variables(),
                           options.training_args);
  if (!options.output_dir.empty()) cfg.training.output_dir = options.output_dir;
  if (options.print_config) {
    std::cout << config_to_yaml(cfg);
    return 0;
  }
  const LaunchEnv env = detect_launch_env(cfg.main_process_ip, cfg.main_process_port);
  // Without a launcher, num_processes > 1 on one machine: become the launcher of local ranks.
  if (should_spawn_local_ranks(env.world_size, static_cast<int>(cfg.num_processes),
                               static_cast<int>(cfg.num_machines)))
    // main_process_port's default (29500) is only Accelerate's placeholder: a port the user
    // did not give is picked free, so jobs on one machine do not collide.
    return run_local_ranks(
        static_cast<int>(cfg.num_processes), argc, argv,
        local_launch_options(cfg.main_process_ip,
                             cfg.origins.count("main_process_port") ? cfg.main_process_port : 0));
  Run r = assemble_run(std::move(cfg), env, !options.resume.empty(), options.verbose);
  return train(r, ResumeRequest{options.resume, options.move_newer_checkpoints_aside,
                                options.resume_allow_batch_change});
}
}  // namespace

int run_training(const TrainOptions& options, int argc, char** argv) {
  try {
    return run(options, argc, argv);
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "accel-train: configuration error: %s\n", e.what());
    return 2;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "accel-train: %s\n", e.what());
    return 2;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "accel-train: %s\n", e.what());
    return 2;
  } catch (const DistributedError& e) {
    std::fprintf(stderr, "accel-train: error: %s\n", e.what());
    return kExitAfterPeerFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "accel-train: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace accel
