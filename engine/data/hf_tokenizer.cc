// Encode of HfTokenizer; loading and validation live in hf_tokenizer_load.cc, Decode in
// hf_tokenizer_decode.cc.
#include "engine/data/hf_tokenizer.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"

namespace megatrain {

namespace {

// A cache of pre-token -> ids, two-way set-associative: a pre-token hashes to one pair of
// slots, which hold the last two pre-tokens that landed there. Bounded (1 MiB), never
// allocates after construction. English text reuses a few thousand pre-tokens, so almost
// all are hits. A key is the pre-token zero-padded to kMaxWordBytes, hashed and compared a
// word at a time.
class WordCache {
 public:
  static constexpr size_t kMaxWordBytes = 24;
  static constexpr size_t kMaxIds = 8;
  struct Key {
    uint64_t words[kMaxWordBytes / 8];
    uint64_t size;
  };

  // REQUIRES: word.size() <= kMaxWordBytes.
  static Key MakeKey(absl::string_view word) {
    Key key{};
    key.size = word.size();
    for (size_t i = 0; i < word.size(); i += 8) {
      key.words[i / 8] = LoadUpTo8(word.data() + i, std::min<size_t>(8, word.size() - i));
    }
    return key;
  }

  // Appends the ids of `key` and returns true, or returns false.
  bool Find(const Key& key, std::vector<int32_t>* ids) const {
    const Slot* set = &slots_[SetIndex(key) * 2];
    for (const Slot* slot = set; slot < set + 2; ++slot) {
      if (slot->Holds(key)) {
        for (uint32_t i = 0; i < slot->num_ids; ++i) ids->push_back(slot->ids[i]);
        return true;
      }
    }
    return false;
  }

  // Keeps `ids` for `key`, in place of the older of its set, unless there are too many.
  void Insert(const Key& key, absl::Span<const int32_t> ids) {
    if (ids.size() > kMaxIds) return;
    Slot* set = &slots_[SetIndex(key) * 2];
    set[1] = set[0];
    std::copy(std::begin(key.words), std::end(key.words), set[0].words);
    set[0].size = static_cast<uint32_t>(key.size);
    set[0].num_ids = static_cast<uint32_t>(ids.size());
    std::copy(ids.begin(), ids.end(), set[0].ids);
  }

 private:
  static constexpr int kSetBits = 13;
  struct Slot {
    uint64_t words[kMaxWordBytes / 8] = {};
    uint32_t size = 0;  // 0: empty (an empty pre-token is never looked up)
    uint32_t num_ids = 0;
    int32_t ids[kMaxIds];

    bool Holds(const Key& key) const {
      return size == key.size && words[0] == key.words[0] && words[1] == key.words[1] &&
             words[2] == key.words[2];
    }
  };
  static_assert(sizeof(Slot) == 64);

  // The `size` (1 to 8) bytes at `p`, little-endian, zero-extended; reads no byte past them.
  // Whole loads, not a byte copy into the key, which the loads of the key would then wait on.
  static uint64_t LoadUpTo8(const char* p, size_t size) {
    if (size == 8) {
      uint64_t all;
      std::memcpy(&all, p, 8);
      return all;
    }
    if (size >= 4) {  // two loads of 4 that overlap on equal bytes
      uint32_t first, last;
      std::memcpy(&first, p, 4);
      std::memcpy(&last, p + size - 4, 4);
      return first | static_cast<uint64_t>(last) << (8 * (size - 4));
    }
    auto byte = [&](size_t i) {
      return static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
    };
    return byte(0) | byte(size / 2) | byte(size - 1);
  }

  static size_t SetIndex(const Key& key) {
    uint64_t h = key.size;
    for (uint64_t word : key.words) h = (h ^ word) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(h >> (64 - kSetBits));
  }

  std::vector<Slot> slots_ = std::vector<Slot>(size_t{2} << kSetBits);
};

constexpr absl::string_view kMetaspace = "\xE2\x96\x81";  // U+2581

}  // namespace

struct HfTokenizer::Scratch {
  WordCache cache;
  std::string normalized[2];              // the normalizers write these in turn
  std::string byte_level;                 // a pre-token in the byte alphabet
  std::vector<absl::string_view> pieces;  // the pre-tokens of a section
};

HfTokenizer::Scratch& HfTokenizer::ThreadScratch() const {
  // Kept for the last few tokenizers a thread used. Keys are never reused, so the scratch
  // of a destroyed tokenizer is never found again; it is replaced in turn.
  struct Entry {
    uint64_t key = 0;
    std::unique_ptr<Scratch> scratch;
  };
  thread_local std::array<Entry, 4> entries;
  thread_local size_t next_replaced = 0;
  for (Entry& entry : entries) {
    if (entry.key == scratch_key_) return *entry.scratch;
  }
  Entry& entry = entries[next_replaced++ % entries.size()];
  entry.key = scratch_key_;
  entry.scratch = std::make_unique<Scratch>();
  return *entry.scratch;
}

size_t HfTokenizer::NextAddedTokenStart(absl::string_view text, size_t i) const {
  if (num_added_first_bytes_ == 0 || i >= text.size()) return text.size();
  if (num_added_first_bytes_ == 1) {  // all start with '<' in the tokenizers we know
    const void* hit = std::memchr(text.data() + i, added_first_byte_, text.size() - i);
    return hit == nullptr ? text.size() : static_cast<const char*>(hit) - text.data();
  }
  while (i < text.size() && !starts_added_[static_cast<unsigned char>(text[i])]) ++i;
  return i;
}

const HfTokenizer::AddedToken* HfTokenizer::MatchAddedToken(absl::string_view text) const {
  for (int32_t index : added_by_first_byte_[static_cast<unsigned char>(text[0])]) {
    const AddedToken& token = added_[index];
    if (absl::StartsWith(text, token.content)) return &token;  // longest first
  }
  return nullptr;
}

absl::StatusOr<std::vector<int32_t>> HfTokenizer::Encode(absl::string_view input) const {
  std::vector<int32_t> ids;
  if (absl::Status s = EncodeTo(input, &ids); !s.ok()) {
    // The tokenizer's file, for the one who has to mend it.
    return absl::Status(s.code(), absl::StrCat("tokenizer ", Printable(json_path_), ": ",
                                               s.message()));
  }
  return ids;
}

absl::Status HfTokenizer::EncodeTo(absl::string_view input, std::vector<int32_t>* out) const {
  std::string repaired;
  absl::string_view view = input;
  if (!IsValidUtf8(input)) {
    repaired = RepairUtf8(input);
    view = repaired;
  }
  Scratch& scratch = ThreadScratch();
  std::vector<int32_t>& ids = *out;
  ids.reserve(view.size() / 3 + 4);
  size_t start = 0;  // first byte not yet encoded
  size_t i = NextAddedTokenStart(view, 0);
  while (i < view.size()) {
    const AddedToken* added = MatchAddedToken(view.substr(i));
    if (added == nullptr) {
      i = NextAddedTokenStart(view, i + 1);
      continue;
    }
    RETURN_IF_ERROR(EncodeSection(view.substr(start, i - start), &scratch, &ids));
    ids.push_back(added->id);
    i += added->content.size();
    start = i;
    i = NextAddedTokenStart(view, i);
  }
  return EncodeSection(view.substr(start), &scratch, &ids);
}

absl::StatusOr<absl::string_view> HfTokenizer::Normalize(absl::string_view section,
                                                         Scratch* scratch) const {
  absl::string_view text = section;
  int next = 0;  // the buffer that the next step that changes the text writes
  for (const NormalizerStep& step : normalizers_) {
    std::string& out = scratch->normalized[next];
    if (step.kind == NormalizerStep::kNfc) {
      if (IsNfcByQuickCheck(text)) continue;
      ASSIGN_OR_RETURN(out, NfcNormalize(text));
    } else if (step.kind == NormalizerStep::kPrepend) {
      out.assign(step.to);
      out.append(text.data(), text.size());
    } else if (step.from.size() == 1) {  // kReplace of one byte (" " -> "▁"): byte by byte
      const char from = step.from[0];
      if (text.find(from) == absl::string_view::npos) continue;
      out.resize(text.size() * std::max<size_t>(step.to.size(), 1));
      char* end = out.data();
      for (char c : text) {
        if (c == from) {
          std::memcpy(end, step.to.data(), step.to.size());
          end += step.to.size();
        } else {
          *end++ = c;
        }
      }
      out.resize(end - out.data());
    } else {  // kReplace: every `from`, left to right, without overlaps
      size_t hit = text.find(step.from);
      if (hit == absl::string_view::npos) continue;
      out.clear();
      size_t done = 0;
      for (; hit != absl::string_view::npos; hit = text.find(step.from, done)) {
        out.append(text.data() + done, hit - done);
        out.append(step.to);
        done = hit + step.from.size();
      }
      out.append(text.data() + done, text.size() - done);
    }
    text = out;
    next ^= 1;
  }
  return text;
}

absl::Status HfTokenizer::EncodeSection(absl::string_view section, Scratch* scratch,
                                        std::vector<int32_t>* ids) const {
  if (section.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const absl::string_view text, Normalize(section, scratch));
  if (text.empty()) return absl::OkStatus();
  const size_t first = ids->size();
  if (split_.has_value()) {
    RETURN_IF_ERROR(split_->Split(text, &scratch->pieces));
    for (absl::string_view piece : scratch->pieces) EncodePreToken(piece, scratch, ids);
  } else if (split_before_metaspace_) {
    // Pieces are a few bytes long: a byte loop, not a search call per piece.
    size_t begin = 0;
    bool after_metaspace = false;  // text[i - 3, i) is U+2581
    for (size_t i = 0; i < text.size();) {
      if (text[i] == kMetaspace[0] && text.substr(i, kMetaspace.size()) == kMetaspace) {
        if (i > begin && !after_metaspace) {  // a run of U+2581 stays in one piece
          EncodePreToken(text.substr(begin, i - begin), scratch, ids);
          begin = i;
        }
        after_metaspace = true;
        i += kMetaspace.size();
      } else {
        after_metaspace = false;
        ++i;
      }
    }
    EncodePreToken(text.substr(begin), scratch, ids);
  } else {
    EncodePreToken(text, scratch, ids);
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
  return absl::OkStatus();
}

void HfTokenizer::EncodePreToken(absl::string_view pre_token, Scratch* scratch,
                                 std::vector<int32_t>* ids) const {
  const bool cacheable = pre_token.size() <= WordCache::kMaxWordBytes;
  WordCache::Key key{};
  if (cacheable) {
    key = WordCache::MakeKey(pre_token);
    if (scratch->cache.Find(key, ids)) return;
  }
  const size_t first = ids->size();
  if (byte_level_) {
    scratch->byte_level.clear();
    ByteLevelEncode(pre_token, &scratch->byte_level);
    model_->EncodeWord(scratch->byte_level, ids);
  } else {
    model_->EncodeWord(pre_token, ids);
  }
  if (cacheable) {
    scratch->cache.Insert(key, absl::MakeConstSpan(ids->data() + first, ids->size() - first));
  }
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(
    const std::string& tokenizer_json_path, const std::string& tokenizer_config_json_path) {
  absl::StatusOr<std::unique_ptr<HfTokenizer>> tokenizer =
      HfTokenizer::Load(tokenizer_json_path, tokenizer_config_json_path);
  if (!tokenizer.ok()) return tokenizer.status();
  return std::unique_ptr<Tokenizer>(std::move(tokenizer).value());
}

}  // namespace megatrain
