#!/usr/bin/env bash
# The two-GPU machine the batch-system GPU tests give topod (sourced by tests/slurm-gpu.sh and
# tests/openpbs-e2e.sh): a sysfs tree with this host's two CPUs as two NUMA nodes (CPU 0 on node
# 0, package 0; CPU 1 on node 1, package 1; memory on node 0 only, as on this machine class),
# GPU 0000:18:00.0 on node 0 and GPU 0000:86:00.0 on node 1 behind a PCIe switch, their device
# files character devices of major 241 (local use: no driver has it, so opening one the job may
# open says ENXIO and one it may not EPERM), linked from sys/dev/char as the kernel links a GPU's.
# Usage: two_gpu_machine SYSFS_DIR DEV_DIR   (DEV_DIR gets gpu3 = 241:3 and gpu5 = 241:5; root)
two_gpu_machine() {
    local SYS=$1 d cpu
    w() { mkdir -p "$(dirname "$SYS/$1")"; printf '%s\n' "$2" > "$SYS/$1"; }
    w sys/devices/system/cpu/online 0-1
    for cpu in 0 1; do
        d=sys/devices/system/cpu/cpu$cpu
        w $d/topology/thread_siblings_list $cpu
        w $d/topology/core_siblings_list $cpu
        w $d/topology/physical_package_id $cpu
        w $d/topology/core_id 0
        w $d/cache/index3/level 3
        w $d/cache/index3/type Unified
        w $d/cache/index3/shared_cpu_map $((cpu + 1))
        w sys/devices/system/node/node$cpu/cpulist $cpu
    done
    w sys/devices/system/node/possible 0-1
    w sys/devices/system/node/node0/meminfo "Node 0 MemTotal:  1048576 kB"
    w sys/devices/system/node/node1/meminfo "Node 1 MemTotal:  0 kB"
    w sys/devices/system/node/node0/distance "10 21"
    w sys/devices/system/node/node1/distance "21 10"
    w proc/mounts "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0"
    w proc/self/cgroup "0::/"
    w sys/fs/cgroup/cpuset.cpus.effective 0-1
    w sys/fs/cgroup/cpuset.mems.effective 0
    pci() {               # pci PATH CLASS NODE [DEV MAJOR:MINOR]
        local addr=${1##*/}
        w "sys/devices/$1/class" "$2"
        w "sys/devices/$1/numa_node" "$3"
        mkdir -p "$SYS/sys/bus/pci/devices" "$SYS/sys/dev/char"
        ln -s "../../../devices/$1" "$SYS/sys/bus/pci/devices/$addr"
        if [ -n "${4:-}" ]; then
            mkdir -p "$SYS/sys/devices/$1/drm/$4"
            ln -s "../../devices/$1/drm/$4" "$SYS/sys/dev/char/$5"
        fi
    }
    pci pci0000:00/0000:00:01.0 0x060400 0
    pci pci0000:00/0000:00:01.0/0000:18:00.0 0x030200 0 card3 241:3
    pci pci0000:80/0000:80:01.0 0x060400 1
    pci pci0000:80/0000:80:01.0/0000:81:00.0 0x060400 1
    pci pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:08.0 0x060400 1
    pci pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:08.0/0000:86:00.0 0x030200 1 card5 241:5
    mkdir -p "$2"
    mknod -m 0666 "$2/gpu3" c 241 3
    mknod -m 0666 "$2/gpu5" c 241 5
}
