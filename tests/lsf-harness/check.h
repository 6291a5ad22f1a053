/* The harnesses' one assertion: prints "ok" or "FAIL" with the message and counts failures. */
#ifndef TOPO_HARNESS_CHECK_H
#define TOPO_HARNESS_CHECK_H
#include <stdarg.h>
#include <stdio.h>

static int failures;

__attribute__((format(printf, 2, 3))) static void check(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, ok ? "  ok    " : "  FAIL  ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    failures += !ok;
}

#endif
