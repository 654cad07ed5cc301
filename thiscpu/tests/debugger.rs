//! A thread that a debugger single-steps is stopped after every instruction, and the kernel
//! aborts any restartable sequence it was in when it resumes: without a bound on consecutive
//! aborts, such a thread would retry its section forever. A forked child is single-stepped with
//! `ptrace(PTRACE_SINGLESTEP)` through each of thiscpu's operations and must finish them.

use std::time::{Duration, Instant};
use thiscpu::{Counter, Histogram, Pool, Sharded, ops};

/// Failures the child reports through its exit status, one bit each.
const WRONG_COUNT: i32 = 1;
const WRONG_POOL: i32 = 2;
const WRONG_HISTOGRAM: i32 = 4;
const WRONG_SHARD: i32 = 8;
const NO_FALLBACK: i32 = 16;

fn describe(bits: i32) -> String {
    [
        (WRONG_COUNT, "the counter's sum is wrong"),
        (WRONG_POOL, "the pool handed out a wrong object"),
        (WRONG_HISTOGRAM, "the histogram's count is wrong"),
        (WRONG_SHARD, "the shard holds a wrong value"),
        (
            NO_FALLBACK,
            "no call took the fallback path, yet every section aborts",
        ),
    ]
    .iter()
    .filter(|(bit, _)| bits & bit != 0)
    .map(|(_, what)| *what)
    .collect::<Vec<_>>()
    .join("; ")
}

/// The operations the parent single-steps, one each, in this order.
const OPERATIONS: [&str; 5] = [
    "Counter::inc",
    "getcpu",
    "Pool::get and put",
    "Histogram::observe",
    "Sharded::lock_current",
];

/// Single-stepping time after which the remaining operations run at full speed. The first
/// operation is always stepped to its end; an emulated guest (TCG) takes a few hundred steps a
/// second, too few to step all of them (about 50,000 steps in a debug build) within seconds.
const STEPPING_BUDGET: Duration = Duration::from_secs(3);

/// Stops the calling (traced) process: the parent single-steps from here to the next stop.
fn stop() {
    // SAFETY: a plain system call.
    unsafe { libc::raise(libc::SIGSTOP) };
}

/// The traced child: stops itself before each operation and once after the last, then checks
/// the results at full speed. Only calls what is safe after `fork` in a multithreaded process
/// (the objects are this test's, so no lock of theirs is held by another thread).
fn child(
    counter: &Counter,
    pool: &Pool<u64>,
    histogram: &Histogram,
    sharded: &Sharded<u64>,
    rseq: bool,
) -> ! {
    // SAFETY: a plain system call; the parent is the tracer and waits for the stop.
    unsafe { libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0) };
    let fallbacks = ops::abort_fallbacks();
    stop();
    counter.inc();
    stop();
    let _ = thiscpu::getcpu();
    stop();
    let object = pool.get();
    let pooled = *object;
    drop(object);
    stop();
    histogram.observe(1.0);
    stop();
    *sharded.lock_current() += 1;
    stop();
    let mut failed = 0;
    if counter.sum() != 1 {
        failed |= WRONG_COUNT;
    }
    if pooled != 7 {
        failed |= WRONG_POOL;
    }
    if histogram.snapshot().count != 1 {
        failed |= WRONG_HISTOGRAM;
    }
    if sharded.fold(0, |sum, shard| sum + shard) != 1 {
        failed |= WRONG_SHARD;
    }
    if rseq && ops::abort_fallbacks() == fallbacks {
        failed |= NO_FALLBACK;
    }
    // SAFETY: ends the child without running the parent's atexit handlers or destructors.
    unsafe { libc::_exit(failed) }
}

/// Waits for the traced child's next stop or exit.
fn wait(pid: libc::pid_t) -> i32 {
    let mut status = 0;
    // SAFETY: waits for our own child.
    let ret = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(ret, pid, "waitpid: {}", std::io::Error::last_os_error());
    status
}

#[test]
fn single_stepped_operations_finish() {
    let counter = Counter::new();
    let pool = Pool::with_capacity(4, || 7u64);
    drop(pool.get());
    let histogram = Histogram::with_default_buckets();
    let sharded = Sharded::new(|_| 0u64);
    // Registers this thread (the child inherits its area) and makes every process-wide choice
    // before the fork.
    let source = thiscpu::source();
    let rseq = ops::position().is_some();
    eprintln!("{source:?}");

    // SAFETY: the child only runs `child`, which ends in `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        child(&counter, &pool, &histogram, &sharded, rseq);
    }

    let stopped = |status: i32| libc::WIFSTOPPED(status) && libc::WSTOPSIG(status) == libc::SIGSTOP;
    let status = wait(pid);
    assert!(
        stopped(status),
        "the child did not stop itself: status {status:#x}"
    );
    // With the bound, each operation takes at most a few thousand steps (x86_64, debug build);
    // without it, the first one that enters a section never finishes.
    let (max_steps, limit) = (200_000, Duration::from_secs(120));
    let start = Instant::now();
    for (n, operation) in OPERATIONS.into_iter().enumerate() {
        if n > 0 && start.elapsed() > STEPPING_BUDGET {
            eprintln!("{operation} runs at full speed: the stepping budget is spent");
            // SAFETY: lets our own traced child run to its next stop.
            let ret = unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, 0) };
            assert_eq!(ret, 0, "PTRACE_CONT: {}", std::io::Error::last_os_error());
            let status = wait(pid);
            assert!(stopped(status), "{operation}: status {status:#x}");
            continue;
        }
        let mut steps = 0u64;
        loop {
            if steps == max_steps || start.elapsed() > limit {
                // SAFETY: kills and reaps our own child.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, std::ptr::null_mut(), 0);
                }
                panic!(
                    "single-stepped, {operation} did not finish: {steps} steps, {:?} in all",
                    start.elapsed()
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
            steps += 1;
            let status = wait(pid);
            if stopped(status) {
                break;
            }
            assert!(
                libc::WIFSTOPPED(status) && libc::WSTOPSIG(status) == libc::SIGTRAP,
                "{operation}: the child stopped for something else than a step: {status:#x}"
            );
        }
        eprintln!("single-stepped, {operation} finished in {steps} steps");
    }
    // SAFETY: lets our own traced child run its checks.
    let ret = unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, 0) };
    assert_eq!(ret, 0, "PTRACE_CONT: {}", std::io::Error::last_os_error());
    let status = wait(pid);
    assert!(
        libc::WIFEXITED(status),
        "the child did not exit: status {status:#x}"
    );
    let exit = libc::WEXITSTATUS(status);
    assert_eq!(exit, 0, "{}", describe(exit));
}
