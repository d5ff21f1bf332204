// Tests server/errors/cache_error.h: the reason and field an error carries as values, with no
// transport involved.
#include "server/errors/cache_error.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvcellar::server {
namespace {

TEST(CacheErrorTest, CarriesCodeMessageReasonAndField) {
  const absl::Status s = CacheError(absl::StatusCode::kFailedPrecondition,
                                    v1::ERROR_REASON_HANDLE_OPEN_FAILED, "layout.regions[2]",
                                    "layout.regions[2]: no such object");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "layout.regions[2]: no such object");
  EXPECT_EQ(ErrorReasonOf(s), v1::ERROR_REASON_HANDLE_OPEN_FAILED);
  EXPECT_EQ(ErrorFieldOf(s), "layout.regions[2]");
}

TEST(CacheErrorTest, ShorthandsPickTheirCodeAndReason) {
  EXPECT_EQ(ErrorReasonOf(InvalidField("a", "m")), v1::ERROR_REASON_INVALID_FIELD);
  EXPECT_EQ(ErrorReasonOf(LimitExceeded("a", "m")), v1::ERROR_REASON_LIMIT_EXCEEDED);
  EXPECT_EQ(ErrorReasonOf(BlockOutOfRange("a", "m")), v1::ERROR_REASON_BLOCK_OUT_OF_RANGE);
  for (const absl::Status& s : {InvalidField("a", "m"), LimitExceeded("a", "m"),
                                BlockOutOfRange("a", "m")}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ErrorFieldOf(s), "a");
  }
  const absl::Status unknown = SessionUnknown(42);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ErrorReasonOf(unknown), v1::ERROR_REASON_SESSION_UNKNOWN);
  EXPECT_EQ(ErrorFieldOf(unknown), "session_id");
  EXPECT_NE(unknown.message().find("42"), absl::string_view::npos);
}

TEST(CacheErrorTest, WithReasonReplacesReasonAndFieldAndKeepsCodeAndMessage) {
  absl::Status s = InvalidField("old", "the message");
  s = WithReason(s, v1::ERROR_REASON_STEP_MISMATCH, "step_id");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "the message");
  EXPECT_EQ(ErrorReasonOf(s), v1::ERROR_REASON_STEP_MISMATCH);
  EXPECT_EQ(ErrorFieldOf(s), "step_id");
  // An empty field removes the old one.
  s = WithReason(s, v1::ERROR_REASON_INTERNAL, "");
  EXPECT_EQ(ErrorFieldOf(s), "");
}

TEST(CacheErrorTest, OkAndPlainStatusesCarryNothing) {
  EXPECT_TRUE(WithReason(absl::OkStatus(), v1::ERROR_REASON_INTERNAL, "x").ok());
  const absl::Status plain = absl::InternalError("boom");
  EXPECT_EQ(ErrorReasonOf(plain), v1::ERROR_REASON_UNSPECIFIED);
  EXPECT_EQ(ErrorFieldOf(plain), "");
}

TEST(CacheErrorTest, BlockFieldNamesTheSequenceAndTheBlockWithinIt) {
  // Three sequences of 2, 0 and 3 blocks: flat indices 0-1, then 2-4.
  const std::vector<uint32_t> seq_begin = {0, 2, 2, 5};
  EXPECT_EQ(BlockField(seq_begin, 0), "sequences[0].device_blocks[0]");
  EXPECT_EQ(BlockField(seq_begin, 1), "sequences[0].device_blocks[1]");
  EXPECT_EQ(BlockField(seq_begin, 2), "sequences[2].device_blocks[0]");
  EXPECT_EQ(BlockField(seq_begin, 4), "sequences[2].device_blocks[2]");
}

}  // namespace
}  // namespace kvcellar::server
