// The NCCL process group: CUDA tensors, one communicator per group, its own communication stream.
//
// Each operation waits (on the GPU) for the work already queued on the caller's current stream,
// runs on the communication stream, and records a completion event. Communicators are created
// non-blocking, so initialization and waits poll with a deadline and can abort a communicator
// whose peers died or stalled instead of hanging forever. The unique id goes through the store.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "parallel/process_group.h"
#include "runtime/cuda/context.h"

namespace accel {
namespace {

using Clock = std::chrono::steady_clock;

std::string nccl_error(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last && *last) s += std::string(" (") + last + ")";
  return s;
}

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::F32:
      return ncclFloat32;
    case DType::F64:
      return ncclFloat64;
    case DType::BF16:
      return ncclBfloat16;
    case DType::F16:
      return ncclFloat16;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
    case DType::U8:
    case DType::Bool:
    case DType::E4M3:  // fp8 only moves as bytes
    case DType::E5M2:
      return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op, DType d) {
  if (d == DType::Bool) return ncclMax;  // sum and max of bools are "or"
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Avg:
      return ncclAvg;  // integer types: sum, then truncating division
    case ReduceOp::Max:
      return ncclMax;
  }
  return ncclSum;
}

// Shared by a group and its work handles: the communicator outlives every handle.
struct Comm {
  ncclComm_t comm = nullptr;
  int device = 0;
  cudaStream_t stream = nullptr;
  std::mutex mu;
  bool aborted = false;
  std::string abort_reason;
  std::shared_ptr<TcpStore> diag_store;  // short-timeout connection for diagnosis
  std::string prefix;                    // store keys of this communicator
  int rank = 0;                          // world rank, for the store keys
  std::vector<int> members;

  ~Comm() {
    cuda::DeviceGuard g(device);
    if (comm) {
      if (aborted)
        ncclCommAbort(comm);
      else
        ncclCommDestroy(comm);
    }
    if (stream) cudaStreamDestroy(stream);
  }

  // Marks the communicator dead and aborts it so that queued kernels return.
  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu);
    if (aborted) return;
    aborted = true;
    abort_reason = reason;
    if (comm) ncclCommAbort(comm);
    comm = nullptr;
  }

  // A non-blocking call returned `r`: wait for it to settle, throwing on failure or timeout.
  void settle(ncclResult_t r, const std::string& what, Clock::time_point deadline) {
    while (r == ncclInProgress) {
      if (Clock::now() > deadline) {
        abort(what + " did not finish before the timeout");
        throw DistributedError("nccl: " + abort_reason);
      }
      std::this_thread::yield();
      ncclCommGetAsyncError(comm, &r);
    }
    if (r != ncclSuccess) {
      std::string msg = what + " failed: " + nccl_error(r, comm);
      abort(msg);
      throw DistributedError("nccl: " + msg);
    }
  }

  // Members that never reported reaching sequence number `seq` (see NcclWork::wait).
  std::vector<int> absent(uint64_t seq) {
    std::vector<int> out;
    for (int m : members) {
      if (m == rank) continue;
      auto v = diag_store->try_get(prefix + "/at/" + std::to_string(m));
      if (!v || std::stoull(*v) < seq) out.push_back(m);
    }
    return out;
  }
};

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<Comm> comm, std::string desc, uint64_t seq, Millis timeout,
           std::vector<Tensor> keep)
      : comm_(std::move(comm)),
        desc_(std::move(desc)),
        seq_(seq),
        timeout_(timeout),
        keep_(std::move(keep)) {}

  void record() { done_.record(comm_->stream); }

  bool is_completed() override {
    cuda::DeviceGuard g(comm_->device);
    return done_.query();
  }
  void wait() override { wait_until(Clock::now() + timeout_, timeout_, true); }
  void wait(Millis timeout) override { wait_until(Clock::now() + timeout, timeout, false); }
  void wait_stream() override {
    cuda::DeviceGuard g(comm_->device);
    done_.wait(cuda::current_stream());
  }

  void wait_until(Clock::time_point deadline, Millis timeout, bool fatal) {
    cuda::DeviceGuard g(comm_->device);
    const auto report_at = Clock::now() + std::max(Millis(10), std::min(Millis(2000), timeout / 5));
    bool reported = false;
    while (!done_.query()) {
      std::string failed;
      {
        std::lock_guard<std::mutex> lock(comm_->mu);
        if (comm_->aborted)
          throw DistributedError("nccl " + desc_ + " failed: " + comm_->abort_reason);
        ncclResult_t r = ncclSuccess;
        ncclCommGetAsyncError(comm_->comm, &r);
        if (r != ncclSuccess && r != ncclInProgress)
          failed = desc_ + " failed: " + nccl_error(r, comm_->comm);
      }
      if (!failed.empty()) {
        comm_->abort(failed);
        throw DistributedError("nccl " + failed);
      }
      auto now = Clock::now();
      if (!reported && now >= report_at) {
        reported = true;
        try {
          comm_->diag_store->set(comm_->prefix + "/at/" + std::to_string(comm_->rank),
                                 std::to_string(seq_));
        } catch (const std::exception&) {
        }
      }
      if (now >= deadline) {
        std::string msg = desc_ + " timed out after " + describe_duration(timeout);
        try {
          auto missing = comm_->absent(seq_);
          msg += missing.empty() ? ": every rank joined it (a peer may be stuck in a kernel)"
                                 : ": " + describe_ranks(missing) +
                                       " never joined it (stalled, crashed, or issuing "
                                       "different collectives)";
        } catch (const std::exception&) {
          msg += " (the store could not say which rank is missing)";
        }
        if (!fatal) throw DistributedError("wait() gave up: " + msg);
        comm_->abort(msg);
        throw DistributedError("nccl " + msg);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    keep_.clear();
  }

 private:
  std::shared_ptr<Comm> comm_;
  std::string desc_;
  uint64_t seq_;
  Millis timeout_;
  std::vector<Tensor> keep_;  // the tensors stay alive until the GPU is done with them
  cuda::Event done_;
};

class NcclProcessGroup : public ProcessGroup {
 public:
  NcclProcessGroup(std::shared_ptr<TcpStore> store, int rank, std::vector<int> world_ranks,
                   int device, ProcessGroupOptions options, std::string prefix)
      : ProcessGroup(rank, static_cast<int>(world_ranks.size()), world_ranks, options),
        store_(std::move(store)),
        prefix_(std::move(prefix)) {
    comm_ = std::make_shared<Comm>();
    comm_->device = device;
    comm_->prefix = prefix_;
    comm_->rank = world_ranks_[rank_];
    comm_->members = world_ranks_;
    comm_->diag_store = store_->connect_again(std::min(Millis(5000), options_.timeout));
    cuda::DeviceGuard g(device);

    const auto deadline = Clock::now() + store_->timeout();
    ncclUniqueId id;
    if (rank_ == 0) {
      ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess)
        throw DistributedError("nccl: ncclGetUniqueId failed: " + nccl_error(r, nullptr));
      store_->set(prefix_ + "/id", std::string(reinterpret_cast<const char*>(&id), sizeof id));
    } else {
      std::string v;
      try {
        v = store_->get(prefix_ + "/id");
      } catch (const DistributedError&) {
        throw DistributedError("nccl: rank " + std::to_string(world_ranks_[0]) +
                               " did not publish the NCCL unique id within " +
                               describe_duration(store_->timeout()) +
                               " (not started, crashed or stalled)");
      }
      if (v.size() != sizeof id) throw DistributedError("nccl: malformed unique id in the store");
      std::memcpy(&id, v.data(), sizeof id);
    }
    store_->set(prefix_ + "/joined/" + std::to_string(world_ranks_[rank_]), "1");

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm_->comm, size_, id, rank_, &config);
    try {
      comm_->settle(r, "communicator initialization", deadline);
    } catch (const DistributedError& e) {
      std::vector<int> missing;
      for (int m : world_ranks_)
        if (!store_->check({prefix_ + "/joined/" + std::to_string(m)})) missing.push_back(m);
      if (missing.empty()) throw;
      throw DistributedError(std::string(e.what()) + ": " + describe_ranks(missing) +
                             " never joined (not started, crashed or stalled)");
    }
    ACCEL_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_->stream, cudaStreamNonBlocking));
  }

  std::string backend() const override { return "nccl"; }

  WorkPtr all_reduce(const Tensor& t, ReduceOp op) override {
    check_tensor(t, "all_reduce");
    check_reducible(t, op, "all_reduce");
    const int64_t S = static_cast<int64_t>(t.nbytes());
    return launch(
        CommKind::AllReduce, S, ring_share(2 * S), {t},
        std::string(dtype_name(t.dtype())) + " " + reduce_op_name(op), [&](cudaStream_t s) {
          return ncclAllReduce(t.data_ptr(), t.data_ptr(), numel_of(t), nccl_type(t.dtype()),
                               nccl_op(op, t.dtype()), comm_->comm, s);
        });
  }

  WorkPtr reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override {
    check_tensor(out, "reduce_scatter");
    check_tensor(in, "reduce_scatter");
    check_reducible(in, op, "reduce_scatter");
    if (out.dtype() != in.dtype() || in.numel() != out.numel() * size_)
      throw std::invalid_argument("[nccl reduce_scatter] input " + in.str() +
                                  " must have the output's dtype and " + std::to_string(size_) +
                                  " (group size) times its " + std::to_string(out.numel()) +
                                  " elements; output " + out.str());
    const int64_t S = static_cast<int64_t>(in.nbytes());
    return launch(
        CommKind::ReduceScatter, S, ring_share(S), {out, in},
        std::string(dtype_name(in.dtype())) + " " + reduce_op_name(op), [&](cudaStream_t s) {
          return ncclReduceScatter(in.data_ptr(), out.data_ptr(), numel_of(out),
                                   nccl_type(in.dtype()), nccl_op(op, in.dtype()), comm_->comm, s);
        });
  }

  WorkPtr all_gather(const Tensor& out, const Tensor& in) override {
    check_tensor(out, "all_gather");
    check_tensor(in, "all_gather");
    if (out.dtype() != in.dtype() || out.numel() != in.numel() * size_)
      throw std::invalid_argument("[nccl all_gather] output " + out.str() +
                                  " must have the input's dtype and " + std::to_string(size_) +
                                  " (group size) times its " + std::to_string(in.numel()) +
                                  " elements; input " + in.str());
    const int64_t S = static_cast<int64_t>(out.nbytes());
    return launch(CommKind::AllGather, S, ring_share(S), {out, in}, dtype_name(in.dtype()),
                  [&](cudaStream_t s) {
                    return ncclAllGather(in.data_ptr(), out.data_ptr(), numel_of(in),
                                         nccl_type(in.dtype()), comm_->comm, s);
                  });
  }

  WorkPtr broadcast(const Tensor& t, int root) override {
    check_tensor(t, "broadcast");
    if (root < 0 || root >= size_)
      throw std::invalid_argument("[nccl broadcast] root " + std::to_string(root) +
                                  " is not in this group of " + std::to_string(size_) + " ranks");
    const int64_t S = static_cast<int64_t>(t.nbytes());
    // Ring model: every rank but the one just before the root forwards the whole buffer.
    int64_t wire = size_ > 1 && rank_ != (root + size_ - 1) % size_ ? S : 0;
    return launch(CommKind::Broadcast, S, wire, {t}, "root " + std::to_string(root),
                  [&](cudaStream_t s) {
                    return ncclBroadcast(t.data_ptr(), t.data_ptr(), numel_of(t),
                                         nccl_type(t.dtype()), root, comm_->comm, s);
                  });
  }

  WorkPtr barrier() override {
    if (!barrier_buf_.get()) {
      cuda::DeviceGuard g(comm_->device);
      barrier_buf_ = cuda::DeviceBuffer(sizeof(int32_t), comm_->device);
    }
    return launch(CommKind::Barrier, 0, 0, {}, "", [&](cudaStream_t s) {
      return ncclAllReduce(barrier_buf_.get(), barrier_buf_.get(), 1, ncclInt32, ncclSum,
                           comm_->comm, s);
    });
  }

  // One ncclSend/ncclRecv per peer with rows to move, fused by ncclGroupStart/End into one
  // launch; this rank's own rows are a device copy on the communication stream.
  WorkPtr all_to_all(const Tensor& out, const Tensor& in, const std::vector<int64_t>& out_splits,
                     const std::vector<int64_t>& in_splits) override {
    const int64_t row = check_all_to_all(out, in, out_splits, in_splits);
    int64_t wire = 0;
    for (int p = 0; p < size_; ++p)
      if (p != rank_) wire += in_splits[p] * row;
    const int64_t S = static_cast<int64_t>(in.nbytes());
    // Bytes, so that every dtype (fp8 and bool included) moves the same way.
    return launch(
        CommKind::AllToAll, S, wire, {out, in}, dtype_name(in.dtype()), [&](cudaStream_t s) {
          const char* x = static_cast<const char*>(in.data_ptr());
          char* o = static_cast<char*>(out.data_ptr());
          std::vector<int64_t> in_at(size_ + 1, 0), out_at(size_ + 1, 0);
          for (int p = 0; p < size_; ++p) {
            in_at[p + 1] = in_at[p] + in_splits[p] * row;
            out_at[p + 1] = out_at[p] + out_splits[p] * row;
          }
          if (const int64_t own = in_splits[rank_] * row)
            ACCEL_CUDA_CHECK(cudaMemcpyAsync(o + out_at[rank_], x + in_at[rank_],
                                             static_cast<size_t>(own), cudaMemcpyDeviceToDevice,
                                             s));
          auto ok = [](ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; };
          ncclResult_t r = ncclGroupStart();
          for (int p = 0; p < size_ && ok(r); ++p) {
            if (p == rank_) continue;
            const size_t sb = static_cast<size_t>(in_splits[p] * row);
            const size_t rb = static_cast<size_t>(out_splits[p] * row);
            if (sb) r = ncclSend(x + in_at[p], sb, ncclUint8, p, comm_->comm, s);
            if (rb && ok(r)) r = ncclRecv(o + out_at[p], rb, ncclUint8, p, comm_->comm, s);
          }
          const ncclResult_t e = ncclGroupEnd();  // closes the group in any case
          return ok(r) ? e : r;
        });
  }

  WorkPtr send(const Tensor& t, int dst) override {
    check_tensor(t, "send");
    check_peer(dst, "send");
    const int64_t S = static_cast<int64_t>(t.nbytes());
    return launch(CommKind::Send, S, S, {t}, "to rank " + std::to_string(world_ranks_[dst]),
                  [&](cudaStream_t s) {
                    return ncclSend(t.data_ptr(), numel_of(t), nccl_type(t.dtype()), dst,
                                    comm_->comm, s);
                  });
  }

  WorkPtr recv(const Tensor& t, int src) override {
    check_tensor(t, "recv");
    check_peer(src, "recv");
    const int64_t S = static_cast<int64_t>(t.nbytes());
    return launch(CommKind::Recv, S, 0, {t}, "from rank " + std::to_string(world_ranks_[src]),
                  [&](cudaStream_t s) {
                    return ncclRecv(t.data_ptr(), numel_of(t), nccl_type(t.dtype()), src,
                                    comm_->comm, s);
                  });
  }

  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks) override {
    std::string key;
    int me = -1;
    std::vector<bool> seen(size_, false);
    for (size_t i = 0; i < ranks.size(); ++i) {
      int g = ranks[i];
      if (g < 0 || g >= size_ || seen[g])
        throw std::invalid_argument(
            "[nccl new_group] ranks must be distinct ranks of this group of " +
            std::to_string(size_) + ", got " + std::to_string(g));
      seen[g] = true;
      if (g == rank_) me = static_cast<int>(i);
      key += std::to_string(g) + ",";
    }
    if (ranks.empty()) throw std::invalid_argument("[nccl new_group] empty rank list");
    int k = made_[key]++;
    if (me < 0) return nullptr;
    std::vector<int> wr;
    for (int g : ranks) wr.push_back(world_ranks_[g]);
    return std::make_shared<NcclProcessGroup>(store_, me, wr, comm_->device, options_,
                                              prefix_ + "/g" + key + "#" + std::to_string(k));
  }

 private:
  static size_t numel_of(const Tensor& t) { return static_cast<size_t>(t.numel()); }
  int64_t ring_share(int64_t bytes) const { return size_ > 1 ? bytes * (size_ - 1) / size_ : 0; }

  template <class F>
  WorkPtr launch(CommKind kind, int64_t bytes, int64_t wire, std::vector<Tensor> tensors,
                 const std::string& detail, F&& call) {
    {
      std::lock_guard<std::mutex> lock(comm_->mu);
      if (comm_->aborted)
        throw DistributedError(
            std::string("nccl ") + comm_kind_name(kind) +
            ": the communicator was aborted by an earlier failure: " + comm_->abort_reason);
    }
    cuda::DeviceGuard g(comm_->device);
    for (auto& t : tensors)
      if (t.device().index != comm_->device)
        throw std::invalid_argument(
            std::string("[nccl ") + comm_kind_name(kind) + "] tensor on " + t.device().str() +
            " but this group's communicator is on cuda:" + std::to_string(comm_->device));
    uint64_t seq = seq_++;
    std::string desc = std::string(comm_kind_name(kind)) + " #" + std::to_string(seq) + " (" +
                       detail + (detail.empty() ? "" : ", ") + std::to_string(bytes) +
                       " bytes, group of " + std::to_string(size_) + " ranks)";
    // The communication stream waits for what the caller queued on its stream.
    cuda::Event ready;
    ready.record(cuda::current_stream());
    ready.wait(comm_->stream);
    for (auto& t : tensors)
      if (t.numel() > 0) cuda::record_stream(t.storage()->data, comm_->stream);
    auto work = std::make_shared<NcclWork>(comm_, desc, seq, options_.timeout, tensors);
    comm_->settle(call(comm_->stream), desc, Clock::now() + options_.timeout);
    work->record();
    count(kind, bytes, wire);
    return work;
  }

  std::shared_ptr<TcpStore> store_;
  std::string prefix_;
  std::shared_ptr<Comm> comm_;
  uint64_t seq_ = 0;
  std::map<std::string, int> made_;
  cuda::DeviceBuffer barrier_buf_;
};

int next_instance() {
  static std::atomic<int> n{0};
  return n++;
}

}  // namespace

bool nccl_available() { return cuda::available(); }

std::shared_ptr<ProcessGroup> make_nccl_process_group(std::shared_ptr<TcpStore> store, int rank,
                                                      int size, int device,
                                                      ProcessGroupOptions options) {
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument("make_nccl_process_group: rank " + std::to_string(rank) +
                                " is not in a world of " + std::to_string(size));
  if (!store) throw std::invalid_argument("make_nccl_process_group: no store");
  if (!cuda::available())
    throw std::runtime_error("make_nccl_process_group: no CUDA device is visible");
  std::vector<int> world(size);
  for (int i = 0; i < size; ++i) world[i] = i;
  return std::make_shared<NcclProcessGroup>(std::move(store), rank, world, device, options,
                                            "nccl" + std::to_string(next_instance()));
}

}  // namespace accel
