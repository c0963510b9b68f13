#include "tools/trainer/model_folder.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>

#include "runtime/data/tokenizer.h"
#include "runtime/json.h"

namespace accel {
namespace fs = std::filesystem;

namespace {

const char* const kTokenizerFiles[] = {"tokenizer.json", "tokenizer_config.json",
                                       "special_tokens_map.json"};

// The tokenizer.json of a spec, or empty for the byte tokenizer.
fs::path tokenizer_json(const std::string& spec) {
  if (spec == "byte") return {};
  return fs::is_directory(spec) ? fs::path(spec) / "tokenizer.json" : fs::path(spec);
}

// tokenizer_config.json's "bos_token" / "eos_token": a string or {"content": string}.
std::optional<std::string> special_token(const fs::path& tokenizer_config, const char* key) {
  if (!fs::exists(tokenizer_config)) return std::nullopt;
  nlohmann::json j;
  try {
    j = read_json_file(tokenizer_config.string());
  } catch (const std::exception& e) {
    throw std::runtime_error(tokenizer_config.string() + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object() || !j.contains(key)) return std::nullopt;
  const nlohmann::json& t = j[key];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content") && t["content"].is_string())
    return t["content"].get<std::string>();
  return std::nullopt;
}

void copy_or_throw(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec)
    throw std::runtime_error("cannot copy " + from.string() + " to " + to.string() + ": " +
                             ec.message());
}

}  // namespace

void write_generation_config(const std::string& dir, const Tokenizer* tok,
                             const std::string& tokenizer_spec) {
  nlohmann::json j = {{"_from_model_config", true}};
  if (tok) {
    const fs::path spec = tokenizer_json(tokenizer_spec);
    const fs::path config =
        spec.empty() ? fs::path() : spec.parent_path() / "tokenizer_config.json";
    std::optional<uint32_t> bos, eos = tok->end_of_text_id();
    if (auto name = special_token(config, "bos_token")) bos = tok->token_to_id(*name);
    if (auto name = special_token(config, "eos_token"))
      if (auto id = tok->token_to_id(*name)) eos = id;
    for (const char* name : {"<|begin_of_text|>", "<s>", "<bos>"})
      if (!bos) bos = tok->token_to_id(name);
    if (bos) j["bos_token_id"] = *bos;
    if (eos) j["eos_token_id"] = *eos;
  }
  const fs::path p = fs::path(dir) / "generation_config.json";
  std::ofstream out(p);
  out << j.dump(2) << "\n";
  if (!out.flush()) throw std::runtime_error(p.string() + ": write failed (disk full?)");
}

void copy_tokenizer_files(const std::string& tokenizer_spec, const std::string& dir) {
  const fs::path json = tokenizer_json(tokenizer_spec);
  if (json.empty()) return;
  copy_or_throw(json, fs::path(dir) / "tokenizer.json");
  for (const char* f : kTokenizerFiles)
    if (fs::path beside = json.parent_path() / f; f != kTokenizerFiles[0] && fs::exists(beside))
      copy_or_throw(beside, fs::path(dir) / f);
}

int copy_model_folder_extras(const std::string& from, const std::string& to) {
  int n = 0;
  auto take = [&](const char* f) {
    const fs::path src = fs::path(from) / f, dst = fs::path(to) / f;
    if (!fs::exists(src) || fs::absolute(src) == fs::absolute(dst)) return;
    copy_or_throw(src, dst);
    ++n;
  };
  take("generation_config.json");
  for (const char* f : kTokenizerFiles) take(f);
  return n;
}

}  // namespace accel
