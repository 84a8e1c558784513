// Helpers shared by the aio tests: a scratch directory on a filesystem that takes O_DIRECT, and
// seeded random bytes.
#ifndef STRATA_TESTS_AIO_TEST_UTIL_H_
#define STRATA_TESTS_AIO_TEST_UTIL_H_

#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace strata::testing {

// Kilobytes of locked memory, as the kernel counts them for this process.
inline int64_t VmLckKiB() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmLck:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// A fresh directory, removed with its contents at destruction. Under $STRATA_TEST_DIR when set,
// else under the build tree's working directory (ctest runs in the build folder, which is on the
// project's disk; /tmp may be tmpfs, which refuses O_DIRECT).
class ScratchDir {
 public:
  // Under STRATA_TEST_DIR, else the current directory (the build tree: a real disk, for O_DIRECT).
  ScratchDir()
      : ScratchDir(getenv("STRATA_TEST_DIR") ? std::string(getenv("STRATA_TEST_DIR"))
                                             : std::filesystem::current_path().string()) {}
  // Under the system's temporary root, mode 0755: for tests that drop to another user, who must
  // reach it wherever the checkout lies (a checkout under a 0700 folder is not traversable).
  static ScratchDir Traversable() {
    ScratchDir d(std::filesystem::temp_directory_path().string());
    std::filesystem::permissions(
        d.path_, std::filesystem::perms::owner_all | std::filesystem::perms::group_read |
                     std::filesystem::perms::group_exec | std::filesystem::perms::others_read |
                     std::filesystem::perms::others_exec);
    return d;
  }
  ScratchDir(ScratchDir&& o) noexcept : path_(std::move(o.path_)) { o.path_.clear(); }
  explicit ScratchDir(const std::string& base) {
    std::string pattern = base + "/strata-test-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) ADD_FAILURE() << "mkdtemp " << pattern << " failed";
    path_ = buf.data();
  }
  ~ScratchDir() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, ec);
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::vector<std::byte> out(n);
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(&out[i], &v, 8);
  }
  for (; i < n; ++i) out[i] = static_cast<std::byte>(rng());
  return out;
}

}  // namespace strata::testing

#endif  // STRATA_TESTS_AIO_TEST_UTIL_H_
