//! A thread that a debugger single-steps is stopped after every instruction, and the kernel
//! aborts any restartable sequence it was in when it resumes: without a bound on consecutive
//! aborts, such a thread would retry its section forever. A forked child is single-stepped with
//! `ptrace(PTRACE_SINGLESTEP)` through each of thiscpu's operations, from the stop before it to
//! the stop after it, and each must end within a fixed number of steps, by its fallback path.
//!
//! Built where thiscpu has restartable sequences (`thiscpu_rseq`, set by the build script),
//! whose aborts the bound is for; the other Linux architectures are tested under qemu-user,
//! which has no `ptrace`. Not under the model checker, whose sections a debugger cannot see.
#![cfg(all(thiscpu_rseq, not(thiscpu_model)))]

use std::alloc::{GlobalAlloc, Layout};
use std::time::{Duration, Instant};
use thiscpu::{Counter, PerCpuAlloc, Pool, Sharded, ops};

/// The operations the child runs, each between two stops, in this order.
const OPERATIONS: [&str; 6] = [
    "Counter::inc",
    "Adder::inc",
    "Sharded::with_current",
    "Pool::get and put",
    "getcpu",
    "PerCpuAlloc alloc and dealloc",
];
const GETCPU: usize = 4;

/// The layout the child allocates from a `PerCpuAlloc` (a cached size class).
const ALLOCATED: Layout = match Layout::from_size_align(64, 8) {
    Ok(layout) => layout,
    Err(_) => panic!("a valid layout"),
};

/// Steps one operation may take, stop to stop. The most any took with the bound on
/// consecutive aborts was about 27,000 (`Pool` get and put, two sections, aarch64 debug
/// build; 20,830 on x86_64); `PerCpuAlloc`'s alloc and dealloc, two sections and two calls
/// into `malloc`, took 20,177 on x86_64. Fixed, not derived from `ops::ABORT_LIMIT`: an operation whose retries are not
/// bounded must fail here rather than be stepped for ever.
const MAX_STEPS: u64 = 100_000;

/// Wall time for all of the stepping: a failure, not a hang, where steps stop coming back.
/// Far above what the bounded operations need: about 61,000 steps in all on x86_64, 1.1-1.4 s
/// native. Before the allocator's operation was added (a third of the steps now), the rest
/// took 15 s in an emulated x86_64 guest and 50-80 s in an emulated arm64 guest (800-1,300
/// steps a second, under a runner that allows 300 s per test executable).
const MAX_TIME: Duration = Duration::from_secs(240);

/// Failures the child reports, one bit each.
const WRONG_COUNT: u64 = 1;
const WRONG_POOL: u64 = 2;
const WRONG_SHARD: u64 = 4;
const WRONG_CPU: u64 = 8;
const WRONG_ALLOCATION: u64 = 16;

fn describe(bits: u64) -> String {
    [
        (WRONG_COUNT, "the counter's sum is wrong"),
        (WRONG_POOL, "the pool handed out a wrong object"),
        (WRONG_SHARD, "the shard holds a wrong value"),
        (
            WRONG_CPU,
            "getcpu named another CPU than the one the child is pinned to",
        ),
        (
            WRONG_ALLOCATION,
            "the allocator returned null or an object that did not keep its bytes",
        ),
    ]
    .iter()
    .filter(|(bit, _)| bits & bit != 0)
    .map(|(_, what)| *what)
    .collect::<Vec<_>>()
    .join("; ")
}

/// What the child sends back through the pipe: its failure bits, then how many calls took the
/// fallback path after `ops::ABORT_LIMIT` aborts in a row, per operation.
type Report = [u64; 1 + OPERATIONS.len()];

/// Stops the calling (traced) process: the parent single-steps from here to the next stop.
fn stop() {
    // SAFETY: a plain system call.
    unsafe { libc::raise(libc::SIGSTOP) };
}

/// The traced child: stops itself before each operation and once after the last, then checks
/// the results at full speed and writes its report to `report_fd`. Only calls what is safe
/// after `fork` in a multithreaded process (the objects are this test's, so no lock of theirs
/// is held by another thread).
fn child(
    counter: &Counter,
    sharded: &Sharded<u64>,
    pool: &Pool<u64>,
    allocator: &PerCpuAlloc,
    cpu: u32,
    report_fd: libc::c_int,
) -> ! {
    let adder = counter.adder();
    // SAFETY: a plain system call; the parent is the tracer and waits for the stop.
    unsafe { libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0) };
    let mut fallbacks = [0u64; OPERATIONS.len() + 1];
    fallbacks[0] = ops::abort_fallbacks();
    stop();
    counter.inc();
    fallbacks[1] = ops::abort_fallbacks();
    stop();
    adder.inc();
    fallbacks[2] = ops::abort_fallbacks();
    stop();
    sharded.with_current(|shard| *shard += 1);
    fallbacks[3] = ops::abort_fallbacks();
    stop();
    let object = pool.get();
    let pooled = *object;
    drop(object);
    fallbacks[4] = ops::abort_fallbacks();
    stop();
    let here = thiscpu::getcpu();
    fallbacks[5] = ops::abort_fallbacks();
    stop();
    // SAFETY: a non-zero layout; the object is written within its size and freed with it.
    let allocated = unsafe {
        let object = allocator.alloc(ALLOCATED);
        let whole = !object.is_null() && {
            object.write_bytes(0x5a, ALLOCATED.size());
            (0..ALLOCATED.size()).all(|i| object.add(i).read() == 0x5a)
        };
        if !object.is_null() {
            allocator.dealloc(object, ALLOCATED);
        }
        whole
    };
    fallbacks[6] = ops::abort_fallbacks();
    stop();
    let mut report: Report = [0; 1 + OPERATIONS.len()];
    if counter.sum() != 2 {
        report[0] |= WRONG_COUNT;
    }
    if pooled != 7 {
        report[0] |= WRONG_POOL;
    }
    if sharded.fold(0, |sum, shard| sum + shard) != 1 {
        report[0] |= WRONG_SHARD;
    }
    if here.cpu != cpu {
        report[0] |= WRONG_CPU;
    }
    if !allocated {
        report[0] |= WRONG_ALLOCATION;
    }
    for (n, pair) in fallbacks.windows(2).enumerate() {
        report[1 + n] = pair[1] - pair[0];
    }
    // SAFETY: writes the report from a live local; `_exit` ends the child without running the
    // parent's atexit handlers or destructors.
    unsafe {
        libc::write(
            report_fd,
            report.as_ptr().cast(),
            core::mem::size_of_val(&report),
        );
        libc::_exit(0)
    }
}

/// Waits for the traced child's next stop or exit.
fn wait(pid: libc::pid_t) -> i32 {
    let mut status = 0;
    // SAFETY: waits for our own child.
    let ret = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(ret, pid, "waitpid: {}", std::io::Error::last_os_error());
    status
}

/// Kills and reaps the child, then fails the test with `why`.
fn give_up(pid: libc::pid_t, why: String) -> ! {
    // SAFETY: kills and reaps our own child.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
    panic!("{why}");
}

#[test]
#[cfg_attr(
    target_arch = "riscv64",
    ignore = "riscv64 Linux has no PTRACE_SINGLESTEP: see single_stepping_is_refused_on_riscv64"
)]
fn single_stepped_operations_finish_in_bounded_steps() {
    // Parent and child on one CPU: each step hands the CPU from one to the other, with no
    // wake-up of another CPU (the slowest part of a step in an emulated guest), and getcpu's
    // answer is known.
    let cpu = thiscpu::current_cpu();
    let _pinned = thiscpu::topology::pin_to(cpu).expect("pin to the current CPU");
    let counter = Counter::new();
    let sharded = Sharded::new(|_| 0u64);
    let pool = Pool::with_capacity(4, || 7u64);
    drop(pool.get());
    // Made and used once on this CPU: its caches exist and hold an object of the child's class.
    let allocator = PerCpuAlloc::new();
    // SAFETY: a non-zero layout; the object is freed with it.
    unsafe {
        let object = allocator.alloc(ALLOCATED);
        assert!(!object.is_null());
        allocator.dealloc(object, ALLOCATED);
    }
    // Registers this thread (the child inherits its area) and makes every process-wide choice
    // before the fork.
    let source = thiscpu::source();
    let rseq = ops::position().is_some();
    eprintln!("{source:?}");
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe");

    // SAFETY: the child only runs `child`, which ends in `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        child(&counter, &sharded, &pool, &allocator, cpu, fds[1]);
    }
    // SAFETY: the parent's copy of the write end, which it does not use.
    unsafe { libc::close(fds[1]) };

    let stopped = |status: i32| libc::WIFSTOPPED(status) && libc::WSTOPSIG(status) == libc::SIGSTOP;
    let status = wait(pid);
    assert!(
        stopped(status),
        "the child did not stop itself: status {status:#x}"
    );
    let start = Instant::now();
    let mut steps_of = [0u64; OPERATIONS.len()];
    for (n, operation) in OPERATIONS.into_iter().enumerate() {
        loop {
            let steps = steps_of[n];
            if steps == MAX_STEPS {
                give_up(
                    pid,
                    format!(
                        "single-stepped, {operation} did not finish within {MAX_STEPS} steps: \
                         its retries are not bounded (steps so far: {steps_of:?})"
                    ),
                );
            }
            if start.elapsed() > MAX_TIME {
                give_up(
                    pid,
                    format!(
                        "single-stepping took longer than {MAX_TIME:?}, {steps} steps into \
                         {operation} (steps so far: {steps_of:?})"
                    ),
                );
            }
            // SAFETY: single-steps our own traced, stopped child (suppressing a SIGSTOP it
            // raised).
            let ret = unsafe { libc::ptrace(libc::PTRACE_SINGLESTEP, pid, 0, 0) };
            assert_eq!(
                ret,
                0,
                "PTRACE_SINGLESTEP: {}",
                std::io::Error::last_os_error()
            );
            steps_of[n] += 1;
            let status = wait(pid);
            if stopped(status) {
                break;
            }
            if !(libc::WIFSTOPPED(status) && libc::WSTOPSIG(status) == libc::SIGTRAP) {
                give_up(
                    pid,
                    format!(
                        "{operation}: the child stopped for something else than a step: {status:#x}"
                    ),
                );
            }
        }
        eprintln!(
            "single-stepped, {operation} finished in {} steps",
            steps_of[n]
        );
    }
    eprintln!(
        "{} steps in {:?} ({:.0} a second)",
        steps_of.iter().sum::<u64>(),
        start.elapsed(),
        steps_of.iter().sum::<u64>() as f64 / start.elapsed().as_secs_f64()
    );
    // SAFETY: lets our own traced child run its checks.
    let ret = unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, 0) };
    assert_eq!(ret, 0, "PTRACE_CONT: {}", std::io::Error::last_os_error());
    let status = wait(pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child did not exit cleanly: status {status:#x}"
    );
    let mut report: Report = [0; 1 + OPERATIONS.len()];
    // SAFETY: reads at most the report's size into it, from our end of the pipe.
    let read = unsafe {
        libc::read(
            fds[0],
            report.as_mut_ptr().cast(),
            core::mem::size_of_val(&report),
        )
    };
    // SAFETY: our end of the pipe, no longer used.
    unsafe { libc::close(fds[0]) };
    assert_eq!(
        read as usize,
        core::mem::size_of_val(&report),
        "the child's report"
    );
    assert_eq!(report[0], 0, "{}", describe(report[0]));
    let fallbacks = &report[1..];
    eprintln!(
        "fallbacks after {} aborts in a row: {fallbacks:?}",
        ops::ABORT_LIMIT
    );
    // Every step aborts the section it lands in, so with rseq each operation that runs one must
    // have ended by its fallback; getcpu runs one only where `node_id` is kept current.
    for (n, operation) in OPERATIONS.into_iter().enumerate() {
        let runs_a_section = rseq && (n != GETCPU || source.node_id);
        assert!(
            !runs_a_section || fallbacks[n] > 0,
            "{operation} took no fallback, yet every section it ran was aborted: {fallbacks:?}"
        );
    }
}

/// riscv64 Linux has no hardware single-step for user space (`arch_has_single_step()` is false
/// there, so `ptrace` refuses `PTRACE_SINGLESTEP` with `EIO`), and the stepping test above cannot
/// run there. This fails once a kernel offers it, so that the stepping test is turned on.
#[cfg(target_arch = "riscv64")]
#[test]
fn single_stepping_is_refused_on_riscv64() {
    // SAFETY: the child only stops itself and exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: plain system calls in the child, which then leaves without unwinding.
        unsafe {
            libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0);
            libc::raise(libc::SIGSTOP);
            libc::_exit(0);
        }
    }
    let status = wait(pid);
    assert!(
        libc::WIFSTOPPED(status),
        "the child did not stop itself: status {status:#x}"
    );
    // SAFETY: asks to single-step our own traced, stopped child.
    let ret = unsafe { libc::ptrace(libc::PTRACE_SINGLESTEP, pid, 0, 0) };
    let error = std::io::Error::last_os_error();
    // SAFETY: ends our own child, stopped or stepping.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
    assert_eq!(
        (ret, error.raw_os_error()),
        (-1, Some(libc::EIO)),
        "PTRACE_SINGLESTEP was not refused ({error}): enable the stepping test on riscv64"
    );
}

/// The abort signature, as the kernel reads it before an abort address: glibc's, librseq's and
/// the kernel selftests' value for this architecture.
#[cfg(all(thiscpu_rseq, target_arch = "x86_64"))]
const RSEQ_SIG: u32 = 0x5305_3053;
#[cfg(all(thiscpu_rseq, target_arch = "aarch64"))]
const RSEQ_SIG: u32 = u32::from_le(0xd428_bc00);
#[cfg(all(thiscpu_rseq, target_arch = "riscv64"))]
const RSEQ_SIG: u32 = 0xf140_1073;

// Start and end of the sections, defined by the linker (the names are C identifiers). The
// tables exist where thiscpu has restartable sequences (`thiscpu_rseq`, from its build script):
// the portable path emits no section for a debugger to find.
#[cfg(thiscpu_rseq)]
unsafe extern "C" {
    static __start___rseq_cs: u8;
    static __stop___rseq_cs: u8;
    static __start___rseq_cs_ptr_array: u8;
    static __stop___rseq_cs_ptr_array: u8;
    static __start___rseq_exit_point_array: u8;
    static __stop___rseq_exit_point_array: u8;
}

/// The words of a table, from the linker's start and stop symbols.
#[cfg(thiscpu_rseq)]
fn table(start: *const u8, stop: *const u8) -> &'static [u64] {
    assert_eq!(
        start as usize % 8,
        0,
        "a table of 8-byte words at {start:?}"
    );
    let words = (stop as usize - start as usize) / 8;
    // SAFETY: the linker's bounds of a section of the program, which is mapped for the
    // process's lifetime and only read here; aligned (checked).
    unsafe { core::slice::from_raw_parts(start.cast(), words) }
}

/// What a debugger reads to find the restartable sequences, as librseq lays it out: in
/// `__rseq_cs_ptr_array`, the address of every section's descriptor; in
/// `__rseq_exit_point_array`, every early exit as (section start, exit address). Both are in
/// the program (no code refers to them, and the linker would drop them otherwise), aligned to
/// 8, list every descriptor of `__rseq_cs`, and each entry is one the kernel would accept.
#[cfg(thiscpu_rseq)]
#[test]
fn the_debuggers_tables_list_every_section_well_formed() {
    // Only the addresses of the linker's symbols are taken.
    let (cs_start, cs_stop, pointers, exits) = {
        (
            &raw const __start___rseq_cs as usize,
            &raw const __stop___rseq_cs as usize,
            table(
                &raw const __start___rseq_cs_ptr_array,
                &raw const __stop___rseq_cs_ptr_array,
            ),
            table(
                &raw const __start___rseq_exit_point_array,
                &raw const __stop___rseq_exit_point_array,
            ),
        )
    };
    let descriptors = (cs_stop - cs_start) / size_of::<thiscpu::abi::RseqCs>();
    assert!(descriptors > 0, "no descriptor in __rseq_cs");
    assert_eq!(
        pointers.len(),
        descriptors,
        "__rseq_cs_ptr_array lists each of the {descriptors} descriptors once"
    );
    let mut sections = Vec::new();
    for &address in pointers {
        let address = address as usize;
        assert!(
            (cs_start..cs_stop).contains(&address) && address.is_multiple_of(32),
            "{address:#x} is not an aligned descriptor in __rseq_cs ({cs_start:#x}..{cs_stop:#x})"
        );
        // SAFETY: an aligned address inside `__rseq_cs`, which holds only descriptors.
        let cs = unsafe { &*(address as *const thiscpu::abi::RseqCs) };
        let section = cs.start_ip..cs.start_ip + cs.post_commit_offset;
        assert_eq!((cs.version, cs.flags), (0, 0), "descriptor at {address:#x}");
        assert!(
            (1..256).contains(&cs.post_commit_offset) && !section.contains(&cs.abort_ip),
            "descriptor at {address:#x}: section {section:#x?}, abort at {:#x}",
            cs.abort_ip
        );
        // SAFETY: the four bytes before an abort address are the signature the section's
        // assembly placed there, in an executable (readable) section.
        let signature = unsafe { ((cs.abort_ip - 4) as *const u32).read_unaligned() };
        assert_eq!(
            signature, RSEQ_SIG,
            "before the abort address {:#x}",
            cs.abort_ip
        );
        sections.push(section);
    }
    assert_eq!(exits.len() % 2, 0, "exit points are pairs of words");
    for pair in exits.chunks(2) {
        let (start, exit) = (pair[0], pair[1]);
        let section = sections
            .iter()
            .find(|section| section.start == start)
            .unwrap_or_else(|| panic!("exit point from {start:#x}, where no section starts"));
        assert!(
            !section.contains(&exit),
            "exit point {exit:#x} inside its section {section:#x?}"
        );
    }
    eprintln!("{descriptors} sections, {} exit points", exits.len() / 2);
}
