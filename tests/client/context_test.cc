// ResolveToken(): the --token-file over $MEGATRAIN_TOKEN's value over ~/.config/megatrain/token,
// each as main() hands them over.
#include "client/context.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace megatrain::client {
namespace {

// A home folder holding .config/megatrain/token with `token` (none when empty).
std::string HomeWithToken(const std::string& name, const std::string& token) {
  const std::string home = ::testing::TempDir() + "/" + name;
  std::filesystem::create_directories(home + "/.config/megatrain");
  if (!token.empty()) std::ofstream(home + "/.config/megatrain/token") << token << "\n";
  return home;
}

TEST(ResolveToken, FileWinsOverEnvAndHome) {
  const std::string home = HomeWithToken("token_file_wins", "mt_home");
  const std::string file = home + "/given";
  std::ofstream(file) << "mt_file \r\nsecond line\n";
  EXPECT_EQ(ResolveToken(file, "mt_env", home).value_or("?"), "mt_file");
}

TEST(ResolveToken, EnvWhenNoFile) {
  const std::string home = HomeWithToken("token_env", "mt_home");
  EXPECT_EQ(ResolveToken("", "mt_env", home).value_or("?"), "mt_env");
}

TEST(ResolveToken, HomeTokenWhenNeitherFileNorEnv) {
  const std::string home = HomeWithToken("token_home", "mt_home");
  EXPECT_EQ(ResolveToken("", "", home).value_or("?"), "mt_home");
}

TEST(ResolveToken, EmptyWhenNothingGivesOne) {
  EXPECT_EQ(ResolveToken("", "", HomeWithToken("token_none", "")).value_or("?"), "");
  EXPECT_EQ(ResolveToken("", "", "").value_or("?"), "");
}

TEST(ResolveToken, UnreadableFileIsNotFound) {
  const absl::StatusOr<std::string> token =
      ResolveToken(::testing::TempDir() + "/no-such-token", "mt_env", "");
  EXPECT_TRUE(absl::IsNotFound(token.status())) << token.status();
}

}  // namespace
}  // namespace megatrain::client
