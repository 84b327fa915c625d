#include "engine/backend/nccl.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstdio>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/common/cuda_check.h"
#include "engine/common/engine_settings.h"

namespace megatrain {
namespace {

// The entry points we use, resolved once per process.
struct NcclApi {
  ncclResult_t (*get_version)(int*) = nullptr;
  ncclResult_t (*comm_init_all)(ncclComm_t*, int, const int*) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  ncclResult_t (*reduce_scatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                 ncclComm_t, cudaStream_t) = nullptr;
  const char* (*error_string)(ncclResult_t) = nullptr;
  std::string description;
};

absl::StatusOr<const NcclApi*> LoadNccl() {
  static std::once_flag once;
  static absl::StatusOr<const NcclApi*> loaded = absl::UnknownError("not loaded");
  std::call_once(once, [] {
    const std::string& given = GetEngineSettings().nccl_library;
    const std::vector<std::string> names =
        !given.empty() ? std::vector<std::string>{given}
                       : std::vector<std::string>{"libnccl.so.2", "libnccl.so"};
    void* lib = nullptr;
    std::string tried, name;
    for (const std::string& n : names) {
      lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) {
        name = n;
        break;
      }
      absl::StrAppend(&tried, tried.empty() ? "" : "; ", dlerror());
    }
    if (lib == nullptr) {
      loaded = absl::UnavailableError(absl::StrCat(
          "NCCL is not loadable (", tried,
          "); set MEGATRAIN_NCCL_LIBRARY to a libnccl.so.2, or add its folder to "
          "LD_LIBRARY_PATH"));
      return;
    }
    static NcclApi api;
    bool ok = true;
    auto bind = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
      ok = ok && fn != nullptr;
    };
    bind(api.get_version, "ncclGetVersion");
    bind(api.comm_init_all, "ncclCommInitAll");
    bind(api.comm_destroy, "ncclCommDestroy");
    bind(api.reduce_scatter, "ncclReduceScatter");
    bind(api.error_string, "ncclGetErrorString");
    int version = 0;
    if (!ok || api.get_version(&version) != ncclSuccess) {
      loaded = absl::UnavailableError(absl::StrCat(name, " is not a usable NCCL library"));
      return;
    }
    // NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9.
    api.description = absl::StrCat("NCCL ", version / 10000, ".", version / 100 % 100, ".",
                                   version % 100, " (", name, ")");
    loaded = &api;
  });
  return loaded;
}

class NcclCollective final : public GradCollective {
 public:
  NcclCollective(const NcclApi* api, ncclComm_t comm, NcclRank rank, int index, int size)
      : api_(api), comm_(comm), rank_(rank), index_(index), size_(size) {}
  ~NcclCollective() override {
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(rank_.device);
    api_->comm_destroy(comm_);
    cudaSetDevice(current);  // the caller's thread keeps its device
  }
  int rank() const override { return index_; }
  int size() const override { return size_; }
  void ReduceScatter(void* buf, int64_t shard, StreamId stream) override {
    float* grad = static_cast<float*>(buf);
    // In place: rank r's shard of the sum lands where its own shard was. A failure is
    // like a failed kernel launch: the step cannot go on with a gradient missing.
    MT_NCCL_CHECK(api_, api_->reduce_scatter(
                            grad, grad + index_ * shard, static_cast<size_t>(shard), ncclFloat32,
                            ncclSum, comm_,
                            static_cast<cudaStream_t>(rank_.streams[static_cast<int>(stream)])));
  }
  std::string description() const override { return api_->description; }

 private:
  const NcclApi* api_;
  ncclComm_t comm_;
  NcclRank rank_;
  int index_, size_;
};

}  // namespace

absl::StatusOr<std::string> NcclVersion() {
  absl::StatusOr<const NcclApi*> api = LoadNccl();
  if (!api.ok()) return api.status();
  return (*api)->description;
}

absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> CreateNcclCollectives(
    const std::vector<NcclRank>& ranks) {
  absl::StatusOr<const NcclApi*> api = LoadNccl();
  if (!api.ok()) return api.status();
  std::vector<int> devices;
  for (const NcclRank& r : ranks) devices.push_back(r.device);
  std::vector<ncclComm_t> comms(ranks.size());
  const ncclResult_t r =
      (*api)->comm_init_all(comms.data(), static_cast<int>(comms.size()), devices.data());
  if (r != ncclSuccess) {
    return absl::UnavailableError(
        absl::StrCat("ncclCommInitAll over ", ranks.size(), " devices failed: ",
                     (*api)->error_string(r)));
  }
  std::vector<std::unique_ptr<GradCollective>> out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    out.push_back(std::make_unique<NcclCollective>(*api, comms[i], ranks[i],
                                                   static_cast<int>(i),
                                                   static_cast<int>(ranks.size())));
  }
  return out;
}

}  // namespace megatrain
