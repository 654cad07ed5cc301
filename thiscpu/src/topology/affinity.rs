//! The calling thread's CPU affinity: the CPUs it may run on, and pinning it to one of them
//! for as long as a guard lives.
//!
//! The masks are sized for the possible CPUs, not for glibc's fixed `cpu_set_t` of 1024 bits:
//! the kernel refuses `sched_getaffinity` with a buffer shorter than its `nr_cpu_ids`, and a
//! fixed set could not name CPUs from 1024 up.
//!
//! The masks are read and written by `os` (`sched_getaffinity` and `sched_setaffinity` on
//! Linux); other systems refuse with an error of kind `Unsupported`.

use super::possible_cpus;
use std::io;
use std::marker::PhantomData;

type Word = crate::os::AffinityWord;
const WORD_BITS: usize = Word::BITS as usize;

/// The most CPUs a mask is grown to when the kernel keeps refusing a buffer as too short:
/// Linux's largest `NR_CPUS` is 8192; this leaves room beyond it.
const LARGEST_MASK_BITS: usize = 1 << 16;

/// A CPU affinity mask of any length, in the kernel's layout: CPU `n` is bit `n % WORD_BITS`
/// of word `n / WORD_BITS`.
#[derive(Clone, PartialEq, Eq)]
struct CpuSet {
    words: Vec<Word>,
}

/// The CPUs as a cpulist (`0-3,8`), not the kernel's words.
impl core::fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_tuple("CpuSet").field(&self.to_cpu_list()).finish()
    }
}

impl CpuSet {
    /// An empty mask with room for `cpus` CPUs.
    fn with_room_for(cpus: usize) -> CpuSet {
        CpuSet {
            words: vec![0; cpus.div_ceil(WORD_BITS).max(1)],
        }
    }

    /// The mask of `cpu` alone.
    fn only(cpu: u32) -> CpuSet {
        let mut set = CpuSet::with_room_for(possible_cpus().max(cpu as usize + 1));
        set.words[cpu as usize / WORD_BITS] |= 1 << (cpu as usize % WORD_BITS);
        set
    }

    fn contains(&self, cpu: u32) -> bool {
        self.words
            .get(cpu as usize / WORD_BITS)
            .is_some_and(|word| word & (1 << (cpu as usize % WORD_BITS)) != 0)
    }

    /// The CPUs in the mask, lowest first.
    fn cpus(&self) -> Vec<u32> {
        (0..self.words.len() * WORD_BITS)
            .map(|cpu| cpu as u32)
            .filter(|&cpu| self.contains(cpu))
            .collect()
    }

    /// The CPUs in the kernel's cpulist format.
    fn to_cpu_list(&self) -> String {
        let mut list = String::new();
        super::write_cpu_list(&mut list, self.cpus().into_iter())
            .expect("writing to a String does not fail");
        list
    }

    /// The affinity mask of thread `tid` (0: the calling thread).
    fn of_thread(tid: i32) -> io::Result<CpuSet> {
        // `possible_cpus` is the kernel's `nr_cpu_ids` when /sys can be read; when it could
        // not be, the count may be short, and the kernel says so with EINVAL: grow and retry.
        CpuSet::of_thread_from(tid, possible_cpus())
    }

    /// As `of_thread`, with a first guess of `bits` for the mask's size.
    fn of_thread_from(tid: i32, mut bits: usize) -> io::Result<CpuSet> {
        loop {
            let mut set = CpuSet::with_room_for(bits);
            let Err(error) = crate::os::get_affinity(tid, &mut set.words) else {
                return Ok(set);
            };
            if error.raw_os_error() != Some(libc::EINVAL) || bits >= LARGEST_MASK_BITS {
                return Err(error);
            }
            bits = (bits * 2).max(WORD_BITS * 2);
        }
    }

    /// Makes this the affinity mask of thread `tid` (0: the calling thread). The kernel
    /// refuses a mask without any CPU that the thread's cpuset allows and that is online.
    fn apply_to(&self, tid: i32) -> io::Result<()> {
        crate::os::set_affinity(tid, &self.words)
    }
}

/// The CPUs the calling thread may run on now (its affinity mask, as `sched_getaffinity`
/// reports it), lowest first. Other threads, and `taskset` from outside, can change it at any
/// time. The kernel reports only active CPUs: an offline CPU in the thread's mask (which
/// `/proc/thread-self/status` still lists) is not among them. On systems other than Linux:
/// an error of kind [`io::ErrorKind::Unsupported`].
///
/// ```
/// // Linux only: elsewhere an `Unsupported` error.
/// let Ok(allowed) = thiscpu::topology::allowed_cpus() else { return };
/// assert!(allowed.contains(&thiscpu::current_cpu()));
/// assert!(allowed.iter().all(|&cpu| (cpu as usize) < thiscpu::topology::possible_cpus()));
/// ```
#[doc(alias = "sched_getaffinity")]
pub fn allowed_cpus() -> io::Result<Vec<u32>> {
    CpuSet::of_thread(0).map(|set| set.cpus())
}

/// The largest CPU the calling thread may run on, read without [`possible_cpus`], which takes
/// it as a floor: `None` where the system does not say.
#[cfg(not(thiscpu_model))]
pub(crate) fn largest_allowed_cpu() -> Option<u32> {
    let set = CpuSet::of_thread_from(0, 1024).ok()?;
    set.cpus().last().copied()
}

/// Pins the calling thread to `cpu`, one of its [`allowed_cpus`], until the returned guard is
/// dropped; the guard then gives the thread back the affinity it had before, as far as
/// [`allowed_cpus`] saw it: CPUs offline at the time of the pin are not given back, so the
/// thread does not follow them when they come online. When this returns `Ok`, the thread runs
/// on `cpu`: the kernel moves a thread that changes its own affinity before the call returns.
///
/// Errors, with nothing changed:
/// - [`io::ErrorKind::InvalidInput`] when `cpu` is not below
///   [`possible_cpus`](super::possible_cpus), or is not among the thread's allowed CPUs
///   (pinning narrows what the thread was given, by `taskset` or a pin in force; to move a
///   pinned thread elsewhere, drop its guard first);
/// - the kernel's error when it refuses (`EINVAL` for a CPU that went offline);
/// - [`io::ErrorKind::Unsupported`] on systems other than Linux, which thiscpu cannot pin.
///
/// ```
/// use thiscpu::topology;
///
/// // Linux only: elsewhere `allowed_cpus` and `pin_to` are `Unsupported` errors.
/// let Ok(allowed) = topology::allowed_cpus() else { return };
/// let cpu = *allowed.last().unwrap();
/// {
///     let _pinned = topology::pin_to(cpu).unwrap();
///     assert_eq!(thiscpu::current_cpu(), cpu);
///     assert_eq!(topology::allowed_cpus().unwrap(), [cpu]);
/// } // the previous affinity is back
/// assert!(topology::pin_to(topology::possible_cpus() as u32).is_err());
/// ```
///
/// To pin threads that a runtime starts, keep the guard with [`PinGuard::keep`]: e.g. a
/// tokio runtime's `on_thread_start` hook pins each new thread to the next allowed CPU.
#[doc(alias = "sched_setaffinity")]
pub fn pin_to(cpu: u32) -> io::Result<PinGuard> {
    if cpu as usize >= possible_cpus() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("CPU {cpu} is not a possible CPU"),
        ));
    }
    let previous = CpuSet::of_thread(0)?;
    if !previous.contains(cpu) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("CPU {cpu} is not among this thread's allowed CPUs"),
        ));
    }
    pin_with_previous(cpu, previous)
}

/// Whether a thread of this process may run on `cpu`, as the affinity masks of its threads
/// (`/proc/self/task`) tell now: the proof a visiting fence needs before it may skip a CPU it
/// cannot run on itself. Threads can have masks of their own (threaded cgroup v2 cpusets,
/// cgroup v1 `tasks`, `sched_setaffinity` of one thread), so the caller's refusal proves
/// nothing about the others. The kernel reports active CPUs only, so an offline CPU is in no
/// mask. Answers `true` (not proven) when the list of threads or a live thread's mask cannot
/// be read; a thread that exited meanwhile (`ESRCH`) runs nowhere.
pub(crate) fn some_thread_may_run_on(cpu: u32) -> bool {
    let Some(tids) = crate::os::thread_ids() else {
        return true;
    };
    for tid in tids {
        match CpuSet::of_thread(tid) {
            Ok(mask) if mask.contains(cpu) => return true,
            Ok(_) => {}
            Err(error) if error.raw_os_error() == Some(libc::ESRCH) => {}
            Err(_) => return true,
        }
    }
    false
}

/// [`pin_to`] without the check against the thread's own mask: the drain of a pool moves its
/// thread to the CPU it drains even when that thread was pinned elsewhere. The kernel still
/// refuses a CPU outside the thread's cpuset or offline.
pub(crate) fn pin_to_beyond_mask(cpu: u32) -> io::Result<PinGuard> {
    pin_with_previous(cpu, CpuSet::of_thread(0)?)
}

fn pin_with_previous(cpu: u32, previous: CpuSet) -> io::Result<PinGuard> {
    CpuSet::only(cpu).apply_to(0)?;
    Ok(PinGuard {
        cpu,
        previous: Some(previous),
        on_this_thread: PhantomData,
    })
}

/// The calling thread pinned to one CPU by [`pin_to`]; dropping it restores the affinity the
/// thread had before (if the kernel still accepts it: a mask whose every CPU went offline or
/// left the thread's cpuset is refused, and the thread stays pinned).
///
/// Not `Send`: it restores the thread it was made on.
///
/// ```compile_fail,E0277
/// let pinned = thiscpu::topology::pin_to(thiscpu::current_cpu()).unwrap();
/// std::thread::spawn(move || drop(pinned));
/// ```
///
/// Its `Debug` names the CPU and the affinity it restores, as cpulists:
///
/// ```
/// use thiscpu::topology;
///
/// let Ok(allowed) = topology::allowed_cpus() else { return }; // Linux only
/// let restores: thiscpu::CpuMask = allowed.iter().copied().collect();
/// let pinned = topology::pin_to(allowed[0]).unwrap();
/// assert_eq!(
///     format!("{pinned:?}"),
///     format!("PinGuard {{ cpu: {}, restores: \"{restores}\" }}", allowed[0])
/// );
/// ```
#[must_use = "dropping the guard at once unpins the thread"]
pub struct PinGuard {
    /// The CPU the thread is pinned to.
    cpu: u32,
    /// `None` once [`keep`](PinGuard::keep) gave the pin up for good.
    previous: Option<CpuSet>,
    on_this_thread: PhantomData<*const ()>,
}

impl PinGuard {
    /// Leaves the thread pinned for good: the previous affinity is not restored.
    ///
    /// ```
    /// use thiscpu::topology;
    ///
    /// let Ok(allowed) = topology::allowed_cpus() else { return }; // Linux only
    /// let cpu = allowed[0];
    /// std::thread::spawn(move || {
    ///     topology::pin_to(cpu).unwrap().keep();
    ///     assert_eq!(topology::allowed_cpus().unwrap(), [cpu]);
    /// })
    /// .join()
    /// .unwrap();
    /// ```
    pub fn keep(mut self) {
        self.previous = None;
    }
}

impl core::fmt::Debug for PinGuard {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let mut guard = f.debug_struct("PinGuard");
        guard.field("cpu", &self.cpu);
        match &self.previous {
            Some(previous) => guard.field("restores", &previous.to_cpu_list()),
            None => guard.field("restores", &"nothing (kept)"),
        };
        guard.finish()
    }
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.previous.take() {
            // Nothing to report to: a refused mask leaves the thread where it is.
            let _ = previous.apply_to(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_holds_cpus_beyond_1024() {
        let set = CpuSet::only(4000);
        assert!(set.contains(4000));
        assert!(!set.contains(3999) && !set.contains(4001) && !set.contains(u32::MAX));
        assert_eq!(set.cpus(), [4000]);
        assert!(set.words.len() * WORD_BITS > 4000);
    }

    // Pins threads: affinity is Linux's (`thiscpu_linux`, set by the build script).
    #[cfg(thiscpu_linux)]
    #[test]
    fn the_pool_may_pin_beyond_the_threads_mask() {
        let allowed = allowed_cpus().unwrap();
        let [first, .., last] = allowed[..] else {
            return; // one allowed CPU: there is nothing beyond it to reach
        };
        std::thread::spawn(move || {
            let _narrowed = pin_to(first).unwrap();
            assert!(pin_to(last).is_err());
            {
                let _moved = pin_to_beyond_mask(last).unwrap();
                assert_eq!(allowed_cpus().unwrap(), [last]);
            }
            assert_eq!(allowed_cpus().unwrap(), [first]);
        })
        .join()
        .unwrap();
    }
}
