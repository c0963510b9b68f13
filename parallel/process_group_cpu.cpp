// The CPU process group: host tensors over a full mesh of TCP connections (Boost.Asio).
//
// One Transport per world group owns the sockets and an engine thread; subgroups share it. The
// caller's thread only queues operations; the engine runs them one at a time in issue order, so a
// Work handle is truly asynchronous. Point-to-point operations are posted without waiting, so
// send/recv pairs in both directions cannot deadlock.
//
// Every message carries a header (group, kind, sequence number, step, size) that the receiver
// checks against what it expects: ranks that diverge get an error instead of mixed data.
// A failure (peer gone, timeout, mismatch) aborts the transport: it records the first failure in
// the store, closes every connection so peers fail fast too, and fails all later operations.
#include <algorithm>
#include <array>
#include <boost/asio.hpp>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "parallel/process_group.h"
#include "runtime/format.h"

namespace accel {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

int mod(int a, int n) { return ((a % n) + n) % n; }

// ---- reductions --------------------------------------------------------------------------------
// dst = a (op) b elementwise, or (a + b) / divisor when divisor > 1 (the last step of Avg).
// Narrow types are widened (bf16/f16 to fp32, integers to int64) and rounded once per call.

template <class T, class A>
struct Plain {
  using Elem = T;
  using Acc = A;
  static A load(T v) { return static_cast<A>(v); }
  static T store(A v) { return static_cast<T>(v); }
  static A add(A x, A y) { return x + y; }
  static A div(A x, int d) { return x / static_cast<A>(d); }
  static A max(A x, A y) { return (x != x || x > y) ? x : y; }  // NaN wins
};
struct I64Cv {  // wrapping add without signed-overflow UB
  using Elem = int64_t;
  using Acc = int64_t;
  static int64_t load(int64_t v) { return v; }
  static int64_t store(int64_t v) { return v; }
  static int64_t add(int64_t x, int64_t y) {
    return static_cast<int64_t>(static_cast<uint64_t>(x) + static_cast<uint64_t>(y));
  }
  static int64_t div(int64_t x, int d) { return x / d; }
  static int64_t max(int64_t x, int64_t y) { return x > y ? x : y; }
};
template <class T>
struct NarrowInt {  // i32 and u8: int64 accumulator, stored modulo 2^bits
  using Elem = T;
  using Acc = int64_t;
  static int64_t load(T v) { return v; }
  static T store(int64_t v) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<uint64_t>(v)));
  }
  static int64_t add(int64_t x, int64_t y) { return I64Cv::add(x, y); }
  static int64_t div(int64_t x, int d) { return x / d; }
  static int64_t max(int64_t x, int64_t y) { return x > y ? x : y; }
};
struct BF16Cv : Plain<uint16_t, float> {
  static float load(uint16_t v) { return bf16_to_f32(v); }
  static uint16_t store(float v) { return f32_to_bf16(v); }
};
struct F16Cv : Plain<uint16_t, float> {
  static float load(uint16_t v) { return f16_to_f32(v); }
  static uint16_t store(float v) { return f32_to_f16(v); }
};
struct BoolCv {  // sum and max are "or"
  using Elem = uint8_t;
  using Acc = int;
  static int load(uint8_t v) { return v != 0; }
  static uint8_t store(int v) { return v != 0; }
  static int add(int x, int y) { return x | y; }
  static int div(int x, int) { return x; }
  static int max(int x, int y) { return x | y; }
};

template <class Cv>
void reduce_pair_t(void* dst_v, const void* a_v, const void* b_v, int64_t n, ReduceOp op,
                   int divisor) {
  using T = typename Cv::Elem;
  T* dst = static_cast<T*>(dst_v);
  const T* a = static_cast<const T*>(a_v);
  const T* b = static_cast<const T*>(b_v);
  if (op == ReduceOp::Max) {
    for (int64_t i = 0; i < n; ++i) dst[i] = Cv::store(Cv::max(Cv::load(a[i]), Cv::load(b[i])));
  } else if (divisor > 1) {
    for (int64_t i = 0; i < n; ++i)
      dst[i] = Cv::store(Cv::div(Cv::add(Cv::load(a[i]), Cv::load(b[i])), divisor));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = Cv::store(Cv::add(Cv::load(a[i]), Cv::load(b[i])));
  }
}

// dst = srcs[0] (op) srcs[1] (op) ... in rank order, rounded once; dst may be one of srcs.
template <class Cv>
void reduce_many_t(void* dst_v, const std::vector<const void*>& srcs, int64_t n, ReduceOp op) {
  using T = typename Cv::Elem;
  using A = typename Cv::Acc;
  T* dst = static_cast<T*>(dst_v);
  const int k = static_cast<int>(srcs.size());
  for (int64_t i = 0; i < n; ++i) {
    A acc = Cv::load(static_cast<const T*>(srcs[0])[i]);
    for (int j = 1; j < k; ++j) {
      A v = Cv::load(static_cast<const T*>(srcs[j])[i]);
      acc = op == ReduceOp::Max ? Cv::max(acc, v) : Cv::add(acc, v);
    }
    if (op == ReduceOp::Avg) acc = Cv::div(acc, k);
    dst[i] = Cv::store(acc);
  }
}

template <template <class> class F, class... Args>
void dispatch(DType d, Args&&... args) {
  switch (d) {
    case DType::F32:
      return F<Plain<float, float>>::run(args...);
    case DType::F64:
      return F<Plain<double, double>>::run(args...);
    case DType::BF16:
      return F<BF16Cv>::run(args...);
    case DType::F16:
      return F<F16Cv>::run(args...);
    case DType::I32:
      return F<NarrowInt<int32_t>>::run(args...);
    case DType::I64:
      return F<I64Cv>::run(args...);
    case DType::U8:
      return F<NarrowInt<uint8_t>>::run(args...);
    case DType::Bool:
      return F<BoolCv>::run(args...);
    case DType::E4M3:
    case DType::E5M2:
      break;
  }
  throw std::logic_error("reduce: dtype without reduction");  // checked at issue time
}
template <class Cv>
struct PairF {
  static void run(void* d, const void* a, const void* b, int64_t n, ReduceOp op, int div) {
    reduce_pair_t<Cv>(d, a, b, n, op, div);
  }
};
template <class Cv>
struct ManyF {
  static void run(void* d, const std::vector<const void*>& s, int64_t n, ReduceOp op) {
    reduce_many_t<Cv>(d, s, n, op);
  }
};

void reduce_pair(DType d, void* dst, const void* a, const void* b, int64_t n, ReduceOp op,
                 int divisor) {
  dispatch<PairF>(d, dst, a, b, n, op, divisor);
}
void reduce_many(DType d, void* dst, const std::vector<const void*>& srcs, int64_t n, ReduceOp op) {
  dispatch<ManyF>(d, dst, srcs, n, op);
}

// ---- wire --------------------------------------------------------------------------------------

constexpr uint32_t kMsgMagic = 0x31474b41;  // "AKG1"
constexpr char kPeerHello[8] = {'A', 'C', 'C', 'E', 'L', 'P', 'G', '1'};
constexpr size_t kMaxPendingPeers = 64;  // handshakes in progress on a rank's mesh listener

struct MsgHeader {
  uint32_t magic = kMsgMagic;
  uint32_t group = 0;
  uint64_t seq = 0;
  uint32_t kind = 0;
  uint32_t step = 0;
  uint64_t nbytes = 0;
};
static_assert(sizeof(MsgHeader) == 32, "MsgHeader must have no padding");

std::string describe_header(const MsgHeader& h) {
  std::string k = h.kind < kNumCommKinds ? comm_kind_name(static_cast<CommKind>(h.kind)) : "?";
  return k + " #" + std::to_string(h.seq) + " step " + std::to_string(h.step) + " (" +
         format_bytes(static_cast<int64_t>(h.nbytes)) + ", group " + std::to_string(h.group) + ")";
}

// ---- operations in flight ----------------------------------------------------------------------

struct OpState {
  std::string desc;  // "all_reduce #5 (group of 4 ranks, 4 KiB)"
  uint32_t group = 0;
  uint64_t seq = 0;
  CommKind kind = CommKind::AllReduce;
  std::vector<int> members;  // world ranks of the group
  bool p2p = false;
  std::function<void(OpState&)> run;  // engine thread

  // Engine-thread state.
  int pending = 0;  // posted reads and writes not yet complete
  Clock::time_point deadline;
  Clock::time_point report_at;
  bool reported = false;

  // Shared with waiters (under mu).
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string error;
  std::multiset<int> awaiting;  // world ranks we wait to hear from
};

class CpuWork : public Work {
 public:
  explicit CpuWork(std::shared_ptr<OpState> op) : op_(std::move(op)) {}
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(op_->mu);
    return op_->done;
  }
  void wait() override {
    std::unique_lock<std::mutex> lock(op_->mu);
    op_->cv.wait(lock, [&] { return op_->done; });
    if (!op_->error.empty()) throw DistributedError(op_->error);
  }
  void wait(Millis timeout) override {
    std::unique_lock<std::mutex> lock(op_->mu);
    if (!op_->cv.wait_for(lock, timeout, [&] { return op_->done; })) {
      std::vector<int> ranks(op_->awaiting.begin(), op_->awaiting.end());
      ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
      throw DistributedError("wait() gave up after " + describe_duration(timeout) + " on " +
                             op_->desc +
                             (ranks.empty() ? std::string(" (queued or sending)")
                                            : ": still waiting for " + describe_ranks(ranks)));
    }
    if (!op_->error.empty()) throw DistributedError(op_->error);
  }

 private:
  std::shared_ptr<OpState> op_;
};

// ---- transport ---------------------------------------------------------------------------------

class Transport {
 public:
  Transport(std::shared_ptr<TcpStore> store, int rank, int size, ProcessGroupOptions options,
            std::string prefix);
  ~Transport();

  int rank() const { return rank_; }
  const ProcessGroupOptions& options() const { return options_; }
  void enqueue(std::shared_ptr<OpState> op);

  // Engine thread only: post I/O for `op` and drive it.
  // Called as each segment of a message arrives: `seg` holds bytes [offset, offset + len).
  using SegmentFn = std::function<void(const char* seg, size_t offset, size_t len)>;
  void write(int peer, const MsgHeader& h, const void* data, OpState& op,
             std::function<void()> done = {});
  // Without on_segment the message lands in data[0, nbytes); with it, `data` is a staging buffer
  // of segment_bytes (see staging()) and on_segment consumes each piece.
  void read(int peer, const MsgHeader& h, void* data, OpState& op, SegmentFn on_segment = {},
            std::function<void()> done = {});
  // Engine-thread scratch memory kept between operations (no allocation or page faults per op).
  char* scratch(size_t slot, size_t bytes);
  char* staging() { return scratch(0, options_.segment_bytes); }
  // Runs I/O until op.pending == 0; throws DistributedError on failure or timeout.
  void finish_io(OpState& op);
  // Engine thread: a check of what a peer sent failed. Aborts the transport (so the peers fail
  // fast instead of waiting for data that will not come) and throws.
  [[noreturn]] void fail(const std::string& reason);

 private:
  struct WriteReq {
    MsgHeader hdr;
    const void* data;
    std::shared_ptr<OpState> op;
    std::function<void()> done;
  };
  struct ReadReq {
    MsgHeader expect;
    void* data;
    std::shared_ptr<OpState> op;
    SegmentFn on_segment;
    std::function<void()> done;
    size_t received = 0;
  };
  struct Peer {
    int rank;
    tcp::socket sock;
    std::deque<WriteReq> writes;
    std::deque<ReadReq> reads;
    bool writing = false, reading = false;
    MsgHeader out_hdr, in_hdr;
    Peer(int r, tcp::socket s) : rank(r), sock(std::move(s)) {}
  };

  void connect_mesh(const std::string& my_address);
  void start_write(Peer& p);
  void start_read(Peer& p);
  void read_payload(Peer& p);
  void io_failed(Peer& p, const boost::system::error_code& ec, const char* what);
  void io_done(OpState& op);
  void abort(const std::string& reason);
  void complete(OpState& op, const std::string& error);
  void execute(const std::shared_ptr<OpState>& op);
  void engine_main();
  void check_p2p_deadlines();
  void report_progress(OpState& op);
  std::string diagnose_timeout(OpState& op);
  std::shared_ptr<OpState> shared(OpState& op);

  std::shared_ptr<TcpStore> store_;
  std::unique_ptr<TcpStore> diag_store_;  // own connection, short timeouts, engine thread only
  int rank_, size_;
  ProcessGroupOptions options_;
  std::string prefix_;
  Millis report_after_;

  asio::io_context ioc_;
  asio::executor_work_guard<asio::io_context::executor_type> guard_;
  std::vector<std::unique_ptr<Peer>> peers_;  // by world rank; null for self

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<OpState>> queue_;
  bool stop_ = false;

  // Engine thread.
  bool aborted_ = false;
  std::string abort_reason_;
  std::vector<std::shared_ptr<OpState>> inflight_p2p_;
  OpState* current_ = nullptr;
  std::vector<std::pair<std::unique_ptr<char[]>, size_t>> scratch_;
  std::shared_ptr<OpState> current_shared_;
  std::thread engine_;
};

Transport::Transport(std::shared_ptr<TcpStore> store, int rank, int size,
                     ProcessGroupOptions options, std::string prefix)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      options_(options),
      prefix_(std::move(prefix)),
      guard_(asio::make_work_guard(ioc_)) {
  report_after_ = std::max(Millis(10), std::min(Millis(2000), options_.timeout / 5));
  options_.segment_bytes = std::max<size_t>(options_.segment_bytes, 64) & ~size_t(7);
  diag_store_ = store_->connect_again(std::min(Millis(5000), options_.timeout));
  peers_.resize(size_);
  connect_mesh(store_->local_address());
  engine_ = std::thread([this] { engine_main(); });
}

Transport::~Transport() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  asio::post(ioc_, [] {});
  if (engine_.joinable()) engine_.join();
  for (auto& p : peers_) {
    if (!p) continue;
    boost::system::error_code ec;
    p->sock.close(ec);
  }
}

void Transport::connect_mesh(const std::string& my_address) {
  const auto deadline = Clock::now() + store_->timeout();
  const std::string& token = store_->token();
  boost::system::error_code ec;

  tcp::acceptor acceptor(ioc_);
  tcp::endpoint ep(asio::ip::make_address(my_address, ec), 0);
  if (ec) ep = tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0);
  acceptor.open(ep.protocol());
  acceptor.bind(ep);
  acceptor.listen(asio::socket_base::max_listen_connections);
  store_->set(prefix_ + "/addr/" + std::to_string(rank_),
              ep.address().to_string() + " " + std::to_string(acceptor.local_endpoint().port()));

  int connected = 0;
  const int expected = size_ - 1;
  std::string error;

  auto make_hello = [&](int to) {
    auto buf = std::make_shared<std::vector<char>>(sizeof(kPeerHello) + 16 + token.size());
    char* p = buf->data();
    std::memcpy(p, kPeerHello, sizeof(kPeerHello));
    uint32_t fields[4] = {static_cast<uint32_t>(rank_), static_cast<uint32_t>(to),
                          static_cast<uint32_t>(size_), static_cast<uint32_t>(token.size())};
    std::memcpy(p + sizeof(kPeerHello), fields, 16);
    if (!token.empty()) std::memcpy(p + sizeof(kPeerHello) + 16, token.data(), token.size());
    return buf;
  };

  // Accept side: ranks above this one connect here. A connection that fails the handshake is
  // closed and the others carry on.
  struct Incoming {
    tcp::socket sock;
    char hello[sizeof(kPeerHello) + 16];
    std::vector<char> token;
    uint8_t ack = 1;
    bool finished = false;  // refused, or handed to peers_
    explicit Incoming(asio::io_context& io) : sock(io) {}
  };
  // Accepted connections still in their handshake, oldest first, and the one being accepted last.
  // As for the store, strangers arriving faster than they are refused are capped: a new one closes
  // the oldest unfinished handshake (a real peer that loses it reconnects).
  std::deque<std::shared_ptr<Incoming>> incoming;
  std::function<void()> accept_one = [&] {
    auto in = std::make_shared<Incoming>(ioc_);
    incoming.push_back(in);
    acceptor.async_accept(in->sock, [&, in](boost::system::error_code aec) {
      if (aec) return;
      while (!incoming.empty() && incoming.front()->finished) incoming.pop_front();
      if (incoming.size() > kMaxPendingPeers) {
        boost::system::error_code ignored;
        incoming.front()->sock.close(ignored);  // its pending read fails and refuses it
        incoming.front()->finished = true;
        incoming.pop_front();
      }
      accept_one();
      asio::async_read(
          in->sock, asio::buffer(in->hello), [&, in](boost::system::error_code e, size_t) {
            // A stranger, a duplicate or garbage: refuse it and keep accepting.
            auto reject = [in] {
              in->finished = true;
              boost::system::error_code ignored;
              in->sock.close(ignored);
            };
            if (e || std::memcmp(in->hello, kPeerHello, sizeof(kPeerHello)) != 0) return reject();
            uint32_t f[4];
            std::memcpy(f, in->hello + sizeof(kPeerHello), 16);
            if (f[3] > kMaxJobTokenBytes) return reject();
            in->token.resize(f[3]);
            asio::async_read(in->sock, asio::buffer(in->token),
                             [&, in, reject, f0 = f[0], f1 = f[1], f2 = f[2]](
                                 boost::system::error_code e2, size_t) {
                               if (e2) return reject();
                               std::string got(in->token.begin(), in->token.end());
                               unsigned char diff = got.size() != token.size();
                               for (size_t i = 0; i < got.size() && i < token.size(); ++i)
                                 diff |= got[i] ^ token[i];
                               int from = static_cast<int>(f0);
                               if (diff || f1 != static_cast<uint32_t>(rank_) ||
                                   f2 != static_cast<uint32_t>(size_) || from <= rank_ ||
                                   from >= size_ || peers_[from])
                                 return reject();
                               asio::async_write(
                                   in->sock, asio::buffer(&in->ack, 1),
                                   [&, in, from](boost::system::error_code e3, size_t) {
                                     in->finished = true;
                                     if (e3 || peers_[from]) return;
                                     peers_[from] =
                                         std::make_unique<Peer>(from, std::move(in->sock));
                                     ++connected;
                                   });
                             });
          });
    });
  };
  if (rank_ < size_ - 1) accept_one();

  // Connect side: to every rank below this one, retrying until its listener is up.
  struct Outgoing {
    int to;
    tcp::endpoint ep;
    tcp::socket sock;
    asio::steady_timer retry;
    std::shared_ptr<std::vector<char>> hello;
    uint8_t ack = 0;
    int handshake_failures = 0;
    std::string last_error = "not tried";
    Outgoing(asio::io_context& io, int t, tcp::endpoint e) : to(t), ep(e), sock(io), retry(io) {}
  };
  std::vector<std::shared_ptr<Outgoing>> outgoing;
  for (int j = 0; j < rank_; ++j) {
    std::string v;
    try {
      v = store_->get(prefix_ + "/addr/" + std::to_string(j),
                      std::chrono::duration_cast<Millis>(deadline - Clock::now()));
    } catch (const DistributedError&) {
      throw DistributedError("cpu process group: rank " + std::to_string(j) +
                             " did not register with the rendezvous store within " +
                             describe_duration(store_->timeout()) +
                             " (not started, crashed or stalled)");
    }
    std::istringstream is(v);
    std::string host;
    unsigned short port = 0;
    is >> host >> port;
    outgoing.push_back(
        std::make_shared<Outgoing>(ioc_, j, tcp::endpoint(asio::ip::make_address(host), port)));
  }
  std::function<void(std::shared_ptr<Outgoing>)> connect_one;
  auto retry_later = [&](const std::shared_ptr<Outgoing>& o) {
    boost::system::error_code ignored;
    o->sock.close(ignored);
    o->retry.expires_after(Millis(20));
    o->retry.async_wait([&, o](boost::system::error_code te) {
      if (!te) connect_one(o);
    });
  };
  // A handshake the peer cut off is tried again a few times: its listener may have dropped this
  // connection among strangers. A peer with another token keeps refusing and is reported.
  constexpr int kHandshakeAttempts = 50;
  connect_one = [&](std::shared_ptr<Outgoing> o) {
    o->sock.async_connect(o->ep, [&, o](boost::system::error_code e) {
      if (e) {
        o->last_error = e.message();
        return retry_later(o);
      }
      o->hello = make_hello(o->to);
      asio::async_write(
          o->sock, asio::buffer(*o->hello), [&, o](boost::system::error_code we, size_t) {
            if (we) {
              if (++o->handshake_failures < kHandshakeAttempts) return retry_later(o);
              error = "could not send the handshake to rank " + std::to_string(o->to) + ": " +
                      we.message();
              return;
            }
            asio::async_read(
                o->sock, asio::buffer(&o->ack, 1), [&, o](boost::system::error_code re, size_t) {
                  if (re || o->ack != 1) {
                    if (++o->handshake_failures < kHandshakeAttempts) return retry_later(o);
                    error = "rank " + std::to_string(o->to) +
                            " closed the connection during the handshake: it has a different "
                            "ACCEL_JOB_TOKEN, or it exited";
                    return;
                  }
                  peers_[o->to] = std::make_unique<Peer>(o->to, std::move(o->sock));
                  ++connected;
                });
          });
    });
  };
  for (auto& o : outgoing) connect_one(o);

  while (connected < expected && error.empty()) {
    if (Clock::now() >= deadline) break;
    ioc_.run_one_until(deadline);
  }
  // Drop whatever is still pending (half-open handshakes, retry timers, the acceptor).
  acceptor.close(ec);
  for (auto& in : incoming) in->sock.close(ec);
  for (auto& o : outgoing) {
    o->retry.cancel();
    if (!peers_[o->to]) o->sock.close(ec);
  }
  ioc_.poll();
  if (!error.empty()) throw DistributedError("cpu process group: " + error);
  if (connected < expected) {
    std::vector<int> missing;
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && !peers_[j]) missing.push_back(j);
    throw DistributedError("cpu process group: rank " + std::to_string(rank_) +
                           " could not connect to " + describe_ranks(missing) + " within " +
                           describe_duration(store_->timeout()) +
                           " (crashed, stalled, wrong ACCEL_JOB_TOKEN, or a firewall)");
  }
  for (auto& p : peers_) {
    if (!p) continue;
    p->sock.set_option(tcp::no_delay(true), ec);
  }
}

void Transport::enqueue(std::shared_ptr<OpState> op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(op));
  }
  cv_.notify_one();
  asio::post(ioc_, [] {});  // wakes the engine if it sits in the io_context
}

std::shared_ptr<OpState> Transport::shared(OpState& op) {
  if (current_ == &op) return current_shared_;
  for (auto& o : inflight_p2p_)
    if (o.get() == &op) return o;
  return nullptr;
}

void Transport::write(int peer, const MsgHeader& h, const void* data, OpState& op,
                      std::function<void()> done) {
  Peer& p = *peers_[peer];
  ++op.pending;
  p.writes.push_back({h, data, shared(op), std::move(done)});
  if (!p.writing) start_write(p);
}

void Transport::read(int peer, const MsgHeader& h, void* data, OpState& op, SegmentFn on_segment,
                     std::function<void()> done) {
  Peer& p = *peers_[peer];
  ++op.pending;
  {
    std::lock_guard<std::mutex> lock(op.mu);
    op.awaiting.insert(peer);
  }
  p.reads.push_back({h, data, shared(op), std::move(on_segment), std::move(done)});
  if (!p.reading) start_read(p);
}

void Transport::start_write(Peer& p) {
  if (aborted_ || p.writes.empty()) {
    p.writing = false;
    return;
  }
  p.writing = true;
  WriteReq& w = p.writes.front();
  p.out_hdr = w.hdr;
  std::array<asio::const_buffer, 2> bufs = {asio::buffer(&p.out_hdr, sizeof(MsgHeader)),
                                            asio::buffer(w.data, w.hdr.nbytes)};
  asio::async_write(p.sock, bufs, [this, &p](boost::system::error_code ec, size_t) {
    if (aborted_) return;
    if (ec) return io_failed(p, ec, "sending to");
    WriteReq req = std::move(p.writes.front());
    p.writes.pop_front();
    if (req.done) req.done();
    io_done(*req.op);
    start_write(p);
  });
}

void Transport::start_read(Peer& p) {
  if (aborted_ || p.reads.empty()) {
    p.reading = false;
    return;
  }
  p.reading = true;
  asio::async_read(
      p.sock, asio::buffer(&p.in_hdr, sizeof(MsgHeader)),
      [this, &p](boost::system::error_code ec, size_t) {
        if (aborted_) return;
        if (ec) return io_failed(p, ec, "receiving from");
        ReadReq& r = p.reads.front();
        const MsgHeader& got = p.in_hdr;
        const MsgHeader& want = r.expect;
        if (got.magic != kMsgMagic) {
          return abort("garbage on the connection from rank " + std::to_string(p.rank) +
                       " (bad message magic)");
        }
        if (got.group != want.group || got.seq != want.seq || got.kind != want.kind ||
            got.step != want.step || got.nbytes != want.nbytes) {
          return abort("ranks disagree on the sequence of collectives: rank " +
                       std::to_string(p.rank) + " sent " + describe_header(got) + " but rank " +
                       std::to_string(rank_) + " expected " + describe_header(want) +
                       "; every rank must issue the same collectives in the same order with "
                       "the same sizes and dtypes");
        }
        r.received = 0;
        read_payload(p);
      });
}

void Transport::read_payload(Peer& p) {
  ReadReq& r = p.reads.front();
  size_t total = r.expect.nbytes;
  if (r.received == total) {
    ReadReq req = std::move(p.reads.front());
    p.reads.pop_front();
    {
      std::lock_guard<std::mutex> lock(req.op->mu);
      auto it = req.op->awaiting.find(p.rank);
      if (it != req.op->awaiting.end()) req.op->awaiting.erase(it);
    }
    if (req.done) req.done();
    io_done(*req.op);
    return start_read(p);
  }
  size_t len = std::min(options_.segment_bytes, total - r.received);
  // With a segment callback, `data` is a one-segment staging buffer that each segment reuses.
  char* dst = static_cast<char*>(r.data) + (r.on_segment ? 0 : r.received);
  asio::async_read(p.sock, asio::buffer(dst, len),
                   [this, &p, len](boost::system::error_code ec, size_t) {
                     if (aborted_) return;
                     if (ec) return io_failed(p, ec, "receiving from");
                     ReadReq& rr = p.reads.front();
                     if (rr.on_segment)
                       rr.on_segment(static_cast<const char*>(rr.data), rr.received, len);
                     rr.received += len;
                     read_payload(p);
                   });
}

char* Transport::scratch(size_t slot, size_t bytes) {
  if (slot >= scratch_.size()) scratch_.resize(slot + 1);
  auto& s = scratch_[slot];
  if (s.second < bytes) {
    s.first.reset(new char[bytes]);
    s.second = bytes;
  }
  return s.first.get();
}

void Transport::io_done(OpState& op) {
  // A point-to-point operation is complete as soon as its one transfer is, even while the engine
  // is busy with a collective.
  if (--op.pending == 0 && op.p2p) complete(op, "");
}

void Transport::io_failed(Peer& p, const boost::system::error_code& ec, const char* what) {
  if (ec == asio::error::eof || ec == asio::error::connection_reset ||
      ec == asio::error::broken_pipe)
    abort("rank " + std::to_string(p.rank) + " closed its connection (it exited or crashed)");
  else
    abort(std::string(what) + " rank " + std::to_string(p.rank) + " failed: " + ec.message());
}

void Transport::abort(const std::string& reason) {
  if (aborted_) return;
  aborted_ = true;
  abort_reason_ = reason;
  // Record the first failure of the job so later failures can point at the root cause. The
  // store is served by rank 0, so when it is gone too that points at rank 0.
  int64_t n = 0;
  try {
    n = diag_store_->add(prefix_ + "/failures", 1);
  } catch (const std::exception&) {
    if (rank_ != 0)
      abort_reason_ +=
          " [the rendezvous store served by rank 0 is unreachable too: rank 0 exited or crashed]";
  }
  try {
    std::string mine = "rank " + std::to_string(rank_) + ": " + reason;
    if (n == 1) {
      diag_store_->set(prefix_ + "/failure/1", mine);
    } else if (n > 1) {
      std::string first = diag_store_->get(prefix_ + "/failure/1", Millis(2000));
      if (first != mine) abort_reason_ += " [first failure in the job: " + first + "]";
    }
  } catch (const std::exception&) {
  }
  boost::system::error_code ec;
  for (auto& p : peers_)
    if (p) p->sock.close(ec);
}

void Transport::fail(const std::string& reason) {
  abort(reason);
  throw DistributedError(abort_reason_);
}

void Transport::complete(OpState& op, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(op.mu);
    op.done = true;
    op.error = error;
    op.awaiting.clear();
  }
  op.cv.notify_all();
}

std::string Transport::diagnose_timeout(OpState& op) {
  std::vector<int> awaiting;
  {
    std::lock_guard<std::mutex> lock(op.mu);
    awaiting.assign(op.awaiting.begin(), op.awaiting.end());
  }
  awaiting.erase(std::unique(awaiting.begin(), awaiting.end()), awaiting.end());
  std::string msg = op.desc + " timed out after " + describe_duration(options_.timeout);
  if (op.p2p) return msg + ": " + describe_ranks(awaiting) + " did not send the matching message";
  // Which members ever got as far as this operation? Ranks report once blocked a while.
  std::vector<int> absent;
  try {
    for (int m : op.members) {
      if (m == rank_) continue;
      auto v = diag_store_->try_get(prefix_ + "/at/" + std::to_string(op.group) + "/" +
                                    std::to_string(m));
      if (!v || std::stoull(*v) < op.seq) absent.push_back(m);
    }
  } catch (const std::exception& e) {
    return msg + ": waiting for " + describe_ranks(awaiting) +
           " (could not ask the store which ranks joined: " + e.what() + ")";
  }
  if (!absent.empty())
    return msg + ": " + describe_ranks(absent) +
           " never joined it (stalled, busy elsewhere, or issuing different collectives)";
  return msg + ": every rank joined it; waiting for data from " + describe_ranks(awaiting);
}

void Transport::report_progress(OpState& op) {
  op.reported = true;
  try {
    diag_store_->set(prefix_ + "/at/" + std::to_string(op.group) + "/" + std::to_string(rank_),
                     std::to_string(op.seq));
  } catch (const std::exception&) {
  }
}

void Transport::check_p2p_deadlines() {
  auto now = Clock::now();
  for (auto& op : inflight_p2p_)
    if (!aborted_ && now >= op->deadline) abort(diagnose_timeout(*op));
}

void Transport::finish_io(OpState& op) {
  while (op.pending > 0) {
    if (aborted_) throw DistributedError(abort_reason_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) throw DistributedError("the process group was destroyed");
    }
    auto now = Clock::now();
    if (now >= op.deadline) {
      abort(diagnose_timeout(op));
      throw DistributedError(abort_reason_);
    }
    check_p2p_deadlines();
    if (!op.reported && now >= op.report_at) report_progress(op);
    auto until = op.deadline;
    if (!op.reported) until = std::min(until, op.report_at);
    for (auto& p : inflight_p2p_) until = std::min(until, p->deadline);
    ioc_.run_one_until(until);
  }
}

void Transport::execute(const std::shared_ptr<OpState>& op) {
  if (aborted_) {
    complete(*op, op->desc + " failed: the process group was aborted by an earlier failure: " +
                      abort_reason_);
    return;
  }
  op->deadline = Clock::now() + options_.timeout;
  op->report_at = Clock::now() + report_after_;
  current_ = op.get();
  current_shared_ = op;
  std::string error;
  try {
    op->run(*op);
  } catch (const std::exception& e) {
    error = op->desc + " failed: " + e.what();
  }
  current_ = nullptr;
  current_shared_.reset();
  if (op->p2p && error.empty()) {
    if (op->pending > 0) inflight_p2p_.push_back(op);  // io_done completes it
    return;
  }
  complete(*op, error);
}

void Transport::engine_main() {
  while (true) {
    std::shared_ptr<OpState> op;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) break;
      if (!queue_.empty()) {
        op = std::move(queue_.front());
        queue_.pop_front();
      }
    }
    if (op) {
      execute(op);
    } else {
      check_p2p_deadlines();
      auto until = Clock::now() + std::chrono::seconds(1);
      for (auto& p : inflight_p2p_) until = std::min(until, p->deadline);
      ioc_.run_one_until(until);
    }
    // Forget finished point-to-point operations; fail them all after an abort.
    for (auto it = inflight_p2p_.begin(); it != inflight_p2p_.end();) {
      if ((*it)->pending == 0 || aborted_) {
        if ((*it)->pending > 0) complete(**it, (*it)->desc + " failed: " + abort_reason_);
        it = inflight_p2p_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Shutting down: fail what is left.
  std::deque<std::shared_ptr<OpState>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(queue_);
  }
  for (auto& op : inflight_p2p_) left.push_back(op);
  inflight_p2p_.clear();
  for (auto& op : left) complete(*op, op->desc + " failed: the process group was destroyed");
}

// ---- the process group -------------------------------------------------------------------------

uint32_t group_hash(uint32_t parent, const std::string& key) {
  uint64_t h = 0xcbf29ce484222325ull ^ parent;
  for (unsigned char c : key) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  uint32_t g = static_cast<uint32_t>(h ^ (h >> 32));
  return g == 0 ? 1 : g;
}

class CpuProcessGroup : public ProcessGroup {
 public:
  CpuProcessGroup(std::shared_ptr<Transport> tp, uint32_t group, int rank,
                  std::vector<int> world_ranks, ProcessGroupOptions options)
      : ProcessGroup(rank, static_cast<int>(world_ranks.size()), world_ranks, options),
        tp_(std::move(tp)),
        group_(group),
        send_seq_(world_ranks.size(), 0),
        recv_seq_(world_ranks.size(), 0) {}

  std::string backend() const override { return "cpu"; }

  WorkPtr all_reduce(const Tensor& t, ReduceOp op) override;
  WorkPtr reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override;
  WorkPtr all_gather(const Tensor& out, const Tensor& in) override;
  WorkPtr broadcast(const Tensor& t, int root) override;
  WorkPtr barrier() override;
  WorkPtr all_to_all(const Tensor& out, const Tensor& in, const std::vector<int64_t>& out_splits,
                     const std::vector<int64_t>& in_splits) override;
  WorkPtr send(const Tensor& t, int dst) override;
  WorkPtr recv(const Tensor& t, int src) override;
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks) override;

 private:
  struct Ctx;
  // Builds the operation, counts it and queues it; `run` executes on the engine thread.
  WorkPtr issue(CommKind kind, int64_t bytes, int64_t wire_bytes, const std::string& detail,
                std::function<void(OpState&, const Ctx&)> run, int p2p_peer = -1);

  std::shared_ptr<Transport> tp_;
  uint32_t group_;
  std::mutex mu_;
  uint64_t seq_ = 0;
  std::vector<uint64_t> send_seq_, recv_seq_;
  std::map<std::string, int> made_;  // new_group calls per rank list
};

// What an algorithm needs to know about its group (captured by value at issue time).
struct CpuProcessGroup::Ctx {
  Transport* tp;
  std::vector<int> wr;  // world ranks
  int r, n;
  size_t threshold;
  size_t segment;
  int world(int group_rank) const { return wr[mod(group_rank, n)]; }
};

namespace algo {

MsgHeader header(const OpState& op, uint32_t step, size_t nbytes) {
  MsgHeader h;
  h.group = op.group;
  h.seq = op.seq;
  h.kind = static_cast<uint32_t>(op.kind);
  h.step = step;
  h.nbytes = nbytes;
  return h;
}

}  // namespace algo

WorkPtr CpuProcessGroup::issue(CommKind kind, int64_t bytes, int64_t wire_bytes,
                               const std::string& detail,
                               std::function<void(OpState&, const Ctx&)> run, int p2p_peer) {
  auto op = std::make_shared<OpState>();
  op->group = group_;
  op->kind = kind;
  op->members = world_ranks_;
  op->p2p = p2p_peer >= 0;
  Ctx ctx{tp_.get(),
          world_ranks_,
          rank_,
          size_,
          options_.ring_threshold_bytes,
          tp_->options().segment_bytes};
  std::lock_guard<std::mutex> lock(mu_);
  if (kind == CommKind::Send)
    op->seq = send_seq_[p2p_peer]++;
  else if (kind == CommKind::Recv)
    op->seq = recv_seq_[p2p_peer]++;
  else
    op->seq = seq_++;
  op->desc = std::string(comm_kind_name(kind)) + " #" + std::to_string(op->seq) + " (" + detail +
             (size_ > 1 ? ", group of " + std::to_string(size_) + " ranks" : "") + ")";
  op->run = [run = std::move(run), ctx](OpState& o) { run(o, ctx); };
  count(kind, bytes, wire_bytes);
  tp_->enqueue(op);
  return std::make_shared<CpuWork>(op);
}

// Chunk c of n: [offset, offset + count) elements, the first numel % n chunks one larger.
struct Chunks {
  int64_t base, rem;
  size_t esize;
  Chunks(int64_t numel, int n, size_t es) : base(numel / n), rem(numel % n), esize(es) {}
  int64_t count(int c) const { return base + (c < rem ? 1 : 0); }
  int64_t offset(int c) const { return c * base + std::min<int64_t>(c, rem); }
  size_t bytes(int c) const { return static_cast<size_t>(count(c)) * esize; }
  size_t byte_offset(int c) const { return static_cast<size_t>(offset(c)) * esize; }
};

// Segment sizes must hold whole elements.
size_t segment_for(size_t segment, size_t esize) {
  return std::max(esize, segment / esize * esize);
}

WorkPtr CpuProcessGroup::all_reduce(const Tensor& t, ReduceOp rop) {
  check_tensor(t, "all_reduce");
  check_reducible(t, rop, "all_reduce");
  const int n = size_, r = rank_;
  const size_t S = t.nbytes();
  const bool ring = S >= options_.ring_threshold_bytes && n > 1;
  Chunks ch(t.numel(), n, t.element_size());
  int64_t wire =
      n == 1 ? 0
      : ring ? static_cast<int64_t>(2 * S - ch.bytes(mod(r + 1, n)) - ch.bytes(mod(r + 2, n)))
             : static_cast<int64_t>((n - 1) * S);
  std::string detail = std::string(dtype_name(t.dtype())) + " " + reduce_op_name(rop) + ", " +
                       format_bytes(static_cast<int64_t>(S));
  return issue(CommKind::AllReduce, S, wire, detail, [t, rop, ring, ch](OpState& op, const Ctx& c) {
    const int n = c.n, r = c.r;
    if (n == 1 || t.numel() == 0) return;
    char* base = static_cast<char*>(t.data_ptr());
    const size_t S = t.nbytes();
    const DType d = t.dtype();
    const size_t es = t.element_size();
    if (!ring) {
      std::vector<const void*> srcs(n);
      for (int p = 0; p < n; ++p) {
        if (p == r) {
          srcs[p] = base;
          continue;
        }
        char* buf = c.tp->scratch(1 + p, S);
        srcs[p] = buf;
        c.tp->write(c.world(p), algo::header(op, 0, S), base, op);
        c.tp->read(c.world(p), algo::header(op, 0, S), buf, op);
      }
      c.tp->finish_io(op);
      reduce_many(d, base, srcs, t.numel(), rop);
      return;
    }
    const int left = c.world(r - 1), right = c.world(r + 1);
    char* stage = c.tp->staging();
    for (int s = 0; s < n - 1; ++s) {  // reduce-scatter: rank r ends with chunk r+1
      int si = mod(r - s, n), ri = mod(r - s - 1, n);
      bool last = s == n - 2;
      int divisor = last && rop == ReduceOp::Avg ? n : 0;
      char* dst = base + ch.byte_offset(ri);
      c.tp->write(right, algo::header(op, s, ch.bytes(si)), base + ch.byte_offset(si), op);
      c.tp->read(left, algo::header(op, s, ch.bytes(ri)), stage, op,
                 [&, dst, divisor](const char* seg, size_t off, size_t len) {
                   reduce_pair(d, dst + off, dst + off, seg, static_cast<int64_t>(len / es), rop,
                               divisor);
                 });
      c.tp->finish_io(op);
    }
    for (int s = 0; s < n - 1; ++s) {  // all-gather of the reduced chunks
      int si = mod(r + 1 - s, n), ri = mod(r - s, n);
      c.tp->write(right, algo::header(op, n + s, ch.bytes(si)), base + ch.byte_offset(si), op);
      c.tp->read(left, algo::header(op, n + s, ch.bytes(ri)), base + ch.byte_offset(ri), op);
      c.tp->finish_io(op);
    }
  });
}

WorkPtr CpuProcessGroup::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp rop) {
  check_tensor(out, "reduce_scatter");
  check_tensor(in, "reduce_scatter");
  check_reducible(in, rop, "reduce_scatter");
  if (out.dtype() != in.dtype() || in.numel() != out.numel() * size_)
    throw std::invalid_argument("[cpu reduce_scatter] input " + in.str() +
                                " must have the output's dtype and " + std::to_string(size_) +
                                " (group size) times its " + std::to_string(out.numel()) +
                                " elements; output " + out.str());
  const int n = size_;
  const size_t cb = out.nbytes();
  const bool ring = in.nbytes() >= options_.ring_threshold_bytes && n > 1;
  std::string detail = std::string(dtype_name(in.dtype())) + " " + reduce_op_name(rop) + ", " +
                       format_bytes(static_cast<int64_t>(in.nbytes()));
  return issue(CommKind::ReduceScatter, static_cast<int64_t>(in.nbytes()),
               static_cast<int64_t>((n - 1) * cb), detail,
               [out, in, rop, ring](OpState& op, const Ctx& c) {
                 const int n = c.n, r = c.r;
                 const size_t cb = out.nbytes(), es = out.element_size();
                 const int64_t cn = out.numel();
                 const DType d = out.dtype();
                 char* o = static_cast<char*>(out.data_ptr());
                 const char* x = static_cast<const char*>(in.data_ptr());
                 if (n == 1) {
                   if (o != x) std::memmove(o, x, cb);
                   return;
                 }
                 if (cn == 0) return;
                 if (!ring) {
                   std::vector<const void*> srcs(n);
                   for (int p = 0; p < n; ++p) {
                     if (p == r) {
                       srcs[p] = x + r * cb;
                       continue;
                     }
                     char* buf = c.tp->scratch(1 + p, cb);
                     srcs[p] = buf;
                     c.tp->write(c.world(p), algo::header(op, 0, cb), x + p * cb, op);
                     c.tp->read(c.world(p), algo::header(op, 0, cb), buf, op);
                   }
                   c.tp->finish_io(op);
                   reduce_many(d, o, srcs, cn, rop);
                   return;
                 }
                 const int left = c.world(r - 1), right = c.world(r + 1);
                 // Partial sums travel from acc[s % 2]; the next one is built in the other.
                 char* stage = c.tp->staging();
                 std::unique_ptr<char[]> acc[2];
                 if (n > 2) {
                   acc[0].reset(new char[cb]);
                   acc[1].reset(new char[cb]);
                 }
                 for (int s = 0; s < n - 1; ++s) {
                   int si = mod(r - s - 1, n), ri = mod(r - s - 2, n);
                   bool last = s == n - 2;
                   int divisor = last && rop == ReduceOp::Avg ? n : 0;
                   const char* src = s == 0 ? x + si * cb : acc[s % 2].get();
                   char* dst = last ? o : acc[(s + 1) % 2].get();
                   const char* mine = x + ri * cb;
                   c.tp->write(right, algo::header(op, s, cb), src, op);
                   c.tp->read(left, algo::header(op, s, cb), stage, op,
                              [&, dst, mine, divisor](const char* seg, size_t off, size_t len) {
                                reduce_pair(d, dst + off, mine + off, seg,
                                            static_cast<int64_t>(len / es), rop, divisor);
                              });
                   c.tp->finish_io(op);
                 }
               });
}

WorkPtr CpuProcessGroup::all_gather(const Tensor& out, const Tensor& in) {
  check_tensor(out, "all_gather");
  check_tensor(in, "all_gather");
  if (out.dtype() != in.dtype() || out.numel() != in.numel() * size_)
    throw std::invalid_argument("[cpu all_gather] output " + out.str() +
                                " must have the input's dtype and " + std::to_string(size_) +
                                " (group size) times its " + std::to_string(in.numel()) +
                                " elements; input " + in.str());
  const int n = size_;
  const size_t cb = in.nbytes();
  const bool ring = out.nbytes() >= options_.ring_threshold_bytes && n > 1;
  std::string detail =
      std::string(dtype_name(in.dtype())) + ", " + format_bytes(static_cast<int64_t>(out.nbytes()));
  return issue(CommKind::AllGather, static_cast<int64_t>(out.nbytes()),
               static_cast<int64_t>((n - 1) * cb), detail,
               [out, in, ring](OpState& op, const Ctx& c) {
                 const int n = c.n, r = c.r;
                 const size_t cb = in.nbytes();
                 char* o = static_cast<char*>(out.data_ptr());
                 const char* x = static_cast<const char*>(in.data_ptr());
                 if (o + r * cb != x && cb) std::memmove(o + r * cb, x, cb);
                 if (n == 1 || cb == 0) return;
                 if (!ring) {
                   for (int p = 0; p < n; ++p) {
                     if (p == r) continue;
                     c.tp->write(c.world(p), algo::header(op, 0, cb), o + r * cb, op);
                     c.tp->read(c.world(p), algo::header(op, 0, cb), o + p * cb, op);
                   }
                   c.tp->finish_io(op);
                   return;
                 }
                 const int left = c.world(r - 1), right = c.world(r + 1);
                 for (int s = 0; s < n - 1; ++s) {
                   int si = mod(r - s, n), ri = mod(r - s - 1, n);
                   c.tp->write(right, algo::header(op, s, cb), o + si * cb, op);
                   c.tp->read(left, algo::header(op, s, cb), o + ri * cb, op);
                   c.tp->finish_io(op);
                 }
               });
}

WorkPtr CpuProcessGroup::broadcast(const Tensor& t, int root) {
  check_tensor(t, "broadcast");
  if (root < 0 || root >= size_)
    throw std::invalid_argument("[cpu broadcast] root " + std::to_string(root) +
                                " is not in this group of " + std::to_string(size_) + " ranks");
  const int n = size_, r = rank_;
  const size_t S = t.nbytes();
  const bool chain = S >= options_.ring_threshold_bytes && n > 1;
  int64_t wire = 0;
  if (n > 1) {
    if (!chain)
      wire = r == root ? static_cast<int64_t>((n - 1) * S) : 0;
    else
      wire = mod(r - root, n) < n - 1 ? static_cast<int64_t>(S) : 0;
  }
  std::string detail = "root " + std::to_string(root) + ", " + dtype_name(t.dtype()) + ", " +
                       format_bytes(static_cast<int64_t>(S));
  return issue(CommKind::Broadcast, S, wire, detail, [t, root, chain](OpState& op, const Ctx& c) {
    const int n = c.n, r = c.r;
    const size_t S = t.nbytes();
    char* base = static_cast<char*>(t.data_ptr());
    if (n == 1 || S == 0) return;
    if (!chain) {
      if (r == root) {
        for (int p = 0; p < n; ++p)
          if (p != r) c.tp->write(c.world(p), algo::header(op, 0, S), base, op);
      } else {
        c.tp->read(c.world(root), algo::header(op, 0, S), base, op);
      }
      c.tp->finish_io(op);
      return;
    }
    // Pipelined chain root -> root+1 -> ...: each segment is forwarded as soon as it arrives.
    const int pos = mod(r - root, n);
    const bool has_next = pos < n - 1;
    const int next = c.world(r + 1), prev = c.world(r - 1);
    const size_t seg = segment_for(c.segment, t.element_size());
    uint32_t k = 0;
    for (size_t off = 0; off < S; off += seg, ++k) {
      size_t len = std::min(seg, S - off);
      if (pos == 0) {
        c.tp->write(next, algo::header(op, k, len), base + off, op);
      } else {
        Transport* tp = c.tp;
        OpState* o = &op;
        c.tp->read(prev, algo::header(op, k, len), base + off, op, {},
                   [tp, o, has_next, next, k, len, base, off] {
                     if (has_next) tp->write(next, algo::header(*o, k, len), base + off, *o);
                   });
      }
    }
    c.tp->finish_io(op);
  });
}

WorkPtr CpuProcessGroup::barrier() {
  return issue(CommKind::Barrier, 0, 0, "", [](OpState& op, const Ctx& c) {
    const int n = c.n, r = c.r;
    uint32_t step = 0;
    for (int k = 1; k < n; k <<= 1, ++step) {  // dissemination: log2(n) rounds
      c.tp->write(c.world(r + k), algo::header(op, step, 0), nullptr, op);
      c.tp->read(c.world(r - k), algo::header(op, step, 0), nullptr, op);
      c.tp->finish_io(op);
    }
  });
}

// Pairwise over the mesh: every pair first trades (row count, row bytes) and checks them against
// what it expects, then the rows go straight into place (no staging); empty transfers are skipped
// once both sides agreed on zero.
WorkPtr CpuProcessGroup::all_to_all(const Tensor& out, const Tensor& in,
                                    const std::vector<int64_t>& out_splits,
                                    const std::vector<int64_t>& in_splits) {
  const int64_t row = check_all_to_all(out, in, out_splits, in_splits);
  const int n = size_, r = rank_;
  int64_t wire = 0;
  for (int p = 0; p < n; ++p)
    if (p != r) wire += in_splits[p] * row;
  std::string detail = std::string(dtype_name(in.dtype())) + ", " + std::to_string(in.shape()[0]) +
                       " rows out, " + std::to_string(out.shape()[0]) + " in, " +
                       format_bytes(static_cast<int64_t>(in.nbytes()));
  return issue(
      CommKind::AllToAll, static_cast<int64_t>(in.nbytes()), wire, detail,
      [out, in, out_splits, in_splits, row](OpState& op, const Ctx& c) {
        const int n = c.n, r = c.r;
        char* o = static_cast<char*>(out.data_ptr());
        const char* x = static_cast<const char*>(in.data_ptr());
        std::vector<int64_t> in_at(n + 1, 0), out_at(n + 1, 0);  // byte offsets by rank
        for (int p = 0; p < n; ++p) {
          in_at[p + 1] = in_at[p] + in_splits[p] * row;
          out_at[p + 1] = out_at[p] + out_splits[p] * row;
        }
        if (in_splits[r] * row > 0) std::memcpy(o + out_at[r], x + in_at[r], in_splits[r] * row);
        if (n == 1) return;
        std::vector<std::array<int64_t, 2>> mine(n), theirs(n);
        for (int p = 0; p < n; ++p) {
          if (p == r) continue;
          mine[p] = {in_splits[p], row};
          c.tp->write(c.world(p), algo::header(op, 0, sizeof mine[p]), mine[p].data(), op);
          c.tp->read(c.world(p), algo::header(op, 0, sizeof theirs[p]), theirs[p].data(), op);
        }
        c.tp->finish_io(op);
        auto who = [&](int p) {
          return "rank " + std::to_string(p) +
                 (c.world(p) != p ? " (world rank " + std::to_string(c.world(p)) + ")" : "");
        };
        for (int p = 0; p < n; ++p) {
          if (p == r) continue;
          if (theirs[p][1] != row)
            c.tp->fail("all_to_all #" + std::to_string(op.seq) + ": " + who(p) + " sends rows of " +
                       std::to_string(theirs[p][1]) + " bytes but " + who(r) +
                       " receives rows of " + std::to_string(row) +
                       " bytes; every rank must pass the same dtype and shape past dim 0");
          if (theirs[p][0] != out_splits[p])
            c.tp->fail("all_to_all #" + std::to_string(op.seq) + ": " + who(p) + " sends " +
                       std::to_string(theirs[p][0]) + " rows to " + who(r) + ", which expects " +
                       std::to_string(out_splits[p]) + " (its out_splits[" + std::to_string(p) +
                       "]); rank q's in_splits[p] must equal rank p's out_splits[q] (exchange the "
                       "counts first)");
        }
        for (int p = 0; p < n; ++p) {
          if (p == r) continue;
          const size_t sb = static_cast<size_t>(in_splits[p] * row);
          const size_t rb = static_cast<size_t>(out_splits[p] * row);
          if (sb) c.tp->write(c.world(p), algo::header(op, 1, sb), x + in_at[p], op);
          if (rb) c.tp->read(c.world(p), algo::header(op, 1, rb), o + out_at[p], op);
        }
        c.tp->finish_io(op);
      });
}

WorkPtr CpuProcessGroup::send(const Tensor& t, int dst) {
  check_tensor(t, "send");
  check_peer(dst, "send");
  const size_t S = t.nbytes();
  std::string detail = "to rank " + std::to_string(world_ranks_[dst]) + ", " +
                       dtype_name(t.dtype()) + ", " + format_bytes(static_cast<int64_t>(S));
  return issue(
      CommKind::Send, S, S, detail,
      [t, dst](OpState& op, const Ctx& c) {
        c.tp->write(c.world(dst), algo::header(op, 0, t.nbytes()), t.data_ptr(), op);
      },
      dst);
}

WorkPtr CpuProcessGroup::recv(const Tensor& t, int src) {
  check_tensor(t, "recv");
  check_peer(src, "recv");
  const size_t S = t.nbytes();
  std::string detail = "from rank " + std::to_string(world_ranks_[src]) + ", " +
                       dtype_name(t.dtype()) + ", " + format_bytes(static_cast<int64_t>(S));
  return issue(
      CommKind::Recv, S, 0, detail,
      [t, src](OpState& op, const Ctx& c) {
        MsgHeader h = algo::header(op, 0, t.nbytes());
        h.kind = static_cast<uint32_t>(CommKind::Send);  // matches the sender's header
        c.tp->read(c.world(src), h, t.data_ptr(), op);
      },
      src);
}

std::shared_ptr<ProcessGroup> CpuProcessGroup::new_group(const std::vector<int>& ranks) {
  std::set<int> seen;
  std::string key;
  int me = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    int g = ranks[i];
    if (g < 0 || g >= size_ || !seen.insert(g).second)
      throw std::invalid_argument("[cpu new_group] ranks must be distinct ranks of this group of " +
                                  std::to_string(size_) + ", got " + std::to_string(g));
    if (g == rank_) me = static_cast<int>(i);
    key += std::to_string(g) + ",";
  }
  if (ranks.empty()) throw std::invalid_argument("[cpu new_group] empty rank list");
  int k;
  {
    std::lock_guard<std::mutex> lock(mu_);
    k = made_[key]++;
  }
  if (me < 0) return nullptr;
  std::vector<int> wr;
  for (int g : ranks) wr.push_back(world_ranks_[g]);
  return std::make_shared<CpuProcessGroup>(tp_, group_hash(group_, key + "#" + std::to_string(k)),
                                           me, wr, options_);
}

int next_instance() {
  static std::atomic<int> n{0};
  return n++;
}

}  // namespace

std::shared_ptr<ProcessGroup> make_cpu_process_group(std::shared_ptr<TcpStore> store, int rank,
                                                     int size, ProcessGroupOptions options) {
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument("make_cpu_process_group: rank " + std::to_string(rank) +
                                " is not in a world of " + std::to_string(size));
  if (!store) throw std::invalid_argument("make_cpu_process_group: no store");
  std::string prefix = "cpu" + std::to_string(next_instance());
  auto tp = std::make_shared<Transport>(std::move(store), rank, size, options, prefix);
  std::vector<int> world(size);
  for (int i = 0; i < size; ++i) world[i] = i;
  return std::make_shared<CpuProcessGroup>(tp, group_hash(0, prefix), rank, world, options);
}

}  // namespace accel
