// accel-data: text or JSONL files -> token shards for accel-train (docs/data.md).
//
//   accel-data --tokenizer byte|PATH/tokenizer.json --out DIR [--eval-fraction F]
//              [--shard-tokens N] [--no-eot] FILES...
//   accel-data --tokenizer T --out DIR [--format F] [--text-field K] [--chat-template C]
//              FILES.jsonl[.gz|.zst]...    (document shards: trained flags per token)
//   accel-data --info SHARDS...  [--tokenizer T --decode N]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "runtime/data/data.h"
#include "runtime/data/jsonl.h"
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
    if (s->has_documents()) {
      int64_t trained = 0;
      for (int64_t i = 0; i < s->size(); ++i) trained += s->trained(i) ? 1 : 0;
      printf("  %s documents, %s trained tokens\n", grouped(s->documents()).c_str(),
             grouped(trained).c_str());
    }
    if (tok) {
      std::vector<uint32_t> ids(static_cast<size_t>(std::min<int64_t>(decode, s->size())));
      s->read(0, static_cast<int64_t>(ids.size()), ids.data());
      printf("  first %zu tokens: %s\n", ids.size(), tok->decode(ids).c_str());
    }
  }
  return 0;
}

bool is_jsonl(const std::string& path) {
  for (const char* tail : {".jsonl", ".jsonl.gz", ".jsonl.zst"}) {
    const std::string t = tail;
    if (path.size() >= t.size() && path.compare(path.size() - t.size(), t.size(), t) == 0)
      return true;
  }
  return false;
}

// Parses a --format / --chat-template value by the config's spelling.
template <class E>
E parse_choice(const std::string& option, const std::string& v) {
  std::string all;
  for (size_t i = 0; i < std::size(accel::EnumNames<E>::names); ++i) {
    if (v == accel::EnumNames<E>::names[i]) return static_cast<E>(i);
    all += (i ? ", " : "") + std::string(accel::EnumNames<E>::names[i]);
  }
  throw std::invalid_argument(option + " '" + v + "' is not one of " + all);
}

int jsonl(const std::vector<std::string>& files, const accel::Tokenizer& tok,
          const accel::JsonlOptions& o, const std::string& out_dir, int64_t shard_tokens) {
  const accel::JsonlShardSet set =
      accel::tokenize_jsonl_files(files, tok, o, out_dir, shard_tokens);
  printf("%s\n", set.notice.c_str());
  for (const auto& [path, n] : set.file_documents)
    printf("  %-40s %s documents\n", path.c_str(), grouped(n).c_str());
  printf("wrote %zu document shard(s): %s documents, %s tokens, %s trained (%.1f%%)\n",
         set.shards.size(), grouped(set.documents).c_str(), grouped(set.tokens).c_str(),
         grouped(set.trained_tokens).c_str(),
         100.0 * static_cast<double>(set.trained_tokens) / static_cast<double>(set.tokens));
  for (const auto& p : set.shards) printf("  %s\n", p.c_str());
  printf("  %s/manifest.json\n", out_dir.c_str());
  printf(
      "train on them with data.source: shards, data.train_path: %s/train (the eval split comes "
      "from data.eval_fraction)\n",
      out_dir.c_str());
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
  std::string format = "auto", text_field = "text", chat_template = "auto";
  app.add_option("--format", format,
                 "JSONL inputs: auto (from the first line), text, prompt_completion, messages")
      ->capture_default_str();
  app.add_option("--text-field", text_field, "JSONL format text: the field to train on")
      ->capture_default_str();
  app.add_option("--chat-template", chat_template,
                 "JSONL format messages: llama3, chatml, qwen3, mistral, or auto (the "
                 "tokenizer_config.json beside --tokenizer)")
      ->capture_default_str();
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
    for (const std::string& f : files) accel::refuse_unreadable_dataset(f, "accel-data");
    const std::vector<std::string> expanded =
        accel::expand_data_paths(files, "accel-data", nullptr);
    const size_t n_jsonl =
        static_cast<size_t>(std::count_if(expanded.begin(), expanded.end(), is_jsonl));
    if (n_jsonl > 0) {
      if (n_jsonl != expanded.size())
        throw std::invalid_argument(
            "FILES mixes JSONL (.jsonl, .jsonl.gz, .jsonl.zst) and text files; make their "
            "shards in two runs");
      if (eval_fraction > 0)
        throw std::invalid_argument(
            "--eval-fraction is for text; JSONL document shards are split at training time by "
            "data.eval_fraction");
      if (no_eot)
        throw std::invalid_argument(
            "--no-eot is for text; every JSONL document ends with the end-of-text token when "
            "the tokenizer has one");
      accel::JsonlOptions o;
      o.format = parse_choice<accel::DataFormat>("--format", format);
      o.text_field = text_field;
      o.chat_template = parse_choice<accel::ChatTemplateChoice>("--chat-template", chat_template);
      o.tokenizer_spec = tokenizer;
      printf("tokenizer: %s\n", tok->description().c_str());
      return jsonl(expanded, *tok, o, out_dir, shard_tokens);
    }
    accel::TextFileSelection selected = accel::select_text_files(expanded, "FILES");
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
