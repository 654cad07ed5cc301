//! The storm around the workers: what it does ([`StressConfig`]), the thread that migrates and
//! signals them at random, the short-lived threads that come and go, and [`run_storm`], which
//! runs a [`Workload`] in it: every stress is a workload and its verdict, and nothing else.
//!
//! # Safety
//! Moves other threads of this process between CPUs with `sched_setaffinity` and sends them
//! signals with `tgkill`; each block states why it holds.

use crate::gate::StartGate;
use crate::signal::{HANDLER_INCREMENTS, HandlerGuard, HandlerTarget, RUN};
use crate::workers::{call_off, gettid, spawn_workers, start_worker, thread_refused};
use core::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use thiscpu::Counter;

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
            threads: 4 * thiscpu::topology::online_cpus().len().max(1),
            migrate: true,
            signals: true,
            churn: true,
            signal: libc::SIGUSR2,
        }
    }
}

/// A small xorshift generator: the stress needs cheap, not good, randomness.
pub(crate) struct Random(pub(crate) u64);

impl Random {
    pub(crate) fn next(&mut self, below: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % below.max(1) as u64) as usize
    }
}

/// The CPUs the workers are moved between: the caller's allowed CPUs.
pub(crate) fn allowed_cpus() -> Vec<u32> {
    thiscpu::topology::allowed_cpus().unwrap_or_else(|_| thiscpu::topology::online_cpus())
}

/// Moves workers between CPUs and sends them signals, at random, and counts what it did.
pub(crate) struct Disturber<'a> {
    config: &'a StressConfig,
    random: Random,
    pid: i32,
    pub(crate) migrations: u64,
    pub(crate) signals: u64,
}

impl<'a> Disturber<'a> {
    pub(crate) fn new(config: &'a StressConfig) -> Self {
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
    pub(crate) fn round(&mut self, tids: &[AtomicI32], cpus: &[u32]) {
        for _ in 0..8 {
            let tid = tids[self.random.next(tids.len())].load(Ordering::Acquire);
            if tid == 0 {
                // That worker saw its deadline and left; its thread id may be reused.
                continue;
            }
            if self.config.migrate
                && !cpus.is_empty()
                && pin_thread(tid, cpus[self.random.next(cpus.len())]).is_ok()
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

/// What threads of a run did, added up over all of them.
pub(crate) trait Tally: Default + Send + 'static {
    fn add(&mut self, other: Self);
}

impl Tally for u64 {
    fn add(&mut self, other: u64) {
        *self += other;
    }
}

/// Short-lived threads made during a run: at most 16 alive, the oldest joined as new ones
/// come. Every thread's tally is added up and a panic in one is a panic of the run.
pub(crate) struct Churn<T> {
    running: Vec<JoinHandle<T>>,
    joined: T,
    pub(crate) created: u64,
}

impl<T: Tally> Default for Churn<T> {
    fn default() -> Self {
        Churn {
            running: Vec::new(),
            joined: T::default(),
            created: 0,
        }
    }
}

impl<T: Tally> Churn<T> {
    /// Starts one more; fails when the system refuses the thread.
    pub(crate) fn spawn(
        &mut self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> std::io::Result<()> {
        let handle = std::thread::Builder::new()
            .spawn(work)
            .map_err(|error| thread_refused("a short-lived thread", &error))?;
        self.running.push(handle);
        self.created += 1;
        if self.running.len() >= 16 {
            let oldest: Vec<_> = self.running.drain(..8).collect();
            self.joined.add(Churn::join(oldest));
        }
        Ok(())
    }

    /// Joins the threads still running; the tally of all.
    pub(crate) fn finish(self) -> T {
        let mut tally = self.joined;
        tally.add(Churn::join(self.running));
        tally
    }

    fn join(threads: Vec<JoinHandle<T>>) -> T {
        let mut tally = T::default();
        for handle in threads {
            tally.add(handle.join().expect("a short-lived stress thread panicked"));
        }
        tally
    }
}

/// What the threads of a stress do; [`run_storm`] does the rest: the start gate, the
/// disturber, the churn, the signal handler, and the joining.
pub(crate) trait Workload: Send + Sync + 'static {
    /// What one worker or short-lived thread did.
    type Tally: Tally;
    /// What the background thread did.
    type Background: Default + Send + 'static;

    /// Long-lived worker `index`'s work, for as long as `shift` allows.
    fn work(&self, index: usize, shift: &Shift) -> Self::Tally;

    /// A short-lived thread's work; `earlier` short-lived threads were made before it.
    fn churn(&self, earlier: u64) -> Self::Tally;

    /// The counter the signal handler increments. The workload's own sections are what the
    /// signals interrupt; by default the handler runs a restartable sequence of its own on a
    /// counter nobody else uses, right after the interrupted section was aborted.
    fn handler_target(&self) -> Arc<Counter> {
        Arc::new(Counter::new())
    }

    /// The thread that works beside the workers until the run stops, as errors name it, when
    /// the run has one.
    fn background(&self) -> Option<&'static str> {
        None
    }

    /// The background thread's work until `stop` is set.
    fn run_background(&self, _stop: &AtomicBool) -> Self::Background {
        Self::Background::default()
    }
}

/// What the coordinator shares with the long-lived workers.
struct Crew {
    stop: AtomicBool,
    /// Workers stop by their own clock, but not before the disturber's first round: a run
    /// that moved and signalled nobody would test nothing.
    disturbed: AtomicBool,
    gate: StartGate,
    tids: Vec<AtomicI32>,
    duration: Duration,
}

/// A long-lived worker's view of the run: whether to go on.
pub(crate) struct Shift<'a> {
    crew: &'a Crew,
    deadline: Instant,
}

impl Shift<'_> {
    /// Whether the coordinator has stopped the run.
    pub(crate) fn stopped(&self) -> bool {
        self.crew.stop.load(Ordering::Relaxed)
    }

    /// Whether this worker's time is up: its deadline has passed and the disturber has had its
    /// first round.
    pub(crate) fn over(&self) -> bool {
        Instant::now() >= self.deadline && self.crew.disturbed.load(Ordering::Acquire)
    }

    /// Neither stopped nor over.
    pub(crate) fn goes_on(&self) -> bool {
        !self.stopped() && !self.over()
    }
}

/// What happened around a workload in [`run_storm`].
pub(crate) struct Storm<T, B> {
    /// The workers' and the short-lived threads' tallies, added up.
    pub(crate) tally: T,
    pub(crate) background: B,
    pub(crate) migrations: u64,
    pub(crate) signals: u64,
    pub(crate) signals_handled: u64,
    pub(crate) threads_created: u64,
    pub(crate) workers: usize,
    pub(crate) elapsed: Duration,
    aborts_before: u64,
}

impl<T, B> Storm<T, B> {
    /// Aborted restartable sequences retried since the run began, the verdict's included.
    pub(crate) fn aborts(&self) -> u64 {
        thiscpu::ops::aborts() - self.aborts_before
    }
}

/// The threads of a run, started and waiting at the gate.
struct Started<W: Workload> {
    workers: Vec<JoinHandle<W::Tally>>,
    background: Option<(&'static str, JoinHandle<W::Background>)>,
}

/// Runs `workload` in the storm `config` describes: its workers start together behind a gate,
/// a disturber migrates and signals them at random while short-lived threads come and go, and
/// a background thread, if the workload has one, works beside them. Returns once every thread
/// has been joined and no signal handler uses the run's counter any more. Only one run (of any
/// stress) at a time in a process.
pub(crate) fn run_storm<W: Workload>(
    config: &StressConfig,
    workload: &Arc<W>,
) -> std::io::Result<Storm<W::Tally, W::Background>> {
    let _one_at_a_time = RUN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let workers = config.threads.max(1);
    let cpus = allowed_cpus();
    let crew = Arc::new(Crew {
        stop: AtomicBool::new(false),
        disturbed: AtomicBool::new(false),
        gate: StartGate::new(workers),
        tids: (0..workers).map(|_| AtomicI32::new(0)).collect(),
        duration: config.duration,
    });
    let aborts_before = thiscpu::ops::aborts();
    HANDLER_INCREMENTS.store(0, Ordering::Relaxed);
    let guard = if config.signals {
        Some(HandlerGuard::install(config.signal)?)
    } else {
        None
    };
    let target = HandlerTarget::publish(&workload.handler_target());
    if workload.background().is_some() {
        // Registration may wait for an RCU grace period: do it before the clock starts.
        let _ = thiscpu::fence::register();
    }

    let started = start(workload, &crew)?;
    let began = crew.gate.open();
    let (disturber, churn, refused) = disturb(config, workload, &crew, &cpus, began);
    crew.stop.store(true, Ordering::Relaxed);
    let mut tally = W::Tally::default();
    for handle in started.workers {
        tally.add(handle.join().expect("stress worker panicked"));
    }
    let threads_created = churn.created;
    tally.add(churn.finish());
    let background = started
        .background
        .map(|(name, handle)| handle.join().unwrap_or_else(|_| panic!("{name} panicked")))
        .unwrap_or_default();
    let elapsed = began.elapsed();
    refused?;
    // The storm's signals went only to workers, all joined now; a signal still pending when
    // its worker exited was discarded with it, neither handled nor counted. A signal sent to
    // the whole process may still run the handler on another thread: withdrawing the target
    // waits for it.
    drop(guard);
    drop(target);
    Ok(Storm {
        tally,
        background,
        migrations: disturber.migrations,
        signals: disturber.signals,
        signals_handled: HANDLER_INCREMENTS.load(Ordering::Relaxed),
        threads_created,
        workers,
        elapsed,
        aborts_before,
    })
}

/// Starts the workers and the background thread and waits until every worker is at the gate.
/// When a thread cannot be made or a worker ends before it arrives, the run is called off: the
/// threads already started are sent home and joined.
fn start<W: Workload>(workload: &Arc<W>, crew: &Arc<Crew>) -> std::io::Result<Started<W>> {
    let mut workers = spawn_workers(crew.tids.len(), &crew.gate, |index| {
        let (workload, crew) = (workload.clone(), crew.clone());
        move || {
            let Some(deadline) = start_worker(&crew.tids, index, &crew.gate, crew.duration) else {
                return W::Tally::default();
            };
            let tally = workload.work(
                index,
                &Shift {
                    crew: &crew,
                    deadline,
                },
            );
            crew.tids[index].store(0, Ordering::Release);
            tally
        }
    })?;
    let background = match workload.background() {
        None => None,
        Some(name) => {
            let (workload, stop_with) = (workload.clone(), crew.clone());
            let spawned =
                std::thread::Builder::new().spawn(move || workload.run_background(&stop_with.stop));
            match spawned {
                Ok(handle) => Some((name, handle)),
                Err(error) => {
                    crew.gate.cancel();
                    for handle in workers.drain(..) {
                        let _ = handle.join();
                    }
                    return Err(thread_refused(name, &error));
                }
            }
        }
    };
    if !crew
        .gate
        .wait_for_all(|| workers.iter().any(|h| h.is_finished()))
    {
        crew.stop.store(true, Ordering::Relaxed);
        if let Some((_, background)) = background {
            let _ = background.join();
        }
        return Err(call_off(&crew.gate, workers));
    }
    Ok(Started {
        workers,
        background,
    })
}

/// The coordinator's part once the gate is open: disturbs the workers and makes short-lived
/// threads until the run's time is up or the system refuses a thread (the error).
fn disturb<'a, W: Workload>(
    config: &'a StressConfig,
    workload: &Arc<W>,
    crew: &Crew,
    cpus: &[u32],
    began: Instant,
) -> (Disturber<'a>, Churn<W::Tally>, std::io::Result<()>) {
    let deadline = began + config.duration;
    let mut disturber = Disturber::new(config);
    let mut churn = Churn::default();
    // The first round comes before the first look at the clock: waking a thousand workers can
    // take longer than the run asked for.
    loop {
        disturber.round(&crew.tids, cpus);
        crew.disturbed.store(true, Ordering::Release);
        if config.churn {
            let workload = workload.clone();
            let earlier = churn.created;
            if let Err(error) = churn.spawn(move || workload.churn(earlier)) {
                return (disturber, churn, Err(error));
            }
        }
        if Instant::now() >= deadline {
            return (disturber, churn, Ok(()));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Pins thread `tid` of this process to `cpu`. The library pins only the calling thread
/// ([`thiscpu::topology::pin_to`]); the disturber moves the workers from outside. The mask has
/// a bit for every possible CPU, not glibc's fixed 1024.
fn pin_thread(tid: i32, cpu: u32) -> std::io::Result<()> {
    type Word = libc::c_ulong;
    let word_bits = Word::BITS as usize;
    let cpu = cpu as usize;
    let cpus = thiscpu::topology::possible_cpus().max(cpu + 1);
    let mut mask: Vec<Word> = vec![0; cpus.div_ceil(word_bits)];
    mask[cpu / word_bits] |= 1 << (cpu % word_bits);
    // SAFETY: the kernel reads `size_of_val(mask)` bytes from the buffer `mask` owns and keeps
    // no reference to it; `tid` is only a number to it (one that names no thread fails).
    let ret = unsafe {
        libc::syscall(
            libc::SYS_sched_setaffinity,
            tid,
            size_of_val(mask.as_slice()),
            mask.as_ptr(),
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // `allowed_cpus` reads the mask on Linux alone: with `--cfg thiscpu_portable` thiscpu
    // takes the path of other systems, where it is `Unsupported`.
    #[cfg(not(thiscpu_portable))]
    #[test]
    fn pinning_by_thread_id_moves_that_thread() {
        let cpu = *thiscpu::topology::allowed_cpus().unwrap().last().unwrap();
        std::thread::spawn(move || {
            pin_thread(gettid(), cpu).unwrap();
            assert_eq!(thiscpu::topology::allowed_cpus().unwrap(), [cpu]);
        })
        .join()
        .unwrap();
    }
}
