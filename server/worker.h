// The worker: megatraind's child process that does one piece of a user's work, as that
// user, so that nothing in it can stop the daemon (server/worker_process.h starts it).
//
// It serves WorkerRequests from the channel on `fd` until an ExitRequest or the daemon
// closes the channel: a CheckRequest (read, check and plan a submission) or a
// StartRequest, then StepRequests and checkpoint requests (run a job on its Trainer).
// Every request gets one reply; a clock thread sends a heartbeat every
// WorkerContext.heartbeat_ms meanwhile. Whatever fails in a request is its reply's error;
// what kills the process (an abort, a signal, a limit) the daemon sees as its exit.
#pragma once

namespace megatrain::server {

// The worker's main: returns its exit status (0 after an ExitRequest or the channel's
// close, 3 when the channel breaks mid-message).
int RunWorker(int fd);

}  // namespace megatrain::server
