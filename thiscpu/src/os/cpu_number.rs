//! The CPU numbers that systems other than Linux's kernel interface give, each where it exists,
//! and the per-thread index that stands in where none does. Every function exists on every
//! target and answers `None` where its system lacks it, so that `via` can offer each by name.
//!
//! # Safety
//! Each call into the system's library passes valid pointers; each block states why it holds.

/// glibc's (or FreeBSD's, 13.1+) `sched_getcpu`: glibc 2.35+ reads its rseq area, older ones
/// the vDSO. `None` where it failed or the system has none.
#[inline]
pub(crate) fn sched_getcpu() -> Option<u32> {
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
    {
        // SAFETY: no precondition.
        u32::try_from(unsafe { libc::sched_getcpu() }).ok()
    }
    #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
    {
        None
    }
}

/// `pthread_cpu_number_np` (macOS 11+, iOS 14.2+), which reads the CPU number the kernel keeps
/// for the thread without a system call. Apple calls the register it comes from private, so
/// the function is called, never the register read. Looked up at run time, once: a program
/// built for an older macOS still runs there, without it.
#[inline]
pub(crate) fn pthread_cpu_number() -> Option<u32> {
    #[cfg(target_vendor = "apple")]
    {
        use core::sync::atomic::{AtomicUsize, Ordering};
        type CpuNumber = unsafe extern "C" fn(*mut libc::size_t) -> libc::c_int;
        const MISSING: usize = 1;
        static FUNCTION: AtomicUsize = AtomicUsize::new(0);
        let mut address = FUNCTION.load(Ordering::Relaxed);
        if address == 0 {
            // SAFETY: `dlsym` with `RTLD_DEFAULT` and a NUL-terminated name has no precondition.
            let symbol =
                unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"pthread_cpu_number_np".as_ptr()) };
            address = if symbol.is_null() {
                MISSING
            } else {
                symbol as usize
            };
            FUNCTION.store(address, Ordering::Relaxed);
        }
        if address == MISSING {
            return None;
        }
        // SAFETY: `address` is `pthread_cpu_number_np`, declared in <pthread.h> as
        // `int pthread_cpu_number_np(size_t *cpu_number_out)`.
        let function = unsafe { core::mem::transmute::<usize, CpuNumber>(address) };
        let mut cpu: libc::size_t = 0;
        // SAFETY: the function writes one `size_t` through a valid pointer.
        let ret = unsafe { function(&mut cpu) };
        if ret == 0 {
            u32::try_from(cpu).ok()
        } else {
            None
        }
    }
    #[cfg(not(target_vendor = "apple"))]
    {
        None
    }
}

/// `GetCurrentProcessorNumberEx` (Windows 7+), made one flat index: a machine with more than
/// 64 logical processors has them in groups, each numbered from 0, and the index is the
/// processors of the groups before this one plus the number within it.
#[inline]
pub(crate) fn processor_number() -> Option<u32> {
    #[cfg(windows)]
    {
        use std::sync::OnceLock;
        use windows_sys::Win32::System::Kernel::PROCESSOR_NUMBER;
        use windows_sys::Win32::System::Threading::{
            GetActiveProcessorCount, GetActiveProcessorGroupCount, GetCurrentProcessorNumberEx,
        };
        static GROUP_STARTS: OnceLock<Box<[u32]>> = OnceLock::new();
        let mut number = PROCESSOR_NUMBER {
            Group: 0,
            Number: 0,
            Reserved: 0,
        };
        // SAFETY: the function writes one `PROCESSOR_NUMBER` through a valid pointer.
        unsafe { GetCurrentProcessorNumberEx(&mut number) };
        let starts = GROUP_STARTS.get_or_init(|| {
            // SAFETY: neither function has a precondition.
            let groups = unsafe { GetActiveProcessorGroupCount() };
            let mut start = 0u32;
            (0..groups)
                .map(|group| {
                    let this = start;
                    // SAFETY: as above.
                    start += unsafe { GetActiveProcessorCount(group) };
                    this
                })
                .collect()
        });
        let start = starts.get(usize::from(number.Group)).copied().unwrap_or(0);
        Some(start + u32::from(number.Number))
    }
    #[cfg(not(windows))]
    {
        None
    }
}

/// A number of the calling thread's own, given in the order threads first ask (0, 1, 2, ...),
/// for systems that tell no CPU: threads still spread over the per-CPU slots, each keeping to
/// one, as the `thread_local` crate spreads its values. The caller folds it into range.
#[inline]
pub(crate) fn thread_index() -> u32 {
    use core::sync::atomic::{AtomicU32, Ordering};
    use std::cell::Cell;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    thread_local! {
        static INDEX: Cell<u32> = const { Cell::new(u32::MAX) };
    }
    let take = || NEXT.fetch_add(1, Ordering::Relaxed) & (u32::MAX >> 1);
    // A thread being torn down has lost its index; any number is a valid slot.
    INDEX
        .try_with(|index| {
            if index.get() == u32::MAX {
                index.set(take());
            }
            index.get()
        })
        .unwrap_or_else(|_| take())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_keeps_its_index_and_threads_get_different_ones() {
        let mine = thread_index();
        assert_eq!(thread_index(), mine);
        let theirs = std::thread::spawn(thread_index).join().unwrap();
        assert_ne!(theirs, mine);
    }

    #[test]
    fn each_source_answers_where_its_system_has_it() {
        assert_eq!(
            sched_getcpu().is_some(),
            cfg!(any(target_os = "linux", target_os = "freebsd"))
        );
        assert_eq!(
            pthread_cpu_number().is_some(),
            cfg!(target_vendor = "apple")
        );
        assert_eq!(processor_number().is_some(), cfg!(windows));
    }
}
