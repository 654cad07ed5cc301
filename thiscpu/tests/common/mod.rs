//! Helpers shared by the integration tests: pinning threads, asking the kernel directly, and
//! reading `/sys` without going through thiscpu, so that every comparison has an independent
//! side.

#![allow(dead_code)]

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A CPU affinity mask as the kernel reads it: bit `n` of the array is CPU `n`. 1024 CPUs, the
/// size of glibc's `cpu_set_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mask([u64; 16]);

impl Mask {
    pub const EMPTY: Mask = Mask([0; 16]);
    pub const CAPACITY: u32 = 1024;

    pub fn of(cpus: &[u32]) -> Mask {
        let mut mask = Mask::EMPTY;
        for &cpu in cpus {
            mask.insert(cpu);
        }
        mask
    }

    pub fn insert(&mut self, cpu: u32) {
        self.0[cpu as usize / 64] |= 1 << (cpu % 64);
    }

    pub fn contains(&self, cpu: u32) -> bool {
        cpu < Self::CAPACITY && self.0[cpu as usize / 64] & (1 << (cpu % 64)) != 0
    }

    pub fn cpus(&self) -> Vec<u32> {
        (0..Self::CAPACITY)
            .filter(|&cpu| self.contains(cpu))
            .collect()
    }
}

/// The affinity mask of thread `tid` (0: the calling thread).
pub fn get_affinity(tid: libc::pid_t) -> Mask {
    let mut mask = Mask::EMPTY;
    // SAFETY: the kernel writes at most `size_of::<Mask>()` bytes into `mask`, which has the
    // layout of `cpu_set_t` (an array of unsigned longs).
    let ret = unsafe {
        libc::sched_getaffinity(
            tid,
            size_of::<Mask>(),
            (&raw mut mask).cast::<libc::cpu_set_t>(),
        )
    };
    assert_eq!(
        ret,
        0,
        "sched_getaffinity: {}",
        std::io::Error::last_os_error()
    );
    mask
}

/// Sets the affinity of thread `tid` (0: the calling thread). Returns the error for masks the
/// kernel refuses.
pub fn set_affinity(tid: libc::pid_t, mask: &Mask) -> std::io::Result<()> {
    // SAFETY: the kernel reads `size_of::<Mask>()` bytes from `mask`.
    let ret = unsafe {
        libc::sched_setaffinity(
            tid,
            size_of::<Mask>(),
            (&raw const *mask).cast::<libc::cpu_set_t>(),
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The CPUs the calling thread may run on now.
pub fn allowed_cpus() -> Vec<u32> {
    get_affinity(0).cpus()
}

/// Restores the calling thread's affinity when dropped.
#[derive(Debug)]
pub struct AffinityGuard(Mask);

impl AffinityGuard {
    pub fn new() -> AffinityGuard {
        AffinityGuard(get_affinity(0))
    }
}

impl Drop for AffinityGuard {
    fn drop(&mut self) {
        let _ = set_affinity(0, &self.0);
    }
}

/// Pins the calling thread to `cpu`. When this returns the thread runs on `cpu` and stays
/// there: `sched_setaffinity` on oneself moves the thread before it returns.
pub fn pin(cpu: u32) {
    set_affinity(0, &Mask::of(&[cpu])).unwrap_or_else(|e| panic!("pin to CPU {cpu}: {e}"));
}

/// The `getcpu` system call, made here rather than through thiscpu: `(cpu, node)`.
pub fn kernel_getcpu() -> (u32, u32) {
    let mut cpu = u32::MAX;
    let mut node = u32::MAX;
    // SAFETY: getcpu writes two `unsigned int`s through valid pointers; the cache argument may
    // be null.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_getcpu,
            &raw mut cpu,
            &raw mut node,
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    assert_eq!(ret, 0, "getcpu: {}", std::io::Error::last_os_error());
    (cpu, node)
}

/// The calling thread's id.
pub fn gettid() -> libc::pid_t {
    // SAFETY: no precondition.
    unsafe { libc::gettid() }
}

/// Number of threads in this process now (`/proc/self/task`).
pub fn live_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count()
}

/// Parses a kernel cpulist (`0-3,8`) with code of its own, independent of thiscpu's parser.
pub fn cpulist(text: &str) -> Vec<u32> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let mut ends = part
            .splitn(2, '-')
            .map(|n| n.trim().parse::<u32>().unwrap());
        let first = ends.next().unwrap();
        let last = ends.next().unwrap_or(first);
        cpus.extend(first..=last);
    }
    cpus
}

/// `/sys/devices/system/cpu/possible`, read here.
pub fn sys_possible_cpus() -> Vec<u32> {
    cpulist(&std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap())
}

/// The node of `cpu` from the `/sys/devices/system/cpu/cpuN/nodeM` link (a different view of
/// the topology from the per-node `cpulist` files thiscpu reads). `None` when the CPU has no
/// such link (no NUMA support in `/sys`, or an offline CPU on some kernels).
pub fn sys_node_of_cpu(cpu: u32) -> Option<u32> {
    let dir = std::fs::read_dir(format!("/sys/devices/system/cpu/cpu{cpu}")).ok()?;
    dir.flatten().find_map(|entry| {
        let name = entry.file_name();
        name.to_str()?.strip_prefix("node")?.parse().ok()
    })
}

/// Every NUMA node's CPUs, read here: `(node, cpus)`.
pub fn sys_nodes() -> Vec<(u32, Vec<u32>)> {
    let Ok(dir) = std::fs::read_dir("/sys/devices/system/node") else {
        return Vec::new();
    };
    let mut nodes: Vec<(u32, Vec<u32>)> = dir
        .flatten()
        .filter_map(|entry| {
            let node = entry
                .file_name()
                .to_str()?
                .strip_prefix("node")?
                .parse()
                .ok()?;
            let list = std::fs::read_to_string(entry.path().join("cpulist")).ok()?;
            Some((node, cpulist(&list)))
        })
        .collect();
    nodes.sort();
    nodes
}

/// Registrar names as `Registrar::name` spells them.
pub fn expected_registrar_from_env() -> Option<String> {
    std::env::var("THISCPU_EXPECT_REGISTRAR")
        .ok()
        .filter(|value| !value.is_empty())
}

/// glibc's exported rseq symbol `name`, looked up at run time (absent before glibc 2.35).
#[cfg(not(target_feature = "crt-static"))]
pub fn glibc_symbol<T: Copy>(name: &std::ffi::CStr) -> Option<T> {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name.
    let address = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    // SAFETY: glibc declares `__rseq_size` as unsigned int and `__rseq_offset` as ptrdiff_t;
    // callers ask for those types.
    (!address.is_null()).then(|| unsafe { address.cast::<T>().read() })
}

/// glibc's rseq symbol `name` in a statically linked test, where `dlsym` sees no symbol of the
/// program: linked by name (the static tests run against glibc 2.35 or later).
#[cfg(target_feature = "crt-static")]
pub fn glibc_symbol<T: Copy>(name: &std::ffi::CStr) -> Option<T> {
    unsafe extern "C" {
        static __rseq_size: u32;
        static __rseq_offset: isize;
    }
    let address: *const u8 = match name.to_bytes() {
        b"__rseq_size" => (&raw const __rseq_size).cast(),
        b"__rseq_offset" => (&raw const __rseq_offset).cast(),
        _ => return None,
    };
    // SAFETY: glibc's own definitions, of the types declared above; callers ask for those
    // types.
    Some(unsafe { address.cast::<T>().read() })
}

/// The thread pointer, read here (the word at `%fs:0` on x86_64, `TPIDR_EL0` on aarch64,
/// `tp` on riscv64).
#[cfg(thiscpu_rseq)]
pub fn thread_pointer() -> usize {
    let tp: usize;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the first word of the x86_64 thread control block holds its own address.
    unsafe {
        std::arch::asm!("mov {}, qword ptr fs:[0]", out(reg) tp, options(nostack, readonly));
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: reading TPIDR_EL0 has no side effect.
    unsafe {
        std::arch::asm!("mrs {}, tpidr_el0", out(reg) tp, options(nostack, nomem));
    }
    #[cfg(target_arch = "riscv64")]
    // SAFETY: copying the `tp` register has no side effect.
    unsafe {
        std::arch::asm!("mv {}, tp", out(reg) tp, options(nostack, nomem));
    }
    tp
}

/// `cpu_id` of glibc's rseq area in the calling thread: the CPU when glibc registered, -1 or
/// -2 when it did not. `None` without glibc's rseq symbols.
#[cfg(thiscpu_rseq)]
pub fn glibc_area_cpu_id() -> Option<i32> {
    let offset = glibc_symbol::<isize>(c"__rseq_offset")?;
    let area = thread_pointer().wrapping_add_signed(offset);
    // SAFETY: glibc 2.35+ keeps a live `struct rseq` at this offset from every thread's
    // thread pointer, registered or not; `cpu_id` is its aligned 32-bit field at offset 4.
    Some(unsafe { ((area + 4) as *const i32).read_volatile() })
}

/// What the kernel says about the calling thread's rseq registration, found by trying to
/// register an area owned by the test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelRseq {
    /// Another area is registered for this thread (the kernel answered `EINVAL` or `EBUSY`).
    Registered,
    /// Nothing was registered (the test's registration succeeded and was undone at once).
    NotRegistered,
    /// The kernel has no rseq (`ENOSYS`).
    NoSyscall,
    /// Any other errno (a seccomp filter, say).
    Refused(i32),
}

#[repr(C, align(32))]
struct ProbeArea([u32; 8]);

thread_local! {
    static PROBE_AREA: std::cell::UnsafeCell<ProbeArea> = const {
        std::cell::UnsafeCell::new(ProbeArea([0, u32::MAX, 0, 0, 0, 0, 0, 0]))
    };
}

const PROBE_SIG: u32 = 0x5305_3053;

pub fn kernel_rseq_state() -> KernelRseq {
    PROBE_AREA.with(|area| {
        let area = area.get();
        // SAFETY: the area is this thread's own, 32 bytes, 32-byte aligned, initialised to
        // `cpu_id = -1` and zeros as the kernel requires, and lives until the thread exits.
        let ret = unsafe { libc::syscall(libc::SYS_rseq, area, 32u32, 0, PROBE_SIG) };
        if ret == 0 {
            // SAFETY: undoes the registration just made, with the same address, length and
            // signature.
            let undo = unsafe { libc::syscall(libc::SYS_rseq, area, 32u32, 1, PROBE_SIG) };
            if undo != 0 {
                // The kernel would keep writing into this thread's TLS; stop here.
                std::process::abort();
            }
            return KernelRseq::NotRegistered;
        }
        match std::io::Error::last_os_error().raw_os_error().unwrap_or(0) {
            libc::EINVAL | libc::EBUSY => KernelRseq::Registered,
            libc::ENOSYS => KernelRseq::NoSyscall,
            errno => KernelRseq::Refused(errno),
        }
    })
}

/// Whether the kernel offers rseq at all: the probe `rseq(NULL, 0, 0, 0)` answers `EINVAL`.
pub fn kernel_has_rseq() -> bool {
    // SAFETY: a null area of length 0 is rejected before the kernel touches memory.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_rseq,
            std::ptr::null_mut::<libc::c_void>(),
            0u32,
            0,
            0u32,
        )
    };
    ret != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL)
}

/// Whether `THISCPU_RSEQ` turns rseq off, by the values the library documents.
pub fn rseq_turned_off_by_env() -> bool {
    matches!(
        std::env::var("THISCPU_RSEQ").as_deref(),
        Ok("off" | "0" | "false" | "no")
    )
}

/// Who should register rseq in this process, worked out from what the test can see itself:
/// the environment, glibc's `__rseq_size`, and the kernel's answer to a probe.
pub fn registrar_from_environment() -> thiscpu::Registrar {
    // `thiscpu_rseq` (from thiscpu's build script): Linux with an architecture port, and no
    // `--cfg thiscpu_portable`. Elsewhere nobody registers.
    if !cfg!(thiscpu_rseq) || rseq_turned_off_by_env() {
        thiscpu::Registrar::None
    } else if glibc_symbol::<u32>(c"__rseq_size").is_some_and(|size| size > 0) {
        thiscpu::Registrar::Glibc
    } else if kernel_has_rseq() {
        thiscpu::Registrar::Thiscpu
    } else {
        thiscpu::Registrar::None
    }
}

/// What should answer `current_cpu()` in a thread of this process.
pub fn expected_this_thread(source: &thiscpu::Source) -> thiscpu::CpuSource {
    match source.registrar {
        thiscpu::Registrar::Glibc => thiscpu::CpuSource::RseqGlibc,
        thiscpu::Registrar::Thiscpu => thiscpu::CpuSource::RseqThiscpu,
        thiscpu::Registrar::None => source.fallback,
    }
}

/// Serialises the tests of one binary that pin threads or count them.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs `step` until it returns false, `max_steps` have run, or `limit` has passed: a bound
/// on the test's duration, never a condition of its result.
pub fn bounded(max_steps: u64, limit: Duration, mut step: impl FnMut(u64) -> bool) -> u64 {
    let start = Instant::now();
    let mut done = 0;
    while done < max_steps && start.elapsed() < limit {
        if !step(done) {
            break;
        }
        done += 1;
    }
    done
}

/// Whether `read` agrees with the kernel's `getcpu` in a thread that may migrate at any
/// moment: tries up to ten times to see `kernel == read() == kernel`, and otherwise returns the
/// last disagreement. A thread can move between two reads, but a source that is wrong stays
/// wrong in every try.
pub fn agrees_with_kernel<T: PartialEq + Copy + std::fmt::Debug>(
    mut read: impl FnMut() -> T,
    from_kernel: impl Fn((u32, u32)) -> T,
) -> Result<(), String> {
    let mut last = String::new();
    for _ in 0..10 {
        let before = from_kernel(kernel_getcpu());
        let value = read();
        let after = from_kernel(kernel_getcpu());
        if before == value && value == after {
            return Ok(());
        }
        last = format!("kernel said {before:?} then {after:?}, the source said {value:?}");
    }
    Err(last)
}

/// Set in the environment of a test binary that `rerun_under_seccomp` re-executed.
pub const SECCOMP_CHILD: &str = "THISCPU_TEST_UNDER_SECCOMP";

// The seccomp filters and the thread pointer are written for the architectures with an rseq
// port (`thiscpu_rseq`, set by thiscpu's build script), and only the rseq tests use them.

/// `AUDIT_ARCH_*` of this target (`EM_*` with the 64-bit and little-endian bits,
/// linux/audit.h).
#[cfg(all(thiscpu_rseq, target_arch = "x86_64"))]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(all(thiscpu_rseq, target_arch = "aarch64"))]
const AUDIT_ARCH: u32 = 0xc000_00b7;
#[cfg(all(thiscpu_rseq, target_arch = "riscv64"))]
const AUDIT_ARCH: u32 = 0xc000_00f3;

/// A seccomp program that makes system call `nr` fail with `errno` and allows everything else.
#[cfg(thiscpu_rseq)]
pub fn refuse_syscall_program(nr: libc::c_long, errno: i32) -> Vec<libc::sock_filter> {
    refuse_syscalls_program(&[nr], errno)
}

/// A seccomp program that makes the system calls `refused` fail with `errno` and allows every
/// other one.
#[cfg(thiscpu_rseq)]
pub fn refuse_syscalls_program(refused: &[libc::c_long], errno: i32) -> Vec<libc::sock_filter> {
    let op = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    let load = |offset: u32| op(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0, 0, offset);
    let jump_if =
        |k: u32, jt: u8, jf: u8| op(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, jt, jf, k);
    let ret = |k: u32| op(libc::BPF_RET | libc::BPF_K, 0, 0, k);
    let count = u8::try_from(refused.len()).expect("at most 255 system calls");
    // struct seccomp_data: `nr` at offset 0, `arch` at offset 4. Another architecture's calls
    // jump past the comparisons and the `nr` load to the allowing return.
    let mut program = vec![load(4), jump_if(AUDIT_ARCH, 0, count + 1), load(0)];
    for (i, &nr) in refused.iter().enumerate() {
        // Past the rest of the comparisons and the allowing return, to the refusing one.
        program.push(jump_if(nr as u32, count - i as u8, 0));
    }
    program.push(ret(libc::SECCOMP_RET_ALLOW));
    program.push(ret(libc::SECCOMP_RET_ERRNO | errno as u32));
    program
}

/// This test executable, to be run again by a test: through the emulator that
/// `THISCPU_TEST_RUNNER` names where the tests run under one (qemu-user, which starts no
/// executable of a foreign architecture by itself).
pub fn this_executable() -> std::process::Command {
    let executable = std::env::current_exe().unwrap();
    match std::env::var_os("THISCPU_TEST_RUNNER") {
        Some(runner) => {
            let mut command = std::process::Command::new(runner);
            command.arg(executable);
            command
        }
        None => std::process::Command::new(executable),
    }
}

/// Runs the test `name` of this binary again, alone, with `env` set, and fails unless it
/// passes within `limit`: a child that hangs is killed and fails the test. Returns its
/// standard error.
pub fn rerun_alone(name: &str, env: &[(&str, &str)], limit: Duration) -> String {
    let mut command = this_executable();
    command
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().expect("run the test binary again");
    let began = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if began.elapsed() > limit {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let Some(status) = status else {
        panic!("{name}: no answer within {limit:?} (hung)\n{stdout}\n{stderr}");
    };
    assert!(status.success(), "{name}: {status}\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("1 passed"),
        "{name} did not run:\n{stdout}\n{stderr}"
    );
    stderr.into_owned()
}

/// Runs the test `name` of this test binary again, alone, under the seccomp `program` and with
/// [`SECCOMP_CHILD`] set (the test checks for it and does its part under the filter); fails
/// unless it ran and passed. Returns its standard error.
pub fn rerun_under_seccomp(name: &str, program: Vec<libc::sock_filter>) -> String {
    let mut command = this_executable();
    command
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(SECCOMP_CHILD, "1")
        .env_remove("THISCPU_RSEQ")
        .env_remove("THISCPU_EXPECT_REGISTRAR");
    let install = move || {
        let fprog = libc::sock_fprog {
            len: program.len() as u16,
            filter: program.as_ptr().cast_mut(),
        };
        // SAFETY: prctl with integer arguments; the filter program outlives the call, and
        // the kernel copies it. Both are plain system calls, safe between fork and exec.
        let ok = unsafe {
            libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
                && libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER,
                    &raw const fprog,
                ) == 0
        };
        if ok {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    // SAFETY: the hook only makes two prctl calls on memory it owns; it allocates nothing.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, install);
    }
    let output = command.output().expect("re-run the test under seccomp");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "under seccomp: {}\n{stdout}\n{stderr}",
        output.status
    );
    assert!(
        stdout.contains("1 passed"),
        "the test did not run under seccomp:\n{stdout}\n{stderr}"
    );
    stderr.into_owned()
}

/// glibc's `RSEQ_SIG`, the signature its registration used.
#[cfg(all(thiscpu_rseq, target_arch = "x86_64"))]
pub const GLIBC_RSEQ_SIG: u32 = 0x5305_3053;
#[cfg(all(thiscpu_rseq, target_arch = "aarch64"))]
pub const GLIBC_RSEQ_SIG: u32 = 0xd428_bc00;
#[cfg(all(thiscpu_rseq, target_arch = "riscv64"))]
pub const GLIBC_RSEQ_SIG: u32 = 0xf140_1073;

/// Takes the calling thread's rseq away where glibc registered it: unregisters glibc's area,
/// as a thread made by a raw `clone` would lack it.
#[cfg(thiscpu_rseq)]
pub fn unregister_glibcs_area() {
    let offset = glibc_symbol::<isize>(c"__rseq_offset").expect("glibc's rseq");
    let area = thread_pointer().wrapping_add_signed(offset);
    let size = glibc_symbol::<u32>(c"__rseq_size").unwrap_or(32);
    // glibc registers 32 bytes, or `__rseq_size` in its later versions: the kernel accepts
    // the unregistration only with the length registered.
    let unregistered = [32, size].into_iter().any(|len| {
        // SAFETY: unregisters glibc's area of this thread (the kernel checks the address,
        // length and signature); glibc reads `cpu_id` as unregistered (-1) afterwards.
        unsafe { libc::syscall(libc::SYS_rseq, area, len, 1, GLIBC_RSEQ_SIG) == 0 }
    });
    assert!(
        unregistered,
        "rseq unregistration: {}",
        std::io::Error::last_os_error()
    );
}

/// Installs `program` on every thread of the process (`SECCOMP_FILTER_FLAG_TSYNC`).
pub fn install_on_every_thread(program: &[libc::sock_filter]) {
    let fprog = libc::sock_fprog {
        len: program.len() as u16,
        filter: program.as_ptr().cast_mut(),
    };
    // SAFETY: prctl with integer arguments.
    let no_new_privs = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    assert_eq!(no_new_privs, 0, "{}", std::io::Error::last_os_error());
    // SAFETY: seccomp reads the program through `fprog`, which outlives the call; the kernel
    // copies it.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_TSYNC,
            &raw const fprog,
        )
    };
    assert_eq!(ret, 0, "seccomp: {}", std::io::Error::last_os_error());
}
