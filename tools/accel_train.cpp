// accel-train --config FILE [--training-args FILE.json] [--set KEY=VALUE ...] [--output-dir DIR]
//             [--resume auto|PATH] [--move-newer-checkpoints-aside]
//             [--resume-allow-batch-change] [--print-config] [-v]
#include <CLI/CLI.hpp>
#include <cstdio>

#include "tools/cli.h"
#include "tools/trainer/trainer.h"

int main(int argc, char** argv) {
  CLI::App app{"accel-train: train a Llama-class model from one YAML file"};
  accel::TrainOptions o;
  app.add_option("--config,-c", o.config_path, "YAML config (Accelerate keys + our sections)");
  app.add_option("--training-args", o.training_args,
                 "Hugging Face TrainingArguments JSON (to_json_string()), mapped onto our keys");
  app.add_option("--set", o.overrides, "override a key, e.g. --set training.max_steps=100")
      ->allow_extra_args(false);
  app.add_option("--output-dir,-o", o.output_dir, "output folder (overrides training.output_dir)");
  CLI::Option* resume = app.add_option("--resume", o.resume,
                                       "auto (newest complete checkpoint) or a checkpoint folder");
  app.add_flag("--move-newer-checkpoints-aside", o.move_newer_checkpoints_aside,
               "with --resume from an older step: rename the newer checkpoints to "
               "step_N.superseded instead of refusing")
      ->needs(resume);
  app.add_flag("--resume-allow-batch-change", o.resume_allow_batch_change,
               "resume with a global batch (micro_batch_size x gradient_accumulation_steps x "
               "num_processes) other than the checkpoint's instead of refusing")
      ->needs(resume);
  app.add_flag("--print-config", o.print_config, "print the effective config and exit");
  app.add_flag("--verbose,-v", o.verbose,
               "print the effective config at the start (it is always saved to the output folder)");
  if (argc == 1) {  // nothing asked for: say how to ask, write nothing
    std::fprintf(stderr, "%s\nexample: accel-train --config configs/llama-tiny.yaml\n",
                 app.help().c_str());
    return 2;
  }
  if (auto code = accel::parse_command_line(app, argc, argv)) return *code;
  return accel::run_training(o, argc, argv);
}
