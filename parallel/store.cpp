// TCP key-value store. Wire format: every frame is a 4-byte little-endian length and that many
// bytes. The first client frame is the hello ("ACCELKV1" + token, at most kMaxHelloBytes); the
// server answers one status byte (+ message) and closes the connection on a wrong token. After
// that each request is [op u8][fields] and each response [status u8][fields]; strings are
// [u32 length][bytes].
#include "parallel/store.h"

#include <sys/socket.h>

#include <algorithm>
#include <boost/asio.hpp>
#include <cmath>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace accel {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

std::string describe_ranks(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

std::string describe_duration(Millis d) {
  if (d < Millis(100)) return std::to_string(d.count()) + " ms";
  std::ostringstream os;
  double s = static_cast<double>(d.count()) / 1000.0;
  os << (s < 10 ? std::round(s * 10) / 10 : std::round(s)) << " s";
  return os.str();
}

void check_timeout(Millis t, const std::string& what) {
  if (t.count() <= 0 || t > kMaxTimeout)
    throw std::invalid_argument(what + " of " + std::to_string(t.count()) +
                                " ms is out of range: it must be above 0 and at most " +
                                describe_duration(kMaxTimeout) + " (30 days)");
}

namespace {

constexpr char kHello[8] = {'A', 'C', 'C', 'E', 'L', 'K', 'V', '1'};
// The only frame a connection may send before it has authenticated.
constexpr uint32_t kMaxHelloBytes = sizeof(kHello) + kMaxJobTokenBytes;

enum class Op : uint8_t { Set = 1, Get = 2, Add = 3, Check = 4, Wait = 5, Delete = 6 };

struct ProtocolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Little-endian encoding of the frame fields.
struct Writer {
  std::vector<char> buf;
  Writer() { buf.resize(4); }  // room for the frame length
  void u8(uint8_t v) { buf.push_back(static_cast<char>(v)); }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) buf.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) buf.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void str(const std::string& s) {
    u32(static_cast<uint32_t>(s.size()));
    buf.insert(buf.end(), s.begin(), s.end());
  }
  void raw(const char* p, size_t n) { buf.insert(buf.end(), p, p + n); }
  // Fills in the length prefix and returns the finished frame.
  std::vector<char>& frame() {
    uint32_t n = static_cast<uint32_t>(buf.size() - 4);
    for (int i = 0; i < 4; ++i) buf[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return buf;
  }
};

uint32_t decode_u32(const unsigned char* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

struct Reader {
  const char* p;
  size_t n;
  size_t pos = 0;
  Reader(const std::vector<char>& b) : p(b.data()), n(b.size()) {}
  void need(size_t k) {
    if (n - pos < k) throw ProtocolError("frame too short");
  }
  uint8_t u8() {
    need(1);
    return static_cast<uint8_t>(p[pos++]);
  }
  uint32_t u32() {
    need(4);
    uint32_t v = decode_u32(reinterpret_cast<const unsigned char*>(p + pos));
    pos += 4;
    return v;
  }
  uint64_t u64() {
    need(8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t(static_cast<unsigned char>(p[pos + i])) << (8 * i);
    pos += 8;
    return v;
  }
  std::string str() {
    uint32_t len = u32();
    need(len);
    std::string s(p + pos, len);
    pos += len;
    return s;
  }
  std::string rest() {
    std::string s(p + pos, n - pos);
    pos = n;
    return s;
  }
  void end() {
    if (pos != n) throw ProtocolError("trailing bytes in frame");
  }
};

bool constant_time_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char d = 0;
  for (size_t i = 0; i < a.size(); ++i) d |= static_cast<unsigned char>(a[i] ^ b[i]);
  return d == 0;
}

std::string where(const std::string& host, int port) { return host + ":" + std::to_string(port); }

}  // namespace

// ---- server ------------------------------------------------------------------------------------

struct TcpStore::Server {
  struct Conn : std::enable_shared_from_this<Conn> {
    Server* server;
    tcp::socket sock;
    asio::steady_timer timer;
    bool authed = false;
    bool closed = false;
    unsigned char len_buf[4];
    std::vector<char> body;
    std::vector<char> out;
    std::vector<std::string> wait_keys;  // non-empty while a WAIT is pending
    Conn(Server* s, tcp::socket so) : server(s), sock(std::move(so)), timer(s->ioc) {}
  };

  StoreOptions opts;
  asio::io_context ioc;
  tcp::acceptor acceptor{ioc};
  asio::steady_timer accept_retry{ioc};
  std::thread thread;
  std::map<std::string, std::string> data;
  std::set<std::shared_ptr<Conn>> conns;
  std::list<std::shared_ptr<Conn>> pending;  // not authenticated yet, oldest first
  std::list<std::weak_ptr<Conn>> waiters;

  explicit Server(StoreOptions o) : opts(std::move(o)) {
    if (opts.max_pending_connections < 1)
      throw std::invalid_argument("rendezvous store: max_pending_connections must be at least 1");
    if (opts.listen_fd >= 0) {
      adopt_listener();
    } else {
      bind_listener();
    }
    accept();
    thread = std::thread([this] { ioc.run(); });
  }

  // Serves on the socket the local launcher bound and listened on (it passed it as an inherited
  // descriptor); it must be listening on the port the other ranks were told.
  void adopt_listener() {
    const int fd = opts.listen_fd;
    int listening = 0;
    socklen_t n = sizeof listening;
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &n) != 0 || !listening ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0 ||
        (ss.ss_family != AF_INET && ss.ss_family != AF_INET6))
      throw DistributedError("rendezvous store: descriptor " + std::to_string(fd) +
                             " (ACCEL_STORE_FD, set by the local launcher) is not a listening TCP "
                             "socket; unset ACCEL_STORE_FD unless the local launcher started "
                             "this process");
    boost::system::error_code ec;
    acceptor.assign(ss.ss_family == AF_INET6 ? tcp::v6() : tcp::v4(), fd, ec);
    if (ec)
      throw DistributedError("rendezvous store: cannot use descriptor " + std::to_string(fd) +
                             " (ACCEL_STORE_FD): " + ec.message());
    if (opts.port != 0 && port() != opts.port)
      throw DistributedError(
          "rendezvous store: the socket the launcher passed (ACCEL_STORE_FD) "
          "listens on port " +
          std::to_string(port()) + ", not MASTER_PORT=" + std::to_string(opts.port));
  }

  void bind_listener() {
    boost::system::error_code ec;
    tcp::resolver resolver(ioc);
    auto results = resolver.resolve(opts.host, std::to_string(opts.port), ec);
    if (ec || results.empty())
      throw DistributedError("rendezvous store: cannot resolve main_process_ip/MASTER_ADDR '" +
                             opts.host + "': " + ec.message());
    tcp::endpoint ep = results.begin()->endpoint();
    acceptor.open(ep.protocol());
    acceptor.set_option(tcp::acceptor::reuse_address(true));
    acceptor.bind(ep, ec);
    if (ec)
      throw DistributedError(
          "rendezvous store: rank 0 cannot listen on " + where(opts.host, opts.port) + ": " +
          ec.message() +
          " (main_process_ip/MASTER_ADDR must be an address of the machine running rank 0, and "
          "main_process_port/MASTER_PORT a free port)");
    acceptor.listen(asio::socket_base::max_listen_connections);
  }

  ~Server() {
    ioc.stop();
    if (thread.joinable()) thread.join();
    for (auto& c : conns) {
      boost::system::error_code ec;
      c->sock.close(ec);
    }
    conns.clear();
  }

  int port() const { return acceptor.local_endpoint().port(); }

  void accept() {
    acceptor.async_accept([this](boost::system::error_code ec, tcp::socket sock) {
      if (!ec) {
        // Strangers may connect faster than the handshake timeout closes them: keep a fixed
        // number waiting and drop the oldest, which has had the longest to say hello.
        if (static_cast<int>(pending.size()) >= opts.max_pending_connections) {
          auto oldest = pending.front();
          close(oldest);
        }
        auto c = std::make_shared<Conn>(this, std::move(sock));
        conns.insert(c);
        pending.push_back(c);
        boost::system::error_code ignored;
        c->sock.set_option(tcp::no_delay(true), ignored);
        c->timer.expires_after(opts.handshake_timeout);
        c->timer.async_wait([this, c](boost::system::error_code e) {
          if (!e && !c->authed) close(c);
        });
        read_frame(c);
      }
      if (ec == asio::error::operation_aborted) return;
      if (!ec) return accept();
      // Out of descriptors or similar: try again shortly instead of spinning.
      accept_retry.expires_after(Millis(50));
      accept_retry.async_wait([this](boost::system::error_code e) {
        if (!e) accept();
      });
    });
  }

  void close(const std::shared_ptr<Conn>& c) {
    if (c->closed) return;
    c->closed = true;
    boost::system::error_code ec;
    c->timer.cancel();
    c->sock.close(ec);
    c->wait_keys.clear();
    conns.erase(c);
    if (!c->authed) pending.remove(c);
  }

  void read_frame(const std::shared_ptr<Conn>& c) {
    asio::async_read(c->sock, asio::buffer(c->len_buf, 4),
                     [this, c](boost::system::error_code ec, size_t) {
                       if (ec) return close(c);
                       // Nothing is allocated for a stranger beyond a hello's size.
                       uint32_t len = decode_u32(c->len_buf);
                       uint32_t limit = c->authed ? opts.max_frame_bytes : kMaxHelloBytes;
                       if (len == 0 || len > limit) return close(c);
                       c->body.resize(len);
                       asio::async_read(c->sock, asio::buffer(c->body),
                                        [this, c](boost::system::error_code ec2, size_t) {
                                          if (ec2) return close(c);
                                          handle(c);
                                        });
                     });
  }

  void respond(const std::shared_ptr<Conn>& c, Writer& w, bool close_after = false) {
    c->out = std::move(w.frame());
    asio::async_write(c->sock, asio::buffer(c->out),
                      [this, c, close_after](boost::system::error_code ec, size_t) {
                        if (ec || close_after) return close(c);
                        read_frame(c);
                      });
  }

  void handle(const std::shared_ptr<Conn>& c) {
    try {
      Reader r(c->body);
      if (!c->authed) {
        r.need(sizeof(kHello));
        if (std::memcmp(c->body.data(), kHello, sizeof(kHello)) != 0)
          throw ProtocolError("bad hello");
        r.pos = sizeof(kHello);
        std::string token = r.rest();
        Writer w;
        if (!constant_time_equal(token, opts.token)) {
          w.u8(1);
          w.raw("wrong job token", 15);
          return respond(c, w, /*close_after=*/true);
        }
        c->authed = true;
        pending.remove(c);
        c->timer.cancel();
        w.u8(0);
        return respond(c, w);
      }
      Writer w;
      switch (static_cast<Op>(r.u8())) {
        case Op::Set: {
          std::string k = r.str(), v = r.str();
          r.end();
          data[k] = std::move(v);
          w.u8(0);
          respond(c, w);
          wake_waiters();
          return;
        }
        case Op::Get: {
          std::string k = r.str();
          r.end();
          auto it = data.find(k);
          w.u8(0);
          w.u8(it != data.end());
          w.str(it != data.end() ? it->second : std::string());
          return respond(c, w);
        }
        case Op::Add: {
          std::string k = r.str();
          int64_t delta = static_cast<int64_t>(r.u64());
          r.end();
          int64_t value = 0;
          auto it = data.find(k);
          if (it != data.end()) {
            try {
              size_t used = 0;
              value = std::stoll(it->second, &used);
              if (used != it->second.size()) throw std::invalid_argument("junk");
            } catch (const std::exception&) {
              w.u8(1);
              w.str("add: key '" + k + "' holds a value that is not an integer");
              return respond(c, w);
            }
          }
          value = static_cast<int64_t>(static_cast<uint64_t>(value) + static_cast<uint64_t>(delta));
          data[k] = std::to_string(value);
          w.u8(0);
          w.u64(static_cast<uint64_t>(value));
          respond(c, w);
          wake_waiters();
          return;
        }
        case Op::Check: {
          uint32_t n = r.u32();
          bool all = true;
          for (uint32_t i = 0; i < n; ++i) all = data.count(r.str()) && all;
          r.end();
          w.u8(0);
          w.u8(all);
          return respond(c, w);
        }
        case Op::Wait: {
          uint64_t timeout_ms = r.u64();
          uint32_t n = r.u32();
          std::vector<std::string> keys;
          for (uint32_t i = 0; i < n; ++i) keys.push_back(r.str());
          r.end();
          if (all_present(keys)) {
            w.u8(0);
            w.u8(1);
            return respond(c, w);
          }
          c->wait_keys = std::move(keys);
          waiters.push_back(c);
          c->timer.expires_after(Millis(std::min<uint64_t>(timeout_ms, kMaxTimeout.count())));
          c->timer.async_wait([this, c](boost::system::error_code e) {
            if (e || c->closed || c->wait_keys.empty()) return;
            c->wait_keys.clear();
            Writer tw;
            tw.u8(0);
            tw.u8(0);
            respond(c, tw);
          });
          return;
        }
        case Op::Delete: {
          std::string k = r.str();
          r.end();
          w.u8(0);
          w.u8(data.erase(k) > 0);
          return respond(c, w);
        }
      }
      throw ProtocolError("unknown op");
    } catch (const ProtocolError&) {
      close(c);  // a malformed frame ends this connection only
    }
  }

  bool all_present(const std::vector<std::string>& keys) const {
    for (auto& k : keys)
      if (!data.count(k)) return false;
    return true;
  }

  void wake_waiters() {
    for (auto it = waiters.begin(); it != waiters.end();) {
      auto c = it->lock();
      if (!c || c->closed || c->wait_keys.empty()) {
        it = waiters.erase(it);
        continue;
      }
      if (all_present(c->wait_keys)) {
        c->wait_keys.clear();
        c->timer.cancel();
        Writer w;
        w.u8(0);
        w.u8(1);
        respond(c, w);
        it = waiters.erase(it);
      } else {
        ++it;
      }
    }
  }
};

// ---- client ------------------------------------------------------------------------------------

struct TcpStore::Client {
  std::string host;
  int port;
  uint32_t max_frame;
  std::mutex mu;
  asio::io_context ioc;
  tcp::socket sock{ioc};
  std::string broken;  // why the connection is unusable, once it is

  Client(std::string h, int p, uint32_t mf) : host(std::move(h)), port(p), max_frame(mf) {}

  std::string server_name() const {
    return "the rendezvous store at " + where(host, port) + " (served by rank 0)";
  }

  // Runs the io_context until `done` or the deadline; false on timeout.
  bool run_until(const bool& done, Clock::time_point deadline) {
    while (!done) {
      if (ioc.stopped()) ioc.restart();
      if (Clock::now() >= deadline) return false;
      ioc.run_one_until(deadline);
    }
    return true;
  }

  void fail(const std::string& why) {
    broken = why;
    reset_socket();
    throw DistributedError(why);
  }

  // Drops the socket and the handlers its close cancelled, so the next use of ioc starts clean.
  void reset_socket() {
    boost::system::error_code ignored;
    sock.close(ignored);
    ioc.restart();
    ioc.poll();
  }

  // Connects and authenticates, retrying until the deadline: rank 0 may not listen yet, and under
  // a flood of strangers the server may drop this connection before it read the hello.
  void connect(const std::string& token, Millis timeout) {
    auto deadline = Clock::now() + timeout;
    std::string last_error = "no attempt";
    Writer hello;
    hello.raw(kHello, sizeof(kHello));
    hello.raw(token.data(), token.size());
    const std::vector<char>& hello_frame = hello.frame();
    while (true) {
      boost::system::error_code ec;
      tcp::resolver resolver(ioc);
      auto results = resolver.resolve(host, std::to_string(port), ec);
      if (!ec) {
        bool done = false;
        boost::system::error_code cec;
        asio::async_connect(sock, results, [&](boost::system::error_code e, const tcp::endpoint&) {
          cec = e;
          done = true;
        });
        if (!run_until(done, deadline)) {
          reset_socket();
          break;
        }
        if (!cec) {
          boost::system::error_code ignored;
          sock.set_option(tcp::no_delay(true), ignored);
          std::vector<char> reply;
          boost::system::error_code xec = transfer(hello_frame, deadline, reply);
          if (!xec) {
            if (reply.empty() || reply[0] != 0)
              fail(server_name() +
                   " rejected this process's job token: every rank must have the same "
                   "ACCEL_JOB_TOKEN (see docs/launch.md)");
            return;
          }
          last_error = "handshake cut off: " + xec.message();
        } else {
          last_error = cec.message();
        }
      } else {
        last_error = "cannot resolve: " + ec.message();
      }
      reset_socket();
      if (Clock::now() + Millis(50) >= deadline) break;
      std::this_thread::sleep_for(Millis(50));
    }
    throw DistributedError("could not connect to " + server_name() + " within " +
                           describe_duration(timeout) + " (last error: " + last_error +
                           "); check that rank 0 started and that main_process_ip/MASTER_ADDR "
                           "and main_process_port/MASTER_PORT are the same on every rank");
  }

  // Writes one frame and reads the answer frame into `body`. On an error or at the deadline
  // (asio::error::timed_out) the socket is closed.
  boost::system::error_code transfer(const std::vector<char>& frame, Clock::time_point deadline,
                                     std::vector<char>& body) {
    bool wrote = false, got_len = false, got_body = false;
    boost::system::error_code err;
    unsigned char len_buf[4];
    asio::async_write(sock, asio::buffer(frame), [&](boost::system::error_code ec, size_t) {
      if (ec && !err) err = ec;
      wrote = true;
    });
    asio::async_read(sock, asio::buffer(len_buf, 4), [&](boost::system::error_code ec, size_t) {
      got_len = true;
      if (ec) {
        if (!err) err = ec;
        got_body = true;
        return;
      }
      uint32_t len = decode_u32(len_buf);
      if (len == 0 || len > max_frame) {
        err = asio::error::message_size;
        got_body = true;
        return;
      }
      body.resize(len);
      asio::async_read(sock, asio::buffer(body), [&](boost::system::error_code ec2, size_t) {
        if (ec2 && !err) err = ec2;
        got_body = true;
      });
    });
    while (!(wrote && got_len && got_body) && !err) {
      if (ioc.stopped()) ioc.restart();
      if (Clock::now() >= deadline) {
        err = asio::error::timed_out;
        break;
      }
      ioc.run_one_until(deadline);
    }
    if (err) reset_socket();  // also runs the handlers still pending on this frame's locals
    return err;
  }

  std::vector<char> exchange(const std::vector<char>& frame, Clock::time_point deadline,
                             const std::string& what) {
    if (!broken.empty()) throw DistributedError(broken);
    std::vector<char> body;
    boost::system::error_code err = transfer(frame, deadline, body);
    if (err == asio::error::timed_out)
      fail("no answer from " + server_name() + " for " + what +
           " before the timeout; rank 0 may be stalled");
    if (err == asio::error::message_size)
      fail("bad frame from " + server_name() + " during " + what);
    if (err)
      fail("lost the connection to " + server_name() + " during " + what + " (" + err.message() +
           "): rank 0 exited, crashed or closed the connection");
    return body;
  }

  // Sends one request and returns the response payload after its status byte.
  std::vector<char> request(Writer& w, Clock::time_point deadline, const std::string& what) {
    if (w.buf.size() - 4 > max_frame)
      throw DistributedError("rendezvous store: " + what + ": request of " +
                             std::to_string(w.buf.size() - 4) +
                             " bytes exceeds the frame limit of " + std::to_string(max_frame) +
                             " bytes (StoreOptions::max_frame_bytes)");
    std::lock_guard<std::mutex> lock(mu);
    std::vector<char> reply = exchange(w.frame(), deadline, what);
    Reader r(reply);
    uint8_t status = r.u8();
    if (status != 0) throw DistributedError("rendezvous store: " + what + ": " + r.str());
    return std::vector<char>(reply.begin() + 1, reply.end());
  }
};

// ---- TcpStore ----------------------------------------------------------------------------------

TcpStore::TcpStore(StoreOptions options) : options_(std::move(options)) {
  if (options_.token.empty())
    throw std::invalid_argument("rendezvous store: empty job token (set ACCEL_JOB_TOKEN)");
  if (options_.token.size() > kMaxJobTokenBytes)
    throw std::invalid_argument("rendezvous store: the job token (ACCEL_JOB_TOKEN) has " +
                                std::to_string(options_.token.size()) + " bytes; at most " +
                                std::to_string(kMaxJobTokenBytes) + " are allowed");
  check_timeout(options_.timeout, "rendezvous store: timeout");
  check_timeout(options_.handshake_timeout, "rendezvous store: handshake_timeout");
  port_ = options_.port;
  if (options_.is_server) {
    server_ = std::make_unique<Server>(options_);
    port_ = server_->port();
  }
  client_ = std::make_unique<Client>(options_.host, port_, options_.max_frame_bytes);
  client_->connect(options_.token, options_.timeout);
}

TcpStore::~TcpStore() {
  client_.reset();
  server_.reset();
}

std::unique_ptr<TcpStore> TcpStore::connect_again(std::optional<Millis> timeout) const {
  StoreOptions o = options_;
  if (timeout) o.timeout = *timeout;
  o.is_server = false;
  o.listen_fd = -1;
  o.port = port_;
  return std::make_unique<TcpStore>(o);
}

std::string TcpStore::local_address() const {
  boost::system::error_code ec;
  auto ep = client_->sock.local_endpoint(ec);
  if (ec) return "127.0.0.1";
  return ep.address().to_string();
}

namespace {
Clock::time_point deadline_after(Millis t) {
  // Generous client-side slack: the server answers WAIT at the timeout itself.
  return Clock::now() + t + std::max(Millis(2000), t / 10);
}
}  // namespace

void TcpStore::set(const std::string& key, const std::string& value) {
  Writer w;
  w.u8(static_cast<uint8_t>(Op::Set));
  w.str(key);
  w.str(value);
  client_->request(w, deadline_after(options_.timeout), "set('" + key + "')");
}

std::optional<std::string> TcpStore::try_get(const std::string& key) {
  Writer w;
  w.u8(static_cast<uint8_t>(Op::Get));
  w.str(key);
  auto reply = client_->request(w, deadline_after(options_.timeout), "get('" + key + "')");
  Reader r(reply);
  bool found = r.u8();
  std::string v = r.str();
  if (!found) return std::nullopt;
  return v;
}

std::string TcpStore::get(const std::string& key, std::optional<Millis> timeout) {
  wait({key}, timeout);
  auto v = try_get(key);
  if (!v) throw DistributedError("rendezvous store: key '" + key + "' vanished while reading it");
  return *v;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  Writer w;
  w.u8(static_cast<uint8_t>(Op::Add));
  w.str(key);
  w.u64(static_cast<uint64_t>(delta));
  auto reply = client_->request(w, deadline_after(options_.timeout), "add('" + key + "')");
  Reader r(reply);
  return static_cast<int64_t>(r.u64());
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  Writer w;
  w.u8(static_cast<uint8_t>(Op::Check));
  w.u32(static_cast<uint32_t>(keys.size()));
  for (auto& k : keys) w.str(k);
  auto reply = client_->request(w, deadline_after(options_.timeout), "check");
  return Reader(reply).u8() != 0;
}

void TcpStore::wait(const std::vector<std::string>& keys, std::optional<Millis> timeout) {
  Millis t = std::clamp(timeout.value_or(options_.timeout), Millis(0), kMaxTimeout);
  Writer w;
  w.u8(static_cast<uint8_t>(Op::Wait));
  w.u64(static_cast<uint64_t>(std::max<int64_t>(0, t.count())));
  w.u32(static_cast<uint32_t>(keys.size()));
  for (auto& k : keys) w.str(k);
  auto reply = client_->request(w, deadline_after(t), "wait");
  if (Reader(reply).u8()) return;
  std::string missing;
  for (auto& k : keys)
    if (!check({k})) missing += (missing.empty() ? "'" : ", '") + k + "'";
  throw DistributedError("rendezvous store: timed out after " + describe_duration(t) +
                         " waiting for key(s) " + missing);
}

bool TcpStore::remove(const std::string& key) {
  Writer w;
  w.u8(static_cast<uint8_t>(Op::Delete));
  w.str(key);
  auto reply = client_->request(w, deadline_after(options_.timeout), "delete('" + key + "')");
  return Reader(reply).u8() != 0;
}

void TcpStore::barrier(const std::string& name, int rank, int world,
                       std::optional<Millis> timeout) {
  const std::string prefix = "__barrier/" + name + "/";
  Millis t = timeout.value_or(options_.timeout);
  set(prefix + std::to_string(rank), "1");
  int64_t n = add(prefix + "count", 1);
  if (n > world)
    throw DistributedError("store barrier '" + name + "' was entered " + std::to_string(n) +
                           " times for a world of " + std::to_string(world) +
                           "; each barrier name may be used once per job");
  if (n == world) set(prefix + "done", "1");
  try {
    wait({prefix + "done"}, t);
  } catch (const DistributedError&) {
    std::vector<int> missing;
    for (int r = 0; r < world; ++r)
      if (!check({prefix + std::to_string(r)})) missing.push_back(r);
    if (missing.empty()) throw;
    throw DistributedError("store barrier '" + name + "': " + describe_ranks(missing) +
                           " did not arrive within " + describe_duration(t) +
                           " (stalled, crashed or never started)");
  }
}

}  // namespace accel
