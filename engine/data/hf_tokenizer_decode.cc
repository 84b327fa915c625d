// Decode of HfTokenizer: ids to tokens, then the tokenizer.json decoder chain, in bytes.
//
// The steps follow the JavaScript reference (@huggingface/transformers' decoders) token
// list for token list, with one difference: where the reference turns a run of bytes
// (ByteLevel's alphabet, ByteFallback's "<0xXX>") into text with a TextDecoder, we keep
// the bytes. A run still becomes one token, as there, since a later per-token step (Strip)
// sees it whole. Unrepaired bytes are what makes Decode prefix-stable: a character cut at
// the end of the ids is a prefix of the character, not a U+FFFD that more ids replace.
#include <cctype>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "engine/data/bpe_text.h"
#include "engine/data/hf_tokenizer.h"

namespace megatrain {
namespace {

// The byte of a "<0xXX>" token, or -1.
int FallbackByte(absl::string_view token) {
  if (token.size() != 6 || !absl::StartsWith(token, "<0x") || token[5] != '>') return -1;
  auto hex = [](char c) {
    if (!std::isxdigit(static_cast<unsigned char>(c))) return -1;
    return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
  };
  const int high = hex(token[3]), low = hex(token[4]);
  return high < 0 || low < 0 ? -1 : high * 16 + low;
}

// ByteFallback: each run of "<0xXX>" tokens becomes one token of its bytes.
void DecodeByteFallback(std::vector<std::string>* tokens) {
  std::vector<std::string> out;
  std::string bytes;
  bool in_run = false;
  for (std::string& token : *tokens) {
    const int byte = FallbackByte(token);
    if (byte >= 0) {
      bytes.push_back(static_cast<char>(byte));
      in_run = true;
      continue;
    }
    if (in_run) out.push_back(std::move(bytes));
    bytes.clear();
    in_run = false;
    out.push_back(std::move(token));
  }
  if (in_run) out.push_back(std::move(bytes));
  *tokens = std::move(out);
}

// ByteLevel: each run of tokens other than added ones becomes one token of the bytes its
// code points stand for in the GPT-2 alphabet; added tokens pass as they are.
void DecodeByteLevel(const absl::flat_hash_set<std::string>& added_contents,
                     std::vector<std::string>* tokens) {
  std::vector<std::string> out;
  std::string run;
  bool in_run = false;
  for (std::string& token : *tokens) {
    if (!added_contents.contains(token)) {
      run += ByteLevelDecode(token);
      in_run = true;
      continue;
    }
    if (in_run) out.push_back(std::move(run));
    run.clear();
    in_run = false;
    out.push_back(std::move(token));
  }
  if (in_run) out.push_back(std::move(run));
  *tokens = std::move(out);
}

// Strip: at most `start` leading and `stop` trailing `content`s off each token.
void Strip(absl::string_view content, int start, int stop, std::vector<std::string>* tokens) {
  for (std::string& token : *tokens) {
    absl::string_view rest(token);
    for (int i = 0; i < start && absl::ConsumePrefix(&rest, content); ++i) {
    }
    for (int i = 0; i < stop && absl::ConsumeSuffix(&rest, content); ++i) {
    }
    if (rest.size() != token.size()) token = std::string(rest);
  }
}

}  // namespace

void HfTokenizer::ApplyDecoderStep(const DecoderStep& step,
                                   std::vector<std::string>* tokens) const {
  switch (step.kind) {
    case DecoderStep::kReplace:
      for (std::string& token : *tokens) {
        if (absl::StrContains(token, step.from)) {
          token = absl::StrReplaceAll(token, {{step.from, step.to}});
        }
      }
      return;
    case DecoderStep::kFuse: {
      std::string fused = absl::StrJoin(*tokens, "");
      tokens->assign(1, std::move(fused));
      return;
    }
    case DecoderStep::kStrip:
      Strip(step.from, step.start, step.stop, tokens);
      return;
    case DecoderStep::kByteFallback:
      DecodeByteFallback(tokens);
      return;
    case DecoderStep::kByteLevel:
      DecodeByteLevel(added_contents_, tokens);
      return;
  }
}

std::string HfTokenizer::Decode(absl::Span<const int32_t> ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (id >= 0 && id < vocab_size_) tokens.push_back(id_to_token_[id]);
  }
  if (!has_decoder_) return absl::StrJoin(tokens, " ");
  for (const DecoderStep& step : decoders_) ApplyDecoderStep(step, &tokens);
  return absl::StrJoin(tokens, "");
}

}  // namespace megatrain
