// TCP key-value store. Wire format: every frame is a 4-byte little-endian length and that many
// bytes. The first client frame is the hello ("ACCELKV1" + token); the server answers one status
// byte (+ message) and closes the connection on a wrong token. After that each request is
// [op u8][fields] and each response [status u8][fields]; strings are [u32 length][bytes].
#include "parallel/store.h"

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
  std::ostringstream os;
  double s = static_cast<double>(d.count()) / 1000.0;
  os << (s < 10 ? std::round(s * 10) / 10 : std::round(s)) << " s";
  return os.str();
}

namespace {

constexpr char kHello[8] = {'A', 'C', 'C', 'E', 'L', 'K', 'V', '1'};

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
  std::list<std::weak_ptr<Conn>> waiters;

  explicit Server(StoreOptions o) : opts(std::move(o)) {
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
    accept();
    thread = std::thread([this] { ioc.run(); });
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
        auto c = std::make_shared<Conn>(this, std::move(sock));
        conns.insert(c);
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
  }

  void read_frame(const std::shared_ptr<Conn>& c) {
    asio::async_read(c->sock, asio::buffer(c->len_buf, 4),
                     [this, c](boost::system::error_code ec, size_t) {
                       if (ec) return close(c);
                       uint32_t len = decode_u32(c->len_buf);
                       if (len == 0 || len > opts.max_frame_bytes) return close(c);
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
          c->timer.expires_after(Millis(std::min<uint64_t>(timeout_ms, 1ull << 40)));
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
    boost::system::error_code ec;
    sock.close(ec);
    // Drain the handlers the close cancelled so the next use of ioc starts clean.
    ioc.restart();
    ioc.poll();
    throw DistributedError(why);
  }

  void connect(const std::string& token, Millis timeout) {
    auto deadline = Clock::now() + timeout;
    std::string last_error = "no attempt";
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
          boost::system::error_code ignored;
          sock.close(ignored);
          ioc.restart();
          ioc.poll();
          break;
        }
        if (!cec) break;
        last_error = cec.message();
      } else {
        last_error = "cannot resolve: " + ec.message();
      }
      boost::system::error_code ignored;
      sock.close(ignored);
      if (Clock::now() + Millis(50) >= deadline) break;
      std::this_thread::sleep_for(Millis(50));
    }
    if (!sock.is_open())
      throw DistributedError("could not connect to " + server_name() + " within " +
                             describe_duration(timeout) + " (last error: " + last_error +
                             "); check that rank 0 started and that main_process_ip/MASTER_ADDR "
                             "and main_process_port/MASTER_PORT are the same on every rank");
    boost::system::error_code ignored;
    sock.set_option(tcp::no_delay(true), ignored);
    Writer w;
    w.raw(kHello, sizeof(kHello));
    w.raw(token.data(), token.size());
    std::vector<char> reply = exchange(w.frame(), deadline, "the handshake");
    if (reply.empty() || reply[0] != 0)
      fail(server_name() +
           " rejected this process's job token: every rank must have the same "
           "ACCEL_JOB_TOKEN (see docs/launch.md)");
  }

  std::vector<char> exchange(const std::vector<char>& frame, Clock::time_point deadline,
                             const std::string& what) {
    if (!broken.empty()) throw DistributedError(broken);
    bool wrote = false, got_len = false, got_body = false;
    boost::system::error_code err;
    unsigned char len_buf[4];
    std::vector<char> body;
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
      if (Clock::now() >= deadline)
        fail("no answer from " + server_name() + " for " + what +
             " before the timeout; rank 0 may be stalled");
      ioc.run_one_until(deadline);
    }
    if (err) {
      if (err == asio::error::message_size)
        fail("bad frame from " + server_name() + " during " + what);
      fail("lost the connection to " + server_name() + " during " + what + " (" + err.message() +
           "): rank 0 exited, crashed or closed the connection");
    }
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
  Millis t = timeout.value_or(options_.timeout);
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
