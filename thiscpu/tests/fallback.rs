//! The other ways to ask "which CPU": each `via::` source against the kernel's own answer, and
//! the fallback chain's choice against what the machine offers.
//!
//! The sources compared are Linux's (`thiscpu_linux`, set by the build script); tests/portable.rs checks the other targets' source.
#![cfg(thiscpu_linux)]

mod common;

use common::*;
use thiscpu::{CpuNode, CpuSource, topology, via};

#[test]
fn every_source_agrees_with_the_kernel_when_pinned() {
    let _restore = AffinityGuard::new();
    let mut seen = Vec::new();
    for cpu in allowed_cpus() {
        pin(cpu);
        let (kernel_cpu, node) = kernel_getcpu();
        assert_eq!(kernel_cpu, cpu);
        assert_eq!(
            topology::node_of_cpu(cpu),
            Some(node),
            "/sys vs getcpu syscall"
        );
        let expected = CpuNode { cpu, node };
        for round in 0..20 {
            let at = format!("pinned to CPU {cpu}, round {round}");
            assert_eq!(via::syscall(), Some(expected), "via::syscall(), {at}");
            if let Some(answer) = via::vdso() {
                assert_eq!(answer, expected, "via::vdso(), {at}");
                seen.push("vdso");
            }
            if let Some(answer) = via::rdpid() {
                assert_eq!(answer, expected, "via::rdpid(), {at}");
                seen.push("rdpid");
            }
            if let Some(answer) = via::rdtscp() {
                assert_eq!(answer, expected, "via::rdtscp(), {at}");
                seen.push("rdtscp");
            }
            if let Some(answer) = via::sched_getcpu() {
                assert_eq!(answer, cpu, "via::sched_getcpu(), {at}");
                seen.push("sched_getcpu");
            }
        }
    }
    seen.sort_unstable();
    seen.dedup();
    eprintln!("sources present besides the syscall: {seen:?}");
}

#[test]
fn the_fallback_is_the_first_source_the_machine_offers() {
    let source = thiscpu::source();
    // Without an rseq port (`thiscpu_rseq` unset by the build script) glibc's `sched_getcpu`
    // comes first: it reads glibc's rseq area where the kernel fills it.
    let expected = if !cfg!(thiscpu_rseq) && via::sched_getcpu().is_some() {
        CpuSource::SchedGetcpu
    } else if via::rdpid().is_some() {
        CpuSource::Rdpid
    } else if via::vdso().is_some() {
        CpuSource::Vdso
    } else {
        CpuSource::Syscall
    };
    assert_eq!(source.fallback, expected, "{source:?}");
}

#[test]
fn sources_answer_for_the_moving_thread_too() {
    for _ in 0..20 {
        let both = |(cpu, node)| CpuNode { cpu, node };
        agrees_with_kernel(|| via::syscall().unwrap(), both)
            .unwrap_or_else(|e| panic!("via::syscall(): {e}"));
        if via::vdso().is_some() {
            agrees_with_kernel(|| via::vdso().unwrap(), both)
                .unwrap_or_else(|e| panic!("via::vdso(): {e}"));
        }
        if via::rdpid().is_some() {
            agrees_with_kernel(|| via::rdpid().unwrap(), both)
                .unwrap_or_else(|e| panic!("via::rdpid(): {e}"));
        }
        if via::rdtscp().is_some() {
            agrees_with_kernel(|| via::rdtscp().unwrap(), both)
                .unwrap_or_else(|e| panic!("via::rdtscp(): {e}"));
        }
    }
}

/// A refused `getcpu` system call is reported as such, and the library still answers with a
/// valid CPU.
// Its seccomp filter is written for the architectures with an rseq port (`thiscpu_rseq`).
#[cfg(thiscpu_rseq)]
#[test]
fn getcpu_refused_by_seccomp_is_reported() {
    if std::env::var_os(SECCOMP_CHILD).is_some() {
        assert_eq!(
            via::syscall(),
            None,
            "getcpu is refused, yet via::syscall() answered"
        );
        assert_eq!(kernel_getcpu_errno(), Some(libc::EPERM));
        let cpu = thiscpu::current_cpu();
        assert!((cpu as usize) < topology::possible_cpus(), "cpu {cpu}");
        let here = thiscpu::getcpu();
        assert!((here.cpu as usize) < topology::possible_cpus(), "{here:?}");
        return;
    }
    rerun_under_seccomp(
        "getcpu_refused_by_seccomp_is_reported",
        refuse_syscall_program(libc::SYS_getcpu, libc::EPERM),
    );
}

/// The errno of the raw `getcpu` system call, `None` if it succeeds.
#[cfg(thiscpu_rseq)]
fn kernel_getcpu_errno() -> Option<i32> {
    let (mut cpu, mut node) = (0u32, 0u32);
    // SAFETY: getcpu writes two `unsigned int`s through valid pointers; the cache may be null.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_getcpu,
            &mut cpu,
            &mut node,
            std::ptr::null_mut::<u8>(),
        )
    };
    (ret != 0).then(|| std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
}

/// The CPU instructions are only used where CPUID says the CPU has them.
#[cfg(target_arch = "x86_64")]
#[test]
fn cpu_instructions_only_where_cpuid_has_them() {
    #[allow(unused_unsafe)]
    fn cpuid(leaf: u32) -> std::arch::x86_64::CpuidResult {
        // SAFETY: CPUID exists on every x86_64 CPU (the intrinsic is safe since Rust 1.94).
        unsafe { std::arch::x86_64::__cpuid_count(leaf, 0) }
    }
    let has_rdpid = cpuid(7).ecx & (1 << 22) != 0;
    let has_rdtscp =
        cpuid(0x8000_0000).eax >= 0x8000_0001 && cpuid(0x8000_0001).edx & (1 << 27) != 0;
    if via::rdpid().is_some() {
        assert!(has_rdpid, "via::rdpid() answered but CPUID has no RDPID");
    }
    if via::rdtscp().is_some() {
        assert!(has_rdtscp, "via::rdtscp() answered but CPUID has no RDTSCP");
    }
}
