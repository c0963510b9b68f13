// Shared by the strategy tests: a tiny Llama, deterministic token batches split over ranks the way
// the data loader splits them, a training loop that calls the strategy as the trainer does, an
// independent reference for the single process, and tolerant comparisons against it.
#pragma once

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "models/decoder.h"
#include "models/fp8_linear.h"
#include "parallel/ddp.h"
#include "parallel/strategy.h"
#include "parallel/zero.h"
#include "runtime/config.h"
#include "runtime/device.h"
#include "tests/parallel/harness.h"

namespace accel::testing {

inline DecoderConfig tiny_llama(int64_t layers = 2, bool tied = false) {
  DecoderConfig c;
  c.tie_word_embeddings = tied;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.vocab_size = 64;
  c.max_position_embeddings = 32;
  return c;
}

// tiny_llama as another family: a tiny Qwen2 (q/k/v biases), Qwen3 (q/k norms, biases, head_dim
// apart from hidden / heads, tied embeddings), Mistral (a sliding window shorter than the tests'
// 8 tokens), Qwen3-MoE or Mixtral (4 experts, top-2; Qwen3-MoE's layer 1 stays dense).
inline DecoderConfig tiny_family(const std::string& family) {
  DecoderConfig c = tiny_llama(2);
  c.model_type = family;
  if (family == "qwen3") {
    c.head_dim = 16;  // 4 heads of 16 from a width of 32
    c.attention_bias = true;
    c.tie_word_embeddings = true;
  }
  if (family == "mistral") c.sliding_window = 5;
  if (family == "qwen3_moe" || family == "mixtral") {
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    if (family == "qwen3_moe") {
      c.moe_intermediate_size = 16;
      c.norm_topk_prob = true;
      c.mlp_only_layers = {1};
    }
  }
  return c;
}

// The reference every strategy is compared with: one process, written without the engine
// (parallel/zero.h) that the strategies, `single` included, share. Each parameter keeps its own
// fp32 master and its autograd gradient; the norm, the non-finite check, clipping and the update
// are done here directly on whole tensors. (It is what SingleProcessStrategy was before the engine
// took the single process over, so it also writes that strategy's checkpoints: state by
// parameter name, no manifest.) With bf16 master weights the bf16 compute copies are the masters.
class ReferenceStrategy : public Strategy {
 public:
  explicit ReferenceStrategy(DType compute_dtype) : compute_dtype_(compute_dtype) {}
  std::string name() const override { return "reference"; }

  void setup(Module& model, const OptimizerOptions& opts) override {
    params_ = model.parameters();
    std::vector<std::string> names;
    std::vector<Tensor> copies;
    NoGradGuard no_grad;
    for (Parameter* p : params_) {
      master_.push_back(p->value);
      names.push_back(p->name);
      if (compute_dtype_ == DType::F32) continue;
      Tensor copy =
          Tensor::empty(p->value.shape(), compute_dtype_, p->value.device(), MemCategory::Params);
      copy.copy_(p->value);
      copy.set_requires_grad(true);
      copy.set_name(p->name);
      master_.back().set_requires_grad(false);
      p->value = copy;
      if (opts.master_dtype == compute_dtype_)
        master_.back() = copy;
      else
        copies.push_back(copy);
    }
    optimizer_ = std::make_unique<Optimizer>(opts, master_, names, std::move(copies));
  }

  StepResult step(double lr, double max_grad_norm, double grad_scale) override {
    std::vector<Tensor> grads, present;
    for (Parameter* p : params_) {
      grads.push_back(p->value.grad());
      if (grads.back().defined()) present.push_back(grads.back());
    }
    StepResult r;
    r.grad_norm = std::sqrt(sum_of_squares(present)) * grad_scale;
    if (!std::isfinite(r.grad_norm)) {
      r.skipped = true;
      for (size_t i = 0; i < params_.size() && r.first_non_finite.empty(); ++i)
        if (grads[i].defined() && has_non_finite(grads[i])) r.first_non_finite = params_[i]->name;
    } else {
      optimizer_->step(grads, lr, grad_scale * clip_coefficient(r.grad_norm, max_grad_norm));
    }
    for (Parameter* p : params_) p->value.zero_grad();
    return r;
  }

  std::vector<std::pair<std::string, Tensor>> full_state_dict() override {
    std::vector<std::pair<std::string, Tensor>> out;
    for (size_t i = 0; i < params_.size(); ++i) out.push_back({params_[i]->name, master_[i]});
    return out;
  }
  std::vector<std::pair<std::string, Tensor>> optimizer_state() override {
    return optimizer_->state_tensors();
  }
  int64_t optimizer_steps() const override { return optimizer_->step_count(); }
  void load_state(const std::vector<std::pair<std::string, Tensor>>& full_weights,
                  const std::vector<std::pair<std::string, Tensor>>& optimizer_state,
                  int64_t optimizer_steps) override {
    std::map<std::string, Tensor> by_name(full_weights.begin(), full_weights.end());
    NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      auto it = by_name.find(params_[i]->name);
      if (it == by_name.end()) throw std::runtime_error("no weight " + params_[i]->name);
      master_[i].copy_(it->second);
      if (master_[i].storage() != params_[i]->value.storage()) params_[i]->value.copy_(master_[i]);
    }
    optimizer_->load_state(optimizer_state, optimizer_steps);
  }
  // Layout-independent state (checkpoints): every parameter whole.
  std::vector<std::string> state_kinds() const override {
    std::vector<std::string> kinds = {"master"};
    const auto st = optimizer_->state_tensors();
    const size_t per = st.size() / params_.size();
    for (size_t k = 0; k < per; ++k)
      kinds.push_back(st[k].first.substr(params_[0]->name.size() + 1));
    return kinds;
  }
  std::vector<ParamStateSlice> param_state_slices() override {
    std::map<std::string, Tensor> st;
    for (const auto& [key, t] : optimizer_->state_tensors()) st[key] = t;
    const std::vector<std::string> kinds = state_kinds();
    std::vector<ParamStateSlice> out;
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t n = master_[i].numel();
      ParamStateSlice p{params_[i]->name, master_[i].shape(), 0, n, {}};
      p.tensors.push_back({"master", flat_view(master_[i], 0, {n})});
      for (size_t k = 1; k < kinds.size(); ++k)
        p.tensors.push_back({kinds[k], flat_view(st.at(p.name + "." + kinds[k]), 0, {n})});
      out.push_back(std::move(p));
    }
    return out;
  }
  void import_param_state(const ParamStateReader& read, int64_t optimizer_steps) override {
    NoGradGuard no_grad;
    std::vector<std::pair<std::string, Tensor>> state;
    for (const auto& [key, t] : optimizer_->state_tensors())
      state.push_back({key, Tensor::empty(t.shape(), DType::F32)});
    std::map<std::string, Tensor> by_key(state.begin(), state.end());
    const std::vector<std::string> kinds = state_kinds();
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t n = master_[i].numel();
      Tensor buf = Tensor::empty({n}, DType::F32);
      read(params_[i]->name, "master", 0, buf);
      flat_view(master_[i], 0, {n}).copy_(buf);
      if (master_[i].storage() != params_[i]->value.storage()) params_[i]->value.copy_(master_[i]);
      for (size_t k = 1; k < kinds.size(); ++k)
        read(params_[i]->name, kinds[k], 0,
             flat_view(by_key.at(params_[i]->name + "." + kinds[k]), 0, {n}));
    }
    optimizer_->load_state(state, optimizer_steps);
  }

 private:
  DType compute_dtype_;
  std::vector<Parameter*> params_;
  // fp32, or with bf16 masters the bf16 compute tensors: the model's own tensors when computing
  // in the master dtype
  std::vector<Tensor> master_;
  std::unique_ptr<Optimizer> optimizer_;
};

struct RunSpec {
  // reference (ReferenceStrategy above) | single | ddp | zero1 | zero2 | zero3 | fsdp (FSDP2 from
  // the config, as the trainer makes it)
  std::string strategy = "reference";
  int world = 1;
  int accum = 1;
  int steps = 10;
  int64_t global_batch = 12;  // rows per micro-batch over all ranks (divisible by 2, 3, 4)
  int64_t seq = 8;
  int64_t layers = 2;
  DType compute = DType::F32;
  double bucket_cap_mb = 0.01;  // ~2.6k fp32 elements: about a dozen buckets in the tiny model
  bool find_unused = false;
  bool offload_optimizer = false;
  bool save_16bit = false;
  ActivationCheckpointing activation_checkpointing = ActivationCheckpointing::None;
  bool tied_embeddings = false;
  OptimizerName optimizer = OptimizerName::AdamW;
  DType state_dtype = DType::F32;   // OptimizerOptions::state_dtype (optimizer.state_dtype)
  DType master_dtype = DType::F32;  // OptimizerOptions::master_dtype (optimizer.master_weights)
  // Every rank trains on the whole global micro-batch (not its share), so that every rank's
  // gradient is the single process's, bit for bit: what the exact bf16-master parity tests need.
  bool every_rank_takes_the_whole_batch = false;
  double lr = 1e-3, clip = 1.0;  // see test_optimizer() on the tolerance
  uint64_t seed = 7;
};

inline std::unique_ptr<Strategy> make_test_strategy(const RunSpec& s,
                                                    std::shared_ptr<ProcessGroup> pg) {
  if (s.strategy == "reference") return std::make_unique<ReferenceStrategy>(s.compute);
  if (s.strategy == "single") return std::make_unique<SingleProcessStrategy>(s.compute);
  if (s.strategy == "ddp")
    return std::make_unique<DdpStrategy>(pg, s.compute, s.bucket_cap_mb, s.find_unused);
  if (s.strategy == "fsdp") {
    Config cfg;
    cfg.distributed_type = DistributedType::Fsdp;
    cfg.fsdp.fsdp_version = 2;
    return make_strategy(cfg, pg, s.compute);
  }
  DataParallelOptions o;
  o.zero_stage = s.strategy.back() - '0';
  o.compute_dtype = s.compute;
  o.bucket_cap_mb = s.bucket_cap_mb;
  o.find_unused_parameters = s.find_unused;
  o.offload_optimizer = s.offload_optimizer;
  o.save_16bit_model = s.save_16bit;
  return std::make_unique<ZeroStrategy>(pg, o);
}

inline OptimizerOptions test_optimizer(OptimizerName name = OptimizerName::AdamW) {
  OptimizerOptions o;
  o.name = name;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  // Adam amplifies a gradient element's absolute rounding error d into an update error of up
  // to lr * d / eps (at a gradient near zero); 1e-6 keeps that far below the 1e-5 tolerance of
  // the parity tests whatever the reduction order.
  o.eps = 1e-6;
  o.weight_decay = 0.1;
  return o;
}

// Tokens of global row `row` of micro-batch `micro` of step `step`: seq + 1 of them. Mostly a
// fixed successor rule (learnable, so the loss falls), sometimes a random token.
inline std::vector<int64_t> sample_tokens(int step, int micro, int64_t row, int64_t seq,
                                          int64_t vocab) {
  std::vector<int64_t> t(static_cast<size_t>(seq + 1));
  uint64_t x = 0x9e3779b97f4a7c15ull ^ (static_cast<uint64_t>(step) << 40) ^
               (static_cast<uint64_t>(micro) << 32) ^ static_cast<uint64_t>(row);
  auto next = [&x] {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 29;
    x += 0x632be59b;
    return x;
  };
  for (size_t i = 0; i < t.size(); ++i) {
    uint64_t r = next();
    if (i == 0 || r % 4 == 0)
      t[i] = static_cast<int64_t>((r >> 8) % static_cast<uint64_t>(vocab));
    else
      t[i] = (t[i - 1] * 5 + 3) % vocab;
  }
  return t;
}

// This rank's rows of the global micro-batch: [ids, labels], each [rows, seq].
inline std::pair<Tensor, Tensor> rank_batch(const RunSpec& s, int step, int micro, int rank,
                                            int64_t vocab) {
  const bool whole = s.every_rank_takes_the_whole_batch;
  const int64_t rows = whole ? s.global_batch : s.global_batch / s.world;
  std::vector<int64_t> ids, labels;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int64_t> t =
        sample_tokens(step, micro, (whole ? 0 : rank * rows) + r, s.seq, vocab);
    ids.insert(ids.end(), t.begin(), t.end() - 1);
    labels.insert(labels.end(), t.begin() + 1, t.end());
  }
  return {Tensor::from_vector(ids, {rows, s.seq}), Tensor::from_vector(labels, {rows, s.seq})};
}

struct Trainee {
  std::unique_ptr<CausalLM> model;
  std::unique_ptr<Strategy> strategy;
};

inline Trainee make_trainee(const RunSpec& s, std::shared_ptr<ProcessGroup> pg,
                            uint64_t model_seed) {
  Trainee t;
  t.model = std::make_unique<CausalLM>(tiny_llama(s.layers, s.tied_embeddings), DType::F32,
                                       Device::cpu(), model_seed);
  t.model->set_activation_checkpointing(s.activation_checkpointing);
  t.strategy = make_test_strategy(s, pg);
  OptimizerOptions o = test_optimizer(s.optimizer);
  o.state_dtype = s.state_dtype;
  o.master_dtype = s.master_dtype;
  o.rounding_seed = s.seed;  // the same on every rank (model_seed differs)
  t.strategy->setup(*t.model, o);
  return t;
}

// The mean of each rank's `v` over pg (v itself without pg or with one rank).
inline double mean_over_ranks(double v, ProcessGroup* pg) {
  if (!pg || pg->size() <= 1) return v;
  Tensor t = Tensor::full({1}, v, DType::F64);
  pg->all_reduce(t, ReduceOp::Avg)->wait();
  return t.item();
}

// One optimizer step as the trainer runs it; returns the global mean loss.
inline double train_step(const RunSpec& s, Trainee& t, int step, int rank, ProcessGroup* pg,
                         double* grad_norm = nullptr) {
  double loss_sum = 0;
  for (int micro = 0; micro < s.accum; ++micro) {
    t.strategy->begin_micro_batch(micro == s.accum - 1);
    auto [ids, labels] = rank_batch(s, step, micro, rank, t.model->config.vocab_size);
    Tensor loss = CausalLM::loss(t.model->forward(ids), labels);
    loss_sum += loss.item();
    mul(loss, 1.0 / s.accum).backward();
    t.strategy->end_micro_batch();
  }
  StepResult r = t.strategy->step(s.lr, s.clip, 1.0);
  if (grad_norm) *grad_norm = r.grad_norm;
  return mean_over_ranks(loss_sum / s.accum, pg);
}

using Weights = std::vector<std::pair<std::string, Tensor>>;

// Full master weights whatever the strategy (ZeRO-3 gathers its master shards).
inline Weights full_weights(Strategy& s) {
  if (auto* f = dynamic_cast<FlatDataParallel*>(&s)) return f->gather_master_weights();
  return s.full_state_dict();
}

// ||a - b|| <= rel * ||b|| (L2 over each tensor) for every tensor; "" or the first mismatch.
// (Per element the relative error is unbounded: an element near zero may differ by a few ulps
// of its neighbours.)
inline std::string compare_weights(const Weights& got, const Weights& want, double rel) {
  std::map<std::string, Tensor> g(got.begin(), got.end());
  if (got.size() != want.size())
    return "got " + std::to_string(got.size()) + " tensors, want " + std::to_string(want.size());
  for (const auto& [name, w] : want) {
    auto it = g.find(name);
    if (it == g.end()) return "missing " + name;
    std::vector<double> a = it->second.to_vector(), b = w.to_vector();
    if (a.size() != b.size()) return name + ": size differs";
    double diff = 0, scale = 0, worst = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      diff += (a[i] - b[i]) * (a[i] - b[i]);
      scale += b[i] * b[i];
      worst = std::max(worst, std::abs(a[i] - b[i]));
    }
    diff = std::sqrt(diff);
    scale = std::sqrt(scale);
    if (!(diff <= rel * scale))
      return name + ": ||diff|| " + std::to_string(diff) + " vs ||ref|| " + std::to_string(scale) +
             " (largest element difference " + std::to_string(worst) + ")";
  }
  return "";
}

struct RunResult {
  std::vector<double> losses, grad_norms;
  Weights final_weights;  // cloned
};

// The whole run on one rank of `pg` (or alone when pg is null).
inline RunResult run_training(const RunSpec& s, std::shared_ptr<ProcessGroup> pg, int rank,
                              uint64_t model_seed) {
  Trainee t = make_trainee(s, pg, model_seed);
  RunResult out;
  for (int step = 0; step < s.steps; ++step) {
    double norm = 0;
    out.losses.push_back(train_step(s, t, step, rank, pg.get(), &norm));
    out.grad_norms.push_back(norm);
  }
  for (auto& [name, w] : full_weights(*t.strategy)) out.final_weights.push_back({name, w.clone()});
  return out;
}

// "" or the first step whose loss differs by more than rel.
inline std::string compare_losses(const std::vector<double>& got, const std::vector<double>& want,
                                  double rel) {
  if (got.size() != want.size()) return "different number of steps";
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(got[i] - want[i]) <= rel * std::abs(want[i])))
      return "step " + std::to_string(i + 1) + ": loss " + std::to_string(got[i]) + " vs " +
             std::to_string(want[i]);
  return "";
}

inline bool close_rel(double a, double b, double rel) {
  return std::abs(a - b) <= rel * std::max(std::abs(a), std::abs(b));
}

// A single process's delayed-scaling state as a rank of `world` data-parallel ranks starts from
// it: a rank's loss is a mean over 1/world of the tokens, so its output gradients are exactly
// `world` times the single process's; with the grad_output amaxes times `world` and their scales
// divided by it (world a power of two: exact), every fp8 code of every later step is the single
// process's. (Runs compared this way start from a warm-up's state rather than scale 1: at scale
// 1 the multiplied gradients fall into e5m2's subnormals differently, and the deviation would
// persist through the histories.)
inline Fp8CheckpointState fp8_state_for_ranks(Fp8CheckpointState st, int world) {
  auto ends_with = [](const std::string& a, const std::string& b) {
    return a.size() >= b.size() && a.compare(a.size() - b.size(), b.size(), b) == 0;
  };
  for (auto& [name, t] : st.tensors) {
    double f = 1;
    if (ends_with(name, ".grad_output.amax_history") || ends_with(name, ".grad_output.scale_inv"))
      f = world;
    else if (ends_with(name, ".grad_output.scale"))
      f = 1.0 / world;
    if (f != 1) t = mul(t, f);
  }
  return st;
}

// The model-state memory check against the ZeRO paper's formulas, on `world` CPU ranks: each rank
// trains two steps of `spec` under ddp, zero1, zero2 and zero3 in bf16 compute, on a deep and
// narrow model (so that the transient buffers, a gradient bucket or two in flight and ZeRO-3's
// gathered layers, stay small next to the persistent states, as in a real model), and its peak
// bytes of Params, Grads and OptimizerState must be within 10% of formula(kind, P, world).
inline void expect_model_states_follow(
    const RunSpec& spec, int world,
    const std::function<double(const std::string& kind, double P, int N)>& formula) {
  const int port = pick_free_port();
  auto exits = run_ranks(
      world,
      [&](int rank) -> int {
        World w = make_world(rank, world, port);
        const Device cpu = Device::cpu();
        for (const char* kind : {"ddp", "zero1", "zero2", "zero3"}) {
          RunSpec s = spec;
          s.strategy = kind;
          s.world = world;
          s.compute = DType::BF16;
          s.layers = 40;
          s.global_batch = 4;
          s.bucket_cap_mb = 0.02;
          MemoryStats base = memory_stats(cpu);
          Trainee t = make_trainee(s, w.pg, s.seed);
          const double P = static_cast<double>(t.model->config.num_parameters());
          reset_peak_memory_stats(cpu);
          for (int step = 0; step < 2; ++step) train_step(s, t, step, rank, nullptr);
          MemoryStats m = memory_stats(cpu);
          double total = 0;
          std::string detail;
          for (MemCategory c :
               {MemCategory::Params, MemCategory::Grads, MemCategory::OptimizerState}) {
            const int i = static_cast<int>(c);
            const double b = static_cast<double>(m.peak[i] - base.current[i]);
            total += b;
            detail += std::string(" ") + mem_category_name(c) + " " + std::to_string(b / P) + "P";
          }
          const double want = formula(kind, P, world);
          const char* state = dtype_name(s.state_dtype);
          if (rank == 0)
            std::fprintf(stderr, "%s N=%d, %s state: model states %.3fP (formula %.3fP):%s\n", kind,
                         world, state, total / P, want / P, detail.c_str());
          RANK_CHECK(std::abs(total - want) <= 0.1 * want,
                     "%s N=%d, %s state: model states %.3fP, formula %.3fP (%s)", kind, world,
                     state, total / P, want / P, detail.c_str());
        }
        return 0;
      },
      std::chrono::seconds(120));
  expect_all_ok(exits);
}

}  // namespace accel::testing
