// Hugging Face TrainingArguments (transformers 5.x names, as `to_json_string()` dumps them) turned
// into accel-train keys. The config loader calls this for a `training_args:` section of the YAML
// file and for `accel-train --training-args FILE.json`, then applies the keys like any other file
// key, so a setting given both here and in the YAML with different values is an error naming both.
//
// Every TrainingArguments field is one of: mapped (to which key, with what conversion), accepted
// with no effect (a notice when its value is not Trainer's default), or refused by name when a
// value other than Trainer's default cannot be honoured. Names that are no field are errors with
// the closest field suggested. docs/config.md ("TrainingArguments") has the table.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace accel {

// One of our keys set from TrainingArguments.
struct TrainingArgsKey {
  std::string from;  // the names and values it comes from: "warmup_steps=0.1, max_steps=300"
  std::string arg;   // the main TrainingArguments name ("warmup_steps"), for locations
  std::string key;   // our key path: "optimizer.warmup_steps"
  nlohmann::json value;
};

struct TrainingArgsMapping {
  std::vector<TrainingArgsKey> keys;
  std::vector<std::string> notices;  // names accepted without effect, other remarks
};

// `args` is a TrainingArguments object (its to_dict() form). Names it does not give leave our keys
// alone; a conversion that reads several names takes Trainer's defaults for the missing ones.
// `where(name)` says where a name was given ("args.json", "run.yaml:12"), for messages. Relative
// paths (fsdp_config, deepspeed, accelerator_config) are tried in `base_dir` first, then in the
// working directory. Throws ConfigError.
TrainingArgsMapping map_training_args(const nlohmann::json& args,
                                      const std::function<std::string(const std::string&)>& where,
                                      const std::string& base_dir);

// Reads a JSON file holding an object (a TrainingArguments dump, an FSDP config). `where` prefixes
// the error messages. Throws ConfigError.
nlohmann::json read_json_object_file(const std::string& path, const std::string& where);

// Every TrainingArguments name known (transformers 5.x), in Trainer's order.
std::vector<std::string> training_args_names();

// The TrainingArguments table of docs/config.md.
std::string training_args_reference_markdown();

}  // namespace accel
