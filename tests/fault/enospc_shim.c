// Fault injection by LD_PRELOAD: writes to files whose path contains
// $MEGATRAIN_FAULT_PATH fail with ENOSPC ("No space left on device") while the file
// $MEGATRAIN_FAULT_ARM exists. A full disk, for one folder, on demand, without root.
//
//   LD_PRELOAD=libmt_fault_enospc.so MEGATRAIN_FAULT_PATH=/checkpoints/.checkpoint-
//   MEGATRAIN_FAULT_ARM=/tmp/arm megatraind ...
//
// Only calls made through the dynamic symbols (our PosixFile's open/write/pwrite and
// fallocate) are seen.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <string.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#define kMaxFd 65536
static unsigned char g_tracked[kMaxFd];

static int Matches(const char* path) {
  const char* want = getenv("MEGATRAIN_FAULT_PATH");
  return path != NULL && want != NULL && *want != '\0' && strstr(path, want) != NULL;
}

static int Armed(int fd) {
  if (fd < 0 || fd >= kMaxFd || !g_tracked[fd]) return 0;
  const char* arm = getenv("MEGATRAIN_FAULT_ARM");
  struct stat st;
  return arm != NULL && stat(arm, &st) == 0;
}

static void Track(int fd, const char* path) {
  if (fd >= 0 && fd < kMaxFd) g_tracked[fd] = (unsigned char)Matches(path);
}

typedef int (*OpenFn)(const char*, int, ...);
typedef ssize_t (*PwriteFn)(int, const void*, size_t, off_t);
typedef int (*FallocateFn)(int, int, off_t, off_t);

// The real function `name`, looked up once into *slot.
static void* Real(void** slot, const char* name) {
  if (*slot == NULL) *slot = dlsym(RTLD_NEXT, name);
  return *slot;
}

static int OpenAndTrack(OpenFn real, const char* path, int flags, mode_t mode) {
  const int fd = real(path, flags, mode);
  Track(fd, path);
  return fd;
}

// The mode argument open() has only with O_CREAT or O_TMPFILE.
#define MODE_OF(flags, mode)                 \
  do {                                       \
    if ((flags) & (O_CREAT | O_TMPFILE)) {   \
      va_list ap;                            \
      va_start(ap, flags);                   \
      mode = va_arg(ap, mode_t);             \
      va_end(ap);                            \
    }                                        \
  } while (0)

int open(const char* path, int flags, ...) {
  static void* real;
  mode_t mode = 0;
  MODE_OF(flags, mode);
  return OpenAndTrack((OpenFn)Real(&real, "open"), path, flags, mode);
}

int open64(const char* path, int flags, ...) {
  static void* real;
  mode_t mode = 0;
  MODE_OF(flags, mode);
  return OpenAndTrack((OpenFn)Real(&real, "open64"), path, flags, mode);
}

ssize_t write(int fd, const void* buf, size_t n) {
  static void* real;
  if (Armed(fd)) {
    errno = ENOSPC;
    return -1;
  }
  return ((ssize_t (*)(int, const void*, size_t))Real(&real, "write"))(fd, buf, n);
}

static ssize_t Pwrite(void** real, const char* name, int fd, const void* buf, size_t n,
                      off_t offset) {
  if (Armed(fd)) {
    errno = ENOSPC;
    return -1;
  }
  return ((PwriteFn)Real(real, name))(fd, buf, n, offset);
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t offset) {
  static void* real;
  return Pwrite(&real, "pwrite", fd, buf, n, offset);
}

ssize_t pwrite64(int fd, const void* buf, size_t n, off_t offset) {
  static void* real;
  return Pwrite(&real, "pwrite64", fd, buf, n, offset);
}

// A full disk refuses to reserve space too (checkpoints reserve their files up front).
static int Fallocate(void** real, const char* name, int fd, int mode, off_t offset,
                     off_t len) {
  if (Armed(fd)) {
    errno = ENOSPC;
    return -1;
  }
  return ((FallocateFn)Real(real, name))(fd, mode, offset, len);
}

int fallocate(int fd, int mode, off_t offset, off_t len) {
  static void* real;
  return Fallocate(&real, "fallocate", fd, mode, offset, len);
}

int fallocate64(int fd, int mode, off_t offset, off_t len) {
  static void* real;
  return Fallocate(&real, "fallocate64", fd, mode, offset, len);
}

int close(int fd) {
  static void* real;
  if (fd >= 0 && fd < kMaxFd) g_tracked[fd] = 0;
  return ((int (*)(int))Real(&real, "close"))(fd);
}
