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

#include <cstddef>
#include <string>

namespace megatrain::server {

// A generate job's completion (its output line, JSON) as the job's log carries it, after
// "completion ": without the logprobs (the output file has them), escaped to ASCII (the
// log escapes control bytes, which would break the JSON); past `max_bytes` without its
// prompt, then its ids, then with its text cut at a character, and marked "truncated".
std::string CompletionLogLine(const std::string& output_line, size_t max_bytes);

// The worker's main: returns its exit status (0 after an ExitRequest or the channel's
// close, 3 when the channel breaks mid-message).
int RunWorker(int fd);

}  // namespace megatrain::server
