// ResolveAddress(): the flag over $MEGATRAIN_ADDR's value over the default; and the
// default's rule.
#include "rpc/address.h"

#include "gtest/gtest.h"

namespace megatrain {
namespace {

TEST(ResolveAddress, FlagWinsOverEnv) {
  EXPECT_EQ(ResolveAddress("localhost:7000", "unix:/tmp/from-env.sock"), "localhost:7000");
}

TEST(ResolveAddress, EnvWhenNoFlag) {
  EXPECT_EQ(ResolveAddress("", "unix:///tmp/from-env.sock"), "unix:///tmp/from-env.sock");
}

TEST(ResolveAddress, DefaultWhenNeitherFlagNorEnv) {
  EXPECT_EQ(ResolveAddress("", ""), DefaultAddress());
}

TEST(DefaultAddressFor, RootAlwaysUsesTheSystemSocket) {
  EXPECT_EQ(DefaultAddressFor(0, false), "unix:/run/megatrain/megatrain.sock");
  EXPECT_EQ(DefaultAddressFor(0, true), "unix:/run/megatrain/megatrain.sock");
}

TEST(DefaultAddressFor, UserPrefersAnInstalledSystemDaemon) {
  EXPECT_EQ(DefaultAddressFor(1000, true), "unix:/run/megatrain/megatrain.sock");
}

TEST(DefaultAddressFor, UserWithoutSystemDaemonUsesAPerUidSocket) {
  EXPECT_EQ(DefaultAddressFor(1000, false), "unix:/tmp/megatrain-1000/megatrain.sock");
}

TEST(UnixSocketPath, ShortAndUriFormsGiveThePath) {
  EXPECT_EQ(UnixSocketPath("unix:/run/x.sock").value_or(""), "/run/x.sock");
  EXPECT_EQ(UnixSocketPath("unix:///run/x.sock").value_or(""), "/run/x.sock");
}

TEST(UnixSocketPath, TcpAndEmptyPathsGiveNothing) {
  EXPECT_FALSE(UnixSocketPath("localhost:7000").has_value());
  EXPECT_FALSE(UnixSocketPath("unix:").has_value());
  EXPECT_FALSE(UnixSocketPath("dns:///host:1").has_value());
}

}  // namespace
}  // namespace megatrain
