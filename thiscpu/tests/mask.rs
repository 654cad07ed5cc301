//! `CpuMask`: set semantics over any number of CPUs, no lost update when threads change bits of
//! one word at once, and the kernel's cpulist format.

use thiscpu::CpuMask;

#[test]
fn bits_across_words_behave_like_a_set() {
    let mask = CpuMask::with_capacity(300);
    let cpus = [0u32, 1, 63, 64, 65, 127, 128, 200, 299];
    for &cpu in &cpus {
        assert!(mask.set(cpu), "{cpu} was absent");
        assert!(!mask.set(cpu), "{cpu} already present");
    }
    assert_eq!(mask.count(), cpus.len());
    assert_eq!(mask.iter().collect::<Vec<_>>(), cpus);
    assert_eq!(mask.first(), Some(0));
    assert!(mask.clear(0));
    assert!(!mask.clear(0));
    assert_eq!(mask.first(), Some(1));
    assert!(!mask.contains(0) && mask.contains(299) && !mask.contains(320));
    assert_eq!(mask.to_string(), "1,63-65,127-128,200,299");
    let copy = mask.clone();
    mask.clear_all();
    assert!(mask.is_empty() && mask.first().is_none());
    assert_eq!(copy.count(), cpus.len() - 1);
}

#[test]
#[should_panic(expected = "CPU 64 is beyond the mask's capacity of 64 CPUs")]
fn setting_a_cpu_beyond_the_capacity_panics() {
    let mask = CpuMask::with_capacity(10);
    assert_eq!(mask.capacity(), 64);
    assert!(mask.set(63));
    assert!(mask.contains(63));
    mask.set(64);
}

/// Each thread flips its own bits in shared words many times, with the idle, mixed and
/// alternating patterns; at the end every bit holds its thread's last value, and no
/// concurrent update of a neighbouring bit was lost.
#[test]
fn concurrent_updates_of_one_word_are_never_lost() {
    let threads = 8u32;
    let mask = CpuMask::with_capacity(64 * 2);
    std::thread::scope(|s| {
        for t in 0..threads {
            let mask = &mask;
            s.spawn(move || {
                let bits = [t, t + 8, 64 + t];
                for i in 0..200_000u32 {
                    let bit = bits[(i % 3) as usize];
                    let want = match t % 3 {
                        0 => true,
                        1 => (i / 16) % 2 == 0,
                        _ => i % 2 == 0,
                    };
                    let had = mask.contains(bit);
                    let changed = if want { mask.set(bit) } else { mask.clear(bit) };
                    // Only this thread writes its bits.
                    assert_eq!(changed, had != want, "bit {bit} at step {i}");
                    assert_eq!(mask.contains(bit), want);
                }
                for bit in bits {
                    mask.set(bit);
                }
                mask.clear(t + 8);
            });
        }
    });
    let expected: Vec<u32> = (0..threads).chain(64..64 + threads).collect();
    assert_eq!(mask.iter().collect::<Vec<_>>(), expected);
    assert_eq!(mask.count(), 2 * threads as usize);
}

#[test]
fn set_current_marks_the_cpu_the_thread_runs_on() {
    let mask = CpuMask::new();
    let cpu = mask.set_current();
    assert!(mask.contains(cpu));
    assert!((cpu as usize) < thiscpu::topology::possible_cpus());
    let now = mask.clear_current();
    assert!(!mask.contains(now));
    assert_eq!(mask.count(), usize::from(now != cpu));
}

#[test]
fn display_round_trips_through_the_kernel_parser() {
    let mask: CpuMask = [0, 1]
        .into_iter()
        .filter(|&c| (c as usize) < thiscpu::topology::possible_cpus())
        .collect();
    let listed = thiscpu::topology::parse_cpu_list(&mask.to_string()).unwrap();
    assert_eq!(listed, mask.iter().collect::<Vec<_>>());
    assert!(format!("{mask:?}").starts_with("CpuMask { cpus: \""));
}
