#include "server/worker_channel.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace megatrain::server {

WorkerChannel::~WorkerChannel() {
  if (fd_ >= 0) close(fd_);
}

absl::Status WorkerChannel::Write(const google::protobuf::MessageLite& message) {
  std::string frame(4, '\0');
  const size_t size = message.ByteSizeLong();
  if (static_cast<int64_t>(size) > kMaxFrameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a worker message of ", size, " bytes"));
  }
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((size >> (8 * i)) & 0xff);
  message.AppendToString(&frame);
  std::lock_guard<std::mutex> lock(write_mu_);
  size_t sent = 0;
  while (sent < frame.size()) {
    // MSG_NOSIGNAL: a peer gone is an error here, not a SIGPIPE.
    const ssize_t n = send(fd_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::UnavailableError(absl::StrCat("the other end has gone (", strerror(errno), ")"));
    }
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status WorkerChannel::Fill(absl::Time deadline) {
  for (;;) {
    int timeout_ms = -1;
    if (deadline != absl::InfiniteFuture()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("no message yet");
      timeout_ms = static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 60000));
    }
    pollfd p{fd_, POLLIN, 0};
    const int ready = poll(&p, 1, timeout_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return absl::InternalError(absl::StrCat("poll: ", strerror(errno)));
    if (ready == 0) continue;  // the loop checks the deadline
    char chunk[65536];
    const ssize_t n = recv(fd_, chunk, sizeof(chunk), 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) return absl::UnavailableError(absl::StrCat("reading: ", strerror(errno)));
    if (n == 0) return absl::UnavailableError("the other end closed the channel");
    buffer_.append(chunk, static_cast<size_t>(n));
    return absl::OkStatus();
  }
}

absl::Status WorkerChannel::Read(google::protobuf::MessageLite* message, absl::Time deadline) {
  for (;;) {
    if (buffer_.size() >= 4) {
      uint64_t size = 0;
      for (int i = 0; i < 4; ++i) size |= uint64_t{static_cast<unsigned char>(buffer_[i])} << (8 * i);
      if (static_cast<int64_t>(size) > kMaxFrameBytes) {
        return absl::DataLossError(absl::StrCat("a frame of ", size, " bytes, over the limit of ",
                                                kMaxFrameBytes));
      }
      if (buffer_.size() >= 4 + size) {
        const bool parsed = message->ParseFromArray(buffer_.data() + 4, static_cast<int>(size));
        buffer_.erase(0, 4 + size);
        if (!parsed) return absl::DataLossError("a frame that is not a message");
        return absl::OkStatus();
      }
    }
    absl::Status filled = Fill(deadline);
    if (!filled.ok()) return filled;
  }
}

}  // namespace megatrain::server
