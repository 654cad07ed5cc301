//! Draining another CPU's cache: [`Pool::drain_cpu`] and [`Pool::drain_all`], what they
//! report, and the fallback that migrates the drainer where membarrier is refused.
//!
//! The protocol, while threads on CPU `c` go on using the pool:
//! 1. the drainer sets `c`'s `stopped` flag (only drainers write it, atomically; drains of one
//!    pool are serialized);
//! 2. it fences CPU `c` with `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ)` targeted at
//!    `c`: every section on `c` that started before the flag was visible is aborted or already
//!    committed, and every later one sees the flag and leaves (steps 1, 2 and 4 are
//!    [`crate::fence::take_over`], which [`crate::Sharded`]'s readers use too);
//! 3. `c`'s count and slots are now the drainer's alone: it takes the objects and stores 0
//!    into the count;
//! 4. it clears the flag with a release store; sections on `c` resume with an empty stack.
//!
//! Meanwhile a `get` or `put` that finds the flag set uses the shared list.
//!
//! # Safety
//! The drainer owns a stopped and fenced stack; the block that takes it states why.

use super::stacks::Stacks;
use super::{Caches, Pool, lock};
use crate::fence::{self, FenceUnavailable};
use crate::ops::{self, StackOutcome};
use crate::topology;

/// How [`Pool::drain_cpu`] reached the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DrainMethod {
    /// The `stopped` flag and a membarrier fence of the CPU.
    Fence,
    /// The drainer moved itself to the CPU and popped there (membarrier refused).
    Migrate,
    /// The process has no rseq: the cache is a locked vector.
    Lock,
}

/// What a drain moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Drained {
    /// Objects moved from the CPU's cache to the shared list.
    pub objects: usize,
    /// How the cache was reached.
    pub method: DrainMethod,
}

/// Why a drain did nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DrainError {
    /// The CPU is beyond the pool's caches (not a possible CPU).
    NoSuchCpu(u32),
    /// membarrier is refused here, and the fallback could not run on the CPU (not in this
    /// thread's allowed CPUs, offline, or this thread has no rseq).
    Unavailable(FenceUnavailable),
}

impl core::fmt::Display for DrainError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            DrainError::NoSuchCpu(cpu) => write!(f, "CPU {cpu} is not a possible CPU"),
            DrainError::Unavailable(why) => write!(
                f,
                "cannot drain another CPU's cache: {why}, and this thread cannot run there"
            ),
        }
    }
}

impl std::error::Error for DrainError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DrainError::NoSuchCpu(_) => None,
            DrainError::Unavailable(why) => Some(why),
        }
    }
}

/// What [`Pool::drain_all`] did when some CPU's cache could not be drained: the objects it
/// moved from the others, and each CPU it could not reach with the reason.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DrainAllError {
    /// Objects moved to the shared list from the caches that could be drained.
    pub moved: usize,
    /// The CPUs whose cache stayed as it was, in CPU order, each with its reason.
    pub failed: Vec<(u32, DrainError)>,
}

impl core::fmt::Display for DrainAllError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "moved {} objects, but {} CPU caches could not be drained",
            self.moved,
            self.failed.len()
        )?;
        if let Some((cpu, why)) = self.failed.first() {
            write!(f, " (CPU {cpu}: {why})")?;
        }
        Ok(())
    }
}

impl std::error::Error for DrainAllError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.failed
            .first()
            .map(|(_, why)| why as &(dyn std::error::Error + 'static))
    }
}

impl<T> Pool<T> {
    /// Moves CPU `cpu`'s cached objects to the shared list, while threads on `cpu` keep using
    /// the pool (see the module documentation for the protocol and its fallback). Objects
    /// pushed during the drain may stay in the cache.
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| 0u8);
    /// pool.put(1);
    /// let cpu = pool.touched().first().unwrap_or(0);
    /// match pool.drain_cpu(cpu) {
    ///     Ok(drained) => assert_eq!(pool.cached_on(cpu), 0, "{drained:?}"),
    ///     Err(why) => println!("{why}"),
    /// }
    /// ```
    pub fn drain_cpu(&self, cpu: u32) -> Result<Drained, DrainError> {
        let taken = match &self.caches {
            Caches::Locked(lists) => {
                let list = lists.get(cpu as usize).ok_or(DrainError::NoSuchCpu(cpu))?;
                let mut taken = core::mem::take(&mut *lock(list));
                let objects = taken.len();
                lock(&self.shared).append(&mut taken);
                return Ok(Drained {
                    objects,
                    method: DrainMethod::Lock,
                });
            }
            Caches::Rseq(stacks) => {
                if cpu as usize >= stacks.heads.len() {
                    return Err(DrainError::NoSuchCpu(cpu));
                }
                let _one_drain_at_a_time = lock(&self.drains);
                match self.drain_fenced(stacks, cpu) {
                    Ok(taken) => (taken, DrainMethod::Fence),
                    Err(refused) => (
                        self.drain_by_migrating(stacks, cpu)
                            .ok_or(DrainError::Unavailable(refused))?,
                        DrainMethod::Migrate,
                    ),
                }
            }
        };
        let (mut objects, method) = taken;
        let count = objects.len();
        lock(&self.shared).append(&mut objects);
        Ok(Drained {
            objects: count,
            method,
        })
    }

    /// Drains every touched CPU's cache ([`drain_cpu`](Pool::drain_cpu)); returns how many
    /// objects moved. A CPU that cannot be drained does not stop the others: the error then
    /// says what was moved anyway and which CPUs were not reached.
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| 0u8);
    /// pool.put(1);
    /// let moved = match pool.drain_all() {
    ///     Ok(moved) => moved,
    ///     Err(partial) => partial.moved,
    /// };
    /// assert_eq!(pool.shared_len(), moved);
    /// ```
    pub fn drain_all(&self) -> Result<usize, DrainAllError> {
        let mut moved = 0;
        let mut failed = Vec::new();
        for cpu in self.touched.iter() {
            match self.drain_cpu(cpu) {
                Ok(drained) => moved += drained.objects,
                Err(why) => failed.push((cpu, why)),
            }
        }
        if failed.is_empty() {
            Ok(moved)
        } else {
            Err(DrainAllError { moved, failed })
        }
    }

    /// Steps 1-4 of the drain protocol. The caller holds the drain lock.
    fn drain_fenced(&self, stacks: &Stacks, cpu: u32) -> Result<Vec<Box<T>>, FenceUnavailable> {
        let head = &stacks.heads[cpu as usize];
        // Sections never write `stopped`, and drains are serialized, so the flag is 0 here and
        // still 1 after the fence: the take-over cannot come back empty-handed.
        let Some(_taken_over) = fence::take_over(Some(cpu), &head.stopped, 0, 1)? else {
            debug_assert!(false, "only drainers write the stopped flag, one at a time");
            return Ok(Vec::new());
        };
        // SAFETY: the take-over returned: no section on `cpu` that missed the flag can commit
        // any more, and every later one leaves at the flag, so the count and slots are ours
        // until the guard clears the flag (with a release store, paired with the sections'
        // load of `stopped`, a load-acquire on aarch64: a section that sees the flag clear
        // sees the count of 0); the fence also made the sections' plain stores visible here.
        Ok(unsafe { self.take_stack(stacks, cpu) })
    }

    /// The fallback: run on `cpu` and pop its stack there. `None` if this thread cannot.
    fn drain_by_migrating(&self, stacks: &Stacks, cpu: u32) -> Option<Vec<Box<T>>> {
        ops::position()?;
        // Restores this thread's affinity when the function returns.
        let _pinned = topology::pin_to_beyond_mask(cpu).ok()?;
        let mut taken = Vec::new();
        // `sched_setaffinity` on oneself returns on an allowed CPU; pop while there. Pushes by
        // other threads on `cpu` meanwhile may refill the stack: stop after a full stack's
        // worth beyond what was there.
        let limit = self.cached_on(cpu) + self.capacity;
        let mut attempts = 0;
        while taken.len() < limit && attempts < 4 * limit + 16 {
            attempts += 1;
            let Some(at) = ops::position() else { break };
            if at.index() != cpu {
                crate::sync::yield_now();
                continue;
            }
            match self.pop_at(stacks, at) {
                Ok(object) => taken.push(object),
                Err(StackOutcome::Aborted) => ops::note_abort(),
                Err(_) => break,
            }
        }
        Some(taken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mask::CpuMask;
    use crate::percpu::CachePadded;
    use crate::sync::Mutex;
    use crate::sync::atomic::AtomicU64;

    /// A pool with locked caches for `caches` CPUs, whose touched mask also names CPUs beyond
    /// them, as a CPU whose drain fails.
    fn pool_with_unreachable_cpus(caches: usize, touched: &[u32]) -> Pool<u8> {
        let pool = Pool {
            caches: Caches::Locked(
                (0..caches)
                    .map(|_| CachePadded(Mutex::new(Vec::new())))
                    .collect(),
            ),
            capacity: 8,
            batch: 4,
            touched: CpuMask::with_capacity(caches + touched.len()),
            shared: CachePadded(Mutex::new(Vec::new())),
            drains: Mutex::new(()),
            created: AtomicU64::new(0),
            make: Box::new(|| 0),
        };
        for &cpu in touched {
            pool.touched.set(cpu);
        }
        pool
    }

    #[test]
    fn drain_all_reports_what_it_moved_when_a_cpu_fails() {
        let pool = pool_with_unreachable_cpus(1, &[0, 1]);
        let Caches::Locked(lists) = &pool.caches else {
            unreachable!()
        };
        lock(&lists[0]).extend([Box::new(1), Box::new(2), Box::new(3)]);
        let partial = pool.drain_all().expect_err("CPU 1 has no cache");
        assert_eq!(partial.moved, 3);
        assert_eq!(partial.failed, vec![(1, DrainError::NoSuchCpu(1))]);
        assert_eq!(pool.shared_len(), 3);
        let source = std::error::Error::source(&partial).expect("the first failure");
        assert_eq!(source.to_string(), DrainError::NoSuchCpu(1).to_string());
        assert!(partial.to_string().contains("moved 3 objects"), "{partial}");
    }

    #[test]
    fn drain_error_names_the_fence_error_as_its_source() {
        let refused = crate::fence::FenceUnavailable::refused(libc::EPERM);
        let error = DrainError::Unavailable(refused);
        let source = std::error::Error::source(&error).expect("the fence's error");
        assert_eq!(source.to_string(), refused.to_string());
        assert!(std::error::Error::source(&DrainError::NoSuchCpu(7)).is_none());
    }
}
