// The NVMe tier: AdamW moments of some units kept in a scratch file on local disk instead of
// host RAM, read ahead and written behind with io_uring and O_DIRECT.
//
// Each unit on disk has one extent of the file holding what HostStore would hold in RAM for
// it: m, v and the int8 scales, as one block (HostStore::moment_block_bytes). A few RAM
// buffers cycle through the units: Prefetch(u) starts reading u's block into a free buffer,
// Acquire(u) waits for it (reading it then if no prefetch did), and when the optimizer has
// updated all of u (Updated(u, elements) adds up to the unit), the block is written back and
// the buffer freed once the write completes. An Acquire that finds no buffer free takes back
// one holding a prefetched block nobody has acquired yet (with clipping, gradients land top
// layer first but the updates run bottom first), so prefetches never block an update. A
// worker thread owns the ring: it submits the queued requests in 64 MiB pieces and reaps
// their completions.
//
// The file is scratch: created (and preallocated, so a full disk fails at the start) when a
// job starts, removed when it ends, rebuilt from the last checkpoint after a crash. An I/O
// error or a short read fails the calls that follow with a message naming the file; the
// moments it held are then not trusted.
//
// Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace megatrain {

class MomentDisk {
 public:
  // units[i] with block_bytes[i] (each a multiple of 4096): their extents in a new file in
  // `dir`; `buffers` RAM buffers of the largest block.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<MomentDisk>> Create(
      const std::string& dir, const std::vector<int64_t>& units,
      const std::vector<int64_t>& block_bytes, int buffers);
  ~MomentDisk();
  MomentDisk(const MomentDisk&) = delete;
  MomentDisk& operator=(const MomentDisk&) = delete;

  bool Has(int64_t unit) const { return extent_.count(unit) > 0; }
  const std::string& path() const { return path_; }
  int64_t file_bytes() const { return file_bytes_; }
  int64_t buffer_bytes() const { return static_cast<int64_t>(buffers_.size()) * max_block_; }

  // Starts reading the unit's block if it is not resident or in flight and a buffer is free.
  void Prefetch(int64_t unit);
  // The unit's block in RAM (until the unit has been Updated in full and written back).
  [[nodiscard]] absl::StatusOr<char*> Acquire(int64_t unit);
  // `elements` more of the unit's `unit_elements` are updated in its acquired block; when
  // all are, the block is written back and its buffer freed once written.
  void Updated(int64_t unit, int64_t elements, int64_t unit_elements);
  // Waits for every write; the first error seen, if any.
  [[nodiscard]] absl::Status Flush();
  // Synchronous access to bytes [offset, offset + bytes) of a unit's block (checkpoints):
  // through its buffer while resident, else from the file. REQUIRES: no Acquire of the unit
  // in progress by another thread.
  [[nodiscard]] absl::Status Read(int64_t unit, int64_t offset, int64_t bytes, char* dst);
  [[nodiscard]] absl::Status Write(int64_t unit, int64_t offset, int64_t bytes, const char* src);
  // Bytes read and written since creation.
  int64_t bytes_read() const;
  int64_t bytes_written() const;

 private:
  enum class State { kReading, kResident, kWriting };
  struct Buffer {
    char* data = nullptr;
    int64_t unit = -1;  // -1: free
    State state = State::kResident;
    int64_t updated = 0;      // elements updated since acquired
    int pending = 0;          // pieces in flight
    bool acquired = false;    // handed to the optimizer (not to be taken back)
  };
  struct Request {
    int buffer;
    bool write;
  };
  MomentDisk() = default;
  void Loop();
  // A free buffer for `unit`, reading it in; -1 if none is free. evict: a buffer that holds
  // a prefetched block no one has acquired counts as free (its block is still the file's).
  // REQUIRES: mu_ held.
  int StartRead(int64_t unit, bool evict = false);
  int BufferOf(int64_t unit) const;  // -1 if not in a buffer. REQUIRES: mu_ held.
  absl::Status FileIo(bool write, int64_t offset, int64_t bytes, char* data);

  std::string path_;
  int fd_ = -1;
  int64_t file_bytes_ = 0, max_block_ = 0;
  std::map<int64_t, std::pair<int64_t, int64_t>> extent_;  // unit -> (file offset, bytes)
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Buffer> buffers_;
  std::deque<Request> queue_;
  absl::Status error_;
  bool stop_ = false;
  int64_t read_bytes_ = 0, written_bytes_ = 0;
  struct Ring;
  std::unique_ptr<Ring> ring_;
  std::thread worker_;
};

}  // namespace megatrain
