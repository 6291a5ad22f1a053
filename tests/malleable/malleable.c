/*
 * malleable -- a real malleable job for topo's resize tests and benchmarks (issue 18).
 *
 * Usage: malleable [--signal N] [--notify FILE] LOG [THREADS]
 *
 * CPU-bound worker threads spin; a control thread blocks in topo_resize_wait (libtopo) on the
 * job's notify file (--notify FILE, else $TOPO_NOTIFY_FILE) and, at each new generation, acts on
 * it and appends one line to LOG (flushed at once):
 *
 *     generation=G cpus=LIST threads=N [signals=K] affinity=LIST [on_new_cpus=yes|no]
 *
 *   - Without THREADS (malleable): one worker per CPU of its affinity at start; at each change
 *     the worker count becomes the new list's CPU count (workers stopped and joined, or started)
 *     before the line is written.
 *   - With THREADS (a fixed count, e.g. 64 for a benchmark): that many workers whatever the
 *     CPUs; at each change it waits (up to 1 s) until every one of its threads runs on exactly
 *     the new CPUs and says whether they do: on_new_cpus=yes or no.
 *
 * threads= is the number of workers; the process has two threads more (main, control), which is
 * what /proc/PID/task counts. affinity= is the union of all its threads' affinities when the
 * line is written. The first line, written before the control thread starts, is the state at
 * start (the file's generation and list, the workers started from the affinity); a test waits
 * for it before changing the file.
 *
 * With --signal N the program installs a handler for signal N that only sets a flag and counts;
 * its lines carry signals=K, the count so far. topod sends the signal after rewriting the file,
 * so after a change the control thread waits up to 1 s for a signal it has not yet seen before
 * writing the line (a missing signal shows as an unchanged count, one second late).
 *
 * SIGTERM or SIGINT: the workers are stopped and joined, exit status 0. An error of libtopo
 * (the file gone, malformed) is written to stderr and LOG as error=..., and the program ends
 * the same way with status 1.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../../ffi/include/topo.h"

#define MAX_WORKERS 4096
#define MAX_CPUS 8192           /* the size of every CPU set here; Linux's NR_CPUS maximum */
#define LIST_LEN 65536          /* a CPU list of MAX_CPUS with every other CPU fits */
#define WAIT_SLICE_MS 200       /* how long the control thread waits before looking at `stopping` */
#define SETTLE_NS 1000000000L   /* how long to wait for a signal or the new affinity after a change */

struct worker {
    pthread_t thread;
    atomic_bool stop;
};

static struct worker workers[MAX_WORKERS];
static int nworkers;            /* only the main thread (at start, at end) and the control thread */
static int fixed_threads;       /* 0: one worker per CPU */
static int resize_signal;       /* 0: none */
static const char *notify_file; /* NULL: $TOPO_NOTIFY_FILE */
static FILE *logf;
static atomic_bool stopping;
static atomic_bool failed;
static atomic_bool signal_flag;       /* set by the handler, cleared by the control thread */
static atomic_uint signal_count;      /* lock-free atomics are async-signal-safe */
static unsigned long long start_generation;
static char list_buf[LIST_LEN];

static void on_resize_signal(int sig) {
    (void)sig;
    atomic_fetch_add(&signal_count, 1);
    atomic_store(&signal_flag, true);
}

static void *spin(void *arg) {
    struct worker *w = arg;
    volatile unsigned long long work = 0;
    while (!atomic_load_explicit(&w->stop, memory_order_relaxed))
        work++;
    return NULL;
}

/* Starts or stops workers until there are `n`; false if a thread could not be started. */
static bool set_workers(int n) {
    if (n > MAX_WORKERS)
        n = MAX_WORKERS;
    for (int i = n; i < nworkers; i++)
        atomic_store(&workers[i].stop, true);
    for (int i = n; i < nworkers; i++)
        pthread_join(workers[i].thread, NULL);
    for (int i = nworkers; i < n; i++) {
        atomic_store(&workers[i].stop, false);
        int rc = pthread_create(&workers[i].thread, NULL, spin, &workers[i]);
        if (rc != 0) {
            fprintf(stderr, "malleable: cannot start worker %d: %s\n", i, strerror(rc));
            nworkers = i;
            return false;
        }
    }
    nworkers = n;
    return true;
}

/* Reads a CPU list ("0-3,8-11") into `set`; false if it is not one. */
static bool parse_list(const char *text, cpu_set_t *set, size_t size) {
    CPU_ZERO_S(size, set);
    const char *p = text;
    while (*p) {
        char *end;
        long lo = strtol(p, &end, 10), hi = lo;
        if (end == p)
            return false;
        p = end;
        if (*p == '-') {
            hi = strtol(p + 1, &end, 10);
            if (end == p + 1)
                return false;
            p = end;
        }
        if (lo < 0 || hi < lo || hi >= MAX_CPUS)
            return false;
        for (long c = lo; c <= hi; c++)
            CPU_SET_S((size_t)c, size, set);
        if (*p == ',')
            p++;
        else if (*p)
            return false;
    }
    return true;
}

/* Writes `set` as a CPU list into `out`. */
static void format_list(const cpu_set_t *set, size_t size, char *out, size_t out_len) {
    size_t used = 0;
    out[0] = 0;
    for (int c = 0; c < MAX_CPUS; c++) {
        if (!CPU_ISSET_S((size_t)c, size, set))
            continue;
        int last = c;
        while (last + 1 < MAX_CPUS && CPU_ISSET_S((size_t)last + 1, size, set))
            last++;
        int n = last == c ? snprintf(out + used, out_len - used, "%s%d", used ? "," : "", c)
                          : snprintf(out + used, out_len - used, "%s%d-%d", used ? "," : "", c, last);
        if (n < 0 || (size_t)n >= out_len - used)
            return;
        used += (size_t)n;
        c = last;
    }
}

/*
 * The union of the affinities of all the process's threads into `all`; returns whether every
 * thread's affinity equals `want` (when `want` is not NULL).
 */
static bool affinity_of_threads(cpu_set_t *all, const cpu_set_t *want, size_t size) {
    cpu_set_t *one = CPU_ALLOC(MAX_CPUS);
    bool every_equal = true;
    CPU_ZERO_S(size, all);
    DIR *dir = opendir("/proc/self/task");
    struct dirent *e;
    while (one && dir && (e = readdir(dir)) != NULL) {
        pid_t tid = (pid_t)atoi(e->d_name);
        if (tid <= 0 || sched_getaffinity(tid, size, one) != 0)
            continue; /* "." and "..", or a thread that just ended */
        CPU_OR_S(size, all, all, one);
        if (want && !CPU_EQUAL_S(size, one, want))
            every_equal = false;
    }
    if (dir)
        closedir(dir);
    CPU_FREE(one);
    return every_equal;
}

static void sleep_ns(long ns) {
    struct timespec t = {ns / 1000000000L, ns % 1000000000L};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {
    }
}

/* Writes one state line: generation, list, workers, signals, affinity (and whether it matches). */
static void log_line(unsigned long long generation, const char *cpus) {
    size_t size = CPU_ALLOC_SIZE(MAX_CPUS);
    cpu_set_t *want = CPU_ALLOC(MAX_CPUS), *all = CPU_ALLOC(MAX_CPUS);
    bool on_new = false;
    if (!want || !all) {
        fprintf(stderr, "malleable: out of memory\n");
        exit(1);
    }
    if (fixed_threads) {
        if (!parse_list(cpus, want, size)) {
            fprintf(stderr, "malleable: libtopo gave a CPU list it cannot read: %s\n", cpus);
            exit(1);
        }
        /* topod changes the cpuset before the file, so this normally holds at the first look. */
        for (long waited = 0; !(on_new = affinity_of_threads(all, want, size)) && waited < SETTLE_NS;
             waited += 10000000L)
            sleep_ns(10000000L);
    } else {
        affinity_of_threads(all, NULL, size);
    }
    format_list(all, size, list_buf, sizeof list_buf);
    fprintf(logf, "generation=%llu cpus=%s threads=%d", generation, cpus, nworkers);
    if (resize_signal)
        fprintf(logf, " signals=%u", atomic_load(&signal_count));
    fprintf(logf, " affinity=%s", list_buf);
    if (fixed_threads)
        fprintf(logf, " on_new_cpus=%s", on_new ? "yes" : "no");
    fprintf(logf, "\n");
    fflush(logf);
    CPU_FREE(want);
    CPU_FREE(all);
}

static void fail(const char *what) {
    fprintf(stderr, "malleable: %s\n", what);
    fprintf(logf, "error=%s\n", what);
    fflush(logf);
    atomic_store(&failed, true);
    kill(getpid(), SIGTERM); /* main's sigwait takes it and ends the program */
}

static void *control(void *arg) {
    (void)arg;
    static char cpus[LIST_LEN];
    char err[512];
    unsigned long long last = start_generation;
    while (!atomic_load(&stopping)) {
        unsigned long long generation = 0;
        int n = topo_resize_wait(notify_file, last, WAIT_SLICE_MS, &generation, cpus, sizeof cpus, err, sizeof err);
        if (n == 0)
            continue;
        if (n < 0) {
            fail(err);
            return NULL;
        }
        last = generation;
        if (!fixed_threads && !set_workers(n)) {
            fail("cannot start a worker thread");
            return NULL;
        }
        if (resize_signal) {
            for (long waited = 0; !atomic_load(&signal_flag) && waited < SETTLE_NS; waited += 10000000L)
                sleep_ns(10000000L);
            atomic_store(&signal_flag, false);
        }
        log_line(generation, cpus);
    }
    return NULL;
}

static void usage(void) {
    fprintf(stderr, "usage: malleable [--signal N] [--notify FILE] LOG [THREADS]\n");
    exit(2);
}

int main(int argc, char **argv) {
    int i = 1;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i += 2) {
        if (i + 1 >= argc)
            usage();
        if (strcmp(argv[i], "--signal") == 0) {
            resize_signal = atoi(argv[i + 1]);
            if (resize_signal < 1 || resize_signal > SIGRTMAX || resize_signal == SIGTERM || resize_signal == SIGINT ||
                resize_signal == SIGKILL || resize_signal == SIGSTOP) {
                fprintf(stderr, "malleable: --signal %s: not a signal it can catch for resizes\n", argv[i + 1]);
                return 2;
            }
        } else if (strcmp(argv[i], "--notify") == 0) {
            notify_file = argv[i + 1];
        } else {
            usage();
        }
    }
    if (argc - i < 1 || argc - i > 2)
        usage();
    if (argc - i == 2) {
        fixed_threads = atoi(argv[i + 1]);
        if (fixed_threads < 1 || fixed_threads > MAX_WORKERS) {
            fprintf(stderr, "malleable: THREADS must be 1 to %d\n", MAX_WORKERS);
            return 2;
        }
    }
    logf = fopen(argv[i], "a");
    if (!logf) {
        fprintf(stderr, "malleable: cannot open %s: %s\n", argv[i], strerror(errno));
        return 1;
    }

    /* Every thread inherits this mask: SIGTERM and SIGINT only reach main's sigwait. */
    sigset_t ending;
    sigemptyset(&ending);
    sigaddset(&ending, SIGTERM);
    sigaddset(&ending, SIGINT);
    pthread_sigmask(SIG_BLOCK, &ending, NULL);
    if (resize_signal) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_resize_signal;
        sa.sa_flags = SA_RESTART;
        sigemptyset(&sa.sa_mask);
        sigaction(resize_signal, &sa, NULL);
    }

    static char cpus[LIST_LEN];
    char err[512];
    if (topo_notify_read(notify_file, &start_generation, cpus, sizeof cpus, err, sizeof err) < 0) {
        fprintf(stderr, "malleable: %s\n", err);
        return 1;
    }
    int start_workers = fixed_threads;
    if (!start_workers) {
        cpu_set_t *mine = CPU_ALLOC(MAX_CPUS);
        if (!mine || sched_getaffinity(0, CPU_ALLOC_SIZE(MAX_CPUS), mine) != 0) {
            fprintf(stderr, "malleable: sched_getaffinity: %s\n", strerror(errno));
            return 1;
        }
        start_workers = CPU_COUNT_S(CPU_ALLOC_SIZE(MAX_CPUS), mine);
        CPU_FREE(mine);
    }
    if (!set_workers(start_workers))
        return 1;
    log_line(start_generation, cpus);

    pthread_t control_thread;
    int rc = pthread_create(&control_thread, NULL, control, NULL);
    if (rc != 0) {
        fprintf(stderr, "malleable: cannot start the control thread: %s\n", strerror(rc));
        return 1;
    }
    int sig;
    sigwait(&ending, &sig);
    atomic_store(&stopping, true);
    pthread_join(control_thread, NULL);
    set_workers(0);
    fclose(logf);
    return atomic_load(&failed) ? 1 : 0;
}
