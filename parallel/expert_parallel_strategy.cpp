#include "parallel/expert_parallel_strategy.h"

#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "runtime/autograd.h"
#include "runtime/format.h"

namespace accel {

std::string with_expert_index(const std::string& name, int64_t expert) {
  static const std::string key = ".experts.";
  const size_t at = name.find(key);
  if (at == std::string::npos || expert_index_of(name) < 0)
    throw std::invalid_argument("with_expert_index: '" + name + "' is not an expert parameter");
  const size_t begin = at + key.size();
  const size_t end = name.find('.', begin);
  return name.substr(0, begin) + std::to_string(expert) + name.substr(end);
}

ExpertParallelStrategy::ExpertParallelStrategy(std::shared_ptr<ProcessGroup> world,
                                               ExpertParallelContext ctx, const EngineFactory& make,
                                               ParamFilter is_expert)
    : world_(std::move(world)), ctx_(std::move(ctx)), is_expert_(std::move(is_expert)) {
  if (!ctx_.ep_group || !ctx_.expert_dp_group)
    throw std::logic_error(
        "ExpertParallelStrategy: the context has no groups (make_expert_parallel)");
  const int w = world_ ? world_->size() : 1;
  if (ctx_.ep_group->size() * ctx_.expert_dp_group->size() != w)
    throw std::logic_error(
        "ExpertParallelStrategy: EP group x expert-data-parallel group is not "
        "the world");
  ParamFilter expert = is_expert_;
  dense_ = make(world_, [expert](const std::string& n) { return !expert(n); });
  experts_ = make(ctx_.expert_dp_group, expert);
  if (dense_->name() != experts_->name())
    throw std::logic_error("ExpertParallelStrategy: both engines must be of one kind");
}

std::string ExpertParallelStrategy::name() const {
  return dense_->name() + "+ep" + std::to_string(ctx_.ep_size);
}

void ExpertParallelStrategy::setup(Module& model, const OptimizerOptions& opts) {
  int64_t expert_params = 0;
  for (Parameter* p : model.parameters()) {
    if (!is_expert_(p->name)) continue;
    ++expert_params;
    const int64_t e = expert_index_of(p->name);
    if (!ctx_.holds(e))
      throw std::logic_error(
          "expert parallelism: the model holds " + p->name + ", but this rank (EP rank " +
          std::to_string(ctx_.ep_rank) + " of " + std::to_string(ctx_.ep_size) +
          ") holds experts " + std::to_string(ctx_.expert_begin) + ".." +
          std::to_string(ctx_.expert_end - 1) +
          " only: the MoE layers must build just the local experts, under their global index "
          "(ExpertParallelContext, parallel/expert_parallel.h)");
  }
  if (expert_params == 0)
    throw std::invalid_argument(
        "distributed.expert_parallel_size " + std::to_string(ctx_.ep_size) +
        ": the model has no expert parameters (names with .experts.<index>.) to split; set "
        "distributed.expert_parallel_size: 1 or train a mixture-of-experts model");
  for (Parameter* p : model.parameters()) {
    device_ = p->value.device();
    break;
  }
  dense_->setup(model, opts);
  experts_->setup(model, opts);
}

void ExpertParallelStrategy::begin_micro_batch(bool last) {
  dense_->begin_micro_batch(last);
  experts_->begin_micro_batch(last);
}

void ExpertParallelStrategy::end_micro_batch() {
  dense_->end_micro_batch();
  experts_->end_micro_batch();
}

namespace {
// A name (or "") from the lowest world rank that has one; collective over `world`.
std::string lowest_rank_name(ProcessGroup* world, const std::string& mine, Device device) {
  if (!world || world->size() == 1) return mine;
  const int n = world->size();
  Tensor who = Tensor::from_vector(
      std::vector<double>{mine.empty() ? 0.0 : static_cast<double>(n - world->rank())}, {1},
      DType::F32, device);
  world->all_reduce(who, ReduceOp::Max)->wait();
  const int best = static_cast<int>(who.item());
  if (best == 0) return "";
  const int root = n - best;
  constexpr int64_t kMax = 512;  // a parameter name fits
  std::vector<double> bytes(kMax, 0);
  if (world->rank() == root)
    for (size_t i = 0; i < mine.size() && i < static_cast<size_t>(kMax - 1); ++i)
      bytes[i] = static_cast<unsigned char>(mine[i]);
  Tensor buf = Tensor::from_vector(bytes, {kMax}, DType::U8, device);
  world->broadcast(buf, root)->wait();
  std::string out;
  for (double b : buf.to_vector()) {
    if (b == 0) break;
    out += static_cast<char>(static_cast<int>(b));
  }
  return out;
}
}  // namespace

StepResult ExpertParallelStrategy::step(double lr, double max_grad_norm, double grad_scale) {
  ++steps_;
  const std::vector<Tensor> gd = dense_->finish_gradients();
  const std::vector<Tensor> ge = experts_->finish_gradients();
  // See the header: the expert gradients carry ep times the weight of a dense one.
  const double expert_scale = 1.0 / ctx_.ep_size;
  const double dense_sq = dense_->grad_sum_of_squares(gd);
  const double expert_sq = Comm(ctx_.ep_group).sum(experts_->grad_sum_of_squares(ge), device_);
  StepResult r;
  r.grad_norm = std::sqrt(dense_sq + expert_sq * expert_scale * expert_scale) * grad_scale;
  if (!std::isfinite(r.grad_norm)) {
    r.skipped = true;
    r.first_non_finite = dense_->first_non_finite(gd);  // the same on every rank
    if (r.first_non_finite.empty())
      r.first_non_finite = lowest_rank_name(world_.get(), experts_->first_non_finite(ge), device_);
  } else {
    const double m = grad_scale * clip_coefficient(r.grad_norm, max_grad_norm);
    dense_->apply_update(gd, lr, m);
    experts_->apply_update(ge, lr, m * expert_scale);
  }
  dense_->clear_gradients();
  experts_->clear_gradients();
  return r;
}

std::vector<std::pair<std::string, Tensor>> ExpertParallelStrategy::full_state_dict() {
  std::vector<std::pair<std::string, Tensor>> out = dense_->full_state_dict();
  std::vector<std::pair<std::string, Tensor>> mine = experts_->full_state_dict();
  if (mine.empty()) return out;  // ZeRO-3 without 16-bit weights: none (as the dense part)
  NoGradGuard no_grad;
  // Every EP rank holds the same structure (its L experts per layer), so each broadcasts its
  // experts as one flat buffer and the others rename them by the root's expert range.
  int64_t numel = 0;
  for (const auto& [name, t] : mine) numel += t.numel();
  const DType dt = mine.front().second.dtype();
  const Device dev = mine.front().second.device();
  const int64_t L = ctx_.num_local_experts();
  for (int p = 0; p < ctx_.ep_size; ++p) {
    Tensor flat = Tensor::empty({numel}, dt, dev, MemCategory::Other);
    if (p == ctx_.ep_rank) {
      int64_t at = 0;
      for (const auto& [name, t] : mine) {
        flat_view(flat, at, t.shape()).copy_(t);
        at += t.numel();
      }
    }
    if (ctx_.ep_size > 1) ctx_.ep_group->broadcast(flat, p)->wait();
    int64_t at = 0;
    for (const auto& [name, t] : mine) {
      const int64_t e = expert_index_of(name) - ctx_.expert_begin + p * L;
      out.push_back({with_expert_index(name, e), flat_view(flat, at, t.shape())});
      at += t.numel();
    }
  }
  return out;
}

std::vector<StateDictEntry> ExpertParallelStrategy::full_state_dict_layout() const {
  std::vector<StateDictEntry> out = dense_->full_state_dict_layout();
  const std::vector<StateDictEntry> mine = experts_->full_state_dict_layout();
  if (mine.empty()) return out;
  // As full_state_dict: every EP rank's experts have this rank's shapes, in one flat buffer of
  // the first expert tensor's dtype and device, renamed by that rank's expert range.
  const int64_t L = ctx_.num_local_experts();
  for (int p = 0; p < ctx_.ep_size; ++p)
    for (const StateDictEntry& e : mine) {
      const int64_t index = expert_index_of(e.name) - ctx_.expert_begin + p * L;
      out.push_back(
          {with_expert_index(e.name, index), e.shape, mine.front().dtype, mine.front().device});
    }
  return out;
}

std::vector<std::pair<std::string, Tensor>> ExpertParallelStrategy::optimizer_state() {
  std::vector<std::pair<std::string, Tensor>> out = dense_->optimizer_state();
  for (auto& [key, t] : experts_->optimizer_state()) out.push_back({"experts/" + key, t});
  return out;
}

int64_t ExpertParallelStrategy::optimizer_steps() const { return dense_->optimizer_steps(); }

void ExpertParallelStrategy::load_state(
    const std::vector<std::pair<std::string, Tensor>>& full_weights,
    const std::vector<std::pair<std::string, Tensor>>& optimizer_state, int64_t optimizer_steps) {
  std::vector<std::pair<std::string, Tensor>> dense, experts;
  const std::string prefix = "experts/";
  for (const auto& [key, t] : optimizer_state) {
    if (key.compare(0, prefix.size(), prefix) == 0)
      experts.push_back({key.substr(prefix.size()), t});
    else
      dense.push_back({key, t});
  }
  dense_->load_state(full_weights, dense, optimizer_steps);
  experts_->load_state(full_weights, experts, optimizer_steps);
}

bool ExpertParallelStrategy::state_is_replicated() const {
  return ctx_.ep_size == 1 && dense_->state_is_replicated() && experts_->state_is_replicated();
}

std::vector<ParamStateSlice> ExpertParallelStrategy::param_state_slices() {
  const bool all = state_is_replicated();
  std::vector<ParamStateSlice> out;
  // A replicated engine's slices are the same on every rank of its group: rank 0 of the group
  // gives them (the world's rank 0 for the dense part, EP ranks 0..ep-1 of EP group 0 for the
  // experts), so that every element of the model is in exactly one rank's file.
  auto take = [&](FlatDataParallel& e) {
    if (!all && e.state_is_replicated() && e.process_group() && e.process_group()->rank() != 0)
      return;
    for (ParamStateSlice& s : e.param_state_slices()) out.push_back(std::move(s));
  };
  take(*dense_);
  take(*experts_);
  return out;
}

std::vector<std::string> ExpertParallelStrategy::state_kinds() const {
  return dense_->state_kinds();
}

void ExpertParallelStrategy::import_param_state(const ParamStateReader& read,
                                                int64_t optimizer_steps) {
  dense_->import_param_state(read, optimizer_steps);
  experts_->import_param_state(read, optimizer_steps);
}

nlohmann::json ExpertParallelStrategy::checkpoint_manifest() const {
  return {{"strategy", name()},
          {"expert_parallel_size", ctx_.ep_size},
          {"num_experts", ctx_.num_experts},
          {"dense", dense_->checkpoint_manifest()},
          {"experts", experts_->checkpoint_manifest()}};
}

bool ExpertParallelStrategy::param_held_elsewhere(const std::string& name) const {
  if (!is_expert_(name)) return false;
  const int64_t e = expert_index_of(name);
  return e >= 0 && e < ctx_.num_experts && !ctx_.holds(e);
}

CommStats ExpertParallelStrategy::group_comm_stats() const {
  CommStats s = ctx_.ep_group->stats();
  const CommStats d = ctx_.expert_dp_group->stats();
  for (int k = 0; k < kNumCommKinds; ++k) {
    s.kind[k].calls += d.kind[k].calls;
    s.kind[k].bytes += d.kind[k].bytes;
    s.kind[k].wire_bytes += d.kind[k].wire_bytes;
  }
  return s;
}

nlohmann::json ExpertParallelStrategy::run_report() const {
  nlohmann::json j = dense_->run_report();
  if (!j.is_object()) j = nlohmann::json::object();
  const double steps = static_cast<double>(std::max<int64_t>(steps_, 1));
  const CommCounter a2a = ctx_.ep_group->stats()[CommKind::AllToAll];
  j["expert_parallel"] = {
      {"size", ctx_.ep_size},
      {"local_experts", ctx_.num_local_experts()},
      {"all_to_all_calls_per_step", static_cast<double>(a2a.calls) / steps},
      {"all_to_all_bytes_per_step", static_cast<int64_t>(static_cast<double>(a2a.bytes) / steps)},
      {"all_to_all_wire_bytes_per_step",
       static_cast<int64_t>(static_cast<double>(a2a.wire_bytes) / steps)},
      {"expert_dp_wire_bytes_per_step",
       static_cast<int64_t>(static_cast<double>(ctx_.expert_dp_group->stats().total().wire_bytes) /
                            steps)}};
  return j;
}

std::string ExpertParallelStrategy::run_report_line() const {
  const double steps = static_cast<double>(std::max<int64_t>(steps_, 1));
  const CommCounter a2a = ctx_.ep_group->stats()[CommKind::AllToAll];
  std::string line =
      "expert parallelism: " + std::to_string(ctx_.ep_size) + " ranks per EP group, " +
      std::to_string(ctx_.num_local_experts()) + " local experts; all-to-all " +
      format_bytes(static_cast<int64_t>(static_cast<double>(a2a.bytes) / steps)) + " per step (" +
      format_bytes(static_cast<int64_t>(static_cast<double>(a2a.wire_bytes) / steps)) +
      " on the wire) in " + std::to_string(static_cast<double>(a2a.calls) / steps).substr(0, 5) +
      " calls";
  const std::string dense = dense_->run_report_line();
  return dense.empty() ? line : dense + "\n" + line;
}

}  // namespace accel
