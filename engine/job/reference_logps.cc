#include "engine/job/reference_logps.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"
#include "engine/common/durable_file.h"
#include "engine/common/status.h"
#include "nlohmann/json.hpp"

namespace megatrain {

absl::StatusOr<ReferenceLogps> ReferenceLogps::Open(const std::string& path,
                                                    const std::string& fingerprint,
                                                    int64_t num_pairs) {
  ReferenceLogps r;
  r.path_ = path;
  r.fingerprint_ = fingerprint;
  r.num_pairs_ = num_pairs;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return r;
  ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(path));
  const nlohmann::json js = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a reference log-probability file: ", what,
                     "; delete it to compute them again"));
  };
  if (js.is_discarded() || !js.is_object()) return bad("not a JSON object");
  if (!js.contains("fingerprint") || !js["fingerprint"].is_string() || !js.contains("pairs") ||
      !js["pairs"].is_number_integer()) {
    return bad("no fingerprint or pair count");
  }
  const std::string saved = js["fingerprint"].get<std::string>();
  const int64_t pairs = js["pairs"].get<int64_t>();
  if (saved != fingerprint || pairs != num_pairs) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " holds the reference log-probabilities of another model or dataset (",
        pairs, " pairs, fingerprint ", saved, "; this job's: ", num_pairs, " pairs, ",
        fingerprint, "); delete it, or give the job another folder"));
  }
  const nlohmann::json chosen = js.value("chosen", nlohmann::json());
  const nlohmann::json rejected = js.value("rejected", nlohmann::json());
  if (!chosen.is_array() || !rejected.is_array() || chosen.size() != rejected.size() ||
      static_cast<int64_t>(chosen.size()) > num_pairs) {
    return bad("chosen and rejected are not two lists of the same length, at most the pairs");
  }
  for (size_t k = 0; k < chosen.size(); ++k) {
    if (!chosen[k].is_number() || !rejected[k].is_number()) {
      return bad(absl::StrCat("pair ", k, "'s values are not numbers"));
    }
    r.Append(chosen[k].get<double>(), rejected[k].get<double>());
  }
  return r;
}

ReferenceLogps ReferenceLogps::InMemory(int64_t num_pairs) {
  ReferenceLogps r;
  r.num_pairs_ = num_pairs;
  return r;
}

void ReferenceLogps::Append(double chosen, double rejected) {
  MT_CHECK(!complete());
  chosen_.push_back(chosen);
  rejected_.push_back(rejected);
}

std::pair<double, double> ReferenceLogps::Get(int64_t k) const {
  MT_CHECK(k >= 0 && k < done());
  return {chosen_[k], rejected_[k]};
}

absl::Status ReferenceLogps::Save() const {
  if (path_.empty()) return absl::OkStatus();  // InMemory
  const nlohmann::json js = {{"fingerprint", fingerprint_},
                             {"pairs", num_pairs_},
                             {"chosen", chosen_},
                             {"rejected", rejected_}};
  return WriteFileDurably(path_, js.dump() + "\n");
}

}  // namespace megatrain
