#include "comm/tcp_store.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/comm/comm_test_util.h"

namespace strata::comm {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

std::vector<char> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::unique_ptr<TcpStoreServer> Serve() {
  auto server = TcpStoreServer::Start("127.0.0.1", 0);
  EXPECT_TRUE(server.ok()) << server.status();
  return std::move(*server);
}

std::unique_ptr<TcpStore> Client(uint16_t port) {
  auto c = TcpStore::Connect("127.0.0.1", port, Duration(5000));
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(*c);
}

TEST(TcpStoreTest, ValuesSetByOneClientAreReadByAnother) {
  auto server = Serve();
  auto a = Client(server->port());
  auto b = Client(server->port());
  ASSERT_TRUE(a->Set("rank0/address", Bytes("10.0.0.1:1234")).ok());
  auto v = b->Get("rank0/address", Duration(1000));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(std::string(v->begin(), v->end()), "10.0.0.1:1234");
  // An empty value and a large one travel whole.
  ASSERT_TRUE(a->Set("empty", {}).ok());
  EXPECT_TRUE(b->Get("empty", Duration(1000))->empty());
  std::vector<char> big(3 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7);
  ASSERT_TRUE(a->Set("big", big).ok());
  EXPECT_EQ(*b->Get("big", Duration(5000)), big);
}

TEST(TcpStoreTest, GetWaitsForAKeySetLater) {
  auto server = Serve();
  auto reader = Client(server->port());
  std::thread writer([port = server->port()] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    auto w = TcpStore::Connect("127.0.0.1", port, Duration(5000));
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Set("late", Bytes("here")).ok());
  });
  const auto t0 = Clock::now();
  auto v = reader->Get("late", Duration(10000));
  writer.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(std::string(v->begin(), v->end()), "here");
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(150));
}

TEST(TcpStoreTest, AGetThatTimesOutNamesTheKeyAndDoesNotHang) {
  auto server = Serve();
  auto c = Client(server->port());
  const auto t0 = Clock::now();
  auto v = c->Get("never", Duration(300));
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(v.status().message(), HasSubstr("\"never\""));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  // The connection is closed after a timeout: later requests say so instead of misreading.
  auto again = c->Set("k", Bytes("v"));
  EXPECT_THAT(again.message(), HasSubstr("connection was closed"));
}

TEST(TcpStoreTest, CountersAddUpAcrossClients) {
  auto server = Serve();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([port = server->port()] {
      auto c = TcpStore::Connect("127.0.0.1", port, Duration(5000));
      ASSERT_TRUE(c.ok());
      for (int i = 0; i < 25; ++i) ASSERT_TRUE((*c)->Add("arrived", 1).ok());
    });
  }
  for (auto& t : threads) t.join();
  auto c = Client(server->port());
  EXPECT_EQ(*c->Add("arrived", 0), 100);
}

TEST(TcpStoreTest, AClientRetriesUntilTheServerIsUp) {
  // A free port, then the server started on it after the client began.
  uint16_t port;
  {
    auto probe = Serve();
    port = probe->port();
  }
  std::unique_ptr<TcpStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto s = TcpStoreServer::Start("127.0.0.1", port);
    ASSERT_TRUE(s.ok()) << s.status();
    server = std::move(*s);
  });
  auto c = TcpStore::Connect("127.0.0.1", port, Duration(10000));
  starter.join();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->Set("k", Bytes("v")).ok());
}

TEST(TcpStoreTest, NoServerIsATimeoutNamingTheAddress) {
  uint16_t port;
  {
    auto probe = Serve();
    port = probe->port();
  }
  const auto t0 = Clock::now();
  auto c = TcpStore::Connect("127.0.0.1", port, Duration(400));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(c.status().message(), HasSubstr("127.0.0.1:" + std::to_string(port)));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
}

// A stop check that says to stop once `after` has passed, counting its calls.
StopCheck StopAfter(std::chrono::milliseconds after, int* calls) {
  return [until = Clock::now() + after, calls]() -> absl::Status {
    ++*calls;
    if (Clock::now() < until) return absl::OkStatus();
    return absl::CancelledError("stopped by the test");
  };
}

TEST(TcpStoreTest, AStopCheckEndsAWaitForAKeyLongBeforeItsTimeout) {
  auto server = Serve();
  auto c = Client(server->port());
  int calls = 0;
  c->set_stop(StopAfter(std::chrono::milliseconds(300), &calls));
  const auto t0 = Clock::now();
  auto v = c->Get("never", Duration(60000));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(v.status().message(), HasSubstr("waiting for \"never\": stopped by the test"));
  EXPECT_GE(calls, 2);  // polled while it waited
  // The connection is closed then, as after a timeout; a client without a check waits on.
  EXPECT_FALSE(c->Set("k", Bytes("v")).ok());
  auto d = Client(server->port());
  d->set_stop(nullptr);
  EXPECT_TRUE(d->Set("k", Bytes("v")).ok());
}

TEST(TcpStoreTest, AStopCheckEndsTheRetriesOfAConnection) {
  uint16_t port;
  {
    auto probe = Serve();
    port = probe->port();
  }
  int calls = 0;
  const auto t0 = Clock::now();
  auto c = TcpStore::Connect("127.0.0.1", port, Duration(60000),
                             StopAfter(std::chrono::milliseconds(300), &calls));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kCancelled);
}

TEST(TcpStoreTest, AServiceThatIsNotTheStoreIsNamedAsSuch) {
  // A listener that accepts and answers something else (as another service on the port would).
  uint16_t port = 0;
  const int fd = testing::ListenOnLoopback(&port);
  ASSERT_GE(fd, 0);
  std::thread other([fd] {
    int conn = accept(fd, nullptr, nullptr);
    const char junk[] = "HTTP/1.1 400 Bad Request\r\n\r\n";
    (void)!write(conn, junk, sizeof junk);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    close(conn);
  });
  auto c = TcpStore::Connect("127.0.0.1", port, Duration(3000));
  other.join();
  close(fd);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(c.status().message(), HasSubstr("is not strata's rendezvous store"));
}

TEST(TcpStoreTest, APortInUseIsRefusedByName) {
  auto first = Serve();
  auto second = TcpStoreServer::Start("127.0.0.1", first->port());
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(second.status().message(), HasSubstr("cannot listen on 127.0.0.1:"));
  auto bad = TcpStoreServer::Start("not-an-ip", 0);
  EXPECT_THAT(bad.status().message(), HasSubstr("is not an IP address"));
}

}  // namespace
}  // namespace strata::comm
