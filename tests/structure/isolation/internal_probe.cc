// Must not compile: an engine internal, out of server/'s reach.
#include "engine/job/trainer.h"

int InternalProbe() { return 0; }
