#include "parallel/process_group.h"

#include <stdexcept>

namespace accel {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
  }
  return "?";
}

const char* comm_kind_name(CommKind k) {
  switch (k) {
    case CommKind::AllReduce:
      return "all_reduce";
    case CommKind::ReduceScatter:
      return "reduce_scatter";
    case CommKind::AllGather:
      return "all_gather";
    case CommKind::Broadcast:
      return "broadcast";
    case CommKind::Barrier:
      return "barrier";
    case CommKind::Send:
      return "send";
    case CommKind::Recv:
      return "recv";
    case CommKind::AllToAll:
      return "all_to_all";
  }
  return "?";
}

CommCounter CommStats::total() const {
  CommCounter t;
  for (const auto& c : kind) {
    t.calls += c.calls;
    t.bytes += c.bytes;
    t.wire_bytes += c.wire_bytes;
  }
  return t;
}

ProcessGroup::ProcessGroup(int rank, int size, std::vector<int> world_ranks,
                           ProcessGroupOptions options)
    : rank_(rank), size_(size), world_ranks_(std::move(world_ranks)), options_(options) {
  check_timeout(options_.timeout, "process group: timeout");
}

CommStats ProcessGroup::stats() const {
  CommStats s;
  for (int i = 0; i < kNumCommKinds; ++i) {
    s.kind[i].calls = counters_[i].calls.load();
    s.kind[i].bytes = counters_[i].bytes.load();
    s.kind[i].wire_bytes = counters_[i].wire_bytes.load();
  }
  return s;
}

void ProcessGroup::reset_stats() {
  for (auto& c : counters_) {
    c.calls = 0;
    c.bytes = 0;
    c.wire_bytes = 0;
  }
}

void ProcessGroup::count(CommKind k, int64_t bytes, int64_t wire_bytes) {
  auto& c = counters_[static_cast<int>(k)];
  c.calls += 1;
  c.bytes += bytes;
  c.wire_bytes += wire_bytes;
}

void ProcessGroup::count_wire(CommKind k, int64_t wire_bytes) {
  counters_[static_cast<int>(k)].wire_bytes += wire_bytes;
}

void ProcessGroup::check_tensor(const Tensor& t, const char* op) const {
  std::string where = std::string("[") + backend() + " " + op + "] ";
  if (!t.defined()) throw std::invalid_argument(where + "got an undefined tensor");
  if (!t.is_contiguous())
    throw std::invalid_argument(where + "needs a contiguous tensor, got " + t.str() +
                                " with strides " + shape_str(t.strides()) +
                                "; pass t.clone() and copy the result back");
  bool want_cuda = backend() == "nccl";
  if (t.device().is_cuda() != want_cuda)
    throw std::invalid_argument(where + "got a tensor on " + t.device().str() + " but the " +
                                backend() + " backend " +
                                (want_cuda ? "moves CUDA tensors only"
                                           : "moves host tensors only (use the nccl backend for "
                                             "GPU tensors)"));
}

void ProcessGroup::check_reducible(const Tensor& t, ReduceOp r, const char* op) const {
  DType d = t.dtype();
  std::string where = std::string("[") + backend() + " " + op + "] ";
  if (d == DType::E4M3 || d == DType::E5M2)
    throw std::invalid_argument(where + "cannot reduce " + dtype_name(d) +
                                " tensors (fp8 moves as bytes only: all_gather, broadcast, "
                                "send/recv); cast to bf16 or f32 before reducing");
  if (d == DType::Bool && r == ReduceOp::Avg)
    throw std::invalid_argument(where + "cannot average bool tensors (use sum or max)");
}

void ProcessGroup::check_peer(int peer, const char* op) const {
  if (peer < 0 || peer >= size_)
    throw std::invalid_argument(std::string("[") + backend() + " " + op + "] rank " +
                                std::to_string(peer) + " is not in this group of " +
                                std::to_string(size_) + " ranks");
  if (peer == rank_)
    throw std::invalid_argument(std::string("[") + backend() + " " + op + "] rank " +
                                std::to_string(peer) + " is this rank itself");
}

int64_t ProcessGroup::check_all_to_all(const Tensor& out, const Tensor& in,
                                       const std::vector<int64_t>& out_splits,
                                       const std::vector<int64_t>& in_splits) const {
  check_tensor(out, "all_to_all");
  check_tensor(in, "all_to_all");
  const std::string where = "[" + backend() + " all_to_all] ";
  if (in.dim() < 1 || out.dim() < 1)
    throw std::invalid_argument(where +
                                "exchanges rows of dim 0 and needs tensors of at least "
                                "one dimension, got input " +
                                in.str() + " and output " + out.str());
  Shape in_row(in.shape().begin() + 1, in.shape().end());
  Shape out_row(out.shape().begin() + 1, out.shape().end());
  if (in.dtype() != out.dtype() || in_row != out_row)
    throw std::invalid_argument(where + "input " + in.str() + " and output " + out.str() +
                                " must have the same dtype and the same shape past dim 0");
  auto check_splits = [&](const std::vector<int64_t>& splits, const Tensor& t, const char* what) {
    if (static_cast<int>(splits.size()) != size_)
      throw std::invalid_argument(where + what + " has " + std::to_string(splits.size()) +
                                  " entries; it needs one per rank of this group of " +
                                  std::to_string(size_));
    int64_t sum = 0;
    for (size_t p = 0; p < splits.size(); ++p) {
      if (splits[p] < 0)
        throw std::invalid_argument(where + what + "[" + std::to_string(p) + "] is " +
                                    std::to_string(splits[p]) + "; row counts are >= 0");
      sum += splits[p];
    }
    if (sum != t.shape()[0])
      throw std::invalid_argument(where + what + " sums to " + std::to_string(sum) +
                                  " rows but the tensor " + t.str() + " has " +
                                  std::to_string(t.shape()[0]));
  };
  check_splits(in_splits, in, "in_splits");
  check_splits(out_splits, out, "out_splits");
  if (in_splits[rank_] != out_splits[rank_])
    throw std::invalid_argument(where + "rank " + std::to_string(rank_) + " sends itself " +
                                std::to_string(in_splits[rank_]) +
                                " rows (in_splits) but expects " +
                                std::to_string(out_splits[rank_]) + " (out_splits)");
  if (in.numel() > 0 && out.numel() > 0) {
    const char* a = static_cast<const char*>(in.data_ptr());
    const char* b = static_cast<const char*>(out.data_ptr());
    if (a < b + out.nbytes() && b < a + in.nbytes())
      throw std::invalid_argument(where + "input and output overlap; pass separate buffers");
  }
  int64_t row_numel = 1;
  for (int64_t d : in_row) row_numel *= d;
  return row_numel * static_cast<int64_t>(in.element_size());
}

}  // namespace accel
