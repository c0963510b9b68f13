#include "parallel/expert_parallel.h"

#include <stdexcept>

#include "runtime/autograd.h"

namespace accel {

int ExpertParallelContext::owner(int64_t expert) const {
  if (expert < 0 || expert >= num_experts)
    throw std::out_of_range("expert " + std::to_string(expert) + " is not one of the " +
                            std::to_string(num_experts) + " experts");
  return static_cast<int>(expert / (num_experts / ep_size));
}

std::vector<int> expert_parallel_group_ranks(int world, int ep_size, int g) {
  std::vector<int> r;
  for (int i = 0; i < ep_size; ++i) r.push_back(g * ep_size + i);
  return r;
}

std::vector<int> expert_data_parallel_group_ranks(int world, int ep_size, int i) {
  std::vector<int> r;
  for (int q = i; q < world; q += ep_size) r.push_back(q);
  return r;
}

ExpertParallelContext make_expert_parallel(const std::shared_ptr<ProcessGroup>& world, int ep_size,
                                           int64_t num_experts, Device device) {
  const int n = world ? world->size() : 1, rank = world ? world->rank() : 0;
  if (ep_size < 1 || n % ep_size != 0)
    throw std::invalid_argument(
        "distributed.expert_parallel_size " + std::to_string(ep_size) +
        " must be >= 1 and divide the number of processes (" + std::to_string(n) +
        "); set it to a divisor of num_processes or launch a multiple of it");
  if (num_experts < 1 || num_experts % ep_size != 0)
    throw std::invalid_argument("distributed.expert_parallel_size " + std::to_string(ep_size) +
                                " must divide the model's number of experts (" +
                                std::to_string(num_experts) + ")");
  ExpertParallelContext c;
  c.ep_size = ep_size;
  c.ep_rank = rank % ep_size;
  c.num_experts = num_experts;
  const int64_t per = num_experts / ep_size;
  c.expert_begin = c.ep_rank * per;
  c.expert_end = c.expert_begin + per;
  c.device = device;
  if (!world) {
    if (ep_size != 1) throw std::logic_error("expert parallelism over several ranks needs a group");
    return c;
  }
  // Every rank makes every group in the same order (the backends need it); it keeps its own.
  for (int g = 0; g < n / ep_size; ++g) {
    auto pg = world->new_group(expert_parallel_group_ranks(n, ep_size, g));
    if (pg) c.ep_group = pg;
  }
  for (int i = 0; i < ep_size; ++i) {
    auto pg = world->new_group(expert_data_parallel_group_ranks(n, ep_size, i));
    if (pg) c.expert_dp_group = pg;
  }
  if (!c.ep_group || !c.expert_dp_group || c.ep_group->rank() != c.ep_rank)
    throw std::logic_error("expert parallel mesh: rank " + std::to_string(rank) +
                           " is missing from its groups");
  return c;
}

ExpertDispatch plan_expert_dispatch(const ExpertParallelContext& ctx,
                                    const std::vector<int64_t>& expert_counts) {
  if (static_cast<int64_t>(expert_counts.size()) != ctx.num_experts)
    throw std::invalid_argument("plan_expert_dispatch: " + std::to_string(expert_counts.size()) +
                                " expert counts for " + std::to_string(ctx.num_experts) +
                                " experts");
  if (!ctx.ep_group) throw std::logic_error("plan_expert_dispatch: the context has no EP group");
  const int ep = ctx.ep_size;
  const int64_t L = ctx.num_local_experts();
  ExpertDispatch d;
  d.send_rows.assign(ep, 0);
  for (int64_t e = 0; e < ctx.num_experts; ++e) {
    if (expert_counts[e] < 0)
      throw std::invalid_argument("plan_expert_dispatch: negative count for expert " +
                                  std::to_string(e));
    d.send_rows[e / L] += expert_counts[e];
  }
  // Experts are owned in blocks of L by EP rank, so the counts in expert order are already
  // rank-major: EP rank p gets entries [p * L, (p + 1) * L).
  Tensor counts = Tensor::from_vector(expert_counts, {ep, L}, DType::I64, ctx.device);
  Tensor got = Tensor::empty({ep, L}, DType::I64, ctx.device);
  const std::vector<int64_t> ones(ep, 1);
  ctx.ep_group->all_to_all(got, counts, ones, ones)->wait();
  const std::vector<double> v = got.to_vector();
  d.recv_rows.assign(ep, 0);
  d.recv_expert_rows.resize(static_cast<size_t>(ep * L));
  d.local_expert_rows.assign(L, 0);
  for (int s = 0; s < ep; ++s)
    for (int64_t j = 0; j < L; ++j) {
      const int64_t c = static_cast<int64_t>(v[s * L + j]);
      d.recv_expert_rows[s * L + j] = c;
      d.recv_rows[s] += c;
      d.local_expert_rows[j] += c;
    }
  return d;
}

namespace {
Tensor exchange_rows(const Tensor& x, const std::vector<int64_t>& send_rows,
                     const std::vector<int64_t>& recv_rows, ProcessGroup& group) {
  int64_t rows = 0;
  for (int64_t r : recv_rows) rows += r;
  Shape shape = x.shape();
  shape.at(0) = rows;
  Tensor src = x.is_contiguous() ? x : x.clone(MemCategory::Comm);
  Tensor out = Tensor::empty(shape, x.dtype(), x.device(), MemCategory::Activations);
  // NCCL: later kernels on the caller's stream wait for the exchange, the host does not (the
  // backend records the buffers on its stream); CPU: a plain wait.
  group.all_to_all(out, src, recv_rows, send_rows)->wait_stream();
  return out;
}
}  // namespace

Tensor all_to_all_rows(const Tensor& x, const std::vector<int64_t>& send_rows,
                       const std::vector<int64_t>& recv_rows, ProcessGroup& group) {
  if (!x.defined() || x.dim() < 1)
    throw std::invalid_argument("all_to_all_rows: needs a tensor of at least one dimension");
  Tensor out;
  {
    NoGradGuard no_grad;
    out = exchange_rows(x, send_rows, recv_rows, group);
  }
  ProcessGroup* g = &group;
  return record("all_to_all_rows", out, {x}, [send_rows, recv_rows, g](const Tensor& grad) {
    NoGradGuard no_grad;
    return std::vector<Tensor>{exchange_rows(grad, recv_rows, send_rows, *g)};
  });
}

int64_t expert_index_of(const std::string& name) {
  static const std::string key = ".experts.";
  size_t at = name.find(key);
  if (at == std::string::npos) return -1;
  at += key.size();
  size_t end = at;
  while (end < name.size() && name[end] >= '0' && name[end] <= '9') ++end;
  if (end == at || end == name.size() || name[end] != '.') return -1;
  return std::stoll(name.substr(at, end - at));
}

bool is_expert_param(const std::string& name) { return expert_index_of(name) >= 0; }

}  // namespace accel
