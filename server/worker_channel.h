// The framed channel between megatraind and a worker process: each message is a 4-byte
// little-endian length and the serialized protobuf, on a stream socket. Both ends use it:
// the daemon sends WorkerRequests and reads WorkerReplies, the worker the reverse.
//
// A frame over kMaxFrameBytes is a protocol error (a worker cannot make the daemon
// allocate what it likes). Write() is thread-safe (the worker's heartbeat thread and its
// main thread share the channel); Read() is for one thread at a time.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "google/protobuf/message_lite.h"

namespace megatrain::server {

class WorkerChannel {
 public:
  static constexpr int64_t kMaxFrameBytes = int64_t{64} << 20;

  explicit WorkerChannel(int fd) : fd_(fd) {}  // takes ownership of fd
  ~WorkerChannel();
  WorkerChannel(const WorkerChannel&) = delete;
  WorkerChannel& operator=(const WorkerChannel&) = delete;

  int fd() const { return fd_; }

  // Sends one message whole. Unavailable when the other end has gone.
  [[nodiscard]] absl::Status Write(const google::protobuf::MessageLite& message);

  // Reads the next message. With a deadline, DeadlineExceeded when no whole message came
  // by then (a frame begun is kept for the next call). Unavailable at the other end's
  // close; DataLoss for a malformed frame.
  [[nodiscard]] absl::Status Read(google::protobuf::MessageLite* message,
                                  absl::Time deadline = absl::InfiniteFuture());

 private:
  // Reads what is there without blocking past `deadline`; false at the deadline.
  [[nodiscard]] absl::Status Fill(absl::Time deadline);

  int fd_;
  std::mutex write_mu_;
  std::string buffer_;  // bytes read and not yet consumed
};

}  // namespace megatrain::server
