// LD_PRELOAD shim for running aarch64 torch under qemu-user on an x86 machine: qemu passes /proc/cpuinfo through
// from the host, and the x86 text it gets makes the cpuinfo library (linked into libc10) crash while ATen picks
// its CPU kernels. Opening /proc/cpuinfo opens $BRISK_FAKE_CPUINFO (an aarch64 /proc/cpuinfo) instead.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char* redirect(const char* path) {
  const char* fake = getenv("BRISK_FAKE_CPUINFO");
  return path && fake && strcmp(path, "/proc/cpuinfo") == 0 ? fake : path;
}

#define OPEN_LIKE(name)                                                       \
  int name(const char* path, int flags, ...) {                                \
    static int (*real)(const char*, int, ...);                                \
    if (!real) real = (int (*)(const char*, int, ...))dlsym(RTLD_NEXT, #name); \
    va_list ap;                                                               \
    va_start(ap, flags);                                                      \
    const int mode = va_arg(ap, int);                                         \
    va_end(ap);                                                               \
    return real(redirect(path), flags, mode);                                 \
  }
OPEN_LIKE(open)
OPEN_LIKE(open64)

#define OPENAT_LIKE(name)                                                                 \
  int name(int dir, const char* path, int flags, ...) {                                   \
    static int (*real)(int, const char*, int, ...);                                       \
    if (!real) real = (int (*)(int, const char*, int, ...))dlsym(RTLD_NEXT, #name);       \
    va_list ap;                                                                           \
    va_start(ap, flags);                                                                  \
    const int mode = va_arg(ap, int);                                                     \
    va_end(ap);                                                                           \
    return real(dir, redirect(path), flags, mode);                                        \
  }
OPENAT_LIKE(openat)
OPENAT_LIKE(openat64)

#define FOPEN_LIKE(name)                                                               \
  FILE* name(const char* path, const char* mode) {                                     \
    static FILE* (*real)(const char*, const char*);                                    \
    if (!real) real = (FILE * (*)(const char*, const char*)) dlsym(RTLD_NEXT, #name);  \
    return real(redirect(path), mode);                                                 \
  }
FOPEN_LIKE(fopen)
FOPEN_LIKE(fopen64)
