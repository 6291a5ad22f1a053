/*
 * A stand-in for LSF's scheduler (mbschd), for testing schmod_topo.so without LSF.
 *
 * It dlopen()s the module as the scheduler does, calls sched_init, and provides from this
 * executable (linked with -rdynamic) the scheduler functions the module calls: the LSF 9/10
 * extsched_* names, or with -DLSB_ONLY only the 6.x lsb_* names. It then drives scheduling
 * sessions against real topod processes that tests/lsf-harness/run.sh started, and checks
 * which hosts the module removes (and with which pending reason), their order, the pending
 * reason text of a bad request, tentative reservations across dispatches, checkAlloc limits,
 * the replay after a scheduler restart, and topod's topology reservations and defrag on h3.
 *
 * Usage: harness MODULE.so SCENARIO    (session | restart | reinit | reconfig | agree | rehardware | open | pools | refuse | panic | blocks | scale)
 * Environment: TOPO_LSF_CONF (the module's config, written by run.sh), HARNESS_TOPOCTL,
 * HARNESS_H1_SOCKET and HARNESS_H3_SOCKET (to change topod's state between sessions),
 * HARNESS_REFRESH_MS.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../ffi/include/lssched.h"
#include "check.h"

#define API __attribute__((visibility("default")))

/* ---------------------------------------------------------------------------------------- */
/* The scheduler's objects                                                                   */

/* The scenarios' four hosts h1..h4; the scale scenario offers up to MAXHOSTS. */
enum { NHOSTS = 4, MAXHOSTS = 12000, MAXMSG = 2 };
static const char *host_names[MAXHOSTS] = {"h1", "h2", "h3", "h4"};
static struct hostSlot slots[MAXHOSTS];
static int host_tokens[MAXHOSTS]; /* what hostPtr points at */
static int n_hosts = NHOSTS;      /* hosts in the table */
/* 0: extsched_cand_removehost compacts the array at once (the module walks each group from
 * its end, so each removal moves only the members kept after it). 1 (scale): the member is
 * marked and the array compacted once after matchFn returns (compact_list), so that the
 * figures time the module, not this stand-in's O(kept) memmove per removal. */
static int deferred_removal;

struct resreq {
    char *msgs[MAXMSG];
    const char *mandatory, *deflt;
    char *key;
    void *data;
    int set;
};

struct cand_list {
    struct candHostGroup group;
    struct candHost members[MAXHOSTS];
    int iterated;
};

struct reasons {
    int id[MAXHOSTS];
    char *main_text;
};

struct job {
    int id, index;
    char *res_key;
    const char *queue, *user; /* NULL: not told (most scenarios) */
};

struct alloc {
    const char *host;
    int slots;
};

struct limit {
    char host[64];
    int max_tasks, reason, handler, calls;
    char detail[512];
};

static RsrcReqHandlerType handler;
static int handler_id = -1, handler_registered;
/* The scale scenario's dummy module (dummy_module.c), loaded beside the module under test. */
static RsrcReqHandlerType dummy_handler;
static int dummy_id = -1;
static struct cand_list *current_list;
static struct limit last_limit;

/* ---------------------------------------------------------------------------------------- */
/* The functions the module calls. Each is defined once and exported under the names the
 * scheduler generation being emulated has.                                                  */

static int refuse_registrations; /* the "refuse" scenario: the scheduler refuses this many */
static int do_register(int id, RsrcReqHandlerType *h) {
    if (id < 100 || id > 199 || h == NULL)
        return -1;
    if (refuse_registrations > 0) {
        refuse_registrations--;
        return -1;
    }
    handler = *h; /* the scheduler keeps a copy */
    handler_id = id;
    handler_registered++;
    return 0;
}
static void do_setobject(void *rr, int id, char *key, void *data) {
    struct resreq *r = rr;
    if (id != handler_id && id != dummy_id)
        fprintf(stderr, "  FAIL  setobject with handler id %d, registered %d\n", id, handler_id), failures++;
    free(r->key);
    r->key = strdup(key); /* the key is copied */
    r->data = data;
    r->set = 1;
}
static char **do_getextresreq(void *rr, int *cnt) {
    struct resreq *r = rr;
    *cnt = MAXMSG;
    return r->msgs;
}
static int do_getqueextsched(void *rr, char **mand, char **def) {
    struct resreq *r = rr;
    *mand = (char *)r->mandatory;
    *def = (char *)r->deflt;
    return 0;
}
static struct candHostGroup *do_getnextgroup(void *list) {
    if (list != NULL) {
        current_list = list;
        current_list->iterated = 0;
    }
    if (current_list == NULL || current_list->iterated)
        return NULL;
    current_list->iterated = 1;
    return &current_list->group;
}
static void do_removehost(struct candHostGroup *g, int index) {
    if (index < 0 || index >= g->numOfMembers) {
        fprintf(stderr, "  FAIL  removehost index %d of %d\n", index, g->numOfMembers);
        failures++;
        return;
    }
    if (deferred_removal) {
        if (g->candHost[index].hostPtr == NULL) {
            fprintf(stderr, "  FAIL  removehost index %d twice\n", index);
            failures++;
        }
        g->candHost[index].hostPtr = NULL; /* compacted by compact_list */
        return;
    }
    memmove(&g->candHost[index], &g->candHost[index + 1], sizeof(struct candHost) * (g->numOfMembers - index - 1));
    g->numOfMembers--;
}
static void compact_list(struct candHostGroup *g) {
    int n = 0;
    for (int i = 0; i < g->numOfMembers; i++)
        if (g->candHost[i].hostPtr != NULL)
            g->candHost[n++] = g->candHost[i];
    g->numOfMembers = n;
}
/* How often the module asked for a candidate's slot, and for a host pointer's name. */
static long availslot_calls, hostid_calls;
static struct hostSlot *do_getavailslot(struct candHost *c) {
    availslot_calls++;
    return &slots[c->hostIdx];
}
static int do_reason_set(void *rp, struct candHost *c, int id) {
    struct reasons *r = rp;
    r->id[c->hostIdx] = id;
    return 0;
}
static struct jobInfo *fill_jobinfo(struct job *j, struct jobInfo *info) {
    memset(info, 0, sizeof *info);
    info->jobId = j->id;
    info->jobIndex = j->index;
    info->resKey = j->res_key ? strdup(j->res_key) : NULL;
    info->queue = j->queue ? strdup(j->queue) : NULL;
    info->user = j->user ? strdup(j->user) : NULL;
    return info;
}

#ifndef LSB_ONLY
API int extsched_resreq_registerhandler(int id, RsrcReqHandlerType *h) { return do_register(id, h); }
API void extsched_resreq_setobject(INT_RsrcReq *rr, int id, char *key, void *data) { do_setobject(rr, id, key, data); }
API char **extsched_resreq_getextresreq(INT_RsrcReq *rr, int *cnt) { return do_getextresreq(rr, cnt); }
API int extsched_resreq_getqueextsched(INT_RsrcReq *rr, char **m, char **d) { return do_getqueextsched(rr, m, d); }
API struct candHostGroup *extsched_cand_getnextgroup(INT_CandGroupList *l) { return do_getnextgroup(l); }
API void extsched_cand_removehost(struct candHostGroup *g, int i) { do_removehost(g, i); }
API struct hostSlot *extsched_cand_getavailslot(struct candHost *c) { return do_getavailslot(c); }
/* Documented "caller frees both": the strings are malloc'ed per call, so a module that does not
 * free them leaks (memcheck's definite leaks fail the valgrind run). */
API int extsched_getHostID(INT_Host *hostPtr, char **hostname, char **clustername) {
    hostid_calls++;
    long i = (int *)hostPtr - host_tokens;
    if (i < 0 || i >= n_hosts)
        return -1;
    *hostname = strdup(host_names[i]);
    *clustername = strdup("harness_cluster");
    return 0;
}
API int extsched_reason_set(INT_Reason *r, struct candHost *c, int id) { return do_reason_set(r, c, id); }
API int extsched_setMainReason(INT_Reason *rp, char *msg, int level) {
    struct reasons *r = rp;
    (void)level;
    free(r->main_text);
    r->main_text = strdup(msg);
    return 0;
}
API int extsched_getJobInfo(INT_Job *job, struct jobInfo *info) {
    fill_jobinfo(job, info);
    return 0;
}
API void extsched_freeJobInfo(struct jobInfo *info) {
    free(info->resKey);
    free(info->queue);
    free(info->user);
    info->resKey = info->queue = info->user = NULL;
}
API int extsched_getAlloc(INT_Alloc *a, extsched_Alloc **out) {
    struct alloc *al = a;
    extsched_Alloc *x = calloc(1, sizeof *x);
    x->type = ALLOC_TYPE_ALLOC;
    x->nInst = 1;
    x->inst = calloc(1, sizeof *x->inst);
    x->inst[0] = calloc(1, sizeof **x->inst);
    x->inst[0]->host = strdup(al->host);
    x->inst[0]->rsrc = NULL;
    x->inst[0]->amount = (float)al->slots;
    *out = x;
    return 0;
}
API void extsched_freeAlloc(extsched_Alloc **p) {
    extsched_Alloc *x = *p;
    for (int i = 0; i < x->nInst; i++) {
        free(x->inst[i]->host);
        free(x->inst[i]);
    }
    free(x->inst);
    free(x);
    *p = NULL;
}
API int extsched_addAllocLimit(INT_AllocLimitList *l, INT_Alloc *a, char *host, int max, int reason, char *detail, int hid, int bucket) {
    (void)l, (void)a, (void)bucket;
    snprintf(last_limit.host, sizeof last_limit.host, "%s", host ? host : "(all)");
    snprintf(last_limit.detail, sizeof last_limit.detail, "%s", detail ? detail : "");
    last_limit.max_tasks = max;
    last_limit.reason = reason;
    last_limit.handler = hid;
    last_limit.calls++;
    return 0;
}
API extsched_SchedContext extsched_getCheckAllocContext(void) { return SCHED_CONTEXT_ALLOC; }
#else
API int lsb_resreq_registerhandler(int id, RsrcReqHandlerType *h) { return do_register(id, h); }
API void lsb_resreq_setobject(void *rr, int id, char *key, void *data) { do_setobject(rr, id, key, data); }
API char **lsb_resreq_getextresreq(void *rr, int *cnt) { return do_getextresreq(rr, cnt); }
API int lsb_resreq_getqueextsched(void *rr, char **m, char **d) { return do_getqueextsched(rr, m, d); }
API struct candHostGroup *lsb_cand_getnextgroup(void *l) { return do_getnextgroup(l); }
API void lsb_cand_removehost(struct candHostGroup *g, int i) { do_removehost(g, i); }
API struct hostSlot *lsb_cand_getavailslot(struct candHost *c) { return do_getavailslot(c); }
API int lsb_reason_set(void *r, struct candHost *c, int id) { return do_reason_set(r, c, id); }
static struct jobInfo static_jobinfo; /* 6.x returns a static buffer */
API struct jobInfo *lsb_get_jobinfo(void *job, int phase) {
    (void)phase;
    free(static_jobinfo.resKey);
    free(static_jobinfo.queue);
    free(static_jobinfo.user);
    return fill_jobinfo(job, &static_jobinfo);
}
static struct hostSlot alloc_slot;
API struct hostSlot *lsb_alloc_gethostslot(void *a, void *l, int *cnt, struct candHostGroup **g) {
    struct alloc *al = a;
    (void)l;
    alloc_slot.name = (char *)al->host;
    alloc_slot.nslotAlloc = al->slots;
    *cnt = 1;
    *g = NULL;
    return &alloc_slot;
}
#endif

/* ---------------------------------------------------------------------------------------- */
/* Driving the module                                                                        */

/* A new resource requirement, given to `h`'s newFn. */
static struct resreq *new_resreq_for(const RsrcReqHandlerType *h, const char *job, const char *mandatory, const char *deflt) {
    struct resreq *r = calloc(1, sizeof *r);
    r->msgs[0] = strdup(""); /* observed: the user's string is element 1 */
    r->msgs[1] = job ? strdup(job) : NULL;
    r->mandatory = mandatory;
    r->deflt = deflt;
    int rc = h->newFn(r);
    if (rc != 0)
        fprintf(stderr, "        newFn returned %d\n", rc);
    return r;
}

static struct resreq *new_resreq(const char *job, const char *mandatory, const char *deflt) {
    return new_resreq_for(&handler, job, mandatory, deflt);
}

static void free_resreq_for(const RsrcReqHandlerType *h, struct resreq *r) {
    if (r->set && h->freeFn)
        h->freeFn(r->data);
    free(r->msgs[0]);
    free(r->msgs[1]);
    free(r->key);
    free(r);
}

static void free_resreq(struct resreq *r) { free_resreq_for(&handler, r); }

static void fill_list(struct cand_list *l, const int *order, int n) {
    memset(l, 0, sizeof *l);
    for (int i = 0; i < n; i++) {
        l->members[i].hostIdx = order[i];
        l->members[i].hostPtr = &host_tokens[order[i]];
    }
    l->group.maxOfMembers = n;
    l->group.numOfMembers = n;
    l->group.candHost = l->members;
}

/* Runs matchFn then sortFn over h1..h4 (in `order`), and returns the surviving names joined
 * by commas in `out`; the reasons land in `rs`. */
static int match_sort(struct resreq *r, const int *order, struct reasons *rs, char *out, size_t outlen) {
    struct cand_list l;
    fill_list(&l, order, NHOSTS);
    memset(rs, 0, sizeof *rs);
    int rc = handler.matchFn(r->data, &l, rs);
    if (rc == 0)
        rc = handler.sortFn(r->data, &l, rs);
    out[0] = 0;
    for (int i = 0; i < l.group.numOfMembers; i++) {
        if (i)
            strncat(out, ",", outlen - strlen(out) - 1);
        strncat(out, host_names[l.group.candHost[i].hostIdx], outlen - strlen(out) - 1);
    }
    current_list = NULL;
    return rc;
}

static const int DEFAULT_ORDER[NHOSTS] = {2, 3, 1, 0}; /* h3, h4, h2, h1 */

static void dispatch(struct resreq *r, int id, const char *host, int slots, int flag) {
    struct job j = {id, 0, r->key, NULL, NULL};
    struct alloc a = {host, slots};
    int rc = handler.notifyAllocFn(r->data, &j, &a, NULL, flag);
    check(rc == 0, "notifyAllocFn(job %d on %s, flag 0x%x) returns 0 (got %d)", id, host, flag, rc);
}

static void expect(struct resreq *r, const char *want, const char *what) {
    struct reasons rs;
    char got[128];
    int rc = match_sort(r, DEFAULT_ORDER, &rs, got, sizeof got);
    check(rc == 0 && strcmp(got, want) == 0, "%s: kept [%s], expected [%s]", what, got, want);
    free(rs.main_text);
}

static int reason_base = 20001;

static void wait_refresh(void) {
    const char *ms = getenv("HARNESS_REFRESH_MS");
    usleep((useconds_t)(ms ? atoi(ms) : 300) * 3 * 1000);
}

static int topoctl(const char *args) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s %s >/dev/null", getenv("HARNESS_TOPOCTL"), args);
    return system(cmd);
}

static void scenario_session(void) {
    struct reasons rs;
    char got[128];
    const char *socket_req = "affinity[core(24,same=socket)]";

    fprintf(stderr, "filtering: one package of 24 cores\n");
    struct resreq *big = new_resreq(socket_req, NULL, NULL);
    check(big->set, "newFn attaches data to a job with a topology request (key %s)", big->key ? big->key : "-");
    int rc = match_sort(big, DEFAULT_ORDER, &rs, got, sizeof got);
    check(rc == 0, "matchFn + sortFn return 0");
    check(strstr(got, "h1") && strstr(got, "h2") && !strstr(got, "h3") && !strstr(got, "h4"), "h1 and h2 kept, h3 and h4 removed: [%s]", got);
    check(rs.id[2] == reason_base + 1, "h3 (8 cores per package) removed with 'does not fit' (%d)", rs.id[2]);
    check(rs.id[3] == reason_base + 2, "h4 (no topod) removed with 'state unknown', fail-closed (%d)", rs.id[3]);
    free(rs.main_text);

    fprintf(stderr, "ranking: 16 cores anywhere\n");
    struct resreq *spread = new_resreq("affinity[core(16)]", NULL, NULL);
    rc = match_sort(spread, DEFAULT_ORDER, &rs, got, sizeof got);
    check(rc == 0 && strlen(got) > 0 && strcmp(got + strlen(got) - 2, "h3") == 0,
          "h3 (16 cores only across both packages) ranked last, though offered first: [%s]", got);
    free(rs.main_text);

    /* The module keeps the scores of only its last few matches (issue 31: a requirement that
     * kept them until freeFn held 16 bytes per candidate, 246 KB each at 10,000 hosts); a sort
     * whose match's scores are gone asks the memo again and ranks the same. */
    fprintf(stderr, "a scheduler that matches every pending requirement before it sorts any\n");
    char ranked[128];
    snprintf(ranked, sizeof ranked, "%s", got);
    struct cand_list *late = malloc(sizeof *late), *between = malloc(sizeof *between);
    struct reasons *rs_between = malloc(sizeof *rs_between);
    fill_list(late, DEFAULT_ORDER, NHOSTS);
    memset(&rs, 0, sizeof rs);
    rc = handler.matchFn(spread->data, late, &rs);
    current_list = NULL;
    struct resreq *others[6]; /* pending (not freed) until after the sort */
    for (int i = 0; i < 6; i++) {
        others[i] = new_resreq(i % 2 ? "affinity[core(2)]" : "affinity[core(4,same=numa)]", NULL, NULL);
        fill_list(between, DEFAULT_ORDER, NHOSTS);
        memset(rs_between, 0, sizeof *rs_between);
        rc |= handler.matchFn(others[i]->data, between, rs_between);
        current_list = NULL;
        free(rs_between->main_text);
    }
    rc |= handler.sortFn(spread->data, late, &rs);
    current_list = NULL;
    for (int i = 0; i < 6; i++)
        free_resreq(others[i]);
    got[0] = 0;
    for (int i = 0; i < late->group.numOfMembers; i++) {
        if (i)
            strncat(got, ",", sizeof got - strlen(got) - 1);
        strncat(got, host_names[late->group.candHost[i].hostIdx], sizeof got - strlen(got) - 1);
    }
    check(rc == 0 && strcmp(got, ranked) == 0, "sorted after six other matches, the 16-core job ranks as before: [%s], before [%s]", got,
          ranked);
    free(rs.main_text);
    free(late);
    free(between);
    free(rs_between);

    fprintf(stderr, "a bad -extsched string\n");
    struct resreq *bad = new_resreq("affinity[core(2,same=numaa)]", NULL, NULL);
    rc = match_sort(bad, DEFAULT_ORDER, &rs, got, sizeof got);
    check(rc == 0 && got[0] == 0, "every host removed: [%s]", got);
    check(rs.id[0] == reason_base && rs.id[2] == reason_base, "with the 'bad request' reason %d (%d)", reason_base, rs.id[0]);
    check(rs.main_text && strstr(rs.main_text, "\"affinity[core(2,same=numaa)]\"") && strstr(rs.main_text, "(\"numaa\"): unknown level"),
          "the pending reason quotes the fragment: %s", rs.main_text ? rs.main_text : "(none)");
    free(rs.main_text);

    fprintf(stderr, "jobs without a topology request\n");
    struct resreq *other = new_resreq("filer[vol1 vol2]", NULL, NULL);
    check(!other->set, "another module's -extsched string is left to LSF");
    struct resreq *none = new_resreq(NULL, NULL, NULL);
    check(!none->set, "no -extsched at all is left to LSF");

    fprintf(stderr, "queue strings\n");
    struct resreq *merged = new_resreq("affinity[core(24)]", "affinity[core(24,same=socket)]", NULL);
    expect(merged, "h2,h1", "MANDATORY_EXTSCHED adds same=socket, so h3 goes");
    struct resreq *deflt = new_resreq(NULL, NULL, socket_req);
    check(deflt->set, "DEFAULT_EXTSCHED alone makes a topology job");

    fprintf(stderr, "reservations within a session\n");
    dispatch(big, 101, "h1", 1, NOTIFY_ALLOC | NOTIFY_IN_SCHED_SESSION);
    expect(big, "h2,h1", "after job 101 took one package of h1, h1 still has one");
    dispatch(big, 102, "h1", 1, NOTIFY_ALLOC | NOTIFY_IN_SCHED_SESSION);
    expect(big, "h2", "after job 102 took the other, h1 is full: the same CPUs are never counted twice");

    fprintf(stderr, "checkAllocFn\n");
    struct job j104 = {104, 0, big->key, NULL, NULL};
    struct alloc a104 = {"h1", 1};
    memset(&last_limit, 0, sizeof last_limit);
    rc = handler.checkAllocFn(big->data, &j104, &a104, (void *)&last_limit);
    check(rc == 0 && last_limit.calls == 1 && strcmp(last_limit.host, "h1") == 0 && last_limit.max_tasks == 0 &&
              last_limit.reason == reason_base + 3,
          "an allocation of job 104 on full h1 is limited to 0 tasks with reason %d (calls %d, host %s, max %d, reason %d)",
          reason_base + 3, last_limit.calls, last_limit.host, last_limit.max_tasks, last_limit.reason);
    check(strstr(last_limit.detail, "h1") != NULL, "with a detail naming the host: %s", last_limit.detail);
    struct alloc a104b = {"h2", 1};
    memset(&last_limit, 0, sizeof last_limit);
    rc = handler.checkAllocFn(big->data, &j104, &a104b, (void *)&last_limit);
    check(rc == 0 && last_limit.calls == 0, "an allocation on h2, where it fits, is not limited");

    fprintf(stderr, "deallocation\n");
    dispatch(big, 102, "h1", 1, NOTIFY_DEALLOC);
    expect(big, "h2,h1", "after job 102 ended, h1 has a package again");

    fprintf(stderr, "topod confirms job 101\n");
    check(topoctl("alloc --socket \"$HARNESS_H1_SOCKET\" --job lsf-101 'affinity[core(24,same=socket)]'") == 0,
          "job 101 starts on h1 (topoctl alloc, as topo-exec would)");
    wait_refresh();
    struct resreq *two = new_resreq("affinity[core(24,same=socket)*2]", NULL, NULL);
    expect(two, "", "two packages: h1 holds job 101 (once: its reservation went when topod reported it), h2 holds one");
    expect(big, "h2,h1", "one package: h1 still has exactly one free");

    /* Each host's name is read once for the whole session (its pointer is remembered), through
     * the call whose ownership is documented (extsched_getHostID, whose strings the module frees:
     * the valgrind run of this scenario fails on a definite leak). */
#ifndef LSB_ONLY
    check(hostid_calls > 0 && hostid_calls <= NHOSTS && availslot_calls == 0,
          "host names read once per host (%ld extsched_getHostID calls for %d hosts), no hostSlot asked for (%ld)", hostid_calls,
          NHOSTS, availslot_calls);
#endif
    free_resreq(big);
    free_resreq(spread);
    free_resreq(bad);
    free_resreq(other);
    free_resreq(none);
    free_resreq(merged);
    free_resreq(deflt);
    free_resreq(two);
}

static void scenario_restart(void) {
    fprintf(stderr, "a restarted scheduler replays its running jobs (NOTIFY_STARTUP)\n");
    struct resreq *big = new_resreq("affinity[core(24,same=socket)]", NULL, NULL);
    expect(big, "h2,h1", "before the replay: h1 and h2 each have a free package");
    dispatch(big, 101, "h1", 1, NOTIFY_STARTUP); /* topod already holds it: nothing added */
    dispatch(big, 105, "h2", 1, NOTIFY_STARTUP); /* dispatched, not started yet */
    expect(big, "h1", "after the replay: job 105 holds h2's free package; job 101 is not counted twice on h1");
    dispatch(big, 105, "h2", 1, NOTIFY_DEALLOC);
    expect(big, "h2,h1", "job 105 deallocated");
    free_resreq(big);
#ifdef LSB_ONLY
    check(availslot_calls > 0 && availslot_calls <= NHOSTS,
          "6.x: each host's slot asked for once (%ld lsb_cand_getavailslot calls for %d hosts over 4 matches)", availslot_calls,
          NHOSTS);
#else
    check(hostid_calls > 0 && hostid_calls <= NHOSTS && availslot_calls == 0,
          "9/10: each host's name read once with extsched_getHostID (%ld calls for %d hosts over 4 matches; %ld hostSlots)",
          hostid_calls, NHOSTS, availslot_calls);
#endif
}

/* A request whose canonical form is longer than a handler key (265 bytes): keyed by a hash. */
#define LONG_REQUEST                                                                                                   \
    "CPUSET[CPU_LIST=0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,30,32,34,36,38,40,42,44,46,48,50,52,54,56,58,60,62,64,"  \
    "66,68,70,72,74,76,78,80,82,84,86,88,90,92,94] affinity[thread(1,same=numa,exclusive=(core,alljobs))*24:"          \
    "cpubind=thread:membind=localonly:distribute=balance]"

/* A restarted scheduler replays a running job keyed by a hash (issue 31): "save" (one process)
 * makes the key and writes it to $HARNESS_KEY_FILE; "replay" (a new process, which never saw the
 * request) replays the job with that key at NOTIFY_STARTUP. Before, the new process did not
 * know the hash: notifyAllocFn returned -1 and the job's CPUs were offered to the next job. */
static void scenario_longkey(const char *mode) {
    const char *file = getenv("HARNESS_KEY_FILE");
    if (!file) {
        check(0, "HARNESS_KEY_FILE is set");
        return;
    }
    if (strcmp(mode, "save") == 0) {
        fprintf(stderr, "a request longer than a handler key is keyed by a hash\n");
        struct resreq *r = new_resreq(LONG_REQUEST, NULL, NULL);
        check(r->key && strlen(r->key) <= 256 && strncmp(r->key, "topo#h#", 7) == 0, "its key is a hash (%s)",
              r->key ? r->key : "none");
        FILE *f = fopen(file, "w");
        if (f && r->key) {
            fputs(r->key, f);
            fclose(f);
        }
        free_resreq(r);
        return;
    }
    fprintf(stderr, "a new scheduler process replays a job keyed by a hash it never made\n");
    char key[300] = {0};
    FILE *f = fopen(file, "r");
    check(f && fgets(key, sizeof key, f), "the first process's key is read");
    if (f)
        fclose(f);
    struct job j = {301, 0, key, NULL, NULL};
    struct alloc a = {"h2", 24};
    int rc = handler.notifyAllocFn(NULL, &j, &a, NULL, NOTIFY_STARTUP);
    check(rc == 0, "notifyAllocFn(job 301 on h2, NOTIFY_STARTUP) with the hashed key returns 0 (got %d)", rc);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "grep -q 'lsf-301.*startup=true' '%s'", getenv("HARNESS_LOG"));
    check(system(cmd) == 0, "the module reserved the replayed job's CPUs on h2 (its log says so)");
    j.res_key = key;
    rc = handler.notifyAllocFn(NULL, &j, &a, NULL, NOTIFY_DEALLOC);
    check(rc == 0, "and deallocates it (%d)", rc);
}

/* The module as the scheduler holds it: the library and its seven entry points. */
static void *module_so;
static int (*entry_fn[7])(void *);
static const char *entry_names[7] = {"sched_version", "sched_init", "sched_pre_proc", "sched_match_limit",
                                     "sched_order_alloc", "sched_post_proc", "sched_finalize"};

/* As the scheduler loads a module listed in lsb.modules. */
static int load_module(const char *path) {
    module_so = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!module_so) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return -1;
    }
    for (int i = 0; i < 7; i++) {
        *(void **)&entry_fn[i] = dlsym(module_so, entry_names[i]);
        check(entry_fn[i] != NULL, "the module exports %s", entry_names[i]);
        if (!entry_fn[i])
            return -1;
    }
    return 0;
}

/* Loads the dummy module (dummy_module.c) beside the module under test and keeps its handler
 * apart: the module under test stays the one `handler` is. Returns -1 when it cannot. */
static int load_dummy(const char *path) {
    RsrcReqHandlerType kept = handler;
    int kept_id = handler_id, kept_registered = handler_registered;
    void *so = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    int (*init)(void *) = NULL;
    if (so)
        *(void **)&init = dlsym(so, "sched_init");
    int rc = init ? init(NULL) : -1;
    if (rc == 0) {
        dummy_handler = handler;
        dummy_id = handler_id;
    }
    handler = kept;
    handler_id = kept_id;
    handler_registered = kept_registered;
    check(rc == 0 && dummy_id != handler_id, "the dummy module %s loads and registers its handler (id %d)", path, dummy_id);
    return rc == 0 ? 0 : -1;
}

/* The "open" scenario (run.sh gives it a config with unreachable = "open"): fail-open is for a
 * topod that does not answer, not for one not asked yet (issue 31: after a restart every host
 * was offered until the first refresh brought it, an impossible request kept 9,997 of 10,000
 * hosts, and a job landed on a host the replayed jobs had filled). */
static void scenario_open(const char *path) {
    fprintf(stderr, "fail-open: a scheduler restart, and a match at once, before the host states come\n");
    check(entry_fn[6](NULL) == 0, "sched_finalize returns 0");
    dlclose(module_so);
    if (load_module(path) != 0)
        return;
    check(entry_fn[1](NULL) == 0, "sched_init again returns 0");
    struct resreq *huge = new_resreq("affinity[core(4096)]", NULL, NULL);
    struct reasons rs;
    char got[128];
    int rc = match_sort(huge, DEFAULT_ORDER, &rs, got, sizeof got);
    check(rc == 0 && !strstr(got, "h1") && !strstr(got, "h2") && !strstr(got, "h3"),
          "4096 cores, at once: h1-h3 (asked, answers not yet in, or in and too small) are not offered: [%s]", got);
    free(rs.main_text);
    wait_refresh();
    rc = match_sort(huge, DEFAULT_ORDER, &rs, got, sizeof got);
    check(rc == 0 && strcmp(got, "h4") == 0 && rs.id[0] == reason_base + 1,
          "once they have answered: only h4, whose topod does not answer, is offered (fail-open): [%s]", got);
    free(rs.main_text);
    free_resreq(huge);
}

/* The "pools" scenario (run.sh points h1 at a topod of its own, "hp": an EPYC whose second
 * package is a prime-time pool open all week for queue interactive, its first package held).
 * matchFn is not told the job; checkAllocFn and topod are (issue 31: a normal-queue job kept
 * the pool's host, and topod refused it). */
static void scenario_pools(void) {
    fprintf(stderr, "prime-time pools: h1's free package is a pool open now for queue interactive\n");
    struct resreq *r = new_resreq("affinity[core(12)]", NULL, NULL);
    struct reasons rs;
    char got[128];
    int rc = match_sort(r, DEFAULT_ORDER, &rs, got, sizeof got);
    check(rc == 0 && strcmp(got, "h1") == 0, "matchFn (the job's queue not known) keeps h1, where 12 cores fit only in the pool: [%s]", got);
    free(rs.main_text);
    struct job normal = {301, 0, r->key, "normal", NULL}, interactive = {302, 0, r->key, "interactive", NULL};
    struct alloc on_h1 = {"h1", 1};
    memset(&last_limit, 0, sizeof last_limit);
    rc = handler.checkAllocFn(r->data, &normal, &on_h1, (void *)&last_limit);
    check(rc == 0 && last_limit.calls == 1 && last_limit.max_tasks == 0 && strstr(last_limit.detail, "do not admit it: day"),
          "checkAllocFn: a job of queue normal may not have h1 (max %d: %s)", last_limit.max_tasks, last_limit.detail);
    memset(&last_limit, 0, sizeof last_limit);
    rc = handler.checkAllocFn(r->data, &interactive, &on_h1, (void *)&last_limit);
    check(rc == 0 && last_limit.calls == 0, "a job of queue interactive may (no limit: %d)", last_limit.calls);
    /* topod decides the same, both ways. */
    check(topoctl("alloc --socket \"$HARNESS_H1_SOCKET\" --job lsf-301 --queue normal 'affinity[core(12)]' 2>/dev/null") != 0,
          "topod refuses the normal-queue job there");
    rc = handler.notifyAllocFn(r->data, &interactive, &on_h1, NULL, NOTIFY_ALLOC | NOTIFY_IN_SCHED_SESSION);
    check(rc == 0, "notifyAllocFn(job 302 on h1) returns 0");
    check(topoctl("alloc --socket \"$HARNESS_H1_SOCKET\" --job lsf-302 --queue interactive 'affinity[core(12)]'") == 0,
          "and places the interactive one in the pool");
    /* Its tentative reservation was in the pool: 12 of the pool's cores are left, for the
     * interactive queue only. */
    struct job another = {303, 0, r->key, "interactive", NULL};
    memset(&last_limit, 0, sizeof last_limit);
    rc = handler.checkAllocFn(r->data, &another, &on_h1, (void *)&last_limit);
    check(rc == 0 && last_limit.calls == 0, "another interactive job may still have h1 (no limit: %d)", last_limit.calls);
    handler.notifyAllocFn(r->data, &interactive, &on_h1, NULL, NOTIFY_DEALLOC);
    check(topoctl("release --socket \"$HARNESS_H1_SOCKET\" lsf-302") == 0, "and releases it");
    free_resreq(r);
}

/* A job the module keeps on a host is one topod accepts there (issue 31): a long mixed run of
 * jobs of many shapes and two queues over h1-h4 (h4 is hp here: a prime-time pool for queue
 * interactive; h3 moves jobs to make room), each dispatched as LSF would (matchFn, sortFn, then
 * checkAllocFn on the first kept host, the next where it limits the job to 0 tasks), then
 * allocated on that host's topod as the job's pre-exec would, and ended at random. With
 * fail-closed no dispatched job may be refused. */
static unsigned long agree_rng = 0x9e3779b97f4a7c15UL;
static unsigned agree_next(unsigned n) {
    agree_rng ^= agree_rng << 13;
    agree_rng ^= agree_rng >> 7;
    agree_rng ^= agree_rng << 17;
    return (unsigned)(agree_rng % n);
}

static void scenario_agree(void) {
    static const char *shapes[] = {
        "affinity[core(1)]",           "affinity[core(2,same=numa)]",   "affinity[core(4,same=numa)]",
        "affinity[core(6,same=l3)]",   "affinity[core(8,same=socket)]", "affinity[core(12,same=socket)]",
        "affinity[core(3)]",           "affinity[core(16)]",            "affinity[core(24,same=socket)]",
        "affinity[core(2,same=core)]", "affinity[thread(2,same=core)]",
    };
    enum { NSHAPES = sizeof shapes / sizeof shapes[0], STEPS = 400, MAXRUN = 48 };
    const char *sockets[NHOSTS] = {getenv("HARNESS_H1_SOCKET"), getenv("HARNESS_H2_SOCKET"), getenv("HARNESS_H3_SOCKET"),
                                   getenv("HARNESS_H4_SOCKET")};
    struct resreq *req[NSHAPES];
    for (int i = 0; i < NSHAPES; i++)
        req[i] = new_resreq(shapes[i], NULL, NULL);
    struct running {
        int id, host, shape;
    } run[MAXRUN];
    int n_run = 0, dispatched = 0, refused = 0, no_host = 0, limited = 0, next_id = 5001;
    /* HARNESS_AGREE_RESTART: halfway, the scheduler restarts (sched_finalize, sched_init, its
     * requirements made again) and replays its running jobs (NOTIFY_STARTUP), and the run goes
     * on at once, before any host state has come: what fail-open (or fail-closed) does then. */
    int restart = getenv("HARNESS_AGREE_RESTART") != NULL, restarted_at = -1;
    int dispatched_after = 0, refused_after = 0, refused_window = 0;
    const int window = 16; /* steps after the restart with no wait for a refresh */
    int in_window = 0;      /* after the restart, before the first wait for a refresh */
    fprintf(stderr, "a mixed run of %d steps: %d shapes, queues normal and interactive, jobs ending at random%s\n", STEPS,
            NSHAPES, restart ? "; the scheduler restarts halfway" : "");
    for (int step = 0; step < STEPS; step++) {
        if (restart && step == STEPS / 2) {
            for (int i = 0; i < NSHAPES; i++)
                free_resreq(req[i]);
            check(entry_fn[6](NULL) == 0 && entry_fn[1](NULL) == 0, "the scheduler restarts the module");
            for (int i = 0; i < NSHAPES; i++)
                req[i] = new_resreq(shapes[i], NULL, NULL);
            for (int k = 0; k < n_run; k++)
                dispatch(req[run[k].shape], run[k].id, host_names[run[k].host], 1, NOTIFY_STARTUP);
            restarted_at = step;
            in_window = 1;
        }
        if (step % 16 == 15 && (restarted_at < 0 || step >= restarted_at + window)) {
            wait_refresh(); /* topod's view of what ended and started reaches the module */
            in_window = 0;
        }
        if (n_run > 0 && (n_run == MAXRUN || agree_next(5) < 2)) {
            int k = (int)agree_next((unsigned)n_run);
            char cmd[512];
            snprintf(cmd, sizeof cmd, "release --socket \"%s\" lsf-%d", sockets[run[k].host], run[k].id);
            check(topoctl(cmd) == 0, "job %d released on %s", run[k].id, host_names[run[k].host]);
            dispatch(req[run[k].shape], run[k].id, host_names[run[k].host], 1, NOTIFY_DEALLOC);
            run[k] = run[--n_run];
            continue;
        }
        int shape = (int)agree_next(NSHAPES), id = next_id++;
        const char *queue = agree_next(10) < 3 ? "interactive" : "normal";
        struct cand_list l;
        struct reasons rs;
        fill_list(&l, DEFAULT_ORDER, NHOSTS);
        memset(&rs, 0, sizeof rs);
        int rc = handler.matchFn(req[shape]->data, &l, &rs);
        if (rc == 0)
            rc = handler.sortFn(req[shape]->data, &l, &rs);
        current_list = NULL;
        free(rs.main_text);
        check(rc == 0, "matchFn and sortFn for job %d return 0", id);
        struct job j = {id, 0, req[shape]->key, queue, NULL};
        int host = -1;
        for (int i = 0; i < l.group.numOfMembers && host < 0; i++) {
            int h = l.group.candHost[i].hostIdx;
            struct alloc a = {host_names[h], 1};
            memset(&last_limit, 0, sizeof last_limit);
            rc = handler.checkAllocFn(req[shape]->data, &j, &a, (void *)&last_limit);
            if (rc == 0 && last_limit.calls > 0 && last_limit.max_tasks == 0)
                limited++;
            else
                host = h;
        }
        if (host < 0) {
            no_host++;
            continue;
        }
        struct alloc a = {host_names[host], 1};
        rc = handler.notifyAllocFn(req[shape]->data, &j, &a, NULL, NOTIFY_ALLOC | NOTIFY_IN_SCHED_SESSION);
        check(rc == 0, "notifyAllocFn(job %d on %s) returns 0", id, host_names[host]);
        dispatched++;
        dispatched_after += restarted_at >= 0;
        char cmd[512];
        snprintf(cmd, sizeof cmd, "alloc --socket \"%s\" --job lsf-%d --queue %s '%s' 2>&1", sockets[host], id, queue,
                 shapes[shape]);
        if (topoctl(cmd) != 0) {
            refused++;
            refused_after += restarted_at >= 0;
            refused_window += in_window;
            fprintf(stderr, "        job %d (%s, queue %s) kept on %s and refused there by topod\n", id, shapes[shape], queue,
                    host_names[host]);
            dispatch(req[shape], id, host_names[host], 1, NOTIFY_DEALLOC);
            continue;
        }
        run[n_run++] = (struct running){id, host, shape};
    }
    fprintf(stderr, "  figure  %d jobs dispatched, %d refused by topod (%.1f%%); %d found no host, %d checkAllocFn refusals of a kept host\n",
            dispatched, refused, dispatched ? 100.0 * refused / dispatched : 0.0, no_host, limited);
    check(dispatched >= STEPS / 3, "most jobs were dispatched (%d), so the check means something", dispatched);
    if (restart)
        fprintf(stderr, "  figure  after the restart: %d dispatched, %d refused, %d of them before the run's first wait for a refresh after it\n",
                dispatched_after, refused_after, refused_window);
    if (getenv("HARNESS_AGREE_OPEN"))
        check(refused == refused_window,
              "fail-open: a job the module kept was refused only after the restart, before the first wait for a refresh (%d of %d refused outside)",
              refused - refused_window, refused);
    else
        check(refused == 0, "fail-closed: every job the module kept on a host, topod accepted there (%d refused)", refused);
    for (int k = 0; k < n_run; k++) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "release --socket \"%s\" lsf-%d", sockets[run[k].host], run[k].id);
        topoctl(cmd);
        dispatch(req[run[k].shape], run[k].id, host_names[run[k].host], 1, NOTIFY_DEALLOC);
    }
    for (int i = 0; i < NSHAPES; i++)
        free_resreq(req[i]);
    wait_refresh();
}

/* The names a match keeps, as a set: "h3,h1" and "h1,h3" are equal. */
static int same_hosts(const char *got, const char *want) {
    char a[128], b[128];
    snprintf(a, sizeof a, ",%s,", got);
    snprintf(b, sizeof b, ",%s,", want);
    if (strlen(a) != strlen(b))
        return 0;
    for (char *name = strtok(b, ","); name; name = strtok(NULL, ",")) {
        char needle[32];
        snprintf(needle, sizeof needle, ",%s,", name);
        if (!strstr(a, needle))
            return 0;
    }
    return 1;
}

static int same_order(const char *got, const char *want) { return strcmp(got, want) == 0; }

/* Whether a match of r keeps `want` (by `same`), tried for up to ~15 s (the module learns of a
 * topod's restart or a new configuration only at its next fetches: a refresh interval or two
 * after, later on a busy machine). Reports the last result. */
static void kept_soon(struct resreq *r, const char *want, int (*same)(const char *, const char *), const char *what) {
    struct reasons rs;
    char got[128] = "";
    int rc = -1;
    for (int i = 0; i < 50; i++) {
        rc = match_sort(r, DEFAULT_ORDER, &rs, got, sizeof got);
        free(rs.main_text);
        if (rc == 0 && same(got, want))
            break;
        usleep(300 * 1000);
    }
    check(rc == 0 && same(got, want), "%s: kept [%s], expected %s", what, got, want);
}

/* Exactly `want`, in its order. */
static void expect_soon(struct resreq *r, const char *want, const char *what) { kept_soon(r, want, same_order, what); }

/* The hosts of `want`, in any order. */
static void expect_hosts_soon(struct resreq *r, const char *want, const char *what) { kept_soon(r, want, same_hosts, what); }

/* sched_init again without sched_finalize after topo-lsf.toml changed (issue 31: the running
 * module was kept as it was, so a host moved to another topod kept the old one's verdicts and a
 * host given a topod stayed unknown). HARNESS_CONF2: h1 at h3's topod, h3 at h1's, h4 at h2's. */
static void scenario_reconfig(void) {
    fprintf(stderr, "sched_init again without sched_finalize, after topo-lsf.toml changed\n");
    struct resreq *big = new_resreq("affinity[core(24,same=socket)]", NULL, NULL);
    expect(big, "h2,h1", "before: h1 and h2 each have a free package (h3's are 8 cores, h4 has no topod)");
    const char *first = getenv("TOPO_LSF_CONF");
    int registered = handler_registered;
    setenv("TOPO_LSF_CONF", getenv("HARNESS_CONF2"), 1);
    /* Nothing of the new configuration may take hold when the call fails (attack on 1380592:
     * a refused registration had already moved h1 to h3's topod; a missing file read as the
     * defaults turned a fail-closed site fail-open). */
    refuse_registrations = 1;
    int rc = entry_fn[1](NULL);
    check(rc == -1 && handler_registered == registered, "sched_init whose registration the scheduler refuses returns -1 (%d)", rc);
    wait_refresh();
    expect(big, "h2,h1", "and the running module goes on with the configuration before, each host on its own topod");
    setenv("TOPO_LSF_CONF", getenv("HARNESS_CONF_MISSING"), 1);
    rc = entry_fn[1](NULL);
    check(rc == -1 && handler_registered == registered, "sched_init when topo-lsf.toml has gone returns -1 (%d)", rc);
    wait_refresh();
    expect(big, "h2,h1", "and the running module goes on fail-closed (h4, with no topod, is not offered)");
    setenv("TOPO_LSF_CONF", getenv("HARNESS_CONF2"), 1);
    rc = entry_fn[1](NULL);
    check(rc == 0 && handler_registered == registered + 1,
          "sched_init with the new configuration returns 0 (%d) and registers the handler again (%d)", rc,
          handler_registered);
    expect_hosts_soon(big, "h2,h3,h4", "after: h1 is the 8-core Intel now; h3 the EPYC, h4 a second view of h2");
    /* A configuration that no longer reads fails the call, and the running module goes on. */
    setenv("TOPO_LSF_CONF", getenv("HARNESS_CONF_BAD"), 1);
    rc = entry_fn[1](NULL);
    check(rc == -1 && handler_registered == registered + 1,
          "sched_init with a configuration that does not read returns -1 (%d), registering nothing", rc);
    expect_hosts_soon(big, "h2,h3,h4", "the running module goes on with the configuration before");
    setenv("TOPO_LSF_CONF", first, 1);
    rc = entry_fn[1](NULL);
    check(rc == 0, "sched_init with the first configuration again returns 0 (%d)", rc);
    expect_soon(big, "h2,h1", "and each host is judged on its own topod again");
    free_resreq(big);
}

/* h1's topod stops and comes back at the same address on other hardware (issue 31): the
 * module must judge h1 on the new machine, not on the topology it cached first. */
static void scenario_rehardware(void) {
    fprintf(stderr, "h1's topod (a 2 x 24-core EPYC) comes back at the same address on a 2 x 8-core Intel\n");
    struct resreq *ten = new_resreq("affinity[core(10,same=socket)]", NULL, NULL);
    struct resreq *big = new_resreq("affinity[core(24,same=socket)]", NULL, NULL);
    struct resreq *one8 = new_resreq("affinity[core(8,same=socket)]", NULL, NULL);
    struct resreq *eight = new_resreq("affinity[core(8,same=socket)*2]", NULL, NULL);
    expect(ten, "h1", "before: 10 cores in one package fit the EPYC");
    /* Two jobs dispatched there, not started: 952 takes 8 cores of a package, 950 the other. */
    dispatch(one8, 952, "h1", 1, NOTIFY_ALLOC | NOTIFY_IN_SCHED_SESSION);
    dispatch(big, 950, "h1", 1, NOTIFY_ALLOC | NOTIFY_IN_SCHED_SESSION);
    expect(big, "", "jobs 950 and 952 dispatched there leave no free package");
    check(system(getenv("HARNESS_SWAP_H1")) == 0, "h1's topod restarted on the other machine");
    /* With the EPYC's model kept, the Intel's CPUs 0-31 would still be 24 cores of one package;
     * with the EPYC's reservations kept, they would hold every CPU of the Intel until they
     * lapse (attack on 1380592: reservation_ttl_s, 300 s by default); with them dropped, job
     * 952 would lose its CPUs to the next job. Job 952 is placed again on one of the Intel's
     * packages; job 950 fits it no more, and holds nothing (its topod will refuse it). */
    expect_soon(ten, "", "after: 10 cores in one package do not fit the Intel's 8 (they fit the EPYC's free 16)");
    expect(one8, "h1", "a whole 8-core package of the Intel is free for another job");
    expect(eight, "", "but only one: job 952 holds the other");
    dispatch(big, 950, "h1", 1, NOTIFY_DEALLOC);
    dispatch(one8, 952, "h1", 1, NOTIFY_DEALLOC);
    expect(eight, "h1", "jobs 950 and 952 deallocated: two tasks of a whole package each fit");
    free_resreq(ten);
    free_resreq(big);
    free_resreq(one8);
    free_resreq(eight);
}

static void scenario_reinit(const char *path) {
    fprintf(stderr, "the scheduler finalizes the module, closes it, opens it and initializes it again\n");
    struct resreq *big = new_resreq("affinity[core(24,same=socket)]", NULL, NULL);
    expect(big, "h2,h1", "before: h1 and h2 each have a free package");
    free_resreq(big);
    check(entry_fn[6](NULL) == 0, "sched_finalize returns 0");
    int registered = handler_registered;
    dlclose(module_so);
    if (load_module(path) != 0)
        return;
    int rc = entry_fn[1](NULL);
    check(rc == 0 && handler_registered == registered + 1,
          "sched_init again returns 0 (%d) and registers the handler again (%d registrations, %d before)", rc,
          handler_registered, registered);
    /* The restarted scheduler replays its running jobs at once, before any host state. */
    big = new_resreq("affinity[core(24,same=socket)]", NULL, NULL);
    dispatch(big, 106, "h2", 1, NOTIFY_STARTUP);
    expect_soon(big, "h1", "a STARTUP replay that came before the host states holds h2's free package once they arrive");
    dispatch(big, 106, "h2", 1, NOTIFY_DEALLOC);
    expect(big, "h2,h1", "job 106 deallocated");
    /* The refresher runs again: a change made after the restart is seen. */
    check(topoctl("alloc --socket \"$HARNESS_H1_SOCKET\" --job reinit-1 'affinity[core(24,same=socket)]'") == 0,
          "topoctl holds a package of h1");
    /* And the other, unless the session scenario's job 101 holds it (run alone, it is free). */
    int second = topoctl("alloc --socket \"$HARNESS_H1_SOCKET\" --job reinit-2 'affinity[core(24,same=socket)]' 2>/dev/null") == 0;
    expect_soon(big, "h2", "the restarted module's refresher sees it");
    check(topoctl("release --socket \"$HARNESS_H1_SOCKET\" reinit-1") == 0, "and releases it");
    if (second)
        topoctl("release --socket \"$HARNESS_H1_SOCKET\" reinit-2");
    wait_refresh();
    free_resreq(big);
}

/* h3's topod (2 packages of 8 cores, PUs 0-7,16-23 and 8-15,24-31; topod.toml defrag = true)
 * gets a topology reservation and then fragmented: what the module does with blocks and with a
 * host that moves running jobs. It leaves h3 as it found it. */
static void expect_h3_kept(struct resreq *r, const char *what) {
    struct reasons rs;
    char got[128];
    int rc = match_sort(r, DEFAULT_ORDER, &rs, got, sizeof got);
    check(rc == 0 && strstr(got, "h3") != NULL, "%s: [%s]", what, got);
    free(rs.main_text);
}

static void scenario_blocks(void) {
    char got[128];
    struct reasons rs;
    fprintf(stderr, "a topology reservation on h3 for job 201 (affinity[core(6)])\n");
    struct resreq *six = new_resreq("affinity[core(6)]", NULL, NULL);
    struct resreq *twelve = new_resreq("affinity[core(12)]", NULL, NULL);
    struct resreq *ten = new_resreq("affinity[core(10)]", NULL, NULL);
    expect_h3_kept(twelve, "before: 12 cores fit h3's 16");
    int rc = match_sort(six, DEFAULT_ORDER, &rs, got, sizeof got);
    free(rs.main_text);
    check(rc == 0 && strncmp(got, "h3", 2) != 0, "before: h3 does not rank first for 6 cores (it breaks an L3 there): [%s]", got);
    check(topoctl("reserve --socket \"$HARNESS_H3_SOCKET\" --job lsf-201 --for 1h 'affinity[core(6)]'") == 0,
          "topoctl reserve sets 6 cores of h3 aside for lsf-201");
    wait_refresh();
    rc = match_sort(twelve, DEFAULT_ORDER, &rs, got, sizeof got);
    check(rc == 0 && strcmp(got, "h2,h1") == 0 && rs.id[2] == reason_base + 1,
          "12 cores for any other job: h3 has 10 outside the block and is removed with 'does not fit' (kept [%s], reason %d)", got,
          rs.id[2]);
    free(rs.main_text);
    /* LSF matches peer jobs without naming them: the block is one peer's at most. They fit
     * beside it, so h3 ranks as any host where they fit (not first for all of them). */
    expect_h3_kept(six, "6 cores, the block's own request, 10 free beside the block");

    /* checkAllocFn knows the job: only the job the block is for may use it. */
    struct job j202 = {202, 0, six->key, NULL, NULL}, j201 = {201, 0, six->key, NULL, NULL};
    struct alloc two_on_h3 = {"h3", 2};
    memset(&last_limit, 0, sizeof last_limit);
    rc = handler.checkAllocFn(six->data, &j202, &two_on_h3, (void *)&last_limit);
    check(rc == 0 && last_limit.calls == 1 && strcmp(last_limit.host, "h3") == 0 && last_limit.max_tasks == 1,
          "job 202, a peer, gets at most 1 task of 6 cores on h3, outside lsf-201's block (calls %d, host %s, max %d)",
          last_limit.calls, last_limit.host, last_limit.max_tasks);
    memset(&last_limit, 0, sizeof last_limit);
    rc = handler.checkAllocFn(six->data, &j201, &two_on_h3, (void *)&last_limit);
    check(rc == 0 && last_limit.calls == 0, "job 201 may have 2 tasks there: its block and 6 cores beside it");
    /* Issue 31: where the peers fit only in the block, h3 ranked first for all of them, and
     * checkAllocFn then closed it to every one but job 201. It is now after every host where
     * any of them fits, and still a candidate (for job 201). */
    check(topoctl("alloc --socket \"$HARNESS_H3_SOCKET\" --job beside 'affinity[core(5)]'") == 0,
          "a job takes 5 of the 10 cores beside the block");
    wait_refresh();
    rc = match_sort(six, DEFAULT_ORDER, &rs, got, sizeof got);
    size_t len = strlen(got);
    check(rc == 0 && len > 3 && strcmp(got + len - 3, ",h3") == 0 && strstr(got, "h1") && strstr(got, "h2"),
          "6 cores now fit h3 only in the block: h3 kept last, after h1 and h2: [%s]", got);
    free(rs.main_text);
    struct alloc one_on_h3 = {"h3", 1};
    memset(&last_limit, 0, sizeof last_limit);
    rc = handler.checkAllocFn(six->data, &j202, &one_on_h3, (void *)&last_limit);
    check(rc == 0 && last_limit.calls == 1 && last_limit.max_tasks == 0,
          "job 202 gets no task on h3 (calls %d, max %d)", last_limit.calls, last_limit.max_tasks);
    memset(&last_limit, 0, sizeof last_limit);
    rc = handler.checkAllocFn(six->data, &j201, &one_on_h3, (void *)&last_limit);
    check(rc == 0 && last_limit.calls == 0, "job 201 gets its block (no limit: %d)", last_limit.calls);
    check(topoctl("release --socket \"$HARNESS_H3_SOCKET\" beside") == 0, "and the job beside it is released");
    wait_refresh();
    /* Its tentative reservation goes inside its block, as topod will place it: 10 cores are
     * still free outside the block for the next job. */
    dispatch(six, 201, "h3", 1, NOTIFY_ALLOC | NOTIFY_IN_SCHED_SESSION);
    expect_h3_kept(ten, "after job 201's dispatch to h3 (reserved inside its block), another job's 10 cores still fit beside the block");
    dispatch(six, 201, "h3", 1, NOTIFY_DEALLOC);
    check(topoctl("unreserve --socket \"$HARNESS_H3_SOCKET\" lsf-201") == 0, "topoctl unreserve drops the block");
    wait_refresh();
    expect_h3_kept(twelve, "without the block, 12 cores fit h3 again");

    fprintf(stderr, "h3 defragments (topod.toml defrag = true, migrate_min_run_s = 0)\n");
    check(topoctl("alloc --socket \"$HARNESS_H3_SOCKET\" --job frag-1 'CPUSET[CPU_LIST=0-3,16-19] affinity[core(4)]'") == 0 &&
              topoctl("alloc --socket \"$HARNESS_H3_SOCKET\" --job frag-2 'CPUSET[CPU_LIST=8-11,24-27] affinity[core(4)]'") == 0,
          "two jobs pinned by their CPU_LIST hold half of each package of h3");
    wait_refresh();
    struct resreq *pkg = new_resreq("affinity[core(8,same=socket)]", NULL, NULL);
    rc = match_sort(pkg, DEFAULT_ORDER, &rs, got, sizeof got);
    /* Issue 31: kept before, though topod moves no pinned job; dispatched there, it was refused. */
    check(rc == 0 && !strstr(got, "h3") && rs.id[2] == reason_base + 1,
          "8 cores in one package: h3 has 8 free, none in one package, and topod would move neither pinned job: removed "
          "([%s], reason %d)",
          got, rs.id[2]);
    free(rs.main_text);
    check(topoctl("release --socket \"$HARNESS_H3_SOCKET\" frag-1") == 0 && topoctl("release --socket \"$HARNESS_H3_SOCKET\" frag-2") == 0,
          "and releases them");
    /* The same halves held by jobs topod placed itself (f1 on 0-3,16-19 and f3 on 8-11,24-27). */
    check(topoctl("alloc --socket \"$HARNESS_H3_SOCKET\" --job f1 'affinity[core(4)]'") == 0 &&
              topoctl("alloc --socket \"$HARNESS_H3_SOCKET\" --job f2 'affinity[core(4)]'") == 0 &&
              topoctl("alloc --socket \"$HARNESS_H3_SOCKET\" --job f3 'affinity[core(4)]'") == 0 &&
              topoctl("alloc --socket \"$HARNESS_H3_SOCKET\" --job f4 'affinity[core(4)]'") == 0 &&
              topoctl("release --socket \"$HARNESS_H3_SOCKET\" f2") == 0 && topoctl("release --socket \"$HARNESS_H3_SOCKET\" f4") == 0,
          "two movable jobs hold half of each package of h3");
    wait_refresh();
    rc = match_sort(pkg, DEFAULT_ORDER, &rs, got, sizeof got);
    len = strlen(got);
    check(rc == 0 && len > 3 && strcmp(got + len - 3, ",h3") == 0 && strstr(got, "h1") && strstr(got, "h2"),
          "8 cores in one package, the jobs movable: h3 kept, after h1 and h2 where it fits as they are, though offered first: [%s]",
          got);
    free(rs.main_text);
    struct job j203 = {203, 0, pkg->key, NULL, NULL};
    memset(&last_limit, 0, sizeof last_limit);
    rc = handler.checkAllocFn(pkg->data, &j203, &one_on_h3, (void *)&last_limit);
    check(rc == 0 && last_limit.calls == 0, "an allocation there is left to topod, which moves the jobs (no limit: %d)", last_limit.calls);
    /* What the module kept, topod accepts: the job starts there, after a move. */
    check(topoctl("alloc --socket \"$HARNESS_H3_SOCKET\" --job lsf-203 'affinity[core(8,same=socket)]'") == 0,
          "dispatched to h3, topod places the job (moving one of the two)");
    struct resreq *nine = new_resreq("affinity[core(9)]", NULL, NULL);
    rc = match_sort(nine, DEFAULT_ORDER, &rs, got, sizeof got);
    check(rc == 0 && !strstr(got, "h3") && rs.id[2] == reason_base + 1,
          "9 cores, more than h3 has free: removed as before, moves make no CPUs ([%s], reason %d)", got, rs.id[2]);
    free(rs.main_text);
    check(topoctl("release --socket \"$HARNESS_H3_SOCKET\" f1") == 0 && topoctl("release --socket \"$HARNESS_H3_SOCKET\" f3") == 0 &&
              topoctl("release --socket \"$HARNESS_H3_SOCKET\" lsf-203") == 0,
          "and releases them");
    wait_refresh();
    free_resreq(six);
    free_resreq(twelve);
    free_resreq(ten);
    free_resreq(pkg);
    free_resreq(nine);
}

#include "scale.h"

static void scenario_panic(void) {
    fprintf(stderr, "a panic inside a callback (test build, TOPO_LSF_PANIC_IN=%s)\n", getenv("TOPO_LSF_PANIC_IN"));
    struct resreq *big = new_resreq("affinity[core(24,same=socket)]", NULL, NULL);
    static struct reasons rs;
    char got[128];
    static struct cand_list l;
    fill_list(&l, DEFAULT_ORDER, NHOSTS);
    memset(&rs, 0, sizeof rs);
    int rc = handler.matchFn(big->data, &l, &rs);
    check(rc == -1, "matchFn returns -1 instead of unwinding into the scheduler (got %d)", rc);
    check(l.group.numOfMembers == NHOSTS, "and removed nothing");
    current_list = NULL;
    unsetenv("TOPO_LSF_PANIC_IN");
    rc = match_sort(big, DEFAULT_ORDER, &rs, got, sizeof got);
    check(rc == 0 && strstr(got, "h1") && !strstr(got, "h3"), "the next call works: [%s]", got);
    free(rs.main_text);
    free_resreq(big);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODULE.so session|restart|reinit|reconfig|agree|rehardware|open|pools|refuse|panic|blocks|scale\n", argv[0]);
        return 2;
    }
    int scale = strcmp(argv[2], "scale") == 0;
    if (scale && scale_setup() != 0)
        return 2;
    for (int i = 0; i < n_hosts; i++) {
        slots[i].name = (char *)host_names[i];
        slots[i].nslotAvail = 8;
        slots[i].ncpus = 8;
    }
    const char *rb = getenv("HARNESS_REASON_BASE");
    if (rb)
        reason_base = atoi(rb);
    if (load_module(argv[1]) != 0)
        return 1;
    long rss_before = rss_kib(); /* the module's growth is measured from here (scale) */
    mark_rss_parts();
    size_t heap_before = live_heap();
    int (**fn)(void *) = entry_fn;
    const char **entry = entry_names;
    check(fn[0](NULL) == 0, "sched_version returns 0");
    if (strcmp(argv[2], "refuse") == 0) {
        /* A scheduler that refuses the handler: sched_init fails and leaves nothing running, so
         * that the next sched_init starts again and registers it. */
        fprintf(stderr, "the scheduler refuses the first registration\n");
        refuse_registrations = 1;
        check(fn[1](NULL) == -1 && handler_registered == 0, "sched_init returns -1 when the handler is refused");
    }
    int rc = fn[1](NULL);
    check(rc == 0 && handler_registered == 1, "sched_init returns 0 (%d) and registers one handler (%d)", rc, handler_registered);
    if (rc != 0 || !handler_registered)
        return 1;
    check(handler_id >= 100 && handler_id <= 199, "handler id %d is within 100-199", handler_id);
    check(handler.newFn && handler.freeFn && handler.matchFn && handler.sortFn && handler.notifyAllocFn && handler.checkAllocFn,
          "all six handler callbacks are set");
    for (int i = 2; i < 6; i++)
        check(fn[i](NULL) == 0, "%s returns 0", entry[i]);
    if (!scale) {
        /* sched_init again without sched_finalize (issue 31): the running module is kept, and
         * the handler registered again, so that the scheduler has it whatever it did between. */
        rc = fn[1](NULL);
        check(rc == 0 && handler_registered == 2,
              "sched_init again without sched_finalize returns 0 (%d) and registers the handler again (%d)", rc,
              handler_registered);
        wait_refresh(); /* the module fetches host states in the background */
    }

    if (strcmp(argv[2], "session") == 0)
        scenario_session();
    else if (strcmp(argv[2], "restart") == 0)
        scenario_restart();
    else if (strcmp(argv[2], "panic") == 0)
        scenario_panic();
    else if (strcmp(argv[2], "reinit") == 0)
        scenario_reinit(argv[1]);
    else if (strcmp(argv[2], "agree") == 0)
        scenario_agree();
    else if (strcmp(argv[2], "reconfig") == 0)
        scenario_reconfig();
    else if (strcmp(argv[2], "rehardware") == 0)
        scenario_rehardware();
    else if (strcmp(argv[2], "open") == 0)
        scenario_open(argv[1]);
    else if (strcmp(argv[2], "pools") == 0)
        scenario_pools();
    else if (strcmp(argv[2], "blocks") == 0)
        scenario_blocks();
    else if (strcmp(argv[2], "longkey-save") == 0)
        scenario_longkey("save");
    else if (strcmp(argv[2], "longkey-replay") == 0)
        scenario_longkey("replay");
    else if (strcmp(argv[2], "refuse") == 0) {
        struct resreq *big = new_resreq("affinity[core(24,same=socket)]", NULL, NULL);
        check(big->set, "and the next sched_init works: newFn attaches data");
        free_resreq(big);
    }
    else if (scale)
        scenario_scale(argv[1], rss_before, heap_before);
    else {
        fprintf(stderr, "unknown scenario %s\n", argv[2]);
        return 2;
    }
    check(fn[6](NULL) == 0, "sched_finalize returns 0");
    fprintf(stderr, "%s: %s\n", argv[2], failures ? "FAILED" : "passed");
    return failures ? 1 : 0;
}
