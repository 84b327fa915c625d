// Compiles: what a server file may include of the engine.
#include "engine/common/status.h"
#include "engine/engine.h"

int ApiProbe() { return megatrain::JobSpec().rows_per_step() > 0 ? 0 : 1; }
