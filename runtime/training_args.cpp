#include "runtime/training_args.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include "runtime/config.h"

namespace accel {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

enum class Kind { Mapped, NoEffect, Refused };

struct Mapper;
using Apply = std::function<void(Mapper&, const json&)>;

struct Arg {
  std::string name;
  json def;  // Trainer's default, as to_dict() dumps it
  Kind kind = Kind::Mapped;
  std::string target;   // docs: our key(s)
  std::string doc;      // docs: the conversion, or why it has no effect / is refused
  Apply apply;          // Mapped: sets our keys (may refuse values it cannot honour)
  std::string part_of;  // read by another name's conversion (eval_steps by eval_strategy)
  bool quiet = false;   // NoEffect: a value other than the default changes nothing here either
};

// A value for messages: strings bare, the rest as JSON, never long.
std::string brief(const json& v) {
  std::string s = v.is_string() ? v.get<std::string>() : v.dump();
  for (char& ch : s)
    if (static_cast<unsigned char>(ch) < 0x20) ch = ' ';
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

bool empty_value(const json& v) {
  return v.is_null() || (v.is_string() && v.get<std::string>().empty()) ||
         (v.is_array() && v.empty()) || (v.is_object() && v.empty());
}

// Trainer's default (or an equivalent spelling of "nothing": null, "", [], {}).
bool is_default(const json& v, const json& def) {
  return v == def || (empty_value(v) && empty_value(def));
}

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

struct Mapper {
  const json& args;
  const std::function<std::string(const std::string&)>& where;
  std::string base_dir;
  const std::map<std::string, const Arg*>& table;
  TrainingArgsMapping out;

  // The value given, else Trainer's default.
  const json& get(const std::string& name) const {
    auto it = args.find(name);
    if (it != args.end()) return *it;
    return table.at(name)->def;
  }
  bool given(const std::string& name) const { return args.contains(name); }
  std::string shown(const std::string& name) const { return name + "=" + brief(get(name)); }

  [[noreturn]] void fail(const std::string& name, const std::string& msg) const {
    throw ConfigError(where(name) + ": training_args." + name + ": " + msg);
  }
  [[noreturn]] void refuse(const std::string& name, const std::string& why) const {
    fail(name, brief(get(name)) + " cannot be honoured: " + why);
  }
  [[noreturn]] void type_error(const std::string& name, const std::string& expected) const {
    fail(name, "expected " + expected + ", got " + brief(get(name)));
  }
  void notice(const std::string& name, const json& v, const std::string& why) {
    out.notices.push_back("key training_args." + name + "=" + brief(v) +
                          " has no effect in accel-train (" + why + ")");
  }
  void set(const std::string& arg, const std::string& from, const std::string& key,
           const json& value) {
    out.keys.push_back({from, arg, key, value});
  }

  double number(const std::string& name) const {
    const json& v = get(name);
    if (!v.is_number()) type_error(name, "a number");
    return v.get<double>();
  }
  std::string text(const std::string& name) const {
    const json& v = get(name);
    if (!v.is_string()) type_error(name, "a string");
    return v.get<std::string>();
  }
  bool flag(const std::string& name) const {
    const json& v = get(name);
    if (!v.is_boolean()) type_error(name, "true or false");
    return v.get<bool>();
  }

  // A relative path: next to the file that named it when it exists there, else as given
  // (Trainer reads it relative to the working directory).
  std::string resolve(const std::string& p) const {
    fs::path fp(p);
    std::error_code ec;
    if (fp.is_relative() && !base_dir.empty() && fs::exists(fs::path(base_dir) / fp, ec))
      fp = fs::path(base_dir) / fp;
    return fs::absolute(fp, ec).lexically_normal().string();
  }

  // An object given inline or as the path of a JSON file (fsdp_config, accelerator_config).
  json object(const std::string& name) const {
    const json& v = get(name);
    if (v.is_null()) return json::object();
    if (v.is_object()) return v;
    if (v.is_string()) {
      const std::string s = v.get<std::string>();
      if (s.empty()) return json::object();
      if (s.front() == '{') {
        try {
          json j = json::parse(s);
          if (j.is_object()) return j;
        } catch (const json::exception&) {
        }
        type_error(name, "a JSON object or the path of a JSON file");
      }
      return read_json_object_file(resolve(s), where(name) + ": training_args." + name);
    }
    type_error(name, "a JSON object or the path of a JSON file");
  }

  // Steps given as a count, or below 1 as a fraction of max_steps (rounded up, as Trainer does).
  int64_t steps(const std::string& name, const json& v) const {
    if (!v.is_number() || v.get<double>() < 0) type_error(name, "a number of steps >= 0");
    const double d = v.get<double>();
    if (d >= 1 || d == 0) return static_cast<int64_t>(d);
    if (!given("max_steps"))
      fail(name, brief(v) + " is a fraction of max_steps, which training_args does not give");
    // An epoch run's step count is known only once the data is read, after this mapping.
    if (number("max_steps") <= 0)
      fail(name, brief(v) + " is a fraction of the run's steps, and " + shown("max_steps") +
                     " runs " + shown("num_train_epochs") +
                     " epochs, whose steps are counted from the data at start; give " + name +
                     " as a number of steps (or give max_steps > 0)");
    return static_cast<int64_t>(std::ceil(number("max_steps") * d));
  }
  std::string steps_from(const std::string& name, const json& v) const {
    std::string s = name + "=" + brief(v);
    if (v.is_number() && v.get<double>() > 0 && v.get<double>() < 1)
      s += " (a fraction of max_steps=" + brief(get("max_steps")) + ")";
    return s;
  }
};

std::vector<Arg> build_table() {
  std::vector<Arg> t;
  auto mapped = [&](const std::string& name, json def, const std::string& target,
                    const std::string& doc, Apply f) {
    Arg a;
    a.name = name;
    a.def = std::move(def);
    a.kind = Kind::Mapped;
    a.target = target;
    a.doc = doc;
    a.apply = std::move(f);
    t.push_back(std::move(a));
  };
  // A name another one's conversion reads (that one runs when either is given).
  auto part = [&](const std::string& name, json def, const std::string& target,
                  const std::string& doc, const std::string& owner) {
    mapped(name, std::move(def), target, doc, [](Mapper&, const json&) {});
    t.back().part_of = owner;
  };
  // Same meaning, value as given; null means Trainer leaves it to others, so we do too.
  auto same = [&](const std::string& name, json def, const std::string& key,
                  const std::string& doc = "") {
    mapped(name, std::move(def), key, doc, [name, key](Mapper& m, const json& v) {
      if (!v.is_null()) m.set(name, m.shown(name), key, v);
    });
  };
  auto no_effect = [&](const std::string& name, json def, const std::string& why,
                       bool quiet = false) {
    Arg a;
    a.name = name;
    a.def = std::move(def);
    a.kind = Kind::NoEffect;
    a.doc = why;
    a.quiet = quiet;
    t.push_back(std::move(a));
  };
  auto refused = [&](const std::string& name, json def, const std::string& why) {
    Arg a;
    a.name = name;
    a.def = std::move(def);
    a.kind = Kind::Refused;
    a.doc = why;
    t.push_back(std::move(a));
  };
  const json null;
  const std::string kEvalLoss = "evaluation computes only the loss";
  const std::string kHub = "nothing is uploaded to the Hub";
  const std::string kLoader =
      "the data loader is accel-train's own: token sequences read in the training process";
  const std::string kFused = "the kernels are fused by hand";

  // ---- output, length, batch ----
  mapped("output_dir", null, "training.output_dir", "As given (null: Trainer's trainer_output).",
         [](Mapper& m, const json& v) {
           m.set("output_dir", m.shown("output_dir"), "training.output_dir",
                 v.is_null() ? json("trainer_output") : v);
         });
  same("per_device_train_batch_size", 8, "training.micro_batch_size",
       "Sequences per micro-batch per process.");
  part("num_train_epochs", 3.0, "training.num_epochs",
       "Read with max_steps: used when max_steps < 0 (a fraction such as 2.5 stops mid-epoch, as "
       "in Trainer); ignored, as in Trainer, when max_steps > 0.",
       "max_steps");
  mapped("max_steps", -1, "training.max_steps or training.num_epochs",
         "> 0 -> training.max_steps (it overrides num_train_epochs, as in Trainer); < 0 (Trainer's "
         "-1) -> training.num_epochs = num_train_epochs: the steps are ceil(epochs x batches per "
         "epoch / gradient_accumulation_steps), printed at start (Trainer rounds each epoch's "
         "last accumulation up to a short step, so with batches per epoch not a multiple of "
         "gradient_accumulation_steps its count can be higher); 0 is refused.",
         [](Mapper& m, const json& v) {
           if (!v.is_number_integer() &&
               !(v.is_number() && v.get<double>() == std::floor(v.get<double>())))
             m.type_error("max_steps", "an integer");
           const double epochs = m.number("num_train_epochs");
           if (v.get<double>() > 0) {
             m.set("max_steps", m.shown("max_steps"), "training.max_steps", v);
             if (m.given("num_train_epochs"))
               m.out.notices.push_back("training_args " + m.shown("num_train_epochs") +
                                       " is not used: " + m.shown("max_steps") +
                                       " > 0 overrides it (as in Trainer)");
             return;
           }
           if (v.get<double>() == 0)
             m.fail("max_steps",
                    "0 trains nothing; give the number of optimizer steps, or -1 to run " +
                        m.shown("num_train_epochs") + " epochs");
           if (!(epochs > 0) || !std::isfinite(epochs))
             m.fail("num_train_epochs",
                    brief(m.get("num_train_epochs")) + " epochs with " + m.shown("max_steps") +
                        " trains nothing; give num_train_epochs > 0 or max_steps > 0");
           m.set("num_train_epochs", m.shown("max_steps") + ", " + m.shown("num_train_epochs"),
                 "training.num_epochs", epochs);
         });

  // ---- learning rate and schedule ----
  same("learning_rate", 5e-5, "optimizer.lr", "Peak learning rate.");
  mapped("lr_scheduler_type", "linear", "optimizer.lr_schedule, optimizer.min_lr_ratio",
         "linear -> linear, cosine -> cosine (both to 0: min_lr_ratio 0), cosine_with_min_lr -> "
         "cosine with min_lr_ratio from lr_scheduler_kwargs min_lr_rate (or min_lr / "
         "learning_rate), constant_with_warmup -> constant, constant -> constant without warmup "
         "(as in Trainer). Others are refused.",
         [](Mapper& m, const json&) {
           const std::string type = lower(m.text("lr_scheduler_type"));
           json kw = m.object("lr_scheduler_kwargs");
           const std::string from =
               m.shown("lr_scheduler_type") + (empty_value(m.get("lr_scheduler_kwargs"))
                                                   ? ""
                                                   : ", " + m.shown("lr_scheduler_kwargs"));
           // num_cycles 0.5 is the one half-wave accel-train's cosine draws.
           auto take_half_cycle = [&]() {
             if (kw.contains("num_cycles")) {
               if (!kw["num_cycles"].is_number() || kw["num_cycles"].get<double>() != 0.5)
                 m.refuse("lr_scheduler_kwargs",
                          "accel-train's cosine is one half-wave (num_cycles 0.5)");
               kw.erase("num_cycles");
             }
           };
           double min_ratio = 0;
           std::string sched;
           if (type == "linear") {
             sched = "linear";
           } else if (type == "cosine") {
             sched = "cosine";
             take_half_cycle();
           } else if (type == "cosine_with_min_lr") {
             sched = "cosine";
             take_half_cycle();
             if (kw.contains("min_lr_rate") == kw.contains("min_lr"))
               m.fail("lr_scheduler_kwargs",
                      "cosine_with_min_lr needs exactly one of min_lr_rate and min_lr");
             if (kw.contains("min_lr_rate")) {
               if (!kw["min_lr_rate"].is_number())
                 m.type_error("lr_scheduler_kwargs", "min_lr_rate as a number");
               min_ratio = kw["min_lr_rate"].get<double>();
               kw.erase("min_lr_rate");
             } else {
               if (!kw["min_lr"].is_number())
                 m.type_error("lr_scheduler_kwargs", "min_lr as a number");
               min_ratio = kw["min_lr"].get<double>() / m.number("learning_rate");
               kw.erase("min_lr");
             }
           } else if (type == "constant" || type == "constant_with_warmup") {
             sched = "constant";
           } else {
             m.refuse("lr_scheduler_type",
                      "accel-train implements linear, cosine, cosine_with_min_lr, constant and "
                      "constant_with_warmup (optimizer.lr_schedule)");
           }
           if (!kw.empty())
             m.refuse("lr_scheduler_kwargs", "accel-train's " + type + " schedule takes no " +
                                                 kw.begin().key() + " argument");
           m.set("lr_scheduler_type", from, "optimizer.lr_schedule", sched);
           if (sched != "constant")
             m.set("lr_scheduler_type", from, "optimizer.min_lr_ratio", min_ratio);
         });
  part("lr_scheduler_kwargs", null, "-", "Read with lr_scheduler_type.", "lr_scheduler_type");
  mapped("warmup_steps", 0, "optimizer.warmup_steps",
         "A count, or below 1 a fraction of max_steps (rounded up). accel-train's ramp is "
         "lr * (step + 1) / warmup_steps, Trainer's lr * step / warmup_steps (one step earlier). "
         "No warmup with lr_scheduler_type constant (as in Trainer).",
         [](Mapper& m, const json&) {
           const bool ratio = !m.get("warmup_ratio").is_null();
           const std::string name = ratio ? "warmup_ratio" : "warmup_steps";
           const json& v = m.get(name);
           int64_t w = m.steps(name, v);
           if (lower(m.text("lr_scheduler_type")) == "constant") {
             if (w > 0)
               m.notice(name, v,
                        "lr_scheduler_type constant has no warmup in Trainer either; use "
                        "constant_with_warmup");
             w = 0;
           }
           m.set(name, m.steps_from(name, v), "optimizer.warmup_steps", w);
         });

  // ---- optimizer ----
  mapped("optim", "adamw_torch_fused", "optimizer.name",
         "adamw_torch, adamw_torch_fused (and the other plain AdamW kernels) -> adamw; sgd -> "
         "sgd with momentum 0 (torch.optim.SGD's default). Others are refused.",
         [](Mapper& m, const json&) {
           const std::string o = lower(m.text("optim"));
           if (o == "adamw_torch" || o == "adamw_torch_fused" || o == "adamw_torch_xla" ||
               o == "adamw_torch_npu_fused" || o == "adamw_apex_fused" || o == "adamw_hf") {
             m.set("optim", m.shown("optim"), "optimizer.name", "adamw");
           } else if (o == "sgd") {
             m.set("optim", m.shown("optim"), "optimizer.name", "sgd");
             m.set("optim", m.shown("optim"), "optimizer.momentum", 0.0);
           } else {
             m.refuse("optim", "accel-train implements AdamW and SGD (optimizer.name)");
           }
         });
  refused("optim_args", null, "accel-train's AdamW and SGD take no extra optimizer arguments");
  same("weight_decay", 0.0, "optimizer.weight_decay",
       "accel-train decays every weight; Trainer skips biases (Llama has none) and norm weights.");
  same("adam_beta1", 0.9, "optimizer.beta1");
  same("adam_beta2", 0.999, "optimizer.beta2");
  same("adam_epsilon", 1e-8, "optimizer.eps");
  refused("optim_target_modules", null, "GaLore / APOLLO optimizers are not implemented");

  // ---- stability ----
  same("gradient_accumulation_steps", 1, "gradient_accumulation_steps");
  no_effect("average_tokens_across_devices", true,
            "every micro-batch holds the same number of tokens (packed sequences), so both "
            "averages are the same",
            true);
  same("max_grad_norm", 1.0, "optimizer.grad_clip", "0 turns clipping off in both.");
  refused("label_smoothing_factor", 0.0, "the loss is plain cross-entropy");

  // ---- precision ----
  mapped("bf16", false, "mixed_precision",
         "true -> bf16; false leaves mixed_precision to the Accelerate keys (as Trainer does).",
         [](Mapper& m, const json&) {
           if (m.flag("bf16") && m.flag("fp16"))
             m.fail("bf16", "bf16 and fp16 are both true; pick one (as Trainer requires)");
           if (m.flag("bf16")) m.set("bf16", m.shown("bf16"), "mixed_precision", "bf16");
         });
  mapped("fp16", false, "mixed_precision",
         "true -> fp16 (dynamic loss scaling); false leaves mixed_precision to the Accelerate "
         "keys.",
         [](Mapper& m, const json&) {
           if (m.flag("fp16") && !m.flag("bf16"))
             m.set("fp16", m.shown("fp16"), "mixed_precision", "fp16");
         });
  no_effect("bf16_full_eval", false, "evaluation runs in the training precision");
  no_effect("fp16_full_eval", false, "evaluation runs in the training precision");
  same("tf32", null, "training.allow_tf32", "null leaves it to accel-train (off).");

  // ---- memory and speed ----
  mapped("gradient_checkpointing", false, "training.activation_checkpointing",
         "true -> full (every layer recomputed whole), false -> none.",
         [](Mapper& m, const json& v) {
           if (v.is_null()) return;  // Trainer's default, as for the other mapped flags
           m.set("gradient_checkpointing", m.shown("gradient_checkpointing"),
                 "training.activation_checkpointing",
                 m.flag("gradient_checkpointing") ? "full" : "none");
         });
  no_effect("gradient_checkpointing_kwargs", null,
            "recomputation has no variants (use_reentrant) to choose", true);
  no_effect("torch_compile", false, "torch.compile is not used; " + kFused);
  no_effect("torch_compile_backend", null, "torch.compile is not used; " + kFused);
  no_effect("torch_compile_mode", null, "torch.compile is not used; " + kFused);
  no_effect("use_liger_kernel", false, "Liger kernels are not used; " + kFused);
  no_effect("liger_kernel_config", null, "Liger kernels are not used; " + kFused);
  no_effect("use_cache", false, "training runs without a KV cache");
  refused("neftune_noise_alpha", null, "NEFTune embedding noise is not implemented");
  no_effect("torch_empty_cache_steps", null,
            "accel-train's caching allocator is not emptied on a schedule");
  no_effect("auto_find_batch_size", false,
            "the batch size is fixed: per_device_train_batch_size (training.micro_batch_size)");

  // ---- logging ----
  mapped("logging_strategy", "steps", "training.log_every",
         "steps: log every logging_steps; no: metrics are still logged (a notice); epoch is "
         "refused.",
         [](Mapper& m, const json& v) {
           const std::string s = lower(m.text("logging_strategy"));
           if (s == "steps") {
             const json& n = m.get("logging_steps");
             m.set("logging_steps", m.steps_from("logging_steps", n), "training.log_every",
                   std::max<int64_t>(1, m.steps("logging_steps", n)));
           } else if (s == "no") {
             m.notice("logging_strategy", v,
                      "metrics.jsonl always gets a line every training.log_every steps");
           } else {
             m.refuse("logging_strategy",
                      "logging at the end of epochs is not supported (runs of num_train_epochs "
                      "epochs are); use steps");
           }
         });
  part("logging_steps", 500, "training.log_every",
       "With logging_strategy steps; below 1 a fraction of max_steps.", "logging_strategy");
  no_effect("logging_first_step", false,
            "lines are written every training.log_every steps and at the last step");
  no_effect("log_on_each_node", true, "rank 0 writes the log", true);
  no_effect("logging_nan_inf_filter", true, "a non-finite loss follows training.nan_policy", true);
  no_effect("include_num_input_tokens_seen", "no", "tokens_per_s is always logged");
  no_effect("log_level", "passive", "accel-train has one log level", true);
  no_effect("log_level_replica", "warning", "only rank 0 prints progress", true);
  mapped("disable_tqdm", false, "training.progress",
         "true -> plain (lines instead of a bar); false/null leaves it at auto.",
         [](Mapper& m, const json& v) {
           if (v.is_boolean() && v.get<bool>())
             m.set("disable_tqdm", m.shown("disable_tqdm"), "training.progress", "plain");
         });
  mapped("report_to", json::array(), "logging.tensorboard",
         "tensorboard (alone or in a list) -> true; none/[] leaves it at its default (true); "
         "another integration gets a notice: metrics go to metrics.jsonl, loss.svg and tb/.",
         [](Mapper& m, const json& v) {
           std::vector<std::string> names;
           if (v.is_string()) names.push_back(lower(v.get<std::string>()));
           if (v.is_array())
             for (const json& e : v)
               if (e.is_string()) names.push_back(lower(e.get<std::string>()));
           std::string others;
           for (const std::string& n : names) {
             if (n == "tensorboard")
               m.set("report_to", m.shown("report_to"), "logging.tensorboard", true);
             else if (n != "none")
               others += (others.empty() ? "" : ", ") + n;
           }
           if (!others.empty())
             m.notice("report_to", v,
                      "no integration for " + others +
                          ": metrics go to metrics.jsonl (logging.metrics_file), loss.svg and "
                          "TensorBoard files in training.output_dir/tb");
         });
  no_effect("run_name", null, "only trackers use it", true);
  no_effect("project", "huggingface", "only trackers use it", true);
  no_effect("trackio_space_id", null, "only trackers use it", true);
  no_effect("trackio_bucket_id", null, "only trackers use it", true);
  no_effect("trackio_static_space_id", null, "only trackers use it", true);

  // ---- evaluation ----
  mapped("eval_strategy", "no", "training.eval_every",
         "no -> 0; steps -> eval_steps (else logging_steps; below 1 a fraction of max_steps); "
         "epoch is refused.",
         [](Mapper& m, const json&) {
           const std::string s = lower(m.text("eval_strategy"));
           if (s == "no") {
             if (!m.get("eval_steps").is_null())
               m.notice("eval_steps", m.get("eval_steps"),
                        "eval_strategy is no, so Trainer would not evaluate either");
             m.set("eval_strategy", m.shown("eval_strategy"), "training.eval_every", 0);
           } else if (s == "steps") {
             const json& e = m.get("eval_steps");
             const bool own = !e.is_null() && !(e.is_number() && e.get<double>() == 0);
             const std::string name = own ? "eval_steps" : "logging_steps";
             const json& n = m.get(name);
             m.set(name, m.shown("eval_strategy") + ", " + m.steps_from(name, n),
                   "training.eval_every", std::max<int64_t>(1, m.steps(name, n)));
           } else {
             m.refuse("eval_strategy",
                      "evaluating at the end of epochs is not supported (runs of num_train_epochs "
                      "epochs are); use steps");
           }
         });
  part("eval_steps", null, "training.eval_every", "With eval_strategy steps.", "eval_strategy");
  no_effect("eval_delay", 0, "evaluation starts at the first training.eval_every step");
  mapped("per_device_eval_batch_size", 8, "-",
         "Evaluation uses training.micro_batch_size (a notice when the two differ).",
         [](Mapper& m, const json& v) {
           if (v != m.get("per_device_train_batch_size"))
             m.notice("per_device_eval_batch_size", v,
                      "evaluation runs training.eval_batches micro-batches of "
                      "per_device_train_batch_size sequences");
         });
  no_effect("prediction_loss_only", false, kEvalLoss, true);
  no_effect("eval_on_start", false, "the first evaluation is at step training.eval_every");
  no_effect("eval_do_concat_batches", true, kEvalLoss, true);
  no_effect("eval_use_gather_object", false, kEvalLoss, true);
  no_effect("eval_accumulation_steps", null, kEvalLoss, true);
  no_effect("include_for_metrics", json::array(), kEvalLoss, true);
  no_effect("batch_eval_metrics", false, kEvalLoss, true);

  // ---- checkpoints ----
  mapped("save_only_model", false, "checkpoint.save_optimizer", "Negated.",
         [](Mapper& m, const json&) {
           m.set("save_only_model", m.shown("save_only_model"), "checkpoint.save_optimizer",
                 !m.flag("save_only_model"));
         });
  mapped("save_strategy", "steps", "checkpoint.every_steps, checkpoint.at_end",
         "steps -> every save_steps (below 1 a fraction of max_steps) and at the end; no -> no "
         "checkpoints; epoch and best are refused.",
         [](Mapper& m, const json&) {
           const std::string s = lower(m.text("save_strategy"));
           if (s == "steps") {
             const json& n = m.get("save_steps");
             const std::string from =
                 m.shown("save_strategy") + ", " + m.steps_from("save_steps", n);
             m.set("save_steps", from, "checkpoint.every_steps", m.steps("save_steps", n));
             m.set("save_strategy", from, "checkpoint.at_end", true);
           } else if (s == "no") {
             m.set("save_strategy", m.shown("save_strategy"), "checkpoint.every_steps", 0);
             m.set("save_strategy", m.shown("save_strategy"), "checkpoint.at_end", false);
           } else {
             m.refuse("save_strategy",
                      s == "best" ? "there is no best-model tracking; use steps"
                                  : "saving at the end of epochs is not supported (runs of "
                                    "num_train_epochs epochs are); use steps");
           }
         });
  part("save_steps", 500, "checkpoint.every_steps", "With save_strategy steps.", "save_strategy");
  no_effect("save_on_each_node", false,
            "rank 0 writes checkpoints (each rank its own shard with SHARDED_STATE_DICT)");
  mapped("save_total_limit", null, "checkpoint.keep_last", "null -> 0 (keep all).",
         [](Mapper& m, const json& v) {
           m.set("save_total_limit", m.shown("save_total_limit"), "checkpoint.keep_last",
                 v.is_null() ? json(0) : v);
         });
  no_effect("enable_jit_checkpoint", false,
            "SIGTERM always finishes the step, writes its checkpoint and exits 3; --resume auto "
            "continues");

  // ---- Hub ----
  refused("push_to_hub", false, kHub + "; upload output_dir/checkpoints/step_N yourself");
  no_effect("hub_token", null, kHub, true);
  no_effect("hub_private_repo", null, kHub, true);
  no_effect("hub_model_id", null, kHub, true);
  no_effect("hub_strategy", "every_save", kHub, true);
  no_effect("hub_always_push", false, kHub, true);
  no_effect("hub_revision", null, kHub, true);

  // ---- best model, resume, reproducibility ----
  refused("load_best_model_at_end", false,
          "there is no best-model tracking; the final model is the last step's");
  no_effect("metric_for_best_model", null, "there is no best-model tracking", true);
  no_effect("greater_is_better", null, "there is no best-model tracking", true);
  no_effect("ignore_data_skip", false, "--resume always restores the data position exactly");
  no_effect("restore_callback_states_from_checkpoint", false, "there are no callbacks", true);
  no_effect("full_determinism", false, "runs are reproducible from training.seed already", true);
  same("seed", 42, "training.seed");
  mapped("data_seed", null, "-",
         "null or equal to seed; another value is refused (one seed drives init and data order).",
         [](Mapper& m, const json& v) {
           if (!v.is_null() && v != m.get("seed"))
             m.refuse("data_seed",
                      "one seed (training.seed) drives both initialization and data order");
         });

  // ---- hardware, Accelerate ----
  mapped("use_cpu", false, "use_cpu",
         "true -> use_cpu: true; false leaves it to the Accelerate keys.",
         [](Mapper& m, const json&) {
           if (m.flag("use_cpu")) m.set("use_cpu", m.shown("use_cpu"), "use_cpu", true);
         });
  mapped("accelerator_config", null, "-",
         "An object or a JSON file: split_batches true is refused; dispatch_batches, even_batches, "
         "use_seedable_sampler, non_blocking, gradient_accumulation_kwargs and "
         "use_configured_state have no effect (a notice when not Trainer's default).",
         [](Mapper& m, const json&) {
           static const std::map<std::string, std::pair<json, std::string>> kKeys = {
               {"split_batches", {false, ""}},
               {"dispatch_batches", {nullptr, "every rank reads its own part of the data"}},
               {"even_batches", {true, "every rank always gets full batches"}},
               {"use_seedable_sampler", {true, "the data order always follows training.seed"}},
               {"non_blocking", {false, "host-to-device copies are accel-train's own"}},
               {"gradient_accumulation_kwargs",
                {nullptr, "accumulation is gradient_accumulation_steps micro-batches per step"}},
               {"use_configured_state", {false, "accel-train sets up its own process group"}}};
           const json cfg = m.object("accelerator_config");
           for (auto it = cfg.begin(); it != cfg.end(); ++it) {
             auto k = kKeys.find(it.key());
             if (k == kKeys.end()) {
               std::string names;
               for (const auto& kv : kKeys) names += (names.empty() ? "" : ", ") + kv.first;
               m.fail("accelerator_config",
                      "unknown key '" + it.key() + "' (AcceleratorConfig has " + names + ")");
             }
             if (is_default(it.value(), k->second.first) ||
                 (it.key() == "dispatch_batches" && it.value() == false))
               continue;
             if (it.key() == "split_batches")
               m.fail("accelerator_config",
                      "split_batches=true cannot be honoured: batches are per process "
                      "(per_device_train_batch_size sequences on every rank)");
             m.notice("accelerator_config." + it.key(), it.value(), k->second.second);
           }
         });
  mapped("parallelism_config", null, "parallelism_config",
         "Passed to the top-level parallelism_config (tensor / context parallel sizes above 1 "
         "are refused there).",
         [](Mapper& m, const json& v) {
           if (empty_value(v)) return;
           json p = v;
           if (v.is_string()) {
             try {
               p = json::parse(v.get<std::string>());
             } catch (const json::exception&) {
               m.type_error("parallelism_config", "a JSON object");
             }
           }
           m.set("parallelism_config", m.shown("parallelism_config"), "parallelism_config", p);
         });

  // ---- data loading ----
  no_effect("dataloader_drop_last", false, "batches are always full (packed sequences)", true);
  no_effect("dataloader_num_workers", 0, kLoader);
  no_effect("dataloader_pin_memory", true, kLoader, true);
  no_effect("dataloader_persistent_workers", false, kLoader);
  no_effect("dataloader_prefetch_factor", null, kLoader);
  no_effect("dataloader_multiprocessing_context", null, kLoader);
  no_effect("dataloader_in_order", true, kLoader);
  no_effect("remove_unused_columns", true, "the data is token sequences", true);
  no_effect("label_names", null, "the labels are the input tokens shifted by one", true);
  mapped("train_sampling_strategy", "random", "data.shuffle",
         "random -> true, sequential -> false; group_by_length is refused.",
         [](Mapper& m, const json&) {
           const std::string s = lower(m.text("train_sampling_strategy"));
           if (s != "random" && s != "sequential")
             m.refuse("train_sampling_strategy",
                      "all sequences have the same length (training.seq_len); use random or "
                      "sequential");
           m.set("train_sampling_strategy", m.shown("train_sampling_strategy"), "data.shuffle",
                 s == "random");
         });
  no_effect("length_column_name", "length", "all sequences have the same length", true);

  // ---- DDP ----
  same("ddp_find_unused_parameters", null, "distributed.find_unused_parameters");
  same("ddp_bucket_cap_mb", null, "distributed.ddp_bucket_cap_mb");
  no_effect("ddp_broadcast_buffers", null, "the model has no buffers to broadcast", true);
  no_effect("ddp_static_graph", null, "the gradient buckets do not depend on a static graph", true);
  mapped("ddp_backend", null, "distributed.backend",
         "nccl -> nccl, gloo -> cpu (TCP); others are refused; null leaves it at auto.",
         [](Mapper& m, const json& v) {
           if (v.is_null()) return;
           const std::string b = lower(m.text("ddp_backend"));
           if (b != "nccl" && b != "gloo")
             m.refuse("ddp_backend",
                      "accel-train has nccl (GPU) and its own TCP collectives "
                      "(cpu, what gloo is used for)");
           m.set("ddp_backend", m.shown("ddp_backend"), "distributed.backend",
                 b == "nccl" ? "nccl" : "cpu");
         });
  same("ddp_timeout", 1800, "distributed.timeout_s", "Seconds.");

  // ---- FSDP, DeepSpeed ----
  mapped("fsdp", json::array(), "distributed_type: FSDP, fsdp_config.*",
         "full_shard / shard_grad_op -> FSDP with fsdp_reshard_after_forward true / false; offload "
         "-> fsdp_offload_params; auto_wrap -> TRANSFORMER_BASED_WRAP (SIZE_BASED_WRAP when "
         "fsdp_config min_num_params > 0). no_shard and hybrid_shard* are refused. fsdp_config (an "
         "object or a JSON file; keys with or without the fsdp_ prefix) is read as Accelerate's "
         "fsdp_config.",
         [](Mapper& m, const json& v) {
           std::vector<std::string> opts;
           if (v.is_boolean()) {
             if (v.get<bool>()) opts.push_back("full_shard");
           } else if (v.is_string()) {
             std::istringstream in(v.get<std::string>());
             for (std::string o; in >> o;) opts.push_back(lower(o));
           } else if (v.is_array()) {
             for (const auto& o : v) {
               if (!o.is_string())
                 m.type_error("fsdp", "FSDP options such as \"full_shard auto_wrap\"");
               opts.push_back(lower(o.get<std::string>()));
             }
           } else if (!v.is_null()) {
             m.type_error("fsdp", "FSDP options such as \"full_shard auto_wrap\"");
           }
           json cfg = m.object("fsdp_config");
           // Trainer strips the fsdp_ prefix of fsdp_config keys.
           json plain = json::object();
           for (auto it = cfg.begin(); it != cfg.end(); ++it) {
             std::string k = it.key();
             if (k.rfind("fsdp_", 0) == 0) k = k.substr(5);
             plain[k] = it.value();
           }
           const json min_params = plain.value("min_num_params", json(0));
           if (opts.empty()) {
             // Trainer ignores fsdp_config without fsdp; it dumps min_num_params and xla* anyway.
             for (auto it = plain.begin(); it != plain.end(); ++it) {
               const bool dumped_default = (it.key() == "min_num_params" && it.value() == 0) ||
                                           (it.key().rfind("xla", 0) == 0 &&
                                            (it.value() == false || empty_value(it.value())));
               if (!dumped_default) {
                 m.notice("fsdp_config", m.get("fsdp_config"),
                          "fsdp is not set, so Trainer would not use it either");
                 break;
               }
             }
             return;
           }
           const std::string from = m.shown("fsdp");
           m.set("fsdp", from, "distributed_type", "FSDP");
           const bool full = std::count(opts.begin(), opts.end(), "full_shard") > 0;
           const bool grad_op = std::count(opts.begin(), opts.end(), "shard_grad_op") > 0;
           if (full && grad_op) m.fail("fsdp", "full_shard and shard_grad_op exclude each other");
           bool auto_wrap = false, offload = false;
           for (const auto& o : opts) {
             if (o == "full_shard" || o == "shard_grad_op") {
               m.set("fsdp", from, "fsdp_config.fsdp_reshard_after_forward", o == "full_shard");
             } else if (o == "offload") {
               offload = true;
               m.set("fsdp", from, "fsdp_config.fsdp_offload_params", true);
             } else if (o == "auto_wrap") {
               auto_wrap = true;
             } else if (o == "no_shard") {
               m.refuse("fsdp",
                        "no_shard is plain data parallelism: use distributed_type "
                        "MULTI_GPU (no fsdp)");
             } else if (o == "hybrid_shard" || o == "hybrid_shard_zero2") {
               m.refuse("fsdp",
                        "hybrid sharding is not implemented; use full_shard or "
                        "shard_grad_op");
             } else {
               m.fail("fsdp", "unknown FSDP option '" + o +
                                  "' (full_shard, shard_grad_op, offload, auto_wrap, no_shard, "
                                  "hybrid_shard, hybrid_shard_zero2)");
             }
           }
           if (offload && !full && !grad_op)
             m.fail("fsdp", "offload needs full_shard or shard_grad_op (as Trainer requires)");
           if (auto_wrap) {
             const bool by_size = min_params.is_number() && min_params.get<double>() > 0;
             m.set("fsdp", from, "fsdp_config.fsdp_auto_wrap_policy",
                   by_size ? "SIZE_BASED_WRAP" : "TRANSFORMER_BASED_WRAP");
           }
           // The rest of fsdp_config, read as Accelerate's fsdp_config keys.
           std::vector<std::string> known;
           for (const auto& k : config_keys())
             if (k.path.rfind("fsdp_config.fsdp_", 0) == 0) known.push_back(k.path.substr(17));
           const std::string cfrom = "fsdp_config";
           for (auto it = plain.begin(); it != plain.end(); ++it) {
             const std::string& k = it.key();
             const json& val = it.value();
             if (k == "min_num_params") {
               if (auto_wrap && val.is_number() && val.get<double>() > 0)
                 m.set("fsdp_config", cfrom + ".min_num_params=" + brief(val),
                       "fsdp_config.fsdp_min_num_params", val);
             } else if (k == "xla" || k == "xla_fsdp_v2" || k == "xla_fsdp_grad_ckpt" ||
                        k == "xla_fsdp_settings") {
               if (!(val == false || empty_value(val)))
                 m.fail("fsdp_config", k + "=" + brief(val) +
                                           " cannot be honoured: XLA (TPU) FSDP is not supported");
             } else if (k == "limit_all_gathers") {
               // Gathers run at most one unit ahead already.
             } else if (k == "transformer_layer_cls_to_wrap") {
               std::string names;
               if (val.is_string()) {
                 names = val.get<std::string>();
               } else if (val.is_array()) {
                 for (const auto& n : val) {
                   if (!n.is_string()) m.type_error("fsdp_config", "layer class names");
                   names += (names.empty() ? "" : ",") + n.get<std::string>();
                 }
               } else {
                 m.type_error("fsdp_config", "transformer_layer_cls_to_wrap as class names");
               }
               m.set("fsdp_config", cfrom + "." + k + "=" + brief(val),
                     "fsdp_config.fsdp_transformer_layer_cls_to_wrap", names);
             } else {
               std::string ours = k == "cpu_offload" ? "offload_params" : k;
               if (std::find(known.begin(), known.end(), ours) == known.end()) {
                 std::string best;
                 size_t best_d = std::numeric_limits<size_t>::max();
                 for (const auto& c : known) {
                   size_t d = config_edit_distance(ours, c);
                   if (d < best_d) best_d = d, best = c;
                 }
                 m.fail("fsdp_config", "unknown FSDP config key '" + k + "'" +
                                           (best_d <= 3 ? "; did you mean '" + best + "'?" : ""));
               }
               m.set("fsdp_config", cfrom + "." + k + "=" + brief(val), "fsdp_config.fsdp_" + ours,
                     val);
             }
           }
         });
  part("fsdp_config", null, "fsdp_config.*", "Read with fsdp.", "fsdp");
  mapped("deepspeed", null, "distributed_type: DEEPSPEED, deepspeed_config.deepspeed_config_file",
         "The path of a DeepSpeed JSON config, read as deepspeed_config_file (an inline object "
         "is refused: give a file).",
         [](Mapper& m, const json& v) {
           if (empty_value(v)) return;
           if (!v.is_string())
             m.refuse("deepspeed", "give the DeepSpeed config as the path of its JSON file");
           const std::string p = m.resolve(v.get<std::string>());
           m.set("deepspeed", m.shown("deepspeed"), "distributed_type", "DEEPSPEED");
           m.set("deepspeed", m.shown("deepspeed"), "deepspeed_config.deepspeed_config_file", p);
         });

  // ---- debugging, scripts, deprecated ----
  no_effect("debug", json::array(), "accel-train has no separate debug mode");
  no_effect("skip_memory_metrics", true, "peak memory is always logged (peak_mem_bytes)", true);
  no_effect("do_train", false, "Trainer does not use it either", true);
  no_effect("do_eval", false, "Trainer does not use it either", true);
  no_effect("do_predict", false, "Trainer does not use it either", true);
  no_effect("resume_from_checkpoint", null,
            "Trainer does not use it either; resume with accel-train --resume auto or --resume "
            "PATH");
  part("warmup_ratio", null, "optimizer.warmup_steps",
       "Deprecated spelling of a warmup_steps "
       "fraction; read with warmup_steps.",
       "warmup_steps");
  no_effect("logging_dir", null,
            "TensorBoard files go to training.output_dir/tb (logging.tensorboard), metrics to "
            "metrics.jsonl there");
  no_effect("local_rank", -1, "the launcher's environment gives the rank", true);
  return t;
}

const std::vector<Arg>& table() {
  static const std::vector<Arg> t = build_table();
  return t;
}

const std::map<std::string, const Arg*>& index() {
  static const std::map<std::string, const Arg*> m = [] {
    std::map<std::string, const Arg*> r;
    for (const auto& a : table()) r[a.name] = &a;
    return r;
  }();
  return m;
}

}  // namespace

json read_json_object_file(const std::string& path, const std::string& where) {
  std::ifstream in(path);
  if (!in) throw ConfigError(where + ": cannot open '" + path + "'");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw ConfigError(where + ": '" + path + "' is not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw ConfigError(where + ": '" + path + "' must hold a JSON object");
  return j;
}

std::vector<std::string> training_args_names() {
  std::vector<std::string> n;
  for (const auto& a : table()) n.push_back(a.name);
  return n;
}

TrainingArgsMapping map_training_args(const json& args,
                                      const std::function<std::string(const std::string&)>& where,
                                      const std::string& base_dir) {
  if (!args.is_object())
    throw ConfigError(where("") + ": training_args must be an object of TrainingArguments names");
  for (auto it = args.begin(); it != args.end(); ++it) {
    if (index().count(it.key())) continue;
    std::string best;
    size_t best_d = std::numeric_limits<size_t>::max();
    for (const auto& a : table()) {
      size_t d = config_edit_distance(it.key(), a.name);
      if (d < best_d) best_d = d, best = a.name;
    }
    throw ConfigError(where(it.key()) + ": unknown TrainingArguments name 'training_args." +
                      it.key() + "'" +
                      (best_d <= std::max<size_t>(2, it.key().size() / 3)
                           ? "; did you mean '" + best + "'?"
                           : " (the names are transformers 5.x TrainingArguments fields)"));
  }
  Mapper m{args, where, base_dir, index(), {}};
  // Names not given leave our keys alone (a dump gives them all); a conversion runs when its
  // name or one it reads is given.
  auto wanted = [&](const Arg& a) {
    if (m.given(a.name)) return true;
    for (const auto& b : table())
      if (b.part_of == a.name && m.given(b.name)) return true;
    return false;
  };
  for (const auto& a : table()) {
    const json& v = m.get(a.name);
    if (!a.part_of.empty() || !wanted(a)) continue;
    switch (a.kind) {
      case Kind::Mapped:
        a.apply(m, v);
        break;
      case Kind::NoEffect:
        if (!a.quiet && !is_default(v, a.def)) m.notice(a.name, v, a.doc);
        break;
      case Kind::Refused:
        if (!is_default(v, a.def)) m.refuse(a.name, a.doc);
        break;
    }
  }
  return std::move(m.out);
}

std::string training_args_reference_markdown() {
  std::ostringstream o;
  o << "| TrainingArguments | default | accel-train |\n|---|---|---|\n";
  for (const auto& a : table()) {
    std::string what;
    switch (a.kind) {
      case Kind::Mapped:
        what = (a.target == "-" ? "" : "`" + a.target + "`" + (a.doc.empty() ? "" : ": ")) + a.doc;
        break;
      case Kind::NoEffect:
        what = "No effect (" + a.doc + ")" + (a.quiet ? "." : "; a notice when not the default.");
        break;
      case Kind::Refused:
        what = "Refused unless the default (" + a.doc + ").";
        break;
    }
    std::string def = a.def.dump();
    for (auto& ch : what)
      if (ch == '|') ch = '/';
    o << "| `" << a.name << "` | `" << def << "` | " << what << " |\n";
  }
  return o.str();
}

}  // namespace accel
