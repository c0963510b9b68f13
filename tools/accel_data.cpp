// accel-data: text files -> token shards for accel-train (docs/data.md).
//
//   accel-data --tokenizer byte|PATH/tokenizer.json --out DIR [--eval-fraction F]
//              [--shard-tokens N] [--no-eot] FILES...
//   accel-data --info SHARDS...  [--tokenizer T --decode N]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "runtime/data/data.h"
#include "tools/cli.h"

namespace {

// 1234567 -> "1,234,567"
std::string grouped(int64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > (v < 0 ? 1 : 0); i -= 3) s.insert(i, ",");
  return s;
}

void print_shards(const char* kind, const std::vector<std::string>& paths) {
  for (const auto& p : paths) {
    auto s = accel::TokenShard::open(p, false);
    printf("  %-40s %s %s tokens (uint%d)\n", p.c_str(), kind, grouped(s->size()).c_str(),
           s->token_bytes() * 8);
  }
}

int info(const std::vector<std::string>& shards, const std::string& tokenizer_spec, int decode) {
  std::unique_ptr<accel::Tokenizer> tok;
  if (decode > 0) tok = accel::make_tokenizer(tokenizer_spec);
  for (const auto& path : accel::expand_data_paths(shards, "accel-data --info", ".tok")) {
    auto s = accel::TokenShard::open(path);  // validates every token
    printf("%s: %s tokens, uint%d, vocab_size %lld, max token %u\n", path.c_str(),
           grouped(s->size()).c_str(), s->token_bytes() * 8,
           static_cast<long long>(s->vocab_size()), s->max_token(0, s->size()));
    if (tok) {
      std::vector<uint32_t> ids(static_cast<size_t>(std::min<int64_t>(decode, s->size())));
      s->read(0, static_cast<int64_t>(ids.size()), ids.data());
      printf("  first %zu tokens: %s\n", ids.size(), tok->decode(ids).c_str());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "accel-data: tokenize text files into token shards for accel-train (format: docs/data.md)"};
  std::string tokenizer = "byte";
  std::string out_dir;
  double eval_fraction = 0.0;
  int64_t shard_tokens = 100'000'000;
  bool no_eot = false;
  bool show_info = false;
  int decode = 0;
  std::vector<std::string> files;
  app.add_option("--tokenizer,-t", tokenizer,
                 "'byte' (vocab 256) or a Hugging Face tokenizer.json (byte-level BPE)")
      ->capture_default_str();
  app.add_option("--out,-o", out_dir,
                 "output folder: train/train-NNNNN.tok, eval/eval-NNNNN.tok, manifest.json "
                 "(earlier shards there are replaced)");
  app.add_option("--eval-fraction", eval_fraction,
                 "hold out the last fraction of the tokens as eval shards")
      ->check(CLI::Range(0.0, 0.99))
      ->capture_default_str();
  app.add_option("--shard-tokens", shard_tokens, "tokens per shard file at most")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--no-eot", no_eot,
               "do not put the tokenizer's end-of-text token (e.g. <|endoftext|>) after each file");
  app.add_flag("--info", show_info, "print the header of each shard given as FILES and exit");
  app.add_option("--decode", decode, "with --info: decode this many first tokens");
  app.add_option("FILES", files, "text files or glob patterns (shards with --info)")->required();
  if (auto code = accel::parse_command_line(app, argc, argv)) return *code;

  try {
    if (show_info) return info(files, tokenizer, decode);
    if (out_dir.empty()) {
      fprintf(stderr, "accel-data: --out DIR is required\n");
      return 2;
    }
    auto tok = accel::make_tokenizer(tokenizer);
    accel::TextFileSelection selected =
        accel::select_text_files(accel::expand_data_paths(files, "accel-data", nullptr), "FILES");
    for (const std::string& n : selected.notices)
      fprintf(stderr, "accel-data: warning: %s\n", n.c_str());
    const std::vector<std::string>& inputs = selected.files;
    printf("tokenizer: %s\n", tok->description().c_str());
    accel::TextShardOptions o;
    o.out_dir = out_dir;
    o.shard_tokens = shard_tokens;
    o.eval_fraction = eval_fraction;
    o.end_of_text_between_files = !no_eot;
    accel::ShardSet set = accel::tokenize_text_files(inputs, *tok, o);
    for (const auto& [path, n] : set.file_tokens) {
      printf("  %-40s %s tokens\n", path.c_str(), grouped(n).c_str());
    }
    printf("wrote %zu train shard(s) with %s tokens and %zu eval shard(s) with %s tokens:\n",
           set.train_shards.size(), grouped(set.train_tokens).c_str(), set.eval_shards.size(),
           grouped(set.eval_tokens).c_str());
    print_shards("train", set.train_shards);
    print_shards("eval ", set.eval_shards);
    printf("  %s/manifest.json\n", out_dir.c_str());
    std::string use =
        "train on them with data.source: shards, data.train_path: " + out_dir + "/train";
    if (!set.eval_shards.empty()) use += ", data.eval_path: " + out_dir + "/eval";
    printf("%s\n", use.c_str());
  } catch (const std::exception& e) {
    fprintf(stderr, "accel-data: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
