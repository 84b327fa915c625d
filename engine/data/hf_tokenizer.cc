// Encode and Decode of HfTokenizer; loading and validation live in hf_tokenizer_load.cc.
#include "engine/data/hf_tokenizer.h"

#include <cctype>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace megatrain {

const HfTokenizer::AddedToken* HfTokenizer::MatchAddedToken(absl::string_view text) const {
  for (int32_t index : added_by_first_byte_[static_cast<unsigned char>(text[0])]) {
    const AddedToken& token = added_[index];
    if (absl::StartsWith(text, token.content)) return &token;  // longest first
  }
  return nullptr;
}

std::vector<int32_t> HfTokenizer::Encode(absl::string_view input) const {
  const std::string text = RepairUtf8(input);
  const absl::string_view view(text);
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  size_t start = 0;  // first byte not yet encoded
  size_t i = 0;
  while (i < view.size()) {
    const AddedToken* added = added_by_first_byte_[static_cast<unsigned char>(view[i])].empty()
                                  ? nullptr
                                  : MatchAddedToken(view.substr(i));
    if (added == nullptr) {
      ++i;
      continue;
    }
    EncodeSection(view.substr(start, i - start), &ids);
    ids.push_back(added->id);
    i += added->content.size();
    start = i;
  }
  EncodeSection(view.substr(start), &ids);
  return ids;
}

void HfTokenizer::EncodeSection(absl::string_view section, std::vector<int32_t>* ids) const {
  if (section.empty()) return;
  std::string text(section);
  for (const NormalizerStep& step : normalizers_) {
    switch (step.kind) {
      case NormalizerStep::kNfc:
        text = NfcNormalize(text);
        break;
      case NormalizerStep::kPrepend:
        text = absl::StrCat(step.to, text);
        break;
      case NormalizerStep::kReplace:
        text = absl::StrReplaceAll(text, {{step.from, step.to}});
        break;
    }
  }
  if (text.empty()) return;
  std::vector<absl::string_view> pieces;
  if (split_.has_value()) {
    pieces = split_->Split(text);
  } else {
    pieces.push_back(text);
  }
  const size_t first = ids->size();
  for (absl::string_view piece : pieces) {
    if (byte_level_) {
      model_->EncodeWord(ByteLevelEncode(piece), ids);
    } else {
      model_->EncodeWord(piece, ids);
    }
  }
  if (fuse_unk_ && unk_id_ >= 0) {
    size_t out = first;
    for (size_t in = first; in < ids->size(); ++in) {
      const int32_t id = (*ids)[in];
      if (id == unk_id_ && out > first && (*ids)[out - 1] == unk_id_) continue;
      (*ids)[out++] = id;
    }
    ids->resize(out);
  }
}

void HfTokenizer::ApplyDecoderStep(const DecoderStep& step,
                                   const absl::flat_hash_set<std::string>& added_contents,
                                   std::vector<std::string>* tokens) {
  std::vector<std::string> out;
  switch (step.kind) {
    case DecoderStep::kReplace:
      for (std::string& token : *tokens) token = absl::StrReplaceAll(token, {{step.from, step.to}});
      return;
    case DecoderStep::kFuse:
      out.push_back(absl::StrJoin(*tokens, ""));
      break;
    case DecoderStep::kStrip:
      for (std::string& token : *tokens) {
        absl::string_view rest(token);
        for (int i = 0; i < step.start && absl::ConsumePrefix(&rest, step.from); ++i) {
        }
        for (int i = 0; i < step.stop && absl::ConsumeSuffix(&rest, step.from); ++i) {
        }
        token = std::string(rest);
      }
      return;
    case DecoderStep::kByteFallback: {
      // Runs of "<0xXX>" tokens become their bytes, decoded as UTF-8.
      std::string bytes;
      for (std::string& token : *tokens) {
        if (token.size() == 6 && absl::StartsWith(token, "<0x") && token[5] == '>' &&
            std::isxdigit(static_cast<unsigned char>(token[3])) &&
            std::isxdigit(static_cast<unsigned char>(token[4]))) {
          bytes.push_back(static_cast<char>(std::stoi(token.substr(3, 2), nullptr, 16)));
          continue;
        }
        if (!bytes.empty()) out.push_back(RepairUtf8(bytes));
        bytes.clear();
        out.push_back(std::move(token));
      }
      if (!bytes.empty()) out.push_back(RepairUtf8(bytes));
      break;
    }
    case DecoderStep::kByteLevel: {
      // Added tokens pass through as they are; runs of other tokens are mapped back from
      // the byte alphabet and decoded as UTF-8.
      std::string run;
      bool in_run = false;
      for (std::string& token : *tokens) {
        if (added_contents.contains(token)) {
          if (in_run) out.push_back(RepairUtf8(ByteLevelDecode(run)));
          run.clear();
          in_run = false;
          out.push_back(std::move(token));
        } else {
          run += token;
          in_run = true;
        }
      }
      if (in_run) out.push_back(RepairUtf8(ByteLevelDecode(run)));
      break;
    }
  }
  *tokens = std::move(out);
}

absl::StatusOr<std::string> HfTokenizer::Decode(absl::Span<const int32_t> ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size_) {
      return absl::OutOfRangeError(
          absl::StrCat(name_, ": cannot decode id ", id, "; ids are in [0, ", vocab_size_, ")"));
    }
    tokens.push_back(id_to_token_[id]);
  }
  if (!has_decoder_) return absl::StrJoin(tokens, " ");
  for (const DecoderStep& step : decoders_) ApplyDecoderStep(step, added_contents_, &tokens);
  return absl::StrJoin(tokens, "");
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(
    const std::string& tokenizer_json_path, const std::string& tokenizer_config_json_path) {
  absl::StatusOr<std::unique_ptr<HfTokenizer>> tokenizer =
      HfTokenizer::Load(tokenizer_json_path, tokenizer_config_json_path);
  if (!tokenizer.ok()) return tokenizer.status();
  return std::unique_ptr<Tokenizer>(std::move(tokenizer).value());
}

}  // namespace megatrain
