//! Checks of the architecture contract, run on every architecture (natively on x86_64, in the
//! arm64 and riscv64 test VMs): where the areas are, that the fast path reads the active one,
//! and that each section commits, compares, aborts and arms a descriptor as the kernel
//! requires.

use super::*;
use crate::abi::{RseqCs, offset};
use crate::registration::{self, Registrar};

/// The descriptor the calling thread's active area points at, right after a section ran;
/// `None` if the kernel already cleared it (it does so lazily, at the next preemption or
/// signal after the section).
fn last_descriptor() -> Option<&'static RseqCs> {
    let area = area_at(area_offset().area_start());
    // SAFETY: the active area is this thread's; `rseq_cs` is an aligned 64-bit field.
    let cs = unsafe { core::ptr::addr_of!((*area).rseq_cs).read_volatile() };
    // SAFETY: a non-zero `rseq_cs` was stored by one of this module's sections (the kernel
    // only ever clears it), so it points at a descriptor in `__rseq_cs`, which is static.
    (cs != 0).then(|| unsafe { &*(cs as *const RseqCs) })
}

/// What the kernel checks before it aborts a section (see `rseq_get_rseq_cs`): version and
/// flags 0, the abort address outside the section, the signature right before it.
fn check_descriptor(cs: &RseqCs) {
    assert_eq!(cs as *const RseqCs as usize % 32, 0, "descriptor alignment");
    assert_eq!((cs.version, cs.flags), (0, 0));
    assert!(cs.post_commit_offset > 0 && cs.post_commit_offset < 256);
    let end = cs.start_ip + cs.post_commit_offset;
    assert!(
        cs.abort_ip < cs.start_ip || cs.abort_ip >= end,
        "abort inside the section"
    );
    // SAFETY: the four bytes before `abort_ip` are the signature word emitted with it (an
    // instruction's operand on x86_64, a word of its own elsewhere), in an executable
    // (readable) section.
    let sig = unsafe { ((cs.abort_ip - 4) as *const u32).read_unaligned() };
    assert_eq!(sig, RSEQ_SIG);
}

fn register() -> bool {
    registration::ensure_registered()
}

#[test]
fn own_area_is_aligned_static_tls_and_starts_unregistered() {
    let own = own_area_offset();
    assert!(is_static_tls_offset(own), "own area offset {own}");
    // Aligned for the largest registration the area can hold (optimized mode on 7.2).
    assert_eq!(
        area_at(own) as usize % crate::abi::OWN_AREA_CAPACITY as usize,
        0
    );
    // A fresh thread that never asked thiscpu anything has the initial image.
    let (offset, cpu_id, rseq_cs) = std::thread::spawn(|| {
        let area = area_at(own_area_offset());
        // SAFETY: this thread's own area, live while the thread runs; aligned fields.
        unsafe {
            (
                own_area_offset(),
                core::ptr::addr_of!((*area).cpu_id).read_volatile(),
                core::ptr::addr_of!((*area).rseq_cs).read_volatile(),
            )
        }
    })
    .join()
    .unwrap();
    assert_eq!(offset, own, "the offset is the same in every thread");
    assert_eq!((cpu_id, rseq_cs), (-1, 0));
}

#[test]
fn area_offset_follows_the_registrar() {
    let process = registration::decided().expect("decided before the tests");
    let active = area_offset().area_start();
    match process.rseq.registrar {
        Registrar::Glibc => assert_eq!(Some(active), process.rseq.glibc_rseq_offset),
        _ => assert_eq!(active, own_area_offset()),
    }
}

#[test]
fn fast_path_reads_the_active_area() {
    let registered = register();
    let area = area_at(area_offset().area_start());
    for _ in 0..1000 {
        // SAFETY: the active area is this thread's; aligned 32-bit fields.
        let (start, id, mm_cid) = unsafe {
            (
                core::ptr::addr_of!((*area).cpu_id_start).read_volatile(),
                core::ptr::addr_of!((*area).cpu_id).read_volatile(),
                core::ptr::addr_of!((*area).mm_cid).read_volatile(),
            )
        };
        let fast = active_field::<{ offset::CPU_ID }>();
        let start_field = active_field::<{ offset::CPU_ID_START }>() as u32;
        let mm_cid_field = active_field::<{ offset::MM_CID }>() as u32;
        if fast == id && start_field == start && mm_cid_field == mm_cid {
            // Unregistered (no rseq in this process): the fast path sees -1 or -2 and
            // takes the slow path.
            assert_eq!(fast >= 0, registered, "cpu_id {fast}");
            return;
        }
    }
    panic!("the fast path never agreed with the area it should read");
}

#[test]
fn load_cpu_node_arms_a_valid_descriptor() {
    if !register() {
        return;
    }
    for _ in 0..10_000 {
        if let Some((cpu, _node)) = load_cpu_node(area_offset()) {
            assert!(cpu >= 0);
            if let Some(cs) = last_descriptor() {
                check_descriptor(cs);
                return;
            }
        }
    }
    panic!("load_cpu_node never completed with its descriptor still armed");
}

/// Runs `section` at the current position until it ends with `want` and the area is still
/// armed right after it, then checks the descriptor it armed.
fn until_armed(want: Outcome<()>, mut section: impl FnMut(AreaOffset, u32) -> Outcome<()>) {
    for _ in 0..10_000 {
        let offset = area_offset();
        let index = field_at::<{ offset::CPU_ID }>(offset);
        assert!(index >= 0);
        if section(offset, index as u32) == want
            && let Some(cs) = last_descriptor()
        {
            check_descriptor(cs);
            return;
        }
    }
    panic!("no section ended with {want:?} and its descriptor still armed");
}

#[test]
fn load_add_store_commits_and_arms_a_valid_descriptor() {
    if !register() {
        return;
    }
    let (mut word, mut commits) = (0u64, 0u64);
    until_armed(Outcome::Committed(()), |offset, index| {
        // SAFETY: `offset` and `index` were just read from this thread's area; `word` is a
        // local that only this thread touches.
        let outcome = unsafe { load_add_store::<{ offset::CPU_ID }>(offset, index, &mut word, 5) };
        commits += u64::from(outcome == Outcome::Committed(()));
        outcome
    });
    assert_eq!(word, 5 * commits);
}

#[test]
fn load_cbne_store_compares_commits_and_arms_a_valid_descriptor() {
    if !register() {
        return;
    }
    let mut word = 5u64;
    until_armed(Outcome::Mismatch, |offset, index| {
        // SAFETY: as above.
        unsafe { load_cbne_store::<{ offset::CPU_ID }>(offset, index, &mut word, 4, 9) }
    });
    assert_eq!(word, 5);
    let mut commits = 0u64;
    until_armed(Outcome::Committed(()), |offset, index| {
        let expect = word;
        // SAFETY: as above.
        let outcome = unsafe {
            load_cbne_store::<{ offset::CPU_ID }>(offset, index, &mut word, expect, expect + 1)
        };
        commits += u64::from(outcome == Outcome::Committed(()));
        outcome
    });
    assert_eq!(word, 5 + commits);
}

#[test]
fn load_cbeq_load_store_pops_and_arms_a_valid_descriptor() {
    if !register() {
        return;
    }
    let (mut head, mut out) = (0usize, 0usize);
    until_armed(Outcome::Mismatch, |offset, index| {
        // SAFETY: as above; the list is empty.
        unsafe { load_cbeq_load_store::<{ offset::CPU_ID }, 8>(offset, index, &mut head, &mut out) }
    });
    // A one-node list: `node[1]` is the node's `next` field, at byte offset 8.
    let mut node = [0usize; 2];
    let node_address = node.as_mut_ptr() as usize;
    until_armed(Outcome::Committed(()), |offset, index| {
        if head == 0 {
            (head, out) = (node_address, 0);
        }
        // SAFETY: as above; `head` is null or points at `node`, whose `next` is null.
        unsafe { load_cbeq_load_store::<{ offset::CPU_ID }, 8>(offset, index, &mut head, &mut out) }
    });
    assert_eq!((out, head), (node_address, 0));
    assert_eq!(node[1], 0);
}

#[test]
fn a_stale_index_aborts() {
    if !register() {
        return;
    }
    let mut word = 0u64;
    let offset = area_offset();
    let index = field_at::<{ offset::CPU_ID }>(offset) as u32;
    // SAFETY: as in the test above, with an index that is never this thread's CPU.
    let outcome = unsafe {
        load_add_store::<{ offset::CPU_ID }>(offset, index.wrapping_add(1 << 20), &mut word, 1)
    };
    assert_eq!(outcome, Outcome::Aborted);
    assert_eq!(word, 0);
}

/// Stacks for the sections that find their CPU's stack themselves: one per CPU,
/// `1 << STACK_SHIFT` bytes (`STACK_WORDS` words) apart, each a head and `STACK_SLOTS` slots.
const STACK_SHIFT: u32 = 7;
const STACK_WORDS: usize = 16;
const STACK_SLOTS: u64 = 4;

struct HereStacks {
    words: Vec<u64>,
    cpus: usize,
}

impl HereStacks {
    fn new(cpus: usize) -> HereStacks {
        HereStacks {
            words: vec![0; cpus * STACK_WORDS],
            cpus,
        }
    }

    /// CPU 0's head and slots.
    fn base(&mut self) -> (*const StackHead, *mut usize) {
        let words = self.words.as_mut_ptr();
        (words.cast(), words.wrapping_add(2).cast())
    }

    /// One push onto the stack of the CPU the thread runs on, seen by the section as one of
    /// `cpus`; retried while the kernel aborts it.
    fn push(&mut self, cpus: usize, item: usize) -> StackOutcome {
        assert!(cpus <= self.cpus);
        let (head, slots) = self.base();
        for _ in 0..10_000 {
            // SAFETY: CPU `c`'s head and slots (4 of them) are `c << STACK_SHIFT` bytes after
            // CPU 0's, inside `words` for every `c < cpus`; only this thread uses them.
            let outcome = unsafe {
                stack_push_here(
                    area_offset(),
                    cpus as u64,
                    STACK_SHIFT,
                    head,
                    slots,
                    STACK_SLOTS,
                    item,
                )
            };
            if outcome != StackOutcome::Aborted || cpus == 0 {
                return outcome;
            }
        }
        StackOutcome::Aborted
    }

    /// One pop, as `push`: the item, or 0 after an abort, an empty or a stopped stack.
    fn pop(&mut self, cpus: usize) -> usize {
        assert!(cpus <= self.cpus);
        let (head, slots) = self.base();
        // SAFETY: as in `push`.
        unsafe { stack_pop_here(area_offset(), cpus as u64, STACK_SHIFT, head, slots) }
    }

    /// CPU `cpu`'s words: count, stopped, then the slots.
    fn of(&self, cpu: usize) -> &[u64] {
        &self.words[cpu * STACK_WORDS..][..STACK_WORDS]
    }
}

#[test]
fn here_sections_use_the_stack_of_the_cpu_they_run_on() {
    if !register() {
        return;
    }
    let cpu = *crate::topology::allowed_cpus().unwrap().last().unwrap();
    let _pin = crate::topology::pin_to(cpu).unwrap();
    let cpu = cpu as usize;
    let cpus = crate::topology::possible_cpus();
    let mut stacks = HereStacks::new(cpus);
    for item in 1..=STACK_SLOTS as usize {
        assert_eq!(stacks.push(cpus, item), StackOutcome::Committed);
    }
    assert_eq!(stacks.push(cpus, 99), StackOutcome::Refused);
    assert_eq!(stacks.of(cpu)[..6], [4, 0, 1, 2, 3, 4]);
    for other in (0..cpus).filter(|&other| other != cpu) {
        assert!(
            stacks.of(other).iter().all(|&word| word == 0),
            "CPU {other}"
        );
    }
    let mut armed = false;
    for _ in 0..10_000 {
        let item = stacks.pop(cpus);
        if item == 0 {
            continue;
        }
        assert_eq!(stacks.push(cpus, item), StackOutcome::Committed);
        if let Some(cs) = last_descriptor() {
            check_descriptor(cs);
            armed = true;
            break;
        }
    }
    assert!(armed, "no push ended with its descriptor still armed");

    // A stopped stack refuses both, and neither touches it.
    stacks.words[cpu * STACK_WORDS + 1] = 1;
    assert_eq!(stacks.push(cpus, 99), StackOutcome::Stopped);
    assert_eq!(stacks.pop(cpus), 0);
    assert_eq!(stacks.of(cpu)[..6], [4, 1, 1, 2, 3, 4]);
    stacks.words[cpu * STACK_WORDS + 1] = 0;

    // A CPU from `cpus` up has no stack: nothing is read or written.
    assert_eq!(stacks.push(cpu, 99), StackOutcome::Aborted);
    assert_eq!(stacks.pop(cpu), 0);
    assert_eq!(stacks.of(cpu)[..6], [4, 0, 1, 2, 3, 4]);

    // An area that no thread registered reads `cpu_id` as -1: no stack either.
    let blank = AreaOffset(blank_area_offset() + AREA_OFFSET_FIELD as isize);
    let (head, slots) = stacks.base();
    // SAFETY: as in `HereStacks::push`; the blank area is this thread's too.
    let (pushed, popped) = unsafe {
        (
            stack_push_here(
                blank,
                cpus as u64,
                STACK_SHIFT,
                head,
                slots,
                STACK_SLOTS,
                99,
            ),
            stack_pop_here(blank, cpus as u64, STACK_SHIFT, head, slots),
        )
    };
    assert_eq!((pushed, popped), (StackOutcome::Aborted, 0));
    assert_eq!(stacks.of(cpu)[..6], [4, 0, 1, 2, 3, 4]);

    let mut popped = Vec::new();
    for _ in 0..10_000 {
        match stacks.pop(cpus) {
            0 if stacks.of(cpu)[0] == 0 => break,
            0 => {}
            item => popped.push(item),
        }
    }
    assert_eq!(popped, [4, 3, 2, 1]);
    assert_eq!(stacks.pop(cpus), 0);
}

/// Runs a positioned stack section until the kernel lets it end otherwise than by an abort.
fn until_not_aborted(
    mut section: impl FnMut(AreaOffset, u32) -> (StackOutcome, usize),
) -> (StackOutcome, usize) {
    for _ in 0..10_000 {
        let offset = area_offset();
        let index = field_at::<{ offset::CPU_ID }>(offset);
        assert!(index >= 0);
        let ended = section(offset, index as u32);
        if ended.0 != StackOutcome::Aborted {
            return ended;
        }
    }
    panic!("every section aborted");
}

#[test]
fn batch_sections_move_the_top_of_the_stack_in_one_commit() {
    if !register() {
        return;
    }
    const CAPACITY: usize = 8;
    // The head's count and stopped words, then the slots.
    let mut words = [0u64; 2 + CAPACITY];
    let head: *const StackHead = words.as_ptr().cast();
    let slots: *mut usize = words.as_mut_ptr().wrapping_add(2).cast();
    let push = |items: &[usize]| {
        until_not_aborted(|offset, index| {
            // SAFETY: `offset` and `index` were just read from this thread's area; the head and
            // its `CAPACITY` slots are a local that only this thread uses; `items` is valid
            // for its length.
            unsafe {
                stack_push_batch::<{ offset::CPU_ID }>(
                    offset,
                    index,
                    head,
                    slots,
                    CAPACITY as u64,
                    items.as_ptr(),
                    items.len(),
                )
            }
        })
    };
    let pop = |out: &mut [usize]| {
        until_not_aborted(|offset, index| {
            // SAFETY: as in `push`; `out` is valid for its length.
            unsafe {
                stack_pop_batch::<{ offset::CPU_ID }>(
                    offset,
                    index,
                    head,
                    slots,
                    out.as_mut_ptr(),
                    out.len(),
                )
            }
        })
    };
    let words_now = |words: *const u64| {
        // SAFETY: `words` is the local array above, which no section writes meanwhile.
        unsafe { core::slice::from_raw_parts(words, 2 + CAPACITY) }.to_vec()
    };
    let at = words.as_ptr();

    assert_eq!(push(&[11, 12, 13, 14, 15]), (StackOutcome::Committed, 5));
    assert_eq!(words_now(at), [5, 0, 11, 12, 13, 14, 15, 0, 0, 0]);
    // Room for three: the last three go, in their order.
    assert_eq!(push(&[21, 22, 23, 24, 25]), (StackOutcome::Committed, 3));
    assert_eq!(words_now(at), [8, 0, 11, 12, 13, 14, 15, 23, 24, 25]);
    assert_eq!(push(&[31]), (StackOutcome::Refused, 0));
    assert_eq!(push(&[]), (StackOutcome::Committed, 0));

    // The top four come out in their order; then the rest, fewer than asked for.
    let mut out = [0usize; 4];
    assert_eq!(pop(&mut out), (StackOutcome::Committed, 4));
    assert_eq!(out, [15, 23, 24, 25]);
    assert_eq!(words_now(at)[0], 4);
    let mut out = [0usize; 6];
    assert_eq!(pop(&mut out), (StackOutcome::Committed, 4));
    assert_eq!(out[..4], [11, 12, 13, 14]);
    assert_eq!(words_now(at)[0], 0);
    assert_eq!(pop(&mut out), (StackOutcome::Refused, 0));
    assert_eq!(pop(&mut []), (StackOutcome::Committed, 0));

    // A stopped stack refuses both, and neither touches it.
    assert_eq!(push(&[41, 42]), (StackOutcome::Committed, 2));
    // SAFETY: the stopped word of the local array, which no section runs on meanwhile.
    unsafe { words.as_mut_ptr().add(1).write(1) };
    let before = words_now(at);
    assert_eq!(push(&[51]), (StackOutcome::Stopped, 0));
    assert_eq!(pop(&mut out), (StackOutcome::Stopped, 0));
    assert_eq!(words_now(at), before);
    assert_eq!(out[..4], [11, 12, 13, 14], "a stopped pop wrote out");

    // A stale index aborts both before anything is written.
    // SAFETY: as above.
    unsafe { words.as_mut_ptr().add(1).write(0) };
    let before = words_now(at);
    let offset = area_offset();
    let stale = (field_at::<{ offset::CPU_ID }>(offset) as u32).wrapping_add(1 << 20);
    // SAFETY: as in `push`, with an index that is never this thread's CPU.
    let pushed = unsafe {
        stack_push_batch::<{ offset::CPU_ID }>(offset, stale, head, slots, 8, [61].as_ptr(), 1)
    };
    // SAFETY: as in `pop`, with that index.
    let popped = unsafe {
        stack_pop_batch::<{ offset::CPU_ID }>(offset, stale, head, slots, out.as_mut_ptr(), 6)
    };
    assert_eq!(
        (pushed, popped),
        ((StackOutcome::Aborted, 0), (StackOutcome::Aborted, 0))
    );
    assert_eq!(words_now(at), before);
}
