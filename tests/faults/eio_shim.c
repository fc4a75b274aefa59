// An LD_PRELOAD shim that injects read faults into one file (tests/test_io_faults.py):
// pread()s of the file PYEDGEMOE_FAULT_PATH whose range meets [PYEDGEMOE_FAULT_BEGIN,
// PYEDGEMOE_FAULT_END) fail with EIO, or with PYEDGEMOE_FAULT_SHORT=1 return half the bytes asked
// for (rounded down to 4 KiB, as O_DIRECT needs) and then end of file. PYEDGEMOE_FAULT_AFTER=N
// lets the first N such reads through; PYEDGEMOE_FAULT_TIMES=N fails only N (default: all).
// PYEDGEMOE_FAULT_DELAY_MS=N makes every read of the range slow instead (a slow disk), and
// PYEDGEMOE_FAULT_MARK=path is created at the first read of the range (the test knows it began).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static ssize_t (*real_pread)(int, void *, size_t, off_t);
static dev_t fault_dev;
static ino_t fault_ino;
static unsigned long long fault_begin, fault_end;
static long fault_after = 0, fault_times = -1;
static int fault_short;
static long delay_ms;
static const char * mark;
static atomic_long matches;  // reads of the range so far

__attribute__((constructor)) static void init(void) {
    real_pread = (ssize_t (*)(int, void *, size_t, off_t)) dlsym(RTLD_NEXT, "pread64");
    const char * path = getenv("PYEDGEMOE_FAULT_PATH");
    struct stat st;
    if (!path || stat(path, &st) != 0) return;
    fault_dev = st.st_dev;
    fault_ino = st.st_ino;
    fault_begin = strtoull(getenv("PYEDGEMOE_FAULT_BEGIN") ? getenv("PYEDGEMOE_FAULT_BEGIN") : "0", NULL, 10);
    fault_end = strtoull(getenv("PYEDGEMOE_FAULT_END") ? getenv("PYEDGEMOE_FAULT_END") : "0", NULL, 10);
    if (getenv("PYEDGEMOE_FAULT_AFTER")) fault_after = atol(getenv("PYEDGEMOE_FAULT_AFTER"));
    if (getenv("PYEDGEMOE_FAULT_TIMES")) fault_times = atol(getenv("PYEDGEMOE_FAULT_TIMES"));
    fault_short = getenv("PYEDGEMOE_FAULT_SHORT") != NULL;
    if (getenv("PYEDGEMOE_FAULT_DELAY_MS")) delay_ms = atol(getenv("PYEDGEMOE_FAULT_DELAY_MS"));
    mark = getenv("PYEDGEMOE_FAULT_MARK");
}

static int faulty(int fd, size_t size, off_t offset) {
    struct stat st;
    if (fault_ino == 0 || fstat(fd, &st) != 0 || st.st_ino != fault_ino || st.st_dev != fault_dev) return 0;
    if ((unsigned long long) offset >= fault_end || (unsigned long long) offset + size <= fault_begin) return 0;
    const long n = atomic_fetch_add(&matches, 1);
    if (n == 0 && mark) close(open(mark, O_CREAT | O_WRONLY, 0644));
    if (delay_ms > 0) {
        const struct timespec pause = { delay_ms / 1000, (delay_ms % 1000) * 1000000L };
        nanosleep(&pause, NULL);
        return 0;
    }
    return n >= fault_after && (fault_times < 0 || n < fault_after + fault_times);
}

ssize_t pread64(int fd, void * buf, size_t size, off_t offset) {
    if (faulty(fd, size, offset)) {
        if (!fault_short) {
            errno = EIO;
            return -1;
        }
        const size_t part = (size / 2) & ~(size_t) 4095;
        return part ? real_pread(fd, buf, part, offset) : 0;
    }
    return real_pread(fd, buf, size, offset);
}

ssize_t pread(int fd, void * buf, size_t size, off_t offset) { return pread64(fd, buf, size, offset); }
