// Expert parallelism (distributed.expert_parallel_size = ep): the experts of every mixture-of-
// experts layer are split over ep consecutive ranks, and tokens travel to their expert's owner
// and back by all-to-all.
//
// Mesh over W ranks (W divisible by ep): expert-parallel (EP) groups of consecutive ranks
// {0..ep-1}, {ep..2ep-1}, ...; EP rank i of every EP group holds the same experts
// [i * E/ep, (i + 1) * E/ep) of the E experts, and those W/ep ranks (world ranks i, i + ep, ...)
// form its expert-data-parallel group, over which the expert parameters are data-parallel.
//
// What the MoE layer does with it (forward of one layer, N tokens here, top-k routing):
//   MoeRouting rt = moe_routing(expert_ids, ctx.num_experts);       // counts by GLOBAL expert
//   ExpertDispatch d = plan_expert_dispatch(ctx, rt.expert_counts);  // collective over EP group
//   Tensor rows = all_to_all_rows(moe_permute(x, rt), d.send_rows, d.recv_rows, *ctx.ep_group);
//   // rows come from EP rank 0, 1, ... and within each sender by local expert: grouped_linear
//   // with d.recv_group_sizes() and, per group, the weight of local expert group % L.
//   Tensor y = all_to_all_rows(expert_out, d.recv_rows, d.send_rows, *ctx.ep_group);
//   out = moe_unpermute(y, weights, rt);
// Every rank of an EP group must run every MoE layer's forward (and so its backward) in the same
// order, and every local expert weight must receive a gradient (zeros when none of its rows
// came) in every backward: the collectives of the EP group, the expert-data-parallel group and
// the world group are issued in the same order on every rank only then.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "parallel/process_group.h"
#include "runtime/tensor.h"

namespace accel {

struct ExpertParallelContext {
  int ep_size = 1;  // ranks an expert layer's experts are split over
  int ep_rank = 0;  // this rank's index in its EP group
  int64_t num_experts = 0;
  int64_t expert_begin = 0, expert_end = 0;  // [begin, end): the GLOBAL experts held here
  Device device;  // where the per-expert counts travel (the compute device)
  // The ranks of this EP group (ep_size ranks) and the expert-data-parallel group (world / ep
  // ranks holding the same experts); both exist also when of size 1.
  std::shared_ptr<ProcessGroup> ep_group, expert_dp_group;

  int64_t num_local_experts() const { return expert_end - expert_begin; }
  bool holds(int64_t expert) const { return expert >= expert_begin && expert < expert_end; }
  int owner(int64_t expert) const;  // the EP rank holding `expert`
};

// The mesh: every rank of `world` calls it, in the same order relative to its other new_group
// calls. Throws invalid_argument naming the key when ep_size does not divide the world size or
// the number of experts.
ExpertParallelContext make_expert_parallel(const std::shared_ptr<ProcessGroup>& world, int ep_size,
                                           int64_t num_experts, Device device);
// The contexts' group layout without a process group (for messages, tests, docs): the world
// ranks of EP group `g` and of the expert-data-parallel group of EP rank `i`.
std::vector<int> expert_parallel_group_ranks(int world, int ep_size, int g);
std::vector<int> expert_data_parallel_group_ranks(int world, int ep_size, int i);

// What one all-to-all dispatch moves, from this rank's rows per GLOBAL expert (its tokens'
// slots, sorted by expert as moe_routing orders them).
struct ExpertDispatch {
  std::vector<int64_t> send_rows;  // [ep_size]: rows for each EP rank (its experts' counts)
  std::vector<int64_t> recv_rows;  // [ep_size]: rows arriving from each EP rank
  // [ep_size * L] (L local experts): rows from EP rank s for local expert j at s * L + j, the
  // order the received rows come in.
  std::vector<int64_t> recv_expert_rows;
  std::vector<int64_t> local_expert_rows;  // [L]: rows for each local expert, all senders
  // The groups of the received rows in arrival order (= recv_expert_rows) and, per group, the
  // local expert it belongs to: group g is local expert g % L.
  const std::vector<int64_t>& recv_group_sizes() const { return recv_expert_rows; }
};
// Collective over ctx.ep_group (one all-to-all of L counts per rank). expert_counts has
// ctx.num_experts entries.
ExpertDispatch plan_expert_dispatch(const ExpertParallelContext& ctx,
                                    const std::vector<int64_t>& expert_counts);

// Rows of dim 0 of x to the ranks of `group`: send_rows[p] rows (consecutive, rank after rank) to
// rank p, recv_rows[p] from it; returns [sum(recv_rows), ...]. Differentiable: the backward sends
// the gradient rows back the way they came (the reverse all-to-all), so every rank of the group
// must run it in its backward too. Blocking on the CPU backend; on NCCL the caller's stream waits
// for it (not the host). `group` must outlive the autograd graph.
Tensor all_to_all_rows(const Tensor& x, const std::vector<int64_t>& send_rows,
                       const std::vector<int64_t>& recv_rows, ProcessGroup& group);

// Parameter names of experts: "<...>.experts.<global index>.<...>" (Mixtral's
// block_sparse_moe.experts.N.w1, Qwen3-MoE's mlp.experts.N.gate_proj). The strategy shards these
// over the expert-data-parallel group and everything else over the world.
bool is_expert_param(const std::string& name);
// The global expert index in such a name, or -1.
int64_t expert_index_of(const std::string& name);

}  // namespace accel
