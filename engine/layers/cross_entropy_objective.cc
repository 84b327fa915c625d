#include "engine/layers/cross_entropy_objective.h"

namespace megatrain {

void NextTokenCrossEntropy::Chunk(const LogitsChunk& c, HeadPass pass) const {
  // Null dlogits: the loss alone (both backends' kernels take it), computed as kTrain's is.
  void* dlogits = pass == HeadPass::kTrain ? c.logits : nullptr;
  backend_->CrossEntropy(dlogits, c.values, c.logits, c.batch->targets + c.first_row, c.rows,
                         c.vocab, c.scale, /*row_scale=*/nullptr, c.stream);
}

}  // namespace megatrain
