// EngineSettingsFromEnvironment(): each variable main hands over, what its values mean, and
// that an empty environment (or empty values) gives the defaults.
#include "engine/common/engine_settings.h"

#include <map>
#include <string>

#include "gtest/gtest.h"

namespace megatrain {
namespace {

EngineSettings From(const std::map<std::string, std::string>& env) {
  return EngineSettingsFromEnvironment([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(EngineSettings, AnEmptyEnvironmentGivesTheDefaults) {
  const EngineSettings s = From({});
  EXPECT_TRUE(s.attention.hopper);
  EXPECT_EQ(s.attention.fused_backward_kv_heads, -1);
  EXPECT_EQ(s.nccl_library, "");
  EXPECT_EQ(s.profiles.profile, "");
  EXPECT_EQ(s.profiles.cache_home, "");
  EXPECT_EQ(s.profiles.home, "");
}

TEST(EngineSettings, MmaDeclinesTheHopperKernelsAndOtherValuesDoNot) {
  EXPECT_FALSE(From({{"MEGATRAIN_ATTENTION", "mma"}}).attention.hopper);
  EXPECT_TRUE(From({{"MEGATRAIN_ATTENTION", "hopper"}}).attention.hopper);
  EXPECT_TRUE(From({{"MEGATRAIN_ATTENTION", ""}}).attention.hopper);
}

TEST(EngineSettings, FusedBackwardWithAndWithoutACapOnKvHeads) {
  auto heads = [](const char* value) {
    return From({{"MEGATRAIN_ATTENTION_BACKWARD", value}}).attention.fused_backward_kv_heads;
  };
  EXPECT_EQ(heads("fused"), 0);
  EXPECT_EQ(heads("fused:4"), 4);
  EXPECT_EQ(heads("fused:0"), 0);
  EXPECT_EQ(heads("fused:-3"), 0);
  EXPECT_EQ(heads("fusedx"), -1);
  EXPECT_EQ(heads("two-pass"), -1);
  EXPECT_EQ(heads(""), -1);
}

TEST(EngineSettings, PathsAreTakenAsGiven) {
  const EngineSettings s = From({{"MEGATRAIN_NCCL_LIBRARY", "/opt/nccl/libnccl.so.2"},
                                 {"MEGATRAIN_PROFILE", "/srv/profile.json"},
                                 {"XDG_CACHE_HOME", "/scratch/cache"},
                                 {"HOME", "/home/alice"}});
  EXPECT_EQ(s.nccl_library, "/opt/nccl/libnccl.so.2");
  EXPECT_EQ(s.profiles.profile, "/srv/profile.json");
  EXPECT_EQ(s.profiles.cache_home, "/scratch/cache");
  EXPECT_EQ(s.profiles.home, "/home/alice");
}

TEST(EngineSettings, SetReplacesWhatGetReturns) {
  const EngineSettings saved = GetEngineSettings();
  EngineSettings s;
  s.attention.hopper = false;
  s.nccl_library = "x";
  SetEngineSettings(s);
  EXPECT_FALSE(GetEngineSettings().attention.hopper);
  EXPECT_EQ(GetEngineSettings().nccl_library, "x");
  SetEngineSettings(saved);
}

}  // namespace
}  // namespace megatrain
