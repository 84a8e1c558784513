// Helpers of comm/'s tests: loopback sockets.
#ifndef STRATA_TESTS_COMM_COMM_TEST_UTIL_H_
#define STRATA_TESTS_COMM_COMM_TEST_UTIL_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>

namespace strata::comm::testing {

// A socket listening on a free loopback port (what another service on a port looks like); -1 on
// failure.
inline int ListenOnLoopback(uint16_t* port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
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

// A loopback port free a moment ago.
inline uint16_t FreePort() {
  uint16_t port = 0;
  int fd = ListenOnLoopback(&port);
  if (fd >= 0) close(fd);
  return port;
}

}  // namespace strata::comm::testing

#endif  // STRATA_TESTS_COMM_COMM_TEST_UTIL_H_
