#include "base/status.h"

#include <cerrno>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata {
namespace {

using ::testing::HasSubstr;

TEST(ErrnoStatusTest, MessageNamesOpPathOffsetLengthAndErrno) {
  absl::Status s = ErrnoStatus(EIO, "pread", "/nvme/p17.swp", 1048576, 4194304);
  EXPECT_EQ(s.code(), absl::ErrnoToStatusCode(EIO));
  EXPECT_THAT(s.message(), HasSubstr("pread /nvme/p17.swp @ 1048576 len 4194304: "
                                     "Input/output error"));
  EXPECT_EQ(StatusErrno(s), EIO);
}

TEST(ErrnoStatusTest, EnospcIsResourceExhaustedAndKeepsErrno) {
  absl::Status s = ErrnoStatus(ENOSPC, "write", "/x");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(StatusErrno(s), ENOSPC);
}

TEST(ErrnoStatusTest, StatusWithoutErrnoGivesZero) {
  EXPECT_EQ(StatusErrno(absl::InternalError("x")), 0);
  EXPECT_EQ(StatusErrno(absl::OkStatus()), 0);
}

TEST(AnnotateTest, PrependsContextAndKeepsCodeAndPayload) {
  absl::Status s = Annotate(ErrnoStatus(ENOENT, "open", "/a"), "swap-in p3");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("swap-in p3: open /a"));
  EXPECT_EQ(StatusErrno(s), ENOENT);
  EXPECT_TRUE(Annotate(absl::OkStatus(), "x").ok());
}

// What a Status handed to another thread is: its code, message and payloads, in storage of its
// own (a copy that shared the message would be freed by whichever thread drops it last, which
// ThreadSanitizer reports as a race on Debian's uninstrumented Abseil).
TEST(UnsharedTest, KeepsCodeMessageAndPayloadInStorageOfItsOwn) {
  const absl::Status original = Annotate(ErrnoStatus(EIO, "pread", "/a"), "swap-in p3");
  const absl::Status copy = Unshared(original);
  EXPECT_EQ(copy, original);
  EXPECT_EQ(StatusErrno(copy), EIO);
  EXPECT_NE(copy.message().data(), original.message().data());
  const absl::Status shared = original;  // what a plain copy does
  EXPECT_EQ(shared.message().data(), original.message().data());
  EXPECT_TRUE(Unshared(absl::OkStatus()).ok());
}

absl::StatusOr<int> Half(int v) {
  if (v % 2 != 0) return absl::InvalidArgumentError("odd");
  return v / 2;
}

absl::Status UseMacros(int v, int* out) {
  STRATA_ASSIGN_OR_RETURN(int h, Half(v));
  STRATA_RETURN_IF_ERROR(h > 10 ? absl::OutOfRangeError("big") : absl::OkStatus());
  *out = h;
  return absl::OkStatus();
}

TEST(StatusMacrosTest, ReturnEarlyOnErrorAndAssignOnSuccess) {
  int out = 0;
  EXPECT_TRUE(UseMacros(8, &out).ok());
  EXPECT_EQ(out, 4);
  EXPECT_EQ(UseMacros(7, &out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UseMacros(40, &out).code(), absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace strata
