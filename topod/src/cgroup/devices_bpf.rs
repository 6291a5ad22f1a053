//! Device confinement on cgroup v2: a BPF program per job cgroup.
//!
//! The unified hierarchy has no `devices.allow`/`devices.deny` files. A cgroup's device access
//! is decided by programs of type `BPF_PROG_TYPE_CGROUP_DEVICE` attached to it and to its
//! ancestors (cgroup-v2.rst, "Device controller"; `include/uapi/linux/bpf.h`). Kernel facts
//! this module relies on, from `include/uapi/linux/bpf.h` and `kernel/bpf/cgroup.c`:
//! - the program reads `struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }`,
//!   where `access_type` is `(access << 16) | type`, type `BPF_DEVCG_DEV_CHAR` = 2 (block = 1),
//!   access a mask of mknod 1, read 2, write 4; it returns 1 to allow and 0 to deny (`EPERM`);
//! - attached with `BPF_F_ALLOW_MULTI`, every program from the cgroup up to the root runs and
//!   all must allow: topo's program only narrows what a parent (systemd's `DeviceAllow=`, a
//!   batch system's) already allows, and takes nothing away from them;
//! - a program stays attached until it is detached or its cgroup is removed, so it outlives a
//!   topod restart, and removing the job's cgroup at release drops it.
//!
//! [`deny_program`] is pure: the instructions that deny a list of character devices and allow
//! everything else (the same rules topod writes as v1 `devices.deny` lines). [`DeviceFilter`] is
//! the OS boundary: [`Bpf`] loads and attaches through `bpf(2)`, [`FakeFilter`] keeps the lists
//! in memory for unit tests of the v2 backend on a fake cgroup file system.
//!
//! The crate denies `unsafe`; this module needs it for the one system call libc does not wrap
//! (`bpf(2)`), each block with its reason.
#![allow(unsafe_code)]

use super::{CgroupError, CharDevice};
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The name topod gives its device programs (`bpftool cgroup tree` shows it), and by which it
/// finds its own among the programs attached to a job's cgroup.
pub const PROGRAM_NAME: &str = "topo_devices";

/// The most devices one program denies: each takes four instructions and the first jump spans
/// them all in a signed 16-bit offset.
pub const MAX_DENIED: usize = 4096;

/// One BPF instruction (`struct bpf_insn`: opcode, destination and source registers in one
/// byte, a 16-bit offset, a 32-bit immediate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Insn {
    /// The opcode (class, operation, source).
    pub code: u8,
    /// The destination register (low nibble) and source register (high nibble).
    pub regs: u8,
    /// The memory or jump offset.
    pub off: i16,
    /// The immediate.
    pub imm: i32,
}

impl Insn {
    const fn new(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Self {
        Insn { code, regs: (src << 4) | (dst & 0x0f), off, imm }
    }

    /// The 8 bytes the kernel reads (little-endian, as on every host topod runs on: x86-64 and
    /// arm64 Linux are little-endian; the bit field puts the destination in the low nibble).
    pub fn to_bytes(self) -> [u8; 8] {
        let mut out = [0u8; 8];
        out[0] = self.code;
        out[1] = self.regs;
        out[2..4].copy_from_slice(&self.off.to_le_bytes());
        out[4..8].copy_from_slice(&self.imm.to_le_bytes());
        out
    }
}

// Opcodes (include/uapi/linux/bpf_common.h, bpf.h).
/// `dst = *(u32 *)(src + off)`: BPF_LDX | BPF_MEM | BPF_W.
const LDX_MEM_W: u8 = 0x61;
/// `(u32) dst &= imm`: BPF_ALU | BPF_AND | BPF_K.
const ALU32_AND_K: u8 = 0x54;
/// `if (u32) dst != imm goto pc + 1 + off`: BPF_JMP32 | BPF_JNE | BPF_K.
const JMP32_JNE_K: u8 = 0x56;
/// `dst = imm`: BPF_ALU64 | BPF_MOV | BPF_K.
const MOV64_K: u8 = 0xb7;
/// Return r0: BPF_JMP | BPF_EXIT.
const EXIT: u8 = 0x95;
/// `BPF_DEVCG_DEV_CHAR`.
const DEV_CHAR: i32 = 2;

/// The program that denies every access (mknod, read, write) to each character device of
/// `denied` and allows every other device, or an error naming the limit when there are more
/// than [`MAX_DENIED`]. Duplicates are dropped.
pub fn deny_program(denied: &[CharDevice]) -> Result<Vec<Insn>, CgroupError> {
    let mut devices: Vec<CharDevice> = denied.to_vec();
    devices.sort();
    devices.dedup();
    if devices.len() > MAX_DENIED {
        return Err(CgroupError::Unsupported(format!(
            "{} device files to deny in one job's cgroup, more than the {MAX_DENIED} one device program holds",
            devices.len()
        )));
    }
    // r1 is the context; r2 its type, r3 its major, r4 its minor.
    let mut prog = vec![
        Insn::new(LDX_MEM_W, 2, 1, 0, 0),
        Insn::new(ALU32_AND_K, 2, 0, 0, 0xffff),
        Insn::new(LDX_MEM_W, 3, 1, 4, 0),
        Insn::new(LDX_MEM_W, 4, 1, 8, 0),
        // Not a character device: allowed (the jump lands on the final "allow").
        Insn::new(JMP32_JNE_K, 2, 0, (4 * devices.len()) as i16, DEV_CHAR),
    ];
    for d in &devices {
        // The kernel compares the low 32 bits (JMP32); the immediate carries them as i32.
        prog.push(Insn::new(JMP32_JNE_K, 3, 0, 3, d.major as i32));
        prog.push(Insn::new(JMP32_JNE_K, 4, 0, 2, d.minor as i32));
        prog.push(Insn::new(MOV64_K, 0, 0, 0, 0));
        prog.push(Insn::new(EXIT, 0, 0, 0, 0));
    }
    prog.push(Insn::new(MOV64_K, 0, 0, 0, 1));
    prog.push(Insn::new(EXIT, 0, 0, 0, 0));
    Ok(prog)
}

/// Where a cgroup's device programs are set: the kernel ([`Bpf`]) or memory ([`FakeFilter`]).
pub trait DeviceFilter: Send + Sync + std::fmt::Debug {
    /// Makes topod's program on the cgroup directory `dir` deny exactly `denied` (and nothing
    /// when it is empty): the new program is attached before the old one is detached, so no
    /// device is open in between.
    fn set(&self, dir: &Path, denied: &[CharDevice]) -> Result<(), CgroupError>;
    /// Detaches topod's program from the cgroup directory `dir`; how many there were.
    fn clear(&self, dir: &Path) -> Result<usize, CgroupError>;
    /// Whether programs can be loaded at all (checked once as topod starts, so that a kernel
    /// without `CONFIG_CGROUP_BPF` or a missing capability stops it before any job).
    fn check(&self) -> Result<(), CgroupError>;
}

/// The kernel's `bpf(2)`.
#[derive(Debug, Default, Clone, Copy)]
pub struct Bpf;

// bpf(2) commands and constants (include/uapi/linux/bpf.h).
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_DETACH: libc::c_long = 9;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
const BPF_F_ALLOW_MULTI: u32 = 2;
/// The size of `union bpf_attr` this module fills (every field it sets lies within it; the
/// kernel requires the bytes past a command's last field to be zero, and they are).
const ATTR_SIZE: usize = 128;

/// A zeroed `union bpf_attr`, filled field by field at the offsets `bpf.h` gives.
struct Attr([u64; ATTR_SIZE / 8]);

impl Attr {
    fn new() -> Self {
        Attr([0; ATTR_SIZE / 8])
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: a [u64; 16] is 128 initialized bytes; u8 has no alignment or validity needs.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), ATTR_SIZE) }
    }

    fn u32_at(mut self, offset: usize, value: u32) -> Self {
        self.bytes()[offset..offset + 4].copy_from_slice(&value.to_ne_bytes());
        self
    }

    fn u64_at(mut self, offset: usize, value: u64) -> Self {
        self.bytes()[offset..offset + 8].copy_from_slice(&value.to_ne_bytes());
        self
    }

    fn bytes_at(mut self, offset: usize, value: &[u8]) -> Self {
        self.bytes()[offset..offset + value.len()].copy_from_slice(value);
        self
    }

    fn read_u32(&mut self, offset: usize) -> u32 {
        let b = &self.bytes()[offset..offset + 4];
        u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
    }

    /// Runs `cmd`; the result (a descriptor for some commands) or the OS error.
    fn call(&mut self, cmd: libc::c_long) -> std::io::Result<libc::c_long> {
        // SAFETY: bpf(2) reads and writes at most ATTR_SIZE bytes of the buffer, which lives
        // for the call; the pointers set inside it (instructions, licence, log, id list, info)
        // point to buffers the caller keeps alive across this call.
        let r = unsafe {
            libc::syscall(libc::SYS_bpf, cmd, self.0.as_mut_ptr(), ATTR_SIZE as libc::c_uint)
        };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }
}

/// A descriptor `bpf(2)` returned.
fn owned(fd: libc::c_long) -> OwnedFd {
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

fn bpf_error(action: &'static str, path: &Path, source: std::io::Error) -> CgroupError {
    CgroupError::Io { action, path: path.to_path_buf(), data: None, source }
}

impl Bpf {
    /// Loads `prog`; on a refusal, loads it again with the verifier's log so the error says why.
    fn load(&self, prog: &[Insn], dir: &Path) -> Result<OwnedFd, CgroupError> {
        let bytes: Vec<u8> = prog.iter().flat_map(|i| i.to_bytes()).collect();
        let licence = c"Apache-2.0";
        let mut name = [0u8; 16];
        name[..PROGRAM_NAME.len()].copy_from_slice(PROGRAM_NAME.as_bytes());
        let attr = |log: Option<&mut Vec<u8>>| {
            let (level, size, buf) = match log {
                Some(l) => (1, l.len() as u32, l.as_mut_ptr() as u64),
                None => (0, 0, 0),
            };
            Attr::new()
                .u32_at(0, BPF_PROG_TYPE_CGROUP_DEVICE)
                .u32_at(4, prog.len() as u32)
                .u64_at(8, bytes.as_ptr() as u64)
                .u64_at(16, licence.as_ptr() as u64)
                .u32_at(24, level)
                .u32_at(28, size)
                .u64_at(32, buf)
                .bytes_at(48, &name)
        };
        match attr(None).call(BPF_PROG_LOAD) {
            Ok(fd) => Ok(owned(fd)),
            Err(first) => {
                let mut log = vec![0u8; 64 * 1024];
                let _ = attr(Some(&mut log)).call(BPF_PROG_LOAD);
                let said = String::from_utf8_lossy(&log);
                let said = said.trim_end_matches('\0').trim();
                let why = if said.is_empty() { String::new() } else { format!(" ({said})") };
                Err(CgroupError::Io {
                    action: "load the device program (bpf BPF_PROG_LOAD) for",
                    path: dir.to_path_buf(),
                    data: None,
                    source: std::io::Error::new(first.kind(), format!("{first}{why}")),
                })
            }
        }
    }

    /// The programs named [`PROGRAM_NAME`] attached to the cgroup `cgroup` itself.
    fn ours(&self, cgroup: &OwnedFd, dir: &Path) -> Result<Vec<OwnedFd>, CgroupError> {
        let mut ids = vec![0u32; 64];
        let mut attr = Attr::new()
            .u32_at(0, cgroup.as_raw_fd() as u32)
            .u32_at(4, BPF_CGROUP_DEVICE)
            .u64_at(16, ids.as_mut_ptr() as u64)
            .u32_at(24, ids.len() as u32);
        attr.call(BPF_PROG_QUERY)
            .map_err(|e| bpf_error("list the device programs (bpf BPF_PROG_QUERY) of", dir, e))?;
        let count = (attr.read_u32(24) as usize).min(ids.len());
        let mut found = Vec::new();
        for &id in &ids[..count] {
            // A program detached meanwhile (another topod's release) is simply gone.
            let Ok(fd) = Attr::new().u32_at(0, id).call(BPF_PROG_GET_FD_BY_ID) else { continue };
            let fd = owned(fd);
            // struct bpf_prog_info: the name is 16 bytes at offset 64.
            let mut info = [0u8; 80];
            let got = Attr::new()
                .u32_at(0, fd.as_raw_fd() as u32)
                .u32_at(4, info.len() as u32)
                .u64_at(8, info.as_mut_ptr() as u64)
                .call(BPF_OBJ_GET_INFO_BY_FD);
            let name = &info[64..80];
            let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
            if got.is_ok() && name == PROGRAM_NAME.as_bytes() {
                found.push(fd);
            }
        }
        Ok(found)
    }
}

impl Bpf {
    /// Detaches `programs` from `cgroup`; how many.
    fn detach(
        &self,
        cgroup: &OwnedFd,
        programs: Vec<OwnedFd>,
        dir: &Path,
    ) -> Result<usize, CgroupError> {
        let count = programs.len();
        for fd in programs {
            Attr::new()
                .u32_at(0, cgroup.as_raw_fd() as u32)
                .u32_at(4, fd.as_raw_fd() as u32)
                .u32_at(8, BPF_CGROUP_DEVICE)
                .call(BPF_PROG_DETACH)
                .map_err(|e| {
                    bpf_error("detach topod's device program (bpf BPF_PROG_DETACH) from", dir, e)
                })?;
        }
        Ok(count)
    }

    /// How many of topod's device programs are attached to the cgroup `dir` itself (one after
    /// [`DeviceFilter::set`], none before): what `bpftool cgroup show` would list by name.
    pub fn attached(&self, dir: &Path) -> Result<usize, CgroupError> {
        let cgroup = std::fs::File::open(dir)
            .map(OwnedFd::from)
            .map_err(|e| bpf_error("open the cgroup", dir, e))?;
        Ok(self.ours(&cgroup, dir)?.len())
    }
}

impl DeviceFilter for Bpf {
    fn set(&self, dir: &Path, denied: &[CharDevice]) -> Result<(), CgroupError> {
        let prog = self.load(&deny_program(denied)?, dir)?;
        let cgroup = std::fs::File::open(dir)
            .map(OwnedFd::from)
            .map_err(|e| bpf_error("open the cgroup", dir, e))?;
        let old = self.ours(&cgroup, dir)?;
        Attr::new()
            .u32_at(0, cgroup.as_raw_fd() as u32)
            .u32_at(4, prog.as_raw_fd() as u32)
            .u32_at(8, BPF_CGROUP_DEVICE)
            .u32_at(12, BPF_F_ALLOW_MULTI)
            .call(BPF_PROG_ATTACH)
            .map_err(|e| bpf_error("attach the device program (bpf BPF_PROG_ATTACH) to", dir, e))?;
        self.detach(&cgroup, old, dir).map(drop)
    }

    fn clear(&self, dir: &Path) -> Result<usize, CgroupError> {
        let cgroup = std::fs::File::open(dir)
            .map(OwnedFd::from)
            .map_err(|e| bpf_error("open the cgroup", dir, e))?;
        let old = self.ours(&cgroup, dir)?;
        self.detach(&cgroup, old, dir)
    }

    fn check(&self) -> Result<(), CgroupError> {
        self.load(&deny_program(&[])?, Path::new("a check as topod starts")).map(drop)
    }
}

/// Device programs kept in memory, by cgroup directory: what [`Bpf`] would attach.
#[derive(Debug, Default)]
pub struct FakeFilter {
    denied: Mutex<BTreeMap<PathBuf, Vec<CharDevice>>>,
}

impl FakeFilter {
    /// What the program on `dir` denies, if one was set.
    pub fn denied(&self, dir: &Path) -> Option<Vec<CharDevice>> {
        self.denied.lock().unwrap_or_else(|e| e.into_inner()).get(dir).cloned()
    }
}

impl DeviceFilter for FakeFilter {
    fn set(&self, dir: &Path, denied: &[CharDevice]) -> Result<(), CgroupError> {
        deny_program(denied)?;
        let mut sorted = denied.to_vec();
        sorted.sort();
        sorted.dedup();
        self.denied.lock().unwrap_or_else(|e| e.into_inner()).insert(dir.to_path_buf(), sorted);
        Ok(())
    }

    fn clear(&self, dir: &Path) -> Result<usize, CgroupError> {
        let had = self.denied.lock().unwrap_or_else(|e| e.into_inner()).remove(dir);
        Ok(usize::from(had.is_some()))
    }

    fn check(&self) -> Result<(), CgroupError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `prog` as the kernel would on one device access, for the instructions
    /// [`deny_program`] uses; panics on any other (so a new opcode needs this too).
    fn run(prog: &[Insn], access_type: u32, major: u32, minor: u32) -> u64 {
        let ctx = [access_type, major, minor];
        let mut r = [0u64; 11];
        let mut pc = 0usize;
        for _ in 0..100_000 {
            let i = prog[pc];
            let (dst, src) = ((i.regs & 0x0f) as usize, (i.regs >> 4) as usize);
            pc += 1;
            match i.code {
                LDX_MEM_W => {
                    assert_eq!(src, 1, "only the context is read");
                    r[dst] = u64::from(ctx[i.off as usize / 4]);
                }
                ALU32_AND_K => r[dst] = u64::from((r[dst] as u32) & (i.imm as u32)),
                JMP32_JNE_K => {
                    if r[dst] as u32 != i.imm as u32 {
                        pc = (pc as isize + i.off as isize) as usize;
                    }
                }
                MOV64_K => r[dst] = i.imm as i64 as u64,
                EXIT => return r[0],
                other => panic!("opcode {other:#x} not interpreted"),
            }
        }
        panic!("no exit");
    }

    const CHAR: u32 = 2;
    const BLOCK: u32 = 1;
    const READ: u32 = 2 << 16;
    const WRITE: u32 = 4 << 16;
    const MKNOD: u32 = 1 << 16;

    #[test]
    fn the_program_denies_exactly_the_listed_character_devices() {
        let denied = [
            CharDevice { major: 195, minor: 0 },
            CharDevice { major: 195, minor: 1 },
            CharDevice { major: 226, minor: 128 },
            // Beyond i32: compared on the low 32 bits, as the kernel does.
            CharDevice { major: 4095, minor: u32::MAX },
        ];
        let prog = deny_program(&denied).unwrap();
        for d in denied {
            for access in [READ, WRITE, MKNOD, READ | WRITE] {
                assert_eq!(run(&prog, CHAR | access, d.major, d.minor), 0, "{d} {access:#x}");
                // A block device of the same numbers is another device.
                assert_eq!(run(&prog, BLOCK | access, d.major, d.minor), 1, "block {d}");
            }
        }
        for (major, minor) in [(195, 2), (195, 255), (1, 3), (226, 0), (0, 0), (196, 0), (4095, 0)]
        {
            assert_eq!(run(&prog, CHAR | READ, major, minor), 1, "{major}:{minor}");
        }
    }

    #[test]
    fn no_device_denied_allows_every_device() {
        let prog = deny_program(&[]).unwrap();
        assert_eq!(prog.len(), 7);
        assert_eq!(run(&prog, CHAR | READ, 195, 0), 1);
        assert_eq!(run(&prog, BLOCK | WRITE, 8, 0), 1);
    }

    #[test]
    fn duplicates_are_dropped_and_the_limit_is_named() {
        let d = CharDevice { major: 10, minor: 1 };
        assert_eq!(deny_program(&[d, d, d]).unwrap().len(), 7 + 4);
        let many: Vec<CharDevice> =
            (0..=MAX_DENIED as u32).map(|minor| CharDevice { major: 10, minor }).collect();
        let err = deny_program(&many).unwrap_err().to_string();
        assert!(err.contains("4097 device files") && err.contains("4096"), "{err}");
        // At the limit the first jump still reaches the end.
        let prog = deny_program(&many[..MAX_DENIED]).unwrap();
        assert_eq!(run(&prog, BLOCK | READ, 10, 0), 1);
        assert_eq!(run(&prog, CHAR | READ, 10, MAX_DENIED as u32 - 1), 0);
        assert_eq!(run(&prog, CHAR | READ, 11, 0), 1);
    }

    #[test]
    fn an_instruction_is_laid_out_as_struct_bpf_insn() {
        // r3 = *(u32 *)(r1 + 4)
        assert_eq!(Insn::new(LDX_MEM_W, 3, 1, 4, 0).to_bytes(), [0x61, 0x13, 4, 0, 0, 0, 0, 0]);
        // if w4 != 0x12345 goto +2
        assert_eq!(
            Insn::new(JMP32_JNE_K, 4, 0, 2, 0x12345).to_bytes(),
            [0x56, 0x04, 2, 0, 0x45, 0x23, 0x01, 0]
        );
    }
}
