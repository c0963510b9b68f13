// Rendezvous key-value store: rank 0 serves it over TCP (Boost.Asio); every rank, rank 0 included,
// talks to it as a client. Ranks exchange addresses and the NCCL unique id through it and meet at
// barriers. See docs/launch.md.
//
// Security model (trusted network, no encryption): the server binds to the configured address only;
// every connection must present the per-job token in its first frame or it is closed; frames are
// length-prefixed and bounded; a malformed frame closes that one connection and nothing else.
// Before the handshake a connection may send only a small hello frame, and only a bounded number
// of such connections is kept (the oldest is dropped for a new one), so a flood of strangers costs
// rank 0 a fixed amount of memory and descriptors; clients retry a handshake that was cut off.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace accel {

using Millis = std::chrono::milliseconds;

// Thrown when a store call or a collective does not complete in time, or a peer went away. The
// message names the rank(s) that did not answer.
class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The longest timeout the store and the process groups accept (30 days): their deadlines are
// steady_clock time points, which overflow some centuries out. The shortest a user may configure
// (distributed.timeout_s, ACCEL_*_TIMEOUT) is kMinUserTimeout; tests use shorter ones directly.
constexpr Millis kMaxTimeout{30LL * 24 * 3600 * 1000};
constexpr Millis kMinUserTimeout{100};
// Throws std::invalid_argument naming `what` unless 0 < t <= kMaxTimeout.
void check_timeout(Millis t, const std::string& what);

// "rank 2" / "ranks 2, 5"; "1.5 s", "20 ms". Shared by the messages of the store and the process
// groups.
std::string describe_ranks(const std::vector<int>& ranks);
std::string describe_duration(Millis d);

// Longest job token accepted (the hello frame is bounded by it). Shared with the process group's
// peer handshake.
constexpr size_t kMaxJobTokenBytes = 4096;

struct StoreOptions {
  std::string host = "127.0.0.1";       // the server binds here; clients connect here
  int port = 29500;                     // 0 on the server picks a free port (see TcpStore::port())
  bool is_server = false;               // true on rank 0
  std::string token;                    // per-job token; must be the same on every rank
  Millis timeout{300000};               // connecting, and the default for get/wait/barrier
  uint32_t max_frame_bytes = 4u << 20;  // largest request/response frame either side accepts
  Millis handshake_timeout{
      10000};  // server: a connection that has not authenticated by then closes
  // Server: connections that have not authenticated yet, at most; a new one drops the oldest.
  int max_pending_connections = 64;
  // Server: a listening socket to serve on instead of binding host:port (the local launcher binds
  // it before starting the ranks, so the port cannot be taken in between); -1 for none.
  int listen_fd = -1;
};

// A synchronous client (thread-safe: calls are serialized) plus, when is_server, the server
// running on its own thread inside this process.
class TcpStore {
 public:
  explicit TcpStore(StoreOptions options);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::string& value);
  // Waits for the key (up to `timeout`, default the store's) and returns its value.
  std::string get(const std::string& key, std::optional<Millis> timeout = std::nullopt);
  // The value now, or nothing; never waits.
  std::optional<std::string> try_get(const std::string& key);
  // Atomically adds `delta` to the integer stored at key (missing = 0) and returns the new value.
  int64_t add(const std::string& key, int64_t delta);
  // True when every key exists now.
  bool check(const std::vector<std::string>& keys);
  // Waits until every key exists; throws DistributedError naming the missing keys on timeout.
  void wait(const std::vector<std::string>& keys, std::optional<Millis> timeout = std::nullopt);
  // Deletes the key; returns whether it existed.
  bool remove(const std::string& key);
  // All `world` ranks call barrier(name, their rank, world); returns when all have arrived. A name
  // may be used once per job. On timeout the message lists the ranks that did not arrive.
  void barrier(const std::string& name, int rank, int world,
               std::optional<Millis> timeout = std::nullopt);

  // A second, independent connection to the same server (for another thread that must not queue
  // behind long waits on this one), optionally with another default timeout.
  std::unique_ptr<TcpStore> connect_again(std::optional<Millis> timeout = std::nullopt) const;

  int port() const { return port_; }  // the real port, also when 0 was asked for
  const std::string& host() const { return options_.host; }
  Millis timeout() const { return options_.timeout; }
  const std::string& token() const { return options_.token; }
  // The local address of this client's connection: the interface that reaches rank 0.
  std::string local_address() const;

 private:
  struct Server;
  struct Client;
  StoreOptions options_;
  int port_ = 0;
  std::unique_ptr<Server> server_;
  std::unique_ptr<Client> client_;
};

}  // namespace accel
