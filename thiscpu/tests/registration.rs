//! Who registers rseq, and whether every thread gets a working area: threads started before
//! and after the first use, hundreds of short-lived threads, and a forked child.
//!
//! `.ci/run` runs this file in each environment and says what it expects in
//! `THISCPU_EXPECT_REGISTRAR` (`glibc`, `thiscpu` or `none`); without it the tests work the
//! expectation out from glibc's symbols, `THISCPU_RSEQ` and the kernel.
//!
//! Built where thiscpu registers rseq (`thiscpu_rseq`, set by the build script); tests/portable.rs checks the other targets.
#![cfg(thiscpu_rseq)]

mod common;

use common::*;
use std::sync::{Arc, Barrier};
use thiscpu::{CpuNode, CpuSource, Registrar, RseqMode, Unavailable, topology, via};

#[test]
fn registrar_is_what_the_environment_provides() {
    let source = thiscpu::source();
    eprintln!("{source:?}");
    if let Some(expected) = expected_registrar_from_env() {
        assert_eq!(
            source.registrar.name(),
            expected,
            "THISCPU_EXPECT_REGISTRAR; source {source:?}"
        );
    }
    assert_eq!(
        source.registrar,
        registrar_from_environment(),
        "registrar vs the environment seen by the test; source {source:?}"
    );
    match source.registrar {
        Registrar::Glibc | Registrar::Thiscpu => assert_eq!(source.unavailable, None),
        Registrar::None => {
            let why = source.unavailable.expect("no registrar but no reason");
            if rseq_turned_off_by_env() {
                assert_eq!(why, Unavailable::TurnedOff);
            } else if !kernel_has_rseq() {
                assert_ne!(why, Unavailable::TurnedOff);
            }
        }
    }
}

#[test]
fn source_reports_the_kernel_and_glibc_as_they_are() {
    let source = thiscpu::source();
    // SAFETY: getauxval has no precondition; it returns 0 for absent entries.
    let feature_size = unsafe { libc::getauxval(27) } as u32;
    if source.registrar != Registrar::None || source.unavailable == Some(Unavailable::TurnedOff) {
        assert_eq!(source.kernel_feature_size, feature_size, "{source:?}");
    }
    assert_eq!(source.glibc_rseq_size, glibc_symbol::<u32>(c"__rseq_size"));
    assert_eq!(
        source.glibc_rseq_offset,
        glibc_symbol::<isize>(c"__rseq_offset")
    );
    assert_eq!(source.this_thread, expected_this_thread(&source));
    assert!(
        matches!(
            source.fallback,
            CpuSource::Rdpid | CpuSource::Vdso | CpuSource::Syscall
        ),
        "{source:?}"
    );
    // node_id (offset 20) and mm_cid (offset 24) are usable exactly when rseq is in use and the
    // kernel fills them (AT_RSEQ_FEATURE_SIZE covers them).
    let rseq = source.registrar != Registrar::None;
    assert_eq!(source.node_id, rseq && feature_size >= 24, "{source:?}");
    assert_eq!(source.mm_cid, rseq && feature_size >= 28, "{source:?}");
    assert_eq!(thiscpu::mm_cid().is_some(), source.mm_cid, "{source:?}");
    if rseq {
        assert!(source.usable_size >= 20, "{source:?}");
    }
}

/// `AT_RSEQ_FEATURE_SIZE` and `AT_RSEQ_ALIGN`, 0 before Linux 6.3.
fn kernel_rseq_auxv() -> (u32, u32) {
    // SAFETY: getauxval has no precondition; it returns 0 for absent entries.
    unsafe { (libc::getauxval(27) as u32, libc::getauxval(28) as u32) }
}

/// The signature glibc and thiscpu register with.
#[cfg(target_arch = "x86_64")]
const RSEQ_SIG: u32 = 0x5305_3053;
#[cfg(target_arch = "aarch64")]
const RSEQ_SIG: u32 = 0xd428_bc00;
#[cfg(target_arch = "riscv64")]
const RSEQ_SIG: u32 = 0xf140_1073;

/// What the kernel answers to registering the calling thread's area at `area_offset` again
/// with `len` bytes: `EBUSY` when that area is registered with exactly that length (and
/// signature), `EINVAL` when with another length. Neither answer touches the area.
fn reregister(area_offset: isize, len: u32) -> i32 {
    let area = thread_pointer().wrapping_add_signed(area_offset);
    // SAFETY: the area is registered already (the callers check that first), so the kernel
    // only compares address, length and signature and refuses; it writes nothing.
    let ret = unsafe { libc::syscall(libc::SYS_rseq, area, len, 0, RSEQ_SIG) };
    assert_ne!(
        ret, 0,
        "a second registration of a registered area succeeded"
    );
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// The registration length the areas thiscpu reads must have, worked out from the kernel's
/// auxiliary vector, glibc's `__rseq_size` and `THISCPU_RSEQ_AREA`: for thiscpu's own area the
/// feature size rounded up to the alignment when the feature size exceeds 32 and the 64
/// reserved bytes hold it, else 32; for glibc's, 32 or its `__rseq_size` when larger.
fn expected_registered_size(registrar: Registrar) -> u32 {
    match registrar {
        Registrar::None => 0,
        Registrar::Glibc => glibc_symbol::<u32>(c"__rseq_size").unwrap().max(32),
        Registrar::Thiscpu => {
            let legacy_asked = std::env::var("THISCPU_RSEQ_AREA").as_deref() == Ok("legacy");
            if legacy_asked {
                32
            } else {
                own_size_on_this_kernel()
            }
        }
    }
}

/// The feature size rounded up to the alignment when the feature size exceeds 32 and the 64
/// bytes thiscpu reserves hold it, else 32.
fn own_size_on_this_kernel() -> u32 {
    let (feature_size, align) = kernel_rseq_auxv();
    let rounded = u64::from(feature_size).div_ceil(u64::from(align.max(1))) * u64::from(align);
    let fits = align.is_power_of_two() && align <= 64 && rounded <= 64;
    if feature_size > 32 && fits {
        rounded as u32
    } else {
        32
    }
}

/// Checks the calling thread's registration: its length and mode as `source()` reports them,
/// and the length the kernel holds.
fn check_registration_length(who: &str) {
    let source = thiscpu::source();
    let (feature_size, align) = kernel_rseq_auxv();
    assert_eq!(source.kernel_align, align, "{who}: {source:?}");
    let expected = expected_registered_size(source.registrar);
    assert_eq!(source.registered_size, expected, "{who}: {source:?}");
    // The kernel's rule: longer than 32 and at least the feature size is optimized.
    let mode = match source.registrar {
        Registrar::None => None,
        _ if expected > 32 && expected >= feature_size => Some(RseqMode::Optimized),
        _ => Some(RseqMode::Legacy),
    };
    assert_eq!(source.mode, mode, "{who}: {source:?}");
    if feature_size == 33 && align == 64 && source.registrar == Registrar::Thiscpu {
        // Linux 7.2: 64 bytes unless legacy mode was asked for.
        assert!(matches!(source.registered_size, 32 | 64), "{who}");
    }
    let optimized = Some(own_size_on_this_kernel()).filter(|&size| size > 32);
    assert_eq!(source.optimized_size, optimized, "{who}: {source:?}");
    let Some(area_offset) = source.area_offset else {
        assert_eq!(source.registrar, Registrar::None, "{who}: {source:?}");
        return;
    };
    if source.this_thread == source.fallback {
        return; // This thread has no area of the registrar's (a foreign registration, say).
    }
    assert_eq!(
        reregister(area_offset, expected),
        libc::EBUSY,
        "{who}: the kernel holds another length than {expected}: {source:?}"
    );
    let other = if expected == 32 { 64 } else { 32 };
    assert_eq!(
        reregister(area_offset, other),
        libc::EINVAL,
        "{who}: the kernel accepted length {other} as the registered one: {source:?}"
    );
}

#[test]
fn registration_length_and_mode_follow_the_kernel() {
    check_registration_length("test thread");
    std::thread::spawn(|| check_registration_length("new thread"))
        .join()
        .expect("registration length in a new thread");
}

/// Set in the environment of the re-executed test binary that checks thiscpu's own
/// registration.
const OWN_REGISTRATION_CHILD: &str = "THISCPU_TEST_OWN_REGISTRATION";

/// thiscpu's own registration, whatever registers rseq in this process: the length check runs
/// again in child processes where glibc keeps out, with the kernel's choice and with
/// `THISCPU_RSEQ_AREA=legacy`.
#[test]
fn own_registration_length_follows_the_kernel_and_the_knob() {
    if std::env::var_os(OWN_REGISTRATION_CHILD).is_some() {
        let source = thiscpu::source();
        eprintln!("own registration: {source:?}");
        if !kernel_has_rseq() {
            return;
        }
        assert_eq!(source.registrar, Registrar::Thiscpu, "{source:?}");
        check_registration_length("own registration, test thread");
        std::thread::spawn(|| check_registration_length("own registration, new thread"))
            .join()
            .expect("own registration in a new thread");
        return;
    }
    let name = "own_registration_length_follows_the_kernel_and_the_knob";
    for area in ["", "legacy"] {
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(OWN_REGISTRATION_CHILD, "1")
            .env("GLIBC_TUNABLES", "glibc.pthread.rseq=0")
            .env("THISCPU_RSEQ_AREA", area)
            .env_remove("THISCPU_RSEQ")
            .env_remove("THISCPU_EXPECT_REGISTRAR")
            .output()
            .expect("re-run the test with thiscpu's own registration");
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success() && stdout.contains("1 passed"),
            "THISCPU_RSEQ_AREA={area:?}: {}\n{stdout}\n{stderr}",
            output.status
        );
        eprintln!("THISCPU_RSEQ_AREA={area:?}: {stderr}");
    }
}

/// The checks every thread must pass, whatever registers rseq, pinned to each allowed CPU.
fn check_thread(who: &str) {
    let source = thiscpu::source();
    assert_eq!(
        source.this_thread,
        expected_this_thread(&source),
        "{who}: {source:?}"
    );
    match source.registrar {
        Registrar::Glibc | Registrar::Thiscpu => assert_eq!(
            kernel_rseq_state(),
            KernelRseq::Registered,
            "{who}: rseq in use, but the kernel has no area registered for this thread"
        ),
        Registrar::None => {}
    }
    let _restore = AffinityGuard::new();
    for cpu in allowed_cpus() {
        pin(cpu);
        let node = topology::node_of_cpu(cpu).unwrap();
        assert_eq!(thiscpu::current_cpu(), cpu, "{who}: current_cpu() on {cpu}");
        assert_eq!(
            thiscpu::getcpu(),
            CpuNode { cpu, node },
            "{who}: getcpu() on {cpu}"
        );
        match source.registrar {
            // glibc's own area must say the same: that is the one thiscpu reads.
            Registrar::Glibc => assert_eq!(glibc_area_cpu_id(), Some(cpu as i32), "{who}"),
            // glibc must have kept out (its area says "registration failed or disabled").
            Registrar::Thiscpu => {
                if let Some(glibc) = glibc_area_cpu_id() {
                    assert!(glibc < 0, "{who}: glibc's area is live ({glibc}) too");
                }
            }
            Registrar::None => {}
        }
    }
}

#[test]
fn threads_started_before_and_after_first_use_all_work() {
    let _serial = serial();
    // `early` exists before this test's thread first asks anything, and asks only later.
    let go = Arc::new(Barrier::new(2));
    let early = {
        let go = Arc::clone(&go);
        std::thread::spawn(move || {
            go.wait();
            check_thread("thread started before first use");
        })
    };
    check_thread("test thread");
    go.wait();
    let late = std::thread::spawn(|| check_thread("thread started after first use"));
    early.join().expect("early thread");
    late.join().expect("late thread");
    // Threads that never ask thiscpu anything cost nothing and break nothing.
    std::thread::spawn(|| {}).join().unwrap();
    check_thread("test thread, again");
}

#[test]
fn short_lived_threads_leave_nothing_behind() {
    let _serial = serial();
    let cpus = allowed_cpus();
    let possible = topology::possible_cpus() as u32;
    // Hundreds of threads register (with thiscpu's own registration), answer, and exit, a few
    // at a time so that glibc reuses their stacks and static TLS for the next ones. An area
    // the kernel still wrote after its thread exited would land in a later thread's TLS.
    for batch in 0..50 {
        let threads: Vec<_> = (0..6)
            .map(|i| {
                let cpu = cpus[(batch * 6 + i) % cpus.len()];
                std::thread::spawn(move || {
                    let first = thiscpu::current_cpu();
                    assert!(first < possible, "first answer {first}");
                    pin(cpu);
                    assert_eq!(thiscpu::current_cpu(), cpu, "batch {batch} thread {i}");
                    assert_eq!(thiscpu::getcpu().cpu, cpu, "batch {batch} thread {i}");
                })
            })
            .collect();
        for thread in threads {
            thread.join().expect("a short-lived thread saw a wrong CPU");
        }
    }
    // Threads built on the recycled memory still start unregistered and register properly,
    // and so does every answer in this old thread.
    for round in 0..4 {
        std::thread::spawn(move || check_thread(&format!("thread {round} after the churn")))
            .join()
            .expect("thread after the churn");
    }
    check_thread("test thread after the churn");
}

/// An rseq area of another library's, in the calling thread's TLS.
#[repr(C, align(32))]
struct ForeignArea([i32; 8]);

thread_local! {
    static FOREIGN: std::cell::UnsafeCell<ForeignArea> =
        const { std::cell::UnsafeCell::new(ForeignArea([0, -1, 0, 0, 0, 0, 0, 0])) };
}

const FOREIGN_SIG: u32 = 0x5305_3053;

/// Registers (`flags` 0) or unregisters (1) the calling thread's foreign area; the errno on
/// failure.
fn foreign_rseq(flags: i32) -> Result<(), i32> {
    FOREIGN.with(|area| {
        // SAFETY: the area is this thread's, 32 bytes, 32-byte aligned, initialised as the
        // kernel requires, and lives until the thread exits.
        let ret = unsafe { libc::syscall(libc::SYS_rseq, area.get(), 32u32, flags, FOREIGN_SIG) };
        if ret == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
        }
    })
}

fn foreign_cpu_id() -> i32 {
    // SAFETY: reads `cpu_id`, an aligned 32-bit field of this thread's area, as one load.
    FOREIGN.with(|area| unsafe { (&raw const (*area.get()).0[1]).read_volatile() })
}

#[test]
fn a_thread_someone_else_registered_is_answered_and_left_alone() {
    let _serial = serial();
    let source = thiscpu::source();
    std::thread::spawn(move || {
        let registered = foreign_rseq(0);
        match source.registrar {
            // thiscpu does not register before this thread's first call, so another library
            // can; thiscpu must then answer through its fallback and leave that area alone.
            Registrar::Thiscpu => assert_eq!(registered, Ok(()), "register the foreign area"),
            // glibc registered this thread when it was created.
            Registrar::Glibc => {
                assert_eq!(
                    registered,
                    Err(libc::EINVAL),
                    "glibc's area was not registered"
                );
                return;
            }
            Registrar::None => {
                if registered.is_ok() {
                    assert_eq!(foreign_rseq(1), Ok(()));
                }
                return;
            }
        }
        let _restore = AffinityGuard::new();
        for cpu in allowed_cpus() {
            pin(cpu);
            let node = topology::node_of_cpu(cpu).unwrap();
            assert_eq!(thiscpu::current_cpu(), cpu, "current_cpu() on {cpu}");
            assert_eq!(
                thiscpu::getcpu(),
                CpuNode { cpu, node },
                "getcpu() on {cpu}"
            );
            assert_eq!(thiscpu::current_node(), node, "current_node() on {cpu}");
            assert_eq!(
                thiscpu::mm_cid(),
                None,
                "mm_cid() without thiscpu's own area"
            );
            // The kernel still updates the other library's area: its registration stands.
            assert_eq!(foreign_cpu_id(), cpu as i32, "the foreign area on {cpu}");
        }
        let now = thiscpu::source();
        assert_eq!(now.this_thread, now.fallback, "{now:?}");
        // Per-CPU data stays exact from such a thread too (it cannot run sections).
        let counter = thiscpu::Counter::new();
        for _ in 0..1000 {
            counter.inc();
        }
        assert_eq!(
            counter.sum(),
            1000,
            "Counter from a thread without thiscpu's area"
        );
        // thiscpu did not unregister it either: the owner can.
        assert_eq!(foreign_rseq(1), Ok(()), "unregister the foreign area");
        assert_eq!(kernel_rseq_state(), KernelRseq::NotRegistered);
    })
    .join()
    .expect("a thread registered by another library");
}

#[test]
fn rseq_refused_by_seccomp_falls_back() {
    if std::env::var_os(SECCOMP_CHILD).is_some() {
        // The re-executed binary: glibc's registration was refused before `main`, and so is
        // thiscpu's probe.
        let source = thiscpu::source();
        eprintln!("under seccomp: {source:?}");
        assert_eq!(source.registrar, Registrar::None, "{source:?}");
        assert_eq!(source.unavailable, Some(Unavailable::Refused(libc::EPERM)));
        assert_eq!(kernel_rseq_state(), KernelRseq::Refused(libc::EPERM));
        if let Some(glibc) = glibc_area_cpu_id() {
            assert!(
                glibc < 0,
                "glibc's area is live ({glibc}) although rseq is refused"
            );
        }
        check_thread("main thread under seccomp");
        std::thread::spawn(|| check_thread("new thread under seccomp"))
            .join()
            .expect("a thread under seccomp");
        return;
    }

    let stderr = rerun_under_seccomp(
        "rseq_refused_by_seccomp_falls_back",
        refuse_syscall_program(libc::SYS_rseq, libc::EPERM),
    );
    eprintln!("{stderr}");
}

/// Failures a forked child reports through its exit status, one bit each.
const CHILD_CPU: i32 = 1;
const CHILD_GETCPU: i32 = 2;
const CHILD_NODE: i32 = 4;
const CHILD_SYSCALL: i32 = 8;
const CHILD_MM_CID: i32 = 16;
const CHILD_PIN: i32 = 32;
const CHILD_UNPINNED: i32 = 64;

fn describe_child_failure(bits: i32) -> String {
    [
        (CHILD_CPU, "current_cpu() differs from the kernel"),
        (CHILD_GETCPU, "getcpu() differs from the kernel"),
        (CHILD_NODE, "current_node() differs from the kernel"),
        (CHILD_SYSCALL, "via::syscall() differs from the kernel"),
        (
            CHILD_MM_CID,
            "mm_cid() is not 0 in a single-threaded process",
        ),
        (CHILD_PIN, "sched_setaffinity failed"),
        (
            CHILD_UNPINNED,
            "an unpinned answer never agreed with the kernel",
        ),
    ]
    .iter()
    .filter(|(bit, _)| bits & bit != 0)
    .map(|(_, what)| *what)
    .collect::<Vec<_>>()
    .join("; ")
}

/// The forked child's work: no allocation, no panics, no locks; reports through `_exit`.
fn child(cpus: &[u32], masks: &[Mask], expect_mm_cid: bool) -> ! {
    let mut failed = 0;
    // Unpinned first (the child runs wherever the kernel put it): some try must agree.
    let mut agreed = false;
    for _ in 0..10 {
        let before = kernel_getcpu();
        let cpu = thiscpu::current_cpu();
        let here = thiscpu::getcpu();
        let after = kernel_getcpu();
        if before == after
            && cpu == before.0
            && here
                == (CpuNode {
                    cpu,
                    node: before.1,
                })
        {
            agreed = true;
            break;
        }
    }
    if !agreed {
        failed |= CHILD_UNPINNED;
    }
    for (&cpu, mask) in cpus.iter().zip(masks) {
        if set_affinity(0, mask).is_err() {
            failed |= CHILD_PIN;
            continue;
        }
        let (kernel_cpu, kernel_node) = kernel_getcpu();
        if thiscpu::current_cpu() != cpu || kernel_cpu != cpu {
            failed |= CHILD_CPU;
        }
        if thiscpu::getcpu()
            != (CpuNode {
                cpu,
                node: kernel_node,
            })
        {
            failed |= CHILD_GETCPU;
        }
        if thiscpu::current_node() != kernel_node {
            failed |= CHILD_NODE;
        }
        if via::syscall()
            != Some(CpuNode {
                cpu,
                node: kernel_node,
            })
        {
            failed |= CHILD_SYSCALL;
        }
        // The child has one thread: the kernel hands it concurrency id 0, on any CPU.
        if expect_mm_cid && thiscpu::mm_cid() != Some(0) {
            failed |= CHILD_MM_CID;
        }
    }
    // SAFETY: ends the child without running the parent's atexit handlers or destructors.
    unsafe { libc::_exit(failed) }
}

fn fork_and_check(who: &str) {
    let cpus = allowed_cpus();
    let masks: Vec<Mask> = cpus.iter().map(|&cpu| Mask::of(&[cpu])).collect();
    let expect_mm_cid = thiscpu::source().mm_cid;
    // SAFETY: the child only makes system calls and reads memory prepared above; it neither
    // allocates nor takes locks that another thread of the parent might hold.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        child(&cpus, &masks, expect_mm_cid);
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked; `status` is a valid out-pointer.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid, "waitpid: {}", std::io::Error::last_os_error());
    assert!(
        libc::WIFEXITED(status),
        "{who}: the child did not exit normally (status {status:#x})"
    );
    let bits = libc::WEXITSTATUS(status);
    assert_eq!(bits, 0, "{who}: {}", describe_child_failure(bits));
}

#[test]
fn forked_child_answers_for_itself() {
    let _serial = serial();
    // From a thread that already uses thiscpu: the child inherits its registration.
    let _ = thiscpu::current_cpu();
    fork_and_check("child of a thread that used thiscpu");
    // From a thread that never asked: the child starts unregistered (with thiscpu's own
    // registration) and registers on its first call.
    std::thread::spawn(|| fork_and_check("child of a thread that never used thiscpu"))
        .join()
        .expect("fork from a fresh thread");
    // And the parent is unaffected.
    check_thread("parent after fork");
}

/// Set in the environment of the re-executed test binary whose registrations the kernel
/// "accepts without a CPU" (fault injection).
#[cfg(thiscpu_inject)]
const NO_CPU_ID_CHILD: &str = "THISCPU_INJECT_NO_CPU_ID";

/// A registration the kernel accepts but that leaves `cpu_id` negative is withdrawn: the
/// process then has no rseq owner, and no thread may keep a registered area (it would run
/// sections with plain stores beside other threads' atomic adds).
#[cfg(thiscpu_inject)]
#[test]
fn a_registration_without_a_cpu_is_withdrawn() {
    if !kernel_has_rseq() {
        eprintln!("skipped: the kernel has no rseq");
        return;
    }
    if std::env::var_os(NO_CPU_ID_CHILD).is_some() {
        let source = thiscpu::source();
        eprintln!("without a CPU: {source:?}");
        assert_eq!(source.registrar, Registrar::None, "{source:?}");
        assert_eq!(source.unavailable, Some(Unavailable::NoCpuId), "{source:?}");
        // The decision ran on the main thread, before `main`; tests run on threads of their own.
        assert_eq!(
            main_thread_rseq_state(),
            KernelRseq::NotRegistered,
            "the thread that made the decision kept a registered area"
        );
        let check = |who: &str| {
            let counter = thiscpu::Counter::new();
            for _ in 0..1000 {
                counter.inc();
            }
            assert_eq!(counter.sum(), 1000, "{who}");
            assert!(thiscpu::ops::position().is_none(), "{who} has a position");
            assert_eq!(
                kernel_rseq_state(),
                KernelRseq::NotRegistered,
                "{who} kept a registered area"
            );
        };
        check("the test's thread");
        std::thread::spawn(move || check("a new thread"))
            .join()
            .expect("a new thread");
        return;
    }
    let name = "a_registration_without_a_cpu_is_withdrawn";
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(NO_CPU_ID_CHILD, "1")
        .env("GLIBC_TUNABLES", "glibc.pthread.rseq=0")
        .env_remove("THISCPU_RSEQ")
        .env_remove("THISCPU_EXPECT_REGISTRAR")
        .output()
        .expect("re-run the test");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "without a CPU: {}\n{stdout}\n{stderr}",
        output.status
    );
    eprintln!("{stderr}");
}

/// `kernel_rseq_state()` of the process's main thread, asked from a signal handler run there.
#[cfg(thiscpu_inject)]
fn main_thread_rseq_state() -> KernelRseq {
    use std::sync::atomic::{AtomicI32, Ordering};
    const UNANSWERED: i32 = i32::MIN;
    static STATE: AtomicI32 = AtomicI32::new(UNANSWERED);
    extern "C" fn on_signal(_: libc::c_int) {
        let code = match kernel_rseq_state() {
            KernelRseq::NotRegistered => 0,
            KernelRseq::Registered => 1,
            KernelRseq::NoSyscall => 2,
            KernelRseq::Refused(errno) => -errno.max(1),
        };
        STATE.store(code, Ordering::Release);
    }
    // SAFETY: installs a handler that makes two system calls and an atomic store, then sends
    // the signal to the main thread (whose id is the process id).
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
        action.sa_flags = libc::SA_RESTART;
        assert_eq!(
            libc::sigaction(libc::SIGUSR2, &action, std::ptr::null_mut()),
            0
        );
        let pid = libc::getpid();
        assert_eq!(libc::syscall(libc::SYS_tgkill, pid, pid, libc::SIGUSR2), 0);
    }
    let start = std::time::Instant::now();
    loop {
        match STATE.load(Ordering::Acquire) {
            UNANSWERED if start.elapsed() < std::time::Duration::from_secs(10) => {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            UNANSWERED => panic!("the main thread did not handle the signal"),
            0 => return KernelRseq::NotRegistered,
            1 => return KernelRseq::Registered,
            2 => return KernelRseq::NoSyscall,
            code => return KernelRseq::Refused(-code),
        }
    }
}

/// Runs the test `name` of this binary again in a child process with `env` set (and glibc's
/// registration off when `tunables` says so), and fails unless the child passed it within a
/// minute: the child side of a test checks a state that only a fresh process can be in.
#[cfg(thiscpu_inject)]
fn rerun_in_child(name: &str, env: &[(&str, &str)], tunables: Option<&str>) {
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    command
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env_remove("THISCPU_RSEQ")
        .env_remove("THISCPU_EXPECT_REGISTRAR")
        .env_remove("GLIBC_TUNABLES")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    command.envs(env.iter().copied());
    if let Some(tunables) = tunables {
        command.env("GLIBC_TUNABLES", tunables);
    }
    let mut child = command.spawn().expect("re-run the test");
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the child") {
            break status;
        }
        if start.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{name} {tunables:?}: the child hung");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let output = child.wait_with_output().expect("the child's output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        status.success() && stdout.contains("1 passed"),
        "{name} {tunables:?}: {status}\n{stdout}\n{stderr}"
    );
    eprint!("{stderr}");
}

/// Set in the environment of the re-executed test binary: the decision waits for first use and
/// raises this signal on the deciding thread halfway through (fault injection).
#[cfg(thiscpu_inject)]
const SIGNAL_IN_DECISION: &str = "THISCPU_INJECT_SIGNAL_IN_DECISION";

/// A signal handler that uses thiscpu, run on the thread making the process-wide decision while
/// it makes it: the handler's calls fall back instead of waiting for their own thread, and the
/// decision then completes. With glibc's registration and with thiscpu's own.
#[cfg(thiscpu_inject)]
#[test]
fn a_signal_handler_during_the_decision_falls_back() {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
    static COUNTER: OnceLock<thiscpu::Counter> = OnceLock::new();
    static HANDLED: AtomicU32 = AtomicU32::new(0);
    static WRONG_CPU: AtomicU64 = AtomicU64::new(0);
    extern "C" fn on_signal(_: libc::c_int) {
        let possible = topology::possible_cpus() as u32;
        let cpu = thiscpu::current_cpu();
        let here = thiscpu::getcpu();
        if cpu >= possible || here.cpu >= possible {
            WRONG_CPU.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(counter) = COUNTER.get() {
            counter.add(5);
        }
        HANDLED.fetch_add(1, Ordering::Relaxed);
    }

    if std::env::var_os(SIGNAL_IN_DECISION).is_some() {
        // Nothing asked thiscpu anything yet (the decision was deferred): the topology and the
        // counter do not need the decision.
        let _ = topology::possible_cpus();
        COUNTER.set(thiscpu::Counter::new()).ok().unwrap();
        // SAFETY: installs a handler that only calls thiscpu's async-signal-safe functions and
        // updates atomics.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            assert_eq!(
                libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut()),
                0
            );
        }
        let source = thiscpu::source();
        eprintln!("after a signal during the decision: {source:?}");
        assert_eq!(HANDLED.load(Ordering::Relaxed), 1, "the handler ran once");
        assert_eq!(WRONG_CPU.load(Ordering::Relaxed), 0);
        assert_eq!(source.registrar, registrar_from_environment(), "{source:?}");
        let counter = COUNTER.get().unwrap();
        counter.add(1);
        assert_eq!(counter.sum(), 6);
        check_thread("the deciding thread, after the decision");
        return;
    }
    let signal = libc::SIGUSR1.to_string();
    for tunables in [None, Some("glibc.pthread.rseq=0")] {
        rerun_in_child(
            "a_signal_handler_during_the_decision_falls_back",
            &[(SIGNAL_IN_DECISION, &signal)],
            tunables,
        );
    }
}

/// Set in the environment of the re-executed test binary by the fork test below.
#[cfg(thiscpu_inject)]
const FORK_IN_DECISION: &str = "THISCPU_TEST_FORK_IN_DECISION";

/// A process forked while the decision is being made: the child has no deciding thread, and
/// its first call must decide again instead of waiting for a thread that does not exist there.
/// The fork comes from a signal handler raised halfway through the decision (fault injection).
#[cfg(thiscpu_inject)]
#[test]
fn a_child_forked_during_the_decision_decides_on_its_own() {
    use std::sync::atomic::{AtomicI32, Ordering};
    /// The child's exit status as the handler saw it: 0 answered, 1 wrong answer, 2 hung.
    static CHILD: AtomicI32 = AtomicI32::new(-1);
    extern "C" fn on_signal(_: libc::c_int) {
        // SAFETY: fork in a single point of the test process; the child only calls thiscpu
        // and `_exit`, the parent only waits for it.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // `source()` asks for the decision itself (the CPU-id fast path would not). With
            // thiscpu's own registration the child's thread inherited the registration the
            // parent's decision made: deciding again must keep it, not read the kernel's
            // "already registered" as someone else's area.
            let possible = topology::possible_cpus() as u32;
            let source = thiscpu::source();
            let ok = source.registrar == registrar_from_environment()
                && source.unavailable.is_none()
                && source.this_thread == expected_this_thread(&source)
                && thiscpu::getcpu().cpu < possible;
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        for _ in 0..500 {
            // SAFETY: waits for our own child without blocking.
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                CHILD.store(libc::WEXITSTATUS(status), Ordering::Relaxed);
                return;
            }
            // SAFETY: a plain sleep.
            unsafe { libc::usleep(20_000) };
        }
        // SAFETY: ends and reaps the hung child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, &mut status, 0);
        }
        CHILD.store(2, Ordering::Relaxed);
    }

    if std::env::var_os(FORK_IN_DECISION).is_some() {
        // SAFETY: installs a handler that forks and waits, as above.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            assert_eq!(
                libc::sigaction(libc::SIGUSR2, &action, std::ptr::null_mut()),
                0
            );
        }
        let _ = thiscpu::source();
        assert_eq!(
            CHILD.load(Ordering::Relaxed),
            0,
            "the child forked during the decision (0 answered, 1 wrong CPU, 2 hung)"
        );
        return;
    }
    let signal = libc::SIGUSR2.to_string();
    for tunables in [None, Some("glibc.pthread.rseq=0")] {
        rerun_in_child(
            "a_child_forked_during_the_decision_decides_on_its_own",
            &[(FORK_IN_DECISION, "1"), (SIGNAL_IN_DECISION, &signal)],
            tunables,
        );
    }
}

/// Set in the environment of the re-executed test binary: the first decision panics halfway
/// through, after registering its thread (fault injection).
#[cfg(thiscpu_inject)]
const PANIC_IN_DECISION: &str = "THISCPU_INJECT_PANIC_IN_DECISION";

/// A decision that unwinds after registering its thread's own area hands the decision back;
/// the next call decides again on a thread that is registered already, and must keep that
/// registration (not rewrite a live area, not read the kernel's "busy" as someone else's).
#[cfg(thiscpu_inject)]
#[test]
fn a_decision_that_panics_is_made_again_on_its_registered_thread() {
    if std::env::var_os(PANIC_IN_DECISION).is_some() {
        let first = std::panic::catch_unwind(thiscpu::source);
        assert!(first.is_err(), "the injected panic did not happen");
        let source = thiscpu::source();
        eprintln!("after a decision that panicked: {source:?}");
        assert_eq!(source.registrar, registrar_from_environment(), "{source:?}");
        assert_eq!(source.unavailable, None, "{source:?}");
        check_thread("the thread whose first decision panicked");
        let counter = thiscpu::Counter::new();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| (0..10_000).for_each(|_| counter.inc()));
            }
        });
        assert_eq!(counter.sum(), 40_000);
        return;
    }
    for tunables in [None, Some("glibc.pthread.rseq=0")] {
        rerun_in_child(
            "a_decision_that_panics_is_made_again_on_its_registered_thread",
            &[(PANIC_IN_DECISION, "1")],
            tunables,
        );
    }
}

/// Set in the environment of the re-executed test binary: the decision waits for first use.
#[cfg(thiscpu_inject)]
const DEFER_DECISION: &str = "THISCPU_INJECT_DEFER_DECISION";

/// Set in the environment of the re-executed test binary: the decision sleeps this many
/// milliseconds halfway, so that the other threads race it.
#[cfg(thiscpu_inject)]
const DELAY_IN_DECISION: &str = "THISCPU_INJECT_DELAY_IN_DECISION";

/// Threads that start together before anything is decided, each making the first call of the
/// process (a by-`mm_cid` counter, an adder, `mm_cid()`) while the decision takes 50 ms: one
/// decides, the others wait for it, and every counter and adder adds under one spread for its
/// whole life, the one the decision allows, so no increment is lost. With glibc's registration
/// and with thiscpu's own.
#[cfg(thiscpu_inject)]
#[test]
fn threads_racing_the_decision_count_exactly_by_mm_cid() {
    use std::sync::OnceLock;
    const ADDS: u64 = 20_000;
    if std::env::var_os(DEFER_DECISION).is_some() {
        let threads = 2 * topology::possible_cpus().max(2);
        let start = Barrier::new(threads);
        let shared: OnceLock<thiscpu::Counter<thiscpu::ByMmCid>> = OnceLock::new();
        std::thread::scope(|s| {
            for t in 0..threads {
                let (start, shared) = (&start, &shared);
                s.spawn(move || {
                    start.wait();
                    match t % 3 {
                        0 => {
                            let _ = thiscpu::mm_cid();
                        }
                        1 => {
                            let _ = thiscpu::current_cpu();
                        }
                        _ => {}
                    }
                    let counter = shared.get_or_init(thiscpu::Counter::by_mm_cid);
                    let adder = counter.adder();
                    for i in 0..ADDS {
                        if i % 2 == 0 {
                            counter.inc();
                        } else {
                            adder.inc();
                        }
                    }
                });
            }
        });
        let source = thiscpu::source();
        let counter = shared.get().unwrap();
        assert_eq!(counter.sum(), threads as u64 * ADDS, "{source:?}");
        assert_eq!(counter.indexed_by_mm_cid(), source.mm_cid, "{source:?}");
        assert_eq!(source.registrar, registrar_from_environment(), "{source:?}");
        eprintln!(
            "{threads} threads raced the decision; by mm_cid: {}",
            counter.indexed_by_mm_cid()
        );
        return;
    }
    for tunables in [None, Some("glibc.pthread.rseq=0")] {
        rerun_in_child(
            "threads_racing_the_decision_count_exactly_by_mm_cid",
            &[(DEFER_DECISION, "1"), (DELAY_IN_DECISION, "50")],
            tunables,
        );
    }
}
