// libFuzzer: the TCP store's wire protocol. One store server runs in this process; each input is
// sent over a fresh connection, after a valid hello when the first byte is odd (to reach the
// request parser) or as the very first frame otherwise (the handshake parser). Whatever the bytes,
// the server must stay up: every 64 inputs a real client sets and reads back a key.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "parallel/store.h"

namespace {

const char kToken[] = "fuzz-token";

accel::TcpStore& server() {
  static std::unique_ptr<accel::TcpStore> s = [] {
    accel::StoreOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.is_server = true;
    o.token = kToken;
    o.timeout = std::chrono::seconds(5);
    return std::make_unique<accel::TcpStore>(o);
  }();
  return *s;
}

void put_u32(std::vector<char>& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static int calls = 0;
  accel::TcpStore& s = server();
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(s.port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) std::abort();
  timeval tv{0, 20000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::vector<char> out;
  if (size > 0 && (data[0] & 1)) {
    std::string hello = std::string("ACCELKV1") + kToken;
    put_u32(out, static_cast<uint32_t>(hello.size()));
    out.insert(out.end(), hello.begin(), hello.end());
    ++data;
    --size;
  }
  out.insert(out.end(), reinterpret_cast<const char*>(data),
             reinterpret_cast<const char*>(data) + size);
  (void)!send(fd, out.data(), out.size(), MSG_NOSIGNAL);
  char buf[4096];
  while (recv(fd, buf, sizeof buf, 0) > 0) {
  }
  close(fd);
  if (++calls % 64 == 0) {
    std::string key = "probe" + std::to_string(calls);
    accel::StoreOptions o;
    o.host = "127.0.0.1";
    o.port = s.port();
    o.token = kToken;
    o.timeout = std::chrono::seconds(5);
    accel::TcpStore client(o);
    client.set(key, "v");
    if (client.get(key) != "v") std::abort();
  }
  return 0;
}
