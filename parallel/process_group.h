// ProcessGroup: collectives and point-to-point transfers between the ranks of a job, each returning
// an asynchronous Work handle. Two backends: "cpu" (host tensors, Boost.Asio TCP full mesh, ring
// algorithms for large messages) and "nccl" (CUDA tensors, on a communication stream of its own).
//
// Contract (as for NCCL): every rank of a group issues the same collectives in the same order with
// the same sizes and dtypes. The CPU backend checks this on the wire and throws on a mismatch.
// A dead or stalled rank makes the survivors' operations throw DistributedError within the
// timeout, naming the rank; after any failure the group is aborted and every later call throws.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "parallel/store.h"
#include "runtime/tensor.h"

namespace accel {

enum class ReduceOp : uint8_t { Sum, Avg, Max };
const char* reduce_op_name(ReduceOp op);  // "sum", "avg", "max"

// An operation in flight.
class Work {
 public:
  virtual ~Work() = default;
  virtual bool is_completed() = 0;
  // Blocks until the operation finished; rethrows its error. With a timeout, throws
  // DistributedError naming the ranks still awaited if it has not finished by then (the operation
  // itself keeps its own deadline). NCCL: returns when the GPU work is complete.
  virtual void wait() = 0;
  virtual void wait(Millis timeout) = 0;
  // NCCL: makes the caller's current CUDA stream wait for the operation without blocking the host
  // (no timeout: a later wait() or collective reports a dead peer). CPU backend: wait().
  virtual void wait_stream() { wait(); }
};
using WorkPtr = std::shared_ptr<Work>;

// Calls and bytes per kind of operation, for traffic reports. `bytes` is the payload the caller
// handed in (all_reduce: the tensor; reduce_scatter / all_gather: the larger buffer; send/recv: the
// tensor; all_to_all: `in`, the rows for this rank itself included); `wire_bytes` is what this
// rank sent on the network (ring all_reduce: 2(N-1)/N of the tensor; all_to_all: the rows for the
// other ranks). The NCCL backend counts the wire bytes of NCCL's ring algorithm.
struct CommCounter {
  int64_t calls = 0;
  int64_t bytes = 0;
  int64_t wire_bytes = 0;
};
enum class CommKind : uint8_t {
  AllReduce,
  ReduceScatter,
  AllGather,
  Broadcast,
  Barrier,
  Send,
  Recv,
  AllToAll
};
constexpr int kNumCommKinds = 8;
const char* comm_kind_name(CommKind k);  // "all_reduce", ...
struct CommStats {
  CommCounter kind[kNumCommKinds];
  const CommCounter& operator[](CommKind k) const { return kind[static_cast<int>(k)]; }
  CommCounter total() const;
};

struct ProcessGroupOptions {
  Millis timeout{std::chrono::seconds(600)};  // per operation, from when it starts executing
  // CPU backend: messages of at least this many bytes use the ring algorithms; smaller ones go
  // straight to every peer (one round trip).
  size_t ring_threshold_bytes = 256 * 1024;
  // CPU backend: granularity of pipelining (reduce while receiving, broadcast forwarding).
  size_t segment_bytes = 1 << 20;
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  // Ranks of this group in the world group, indexed by group rank.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  virtual std::string backend() const = 0;  // "cpu" or "nccl"
  Millis timeout() const { return options_.timeout; }

  // In place. bf16/f16 are added in fp32 and rounded; integer Avg truncates toward zero; Max
  // propagates NaN. fp8 tensors cannot be reduced (cast them first).
  virtual WorkPtr all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum) = 0;
  // in.numel() == size() * out.numel(); rank r receives the reduction of chunk r of every rank's
  // `in` (rank-major chunks, as ncclReduceScatter). `in` is not modified.
  virtual WorkPtr reduce_scatter(const Tensor& out, const Tensor& in,
                                 ReduceOp op = ReduceOp::Sum) = 0;
  // out.numel() == size() * in.numel(); out = [in of rank 0 | in of rank 1 | ...]. `in` may be
  // the rank's own chunk of `out`.
  virtual WorkPtr all_gather(const Tensor& out, const Tensor& in) = 0;
  virtual WorkPtr broadcast(const Tensor& t, int root) = 0;
  virtual WorkPtr barrier() = 0;
  // Rows of dim 0 to every rank, variable sizes (mixture-of-experts token dispatch). `in` holds,
  // rank after rank, in_splits[p] rows for group rank p; `out` receives, rank after rank,
  // out_splits[p] rows from rank p. Both splits have size() non-negative entries summing to
  // dim 0 of their tensor; `in` and `out` have the same dtype and the same shape past dim 0
  // (at least 1-d), do not overlap, and in_splits[rank()] == out_splits[rank()] (the rank's own
  // rows are copied). Across ranks, rank q's in_splits[p] must equal rank p's out_splits[q]
  // (exchange the counts first: parallel/expert_parallel.h). The CPU backend checks this and the
  // row size on the wire and refuses a mismatch naming both ranks; NCCL cannot check it (a
  // mismatch hangs until the timeout or corrupts rows).
  virtual WorkPtr all_to_all(const Tensor& out, const Tensor& in,
                             const std::vector<int64_t>& out_splits,
                             const std::vector<int64_t>& in_splits) = 0;
  // Point-to-point; ranks are group ranks. Sends and receives between a pair are matched in order.
  virtual WorkPtr send(const Tensor& t, int dst) = 0;
  virtual WorkPtr recv(const Tensor& t, int src) = 0;

  // A group of some of this group's ranks (listed as ranks of this group, ascending or not; the
  // new group's rank i is ranks[i]). Called by the members, in the same order on each of them;
  // non-members may call it too and get nullptr.
  virtual std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks) = 0;

  CommStats stats() const;
  void reset_stats();

 protected:
  ProcessGroup(int rank, int size, std::vector<int> world_ranks, ProcessGroupOptions options);
  // Checks shared by the backends; `op` names the call in messages.
  void check_tensor(const Tensor& t, const char* op) const;
  void check_reducible(const Tensor& t, ReduceOp r, const char* op) const;
  void check_peer(int peer, const char* op) const;
  // all_to_all's local contract (above); returns the bytes of one row.
  int64_t check_all_to_all(const Tensor& out, const Tensor& in,
                           const std::vector<int64_t>& out_splits,
                           const std::vector<int64_t>& in_splits) const;
  void count(CommKind k, int64_t bytes, int64_t wire_bytes);
  void count_wire(CommKind k, int64_t wire_bytes);

  int rank_;
  int size_;
  std::vector<int> world_ranks_;
  ProcessGroupOptions options_;

 private:
  struct AtomicCounter {
    std::atomic<int64_t> calls{0}, bytes{0}, wire_bytes{0};
  };
  AtomicCounter counters_[kNumCommKinds];
};

// The CPU backend over `store` (rank 0's server must be up or coming up). Collective over the
// `size` ranks: every rank connects to every other one, presenting the store's job token. Groups
// made by several calls must be made in the same order on every rank.
std::shared_ptr<ProcessGroup> make_cpu_process_group(std::shared_ptr<TcpStore> store, int rank,
                                                     int size, ProcessGroupOptions options = {});
// The NCCL backend on CUDA device `device`; the unique id goes through `store`. In builds without
// NCCL this throws a message saying so; nccl_available() tells beforehand.
std::shared_ptr<ProcessGroup> make_nccl_process_group(std::shared_ptr<TcpStore> store, int rank,
                                                      int size, int device,
                                                      ProcessGroupOptions options = {});
bool nccl_available();

}  // namespace accel
