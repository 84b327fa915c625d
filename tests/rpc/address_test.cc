// ResolveAddress(): flag over $MEGATRAIN_ADDR over the default; and the default's rule.
#include "rpc/address.h"

#include <stdlib.h>

#include "gtest/gtest.h"

namespace megatrain {
namespace {

// Sets or unsets $MEGATRAIN_ADDR for one test and restores it afterwards.
class ScopedAddressEnv {
 public:
  explicit ScopedAddressEnv(const char* value) {
    if (const char* old = getenv(kAddressEnvVar)) {
      old_ = old;
      had_old_ = true;
    }
    if (value == nullptr)
      unsetenv(kAddressEnvVar);
    else
      setenv(kAddressEnvVar, value, 1);
  }
  ~ScopedAddressEnv() {
    if (had_old_)
      setenv(kAddressEnvVar, old_.c_str(), 1);
    else
      unsetenv(kAddressEnvVar);
  }

 private:
  std::string old_;
  bool had_old_ = false;
};

TEST(ResolveAddress, FlagWinsOverEnv) {
  ScopedAddressEnv env("unix:/tmp/from-env.sock");
  EXPECT_EQ(ResolveAddress("localhost:7000"), "localhost:7000");
}

TEST(ResolveAddress, EnvWhenNoFlag) {
  ScopedAddressEnv env("unix:///tmp/from-env.sock");
  EXPECT_EQ(ResolveAddress(""), "unix:///tmp/from-env.sock");
}

TEST(ResolveAddress, EmptyEnvCountsAsUnset) {
  ScopedAddressEnv env("");
  EXPECT_EQ(ResolveAddress(""), DefaultAddress());
}

TEST(ResolveAddress, DefaultWhenNeitherFlagNorEnv) {
  ScopedAddressEnv env(nullptr);
  EXPECT_EQ(ResolveAddress(""), DefaultAddress());
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
