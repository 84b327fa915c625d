#include "engine/layers/preference_objective.h"

#include "engine/common/check.h"

namespace megatrain {

void PreferenceObjective::Chunk(const LogitsChunk& c, HeadPass pass) const {
  const bool train = pass == HeadPass::kTrain;
  MT_CHECK(!train || c.row_scale != nullptr);
  backend_->CrossEntropy(train ? c.logits : nullptr, c.values, c.logits,
                         c.batch->targets + c.first_row, c.rows, c.vocab, /*scale=*/1.0,
                         train ? c.row_scale : nullptr, c.stream);
}

void PreferenceObjective::Coefficients(void* row_scale, const void* values,
                                       const DeviceBatch& b, StreamId s) const {
  MT_CHECK_MSG(b.sequence != nullptr && b.sequence_info != nullptr,
               "a preference step's micro-batch carries its sequences");
  backend_->PreferenceRowScale(row_scale, values, b.sequence, b.sequence_info, b.num_tokens,
                               b.num_sequences, options_.preference_loss, options_.beta,
                               options_.label_smoothing, s);
}

}  // namespace megatrain
