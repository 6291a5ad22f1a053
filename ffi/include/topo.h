/*
 * topo.h -- allocate, bind and release a job's CPUs through the local topod, for resource
 * managers that load a shared object or call through a foreign-function interface.
 *
 * Link with -ltopo (libtopo.so, built from ffi/capi). Every function is safe to call from any
 * thread, never aborts the caller, and returns TOPO_OK or a negative TOPO_ERR_* code; `err`
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

#ifdef __cplusplus
}
#endif

#endif /* TOPO_H */
