//! The allocator's own heap of small objects, behind the per-CPU caches and their transfer
//! lists: what a miss takes a batch from and a spill gives a batch to when no other CPU has
//! one to hand over or room to take it.
//!
//! # Layout
//! Memory comes from the system in *chunks* of [`CHUNK_BYTES`], aligned to their size, and is
//! never unmapped (its pages are given back instead). A chunk is cut into *spans* of
//! [`SPAN_BYTES`]; each span in use holds objects of one size class, packed from its start at a
//! stride of the class size rounded up to 16 (so every object is aligned to 16, as every cached
//! object must be), with no header per object. The chunk's first span holds the records of its
//! spans, one line each, in its first page, and after it each span's free bitmap (a bit per
//! object, 512 bytes), then a word per span saying how much of it was backed ahead (see
//! [`BACKED_AHEAD`]); the rest of it is never touched. So an address
//! finds its span's record by masking and one shift, and whether the heap owns it by one bit of
//! a map of every chunk the address space can hold ([`ADDRESS_BITS`]): a bitmap reserved at
//! start, whose pages are backed only where chunks are.
//!
//! # Per class
//! Each class has a lock and a doubly linked list of its spans that have room: objects given
//! back (their bits set in the span's bitmap) or a tail never carved. A batch is taken from the
//! first span of the list, lowest free objects first, a fresh span made when the list is
//! empty; a batch given back sets its objects' bits. Neither reads nor writes an object's
//! memory: the objects a spill gives back were freed in whatever order the program chose, and
//! a free list linked through them cost a cache miss per object on both sides (a million
//! 16-byte strings dropped in sorted order took 23 to 27 ms with the list, 13 with the bitmap;
//! a 1 MB JSON parse and drop 8.6 to 8.7 ms against 8.2 to 8.3). A span whose every
//! object came back leaves its class for the free spans, shared by all classes under the
//! pages' lock (taken inside a class's lock, never the other way round). Past
//! [`RETAINED_FREE_SPANS`] free spans (64 MiB), the rest give their pages back to the system at
//! once; [`Heap::return_free_spans`] gives back all of them.
//!
//! # Idle spans
//! The free spans are kept newest first, each stamped with when it was freed. Whenever a span
//! leaves a class or a class takes one (under the pages' lock, a few times per 64 KiB the
//! program's heap changes by, and at most once per quarter of the setting), the spans free for
//! longer than [`idle_return`] give their pages back, from the oldest: a program whose heap shrank for good returns that memory without a
//! call to a release. A program that stops allocating altogether keeps its free spans (at most
//! `RETAINED_FREE_SPANS` of them) until a release; no thread of the heap's own runs meanwhile.
//!
//! # Fork
//! The process's heap (`process_heap`) has a `pthread_atfork` handler that takes every lock
//! before a fork ([`Heap::lock_all`]) and releases them after it in both processes, so a child
//! never inherits a lock held by a thread it does not have.
//!
//! The records' fields are atomics accessed with relaxed loads and stores: every field but the
//! class is read and written only under the lock that owns the span (its class's, or the
//! pages' while it is free), whose acquiring and releasing order them between holders; the
//! class and the count carved are also read without a lock, by [`Heap::object_size`].
//! tests/model_heap.rs compiles this file with loom's atomics (through `heap_words`) and checks
//! the spans' changes between classes and the free spans over their interleavings.

use super::classes::{CLASS_SIZES, CLASSES};
use super::heap_lock::Lock;
use super::heap_words::{self, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use super::transfer::Batch;
use core::ptr::NonNull;
use core::time::Duration;

/// Bytes of one span: the objects of one size class. 64 KiB holds 15 objects of the largest
/// class and 2,048 of the smallest.
pub(super) const SPAN_BYTES: usize = 64 << 10;
/// Bytes the heap maps at once, aligned to their size.
pub(super) const CHUNK_BYTES: usize = 4 << 20;
/// Spans per chunk; the first holds the records.
const SPANS_PER_CHUNK: usize = CHUNK_BYTES / SPAN_BYTES;
/// Bytes of one span's record.
const RECORD_BYTES: usize = 64;
const _: () = assert!(SPANS_PER_CHUNK * RECORD_BYTES <= 4096);
const _: () = assert!(size_of::<SpanRecord>() == RECORD_BYTES);
/// The most objects a span holds: at the smallest stride, 16 bytes.
const MOST_OBJECTS: usize = SPAN_BYTES / 16;
/// Bytes of one span's free bitmap: a bit per object it can hold.
const BITMAP_BYTES: usize = MOST_OBJECTS / 8;
/// Where the chunk's free bitmaps start, after the records' page.
const BITMAPS_OFFSET: usize = 4096;
const _: () = assert!(BITMAPS_OFFSET + SPANS_PER_CHUNK * BITMAP_BYTES <= SPAN_BYTES);
/// Where the chunk's backed marks start, after the bitmaps: a `u32` per span, the bytes from
/// the span's start whose pages were backed ahead of their objects (`os::back_pages`) since
/// they were last given back, 0 in a fresh chunk.
const BACKED_MARKS_OFFSET: usize = BITMAPS_OFFSET + SPANS_PER_CHUNK * BITMAP_BYTES;
const _: () = assert!(BACKED_MARKS_OFFSET + SPANS_PER_CHUNK * 4 <= SPAN_BYTES);
/// A word of the ownership map: `core`'s atomic in every build, since the map is zeroed
/// memory from the system. A chunk's bit is set once, before any object of it is handed out.
type MapWord = core::sync::atomic::AtomicU64;
/// The address bits the ownership map covers: the user half of a 48-bit address space, the
/// largest any supported system hands out without being asked for more (a chunk above it is
/// given back, and the heap does without it).
pub(super) const ADDRESS_BITS: u32 = 48;
/// Chunks the address space holds, one bit each in the ownership map.
const CHUNKS: usize = 1 << (ADDRESS_BITS - CHUNK_BYTES.trailing_zeros());
/// How many free spans keep their pages (64 MiB): a program that frees and allocates in waves
/// reuses them without a fault per page; past this, a freed span's pages go back at once, and
/// below it the idle return gives them back once they stay free. At 64 (4 MiB) a parse of a
/// 1 MB JSON document into `serde_json::Value` and its drop gave 2.1 MiB back and faulted it in
/// again at every parse (`madvise` and the first writes into fresh B-tree nodes were 31 of 100
/// stack samples of a loop of them), and took 11.1 to 11.3 ms against 9.2 to 9.4 at 1,024.
/// glibc's allocator keeps up to as much at the top of its heap: its trim threshold follows
/// its mmap threshold, whose ceiling is 32 MiB on 64-bit systems, to twice that.
pub(super) const RETAINED_FREE_SPANS: usize = 1024;

/// Bytes of a span whose pages are backed at once, when objects are first carved from them:
/// one system call for four pages instead of a page fault each. Backing a page ahead took
/// 1.17 us against 1.70 us for the fault of a first write (64 MiB of fresh 4 KiB pages, on the
/// Intel host of `docs/allocator.md`); a class's span holds at most this much backed and not yet
/// handed out, so the heap's resident size still follows the objects carved.
const BACKED_AHEAD: usize = 16 << 10;

/// Milliseconds a free span keeps its pages before the heap's next change gives them back;
/// `u32::MAX` while the policy is off.
static IDLE_RETURN_MS: core::sync::atomic::AtomicU32 = core::sync::atomic::AtomicU32::new(1000);

/// How long a free span of the own heap keeps its pages before they go back to the system
/// (`madvise(MADV_DONTNEED)`), or `None` if only a release gives them back. One setting for
/// the process, since the heap is one: 1 second unless [`set_idle_return`] changed it.
pub fn idle_return() -> Option<Duration> {
    match IDLE_RETURN_MS.load(Ordering::Relaxed) {
        u32::MAX => None,
        ms => Some(Duration::from_millis(u64::from(ms))),
    }
}

/// Sets how long a free span of the own heap keeps its pages before they go back to the
/// system: `None` turns the policy off (only [`crate::PerCpuAlloc::release`] and
/// `release_idle` give them back then, and past 64 MiB of free spans, a span's pages go back
/// as it is freed). Rounded to whole milliseconds, at most about 49 days. The heap applies it when
/// it next changes: as a span is freed or taken, not from a thread of its own.
///
/// ```
/// use std::time::Duration;
/// thiscpu::allocator::set_idle_return(Some(Duration::from_secs(10)));
/// assert_eq!(thiscpu::allocator::idle_return(), Some(Duration::from_secs(10)));
/// thiscpu::allocator::set_idle_return(None);
/// assert_eq!(thiscpu::allocator::idle_return(), None);
/// thiscpu::allocator::set_idle_return(Some(Duration::from_secs(1)));
/// ```
pub fn set_idle_return(after: Option<Duration>) {
    let ms = match after {
        None => u32::MAX,
        Some(after) => after.as_millis().min(u128::from(u32::MAX - 1)) as u32,
    };
    IDLE_RETURN_MS.store(ms, Ordering::Relaxed);
}

/// One span's state. A record is zero while its span was never used.
#[repr(C, align(64))]
struct SpanRecord {
    /// The span's class plus one while it holds objects; 0 while it is free.
    class: AtomicU32,
    /// Objects carved from the start of the span so far; the rest of it was never handed out.
    carved: AtomicU32,
    /// Objects handed out (to caches, lists or their users) and not given back.
    live: AtomicU32,
    /// Whether the span is on its class's list of spans with room.
    listed: AtomicU32,
    /// Objects given back and not taken again: the bits set in the span's free bitmap.
    free: AtomicU32,
    /// The next and previous records on the span's list (its class's, or a free list of the
    /// pages), 0 at the ends.
    next: AtomicUsize,
    prev: AtomicUsize,
    /// When the span was last freed (`os::coarse_millis`), while it is on the free spans.
    freed_at: AtomicU32,
}

impl SpanRecord {
    /// A record of a span never used: what a fresh chunk's zeroed page reads as.
    fn unused() -> SpanRecord {
        SpanRecord {
            class: AtomicU32::new(0),
            carved: AtomicU32::new(0),
            live: AtomicU32::new(0),
            listed: AtomicU32::new(0),
            free: AtomicU32::new(0),
            next: AtomicUsize::new(0),
            prev: AtomicUsize::new(0),
            freed_at: AtomicU32::new(0),
        }
    }
}

/// A size class's spans with room, under its lock.
#[derive(Debug)]
#[repr(align(128))]
struct ClassSpans {
    lock: Lock,
    /// The first record of the list of spans with room, 0 if none.
    with_room: AtomicUsize,
    /// Spans holding objects of the class.
    spans: AtomicUsize,
}

/// The spans that hold no class, and where fresh ones come from, under `lock`.
#[derive(Debug)]
struct Pages {
    lock: Lock,
    /// Free spans whose pages are resident (records linked by `next`).
    free: AtomicUsize,
    free_count: AtomicUsize,
    /// Free spans whose pages were given back.
    returned: AtomicUsize,
    returned_count: AtomicUsize,
    /// The chunk fresh spans are carved from (0 before the first), and its next span.
    chunk: AtomicUsize,
    next_span: AtomicUsize,
    chunks: AtomicUsize,
    /// Bytes of pages given back since the start.
    returned_bytes: AtomicU64,
    /// When the free spans were last looked over for idle ones (`os::coarse_millis`).
    swept_at: AtomicU32,
}

/// The heap's figures at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct HeapFigures {
    /// Bytes of chunks mapped.
    pub(super) mapped: u64,
    /// Bytes of spans holding a class's objects.
    pub(super) in_use: u64,
    /// Bytes of free spans whose pages are resident.
    pub(super) free_resident: u64,
    /// Bytes of free spans whose pages were given back.
    pub(super) returned: u64,
    /// Bytes of pages given back to the system since the start.
    pub(super) returned_total: u64,
}

/// A heap of small objects. The process has one (`process_heap`); the model checks make
/// their own.
#[derive(Debug)]
pub(super) struct Heap {
    classes: [ClassSpans; CLASSES],
    pages: Pages,
    /// The ownership map: one bit per chunk of the address space, 0 until `reserve_map`.
    owned: AtomicUsize,
}

/// The stride of `class`'s objects in a span.
const fn stride(class: usize) -> usize {
    (CLASS_SIZES[class] + 15) & !15
}

/// Objects of `class` one span holds.
const fn objects_per_span(class: usize) -> usize {
    SPAN_BYTES / stride(class)
}

/// The record of the span that holds `address`, an address inside a chunk of the heap.
///
/// # Safety
/// The heap owns `address`'s chunk ([`Heap::owns`]).
unsafe fn record_of(address: usize) -> &'static SpanRecord {
    let chunk = address & !(CHUNK_BYTES - 1);
    let span = (address & (CHUNK_BYTES - 1)) / SPAN_BYTES;
    // SAFETY: the chunk is mapped for the process's life (chunks are never unmapped) and its
    // first page holds a record per span, zeroed or written only as records (the caller's
    // contract that the heap owns it).
    unsafe { &*((chunk + span * RECORD_BYTES) as *const SpanRecord) }
}

/// The free bitmap of the span whose record is `record`: a bit per object, set while the
/// object is free (given back and not taken since). Plain words, read and written only under
/// the lock that owns the span.
fn bitmap_of(record: &SpanRecord) -> *mut u64 {
    let address = record as *const SpanRecord as usize;
    let chunk = address & !(CHUNK_BYTES - 1);
    (chunk + BITMAPS_OFFSET + (address - chunk) / RECORD_BYTES * BITMAP_BYTES) as *mut u64
}

/// The backed mark of the span whose record is `record`. A plain word, read and written only
/// under the lock that owns the span, as its bitmap is.
fn backed_mark_of(record: &SpanRecord) -> *mut u32 {
    let address = record as *const SpanRecord as usize;
    let chunk = address & !(CHUNK_BYTES - 1);
    (chunk + BACKED_MARKS_OFFSET + (address - chunk) / RECORD_BYTES * 4) as *mut u32
}

/// For each class, 2^32 divided by its stride, rounded up: an offset that is a multiple of
/// the stride, below `SPAN_BYTES`, times it, shifted right by 32, is the object's index (the
/// rounding adds less than `SPAN_BYTES / 2^32` to it), without a division.
const STRIDE_RECIPROCALS: [u64; CLASSES] = {
    let mut reciprocals = [0; CLASSES];
    let mut class = 0;
    while class < CLASSES {
        reciprocals[class] = (1u64 << 32).div_ceil(stride(class) as u64);
        class += 1;
    }
    reciprocals
};

/// The index in its span of the object of `class` at `offset` from the span's start, a
/// multiple of the class's stride.
#[inline]
fn object_index(class: usize, offset: usize) -> usize {
    ((offset as u64 * STRIDE_RECIPROCALS[class]) >> 32) as usize
}

/// The start of the span whose record is `record`.
fn span_start(record: &SpanRecord) -> usize {
    let address = record as *const SpanRecord as usize;
    let chunk = address & !(CHUNK_BYTES - 1);
    chunk + (address - chunk) / RECORD_BYTES * SPAN_BYTES
}

/// The record at `address`, a record's address or 0.
fn record_at(address: usize) -> Option<&'static SpanRecord> {
    // SAFETY: the lists hold only addresses of records in mapped chunks, or 0.
    (address != 0).then(|| unsafe { &*(address as *const SpanRecord) })
}

fn address_of(record: &SpanRecord) -> usize {
    record as *const SpanRecord as usize
}

/// The ranges of spans that one `Heap::take` carved into and that were not backed yet, backed
/// together once the class's lock is released.
#[derive(Default)]
struct BackAhead {
    ranges: [(usize, usize); 4],
    len: usize,
}

impl BackAhead {
    /// The span of `record`, starting at `start`, has objects carved up to `carved_end` bytes
    /// from its start: notes the pages from its backed mark to the end of the `BACKED_AHEAD`
    /// block that holds that end, and moves the mark. Under the class's lock.
    fn note(&mut self, record: &SpanRecord, start: usize, carved_end: usize) {
        let mark = backed_mark_of(record);
        // SAFETY: the span's mark, under its class's lock, which owns it (the caller's).
        let backed = unsafe { mark.read() } as usize;
        if carved_end <= backed {
            return;
        }
        let end = carved_end.next_multiple_of(BACKED_AHEAD).min(SPAN_BYTES);
        // SAFETY: as above.
        unsafe { mark.write(end as u32) };
        if self.len == self.ranges.len() {
            self.back();
        }
        self.ranges[self.len] = (start + backed, end - backed);
        self.len += 1;
    }

    fn back(&mut self) {
        for &(start, length) in &self.ranges[..self.len] {
            // SAFETY: a page-aligned range (span starts and the marks are multiples of
            // `BACKED_AHEAD`) of a span of a mapped chunk (chunks are never unmapped).
            unsafe { crate::os::back_pages(start as *mut u8, length) };
        }
        self.len = 0;
    }
}

impl Heap {
    heap_words::constructor! {
        /// An empty heap, without its ownership map: no chunk is its until `reserve_map`.
        pub(super) fn new() -> Heap {
            Heap {
                classes: heap_words::array_of!(
                    ClassSpans,
                    CLASSES,
                    ClassSpans {
                        lock: Lock::over(AtomicU32::new(0)),
                        with_room: AtomicUsize::new(0),
                        spans: AtomicUsize::new(0),
                    }
                ),
                pages: Pages {
                    lock: Lock::over(AtomicU32::new(0)),
                    free: AtomicUsize::new(0),
                    free_count: AtomicUsize::new(0),
                    returned: AtomicUsize::new(0),
                    returned_count: AtomicUsize::new(0),
                    chunk: AtomicUsize::new(0),
                    next_span: AtomicUsize::new(0),
                    chunks: AtomicUsize::new(0),
                    returned_bytes: AtomicU64::new(0),
                    swept_at: AtomicU32::new(0),
                },
                owned: AtomicUsize::new(0),
            }
        }
    }

    /// Reserves the ownership map, which the heap needs before its first chunk; false if the
    /// system refused it. Called once, before the heap is shared.
    pub(super) fn reserve_map(&self) -> bool {
        let Some(map) = crate::os::reserve_zeroed(CHUNKS / 8) else {
            return false;
        };
        self.owned.store(map.as_ptr() as usize, Ordering::Release);
        true
    }

    /// Takes every lock of the heap, in the order the heap nests them: for a fork.
    pub(super) fn lock_all(&self) {
        for class in &self.classes {
            class.lock.lock();
        }
        self.pages.lock.lock();
    }

    /// Releases every lock `lock_all` took.
    pub(super) fn unlock_all(&self) {
        self.pages.lock.unlock();
        for class in &self.classes {
            class.lock.unlock();
        }
    }

    /// The word of the ownership map that holds `chunk_index`'s bit.
    fn owned_word(&self, chunk_index: usize) -> &MapWord {
        let map = self.owned.load(Ordering::Acquire) as *const MapWord;
        // SAFETY: the map is `CHUNKS / 8` zeroed bytes, mapped for the process's life before
        // the heap was published, and `chunk_index < CHUNKS` (the callers check).
        unsafe { &*map.add(chunk_index / 64) }
    }

    /// Whether `address` lies in a chunk of the heap.
    #[inline]
    pub(super) fn owns(&self, address: usize) -> bool {
        let chunk_index = address >> CHUNK_BYTES.trailing_zeros();
        chunk_index < CHUNKS
            && self.owned_word(chunk_index).load(Ordering::Acquire) & (1 << (chunk_index % 64)) != 0
    }

    /// The usable size of the object at `address` if it is the start of an object the heap
    /// carved (live or free: a free one is in a cache, a list, or a span's bitmap); `None`
    /// for any other address.
    pub(super) fn object_size(&self, address: usize) -> Option<usize> {
        if !self.owns(address) {
            return None;
        }
        // SAFETY: the heap owns the address's chunk.
        let record = unsafe { record_of(address) };
        let class = (record.class.load(Ordering::Acquire) as usize).checked_sub(1)?;
        let offset = address - span_start(record);
        let carved = record.carved.load(Ordering::Relaxed) as usize;
        (class < CLASSES
            && address & (CHUNK_BYTES - 1) >= SPAN_BYTES
            && offset.is_multiple_of(stride(class))
            && offset / stride(class) < carved)
            .then(|| CLASS_SIZES[class])
    }

    /// Whether `address` lies in the heap where no live object starts: in a span that holds
    /// no class (free, or the chunk's records), off the span's stride or past what it carved,
    /// or at an object whose bit is set in the span's bitmap (given back, and not taken since).
    /// False for an address the heap does not own, and for a live object, or one a cache or
    /// list holds.
    /// Takes the span's class's lock: for checking modes.
    pub(super) fn holds_no_object_at(&self, address: usize) -> bool {
        if !self.owns(address) {
            return false;
        }
        // SAFETY: the heap owns the address's chunk.
        let record = unsafe { record_of(address) };
        loop {
            let Some(class) = (record.class.load(Ordering::Acquire) as usize).checked_sub(1) else {
                return true;
            };
            let spans = &self.classes[class];
            spans.lock.lock();
            // The span may have left the class before the lock was taken.
            if record.class.load(Ordering::Relaxed) as usize != class + 1 {
                spans.lock.unlock();
                continue;
            }
            let offset = address - span_start(record);
            let index = offset / stride(class);
            let free = !offset.is_multiple_of(stride(class))
                || address & (CHUNK_BYTES - 1) < SPAN_BYTES
                || index >= record.carved.load(Ordering::Relaxed) as usize
                // SAFETY: the bitmap's word of a carved object, under the class's lock, which
                // owns the span.
                || unsafe { bitmap_of(record).add(index / 64).read() } & (1 << (index % 64)) != 0;
            spans.lock.unlock();
            return free;
        }
    }

    /// Takes up to `want` objects of `class` (at most the batch's room) into `batch`; fewer
    /// only if the system refuses a new chunk.
    pub(super) fn take(&self, class: usize, batch: &mut Batch, want: usize) {
        let spans = &self.classes[class];
        let want = want.min(batch.room());
        let mut took = 0;
        let mut ahead = BackAhead::default();
        spans.lock.lock();
        while took < want {
            let record = match record_at(spans.with_room.load(Ordering::Relaxed)) {
                Some(record) => record,
                None => match self.new_span(class) {
                    Some(record) => {
                        self.link_first(spans, record);
                        spans.spans.fetch_add(1, Ordering::Relaxed);
                        record
                    }
                    None => break,
                },
            };
            let start = span_start(record);
            let capacity = objects_per_span(class) as u32;
            let mut free = record.free.load(Ordering::Relaxed);
            let mut carved = record.carved.load(Ordering::Relaxed);
            let mut live = record.live.load(Ordering::Relaxed);
            let bitmap = bitmap_of(record);
            let mut word_index = 0;
            // The lowest free objects first, a word of the bitmap at a time: no object's
            // memory is read to find them.
            while took < want && free != 0 && word_index < MOST_OBJECTS / 64 {
                // SAFETY: a word of the span's bitmap, under the class's lock, which owns it.
                let mut word = unsafe { bitmap.add(word_index).read() };
                if word != 0 {
                    while word != 0 && took < want {
                        let index = word_index * 64 + word.trailing_zeros() as usize;
                        word &= word - 1;
                        batch.push((start + index * stride(class)) as *mut u8);
                        free -= 1;
                        live += 1;
                        took += 1;
                    }
                    // SAFETY: as above.
                    unsafe { bitmap.add(word_index).write(word) };
                }
                word_index += 1;
            }
            let carved_before = carved;
            while took < want && carved < capacity {
                batch.push((start + carved as usize * stride(class)) as *mut u8);
                carved += 1;
                live += 1;
                took += 1;
            }
            // A class with a single span, as most classes of a small program have, faults its
            // pages one by one as they are written: objects carved into a cache may never be.
            if carved > carved_before && spans.spans.load(Ordering::Relaxed) > 1 {
                ahead.note(record, start, carved as usize * stride(class));
            }
            record.free.store(free, Ordering::Relaxed);
            record.carved.store(carved, Ordering::Relaxed);
            record.live.store(live, Ordering::Relaxed);
            if free == 0 && carved == capacity {
                self.unlink(spans, record);
            }
        }
        spans.lock.unlock();
        // Outside the lock: the ranges lie in spans that hold the batch's objects, which no
        // other thread can free before the caller gives them back, and backing a page that is
        // already backed changes nothing.
        ahead.back();
    }

    /// Gives back the objects of `batch` that the heap owns, every one an object of `class`
    /// it handed out; those it does not own stay in the batch.
    ///
    /// # Safety
    /// Every object of the batch that the heap owns was taken from it for `class` and is the
    /// caller's to give up.
    pub(super) unsafe fn give(&self, class: usize, batch: &mut Batch) {
        let spans = &self.classes[class];
        spans.lock.lock();
        // In place, without a second batch: a free that fills its cache comes here with its
        // own batch on the stack, and a process whose address space is used up (`RLIMIT_AS`)
        // cannot grow its stack by another page for it.
        batch.retain(|object| {
            let address = object as usize;
            if !self.owns(address) {
                return true;
            }
            // SAFETY: the heap owns the chunk.
            let record = unsafe { record_of(address) };
            let index = object_index(class, address - span_start(record));
            // SAFETY: the bitmap's word of an object of the span (the caller's contract),
            // under the class's lock, which owns the span.
            unsafe {
                let word = bitmap_of(record).add(index / 64);
                word.write(word.read() | 1 << (index % 64));
            }
            record
                .free
                .store(record.free.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            let live = record.live.load(Ordering::Relaxed).wrapping_sub(1);
            record.live.store(live, Ordering::Relaxed);
            if record.listed.load(Ordering::Relaxed) == 0 {
                self.link_first(spans, record);
            }
            if live == 0 {
                self.unlink(spans, record);
                spans.spans.fetch_sub(1, Ordering::Relaxed);
                // No later object of the batch is in the span: all of its objects are back.
                self.pages.lock.lock();
                self.free_span(record);
                self.pages.lock.unlock();
            }
            false
        });
        spans.lock.unlock();
    }

    /// Puts `record` first on `spans`'s list. Under the class's lock.
    fn link_first(&self, spans: &ClassSpans, record: &SpanRecord) {
        let first = spans.with_room.load(Ordering::Relaxed);
        record.next.store(first, Ordering::Relaxed);
        record.prev.store(0, Ordering::Relaxed);
        if let Some(first) = record_at(first) {
            first.prev.store(address_of(record), Ordering::Relaxed);
        }
        spans.with_room.store(address_of(record), Ordering::Relaxed);
        record.listed.store(1, Ordering::Relaxed);
    }

    /// Takes `record` off `spans`'s list. Under the class's lock.
    fn unlink(&self, spans: &ClassSpans, record: &SpanRecord) {
        let next = record.next.load(Ordering::Relaxed);
        let prev = record.prev.load(Ordering::Relaxed);
        match record_at(prev) {
            Some(prev) => prev.next.store(next, Ordering::Relaxed),
            None => spans.with_room.store(next, Ordering::Relaxed),
        }
        if let Some(next) = record_at(next) {
            next.prev.store(prev, Ordering::Relaxed);
        }
        record.next.store(0, Ordering::Relaxed);
        record.prev.store(0, Ordering::Relaxed);
        record.listed.store(0, Ordering::Relaxed);
    }

    /// A span for `class`, set up empty: a free one with resident pages, else one whose pages
    /// were given back, else a fresh one. Under the class's lock; takes the pages'.
    fn new_span(&self, class: usize) -> Option<&'static SpanRecord> {
        let pages = &self.pages;
        pages.lock.lock();
        let record = self.pop_free().or_else(|| self.carve_fresh());
        self.return_idle_spans(crate::os::coarse_millis());
        pages.lock.unlock();
        let record = record?;
        record.carved.store(0, Ordering::Relaxed);
        record.live.store(0, Ordering::Relaxed);
        record.free.store(0, Ordering::Relaxed);
        // SAFETY: the span's bitmap, which its class's lock (held) owns from here; the bits of
        // the class it last held are cleared.
        unsafe { bitmap_of(record).cast::<u8>().write_bytes(0, BITMAP_BYTES) };
        record.class.store(class as u32 + 1, Ordering::Release);
        Some(record)
    }

    /// A free span off the lists, resident first. Under the pages' lock.
    fn pop_free(&self) -> Option<&'static SpanRecord> {
        let pages = &self.pages;
        for (list, count) in [
            (&pages.free, &pages.free_count),
            (&pages.returned, &pages.returned_count),
        ] {
            if let Some(record) = record_at(list.load(Ordering::Relaxed)) {
                list.store(record.next.load(Ordering::Relaxed), Ordering::Relaxed);
                count.fetch_sub(1, Ordering::Relaxed);
                record.next.store(0, Ordering::Relaxed);
                return Some(record);
            }
        }
        None
    }

    /// The next never-used span, mapping a chunk when the current one is used up. Under the
    /// pages' lock.
    fn carve_fresh(&self) -> Option<&'static SpanRecord> {
        let pages = &self.pages;
        let mut chunk = pages.chunk.load(Ordering::Relaxed);
        let mut next = pages.next_span.load(Ordering::Relaxed);
        if chunk == 0 || next == SPANS_PER_CHUNK {
            chunk = self.map_chunk()?;
            next = 1;
            pages.chunk.store(chunk, Ordering::Relaxed);
        }
        pages.next_span.store(next + 1, Ordering::Relaxed);
        // SAFETY: the heap owns `chunk`, just mapped or the current one.
        Some(unsafe { record_of(chunk + next * SPAN_BYTES) })
    }

    /// Maps a chunk and marks it owned. Under the pages' lock.
    fn map_chunk(&self) -> Option<usize> {
        let chunk = crate::os::map_aligned(CHUNK_BYTES)?.as_ptr() as usize;
        let chunk_index = chunk >> CHUNK_BYTES.trailing_zeros();
        if chunk_index >= CHUNKS {
            // SAFETY: a mapping of `map_aligned`, of `CHUNK_BYTES`, used by nothing.
            unsafe {
                crate::os::unreserve(NonNull::new(chunk as *mut u8)?, CHUNK_BYTES);
            }
            return None;
        }
        if !heap_words::RECORDS_START_ZEROED {
            for span in 0..SPANS_PER_CHUNK {
                // SAFETY: the chunk's first page is the records', just mapped and not yet
                // reachable by any other thread (its bit is set below).
                unsafe {
                    ((chunk + span * RECORD_BYTES) as *mut SpanRecord).write(SpanRecord::unused())
                };
            }
        }
        #[cfg(thiscpu_lsan)]
        super::caches::leak_roots::register(chunk as *const u8, CHUNK_BYTES);
        self.owned_word(chunk_index)
            .fetch_or(1 << (chunk_index % 64), Ordering::Release);
        self.pages.chunks.fetch_add(1, Ordering::Relaxed);
        Some(chunk)
    }

    /// Puts the emptied span `record` on the free spans, giving its pages back if more than
    /// `RETAINED_FREE_SPANS` are resident. Under the pages' lock.
    fn free_span(&self, record: &'static SpanRecord) {
        let pages = &self.pages;
        record.class.store(0, Ordering::Release);
        if pages.free_count.load(Ordering::Relaxed) >= RETAINED_FREE_SPANS {
            self.give_pages_back(record);
            return;
        }
        let now = crate::os::coarse_millis();
        record.freed_at.store(now, Ordering::Relaxed);
        record
            .next
            .store(pages.free.load(Ordering::Relaxed), Ordering::Relaxed);
        pages.free.store(address_of(record), Ordering::Relaxed);
        pages.free_count.fetch_add(1, Ordering::Relaxed);
        self.return_idle_spans(now);
    }

    /// Gives back the pages of the free spans freed longer than `idle_return()` ago (`now`
    /// is the clock's time): the list's tail, since it is kept newest first. Looks at most
    /// once per quarter of that time, so that a program that frees and takes spans often does
    /// not walk the list at every one. Under the pages' lock.
    fn return_idle_spans(&self, now: u32) {
        let idle_ms = IDLE_RETURN_MS.load(Ordering::Relaxed);
        let pages = &self.pages;
        if idle_ms == u32::MAX
            || pages.free_count.load(Ordering::Relaxed) == 0
            || now.wrapping_sub(pages.swept_at.load(Ordering::Relaxed)) < idle_ms / 4
        {
            return;
        }
        pages.swept_at.store(now, Ordering::Relaxed);
        let is_idle = |record: &SpanRecord| {
            now.wrapping_sub(record.freed_at.load(Ordering::Relaxed)) >= idle_ms
        };
        // The link that holds the first idle span: the list's head, or a record's `next`.
        let mut link = &pages.free;
        while let Some(record) = record_at(link.load(Ordering::Relaxed)) {
            if is_idle(record) {
                break;
            }
            link = &record.next;
        }
        let mut idle = link.load(Ordering::Relaxed);
        link.store(0, Ordering::Relaxed);
        while let Some(record) = record_at(idle) {
            idle = record.next.load(Ordering::Relaxed);
            pages.free_count.fetch_sub(1, Ordering::Relaxed);
            self.give_pages_back(record);
        }
    }

    /// Gives a free span's pages back and puts it on the returned list. Under the pages'
    /// lock.
    fn give_pages_back(&self, record: &'static SpanRecord) {
        let pages = &self.pages;
        let start = span_start(record);
        // SAFETY: a whole span of a mapped chunk, page-aligned, holding no object (it is
        // free: every object came back).
        unsafe {
            crate::os::return_pages(NonNull::new(start as *mut u8).expect("a span"), SPAN_BYTES)
        };
        // SAFETY: the span's mark, under the pages' lock, which owns the span while it is free.
        unsafe { backed_mark_of(record).write(0) };
        record
            .next
            .store(pages.returned.load(Ordering::Relaxed), Ordering::Relaxed);
        pages.returned.store(address_of(record), Ordering::Relaxed);
        pages.returned_count.fetch_add(1, Ordering::Relaxed);
        pages
            .returned_bytes
            .fetch_add(SPAN_BYTES as u64, Ordering::Relaxed);
    }

    /// Gives the pages of every free span back to the system; the bytes given back.
    pub(super) fn return_free_spans(&self) -> u64 {
        let pages = &self.pages;
        pages.lock.lock();
        let mut bytes = 0;
        while let Some(record) = record_at(pages.free.load(Ordering::Relaxed)) {
            pages
                .free
                .store(record.next.load(Ordering::Relaxed), Ordering::Relaxed);
            pages.free_count.fetch_sub(1, Ordering::Relaxed);
            self.give_pages_back(record);
            bytes += SPAN_BYTES as u64;
        }
        pages.lock.unlock();
        bytes
    }

    /// The heap's figures now, read without locks (each a moment stale while others work).
    pub(super) fn figures(&self) -> HeapFigures {
        let pages = &self.pages;
        let spans: usize = self
            .classes
            .iter()
            .map(|class| class.spans.load(Ordering::Relaxed))
            .sum();
        HeapFigures {
            mapped: (pages.chunks.load(Ordering::Relaxed) * CHUNK_BYTES) as u64,
            in_use: (spans * SPAN_BYTES) as u64,
            free_resident: (pages.free_count.load(Ordering::Relaxed) * SPAN_BYTES) as u64,
            returned: (pages.returned_count.load(Ordering::Relaxed) * SPAN_BYTES) as u64,
            returned_total: pages.returned_bytes.load(Ordering::Relaxed),
        }
    }

    /// Checks every record of the chunk spans are carved from against the lists and counts
    /// that describe it, under every lock, and returns how many objects its spans have handed
    /// out and not taken back. Complete for a heap of one chunk, as the model checks make;
    /// panics on the first inconsistency. (Only where the heap maps chunks.)
    #[cfg(all(test, thiscpu_linux))]
    #[cfg_attr(thiscpu_model, allow(dead_code))]
    pub(super) fn audit(&self) -> usize {
        self.lock_all();
        let pages = &self.pages;
        assert_eq!(
            pages.chunks.load(Ordering::Relaxed),
            1,
            "the audit covers one chunk"
        );
        let list = |head: &AtomicUsize| {
            let mut records = std::vec::Vec::new();
            let mut next = head.load(Ordering::Relaxed);
            while let Some(record) = record_at(next) {
                assert!(records.len() < SPANS_PER_CHUNK, "a list that loops");
                records.push(next);
                next = record.next.load(Ordering::Relaxed);
            }
            records
        };
        let free = list(&pages.free);
        let returned = list(&pages.returned);
        assert_eq!(free.len(), pages.free_count.load(Ordering::Relaxed));
        assert_eq!(returned.len(), pages.returned_count.load(Ordering::Relaxed));
        let with_room: std::vec::Vec<_> = self.classes.iter().map(|c| list(&c.with_room)).collect();
        for (class, records) in with_room.iter().enumerate() {
            let mut prev = 0;
            for &address in records {
                let record = record_at(address).expect("a record");
                assert_eq!(
                    record.prev.load(Ordering::Relaxed),
                    prev,
                    "a broken back link"
                );
                assert_eq!(record.class.load(Ordering::Relaxed) as usize, class + 1);
                prev = address;
            }
        }
        let chunk = pages.chunk.load(Ordering::Relaxed);
        let mut in_class = [0usize; CLASSES];
        let mut live_objects = 0;
        for span in 1..pages.next_span.load(Ordering::Relaxed) {
            // SAFETY: a span of the heap's current chunk.
            let record = unsafe { record_of(chunk + span * SPAN_BYTES) };
            let address = address_of(record);
            let listed = record.listed.load(Ordering::Relaxed) == 1;
            let Some(class) = (record.class.load(Ordering::Relaxed) as usize).checked_sub(1) else {
                assert!(!listed, "a free span on a class's list");
                let on_free_lists = free.iter().chain(&returned).filter(|&&r| r == address);
                assert_eq!(on_free_lists.count(), 1, "a free span not on one free list");
                continue;
            };
            in_class[class] += 1;
            let carved = record.carved.load(Ordering::Relaxed) as usize;
            let live = record.live.load(Ordering::Relaxed) as usize;
            // SAFETY: the span's bitmap, under its class's lock.
            let bitmap =
                unsafe { core::slice::from_raw_parts(bitmap_of(record), MOST_OBJECTS / 64) };
            let free_objects: std::vec::Vec<usize> = (0..MOST_OBJECTS)
                .filter(|&index| bitmap[index / 64] & (1 << (index % 64)) != 0)
                .collect();
            assert!(
                free_objects.iter().all(|&index| index < carved),
                "a free bit for an object never carved"
            );
            assert_eq!(
                free_objects.len(),
                record.free.load(Ordering::Relaxed) as usize,
                "the free count and the bitmap disagree"
            );
            assert_eq!(live + free_objects.len(), carved, "objects lost or made up");
            assert!(live > 0, "a span of a class with no object out");
            let has_room = !free_objects.is_empty() || carved < objects_per_span(class);
            assert_eq!(
                listed, has_room,
                "a span listed with no room, or unlisted with room"
            );
            assert_eq!(
                with_room[class].contains(&address),
                listed,
                "the listed mark and the list disagree"
            );
            live_objects += live;
        }
        for (class, spans) in self.classes.iter().enumerate() {
            assert_eq!(spans.spans.load(Ordering::Relaxed), in_class[class]);
        }
        self.unlock_all();
        live_objects
    }
}

/// Where the heap maps chunks (elsewhere it never starts), with `core`'s atomics.
#[cfg(all(test, thiscpu_linux, not(thiscpu_model)))]
mod tests {
    use super::*;
    use crate::allocator::transfer::MAX_BATCH;

    fn take(heap: &Heap, class: usize, count: usize) -> Vec<usize> {
        let mut batch = Batch::new();
        heap.take(class, &mut batch, count);
        core::iter::from_fn(|| batch.pop().map(|object| object as usize)).collect()
    }

    fn give(heap: &Heap, class: usize, objects: &[usize]) {
        for objects in objects.chunks(MAX_BATCH) {
            let mut batch = Batch::new();
            for &object in objects {
                batch.push(object as *mut u8);
            }
            // SAFETY: every object was taken from `heap` for `class`, and is given up here.
            unsafe { heap.give(class, &mut batch) };
            assert_eq!(batch.len(), 0);
        }
    }

    /// `count` objects of `class`, a batch at a time.
    fn take_many(heap: &Heap, class: usize, count: usize) -> Vec<usize> {
        let mut objects = Vec::new();
        while objects.len() < count {
            let taken = take(heap, class, (count - objects.len()).min(MAX_BATCH));
            assert!(
                !taken.is_empty(),
                "the heap had no memory for class {class}"
            );
            objects.extend(taken);
        }
        objects
    }

    #[test]
    fn every_object_of_every_class_finds_its_index_without_a_division() {
        for class in 0..CLASSES {
            for index in 0..objects_per_span(class) {
                assert_eq!(
                    object_index(class, index * stride(class)),
                    index,
                    "class {class}"
                );
            }
        }
    }

    /// A heap of its own, on the system's memory, through every state a span has: carved,
    /// full, emptied, reused by another class, and given back to the system.
    #[test]
    fn spans_change_state_as_their_objects_go_and_come_back() {
        let heap = Heap::new();
        assert!(heap.reserve_map());
        let (largest, smallest) = (CLASSES - 1, 0);
        let per_span = objects_per_span(largest);
        let full = take(&heap, largest, per_span);
        assert_eq!(heap.audit(), per_span);
        assert!(
            full.iter()
                .all(|&object| heap.object_size(object) == Some(CLASS_SIZES[largest]))
        );
        let second = take(&heap, largest, 1);
        assert_eq!(heap.figures().in_use, 2 * SPAN_BYTES as u64);
        give(&heap, largest, &full);
        assert_eq!(heap.audit(), 1);
        assert!(
            full.iter()
                .all(|&object| heap.object_size(object).is_none())
        );
        assert_eq!(heap.figures().free_resident, SPAN_BYTES as u64);
        // The emptied span serves the next class that needs one, from its start.
        let small = take(&heap, smallest, 3);
        assert!(small.contains(&full.iter().copied().min().unwrap()));
        assert_eq!(heap.audit(), 4);
        give(&heap, smallest, &small);
        give(&heap, largest, &second);
        assert_eq!(heap.audit(), 0);
        assert_eq!(heap.figures().in_use, 0);
        assert_eq!(heap.return_free_spans(), 2 * SPAN_BYTES as u64);
        assert_eq!(heap.figures().returned, 2 * SPAN_BYTES as u64);
        assert_eq!(heap.audit(), 0);
    }

    /// Which of the pages of `length` bytes from `start`, page-aligned, are resident.
    fn resident_pages(start: usize, length: usize) -> Vec<bool> {
        let mut pages = vec![0u8; length / 4096];
        // SAFETY: a page-aligned range of a chunk's mapping, and a vector of one byte per
        // page of it.
        let done = unsafe { libc::mincore(start as *mut libc::c_void, length, pages.as_mut_ptr()) };
        assert_eq!(done, 0, "mincore: {}", std::io::Error::last_os_error());
        pages.iter().map(|&page| page & 1 == 1).collect()
    }

    /// A system that backs pages ahead (Linux 5.14 and later): one `madvise` on a fresh
    /// mapping, and `mincore` to see that the page is now resident, since an emulator
    /// (qemu-user) may accept the advice and do nothing.
    fn kernel_backs_ahead() -> bool {
        let chunk = crate::os::map_aligned(CHUNK_BYTES)
            .expect("a chunk")
            .as_ptr();
        // SAFETY: the first page of the chunk just mapped, which nothing else uses.
        let advised = unsafe { libc::madvise(chunk.cast(), 4096, libc::MADV_POPULATE_WRITE) } == 0;
        let backed = advised && resident_pages(chunk as usize, 4096) == [true];
        // SAFETY: the whole aligned mapping just made, used by nothing.
        unsafe { libc::munmap(chunk.cast(), CHUNK_BYTES) };
        backed
    }

    /// A class's first span is left to fault page by page as its objects are written. Once
    /// the class needs a second span, carving backs the `BACKED_AHEAD` block the carved
    /// objects end in, the next block only when objects are carved from it; and a span whose
    /// pages went back to the system is backed again when it is carved again. The objects here
    /// are never written, so only backing makes pages resident.
    #[test]
    fn carving_backs_pages_a_block_ahead_of_the_objects() {
        if !kernel_backs_ahead() {
            eprintln!("skipped: the kernel cannot back pages ahead (MADV_POPULATE_WRITE)");
            return;
        }
        let heap = Heap::new();
        assert!(heap.reserve_map());
        let class = 0;
        let block = BACKED_AHEAD / 4096;
        let per_block = BACKED_AHEAD / stride(class);
        let whole_span = take_many(&heap, class, objects_per_span(class));
        let first_span = *whole_span.iter().min().unwrap();
        assert!(
            resident_pages(first_span, SPAN_BYTES)
                .iter()
                .all(|&page| !page)
        );
        // The second span: one object backs its first block whole, and nothing else.
        let one = take(&heap, class, 1);
        let start = one[0];
        assert_eq!(start % SPAN_BYTES, 0, "the first object starts its span");
        let pages = resident_pages(start, SPAN_BYTES);
        assert!(pages[..block].iter().all(|&page| page), "{pages:?}");
        assert!(pages[block..].iter().all(|&page| !page), "{pages:?}");
        // Objects into the second block back it whole.
        let more = take_many(&heap, class, per_block);
        let pages = resident_pages(start, SPAN_BYTES);
        assert!(pages[..2 * block].iter().all(|&page| page), "{pages:?}");
        assert!(pages[2 * block..].iter().all(|&page| !page), "{pages:?}");
        give(&heap, class, &one);
        give(&heap, class, &more);
        assert_eq!(heap.return_free_spans(), SPAN_BYTES as u64);
        assert!(resident_pages(start, SPAN_BYTES).iter().all(|&page| !page));
        let again = take(&heap, class, 1);
        assert_eq!(again, one, "the span is carved again from its start");
        let pages = resident_pages(start, SPAN_BYTES);
        assert!(pages[..block].iter().all(|&page| page), "{pages:?}");
        give(&heap, class, &again);
        give(&heap, class, &whole_span);
    }
}
