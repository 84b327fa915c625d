// gpu_test's main: the engine's settings from the environment, as a program's main reads
// them (MEGATRAIN_ATTENTION=mma runs every test on the mma kernels, MEGATRAIN_NCCL_LIBRARY
// names the NCCL the collective test loads), then the tests.
#include <cstdlib>

#include "engine/common/engine_settings.h"
#include "gtest/gtest.h"

int main(int argc, char** argv) {
  megatrain::SetEngineSettings(megatrain::EngineSettingsFromEnvironment(
      [](const char* name) { return std::getenv(name); }));
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
