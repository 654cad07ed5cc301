//! The storm around the workers: what it does ([`StressConfig`]), the thread that migrates and
//! signals them at random, and the short-lived threads that come and go.
//!
//! # Safety
//! Moves other threads of this process between CPUs with `sched_setaffinity` and sends them
//! signals with `tgkill`; each block states why it holds.

use crate::workers::{gettid, thread_refused};
use core::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

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

/// Short-lived threads made during a run: at most 16 alive, the oldest joined as new ones
/// come. Every thread's operation count is added up and a panic in one is a panic of the run.
#[derive(Default)]
pub(crate) struct Churn {
    running: Vec<std::thread::JoinHandle<u64>>,
    operations: u64,
    pub(crate) created: u64,
}

impl Churn {
    /// Starts one more; fails when the system refuses the thread.
    pub(crate) fn spawn(
        &mut self,
        work: impl FnOnce() -> u64 + Send + 'static,
    ) -> std::io::Result<()> {
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
    pub(crate) fn finish(self) -> u64 {
        self.operations + Churn::join(self.running)
    }

    fn join(threads: Vec<std::thread::JoinHandle<u64>>) -> u64 {
        threads
            .into_iter()
            .map(|handle| handle.join().expect("a short-lived stress thread panicked"))
            .sum()
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
