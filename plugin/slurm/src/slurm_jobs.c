/* spank_topo.so's one question to slurmctld: the state of a Slurm job, through Slurm's own C API
 * (slurm_load_job, slurm.h). Compiled by build.rs against the installed <slurm/slurm.h>, so the
 * job record's layout is this Slurm's; the functions resolve, as the SPANK ones do, from the
 * Slurm process that loads the plug-in (slurmstepd, slurmd, srun, sbatch and salloc all link
 * libslurmfull). */
#include <stdint.h>
#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>

/* What topo_slurm_job_state reports, apart from Slurm's own numbering. */
#define TOPO_SLURM_OTHER 0
#define TOPO_SLURM_RUNNING 1
#define TOPO_SLURM_SUSPENDED 2
#define TOPO_SLURM_GONE 3 /* slurmctld knows no such job (ended and purged, or never was) */

/* 0, with *state one of the TOPO_SLURM_* values; else Slurm's errno for the failure (never 0). */
int topo_slurm_job_state(uint32_t job_id, uint32_t *state)
{
	job_info_msg_t *msg = NULL;
	uint32_t base;

	if (slurm_load_job(&msg, job_id, SHOW_ALL) != SLURM_SUCCESS) {
		int e = slurm_get_errno();
		if (e == ESLURM_INVALID_JOB_ID) {
			*state = TOPO_SLURM_GONE;
			return 0;
		}
		return e ? e : SLURM_ERROR;
	}
	if (!msg || msg->record_count < 1) {
		if (msg)
			slurm_free_job_info_msg(msg);
		return ESLURM_INVALID_JOB_ID;
	}
	base = msg->job_array[0].job_state & JOB_STATE_BASE;
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
