//! Four program-shaped tasks modelled on the published allocator benchmarks, each run in a
//! child process whose global allocator is the one measured ([`super::child`]):
//!
//! - [`larson`]: a server in the manner of Larson and Krishnan's benchmark, as mimalloc-bench
//!   runs it: two threads each replace random objects of 8 to 1,000 bytes in an array of
//!   5,000, and after every 10,000 replacements hand their array to the other thread, which
//!   frees and replaces what the first allocated;
//! - [`bignum`]: the small-object churn of a big-number computation, in the manner of `cfrac`:
//!   the convergents of √2 in arbitrary precision, a new number of a few limbs for every sum
//!   and product, each sequence checked by Pell's equation;
//! - [`sharing`]: passive false sharing, in the manner of Hoard's `cache-scratch`: one thread
//!   allocates an 8-byte object for each of two threads on two CPUs, which free it and then
//!   allocate, write and free 8-byte objects of their own; an allocator that gives each of them
//!   the other's neighbour makes every write move a cache line between the CPUs;
//! - [`mixed`]: a long-lived heap that grows and shrinks: a fifth of the objects live
//!   throughout, the rest grow to a peak and are freed down to a tenth, five times, with sizes
//!   from 16 bytes to 64 KiB.
//!
//! Each task checks what it computed, so that an allocator that hands out one object twice
//! fails it rather than speeds it: `larson`'s and `mixed`'s objects carry a tag made from their
//! size in their first byte, checked when they are freed; `bignum`'s numbers must satisfy
//! Pell's equation; `sharing`'s objects must hold what was last written to them. A thread that
//! finds a bad object counts it and goes on, so that its partner never waits for it at a
//! barrier for ever.

use crate::bench::runner::worker_cpus;
use std::hint::black_box;
use std::sync::{Barrier, Mutex};

/// Threads of the two-thread tasks ([`larson`], [`sharing`]).
const THREADS: usize = 2;

/// How big a task is: as documented, or small enough for `--quick`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    Full,
    Quick,
}

impl Size {
    /// `full` for the documented task, `quick` for `--quick`'s.
    fn pick<T>(self, full: T, quick: T) -> T {
        match self {
            Size::Full => full,
            Size::Quick => quick,
        }
    }
}

/// A xorshift step: the tasks' random numbers, the same in every child.
pub fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// An object of a chosen size whose first byte is a tag made from that size.
struct Tagged(Vec<u8>);

impl Tagged {
    fn tag(size: usize) -> u8 {
        (size ^ (size >> 8) ^ 0x5a) as u8
    }

    fn new(size: usize) -> Tagged {
        let mut bytes = Vec::with_capacity(size);
        bytes.push(Tagged::tag(size));
        Tagged(bytes)
    }

    /// Whether the tag is still the one its size made.
    fn intact(&self) -> bool {
        self.0.first() == Some(&Tagged::tag(self.0.capacity()))
    }
}

/// The CPU the `index`th thread of a task runs on.
fn cpu_of(index: usize) -> u32 {
    let cpus = worker_cpus();
    cpus[index % cpus.len()]
}

/// The outcome of a task whose threads counted `bad` objects with a broken tag.
fn judged(task: &str, bad: usize) -> Result<(), String> {
    if bad == 0 {
        Ok(())
    } else {
        Err(format!("{task}: {bad} objects came back with a broken tag"))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Objects each [`larson`] thread holds.
const LARSON_SLOTS: usize = 5000;
/// Replacements a [`larson`] thread makes before it hands its objects over.
const LARSON_REPLACEMENTS: usize = 10_000;

/// Larson's server: see the module's description. 100 rounds (5 with `--quick`).
pub fn larson(size: Size) -> Result<(), String> {
    let rounds = size.pick(100, 5);
    let handed: Mutex<Vec<Option<Vec<Tagged>>>> = Mutex::new((0..THREADS).map(|_| None).collect());
    let round_done = Barrier::new(THREADS);
    let bad: usize = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..THREADS)
            .map(|index| {
                let (handed, round_done) = (&handed, &round_done);
                scope.spawn(move || {
                    let _pinned = thiscpu::topology::pin_to(cpu_of(index)).ok();
                    let mut state = 0x9e37_79b9_7f4a_7c15 ^ (index as u64 + 1);
                    let make = |state: &mut u64| Tagged::new(8 + (xorshift(state) % 993) as usize);
                    let mut held: Vec<Tagged> = (0..LARSON_SLOTS).map(|_| make(&mut state)).collect();
                    let mut bad = 0;
                    for _ in 0..rounds {
                        for _ in 0..LARSON_REPLACEMENTS {
                            let at = (xorshift(&mut state) % LARSON_SLOTS as u64) as usize;
                            let fresh = make(&mut state);
                            bad += usize::from(!std::mem::replace(&mut held[at], fresh).intact());
                        }
                        lock(handed)[(index + 1) % THREADS] = Some(held);
                        round_done.wait();
                        held = lock(handed)[index].take().unwrap_or_default();
                        // Nobody hands over the next round's objects before both took these.
                        round_done.wait();
                    }
                    bad + held.iter().filter(|object| !object.intact()).count()
                })
            })
            .collect();
        workers.into_iter().map(|worker| worker.join().unwrap_or(1)).sum()
    });
    judged("larson", bad)
}

/// A natural number in arbitrary precision: 64-bit limbs, least significant first, no
/// most significant zero limb. Every operation makes a new one, as a big-number library's
/// owned operations do.
#[derive(Debug, PartialEq, Eq)]
struct Natural(Vec<u64>);

impl Natural {
    fn one() -> Natural {
        Natural(vec![1])
    }

    fn add(&self, other: &Natural) -> Natural {
        let (long, short) = if self.0.len() >= other.0.len() {
            (&self.0, &other.0)
        } else {
            (&other.0, &self.0)
        };
        let mut sum = Vec::with_capacity(long.len() + 1);
        let mut carry = 0u64;
        for (i, &limb) in long.iter().enumerate() {
            let (partial, first) = limb.overflowing_add(short.get(i).copied().unwrap_or(0));
            let (total, second) = partial.overflowing_add(carry);
            sum.push(total);
            carry = u64::from(first | second);
        }
        if carry != 0 {
            sum.push(carry);
        }
        Natural(sum)
    }

    fn mul(&self, other: &Natural) -> Natural {
        let mut product = vec![0u64; self.0.len() + other.0.len()];
        for (i, &a) in self.0.iter().enumerate() {
            let mut carry = 0u128;
            for (j, &b) in other.0.iter().enumerate() {
                let wide = u128::from(a) * u128::from(b) + u128::from(product[i + j]) + carry;
                product[i + j] = wide as u64;
                carry = wide >> 64;
            }
            product[i + other.0.len()] = carry as u64;
        }
        while product.last() == Some(&0) {
            product.pop();
        }
        Natural(product)
    }
}

/// Steps of each [`bignum`] sequence: its last numbers have about 6 limbs.
const BIGNUM_STEPS: usize = 300;

/// The convergents p/q of √2 (p' = p + 2q, q' = p + q from 1/1), `BIGNUM_STEPS` steps a
/// sequence, 5,000 sequences (300 with `--quick`); each sequence's last convergent must
/// satisfy Pell's equation p² − 2q² = ±1.
pub fn bignum(size: Size) -> Result<(), String> {
    for sequence in 0..size.pick(5000, 300) {
        let (mut p, mut q) = (Natural::one(), Natural::one());
        for _ in 0..BIGNUM_STEPS {
            let next_p = p.add(&q.add(&q));
            q = p.add(&q);
            p = next_p;
        }
        let p_squared = p.mul(&p);
        let q_squared = q.mul(&q);
        let twice = q_squared.add(&q_squared);
        if p_squared.add(&Natural::one()) != twice && twice.add(&Natural::one()) != p_squared {
            return Err(format!(
                "bignum: sequence {sequence}: p² − 2q² is not ±1 after {BIGNUM_STEPS} steps"
            ));
        }
        black_box((p, q));
    }
    Ok(())
}

/// Writes each [`sharing`] thread makes to each of its objects.
const SHARING_WRITES: usize = 1000;

/// Hoard's `cache-scratch`: see the module's description. Each thread allocates 20,000 objects
/// (1,000 with `--quick`) after freeing the one it was given, both threads at once.
pub fn sharing(size: Size) -> Result<(), String> {
    let objects = size.pick(20_000, 1000);
    let both_freed = Barrier::new(THREADS);
    // Made one after the other by this thread, so that neighbours are likely.
    let given: Vec<Box<[u8; 8]>> = (0..THREADS).map(|_| Box::new([0u8; 8])).collect();
    let bad: usize = std::thread::scope(|scope| {
        let workers: Vec<_> = given
            .into_iter()
            .enumerate()
            .map(|(index, object)| {
                let both_freed = &both_freed;
                scope.spawn(move || {
                    let _pinned = thiscpu::topology::pin_to(cpu_of(index)).ok();
                    drop(object);
                    both_freed.wait();
                    let mut bad = 0;
                    for _ in 0..objects {
                        let mut object = Box::new([0u8; 8]);
                        for write in 0..SHARING_WRITES {
                            object[write % 8] = write as u8;
                            // Every write reaches memory, as a program's updates would.
                            black_box(&mut *object);
                        }
                        let expected: [u8; 8] =
                            std::array::from_fn(|i| ((SHARING_WRITES - 8 + i) % 256) as u8);
                        bad += usize::from(*object != expected);
                    }
                    bad
                })
            })
            .collect();
        workers.into_iter().map(|worker| worker.join().unwrap_or(1)).sum()
    });
    if bad == 0 {
        Ok(())
    } else {
        Err(format!("sharing: {bad} objects did not keep what was written to them"))
    }
}

/// A size for [`mixed`]: spread evenly over the doublings from 16 bytes to 4 KiB, and one in
/// 64 from 4 to 64 KiB.
fn mixed_size(state: &mut u64) -> usize {
    let r = xorshift(state);
    if r.is_multiple_of(64) {
        4096 + ((r >> 6) % (60 * 1024)) as usize
    } else {
        let low = 16usize << ((r >> 6) % 8);
        low + ((r >> 12) % low as u64) as usize
    }
}

/// A heap that grows and shrinks, five times (two with `--quick`): see the module's
/// description. Its peak is 50,000 objects (5,000 with `--quick`), about 40 MB.
pub fn mixed(size: Size) -> Result<(), String> {
    let (cycles, peak) = size.pick((5, 50_000), (2, 5_000));
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut bad = 0;
    let long_lived: Vec<Tagged> = (0..peak / 5)
        .map(|_| Tagged::new(mixed_size(&mut state)))
        .collect();
    let mut churned: Vec<Tagged> = Vec::new();
    for _ in 0..cycles {
        // Grows to the peak, freeing one object at random for every four it makes.
        while long_lived.len() + churned.len() < peak {
            churned.push(Tagged::new(mixed_size(&mut state)));
            if xorshift(&mut state).is_multiple_of(4) {
                let at = (xorshift(&mut state) % churned.len() as u64) as usize;
                bad += usize::from(!churned.swap_remove(at).intact());
            }
        }
        // Shrinks to a tenth of what it grew by, freeing at random.
        while churned.len() > (peak - long_lived.len()) / 10 {
            let at = (xorshift(&mut state) % churned.len() as u64) as usize;
            bad += usize::from(!churned.swap_remove(at).intact());
        }
    }
    bad += long_lived.iter().chain(&churned).filter(|o| !o.intact()).count();
    judged("mixed", bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tasks_run_and_find_nothing_wrong() {
        for task in [larson, bignum, sharing, mixed] {
            task(Size::Quick).unwrap();
        }
    }

    #[test]
    fn a_tag_broken_by_a_write_is_seen() {
        let mut object = Tagged::new(100);
        assert!(object.intact());
        object.0[0] ^= 1;
        assert!(!object.intact());
        assert!(judged("larson", 1).is_err());
    }

    #[test]
    fn the_big_numbers_add_and_multiply_as_u128_does() {
        let mut state = 0x1234_5678_9abc_def1_u64;
        for _ in 0..1000 {
            let (a, b) = (xorshift(&mut state), xorshift(&mut state));
            let wide = |n: u128| {
                let mut limbs = vec![n as u64, (n >> 64) as u64];
                while limbs.last() == Some(&0) {
                    limbs.pop();
                }
                Natural(limbs)
            };
            let (x, y) = (wide(a.into()), wide(b.into()));
            assert_eq!(x.add(&y), wide(u128::from(a) + u128::from(b)));
            assert_eq!(x.mul(&y), wide(u128::from(a) * u128::from(b)));
        }
    }

    #[test]
    fn mixed_sizes_span_16_bytes_to_64_kib() {
        let mut state = 1;
        let sizes: Vec<usize> = (0..100_000).map(|_| mixed_size(&mut state)).collect();
        assert!(sizes.iter().all(|&size| (16..4096 + 60 * 1024).contains(&size)));
        assert!(sizes.iter().any(|&size| size < 32));
        assert!(sizes.iter().any(|&size| size > 32 * 1024));
    }
}
