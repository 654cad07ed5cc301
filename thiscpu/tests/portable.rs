//! The portable path, where thiscpu has no restartable sequences (`thiscpu_rseq` unset by the
//! build script: every system but Linux, Linux on other architectures, and any build with
//! `--cfg thiscpu_portable`): what `source()` reports, that every answer is in range, that
//! updates stay exact with atomics, and what the Linux-only services answer elsewhere. Built
//! with an rseq port, it checks the other side: that such a build never takes that path.

#[cfg(thiscpu_rseq)]
#[test]
fn a_build_with_an_rseq_port_never_takes_the_portable_path() {
    use thiscpu::{CpuSource, Unavailable};
    let source = thiscpu::source();
    assert_ne!(
        source.unavailable,
        Some(Unavailable::NotPorted),
        "{source:?}"
    );
    assert!(
        matches!(
            source.fallback,
            CpuSource::Rdpid | CpuSource::Vdso | CpuSource::Syscall
        ),
        "{source:?}"
    );
}

#[cfg(not(thiscpu_rseq))]
mod portable {
    use std::sync::Arc;
    use thiscpu::{Counter, CpuSource, Registrar, Sharded, Unavailable, topology};

    /// The source each system is expected to answer with (the first of `via`'s `CPU_SOURCES` that works).
    fn expected_source() -> CpuSource {
        if cfg!(any(target_os = "linux", target_os = "freebsd")) {
            CpuSource::SchedGetcpu
        } else if cfg!(target_vendor = "apple") {
            CpuSource::PthreadCpuNumber
        } else if cfg!(windows) {
            CpuSource::ProcessorNumber
        } else {
            CpuSource::ThreadIndex
        }
    }

    #[test]
    fn nobody_registers_and_the_systems_own_number_answers() {
        let source = thiscpu::source();
        assert_eq!(source.registrar, Registrar::None, "{source:?}");
        assert_eq!(source.unavailable, Some(Unavailable::NotPorted));
        assert_eq!(source.mode, None);
        assert_eq!(source.area_offset, None);
        assert!(!source.node_id && !source.mm_cid);
        assert_eq!(source.fallback, expected_source(), "{source:?}");
        assert_eq!(source.this_thread, source.fallback);
        assert_eq!(thiscpu::mm_cid(), None);
    }

    #[test]
    fn every_answer_is_a_possible_cpu_on_its_node() {
        let possible = topology::possible_cpus();
        let threads: Vec<_> = (0..8)
            .map(|_| {
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        assert!((thiscpu::current_cpu() as usize) < possible);
                        let here = thiscpu::getcpu();
                        assert!((here.cpu as usize) < possible);
                        assert_eq!(topology::node_of_cpu(here.cpu), Some(here.node));
                        assert_eq!(here.node, thiscpu::current_node());
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert!(!topology::online_cpus().is_empty());
    }

    #[test]
    fn counters_and_shards_stay_exact_with_atomics() {
        const THREADS: u64 = 8;
        const ROUNDS: u64 = 20_000;
        let counter = Arc::new(Counter::new());
        let sharded = Arc::new(Sharded::new(|_| 0u64));
        assert!(!sharded.uses_rseq() && !sharded.indexed_by_mm_cid());
        let threads: Vec<_> = (0..THREADS)
            .map(|_| {
                let (counter, sharded) = (counter.clone(), sharded.clone());
                std::thread::spawn(move || {
                    for _ in 0..ROUNDS {
                        counter.inc();
                        sharded.with_current(|shard| *shard += 1);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(counter.sum(), THREADS * ROUNDS);
        assert_eq!(sharded.fold(0, |sum, shard| sum + *shard), THREADS * ROUNDS);
    }

    /// Off Linux there are no fences and no affinity masks: documented errors, never a panic.
    #[cfg(not(thiscpu_linux))]
    #[test]
    fn fences_and_pinning_say_they_are_unavailable() {
        assert!(!thiscpu::fence::available());
        assert!(thiscpu::fence::register().is_err());
        assert!(thiscpu::fence::fence_all().is_err());
        assert!(thiscpu::fence::visit_cpu(0).is_err());
        let unsupported = std::io::ErrorKind::Unsupported;
        assert_eq!(topology::pin_to(0).unwrap_err().kind(), unsupported);
        assert_eq!(topology::allowed_cpus().unwrap_err().kind(), unsupported);
    }
}
