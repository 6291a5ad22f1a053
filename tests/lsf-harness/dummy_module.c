/*
 * The cost of the scheduler ABI itself, for the harness's scale scenario to measure the topo
 * module against (issue 31: "topo <= 1.3x the dummy module in the same run").
 *
 * A module that accepts every host: newFn reads its -extsched strings and attaches data keyed
 * by them, as any module must; matchFn walks every candidate of every group (reading each, as a
 * module that decides per host must) and removes none; sortFn walks them again and keeps their
 * order; notifyAllocFn and checkAllocFn accept. It registers handler id 199 through the LSF 9/10
 * names the harness exports (it is only built for the 9/10 harness).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../ffi/include/lssched.h"

#define API __attribute__((visibility("default")))

struct dummy_data {
    char key[64];
    uintptr_t checksum; /* what the walks read, so that the compiler keeps them */
};

static void walk(struct dummy_data *d, void *list) {
    for (struct candHostGroup *g = extsched_cand_getnextgroup(list); g != NULL; g = extsched_cand_getnextgroup(NULL))
        for (int i = 0; i < g->numOfMembers; i++)
            d->checksum += (uintptr_t)g->candHost[i].hostPtr ^ (uintptr_t)g->candHost[i].hostIdx;
}

static int dummy_new(void *resreq) {
    int n = 0;
    char **elements = extsched_resreq_getextresreq(resreq, &n);
    struct dummy_data *d = calloc(1, sizeof *d);
    if (d == NULL)
        return -1;
    strcpy(d->key, "dummy");
    for (int i = 0; elements != NULL && i < n; i++)
        if (elements[i] != NULL && elements[i][0] != '\0') {
            strncpy(d->key, elements[i], sizeof d->key - 1);
            break;
        }
    extsched_resreq_setobject(resreq, 199, d->key, d);
    return 0;
}

static void dummy_free(void *data) { free(data); }

static int dummy_match(void *data, void *list, void *reason) {
    (void)reason;
    walk(data, list);
    return 0;
}

static int dummy_sort(void *data, void *list, void *reason) {
    (void)reason;
    walk(data, list);
    return 0;
}

static int dummy_notify(void *info, void *job, void *alloc, void *limits, int flag) {
    (void)info, (void)job, (void)alloc, (void)limits, (void)flag;
    return 0;
}

static int dummy_check(void *info, void *job, void *alloc, void *limits) {
    (void)info, (void)job, (void)alloc, (void)limits;
    return 0;
}

API int sched_version(void *p) {
    (void)p;
    return 0;
}

API int sched_init(void *p) {
    (void)p;
    static RsrcReqHandlerType h = {dummy_new, dummy_free, dummy_match, dummy_sort, dummy_notify, dummy_check};
    return extsched_resreq_registerhandler(199, &h);
}

API int sched_pre_proc(void *p) {
    (void)p;
    return 0;
}
API int sched_match_limit(void *p) {
    (void)p;
    return 0;
}
API int sched_order_alloc(void *p) {
    (void)p;
    return 0;
}
API int sched_post_proc(void *p) {
    (void)p;
    return 0;
}
API int sched_finalize(void *p) {
    (void)p;
    return 0;
}
