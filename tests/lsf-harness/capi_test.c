/*
 * Calls libtopo (ffi/include/topo.h) as a resource manager would, against a real topod whose
 * socket is $CAPI_SOCKET: allocate, allocate again, bind, release, and every kind of bad call.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../ffi/include/topo.h"
#include "check.h"


int main(void) {
    const char *sock = getenv("CAPI_SOCKET");
    char cpus[256], mems[64], again[256], err[512];
    if (!sock) {
        fprintf(stderr, "set CAPI_SOCKET\n");
        return 2;
    }
    check(strlen(topo_version()) > 0, "topo_version: %s", topo_version());

    int rc = topo_allocate(sock, "capi-1", "affinity[core(2)]", 0, NULL, 0, cpus, sizeof cpus, mems, sizeof mems, err, sizeof err);
    check(rc == TOPO_OK && cpus[0] && mems[0], "allocate: rc %d, CPUs %s, memory nodes %s", rc, rc ? err : cpus, mems);
    rc = topo_allocate(sock, "capi-1", "affinity[core(2)]", 0, NULL, 0, again, sizeof again, NULL, 0, err, sizeof err);
    check(rc == TOPO_OK && strcmp(cpus, again) == 0, "allocating again gives the same CPUs (%s)", again);
    char tiny[3];
    rc = topo_allocate(sock, "capi-1", "affinity[core(2)]", 0, NULL, 0, tiny, sizeof tiny, NULL, 0, err, sizeof err);
    check(rc == TOPO_ERR_TRUNCATED && strlen(tiny) == 2, "a small buffer: TOPO_ERR_TRUNCATED, cut and terminated (%s)", err);
    rc = topo_bind(sock, "capi-1", (int)getpid(), err, sizeof err);
    check(rc == TOPO_OK, "bind this process: rc %d %s", rc, rc ? err : "");

    rc = topo_allocate(sock, NULL, "affinity[core(2)]", 0, NULL, 0, NULL, 0, NULL, 0, err, sizeof err);
    check(rc == TOPO_ERR_INVALID && strstr(err, "NULL"), "NULL job: %s", err);
    rc = topo_allocate(sock, "../x", "affinity[core(2)]", 0, NULL, 0, NULL, 0, NULL, 0, err, sizeof err);
    check(rc == TOPO_ERR_INVALID && strstr(err, "../x"), "path-like job id: %s", err);
    rc = topo_allocate(sock, "capi-2", "affinity[core(2", 0, NULL, 0, NULL, 0, NULL, 0, err, sizeof err);
    check(rc == TOPO_ERR_INVALID && strstr(err, "affinity[core(2"), "bad request: %s", err);
    rc = topo_allocate(sock, "capi-2", "affinity[core(2)]", 0, "0-x", 0, NULL, 0, NULL, 0, err, sizeof err);
    check(rc == TOPO_ERR_INVALID && strstr(err, "0-x"), "bad CPU list: %s", err);
    rc = topo_allocate(sock, "capi-2", "affinity[core(1000)]", 0, NULL, 0, NULL, 0, NULL, 0, err, sizeof err);
    check(rc == TOPO_ERR_REFUSED, "a request that cannot fit: refused: %s", err);
    rc = topo_allocate("/nonexistent/topod.sock", "capi-2", "affinity[core(2)]", 0, NULL, 0, NULL, 0, NULL, 0, err, sizeof err);
    check(rc == TOPO_ERR_UNREACHABLE && strstr(err, "/nonexistent/topod.sock"), "no topod: %s", err);
    rc = topo_bind(sock, "capi-1", 0, err, sizeof err);
    check(rc == TOPO_ERR_INVALID, "pid 0: %s", err);
    rc = topo_allocate(sock, "capi-3", "affinity[core(2)]", 0, NULL, 0, NULL, 0, NULL, 0, NULL, 0);
    check(rc == TOPO_OK, "NULL output and error buffers are allowed");
    check(topo_release(sock, "capi-3", NULL, 0) == TOPO_OK, "release capi-3");

    rc = topo_release(sock, "capi-1", err, sizeof err);
    check(rc == TOPO_OK, "release: rc %d %s", rc, rc ? err : "");
    rc = topo_release(sock, "capi-1", err, sizeof err);
    check(rc == TOPO_ERR_REFUSED, "release again: refused: %s", err);
    fprintf(stderr, "capi: %s\n", failures ? "FAILED" : "passed");
    return failures ? 1 : 0;
}
