// Helpers of comm/'s tests: loopback sockets.
#ifndef STRATA_TESTS_COMM_COMM_TEST_UTIL_H_
#define STRATA_TESTS_COMM_COMM_TEST_UTIL_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>

namespace strata::comm::testing {

// A socket listening on loopback (what another service on a port looks like): on *port, or on a
// free port when it is 0, which is then written there; -1 on failure.
inline int ListenOnLoopback(uint16_t* port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  at.sin_port = htons(*port);
  socklen_t len = sizeof at;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof at) != 0 || listen(fd, 4) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&at), &len) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  *port = ntohs(at.sin_port);
  return fd;
}

// Whether `port` can be bound on loopback now.
inline bool PortIsFree(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  at.sin_port = htons(port);
  const bool free = fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof at) == 0;
  if (fd >= 0) close(fd);
  return free;
}

// A loopback port free a moment ago, with the next one free too (a job's store listens on
// MASTER_PORT + 1), drawn below the kernel's ephemeral range (32768 and up by default): a port
// the kernel handed out for a connection has its neighbours handed out next, so they are often
// taken a moment later (CI saw MASTER_PORT + 1 in use).
inline uint16_t FreePort() {
  static unsigned seed = static_cast<unsigned>(getpid());
  for (int attempt = 0; attempt < 1000; ++attempt) {
    seed = seed * 1103515245u + 12345u;
    const auto port = static_cast<uint16_t>(20000 + (seed >> 8) % 12000);
    if (PortIsFree(port) && PortIsFree(static_cast<uint16_t>(port + 1))) return port;
  }
  return 0;
}

}  // namespace strata::comm::testing

#endif  // STRATA_TESTS_COMM_COMM_TEST_UTIL_H_
