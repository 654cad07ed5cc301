//! A self-test of exactness: many threads increment one [`Counter`] (half of them through an
//! [`Adder`](crate::Adder)) while another thread
//! migrates them between CPUs at random, a signal storm runs handlers that increment the same
//! counter, and short-lived threads come and go. Every increment is also counted privately, so
//! the counter's total can be checked to the unit.
//!
//! This is what `thiscpu stress` runs; the test suite runs it too, in every environment.
//!
//! # Safety
//! Installs a signal handler (restored afterwards) and sends signals with `tgkill`; each block
//! states why it holds. Threads are moved between CPUs through [`crate::topology`].

use crate::Counter;
use core::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What to run.
#[derive(Clone, Debug)]
pub struct StressConfig {
    /// How long the workers increment.
    pub duration: Duration,
    /// Long-lived incrementing threads (default: 4 per online CPU).
    pub threads: usize,
    /// Move workers between CPUs at random, as fast as the kernel allows.
    pub migrate: bool,
    /// Send workers signals whose handler increments the same counter.
    pub signals: bool,
    /// Keep creating short-lived threads that increment and exit.
    pub churn: bool,
    /// The signal to use for the storm (its handler is restored afterwards).
    pub signal: i32,
}

impl Default for StressConfig {
    fn default() -> Self {
        StressConfig {
            duration: Duration::from_secs(1),
            threads: 4 * crate::topology::online_cpus().len().max(1),
            migrate: true,
            signals: true,
            churn: true,
            signal: libc::SIGUSR2,
        }
    }
}

/// What happened.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StressReport {
    /// Increments made (by workers, short-lived threads and signal handlers).
    pub operations: u64,
    /// What the counter says.
    pub counted: u64,
    /// `operations - counted`: must be 0.
    pub lost: i128,
    /// Aborted restartable sequences retried during the run.
    pub aborts: u64,
    /// Affinity changes made to workers.
    pub migrations: u64,
    /// Signals sent to workers.
    pub signals: u64,
    /// Increments made inside signal handlers.
    pub signal_increments: u64,
    /// Short-lived threads created.
    pub threads_created: u64,
    /// Long-lived worker threads.
    pub workers: usize,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl StressReport {
    /// Whether every increment was counted exactly once.
    pub fn exact(&self) -> bool {
        self.lost == 0
    }
}

// The signal handler reaches the counter under test through these; one run at a time.
static RUN: Mutex<()> = Mutex::new(());
static COUNTER: AtomicPtr<Counter> = AtomicPtr::new(core::ptr::null_mut());
static HANDLER_INCREMENTS: AtomicU64 = AtomicU64::new(0);
/// Handlers between their first and last instruction, on any thread. The handler is installed
/// process-wide, so a signal sent to the whole process (`kill`) may run it on a thread that is
/// not a worker, at any time; a run waits for this to fall to zero before its counter can go.
static HANDLERS_RUNNING: AtomicU32 = AtomicU32::new(0);

extern "C" fn increment_in_handler(_: libc::c_int) {
    // Counted as running before the pointer is read: see `HandlerTarget`'s drop.
    HANDLERS_RUNNING.fetch_add(1, Ordering::SeqCst);
    let counter = COUNTER.load(Ordering::SeqCst);
    if !counter.is_null() {
        #[cfg(test)]
        tests::pause_if_asked();
        // SAFETY: the pointer was read while it was published, after this handler counted
        // itself in `HANDLERS_RUNNING`; the `HandlerTarget` that published it holds the counter
        // alive until the pointer is withdrawn and no handler is running any more.
        unsafe { &*counter }.inc();
        HANDLER_INCREMENTS.fetch_add(1, Ordering::Relaxed);
        #[cfg(test)]
        tests::note_handler_end();
    }
    HANDLERS_RUNNING.fetch_sub(1, Ordering::SeqCst);
}

/// The counter the signal handler increments, published for one run. Dropping it withdraws
/// the pointer and then waits until no handler, on any thread, is still between reading the
/// pointer and using it; only then is its reference to the counter released.
struct HandlerTarget {
    _alive: Arc<Counter>,
}

impl HandlerTarget {
    fn publish(counter: &Arc<Counter>) -> Self {
        COUNTER.store(Arc::as_ptr(counter).cast_mut(), Ordering::SeqCst);
        HandlerTarget {
            _alive: counter.clone(),
        }
    }
}

impl Drop for HandlerTarget {
    fn drop(&mut self) {
        COUNTER.store(core::ptr::null_mut(), Ordering::SeqCst);
        // Sequentially consistent on both sides: a handler that read the pointer before the
        // store above had counted itself before that, so the count seen here includes it.
        // Handlers are short; this loop normally runs zero times.
        while HANDLERS_RUNNING.load(Ordering::SeqCst) != 0 {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Holds worker threads until every one has arrived, then releases them all with one wake-up,
/// or sends them home when the run is called off (a thread could not be created).
///
/// A `std::sync::Barrier` wakes its waiters into a mutex they must take one at a time; with
/// hundreds of threads on a few CPUs, and the released ones spinning, that convoy takes
/// minutes. Here the release is one store and one `futex` wake, and no waiter takes a lock.
/// Each worker learns when the gate opened, so that it can stop on time by its own clock:
/// with many more spinning threads than CPUs, the thread that would tell it to stop may wait
/// a long time for a CPU.
#[derive(Debug)]
pub struct StartGate {
    expected: u32,
    arrived: AtomicU32,
    state: AtomicU32,
    opened: std::sync::OnceLock<Instant>,
}

const GATE_CLOSED: u32 = 0;
const GATE_OPEN: u32 = 1;
const GATE_CANCELLED: u32 = 2;

impl StartGate {
    /// A closed gate for `workers` threads.
    pub fn new(workers: usize) -> Self {
        StartGate {
            expected: u32::try_from(workers).unwrap_or(u32::MAX),
            arrived: AtomicU32::new(0),
            state: AtomicU32::new(GATE_CLOSED),
            opened: std::sync::OnceLock::new(),
        }
    }

    /// Called by a worker: counts it in and waits for the gate to open. The time it opened, or
    /// `None` when the run was called off.
    pub fn arrive(&self) -> Option<Instant> {
        if self.arrived.fetch_add(1, Ordering::AcqRel).wrapping_add(1) == self.expected {
            futex_wake(&self.arrived, 1);
        }
        loop {
            match self.state.load(Ordering::Acquire) {
                GATE_CLOSED => futex_wait(&self.state, GATE_CLOSED),
                GATE_OPEN => return self.opened.get().copied(),
                _ => return None,
            }
        }
    }

    /// Called by the coordinator: waits until every worker has arrived (`true`), or until
    /// `ended_early` reports a worker thread that has ended (`false`; the caller calls the run
    /// off). A worker ends before the gate opens only if it never arrived: std created the
    /// thread but could not start it (its signal stack could not be mapped, say), and waiting
    /// for it would wait forever.
    pub fn wait_for_all(&self, ended_early: impl Fn() -> bool) -> bool {
        loop {
            let arrived = self.arrived.load(Ordering::Acquire);
            if arrived >= self.expected {
                return true;
            }
            if ended_early() {
                return false;
            }
            futex_wait_at_most(&self.arrived, arrived, Duration::from_millis(20));
        }
    }

    /// Lets every waiting (and later arriving) worker go; the time it opened.
    pub fn open(&self) -> Instant {
        let opened = *self.opened.get_or_init(Instant::now);
        self.release(GATE_OPEN);
        opened
    }

    /// Sends every waiting (and later arriving) worker home: `arrive` returns `false`.
    pub fn cancel(&self) {
        self.release(GATE_CANCELLED);
    }

    fn release(&self, state: u32) {
        self.state.store(state, Ordering::Release);
        futex_wake(&self.state, i32::MAX);
    }
}

/// Sleeps while `word` holds `expected`; may return early (a signal, a spurious wake-up), so
/// callers check again in a loop.
fn futex_wait(word: &AtomicU32, expected: u32) {
    futex_wait_until(word, expected, None);
}

/// [`futex_wait`] for at most `limit`.
fn futex_wait_at_most(word: &AtomicU32, expected: u32, limit: Duration) {
    let timeout = libc::timespec {
        tv_sec: limit.as_secs() as libc::time_t,
        tv_nsec: limit.subsec_nanos() as libc::c_long,
    };
    futex_wait_until(word, expected, Some(&timeout));
}

fn futex_wait_until(word: &AtomicU32, expected: u32, timeout: Option<&libc::timespec>) {
    let timeout = timeout.map_or(core::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: FUTEX_WAIT only reads the aligned 32-bit word, which `word` keeps alive for the
    // call, and returns at once when it no longer holds `expected`; the timeout, when given, is
    // a relative time that lives across the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            timeout,
        )
    };
    if ret != 0 {
        let errno = std::io::Error::last_os_error().raw_os_error();
        if !matches!(
            errno,
            Some(libc::EAGAIN) | Some(libc::EINTR) | Some(libc::ETIMEDOUT)
        ) {
            // No futex (a sandbox refusing it): wait politely instead.
            std::thread::yield_now();
        }
    }
}

/// Wakes up to `count` threads sleeping on `word`.
fn futex_wake(word: &AtomicU32, count: i32) {
    // SAFETY: FUTEX_WAKE only uses the word's address as a key; it reads no memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            count,
        );
    }
}

/// Starts `count` workers that wait at `gate` first. When the system refuses a thread, the
/// gate is cancelled, the workers already started are joined, and the error says which thread
/// of how many could not be created.
fn spawn_workers<T: Send + 'static, F: FnOnce() -> T + Send + 'static>(
    count: usize,
    gate: &StartGate,
    mut make: impl FnMut(usize) -> F,
) -> std::io::Result<Vec<std::thread::JoinHandle<T>>> {
    let mut handles = Vec::with_capacity(count);
    for index in 0..count {
        match std::thread::Builder::new().spawn(make(index)) {
            Ok(handle) => handles.push(handle),
            Err(error) => {
                gate.cancel();
                for handle in handles {
                    let _ = handle.join();
                }
                return Err(thread_refused(
                    &format!("worker thread {} of {count}", index + 1),
                    &error,
                ));
            }
        }
    }
    Ok(handles)
}

/// The error for a thread the system would not create.
/// A worker's start: publishes its thread id for the disturber, lets the coordinator run, and
/// waits at the gate. The worker's deadline, or `None` when the run was called off.
fn start_worker(
    tids: &[AtomicI32],
    index: usize,
    gate: &StartGate,
    duration: Duration,
) -> Option<Instant> {
    tids[index].store(gettid(), Ordering::Release);
    yield_to_the_coordinator();
    Some(gate.arrive()? + duration)
}

/// Sends the workers home after one of them ended without reaching the gate, waits for them,
/// and says what happened.
fn call_off<T>(gate: &StartGate, workers: Vec<std::thread::JoinHandle<T>>) -> std::io::Error {
    gate.cancel();
    for handle in workers {
        let _ = handle.join();
    }
    std::io::Error::other(
        "a worker thread ended before it could start (the system may be short of memory or \
         threads)",
    )
}

fn thread_refused(what: &str, error: &std::io::Error) -> std::io::Error {
    let reason = match error.raw_os_error() {
        Some(errno) => os_reason(errno),
        None => error.to_string(),
    };
    std::io::Error::new(
        error.kind(),
        format!("the system refused to create {what}: {reason}"),
    )
}

/// `strerror`'s text, without std's ` (os error N)` suffix.
fn os_reason(errno: i32) -> String {
    let text = std::io::Error::from_raw_os_error(errno).to_string();
    match text.find(" (os error") {
        Some(cut) => text[..cut].to_owned(),
        None => text,
    }
}

/// Puts the calling worker under `SCHED_IDLE` (or, where that is refused, at nice 19), which
/// needs no privilege: any thread at normal priority that wakes, the one that migrates and
/// signals the workers first, then takes the CPU from a worker at once, even when thousands of
/// workers spin. At nice 10 a coordinator among 4096 spinning workers got no round in before
/// the run's second was over. The workers are preempted more often this way, which the stress
/// welcomes; on a machine busy with other work they run less, and still check exactness.
fn yield_to_the_coordinator() {
    // SAFETY: sched_setscheduler and setpriority on the calling thread (pid 0, and
    // PRIO_PROCESS with a thread id, name one thread on Linux) with a valid sched_param;
    // failure leaves the thread as it was, which is harmless.
    unsafe {
        let param = libc::sched_param { sched_priority: 0 };
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
            libc::setpriority(libc::PRIO_PROCESS, gettid() as libc::id_t, 19);
        }
    }
}

fn gettid() -> i32 {
    // SAFETY: no precondition.
    unsafe { libc::gettid() }
}

/// A small xorshift generator: the stress needs cheap, not good, randomness.
struct Random(u64);

impl Random {
    fn next(&mut self, below: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % below.max(1) as u64) as usize
    }
}

/// The CPUs the workers are moved between: the caller's allowed CPUs.
fn allowed_cpus() -> Vec<u32> {
    crate::topology::allowed_cpus().unwrap_or_else(|_| crate::topology::online_cpus())
}

/// Moves workers between CPUs and sends them signals, at random, and counts what it did.
struct Disturber<'a> {
    config: &'a StressConfig,
    random: Random,
    pid: i32,
    migrations: u64,
    signals: u64,
}

impl<'a> Disturber<'a> {
    fn new(config: &'a StressConfig) -> Self {
        Disturber {
            config,
            random: Random(0x9e37_79b9_7f4a_7c15 ^ u64::from(gettid() as u32)),
            // SAFETY: no precondition.
            pid: unsafe { libc::getpid() },
            migrations: 0,
            signals: 0,
        }
    }

    /// Eight disturbances, each of a worker picked at random.
    fn round(&mut self, tids: &[AtomicI32], cpus: &[u32]) {
        for _ in 0..8 {
            let tid = tids[self.random.next(tids.len())].load(Ordering::Acquire);
            if tid == 0 {
                // That worker saw its deadline and left; its thread id may be reused.
                continue;
            }
            if self.config.migrate
                && !cpus.is_empty()
                && crate::topology::pin_thread(tid, cpus[self.random.next(cpus.len())]).is_ok()
            {
                self.migrations += 1;
            }
            if self.config.signals {
                // SAFETY: tgkill reaches only a thread of this process (a worker, or, if it
                // left just now, none: the call fails); the signal's handler is installed.
                let sent =
                    unsafe { libc::syscall(libc::SYS_tgkill, self.pid, tid, self.config.signal) };
                if sent == 0 {
                    self.signals += 1;
                }
            }
        }
    }
}

/// Restores the previous handler when dropped.
struct HandlerGuard {
    signal: i32,
    previous: libc::sigaction,
}

impl HandlerGuard {
    fn install(signal: i32) -> std::io::Result<Self> {
        // SAFETY: a zeroed sigaction is valid; the handler is async-signal-safe (one counter
        // increment and one atomic add); SA_RESTART keeps the workers' syscalls going.
        unsafe {
            let mut action: libc::sigaction = core::mem::zeroed();
            action.sa_sigaction = increment_in_handler as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            let mut previous: libc::sigaction = core::mem::zeroed();
            if libc::sigaction(signal, &action, &mut previous) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(HandlerGuard { signal, previous })
        }
    }
}

impl Drop for HandlerGuard {
    fn drop(&mut self) {
        // SAFETY: restores the action saved at installation.
        unsafe {
            libc::sigaction(self.signal, &self.previous, core::ptr::null_mut());
        }
    }
}

/// Short-lived threads made during a run: at most 16 alive, the oldest joined as new ones
/// come. Every thread's operation count is added up and a panic in one is a panic of the run.
#[derive(Default)]
struct Churn {
    running: Vec<std::thread::JoinHandle<u64>>,
    operations: u64,
    created: u64,
}

impl Churn {
    /// Starts one more; fails when the system refuses the thread.
    fn spawn(&mut self, work: impl FnOnce() -> u64 + Send + 'static) -> std::io::Result<()> {
        let handle = std::thread::Builder::new()
            .spawn(work)
            .map_err(|error| thread_refused("a short-lived thread", &error))?;
        self.running.push(handle);
        self.created += 1;
        if self.running.len() >= 16 {
            let oldest: Vec<_> = self.running.drain(..8).collect();
            self.operations += Churn::join(oldest);
        }
        Ok(())
    }

    /// Joins the threads still running; the operations of all.
    fn finish(self) -> u64 {
        self.operations + Churn::join(self.running)
    }

    fn join(threads: Vec<std::thread::JoinHandle<u64>>) -> u64 {
        threads
            .into_iter()
            .map(|handle| handle.join().expect("a short-lived stress thread panicked"))
            .sum()
    }
}

/// Runs the stress on a fresh [`Counter`] and reports. Only one run at a time in a process.
///
/// ```
/// use std::time::Duration;
/// let config = thiscpu::stress::StressConfig {
///     duration: Duration::from_millis(100),
///     threads: 4,
///     ..Default::default()
/// };
/// let report = thiscpu::stress::run_counter(&config).unwrap();
/// assert!(report.exact(), "{report:?}");
/// ```
pub fn run_counter(config: &StressConfig) -> std::io::Result<StressReport> {
    let _one_at_a_time = RUN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let counter = Arc::new(Counter::new());
    let workers = config.threads.max(1);
    let cpus = allowed_cpus();
    let stop = Arc::new(AtomicBool::new(false));
    let gate = Arc::new(StartGate::new(workers));
    let tids: Arc<Vec<AtomicI32>> = Arc::new((0..workers).map(|_| AtomicI32::new(0)).collect());
    let aborts_before = crate::ops::aborts();
    HANDLER_INCREMENTS.store(0, Ordering::Relaxed);
    let guard = if config.signals {
        Some(HandlerGuard::install(config.signal)?)
    } else {
        None
    };
    let target = HandlerTarget::publish(&counter);
    let duration = config.duration;

    let worker_handles = spawn_workers(workers, &gate, |index| {
        let (counter, stop, gate, tids) =
            (counter.clone(), stop.clone(), gate.clone(), tids.clone());
        move || {
            let Some(deadline) = start_worker(&tids, index, &gate, duration) else {
                return 0;
            };
            let mut made = 0u64;
            // Half the workers add through one `Adder` for the whole run: what it read once
            // must stay right across every migration and signal.
            let adder = (index % 2 == 1).then(|| counter.adder());
            while !stop.load(Ordering::Relaxed) {
                match adder {
                    Some(adder) => (0..64).for_each(|_| adder.inc()),
                    None => (0..64).for_each(|_| counter.inc()),
                }
                made += 64;
                if made.is_multiple_of(4096) && Instant::now() >= deadline {
                    break;
                }
            }
            tids[index].store(0, Ordering::Release);
            made
        }
    })?;

    if !gate.wait_for_all(|| worker_handles.iter().any(|h| h.is_finished())) {
        return Err(call_off(&gate, worker_handles));
    }
    let began = gate.open();
    let deadline = began + config.duration;
    let mut disturber = Disturber::new(config);
    let mut churn = Churn::default();
    let mut refused = None;
    while Instant::now() < deadline {
        disturber.round(&tids, &cpus);
        if config.churn {
            let counter = counter.clone();
            let by_adder = churn.created % 2 == 1;
            let spawned = churn.spawn(move || {
                let n = 2_000;
                if by_adder {
                    // Made on this new thread, whose registration `adder()` itself makes.
                    let adder = counter.adder();
                    (0..n).for_each(|_| adder.inc());
                } else {
                    (0..n).for_each(|_| counter.inc());
                }
                n
            });
            if let Err(error) = spawned {
                refused = Some(error);
                break;
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    stop.store(true, Ordering::Relaxed);
    let mut operations: u64 = worker_handles
        .into_iter()
        .map(|handle| handle.join().expect("stress worker panicked"))
        .sum();
    let threads_created = churn.created;
    operations += churn.finish();
    let elapsed = began.elapsed();
    if let Some(error) = refused {
        return Err(error);
    }
    // The storm's signals went only to workers, all joined now; a signal still pending when
    // its worker exited was discarded with it, neither handled nor counted. A signal sent to
    // the whole process may still run the handler on another thread: withdrawing the target
    // waits for it.
    drop(guard);
    drop(target);
    let signal_increments = HANDLER_INCREMENTS.load(Ordering::Relaxed);
    operations += signal_increments;
    let counted = counter.sum();
    Ok(StressReport {
        operations,
        counted,
        lost: i128::from(operations) - i128::from(counted),
        aborts: crate::ops::aborts() - aborts_before,
        migrations: disturber.migrations,
        signals: disturber.signals,
        signal_increments,
        threads_created,
        workers,
        elapsed,
    })
}

/// What [`run_pool`] runs: the [`StressConfig`] storm (migration, signals, churn) around a
/// [`crate::Pool`], plus a thread that drains CPU caches while the workers use them.
#[derive(Clone, Debug)]
pub struct PoolStressConfig {
    /// Duration, workers, migration, signals, churn, as for the counter.
    pub stress: StressConfig,
    /// Drain random CPUs' caches from another thread throughout the run.
    pub drain: bool,
    /// Objects cached per CPU (small, so that spills and refills happen often).
    pub capacity: usize,
    /// Most objects a worker holds at once (it takes 1 to `hold`, then gives them back).
    pub hold: usize,
}

impl Default for PoolStressConfig {
    fn default() -> Self {
        PoolStressConfig {
            stress: StressConfig::default(),
            drain: true,
            capacity: 8,
            hold: 4,
        }
    }
}

/// What happened in [`run_pool`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStressReport {
    /// Objects taken from the pool and given back (each counts once).
    pub operations: u64,
    /// Objects the pool made.
    pub created: u64,
    /// Distinct objects found in the pool after the run.
    pub found: u64,
    /// Objects handed out while another holder still had them (must be 0).
    pub double_handouts: u64,
    /// Objects found more than once after the run (must be 0).
    pub duplicates: u64,
    /// `created - found`: objects lost (must be 0).
    pub lost: i128,
    /// Drains that succeeded.
    pub drains: u64,
    /// Drains that reported the fence and its fallback unavailable.
    pub drains_unavailable: u64,
    /// Objects moved by drains.
    pub drained_objects: u64,
    /// The method of the last successful drain, if any.
    pub drain_method: Option<crate::pool::DrainMethod>,
    /// Aborted restartable sequences retried during the run.
    pub aborts: u64,
    /// Affinity changes made to workers.
    pub migrations: u64,
    /// Signals sent to workers.
    pub signals: u64,
    /// Signal handlers that ran (each increments a counter inside a restartable sequence).
    pub signals_handled: u64,
    /// Short-lived threads created.
    pub threads_created: u64,
    /// Long-lived worker threads.
    pub workers: usize,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl PoolStressReport {
    /// Whether every object was accounted for exactly once and never held twice.
    pub fn exact(&self) -> bool {
        self.lost == 0 && self.double_handouts == 0 && self.duplicates == 0
    }
}

/// The most objects a pool stress may make: their in-use flags are preallocated.
const POOL_STRESS_OBJECTS: usize = 1 << 20;

/// A pooled object of the stress: its number, and the flag table it marks while held.
#[derive(Debug)]
struct Tracked {
    id: usize,
}

/// Takes up to `hold` objects, marks each held (a second holder shows as a double hand-out),
/// and gives them back.
fn pool_round(
    pool: &crate::Pool<Tracked>,
    held: &[core::sync::atomic::AtomicU8],
    doubles: &AtomicU64,
    take: usize,
) -> u64 {
    let mut objects = Vec::with_capacity(take);
    for _ in 0..take {
        let object = pool.get();
        if held[object.id].swap(1, Ordering::Relaxed) != 0 {
            doubles.fetch_add(1, Ordering::Relaxed);
        }
        objects.push(object);
    }
    for object in objects {
        if held[object.id].swap(0, Ordering::Relaxed) != 1 {
            doubles.fetch_add(1, Ordering::Relaxed);
        }
        drop(object);
    }
    take as u64
}

/// Runs the pool stress and counts every object in and out: workers take and return objects
/// while being migrated and signalled, short-lived threads do the same and exit, and a
/// drainer moves CPU caches to the shared list. Afterwards every object the pool made must be
/// in it exactly once. Only one run (of either stress) at a time in a process.
///
/// ```
/// use std::time::Duration;
/// let config = thiscpu::stress::PoolStressConfig {
///     stress: thiscpu::stress::StressConfig {
///         duration: Duration::from_millis(100),
///         threads: 4,
///         ..Default::default()
///     },
///     ..Default::default()
/// };
/// let report = thiscpu::stress::run_pool(&config).unwrap();
/// assert!(report.exact(), "{report:?}");
/// ```
pub fn run_pool(config: &PoolStressConfig) -> std::io::Result<PoolStressReport> {
    use core::sync::atomic::AtomicU8;
    let _one_at_a_time = RUN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let stress = &config.stress;
    let next_id = Arc::new(AtomicU64::new(0));
    let pool = {
        let next_id = next_id.clone();
        Arc::new(crate::Pool::with_capacity(config.capacity, move || {
            Tracked {
                id: next_id.fetch_add(1, Ordering::Relaxed) as usize,
            }
        }))
    };
    let held: Arc<Vec<AtomicU8>> =
        Arc::new((0..POOL_STRESS_OBJECTS).map(|_| AtomicU8::new(0)).collect());
    let doubles = Arc::new(AtomicU64::new(0));
    let hold = config.hold.max(1);
    let workers = stress.threads.max(1);
    let cpus = allowed_cpus();
    let stop = Arc::new(AtomicBool::new(false));
    let gate = Arc::new(StartGate::new(workers));
    let tids: Arc<Vec<AtomicI32>> = Arc::new((0..workers).map(|_| AtomicI32::new(0)).collect());
    let aborts_before = crate::ops::aborts();
    // The handler increments this counter: a restartable sequence of its own, run right after
    // the interrupted pool section was aborted.
    let handled = Arc::new(Counter::new());
    HANDLER_INCREMENTS.store(0, Ordering::Relaxed);
    let guard = if stress.signals {
        Some(HandlerGuard::install(stress.signal)?)
    } else {
        None
    };
    let target = HandlerTarget::publish(&handled);
    if config.drain {
        // Registration may wait for an RCU grace period: do it before the clock starts.
        let _ = crate::fence::register();
    }

    let duration = stress.duration;
    let mut worker_handles = spawn_workers(workers, &gate, |index| {
        let (pool, held, doubles, stop, gate, tids) = (
            pool.clone(),
            held.clone(),
            doubles.clone(),
            stop.clone(),
            gate.clone(),
            tids.clone(),
        );
        move || {
            let Some(deadline) = start_worker(&tids, index, &gate, duration) else {
                return 0;
            };
            let mut random = Random(0x2545_f491_4f6c_dd1d ^ (index as u64 + 1));
            let mut made = 0u64;
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                for _ in 0..16 {
                    made += pool_round(&pool, &held, &doubles, 1 + random.next(hold));
                }
            }
            tids[index].store(0, Ordering::Release);
            made
        }
    })?;

    let drainer = config.drain.then(|| {
        let (pool, stop) = (pool.clone(), stop.clone());
        std::thread::Builder::new().spawn(move || {
            let possible = crate::topology::possible_cpus() as u32;
            let mut random = Random(0x9e37_79b9_7f4a_7c15);
            let (mut drains, mut unavailable, mut objects, mut method) = (0u64, 0u64, 0u64, None);
            while !stop.load(Ordering::Relaxed) {
                let cpu = random.next(possible as usize) as u32;
                match pool.drain_cpu(cpu) {
                    Ok(drained) => {
                        drains += 1;
                        objects += drained.objects as u64;
                        method = Some(drained.method);
                    }
                    Err(_) => unavailable += 1,
                }
                std::thread::sleep(Duration::from_micros(50));
            }
            (drains, unavailable, objects, method)
        })
    });
    let drainer = match drainer.transpose() {
        Ok(drainer) => drainer,
        Err(error) => {
            gate.cancel();
            for handle in worker_handles.drain(..) {
                let _ = handle.join();
            }
            return Err(thread_refused("the draining thread", &error));
        }
    };

    if !gate.wait_for_all(|| worker_handles.iter().any(|h| h.is_finished())) {
        stop.store(true, Ordering::Relaxed);
        if let Some(drainer) = drainer {
            let _ = drainer.join();
        }
        return Err(call_off(&gate, worker_handles));
    }
    let began = gate.open();
    let deadline = began + stress.duration;
    let mut disturber = Disturber::new(stress);
    let mut churn = Churn::default();
    let mut refused = None;
    while Instant::now() < deadline {
        disturber.round(&tids, &cpus);
        if stress.churn {
            let (pool, held, doubles) = (pool.clone(), held.clone(), doubles.clone());
            let spawned = churn.spawn(move || {
                (0..200)
                    .map(|round| pool_round(&pool, &held, &doubles, 1 + round % hold))
                    .sum::<u64>()
            });
            if let Err(error) = spawned {
                refused = Some(error);
                break;
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    stop.store(true, Ordering::Relaxed);
    let mut operations: u64 = worker_handles
        .into_iter()
        .map(|handle| handle.join().expect("pool stress worker panicked"))
        .sum();
    let threads_created = churn.created;
    operations += churn.finish();
    let (drains, drains_unavailable, drained_objects, drain_method) = drainer
        .map(|handle| handle.join().expect("pool drainer panicked"))
        .unwrap_or_default();
    let elapsed = began.elapsed();
    if let Some(error) = refused {
        return Err(error);
    }
    drop(guard);
    drop(target);
    let signals_handled = HANDLER_INCREMENTS.load(Ordering::Relaxed);

    // Every thread has stopped: take every object out through the pool's own paths and check
    // each is there exactly once. `get` runs only while the shared list holds objects, so it
    // never makes one: this thread may migrate between two calls, and a `get` on a CPU whose
    // cache and the shared list were both empty would make a new object while others sat in
    // the cache a refill filled on the previous CPU. Draining every cache refills the shared
    // list. Where draining is unavailable, objects cached on other CPUs stay unreachable from
    // here and count as lost.
    let created = pool.created();
    let mut taken = Vec::new();
    loop {
        if pool.shared_len() == 0 {
            let _ = pool.drain_all();
            if pool.shared_len() == 0 {
                break;
            }
        }
        taken.push(crate::Pooled::into_box(pool.get()));
    }
    let mut seen = vec![false; created as usize];
    let mut found = 0u64;
    let mut duplicates = 0u64;
    for object in &taken {
        match seen.get_mut(object.id) {
            Some(seen) if !*seen => {
                *seen = true;
                found += 1;
            }
            _ => duplicates += 1,
        }
    }
    duplicates += pool.created() - created;
    let double_handouts = doubles.load(Ordering::Relaxed)
        + held
            .iter()
            .filter(|flag| flag.load(Ordering::Relaxed) != 0)
            .count() as u64;
    Ok(PoolStressReport {
        operations,
        created,
        found,
        double_handouts,
        duplicates,
        lost: i128::from(created) - i128::from(found),
        drains,
        drains_unavailable,
        drained_objects,
        drain_method,
        aborts: crate::ops::aborts() - aborts_before,
        migrations: disturber.migrations,
        signals: disturber.signals,
        signals_handled,
        threads_created,
        workers,
        elapsed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thread whose handler pauses, and for how long.
    static PAUSE_TID: AtomicI32 = AtomicI32::new(0);
    const PAUSE: Duration = Duration::from_millis(800);
    /// `CLOCK_MONOTONIC` nanoseconds when that handler was done with the counter; 0 before.
    static PAUSED_HANDLER_END: AtomicU64 = AtomicU64::new(0);

    fn monotonic_nanos() -> u64 {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec we own; it is async-signal-safe.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
        now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
    }

    /// In the handler, after it read the counter's pointer: holds the chosen thread there.
    pub(super) fn pause_if_asked() {
        if gettid() == PAUSE_TID.load(Ordering::SeqCst) {
            std::thread::sleep(PAUSE);
        }
    }

    /// In the handler, after its increment: records when the chosen thread got there.
    pub(super) fn note_handler_end() {
        if gettid() == PAUSE_TID.load(Ordering::SeqCst) {
            PAUSED_HANDLER_END.store(monotonic_nanos(), Ordering::SeqCst);
        }
    }

    /// A signal for the whole process may run the handler on a thread that is not a worker,
    /// and that handler may still hold the counter when the workers are done: the run must not
    /// free the counter (and must not return) before that handler is finished with it.
    #[test]
    fn a_handler_on_another_thread_keeps_the_counter_alive() {
        let config = StressConfig {
            duration: Duration::from_millis(300),
            threads: 2,
            migrate: false,
            churn: false,
            signals: true,
            // Ignored by default: if it ever came after the run, it would do nothing.
            signal: libc::SIGWINCH,
        };
        let bystander = std::thread::spawn(move || {
            PAUSE_TID.store(gettid(), Ordering::SeqCst);
            let waited = Instant::now();
            while COUNTER.load(Ordering::SeqCst).is_null() {
                assert!(
                    waited.elapsed() < Duration::from_secs(20),
                    "the run never started"
                );
                std::thread::sleep(Duration::from_micros(200));
            }
            // SAFETY: tgkill to this thread; the run's handler for the signal is installed.
            let sent = unsafe {
                libc::syscall(libc::SYS_tgkill, libc::getpid(), gettid(), libc::SIGWINCH)
            };
            assert_eq!(sent, 0);
        });
        let report = run_counter(&config).expect("stress run");
        let returned = monotonic_nanos();
        let handler_end = PAUSED_HANDLER_END.load(Ordering::SeqCst);
        bystander.join().expect("bystander");
        assert_ne!(
            handler_end, 0,
            "the run returned while a handler on another thread still held its counter"
        );
        assert!(handler_end <= returned);
        assert!(report.exact(), "{report:?}");
        assert!(report.signal_increments >= 1, "{report:?}");
    }

    #[test]
    fn the_coordinator_stops_waiting_when_a_worker_ends_without_arriving() {
        let gate = Arc::new(StartGate::new(3));
        let arriving: Vec<_> = (0..2)
            .map(|_| {
                let gate = gate.clone();
                std::thread::spawn(move || gate.arrive())
            })
            .collect();
        // The third worker ends without arriving, as one that std could not start does.
        let lost = std::thread::spawn(|| None::<Instant>);
        assert!(!gate.wait_for_all(|| lost.is_finished()));
        gate.cancel();
        for worker in arriving {
            assert_eq!(worker.join().unwrap(), None);
        }
    }

    #[test]
    fn the_gate_releases_every_waiter_or_sends_them_home() {
        for open in [true, false] {
            let gate = Arc::new(StartGate::new(64));
            let waiters: Vec<_> = (0..64)
                .map(|_| {
                    let gate = gate.clone();
                    std::thread::spawn(move || gate.arrive())
                })
                .collect();
            assert!(gate.wait_for_all(|| false));
            let opened = if open {
                Some(gate.open())
            } else {
                gate.cancel();
                None
            };
            for waiter in waiters {
                assert_eq!(waiter.join().unwrap(), opened);
            }
        }
    }
}
