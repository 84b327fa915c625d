// DPO's reference log-probabilities in the job's folder (job/reference_logps.h): saved as
// the pass goes and resumed where it stopped, bit for bit; a file of another model or
// dataset, or not ours, refused naming it.
#include "engine/job/reference_logps.h"

#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace megatrain {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

TEST(ReferenceLogps, AnInterruptedPassResumesWhereItStoppedBitForBit) {
  TempDir dir;
  const std::string path = dir.Join("reference_logps.json");
  absl::StatusOr<ReferenceLogps> r = ReferenceLogps::Open(path, "model-a/data-b", 3);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->done(), 0);
  r->Append(-12.345678901234567, -0.1 / 3);
  r->Append(-1e-300, -98765.4321);
  ASSERT_TRUE(r->Save().ok());

  absl::StatusOr<ReferenceLogps> again = ReferenceLogps::Open(path, "model-a/data-b", 3);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->done(), 2);
  EXPECT_FALSE(again->complete());
  EXPECT_EQ(again->Get(0), std::make_pair(-12.345678901234567, -0.1 / 3));
  EXPECT_EQ(again->Get(1), std::make_pair(-1e-300, -98765.4321));
  again->Append(-7.0, -8.0);
  EXPECT_TRUE(again->complete());
  ASSERT_TRUE(again->Save().ok());
  absl::StatusOr<ReferenceLogps> whole = ReferenceLogps::Open(path, "model-a/data-b", 3);
  ASSERT_TRUE(whole.ok());
  EXPECT_TRUE(whole->complete());
  EXPECT_EQ(whole->Get(2), std::make_pair(-7.0, -8.0));
}

TEST(ReferenceLogps, AFileOfAnotherModelOrDatasetIsRefusedNamingIt) {
  TempDir dir;
  const std::string path = dir.Join("reference_logps.json");
  absl::StatusOr<ReferenceLogps> r = ReferenceLogps::Open(path, "model-a/data-b", 2);
  ASSERT_TRUE(r.ok());
  r->Append(-1, -2);
  ASSERT_TRUE(r->Save().ok());
  absl::StatusOr<ReferenceLogps> other = ReferenceLogps::Open(path, "model-c/data-b", 2);
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(other.status().message()),
              HasSubstr(path + " holds the reference log-probabilities of another model or "
                               "dataset (2 pairs, fingerprint model-a/data-b; this job's: 2 "
                               "pairs, model-c/data-b)"));
  EXPECT_FALSE(ReferenceLogps::Open(path, "model-a/data-b", 5).ok());  // other pairs

  std::ofstream(path) << "{\"fingerprint\": 3}";
  absl::StatusOr<ReferenceLogps> junk = ReferenceLogps::Open(path, "model-a/data-b", 2);
  ASSERT_FALSE(junk.ok());
  EXPECT_THAT(std::string(junk.status().message()),
              HasSubstr(path + " is not a reference log-probability file: no fingerprint or "
                               "pair count; delete it"));
  std::ofstream(path) << R"({"fingerprint": "model-a/data-b", "pairs": 2, "chosen": [1, 2, 3],
                            "rejected": [1, 2, 3]})";
  EXPECT_FALSE(ReferenceLogps::Open(path, "model-a/data-b", 2).ok());  // more values than pairs
}

}  // namespace
}  // namespace megatrain
