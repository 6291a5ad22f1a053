/*
 * topo.h -- allocate, bind and release a job's CPUs through the local topod, for resource
 * managers that load a shared object or call through a foreign-function interface; and, for a
 * malleable job's own program, learn when topod has resized it (topo_resize_wait).
 *
 * Link with -ltopo (libtopo.so, built from ffi/capi). Every function is safe to call from any
 * thread, never aborts the caller, and returns TOPO_OK or a negative TOPO_ERR_* code (the
 * notify calls at the end return a count of CPUs or -1, see there); `err`
 * (may be NULL) then receives a message for people, NUL-terminated and cut to `err_len`.
 * `socket` NULL means topod's default socket, /run/topo/topod.sock. Job ids follow topod's
 * rules: 1-128 characters of [A-Za-z0-9._-:@+[]], not starting with '.' or '-'.
 */
#ifndef TOPO_H
#define TOPO_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TOPO_OK 0
#define TOPO_ERR_INVALID (-1)     /* a NULL or malformed argument (job id, request, CPU list) */
#define TOPO_ERR_UNREACHABLE (-2) /* topod's socket cannot be reached */
#define TOPO_ERR_REFUSED (-3)     /* topod said no: does not fit, not allowed, unknown job, ... */
#define TOPO_ERR_INTERNAL (-4)    /* a bug in libtopo; the caller can go on */
#define TOPO_ERR_TRUNCATED (-5)   /* an output buffer was too small (the call itself succeeded) */

/* The library's version, e.g. "0.1.0". */
const char *topo_version(void);

/*
 * Places job `job` with `request` (topo's request language, e.g. "affinity[core(2)*4]") and
 * makes its cgroup. `tasks` is the number of tasks when the request does not say (0: one).
 * `cpus` (may be NULL) restricts the placement to the CPUs the batch system gave the job, as a
 * list ("0-7,16-23"). `mem_limit_bytes` 0 means no memory limit. On success the job's CPUs and
 * memory nodes are written as lists to `cpus_out` and `mems_out` (either may be NULL).
 * Allocating the same job again with the same request returns the same allocation.
 */
int topo_allocate(const char *socket, const char *job, const char *request, unsigned int tasks, const char *cpus,
                  unsigned long long mem_limit_bytes, char *cpus_out, size_t cpus_out_len, char *mems_out,
                  size_t mems_out_len, char *err, size_t err_len);

/* Moves process `pid` (with all its threads) into job `job`'s cgroup. */
int topo_bind(const char *socket, const char *job, int pid, char *err, size_t err_len);

/* Kills what is left of job `job`, removes its cgroup and frees its CPUs. */
int topo_release(const char *socket, const char *job, char *err, size_t err_len);

/*
 * Malleable jobs: the job's own side of a resize. When topod grows or shrinks a running job's
 * CPUs it first changes the job's cpuset, then atomically rewrites (writes beside it, renames
 * over it) the job's notify file, whose path the job's processes find in $TOPO_NOTIFY_FILE
 * (job-notify/ beside topod's socket, /run/topo/job-notify/ by default, then the job id), one key=value per line:
 *
 *     generation=3
 *     cpus=0-3,8-11
 *     mems=0
 *
 * generation is 1 when the job is allocated and one more at every change; keys not listed here
 * are skipped, so later versions of topod can add some. If the job's allocate asked for a
 * resize_signal, topod also sends that signal to every process of the job after the rewrite.
 *
 * These two calls talk to no topod (`socket` plays no part): they only read the file. Unlike the
 * calls above, they return a count of CPUs, and -1 on every error (no file, $TOPO_NOTIFY_FILE not
 * set, malformed content, an output buffer too small, no inotify), with a message in `err`
 * saying which. `notify_file` NULL means $TOPO_NOTIFY_FILE. `generation` and `cpus` may be NULL
 * (then `cpus_len` is ignored); when `cpus` is too small for the list, *generation is still set
 * (so the caller can see what it missed and read it again with topo_notify_read) and the call
 * returns -1. Both are safe from any thread and keep nothing open between calls.
 */

/*
 * Reads the notify file now: fills *generation and `cpus` (the job's CPUs as a list, e.g.
 * "0-3,8-11") and returns the number of CPUs in that list (at least 1), or -1.
 */
int topo_notify_read(const char *notify_file, unsigned long long *generation, char *cpus, size_t cpus_len,
                     char *err, size_t err_len);

/*
 * Waits until the notify file's generation is above `last_generation`, then fills *generation
 * and `cpus` as topo_notify_read does and returns the number of CPUs. The file is read at once
 * (so a change made before the call is not missed), then again each time its directory reports
 * it renamed into place or written (inotify). Returns 0 when `timeout_ms` milliseconds pass
 * without a newer generation (timeout_ms 0: look once; below 0: wait for ever), -1 on error,
 * including the file being removed or renamed away while waiting. A signal
 * caught by the caller does not end the wait; to be able to stop a waiting thread, give a
 * timeout and call again.
 */
int topo_resize_wait(const char *notify_file, unsigned long long last_generation, int timeout_ms,
                     unsigned long long *generation, char *cpus, size_t cpus_len, char *err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* TOPO_H */
