/*
 * lssched.h -- topo's own declaration of the LSF external scheduler module interface.
 *
 * Written for topo from the documented facts in shared/reference/lsf-plugin-api.md (LSF 6.x
 * lsb_* names and their LSF 9/10 extsched_* equivalents; struct field order is ABI). It is not
 * IBM's file. To build against a site's real SDK header instead, set LSF_INCLUDE_DIR to the
 * directory holding its lssched.h (e.g. $LSF_TOP/10.1/include/lsf); the build says which one
 * it used.
 *
 * Differences between LSF versions that matter to the ABI:
 *   - struct jobInfo: LSF 9/10 inserts indexRangeCnt/indexRangeStart/End/Step after jobIndex.
 *     This header declares the 9/10 layout; define TOPO_LSF6_JOBINFO for the 6.x one.
 *   - LSF 6.x has only the lsb_* functions; 9/10 has extsched_* and keeps lsb_* as deprecated
 *     aliases with the same arguments.
 */
#ifndef TOPO_LSSCHED_H
#define TOPO_LSSCHED_H

#ifdef __cplusplus
extern "C" {
#endif

/* Opaque scheduler objects (typedef void in the 9/10 SDK). */
typedef void INT_RsrcReq;
typedef void INT_CandGroupList;
typedef void INT_Reason;
typedef void INT_Job;
typedef void INT_JobBlock;
typedef void INT_Alloc;
typedef void INT_AllocLimitList;
typedef void INT_Host;
typedef void INT_ChunkRef;

/* Module entry points (all exported by the module, all int f(void *)). */
int sched_version(void *);
int sched_init(void *);
int sched_pre_proc(void *);
int sched_match_limit(void *);
int sched_order_alloc(void *);
int sched_post_proc(void *);
int sched_finalize(void *);

/* Candidate hosts. */
struct candHost {
    int hostIdx;
    INT_Host *hostPtr;
};

struct hostSlot {
    struct candHost *candHost;
    char *name;
    int nslotAvail;
    int nslotAlloc;
    int ncpus;
};

struct candHostGroup {
    struct candHostGroup *forw;
    struct candHostGroup *back;
    int maxOfMembers;
    int numOfMembers;
    struct candHost *candHost; /* array of numOfMembers */
};

struct resources {
    char *resName;
    int resType;
    int cType;
    union {
        char *sval;
        int bval;
        float fval;
    } val;
};

struct hostResources {
    char *hostName;
    char *cluster;
    int nres;
    struct resources *res;
};

enum restype { NONE, STATIC_RESOURCE, DYNAMIC_RESOURCE, SHARED_RESOURCE };
enum ctype { BOOL_VAL, FLOAT_VAL, STRING_VAL };
enum phase { PHASE_ALLOC, PHASE_NOTIFY };

struct jobInfo {
    int jobId;
    int jobIndex;
#ifndef TOPO_LSF6_JOBINFO
    int indexRangeCnt;
    int *indexRangeStart;
    int *indexRangeEnd;
    int *indexRangeStep;
#endif
    char *cluster;
    char *user;
    char *queue;
    char *resKey;
    int status;
    int pendReason;
    int submitTime;
    char *jobGroup;
    char *serviceClass;
    char *project;
    char *enforcedGroup;
    char *schedHostType;
    char *schedHostModel;
    int userPriority;
    int incPriority;
    int cpuLimit;
    int runLimit;
};

/* Resource-requirement handler: FIELD ORDER IS ABI. */
typedef int (*RsrcReqHandler_NewFn)(void *resreq);
typedef void (*RsrcReqHandler_FreeFn)(void *handlerData);
typedef int (*RsrcReqHandler_MatchFn)(void *handlerData, void *candGroupList, void *reasonPtr);
typedef int (*RsrcReqHandler_SortFn)(void *handlerData, void *candGroupList, void *reasonPtr);
typedef int (*RsrcReqHandler_CheckAllocFn)(void *info, void *job, void *alloc, void *allocLimitList);
typedef int (*RsrcReqHandler_NotifyAllocFn)(void *info, void *job, void *alloc, void *allocLimitList, int flag);

typedef struct _RsrcReqHandlerType {
    RsrcReqHandler_NewFn newFn;
    RsrcReqHandler_FreeFn freeFn;
    RsrcReqHandler_MatchFn matchFn;
    RsrcReqHandler_SortFn sortFn;
    RsrcReqHandler_NotifyAllocFn notifyAllocFn;
    RsrcReqHandler_CheckAllocFn checkAllocFn;
} RsrcReqHandlerType;

/* notifyAllocFn flag bits. */
#define NOTIFY_IN_SCHED_SESSION 0x001
#define NOTIFY_OUT_SCHED_SESSION 0x002
#define NOTIFY_ALLOC 0x004
#define NOTIFY_DEALLOC 0x008
#define NOTIFY_STARTUP 0x010

/* extsched_determineEvent results (9/10). */
#define SCH_FM_EVE_ALLOCATE 0x001
#define SCH_FM_EVE_DEALLOCATE 0x002
#define SCH_FM_EVE_RESERVE 0x004
#define SCH_FM_EVE_CANCEL 0x008
#define SCH_FM_EVE_SUSPEND 0x010
#define SCH_FM_EVE_RESUME 0x020
#define SCH_FM_EVE_REPLAY 0x040
#define SCH_FM_EVE_ALLOCATE_BRUN 0x080
#define SCH_FM_EVE_ADDALLOC 0x100
#define SCH_FM_EVE_RMALLOC 0x200

/* Allocator decisions. */
#define SCH_MOD_DECISION_NONE 0
#define SCH_MOD_DECISION_DISPATCH 1
#define SCH_MOD_DECISION_RESERVE 2
#define SCH_MOD_DECISION_PENDPEERJOBS 3
#define SCH_MOD_DECISION_PENDJOB 4

/* Custom pending reasons must lie in this range (LSF reserves 1-20000). */
#define PEND_CUSTOM_REASON_MIN 20001
#define PEND_CUSTOM_REASON_MAX 25000

typedef struct {
    char *host;
    char *rsrc;
    float amount;
} extsched_AllocInst;

typedef enum {
    ALLOC_TYPE_UNKNOWN,
    ALLOC_TYPE_ALLOC,
    ALLOC_TYPE_RESERVE,
    ALLOC_TYPE_FORCERUN,
    ALLOC_TYPE_ADDALLOC
} extsched_AllocType;

typedef struct {
    extsched_AllocType type;
    int nInst;
    extsched_AllocInst **inst;
} extsched_Alloc;

typedef enum {
    SCHED_CONTEXT_UNKNOWN,
    SCHED_CONTEXT_ALLOC,
    SCHED_CONTEXT_RESERVE,
    SCHED_CONTEXT_BACKFILL,
    SCHED_CONTEXT_PREEMPT1,
    SCHED_CONTEXT_PREEMPT2,
    SCHED_CONTEXT_PREEMPT3,
    SCHED_CONTEXT_PREEMPT4,
    SCHED_CONTEXT_TIMERSV
} extsched_SchedContext;

/* LSF 9/10 names. */
int extsched_resreq_registerhandler(int handlerId, RsrcReqHandlerType *handler);
void extsched_resreq_setobject(INT_RsrcReq *resreq, int handlerId, char *key, void *handlerData);
char **extsched_resreq_getextresreq(INT_RsrcReq *resreq, int *msgCnt);
int extsched_resreq_getqueextsched(INT_RsrcReq *resreq, char **mand_extsched, char **default_extsched);
char **extsched_job_getextresreq(INT_JobBlock *jobPtr, int *msgCnt);
int extsched_job_getaskedslot(INT_JobBlock *jobPtr);
struct candHostGroup *extsched_cand_getnextgroup(INT_CandGroupList *candGroupList);
void extsched_cand_removehost(struct candHostGroup *group, int index);
struct hostSlot *extsched_cand_getavailslot(struct candHost *candHost);
int extsched_reason_set(INT_Reason *reasonPtr, struct candHost *candHost, int reasonId);
int extsched_setMainReason(INT_Reason *reason, char *msg, int bucketLevel);
struct hostResources *extsched_host_resources(INT_Host *host);
int extsched_getAlloc(INT_Alloc *alloc, extsched_Alloc **infoPtr);
void extsched_freeAlloc(extsched_Alloc **infoPtr);
INT_Alloc *extsched_getJobAlloc(INT_Job *job);
int extsched_getJobInfo(INT_Job *job, struct jobInfo *info);
void extsched_freeJobInfo(struct jobInfo *info);
int extsched_determineEvent(INT_Job *job, INT_Alloc *alloc, INT_AllocLimitList *allocLimitList, int flag);
extsched_SchedContext extsched_getCheckAllocContext(void);
int extsched_addAllocLimit(INT_AllocLimitList *allocLimitList, INT_Alloc *alloc, char *host, int maxTasks,
                           int reasonId, char *reasonDetail, int handlerId, int bucketReason);
int extsched_getHostID(INT_Host *hostPtr, char **hostname, char **clustername);
INT_Host *extsched_getHost(char *hostname, char *clustername);
char *extsched_clustername(void);

/* LSF 6.x names (deprecated aliases in 9/10). */
int lsb_resreq_registerhandler(int handlerId, RsrcReqHandlerType *handler);
void lsb_resreq_setobject(void *resreq, int handlerId, char *key, void *handlerData);
char **lsb_resreq_getextresreq(void *resreq, int *msgCnt);
int lsb_resreq_getqueextsched(void *resreq, char **mand_extsched, char **default_extsched);
char **lsb_job_getextresreq(void *job, int *msgCnt);
int lsb_job_getaskedslot(void *job);
struct candHostGroup *lsb_cand_getnextgroup(void *candGroupList);
void lsb_cand_removehost(struct candHostGroup *group, int index);
struct hostSlot *lsb_cand_getavailslot(struct candHost *candHost);
int lsb_reason_set(void *reasonPtr, struct candHost *candHost, int reasonId);
struct hostResources *lsb_host_resources(void *host);
struct jobInfo *lsb_get_jobinfo(void *job, int phase);
struct hostSlot *lsb_alloc_gethostslot(void *alloc, void *candGroupList, int *hostCnt, struct candHostGroup **group);
int lsb_alloc_type(void *alloc);

#ifdef __cplusplus
}
#endif

#endif /* TOPO_LSSCHED_H */
