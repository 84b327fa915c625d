#include "engine/store/moment_disk.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/common/check.h"
#include "engine/common/status.h"

namespace megatrain {
namespace {

constexpr int64_t kAlign = 4096;                 // O_DIRECT: offsets, lengths, addresses
constexpr int64_t kPieceBytes = int64_t{64} << 20;  // one read or write request
constexpr unsigned kRingEntries = 64;

int64_t AlignDown(int64_t x) { return x / kAlign * kAlign; }
int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

char* AlignedAlloc(int64_t bytes) {
  void* p = nullptr;
  MT_CHECK_MSG(posix_memalign(&p, kAlign, std::max<int64_t>(bytes, kAlign)) == 0,
               "moment disk: cannot allocate %lld bytes of buffer", static_cast<long long>(bytes));
  return static_cast<char*>(p);
}

std::atomic<int> g_files{0};

}  // namespace

struct MomentDisk::Ring {
  io_uring ring;
};

// One piece of a request in flight: its buffer, whether a write, and the bytes it moves.
struct Piece {
  int buffer;
  bool write;
  int64_t bytes;
  int64_t offset;
};

absl::StatusOr<std::unique_ptr<MomentDisk>> MomentDisk::Create(
    const std::string& dir, const std::vector<int64_t>& units,
    const std::vector<int64_t>& block_bytes, int buffers) {
  MT_CHECK(units.size() == block_bytes.size() && buffers >= 1);
  std::unique_ptr<MomentDisk> d(new MomentDisk());
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  d->path_ = (std::filesystem::path(dir) /
              absl::StrCat("megatrain-moments-", getpid(), "-", g_files.fetch_add(1), ".bin"))
                 .string();
  d->fd_ = open(d->path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0600);
  if (d->fd_ < 0 && errno == EINVAL) {  // a filesystem without O_DIRECT (tmpfs): page cache
    d->fd_ = open(d->path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  }
  if (d->fd_ < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "optimizer.nvme_dir: cannot create the optimizer's scratch file ", d->path_, ": ",
        std::strerror(errno)));
  }
  for (size_t i = 0; i < units.size(); ++i) {
    MT_CHECK_MSG(block_bytes[i] % kAlign == 0, "moment disk: block of %lld bytes",
                 static_cast<long long>(block_bytes[i]));
    d->extent_[units[i]] = {d->file_bytes_, block_bytes[i]};
    d->file_bytes_ += block_bytes[i];
    d->max_block_ = std::max(d->max_block_, block_bytes[i]);
  }
  if (d->file_bytes_ > 0) {
    const int err = posix_fallocate(d->fd_, 0, d->file_bytes_);
    if (err != 0) {
      const std::string path = d->path_;
      const double gib = static_cast<double>(d->file_bytes_) / (int64_t{1} << 30);
      d.reset();  // closes and removes the file
      return absl::ResourceExhaustedError(absl::StrFormat(
          "optimizer.nvme_dir: no room for %.2f GiB of optimizer state at %s (%s): free space "
          "there, or give the job more host memory",
          gib, path, std::strerror(err)));
    }
  }
  d->buffers_.resize(buffers);
  for (Buffer& b : d->buffers_) b.data = AlignedAlloc(d->max_block_);
  d->ring_ = std::make_unique<Ring>();
  const int r = io_uring_queue_init(kRingEntries, &d->ring_->ring, 0);
  if (r < 0) {
    d->ring_.reset();
    return absl::FailedPreconditionError(
        absl::StrCat("optimizer.nvme_dir: cannot set up io_uring: ", std::strerror(-r)));
  }
  d->worker_ = std::thread([p = d.get()] { p->Loop(); });
  return d;
}

MomentDisk::~MomentDisk() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  if (ring_ != nullptr) io_uring_queue_exit(&ring_->ring);
  for (Buffer& b : buffers_) free(b.data);
  if (fd_ >= 0) {
    close(fd_);
    unlink(path_.c_str());
  }
}

int MomentDisk::BufferOf(int64_t unit) const {
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (buffers_[i].unit == unit) return static_cast<int>(i);
  }
  return -1;
}

int MomentDisk::StartRead(int64_t unit, bool evict) {
  for (int pass = 0; pass < (evict ? 2 : 1); ++pass) {
    for (size_t i = 0; i < buffers_.size(); ++i) {
      Buffer& b = buffers_[i];
      const bool untouched = b.state == State::kResident && !b.acquired && b.updated == 0;
      if (b.unit >= 0 && !(pass == 1 && untouched)) continue;
      b.unit = unit;
      b.state = State::kReading;
      b.updated = 0;
      b.acquired = false;
      queue_.push_back(Request{static_cast<int>(i), false});
      cv_.notify_all();
      return static_cast<int>(i);
    }
  }
  return -1;
}

void MomentDisk::Prefetch(int64_t unit) {
  if (!Has(unit)) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (BufferOf(unit) < 0) StartRead(unit);
}

absl::StatusOr<char*> MomentDisk::Acquire(int64_t unit) {
  MT_CHECK(Has(unit));
  std::unique_lock<std::mutex> lock(mu_);
  int b = -1;
  cv_.wait(lock, [&] {
    if (!error_.ok()) return true;
    b = BufferOf(unit);
    if (b < 0) b = StartRead(unit, /*evict=*/true);  // none free: wait for a write to complete
    return b >= 0 && buffers_[b].state == State::kResident;
  });
  RETURN_IF_ERROR(error_);
  buffers_[b].acquired = true;
  return buffers_[b].data;
}

void MomentDisk::Updated(int64_t unit, int64_t elements, int64_t unit_elements) {
  std::lock_guard<std::mutex> lock(mu_);
  const int b = BufferOf(unit);
  MT_CHECK_MSG(b >= 0 && buffers_[b].state == State::kResident,
               "moment disk: unit %lld updated without being acquired",
               static_cast<long long>(unit));
  buffers_[b].updated += elements;
  if (buffers_[b].updated < unit_elements) return;
  buffers_[b].state = State::kWriting;
  buffers_[b].acquired = false;
  queue_.push_back(Request{b, true});
  cv_.notify_all();
}

absl::Status MomentDisk::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    if (!error_.ok() || !queue_.empty()) return !error_.ok();
    for (const Buffer& b : buffers_) {
      if (b.unit >= 0 && b.state != State::kResident) return false;
    }
    return true;
  });
  return error_;
}

int64_t MomentDisk::bytes_read() const {
  std::lock_guard<std::mutex> lock(mu_);
  return read_bytes_;
}

int64_t MomentDisk::bytes_written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return written_bytes_;
}

void MomentDisk::Loop() {
  io_uring* ring = &ring_->ring;
  int in_flight = 0;
  std::deque<Piece> pieces;  // split requests not yet submitted
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty() || in_flight > 0 || !pieces.empty(); });
      if (stop_ && in_flight == 0) return;
      while (!queue_.empty()) {
        const Request q = queue_.front();
        queue_.pop_front();
        Buffer& b = buffers_[q.buffer];
        const int64_t bytes = extent_.at(b.unit).second;
        for (int64_t off = 0; off < bytes; off += kPieceBytes) {
          pieces.push_back(Piece{q.buffer, q.write, std::min(kPieceBytes, bytes - off), off});
          ++b.pending;
        }
      }
    }
    int queued = 0;
    while (!pieces.empty() && in_flight + queued < static_cast<int>(kRingEntries)) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring);
      if (sqe == nullptr) break;
      Piece* p = new Piece(pieces.front());
      pieces.pop_front();
      int64_t file_off;
      {
        std::lock_guard<std::mutex> lock(mu_);
        file_off = extent_.at(buffers_[p->buffer].unit).first + p->offset;
      }
      char* data = buffers_[p->buffer].data + p->offset;
      if (p->write) {
        io_uring_prep_write(sqe, fd_, data, static_cast<unsigned>(p->bytes), file_off);
      } else {
        io_uring_prep_read(sqe, fd_, data, static_cast<unsigned>(p->bytes), file_off);
      }
      io_uring_sqe_set_data(sqe, p);
      ++queued;
    }
    if (queued > 0) {
      io_uring_submit(ring);
      in_flight += queued;
    }
    if (in_flight == 0) continue;
    io_uring_cqe* cqe = nullptr;
    if (io_uring_wait_cqe(ring, &cqe) != 0 || cqe == nullptr) continue;
    do {
      Piece* p = static_cast<Piece*>(io_uring_cqe_get_data(cqe));
      const int res = cqe->res;
      io_uring_cqe_seen(ring, cqe);
      --in_flight;
      std::lock_guard<std::mutex> lock(mu_);
      Buffer& b = buffers_[p->buffer];
      if (res != p->bytes && error_.ok()) {
        error_ = absl::DataLossError(absl::StrFormat(
            "optimizer.nvme_dir: %s of %lld bytes at offset %lld of %s %s", p->write ? "a write" : "a read",
            static_cast<long long>(p->bytes),
            static_cast<long long>(extent_.at(b.unit).first + p->offset), path_,
            res < 0 ? absl::StrCat("failed: ", std::strerror(-res))
                    : absl::StrCat("moved ", res, " bytes (the file was cut short?)")));
      }
      (p->write ? written_bytes_ : read_bytes_) += std::max(res, 0);
      if (--b.pending == 0) {
        if (b.state == State::kReading) {
          b.state = State::kResident;
        } else if (b.state == State::kWriting) {
          b.unit = -1;  // written back: free
        }
      }
      delete p;
      cv_.notify_all();
    } while (io_uring_peek_cqe(ring, &cqe) == 0 && cqe != nullptr);
  }
}

absl::Status MomentDisk::FileIo(bool write, int64_t offset, int64_t bytes, char* data) {
  for (int64_t done = 0; done < bytes;) {
    const ssize_t r = write ? pwrite(fd_, data + done, bytes - done, offset + done)
                            : pread(fd_, data + done, bytes - done, offset + done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      return absl::DataLossError(absl::StrFormat(
          "optimizer.nvme_dir: %s %s at offset %lld: %s", write ? "writing" : "reading", path_,
          static_cast<long long>(offset + done), r < 0 ? std::strerror(errno) : "end of file"));
    }
    done += r;
  }
  std::lock_guard<std::mutex> lock(mu_);
  (write ? written_bytes_ : read_bytes_) += bytes;
  return absl::OkStatus();
}

absl::Status MomentDisk::Read(int64_t unit, int64_t offset, int64_t bytes, char* dst) {
  MT_CHECK(Has(unit));
  const auto [base, size] = extent_.at(unit);
  MT_CHECK(offset >= 0 && offset + bytes <= size);
  {
    std::unique_lock<std::mutex> lock(mu_);
    int b = -1;
    cv_.wait(lock, [&] {
      b = BufferOf(unit);
      return !error_.ok() || b < 0 || buffers_[b].state != State::kReading;
    });
    RETURN_IF_ERROR(error_);
    if (b >= 0) {  // resident or being written back: the buffer holds the bytes
      std::memcpy(dst, buffers_[b].data + offset, bytes);
      return absl::OkStatus();
    }
  }
  const int64_t lo = AlignDown(offset), hi = AlignUp(offset + bytes);
  std::unique_ptr<char, decltype(&free)> bounce(AlignedAlloc(hi - lo), &free);
  RETURN_IF_ERROR(FileIo(false, base + lo, hi - lo, bounce.get()));
  std::memcpy(dst, bounce.get() + (offset - lo), bytes);
  return absl::OkStatus();
}

absl::Status MomentDisk::Write(int64_t unit, int64_t offset, int64_t bytes, const char* src) {
  MT_CHECK(Has(unit));
  const auto [base, size] = extent_.at(unit);
  MT_CHECK(offset >= 0 && offset + bytes <= size);
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      const int b = BufferOf(unit);
      return !error_.ok() || b < 0 || buffers_[b].state == State::kResident;
    });
    RETURN_IF_ERROR(error_);
    const int b = BufferOf(unit);
    if (b >= 0) buffers_[b].unit = -1;  // a resident copy is stale now: drop it
  }
  const int64_t lo = AlignDown(offset), hi = AlignUp(offset + bytes);
  std::unique_ptr<char, decltype(&free)> bounce(AlignedAlloc(hi - lo), &free);
  if (lo != offset || hi != offset + bytes) {
    RETURN_IF_ERROR(FileIo(false, base + lo, hi - lo, bounce.get()));
  }
  std::memcpy(bounce.get() + (offset - lo), src, bytes);
  return FileIo(true, base + lo, hi - lo, bounce.get());
}

}  // namespace megatrain
