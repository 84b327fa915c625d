// Loading of HfTokenizer: tokenizer.json and tokenizer_config.json into the pipeline.
//
// nlohmann::json throws on malformed input and on a field of the wrong type; both are
// caught in Load, at the boundary, and become InvalidArgument naming the file.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/common/durable_file.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/data/hf_tokenizer.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

using Json = nlohmann::json;

absl::StatusOr<Json> ReadJson(const std::string& path) {
  // A FIFO or a device is refused without blocking, a missing file is NotFound.
  absl::StatusOr<std::string> text = ReadWholeFile(path);
  if (!text.ok()) return text.status();
  Json doc = Json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  }
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": expected a JSON object"));
  }
  return doc;
}

absl::Status Unsupported(const std::string& path, absl::string_view component,
                         absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": ", component, " ", what, " is not supported"));
}

std::string TypeOf(const Json& j) {
  auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : "<none>";
}

bool FlagOf(const Json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<bool>();
}

// The literal of a {"String": s} pattern, or an error naming the component.
absl::StatusOr<std::string> StringPattern(const Json& j, const std::string& path,
                                          absl::string_view component) {
  const Json& pattern = j.at("pattern");
  if (!pattern.contains("String")) return Unsupported(path, component, "with a Regex pattern");
  std::string literal = pattern.at("String").get<std::string>();
  if (literal.empty()) return Unsupported(path, component, "with an empty pattern");
  return literal;
}

// A special token in tokenizer_config.json: a string, {"content": s}, or null.
std::string SpecialTokenContent(const Json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  return it->at("content").get<std::string>();
}

// Whether `token` has U+2581 right after another code point.
bool HasMetaspaceAfterOther(absl::string_view token) {
  constexpr absl::string_view kMetaspace = "\xE2\x96\x81";
  for (size_t hit = token.find(kMetaspace, 1); hit != absl::string_view::npos;
       hit = token.find(kMetaspace, hit + kMetaspace.size())) {
    if (hit < kMetaspace.size() ||
        token.substr(hit - kMetaspace.size(), kMetaspace.size()) != kMetaspace) {
      return true;
    }
  }
  return false;
}

// Ids index a table: one far past the number of tokens would make it huge. Real
// vocabularies stay below 2^20.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// The id `v` gives `token`, an integer in [0, kMaxTokenId]; InvalidArgument naming `path`.
absl::StatusOr<int32_t> TokenIdOf(const Json& v, const std::string& token,
                                  const std::string& path) {
  const bool in_range =
      v.is_number_integer() &&
      (v.is_number_unsigned() ? v.get<uint64_t>() <= kMaxTokenId
                              : v.get<int64_t>() >= 0 && v.get<int64_t>() <= kMaxTokenId);
  if (!in_range) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": token '", token, "' has id ", v.dump(), "; ids must be integers from 0 to ",
        kMaxTokenId, " (larger than megatrain supports)"));
  }
  return static_cast<int32_t>(v.get<int64_t>());
}

// The steps of a component that may be one step or a {"type": "Sequence", key: [...]}.
std::vector<const Json*> StepsOf(const Json& doc, const char* component, const char* key) {
  std::vector<const Json*> steps;
  if (auto it = doc.find(component); it != doc.end() && !it->is_null()) {
    if (TypeOf(*it) == "Sequence") {
      for (const Json& step : it->at(key)) steps.push_back(&step);
    } else {
      steps.push_back(&*it);
    }
  }
  return steps;
}

}  // namespace

// Load's stages, one per part of tokenizer.json (and tokenizer_config.json), each filling
// its members of the tokenizer. nlohmann::json's exceptions pass through them to Load.
struct HfTokenizer::Loader {
  // The BPE vocabulary as the model read it, for the id table.
  struct Vocab {
    std::vector<std::pair<int32_t, std::string>> id_tokens;  // (id, token)
    int64_t max_id = -1;
  };

  // normalizer: NFC, Prepend and Replace (with a String pattern), alone or in a Sequence.
  static absl::Status Normalizers(const Json& doc, const std::string& json_path,
                                  HfTokenizer* tok) {
    for (const Json* n : StepsOf(doc, "normalizer", "normalizers")) {
      const std::string type = TypeOf(*n);
      if (type == "NFC") {
        tok->normalizers_.push_back({NormalizerStep::kNfc, "", ""});
      } else if (type == "Prepend") {
        tok->normalizers_.push_back({NormalizerStep::kPrepend, "", n->at("prepend")});
      } else if (type == "Replace") {
        absl::StatusOr<std::string> from = StringPattern(*n, json_path, "normalizer Replace");
        if (!from.ok()) return from.status();
        tok->normalizers_.push_back({NormalizerStep::kReplace, *from, n->at("content")});
      } else {
        return Unsupported(json_path, "normalizer", absl::StrCat("type '", type, "'"));
      }
    }
    return absl::OkStatus();
  }

  // pre_tokenizer: [Split] then [ByteLevel].
  static absl::Status PreTokenizers(const Json& doc, const std::string& json_path,
                                    HfTokenizer* tok) {
    for (const Json* p : StepsOf(doc, "pre_tokenizer", "pretokenizers")) {
      const std::string type = TypeOf(*p);
      if (type == "Split") {
        if (tok->split_.has_value() || tok->byte_level_) {
          return Unsupported(json_path, "pre_tokenizer", "Split after Split or ByteLevel");
        }
        const Json& pattern = p->at("pattern");
        if (!pattern.contains("Regex")) {
          return Unsupported(json_path, "pre_tokenizer", "Split with a String pattern");
        }
        if (p->value("behavior", std::string()) != "Isolated" || FlagOf(*p, "invert", false)) {
          return Unsupported(json_path, "pre_tokenizer",
                             "Split with a behavior other than Isolated or with invert true");
        }
        absl::StatusOr<RegexSplitter> splitter =
            RegexSplitter::Create(pattern.at("Regex").get<std::string>());
        if (!splitter.ok()) {
          return absl::InvalidArgumentError(absl::StrCat(
              json_path, ": pre_tokenizer Split regex: ", splitter.status().message()));
        }
        tok->split_.emplace(std::move(splitter).value());
      } else if (type == "ByteLevel") {
        if (tok->byte_level_ || FlagOf(*p, "add_prefix_space", true) ||
            FlagOf(*p, "use_regex", true)) {
          return Unsupported(json_path, "pre_tokenizer",
                             "ByteLevel with add_prefix_space or use_regex true");
        }
        tok->byte_level_ = true;
      } else {
        return Unsupported(json_path, "pre_tokenizer", absl::StrCat("type '", type, "'"));
      }
    }
    return absl::OkStatus();
  }

  // model: BPE (no dropout, subword prefix or word suffix), its vocab and merges.
  static absl::StatusOr<Vocab> Model(const Json& doc, const std::string& json_path,
                                     HfTokenizer* tok) {
    const Json& model = doc.at("model");
    if (TypeOf(model) != "BPE") {
      return Unsupported(json_path, "model", absl::StrCat("type '", TypeOf(model), "'"));
    }
    if (model.contains("dropout") && !model.at("dropout").is_null()) {
      return Unsupported(json_path, "model BPE", "dropout");
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (model.contains(key) && !model.at(key).is_null() &&
          !model.at(key).get<std::string>().empty()) {
        return Unsupported(json_path, "model BPE", key);
      }
    }
    BpeModelOptions options;
    options.byte_fallback = FlagOf(model, "byte_fallback", false);
    options.ignore_merges = FlagOf(model, "ignore_merges", false);
    tok->fuse_unk_ = FlagOf(model, "fuse_unk", false);
    options.vocab.reserve(model.at("vocab").size());
    Vocab vocab;
    for (const auto& [token, id] : model.at("vocab").items()) {
      ASSIGN_OR_RETURN(const int32_t value, TokenIdOf(id, token, json_path));
      options.vocab.emplace(token, value);
      vocab.max_id = std::max<int64_t>(vocab.max_id, value);
    }
    options.merges.reserve(model.at("merges").size());
    for (const Json& merge : model.at("merges")) {
      if (merge.is_string()) {
        const std::string text = merge.get<std::string>();
        const size_t space = text.find(' ');
        if (space == std::string::npos) {
          return absl::InvalidArgumentError(absl::StrCat(json_path, ": model BPE merge '", text,
                                                         "' is not two tokens split by a space"));
        }
        options.merges.emplace_back(text.substr(0, space), text.substr(space + 1));
      } else {
        options.merges.emplace_back(merge.at(0).get<std::string>(),
                                    merge.at(1).get<std::string>());
      }
    }
    if (auto it = model.find("unk_token"); it != model.end() && !it->is_null()) {
      auto unk = options.vocab.find(it->get<std::string>());
      if (unk != options.vocab.end()) options.unk_id = unk->second;
    }
    tok->unk_id_ = options.unk_id;
    if (!tok->split_.has_value() && !tok->byte_level_ && !options.ignore_merges) {
      tok->split_before_metaspace_ =
          std::none_of(options.vocab.begin(), options.vocab.end(),
                       [](const auto& entry) { return HasMetaspaceAfterOther(entry.first); });
    }
    absl::flat_hash_map<std::string, int32_t> vocab_copy = options.vocab;
    absl::StatusOr<BpeModel> bpe = BpeModel::Create(std::move(options));
    if (!bpe.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(json_path, ": model BPE: ", bpe.status().message()));
    }
    tok->model_.emplace(std::move(bpe).value());
    for (const auto& [token, id] : vocab_copy) vocab.id_tokens.emplace_back(id, token);
    return vocab;
  }

  // added_tokens: whole-string matches (no single_word, lstrip, rstrip or normalized); they
  // take their ids from the vocab's tokens, and extend *vocab.
  static absl::Status AddedTokens(const Json& doc, const std::string& json_path, Vocab* vocab,
                                  HfTokenizer* tok) {
    auto it = doc.find("added_tokens");
    if (it == doc.end() || it->is_null()) return absl::OkStatus();
    for (const Json& a : *it) {
      const std::string content = a.at("content").get<std::string>();
      const bool special = FlagOf(a, "special", false);
      for (const char* key : {"single_word", "lstrip", "rstrip"}) {
        if (FlagOf(a, key, false)) {
          return Unsupported(json_path, "added_tokens",
                             absl::StrCat("entry '", content, "' with ", key, " true"));
        }
      }
      if (FlagOf(a, "normalized", !special)) {
        return Unsupported(json_path, "added_tokens",
                           absl::StrCat("entry '", content, "' with normalized true"));
      }
      if (content.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(json_path, ": added_tokens has an entry with empty content"));
      }
      ASSIGN_OR_RETURN(const int32_t id, TokenIdOf(a.at("id"), content, json_path));
      vocab->max_id = std::max<int64_t>(vocab->max_id, id);
      vocab->id_tokens.emplace_back(id, content);
      tok->added_.push_back({content, id});
      tok->added_contents_.insert(content);
    }
    return absl::OkStatus();
  }

  // The id -> token table (added tokens over the vocab's) and the added tokens' index by
  // first byte, longest first.
  static absl::Status IndexTokens(const std::string& json_path, Vocab vocab, HfTokenizer* tok) {
    if (vocab.max_id < 0) {
      return absl::InvalidArgumentError(absl::StrCat(json_path, ": model BPE has no vocab"));
    }
    tok->vocab_size_ = vocab.max_id + 1;
    tok->id_to_token_.resize(static_cast<size_t>(tok->vocab_size_));
    for (auto& [id, token] : vocab.id_tokens) {
      if (id < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(json_path, ": token '", token, "' has negative id ", id));
      }
      tok->id_to_token_[id] = std::move(token);  // added tokens override the vocab
    }
    tok->added_by_first_byte_.resize(256);
    for (size_t i = 0; i < tok->added_.size(); ++i) {
      const unsigned char first = static_cast<unsigned char>(tok->added_[i].content[0]);
      tok->added_by_first_byte_[first].push_back(static_cast<int32_t>(i));
      if (!tok->starts_added_[first]) ++tok->num_added_first_bytes_;
      tok->starts_added_[first] = true;
      tok->added_first_byte_ = static_cast<char>(first);
    }
    for (std::vector<int32_t>& bucket : tok->added_by_first_byte_) {
      std::stable_sort(bucket.begin(), bucket.end(), [&](int32_t a, int32_t b) {
        return tok->added_[a].content.size() > tok->added_[b].content.size();
      });
    }
    return absl::OkStatus();
  }

  // decoder: ByteLevel, ByteFallback, Fuse, Replace (String pattern) and Strip, alone or in
  // a Sequence; none: tokens are joined with ' '.
  static absl::Status Decoders(const Json& doc, const std::string& json_path, HfTokenizer* tok) {
    if (auto it = doc.find("decoder"); it != doc.end() && !it->is_null()) tok->has_decoder_ = true;
    for (const Json* d : StepsOf(doc, "decoder", "decoders")) {
      const std::string type = TypeOf(*d);
      DecoderStep step;
      if (type == "ByteLevel") {
        step.kind = DecoderStep::kByteLevel;
      } else if (type == "ByteFallback") {
        step.kind = DecoderStep::kByteFallback;
      } else if (type == "Fuse") {
        step.kind = DecoderStep::kFuse;
      } else if (type == "Replace") {
        absl::StatusOr<std::string> from = StringPattern(*d, json_path, "decoder Replace");
        if (!from.ok()) return from.status();
        step = {DecoderStep::kReplace, *from, d->value("content", std::string())};
      } else if (type == "Strip") {
        int counts[2] = {0, 0};
        for (int i = 0; i < 2; ++i) {
          const char* key = i == 0 ? "start" : "stop";
          const auto it = d->find(key);
          if (it == d->end()) continue;
          if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > 1024) {
            return absl::InvalidArgumentError(absl::StrCat(
                json_path, ": decoder Strip ", key, " is ", it->dump(),
                "; expected a small non-negative integer"));
          }
          counts[i] = static_cast<int>(it->get<int64_t>());
        }
        step = {DecoderStep::kStrip, d->value("content", std::string()), "", counts[0],
                counts[1]};
      } else {
        return Unsupported(json_path, "decoder", absl::StrCat("type '", type, "'"));
      }
      tok->decoders_.push_back(std::move(step));
    }
    return absl::OkStatus();
  }

  // tokenizer_config.json: bos (unless add_bos_token is false) and eos, by content, from
  // the added tokens or the vocab.
  static absl::Status SpecialTokens(const Json& config, const std::string& config_path,
                                    const std::string& json_path, HfTokenizer* tok) {
    auto id_of = [&](const std::string& content) -> absl::StatusOr<int32_t> {
      for (const AddedToken& added : tok->added_) {
        if (added.content == content) return added.id;
      }
      const int32_t id = tok->model_->TokenId(content);
      if (id < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(config_path, ": special token '", content, "' is not in ", json_path));
      }
      return id;
    };
    const std::string bos = SpecialTokenContent(config, "bos_token");
    if (!bos.empty() && FlagOf(config, "add_bos_token", true)) {
      ASSIGN_OR_RETURN(tok->bos_id_, id_of(bos));
    }
    const std::string eos = SpecialTokenContent(config, "eos_token");
    if (!eos.empty()) {
      ASSIGN_OR_RETURN(tok->eos_id_, id_of(eos));
    }
    return absl::OkStatus();
  }
};

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::Load(const std::string& json_path,
                                                               const std::string& config_path) {
  absl::StatusOr<Json> doc_or = ReadJson(json_path);
  if (!doc_or.ok()) return doc_or.status();
  std::optional<Json> config;
  if (!config_path.empty()) {
    absl::StatusOr<Json> config_or = ReadJson(config_path);
    if (!config_or.ok()) return config_or.status();
    config = std::move(config_or).value();
  }
  const Json& doc = *doc_or;
  std::unique_ptr<HfTokenizer> tok(new HfTokenizer());
  tok->name_ = absl::StrCat("hf-bpe:", json_path);
  tok->json_path_ = json_path;
  static std::atomic<uint64_t> next_scratch_key{1};
  tok->scratch_key_ = next_scratch_key.fetch_add(1);
  std::string where = json_path;  // the file that a type error is reported against
  try {
    RETURN_IF_ERROR(Loader::Normalizers(doc, json_path, tok.get()));
    RETURN_IF_ERROR(Loader::PreTokenizers(doc, json_path, tok.get()));
    ASSIGN_OR_RETURN(Loader::Vocab vocab, Loader::Model(doc, json_path, tok.get()));
    RETURN_IF_ERROR(Loader::AddedTokens(doc, json_path, &vocab, tok.get()));
    RETURN_IF_ERROR(Loader::IndexTokens(json_path, std::move(vocab), tok.get()));
    RETURN_IF_ERROR(Loader::Decoders(doc, json_path, tok.get()));
    if (config.has_value()) {
      where = config_path;
      RETURN_IF_ERROR(Loader::SpecialTokens(*config, config_path, json_path, tok.get()));
    }
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": unexpected structure (", Printable(e.what()), ")"));
  }
  return tok;
}

}  // namespace megatrain
