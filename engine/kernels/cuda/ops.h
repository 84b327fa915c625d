// Launchers of the CUDA kernels, in plain C++: raw pointers, integer shapes, a stream.
// Each enqueues on `stream` and returns; inputs may be reused once work recorded after
// it on that stream has completed. The math of each op is the CPU reference's
// (kernels/reference/<op>.h); here activations and weights are bf16, statistics (rstd,
// logsumexp, loss) and weight gradients are fp32, and every reduction accumulates in fp32.
// One op per .cu file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/common/adamw_math.h"
#include "engine/common/preference_math.h"

namespace megatrain::cuda {

using bf16 = __nv_bfloat16;

// The deterministic weight gradients (RMSNorm, QK-norm) take a scratch for their blocks'
// partials: `partials`, `partial_floats` f32, stream-ordered (in use until the stream passes
// the call). The launchers size their grids to fit it; it must hold one block's row (C, or
// 2 * D floats). The CUDA backend gives kPartialFloats (8 MiB): a full grid up to C = 8192.
constexpr int64_t kPartialFloats = int64_t{1} << 21;

// reduce.cu: out (n) bf16 = in (n) f32 rounded to nearest even. REQUIRES: 16-byte aligned.
void RoundToBf16(bf16* out, const float* in, int64_t n, cudaStream_t stream);
// reduce.cu: dst (count) += the column sums of partials (blocks, stride), row by row in
// block order (bits independent of timing).
void AddColumnSums(float* dst, const float* partials, int64_t blocks, int64_t count,
                   int64_t stride, cudaStream_t stream);

// embedding.cu
void Embedding(bf16* out, const int32_t* tokens, const bf16* table, int64_t n, int64_t C,
               cudaStream_t stream);
// dtable f32 (V,C) += scatter of dout (n,C); order (n) is TokenOrder(tokens) (batch.h).
// Deterministic: the reference's sums, bit for bit.
void EmbeddingBackward(float* dtable, const bf16* dout, const int32_t* tokens,
                       const int32_t* order, int64_t n, int64_t C, cudaStream_t stream);

// rmsnorm.cu
void RmsNorm(bf16* out, float* rstd, const bf16* in, const bf16* w, int64_t rows, int64_t C,
             float eps, cudaStream_t stream);
// din bf16 (rows,C) +=, dw f32 (C) += (deterministic; partials: see kPartialFloats).
void RmsNormBackward(bf16* din, float* dw, const bf16* dout, const bf16* in, const bf16* w,
                     const float* rstd, int64_t rows, int64_t C, float* partials,
                     int64_t partial_floats, cudaStream_t stream);

// qkv_prepare.cu: split + QK-norm (norm weights may be null) + RoPE.
void QkvPrepare(bf16* q, bf16* k, bf16* v, float* rstd_q, float* rstd_k, const bf16* qkv,
                const bf16* q_norm_w, const bf16* k_norm_w, const int32_t* pos,
                const float* inv_freq, float rope_scale, int64_t n, int64_t H, int64_t KV,
                int64_t D, float eps, cudaStream_t stream);
// dqkv written; dq_norm_w, dk_norm_w f32 (D) += (null when norms are off; deterministic).
// partials: see kPartialFloats.
void QkvPrepareBackward(bf16* dqkv, float* dq_norm_w, float* dk_norm_w, const bf16* dq,
                        const bf16* dk, const bf16* dv, const bf16* qkv, const bf16* q_norm_w,
                        const bf16* k_norm_w, const float* rstd_q, const float* rstd_k,
                        const int32_t* pos, const float* inv_freq, float rope_scale, int64_t n,
                        int64_t H, int64_t KV, int64_t D, float* partials,
                        int64_t partial_floats, cudaStream_t stream);

// attention.cu: causal GQA within documents; memory linear in n (lse kept, P recomputed).
// sinks bf16 (H) | null: one logit per head in each row's softmax sum (lse includes it);
// window > 0: query i sees only keys i - j < window (0: no window; cost ~ n * window).
void Attention(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v,
               const int32_t* doc_start, const bf16* sinks, int64_t window, int64_t n, int64_t H,
               int64_t KV, int64_t D, cudaStream_t stream);
// dq, dk, dv written; dsinks f32 (H) += | null (needs sinks; deterministic; partials: see
// kPartialFloats, >= H floats, used only with dsinks). dq_sums: the fused Hopper backward's
// fp32 scratch (HopperAttentionBackwardFused), or null.
void AttentionBackward(bf16* dq, bf16* dk, bf16* dv, float* dsinks, const bf16* dout, const bf16* q,
                       const bf16* k, const bf16* v, const bf16* o, const float* lse,
                       const int32_t* doc_start, const bf16* sinks, int64_t window, int64_t n,
                       int64_t H, int64_t KV, int64_t D, float* partials, int64_t partial_floats,
                       cudaStream_t stream, float* dq_sums = nullptr,
                       int64_t dq_sum_floats = 0);

// attention_hopper.cu: the two above on sm_90 (H100/H200) for head_dim 64 and 128, with
// wgmma, TMA and warp specialisation. Attention calls them where HopperAttentionApplies:
// on an sm_90 device, for head_dim 64 or 128, unless the process's settings decline them
// (EngineSettings::attention.hopper false: main read MEGATRAIN_ATTENTION=mma), which keeps
// every call on attention.cu's kernels.
// window: as the kernels take it (0, or < n).
bool HopperAttentionApplies(int64_t D);  // on the current device
void HopperAttention(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v,
                     const int32_t* doc_start, const bf16* sinks, int window, int n, int H,
                     int KV, int D, cudaStream_t stream);
// The backward's dk/dv and dq passes on sm_90 (AttentionBackward's, in that order, after its
// Delta kernel): dk, dv (n,KV,D) written, reading the Delta each (query, head) row of dq has
// parked in its first 4 bytes; then dq (n,H,D) written over them.
void HopperAttentionDkDv(bf16* dk, bf16* dv, const bf16* dq, const bf16* dout, const bf16* q,
                         const bf16* k, const bf16* v, const float* lse, const int32_t* doc_start,
                         int window, int n, int H, int KV, int D, cudaStream_t stream);
void HopperAttentionDq(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                       const float* lse, const int32_t* doc_start, int window, int n, int H,
                       int KV, int D, cudaStream_t stream);
// Both passes in one (HopperDkDvKernel's kFusedDq: 5 GEMMs a tile, not 7), its dq summed in
// fp32 in `dq_sums` in a fixed order, in launches of as many kv heads as it holds (n x
// H / KV x D floats and n / 64 counts each), then rounded into dq. Only when the process's
// settings ask for it (EngineSettings::attention.fused_backward_kv_heads >= 0: main read
// MEGATRAIN_ATTENTION_BACKWARD=fused, or fused:K, which caps a launch at K kv heads), and
// only if dq_sums holds one kv head's: false, and nothing run, otherwise (the two passes
// above then run).
bool HopperFusedBackwardRequested();  // EngineSettings: MEGATRAIN_ATTENTION_BACKWARD=fused[:K]
bool HopperAttentionBackwardFused(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                                  const bf16* k, const bf16* v, const float* lse,
                                  const int32_t* doc_start, int window, int n, int H, int KV, int D,
                                  float* dq_sums, int64_t dq_sum_floats, cudaStream_t stream);

// decode_attention.cu: generation's KV cache and one-token attention against it
// (kernels/reference/decode_attention.h). The caches are (slots, max_len, KV, D) bf16 each.
// k_cache, v_cache [seq_slot[i], position[i]] = k, v (n,KV,D) [i]; a token whose slot is
// negative or position outside [0, max_len) is not written. REQUIRES: KV*D % 8 == 0, tensors
// 16-byte aligned.
void KvCacheWrite(bf16* k_cache, bf16* v_cache, const bf16* k, const bf16* v,
                  const int32_t* seq_slot, const int32_t* position, int64_t n, int64_t KV,
                  int64_t D, int64_t max_len, cudaStream_t stream);
// o (B,H,D) = q (B,H,D) row b against keys 0 .. length[b]-1 of slot seq_slot[b] (the last
// `window` of them when window > 0), sinks bf16 (H) | null, scale 1/sqrt(D). A length past
// max_len reads max_len keys; length <= 0 or a negative slot gives a zero row. Long caches
// with few sequences split their keys over blocks whose fp32 partials go to `partials`
// (partial_floats, stream-ordered: in use until the stream passes the call; see
// kPartialFloats), merged in a fixed order: deterministic. REQUIRES: D 64 or 128,
// H % KV == 0, B <= 65535, tensors 16-byte aligned.
void DecodeAttention(bf16* o, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                     const int32_t* seq_slot, const int32_t* length, const bf16* sinks,
                     int64_t window, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t max_len,
                     float* partials, int64_t partial_floats, cudaStream_t stream);

// swiglu.cu
void SwiGlu(bf16* out, const bf16* gu, int64_t N, int64_t I, cudaStream_t stream);
void SwiGluBackward(bf16* dgu, const bf16* dout, const bf16* gu, int64_t N, int64_t I,
                    cudaStream_t stream);

// clamped_swiglu.cu: GPT-OSS's (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g),
// g = min(gate, limit); gu, dgu (N,2I) rows [gate | up], out, dout (N,I). The backward
// passes gradient where gate <= limit and -limit <= up <= limit, boundaries included.
void ClampedSwiGlu(bf16* out, const bf16* gu, int64_t N, int64_t I, float alpha, float limit,
                   cudaStream_t stream);
void ClampedSwiGluBackward(bf16* dgu, const bf16* dout, const bf16* gu, int64_t N, int64_t I,
                           float alpha, float limit, cudaStream_t stream);

// cross_entropy.cu: loss f32 (N); dlogits bf16 (may alias logits) = scale * row_scale[row]
// (row_scale f32 (N), or null: 1) * (softmax - onehot).
void CrossEntropy(bf16* dlogits, float* loss, const bf16* logits, const int32_t* targets,
                  int64_t N, int64_t V, float scale, const float* row_scale,
                  cudaStream_t stream);

// preference.cu: DPO's row_scale f32 (N) for CrossEntropy from values f32 (N) (each token's
// -log p), sequence int32 (N) and info f64 (S, kPrefFields) (kernels/reference/preference.h);
// one block, deterministic. REQUIRES: S <= kMaxPreferenceSequences, S even.
void PreferenceRowScale(float* row_scale, const float* values, const int32_t* sequence,
                        const double* info, int64_t N, int64_t S, PreferenceLoss kind,
                        double beta, double label_smoothing, cudaStream_t stream);

// adamw.cu: AdamW on n fp32 elements (common/adamw_math.h), IEEE rounding throughout (the
// file is built without fast math): the host optimizer's bits. bf16_out may be null.
void AdamW(float* master, float* m, float* v, uint16_t* bf16_out, const float* grad, int64_t n,
           const AdamWScalars& scalars, float grad_scale, cudaStream_t stream);

// greedy_pick.cu: ids int32 (B) = each row's lowest index of its maximum, logprobs f32 (B) =
// logits[b][id] - logsumexp(logits (B,V) bf16 [b]) (fp32 sums); -1 and NaN for a row with a
// NaN or +inf, or only -inf (kernels/reference/greedy_pick.h). One read of the logits, any V
// and alignment; on sm_90 a long row is split over a cluster of blocks. No scratch, any
// stream; deterministic (the split depends on V and the device). REQUIRES: 1 <= V < 2^31 - 8,
// B < 2^28.
void GreedyPick(int32_t* ids, float* logprobs, const bf16* logits, int64_t B, int64_t V,
                cudaStream_t stream);

// bias.cu: out (N,OC) += bias (OC) per row; dbias f32 (OC) += column sums of dout (N,OC),
// deterministic (no atomics).
void AddBias(bf16* out, const bf16* bias, int64_t N, int64_t OC, cudaStream_t stream);
void BiasGrad(float* dbias, const bf16* dout, int64_t N, int64_t OC, cudaStream_t stream);
// The experts' biases over rows sorted by expert, offsets int32 (E+1) on the device (rows
// [offsets[e], offsets[e+1]) are expert e's): out (R,OC) += bias (E,OC) [expert of row],
// R = offsets[E]; dbias f32 (E,OC) += the column sums of each expert's rows of dout (R,OC),
// in one launch, deterministic; experts without rows keep their dbias bits (E <= 65535).
void AddGroupedBias(bf16* out, const bf16* bias, const int32_t* offsets, int64_t E, int64_t R,
                    int64_t OC, cudaStream_t stream);
void GroupedBiasGrad(float* dbias, const bf16* dout, const int32_t* offsets, int64_t E,
                     int64_t OC, cudaStream_t stream);

// moe_router.cu: probs f32 (n,E) = softmax(logits bf16 (n,E)); idx int32 (n,k), w f32 (n,k)
// the top-k (lower index first among equals; renormalised when renorm). 1 <= E <= 256,
// 1 <= k <= min(E, 8).
void MoeRoute(float* probs, int32_t* idx, float* w, const bf16* logits, int64_t n, int64_t E,
              int64_t k, bool renorm, cudaStream_t stream);
// dlogits bf16 (n,E) written from dw f32 (n,k); counts int32 (E) | null adds the
// load-balancing term aux_scale * counts[e].
void MoeRouteBackward(bf16* dlogits, const float* probs, const int32_t* idx, const float* w,
                      const float* dw, const int32_t* counts, float aux_scale, int64_t n,
                      int64_t E, int64_t k, bool renorm, cudaStream_t stream);
// counts int32 (E) += the choices of each expert in idx (n,k); prob_sum f32 (E) += the
// column sums of probs (n,E) (deterministic; partials: see kPartialFloats, >= E floats).
void MoeRouterStats(int32_t* counts, float* prob_sum, const float* probs, const int32_t* idx,
                    int64_t n, int64_t E, int64_t k, float* partials, int64_t partial_floats,
                    cudaStream_t stream);

// moe.cu: R = n*k rows in expert order.
// The reference's stable counting sort of idx int32 (n,k) by expert: offsets (E+1),
// slot_of (R), row_token (R) int32. scratch int32 (MoeSortScratchInts(R, E), in
// kernels/moe_scratch.h), in use until the stream passes the call. 1 <= E <= 4096;
// REQUIRES every idx in [0, E).
void MoeSort(int32_t* offsets, int32_t* slot_of, int32_t* row_token, int32_t* scratch,
             const int32_t* idx, int64_t n, int64_t E, int64_t k, cudaStream_t stream);
// dh (n,C) written = sum_j dxe (R,C) [slot_of (n,k)], j in order.
void MoeGatherBackward(bf16* dh, const bf16* dxe, const int32_t* slot_of, int64_t n, int64_t k,
                       int64_t C, cudaStream_t stream);
// out (n,C) += sum_j w f32 (n,k) * ye (R,C) [slot_of (n,k)], j in order in fp32.
void MoeCombine(bf16* out, const bf16* ye, const int32_t* slot_of, const float* w, int64_t n,
                int64_t k, int64_t C, cudaStream_t stream);
// dye (R,C) written (w * dout at each choice's row); dw f32 (n,k) written = dot(dout[t],
// ye[slot]) (deterministic). k <= 8.
void MoeCombineBackward(bf16* dye, float* dw, const bf16* dout, const bf16* ye,
                        const int32_t* slot_of, const float* w, int64_t n, int64_t k, int64_t C,
                        cudaStream_t stream);

}  // namespace megatrain::cuda
