#include "engine/model/layout.h"

#include <algorithm>
#include <array>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"

namespace megatrain {
namespace {

constexpr int64_t kGroupAlign = 64;

}  // namespace

TensorSlot MakeSlot(TensorRole role, std::string name, std::vector<int64_t> shape,
                    int64_t offset, bool weight_decay) {
  TensorSlot t;
  t.role = role;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.num_elements = 1;
  for (int64_t d : t.shape) t.num_elements *= d;
  t.offset = offset;
  t.weight_decay = weight_decay;
  return t;
}

namespace {

class UnitBuilder {
 public:
  UnitBuilder(UnitKind kind, int64_t layer, std::string name) {
    unit_.kind = kind;
    unit_.layer = layer;
    unit_.name = std::move(name);
  }
  // Starts a group of adjacent tensors on an aligned offset.
  void Align() { cursor_ = (cursor_ + kGroupAlign - 1) / kGroupAlign * kGroupAlign; }
  void Add(TensorRole role, std::string name, std::vector<int64_t> shape, bool decay,
           int64_t expert = -1) {
    TensorSlot t = MakeSlot(role, std::move(name), std::move(shape), cursor_, decay);
    t.expert = expert;
    cursor_ += t.num_elements;
    unit_.tensors.push_back(std::move(t));
  }
  UnitLayout Finish() {
    Align();
    unit_.num_elements = cursor_;
    return std::move(unit_);
  }

 private:
  UnitLayout unit_;
  int64_t cursor_ = 0;
};

// An MoE layer's router and experts, under Hugging Face's names: Qwen3-MoE's
// mlp.gate / mlp.experts.N.{gate,up,down}_proj, Mixtral's block_sparse_moe.gate /
// block_sparse_moe.experts.N.{w1,w3,w2} (the names transformers saves and loads).
void AddExperts(const ModelConfig& c, const std::string& p, UnitBuilder& u) {
  const int64_t C = c.hidden_size, E = c.moe.num_experts, I = c.moe.intermediate_size;
  if (c.moe.gpt_oss_experts) {  // mlp.router.{weight,bias}, mlp.experts.* as transformers has
    u.Align();
    u.Add(TensorRole::kRouter, p + "mlp.router.weight", {E, C}, true);
    u.Align();
    u.Add(TensorRole::kRouterBias, p + "mlp.router.bias", {E}, false);
    u.Align();
    u.Add(TensorRole::kExpertGateUpT, p + "mlp.experts.gate_up_proj", {E, C, 2 * I}, true);
    u.Align();
    u.Add(TensorRole::kExpertGateUpBias, p + "mlp.experts.gate_up_proj_bias", {E, 2 * I}, false);
    u.Align();
    u.Add(TensorRole::kExpertDownT, p + "mlp.experts.down_proj", {E, I, C}, true);
    u.Align();
    u.Add(TensorRole::kExpertDownBias, p + "mlp.experts.down_proj_bias", {E, C}, false);
    return;
  }
  const bool mixtral = c.architecture == Architecture::kMixtral;
  const std::string moe = p + (mixtral ? "block_sparse_moe." : "mlp.");
  const char* gate = mixtral ? "w1" : "gate_proj";
  const char* up = mixtral ? "w3" : "up_proj";
  const char* down = mixtral ? "w2" : "down_proj";
  u.Align();
  u.Add(TensorRole::kRouter, moe + "gate.weight", {E, C}, true);
  u.Align();
  for (int64_t e = 0; e < E; ++e) {
    const std::string expert = absl::StrCat(moe, "experts.", e, ".");
    u.Add(TensorRole::kExpertGate, absl::StrCat(expert, gate, ".weight"), {I, C}, true, e);
    u.Add(TensorRole::kExpertUp, absl::StrCat(expert, up, ".weight"), {I, C}, true, e);
  }
  u.Align();
  for (int64_t e = 0; e < E; ++e) {
    u.Add(TensorRole::kExpertDown, absl::StrCat(moe, "experts.", e, ".", down, ".weight"),
          {C, I}, true, e);
  }
}

}  // namespace

const TensorSlot* UnitLayout::Find(TensorRole role) const {
  for (const TensorSlot& t : tensors) {
    if (t.role == role) return &t;
  }
  return nullptr;
}

const TensorSlot* UnitLayout::FindLora(TensorRole base, TensorRole which) const {
  for (const TensorSlot& t : tensors) {
    if (t.role == which && t.base_role == base) return &t;
  }
  return nullptr;
}

int64_t UnitLayout::OffsetOf(TensorRole role) const {
  const TensorSlot* t = Find(role);
  return t == nullptr ? -1 : t->offset;
}

int64_t UnitLayout::OffsetOfFused(std::initializer_list<TensorRole> roles) const {
  const TensorSlot* first = Find(*roles.begin());
  if (first == nullptr) return -1;
  int64_t end = first->offset;
  for (TensorRole role : roles) {
    const TensorSlot* t = Find(role);
    MT_CHECK_MSG(t != nullptr && t->offset == end, "%s: the fused tensors are not back to back",
                 name.c_str());
    end = t->offset + t->num_elements;
  }
  return first->offset;
}

bool UnitLayout::SameStructure(const UnitLayout& other) const {
  if (kind != other.kind || num_elements != other.num_elements ||
      tensors.size() != other.tensors.size() || lora_rank != other.lora_rank ||
      lora_scale != other.lora_scale) {
    return false;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSlot& a = tensors[i];
    const TensorSlot& b = other.tensors[i];
    if (a.role != b.role || a.shape != b.shape || a.offset != b.offset ||
        a.trainable != b.trainable || a.base_role != b.base_role) {
      return false;
    }
  }
  return true;
}

int64_t ModelLayout::MaxDecoderElements() const {
  int64_t m = 0;
  for (const UnitLayout& u : units) {
    if (u.kind == UnitKind::kDecoder) m = std::max(m, u.num_elements);
  }
  return m;
}

int64_t ModelLayout::TotalElements() const {
  int64_t total = 0;
  for (const UnitLayout& u : units) total += u.num_elements;
  return total;
}

absl::Status ModelLayout::SetTrainable(const std::string& name, bool trainable) {
  bool found = false;
  for (UnitLayout& u : units) {
    for (TensorSlot& t : u.tensors) {
      if (t.name != name) continue;
      t.trainable = trainable;
      found = true;
    }
  }
  if (found) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("the model has no tensor named ", name));
}

bool UnitLayout::AllTrainable() const {
  for (const TensorSlot& t : tensors) {
    if (!t.trainable) return false;
  }
  return true;
}

bool UnitLayout::AnyTrainable(std::initializer_list<TensorRole> roles) const {
  for (const TensorSlot& t : tensors) {
    if (t.trainable && std::find(roles.begin(), roles.end(), t.role) != roles.end()) return true;
  }
  return false;
}

namespace {
// The roles whose gradients one kernel writes together (a fused q|k|v or gate|up matrix,
// their biases, every expert's share of a grouped GEMM): a state range that holds one of
// them holds all.
int GradientGroup(TensorRole r) {
  switch (r) {
    case TensorRole::kQ: case TensorRole::kK: case TensorRole::kV: return 1;
    case TensorRole::kQBias: case TensorRole::kKBias: case TensorRole::kVBias: return 2;
    case TensorRole::kGate: case TensorRole::kUp: return 3;
    case TensorRole::kExpertGate: case TensorRole::kExpertUp: return 4;
    default: return 8 + static_cast<int>(r);  // every tensor of the role (< 256)
  }
}
}  // namespace

std::pair<int64_t, int64_t> UnitLayout::StateRange() const {
  if (AllTrainable()) return {0, num_elements};
  std::array<bool, 256> trained{};  // by gradient group
  for (const TensorSlot& t : tensors) {
    if (t.trainable) trained[GradientGroup(t.role)] = true;
  }
  int64_t begin = num_elements, end = 0;
  for (const TensorSlot& t : tensors) {
    if (!trained[GradientGroup(t.role)]) continue;
    begin = std::min(begin, t.offset);
    end = std::max(end, t.offset + t.num_elements);
  }
  return begin < end ? std::make_pair(begin, end) : std::make_pair(int64_t{0}, int64_t{0});
}

bool UnitLayout::HasState(const TensorSlot& t) const {
  const auto [begin, end] = StateRange();
  return t.offset >= begin && t.offset + t.num_elements <= end;
}

ModelLayout BuildLayout(const ModelConfig& c) {
  const int64_t C = c.hidden_size, H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim;
  const int64_t I = c.intermediate_size, V = c.vocab_size;
  ModelLayout layout;
  layout.num_layers = c.num_layers;

  UnitBuilder embed(UnitKind::kEmbedding, -1, "embedding");
  embed.Add(TensorRole::kEmbedding, "model.embed_tokens.weight", {V, C}, true);
  layout.units.push_back(embed.Finish());

  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    UnitBuilder u(UnitKind::kDecoder, l, absl::StrCat("layer.", l));
    u.Add(TensorRole::kInputNorm, p + "input_layernorm.weight", {C}, false);
    u.Align();
    u.Add(TensorRole::kQ, p + "self_attn.q_proj.weight", {H * D, C}, true);
    u.Add(TensorRole::kK, p + "self_attn.k_proj.weight", {KV * D, C}, true);
    u.Add(TensorRole::kV, p + "self_attn.v_proj.weight", {KV * D, C}, true);
    if (c.qkv_bias) {
      u.Align();
      u.Add(TensorRole::kQBias, p + "self_attn.q_proj.bias", {H * D}, false);
      u.Add(TensorRole::kKBias, p + "self_attn.k_proj.bias", {KV * D}, false);
      u.Add(TensorRole::kVBias, p + "self_attn.v_proj.bias", {KV * D}, false);
    }
    if (c.qk_norm) {
      u.Align();
      u.Add(TensorRole::kQNorm, p + "self_attn.q_norm.weight", {D}, false);
      u.Align();
      u.Add(TensorRole::kKNorm, p + "self_attn.k_norm.weight", {D}, false);
    }
    u.Align();
    u.Add(TensorRole::kOProj, p + "self_attn.o_proj.weight", {C, H * D}, true);
    if (c.o_bias) {
      u.Align();
      u.Add(TensorRole::kOBias, p + "self_attn.o_proj.bias", {C}, false);
    }
    if (c.attention_sinks) {  // 1-D but not a norm or a bias: HF Trainer decays it
      u.Align();
      u.Add(TensorRole::kSinks, p + "self_attn.sinks", {H}, true);
    }
    u.Align();
    u.Add(TensorRole::kPostNorm, p + "post_attention_layernorm.weight", {C}, false);
    if (c.IsMoeLayer(l)) {
      AddExperts(c, p, u);
    } else {
      u.Align();
      u.Add(TensorRole::kGate, p + "mlp.gate_proj.weight", {I, C}, true);
      u.Add(TensorRole::kUp, p + "mlp.up_proj.weight", {I, C}, true);
      u.Align();
      u.Add(TensorRole::kDown, p + "mlp.down_proj.weight", {C, I}, true);
    }
    layout.units.push_back(u.Finish());
  }

  UnitBuilder head(UnitKind::kHead, -1, "head");
  head.Add(TensorRole::kFinalNorm, "model.norm.weight", {C}, false);
  if (!c.tie_word_embeddings) {
    head.Align();
    head.Add(TensorRole::kLmHead, "lm_head.weight", {V, C}, true);
  }
  layout.units.push_back(head.Finish());
  return layout;
}

}  // namespace megatrain
