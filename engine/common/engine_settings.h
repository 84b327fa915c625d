// The engine's process-wide settings: what a program's main() reads from its environment,
// once, before any thread starts, and installs with SetEngineSettings(). Nothing below
// main reads the environment; the parts of the engine these settings steer read them here.
//
//   int main(int argc, char** argv) {
//     megatrain::SetEngineSettings(megatrain::EngineSettingsFromEnvironment(
//         [](const char* name) { return std::getenv(name); }));
//
// The variables, as the README names them:
//   MEGATRAIN_ATTENTION           "mma": attention.cu's kernels everywhere; else the Hopper
//                                 kernels where they apply (sm_90, head_dim 64 or 128)
//   MEGATRAIN_ATTENTION_BACKWARD  "fused" | "fused:K": the one-pass Hopper backward
//   MEGATRAIN_NCCL_LIBRARY        the libnccl.so.2 to load (backend/nccl.h)
//   MEGATRAIN_PROFILE             the machine profile's file (plan/machine_profile.h)
//   XDG_CACHE_HOME, HOME          where machine profiles are kept otherwise
//
// A program that sets nothing runs with the defaults below (what an empty environment
// means). Thread-compatible: set before threads start; a test may set it between cases.
#pragma once

#include <cstdlib>
#include <string>
#include <utility>

namespace megatrain {

// Which attention kernels run (kernels/cuda/ops.h).
struct AttentionKernels {
  bool hopper = true;  // false ("mma"): attention.cu's mma kernels, on every device
  // The one-pass Hopper backward: -1 off (the two passes run); 0 on; K > 0 on, in launches
  // of at most K kv heads.
  int fused_backward_kv_heads = -1;
};

// Where machine profiles are read and cached (plan/machine_profile.h applies the rules).
struct ProfileLocations {
  std::string profile;     // $MEGATRAIN_PROFILE: the one file to use; "" = the rules
  std::string cache_home;  // $XDG_CACHE_HOME; "" = unset
  std::string home;        // $HOME; "" = unset
};

struct EngineSettings {
  AttentionKernels attention;
  std::string nccl_library;  // "" = libnccl.so.2, then libnccl.so, on the loader's path
  ProfileLocations profiles;
};

// The settings an environment asks for: `env(name)` is the variable's value, null when
// unset (main passes getenv; a test, its own table). Empty values count as unset.
template <typename Env>
EngineSettings EngineSettingsFromEnvironment(Env&& env) {
  auto value = [&](const char* name) -> std::string {
    const char* v = env(name);
    return v != nullptr ? std::string(v) : std::string();
  };
  EngineSettings s;
  s.attention.hopper = value("MEGATRAIN_ATTENTION") != "mma";
  const std::string backward = value("MEGATRAIN_ATTENTION_BACKWARD");
  if (backward == "fused") {
    s.attention.fused_backward_kv_heads = 0;
  } else if (backward.rfind("fused:", 0) == 0) {
    const int heads = std::atoi(backward.c_str() + 6);
    s.attention.fused_backward_kv_heads = heads > 0 ? heads : 0;
  }
  s.nccl_library = value("MEGATRAIN_NCCL_LIBRARY");
  s.profiles.profile = value("MEGATRAIN_PROFILE");
  s.profiles.cache_home = value("XDG_CACHE_HOME");
  s.profiles.home = value("HOME");
  return s;
}

namespace engine_settings_internal {
inline EngineSettings& Current() {
  static EngineSettings settings;
  return settings;
}
}  // namespace engine_settings_internal

// Installs the process's settings. REQUIRES: no other thread is using the engine.
inline void SetEngineSettings(EngineSettings settings) {
  engine_settings_internal::Current() = std::move(settings);
}

// The process's settings: the defaults until SetEngineSettings().
inline const EngineSettings& GetEngineSettings() { return engine_settings_internal::Current(); }

}  // namespace megatrain
