// Fault injection by LD_PRELOAD: writes to files whose path contains
// $MEGATRAIN_FAULT_PATH fail with ENOSPC ("No space left on device") while the file
// $MEGATRAIN_FAULT_ARM exists. A full disk, for one folder, on demand, without root.
//
//   LD_PRELOAD=libmt_fault_enospc.so MEGATRAIN_FAULT_PATH=/checkpoints/.checkpoint-
//   MEGATRAIN_FAULT_ARM=/tmp/arm megatraind ...
//
// Only calls made through the dynamic symbols (our PosixFile's open/write) are seen.
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

int open(const char* path, int flags, ...) {
  static int (*real)(const char*, int, ...) = NULL;
  if (real == NULL) real = (int (*)(const char*, int, ...))dlsym(RTLD_NEXT, "open");
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) {
    va_list ap;
    va_start(ap, flags);
    mode = va_arg(ap, mode_t);
    va_end(ap);
  }
  const int fd = real(path, flags, mode);
  Track(fd, path);
  return fd;
}

int open64(const char* path, int flags, ...) {
  static int (*real)(const char*, int, ...) = NULL;
  if (real == NULL) real = (int (*)(const char*, int, ...))dlsym(RTLD_NEXT, "open64");
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) {
    va_list ap;
    va_start(ap, flags);
    mode = va_arg(ap, mode_t);
    va_end(ap);
  }
  const int fd = real(path, flags, mode);
  Track(fd, path);
  return fd;
}

ssize_t write(int fd, const void* buf, size_t n) {
  static ssize_t (*real)(int, const void*, size_t) = NULL;
  if (real == NULL) real = (ssize_t (*)(int, const void*, size_t))dlsym(RTLD_NEXT, "write");
  if (Armed(fd)) {
    errno = ENOSPC;
    return -1;
  }
  return real(fd, buf, n);
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t offset) {
  static ssize_t (*real)(int, const void*, size_t, off_t) = NULL;
  if (real == NULL) real = (ssize_t (*)(int, const void*, size_t, off_t))dlsym(RTLD_NEXT, "pwrite");
  if (Armed(fd)) {
    errno = ENOSPC;
    return -1;
  }
  return real(fd, buf, n, offset);
}

ssize_t pwrite64(int fd, const void* buf, size_t n, off_t offset) {
  static ssize_t (*real)(int, const void*, size_t, off_t) = NULL;
  if (real == NULL) real = (ssize_t (*)(int, const void*, size_t, off_t))dlsym(RTLD_NEXT, "pwrite64");
  if (Armed(fd)) {
    errno = ENOSPC;
    return -1;
  }
  return real(fd, buf, n, offset);
}

int close(int fd) {
  static int (*real)(int) = NULL;
  if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "close");
  if (fd >= 0 && fd < kMaxFd) g_tracked[fd] = 0;
  return real(fd);
}
