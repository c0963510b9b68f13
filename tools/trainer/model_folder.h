// The files that make a Hugging Face model folder (a checkpoint, or accel-checkpoint
// consolidate's output) self-describing beside its weights and config.json:
//   generation_config.json   bos/eos token ids where the tokenizer knows them
//   tokenizer.json           the run's tokenizer (none with the byte tokenizer), with
//   tokenizer_config.json, special_tokens_map.json   when present beside it
#pragma once

#include <string>

namespace accel {

class Tokenizer;

// Writes dir/generation_config.json; `tok` may be null (synthetic data: no ids known).
void write_generation_config(const std::string& dir, const Tokenizer* tok,
                             const std::string& tokenizer_spec);

// Copies the tokenizer files of `tokenizer_spec` (a tokenizer.json or a folder holding one;
// "byte": nothing) into dir.
void copy_tokenizer_files(const std::string& tokenizer_spec, const std::string& dir);

// Copies those of the files above that `from` holds into `to`; returns how many.
int copy_model_folder_extras(const std::string& from, const std::string& to);

}  // namespace accel
