/* spank_topo.so's questions to slurmctld: a Slurm job's state and partition, through Slurm's own C API
 * (slurm_load_job, slurm.h). Compiled by build.rs against the installed <slurm/slurm.h>, so the
 * job record's layout is this Slurm's; the functions resolve, as the SPANK ones do, from the
 * Slurm process that loads the plug-in (slurmstepd, slurmd, srun, sbatch and salloc all link
 * libslurmfull). */
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>

/* What topo_slurm_job_state reports, apart from Slurm's own numbering. */
#define TOPO_SLURM_OTHER 0
#define TOPO_SLURM_RUNNING 1
#define TOPO_SLURM_SUSPENDED 2
#define TOPO_SLURM_GONE 3 /* slurmctld knows no such job (ended and purged, or never was) */

/* Loads job_id's record from slurmctld: 0 with *msg (to free with slurm_free_job_info_msg) and
 * *job, the record of job_id itself (loading a job array's first task by its id, the array's
 * own id, also returns the array's other tasks, each with its own state and partition); else
 * Slurm's errno for the failure (never 0), ESLURM_INVALID_JOB_ID for no such job. */
static int load_own_record(uint32_t job_id, job_info_msg_t **msg, slurm_job_info_t **job)
{
	uint32_t i;

	*msg = NULL;
	*job = NULL;
	if (slurm_load_job(msg, job_id, SHOW_ALL) != SLURM_SUCCESS) {
		int e = slurm_get_errno();
		*msg = NULL;
		return e ? e : SLURM_ERROR;
	}
	for (i = 0; *msg && i < (*msg)->record_count; i++)
		if ((*msg)->job_array[i].job_id == job_id)
			*job = &(*msg)->job_array[i];
	if (!*job) {
		if (*msg)
			slurm_free_job_info_msg(*msg);
		*msg = NULL;
		return ESLURM_INVALID_JOB_ID;
	}
	return 0;
}

/* 0, with *state one of the TOPO_SLURM_* values; else Slurm's errno for the failure (never 0). */
int topo_slurm_job_state(uint32_t job_id, uint32_t *state)
{
	job_info_msg_t *msg;
	slurm_job_info_t *job;
	uint32_t base;
	int e = load_own_record(job_id, &msg, &job);

	if (e == ESLURM_INVALID_JOB_ID) {
		*state = TOPO_SLURM_GONE;
		return 0;
	}
	if (e)
		return e;
	base = job->job_state & JOB_STATE_BASE;
	slurm_free_job_info_msg(msg);
	if (base == JOB_RUNNING)
		*state = TOPO_SLURM_RUNNING;
	else if (base == JOB_SUSPENDED)
		*state = TOPO_SLURM_SUSPENDED;
	else
		*state = TOPO_SLURM_OTHER;
	return 0;
}

/* Slurm's text for one of its errnos (a static string). */
const char *topo_slurm_strerror(int e)
{
	return slurm_strerror(e);
}

/* 0, with the partition slurmctld runs job_id in written into buf (NUL-terminated; empty when the
 * record names none); ESLURM_INVALID_JOB_ID for no such job; ENAMETOOLONG when the name does not
 * fit in len bytes; else Slurm's errno for the failure. The job's environment can say any
 * partition (a user may set SLURM_JOB_PARTITION before srun); slurmctld's record is the one
 * that counts when the partition decides what a job may use. */
int topo_slurm_job_partition(uint32_t job_id, char *buf, size_t len)
{
	job_info_msg_t *msg;
	slurm_job_info_t *job;
	const char *name;
	size_t n;
	int e;

	if (!buf || len == 0)
		return EINVAL;
	buf[0] = '\0';
	e = load_own_record(job_id, &msg, &job);
	if (e)
		return e;
	name = job->partition;
	n = name ? strlen(name) : 0;
	if (n >= len) {
		slurm_free_job_info_msg(msg);
		return ENAMETOOLONG;
	}
	if (n)
		memcpy(buf, name, n);
	buf[n] = '\0';
	slurm_free_job_info_msg(msg);
	return 0;
}
