--[[
job_submit.lua for topo: turns a job's --topology (spank_topo.so) into node constraints.

spank_topo.so checks --topology=REQUEST in srun/sbatch/salloc with topo's own parser and puts a
summary into the job's control environment, which slurmctld hands this script as
job_desc.spank_job_env:

    TOPO_NEED=cpus=8 numa=2      (at least 8 CPUs; each task needs 2 CPUs inside one NUMA node)

Hosts publish what they can offer with `topoctl slurm-features` as node features: topo_cpus_N
(at least N allocatable CPUs) and topo_numa_N (a NUMA node with at least N allocatable CPUs), N a
power of two, every power up to what the host has. This script adds the largest power of two not
above the need, so a host that fits is never filtered out, and a request that no host can ever
hold is refused at submission. The filter is coarse: topod places on the host, inside the cores
Slurm gave. (Free-now features, topo_free_N, are published too but not used as constraints:
Slurm 22.05 without a node_features plugin refuses, rather than queues, a job whose constraint no
node has active at submission.)

Install: copy next to slurm.conf (same directory), set JobSubmitPlugins=lua, `scontrol reconfigure`.
If a site already has a job_submit.lua, call topo_constrain(job_desc) from its slurm_job_submit.
--]]

local function floor_pow2(n)
    local p = 1
    while p * 2 <= n do p = p * 2 end
    return p
end

-- The TOPO_NEED summary and the raw --topology value from the job's control environment.
local function topo_env(job_desc)
    local env = job_desc.spank_job_env
    if env == nil then return nil, nil end
    local need, raw
    for _, entry in pairs(env) do
        if type(entry) == "string" then
            local v = entry:match("^TOPO_NEED=(.*)$")
            if v then need = v end
            local r = entry:match("^_SLURM_SPANK_OPTION_topo_topology=(.*)$")
            if r then raw = r end
        end
    end
    return need, raw
end

-- "cpus=8 numa=2" -> "topo_cpus_8&topo_numa_2"
local function constraint_for(need)
    local cpus = tonumber(need:match("cpus=(%d+)"))
    local numa = tonumber(need:match("numa=(%d+)"))
    if cpus == nil or cpus < 1 then return nil end
    local c = "topo_cpus_" .. floor_pow2(cpus)
    if numa and numa >= 1 then c = c .. "&topo_numa_" .. floor_pow2(numa) end
    return c
end

function topo_constrain(job_desc)
    local need, raw = topo_env(job_desc)
    if need == nil then
        if raw ~= nil then
            slurm.log_info("topo: job from uid %u has --topology=%s but no TOPO_NEED summary (old or optional plug-in on the client?); not constrained",
                job_desc.user_id, raw)
        end
        return
    end
    local ours = constraint_for(need)
    if ours == nil then
        slurm.log_info("topo: ignoring a malformed TOPO_NEED=%s", need)
        return
    end
    local features = job_desc.features
    if features == nil or features == "" then
        job_desc.features = ours
    else
        job_desc.features = "(" .. features .. ")&" .. ours
    end
    slurm.log_info("topo: uid %u --topology=%s -> features %s", job_desc.user_id, raw or "?", job_desc.features)
end

function slurm_job_submit(job_desc, part_list, submit_uid)
    topo_constrain(job_desc)
    return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    return slurm.SUCCESS
end

slurm.log_info("topo: job_submit.lua loaded")
return slurm.SUCCESS
