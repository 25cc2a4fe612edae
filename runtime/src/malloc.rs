//! How the process gives freed memory back to the kernel, by state backend. Every allocation
//! of the process goes through glibc's malloc, Rust's and the state store's (RocksDB is C++).
//!
//! The rocksdb backend returns it. glibc gives each thread that contends for the allocator an
//! arena of its own (up to eight per core) and gives memory back only from the top of an
//! arena, so memory freed in the middle of one stays resident. A job on the on-disk backend,
//! whose memory must stay within the pod's limit while its state does not, grew about 2 MB/s
//! that way on a 5M-key count until the limit killed it.
//!
//! The heap backend keeps it for reuse. Its maps grow by allocating a table twice the size and
//! freeing the old one; glibc gave the freed tables back (from the top of an arena, or by
//! unmapping them) and the next growth faulted fresh pages in, which the kernel zeroes first:
//! on the CEL pipeline (8M keys in its dedupe) zeroing pages was 7% of the CPU samples.
//!
//! The heap backend's hash tables come from [`TableAlloc`]: the same allocator, with the tables
//! a restore reserves faulted in on every core before the restore fills them, on small pages
//! ([`populate`]). A heap restore asks the kernel for huge pages where it allocates the long
//! values of the state ([`HugePageHeaps`]): a page fault per 2 MiB instead of per 4 KiB.
//!
//! One of two modules allowed `unsafe` (with `prefetch`): calls into the C library, and the
//! allocator trait.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use allocator_api2::alloc::{AllocError, Allocator, Global};

/// The allocator of the heap backend's hash tables ([`crate::state::map::ShardedMap`]): the
/// global one, except that the blocks allocated inside [`record_tables`] on the same thread
/// are listed, for [`populate`].
#[derive(Clone, Copy, Debug, Default)]
pub struct TableAlloc;

/// Blocks smaller than this are not recorded: a page or two is cheaper to fault in where it
/// is written than to hand to another thread.
const RECORDED_FROM_BYTES: usize = 1 << 20;

/// Tables carved from [`PrefaultedTables`] are a page or larger (smaller ones come from the
/// allocator): each is carved in whole pages.
pub const CARVED_FROM_BYTES: usize = PAGE;

thread_local! {
    /// The blocks (address, length) allocated on this thread inside [`record_tables`].
    static RECORDED: RefCell<Option<Vec<(usize, usize)>>> = const { RefCell::new(None) };
}

// SAFETY: every block comes from `Global` and goes back to it with the layout it was
// allocated with; recording its address changes nothing about it.
unsafe impl Allocator for TableAlloc {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if layout.size() >= CARVED_FROM_BYTES {
            // `try_`, as below. Carved memory is faulted in already: not recorded.
            let carved = CARVING.try_with(|pool| pool.try_borrow().ok()?.as_ref()?.carve(layout)).ok().flatten();
            if let Some(piece) = carved {
                return Ok(piece);
            }
        }
        let block = Global.allocate(layout)?;
        if layout.size() >= RECORDED_FROM_BYTES {
            // `try_`: an allocator must not panic, not even on a thread whose locals are gone.
            let _ = RECORDED.try_with(|recorded| {
                if let Some(list) = recorded.try_borrow_mut().ok().as_deref_mut().and_then(Option::as_mut) {
                    list.push((block.as_ptr().cast::<u8>() as usize, block.len()));
                }
            });
        }
        Ok(block)
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() >= CARVED_FROM_BYTES && unmap_carved(ptr.as_ptr() as usize) {
            return;
        }
        // SAFETY: the caller passes a block `allocate` returned, which `Global` allocated with
        // this layout (it was not carved from a [`PrefaultedTables`]: those are unmapped above).
        unsafe { Global.deallocate(ptr, layout) }
    }
}

thread_local! {
    /// The memory [`TableAlloc`] carves this thread's tables from, inside
    /// [`PrefaultedTables::carve_while`].
    static CARVING: RefCell<Option<Arc<TablePool>>> = const { RefCell::new(None) };
}

/// The pieces carved from [`PrefaultedTables`] and not yet freed: start → length. Only they
/// are unmapped when freed; every other block goes back to `Global`.
static CARVED: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// Unmaps the carved piece at `address`, if it is one; whether it was.
fn unmap_carved(address: usize) -> bool {
    let removed = CARVED.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&address);
    let Some(len) = removed else { return false };
    // SAFETY: the piece was carved from a mapping of this process, page-aligned and `len`
    // long, and its owner is freeing it: nothing refers to it any more.
    unsafe { libc::munmap(address as *mut libc::c_void, len) };
    true
}

/// Memory for the hash tables a heap restore is about to reserve, mapped at once and faulted
/// in on other threads while the restore still downloads its files ([`Self::start`]); the
/// restore then carves its tables from it ([`Self::carve_while`]) instead of faulting fresh
/// tables in once every file is in ([`populate`]). A fresh page costs this VM's kernel 0.5–2
/// µs: 3.36 GB of tables for 90M keys took 0.47–3.6 s to fault in. Where the download waits
/// on the network, that work is off the restore's path: from MinIO behind a 4 Gbit/s link the
/// 90M-key chain restored in 3.79–4.04 s instead of 4.06–4.43 s; on loopback, where the
/// server and the download already keep both cores busy, it made no difference beyond the
/// noise (`runtime/BENCHMARKS.md`, session 48).
///
/// Dropped, it stops faulting pages in; what no table took is unmapped once its threads are
/// done. Each carved piece is unmapped when its table is freed.
#[derive(Debug)]
pub struct PrefaultedTables {
    pool: Arc<TablePool>,
}

/// The mapping behind [`PrefaultedTables`], shared with the threads faulting it in.
#[derive(Debug)]
struct TablePool {
    start: usize,
    len: usize,
    /// The next [`FAULT_CHUNK`] to fault in, and how many chunks are done.
    next_chunk: AtomicUsize,
    chunks_done: AtomicUsize,
    /// Set when faulting in was refused or is no longer wanted.
    stopped: AtomicBool,
    /// Bytes handed out from `start`.
    carved: Mutex<usize>,
}

/// What a thread faults in at a time ([`populate`], [`PrefaultedTables`]).
const FAULT_CHUNK: usize = 2 << 20;

const PAGE: usize = 4096;

impl PrefaultedTables {
    /// Maps `bytes` (rounded up to pages) and starts `threads` threads faulting them in.
    /// `None` when nothing is to be mapped, the mapping fails, or outside Linux.
    pub fn start(bytes: u64, threads: usize) -> Option<PrefaultedTables> {
        let len = usize::try_from(bytes).ok()?.checked_next_multiple_of(PAGE)?;
        let pool = Arc::new(TablePool::map(len)?);
        for _ in 0..threads.max(1) {
            let pool = pool.clone();
            let spawned = std::thread::Builder::new().name("table-prefault".into()).spawn(move || pool.fault_in());
            if spawned.is_err() {
                break;
            }
        }
        tracing::debug!(bytes = len, threads, "faulting in the restored tables' memory");
        Some(PrefaultedTables { pool })
    }

    /// Runs `reserve` with [`TableAlloc`]'s blocks of this thread carved from this memory
    /// while they fit (page-aligned), once all of it is faulted in: this thread helps the
    /// others finish. Returns the blocks that did not fit, allocated as [`record_tables`] does
    /// and listed as it lists them.
    pub fn carve_while(&self, reserve: impl FnOnce()) -> Vec<(usize, usize)> {
        let started = std::time::Instant::now();
        self.pool.fault_in();
        let chunks = self.pool.len.div_ceil(FAULT_CHUNK);
        while self.pool.chunks_done.load(Ordering::Acquire) < chunks && !self.pool.stopped.load(Ordering::Relaxed) {
            std::thread::yield_now();
        }
        let waited = started.elapsed();
        CARVING.with(|carving| *carving.borrow_mut() = Some(self.pool.clone()));
        let recorded = record_tables(reserve);
        CARVING.with(|carving| carving.borrow_mut().take());
        tracing::debug!(
            waited_ms = waited.as_millis() as u64,
            carved = self.carved_bytes(),
            of = self.pool.len,
            not_carved = recorded.iter().map(|&(_, len)| len).sum::<usize>(),
            "restored tables carved from memory faulted in while reading"
        );
        recorded
    }

    /// The bytes carved so far.
    pub fn carved_bytes(&self) -> usize {
        *self.pool.carved.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for PrefaultedTables {
    fn drop(&mut self) {
        self.pool.stopped.store(true, Ordering::Relaxed);
    }
}

impl TablePool {
    /// An anonymous private mapping of `len` bytes (a multiple of pages), on small pages (see
    /// [`populate`]).
    #[cfg(target_os = "linux")]
    fn map(len: usize) -> Option<TablePool> {
        if len == 0 {
            return None;
        }
        // SAFETY: a new anonymous mapping, at an address the kernel picks; nothing else refers
        // to it.
        let start = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if start == libc::MAP_FAILED {
            return None;
        }
        // SAFETY: the mapping just made; MADV_NOHUGEPAGE changes how pages are backed only.
        unsafe { libc::madvise(start, len, libc::MADV_NOHUGEPAGE) };
        Some(TablePool {
            start: start as usize,
            len,
            next_chunk: AtomicUsize::new(0),
            chunks_done: AtomicUsize::new(0),
            stopped: AtomicBool::new(false),
            carved: Mutex::new(0),
        })
    }

    /// No mapping to fault in outside Linux.
    #[cfg(not(target_os = "linux"))]
    fn map(_len: usize) -> Option<TablePool> {
        None
    }

    /// Faults in chunks no other thread took until none is left or faulting in is stopped.
    fn fault_in(&self) {
        while !self.stopped.load(Ordering::Relaxed) {
            let at = self.next_chunk.fetch_add(1, Ordering::Relaxed).saturating_mul(FAULT_CHUNK);
            if at >= self.len {
                return;
            }
            if !populate_chunk(self.start + at, FAULT_CHUNK.min(self.len - at)) {
                self.stopped.store(true, Ordering::Relaxed);
            }
            self.chunks_done.fetch_add(1, Ordering::Release);
        }
    }

    /// The next `layout.size()` bytes (rounded up to pages), while they fit and the alignment
    /// is at most a page's; registered to be unmapped when freed ([`unmap_carved`]).
    fn carve(&self, layout: Layout) -> Option<NonNull<[u8]>> {
        let len = layout.size().checked_next_multiple_of(PAGE)?;
        if layout.align() > PAGE {
            return None;
        }
        let mut carved = self.carved.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.len - *carved < len {
            return None;
        }
        let address = self.start + *carved;
        *carved += len;
        CARVED.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(address, len);
        let piece = std::ptr::slice_from_raw_parts_mut(address as *mut u8, len);
        NonNull::new(piece)
    }
}

/// Faults in the pages of `[address, address + len)`, keeping their contents; whether the
/// kernel did (it refuses where nothing is mapped, and before Linux 5.14).
#[cfg(target_os = "linux")]
fn populate_chunk(address: usize, len: usize) -> bool {
    // SAFETY: madvise takes an address range and reads or writes no memory through it;
    // MADV_POPULATE_WRITE only faults the range's pages in, keeping their contents (a table's
    // writes included), and fails (it does not fault) where nothing is mapped.
    unsafe { libc::madvise(address as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) == 0 }
}

/// Nothing to fault in outside Linux (no pool is mapped there).
#[cfg(not(target_os = "linux"))]
fn populate_chunk(_address: usize, _len: usize) -> bool {
    false
}

impl Drop for TablePool {
    fn drop(&mut self) {
        let carved = *self.carved.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        if carved < self.len {
            // SAFETY: the part of the mapping no table was carved from; no thread faults it in
            // any more (they held this pool).
            unsafe { libc::munmap((self.start + carved) as *mut libc::c_void, self.len - carved) };
        }
    }
}

/// Runs `reserve` and returns the blocks of at least [`RECORDED_FROM_BYTES`] that
/// [`TableAlloc`] allocated on this thread meanwhile, as (address, length).
pub fn record_tables(reserve: impl FnOnce()) -> Vec<(usize, usize)> {
    RECORDED.with(|recorded| *recorded.borrow_mut() = Some(Vec::new()));
    reserve();
    RECORDED.with(|recorded| recorded.borrow_mut().take().unwrap_or_default())
}

/// Faults in the pages of `blocks` (address, length) before anything is written to them, on
/// `threads` threads that share them out by 2 MiB, and returns the bytes faulted in once all
/// are. `MADV_POPULATE_WRITE` (Linux 5.14) maps each page as a first write would and leaves
/// its contents alone. A fresh page costs the kernel 1–22 µs here (it zeroes it), and a
/// restored heap map is gigabytes of them (`runtime/BENCHMARKS.md`).
///
/// Before, one thread faulted the tables in while the restore filled them: the two, and the
/// thread decoding the restored entries, contended for two cores, and the restore took the
/// faults the populating thread had not reached yet. Faulted in first on both cores (1.6 GB in
/// 0.25 s), a 20M-key image restored in a median 0.94 s instead of 1.07 s, a 13-file chain of
/// the same keys in 1.93 s instead of 2.35 s (same CPU time).
///
/// Blocks that are mappings of their own are advised `MADV_NOHUGEPAGE` first. On this VM a
/// huge page comes from a free 2 MiB block, which the balloon driver reports to the host and
/// the host backs again page by page at the first touch: the keyed count's 90M-key chain
/// faulted its 5.5 GB of tables in 1.6–1.75 s on huge pages against 0.66–0.69 s on small ones
/// (5 alternating runs each; the first run after an idle minute 6.9 s against 0.66), and the
/// restore took 4.5–4.65 s against 3.67–3.77 (`runtime/BENCHMARKS.md`, session 46). The small
/// pages' misses in the translation cache cost the apply 0.1 s of that.
///
/// Stops at the first refusal (an older kernel, or memory not mapped): the pages not reached
/// are faulted in where they are first written.
#[cfg(target_os = "linux")]
pub fn populate(blocks: &[(usize, usize)], threads: usize) -> usize {
    let chunks: Vec<(usize, usize)> = blocks
        .iter()
        .flat_map(|&(address, len)| {
            let (start, end) = (address.next_multiple_of(PAGE), (address + len) / PAGE * PAGE);
            (start..end.max(start)).step_by(FAULT_CHUNK).map(move |at| (at, FAULT_CHUNK.min(end - at)))
        })
        .collect();
    // A block from MAPPED_FROM_BYTES up is a mapping of its own: small pages for it, whatever
    // the kernel's default (see the function's doc); a smaller one shares an arena's heap.
    for &(address, len) in blocks.iter().filter(|&&(_, len)| len >= MAPPED_FROM_BYTES as usize) {
        let start = address.next_multiple_of(PAGE);
        // SAFETY: as for MADV_POPULATE_WRITE (`populate_chunk`); MADV_NOHUGEPAGE changes how the kernel
        // backs the pages it faults in, not their contents.
        unsafe { libc::madvise(start as *mut libc::c_void, address + len - start, libc::MADV_NOHUGEPAGE) };
    }
    let (next, refused, populated) = (AtomicUsize::new(0), AtomicBool::new(false), AtomicUsize::new(0));
    let work = || {
        while !refused.load(Ordering::Relaxed) {
            let Some(&(at, len)) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) else { return };
            if !populate_chunk(at, len) {
                refused.store(true, Ordering::Relaxed);
                return;
            }
            populated.fetch_add(len, Ordering::Relaxed);
        }
    };
    let started = std::time::Instant::now();
    std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..threads.min(chunks.len()))
            .filter_map(|_| std::thread::Builder::new().name("table-prefault".into()).spawn_scoped(scope, work).ok())
            .collect();
        work();
        drop(helpers);
    });
    let populated = populated.into_inner();
    tracing::debug!(bytes = populated, ms = started.elapsed().as_millis() as u64, threads, "map tables faulted in");
    populated
}

/// Outside Linux the pages are faulted in where they are written.
#[cfg(not(target_os = "linux"))]
pub fn populate(_blocks: &[(usize, usize)], _threads: usize) -> usize {
    0
}

/// How often the trimming thread returns free memory. Measured on the 5M-key count on the
/// rocksdb backend (`runtime/tests/large_state.rs`): peak resident memory 215–228 MiB without
/// it, 172–201 MiB with it. Tried on heap jobs, it cost the 1M-key count 1–4% more CPU and the
/// CEL pipeline none (`runtime/BENCHMARKS.md`).
pub const TRIM_EVERY: Duration = Duration::from_secs(1);

/// Starts, once per process, a thread that returns the free memory of every malloc arena to
/// the kernel every [`TRIM_EVERY`]. Does nothing where the C library is not glibc.
pub fn keep_returning_free_memory() {
    static STARTED: Once = Once::new();
    STARTED.call_once(|| {
        if !TRIMS {
            return;
        }
        let spawned = std::thread::Builder::new().name("malloc-trim".into()).spawn(|| loop {
            std::thread::sleep(TRIM_EVERY);
            trim();
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to return freed memory to the kernel");
        }
    });
}

/// Blocks from this size up are mapped on their own and unmapped when freed, below it they
/// come from the arenas: glibc's own ceiling for the threshold it otherwise raises as blocks
/// are freed (32 MiB on 64-bit), fixed from the start.
const MAPPED_FROM_BYTES: i32 = 32 << 20;

/// Free memory at the top of an arena that is kept rather than returned.
const KEPT_FREE_BYTES: i32 = 256 << 20;

/// What a malloc heap grows by beyond the allocation that grows it while a restore fills the
/// heaps ([`HugePageHeaps`]). glibc's default ([`DEFAULT_TOP_PAD_BYTES`]) leaves a thread's
/// arena to grow its heap a page at a time, each by an `mprotect` that moves the end of the
/// heap's mapping, and the kernel backs none of it with huge pages (a huge page must lie inside
/// one mapping). Padded, a thread's new heap is readable and writable in whole (glibc's 64
/// MiB, [`HEAP_BYTES`]) from its creation.
///
/// Not kept once the restores end: glibc unmaps a thread arena's heap that has become free only
/// while the heap below it has more room than the pad, so a pad this large keeps every freed
/// heap (a parallelism-2 restore under a memory limit peaked 20–40 MiB higher,
/// `large_heap_restore.rs`).
const TOP_PAD_BYTES: i32 = 64 << 20;

/// glibc's own pad (`DEFAULT_TOP_PAD`), set back when no restore fills the heaps.
const DEFAULT_TOP_PAD_BYTES: i32 = 128 << 10;

/// Whether [`keep_freed_memory_for_reuse`] was asked for, which enables [`HugePageHeaps`].
static HUGE_PAGES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The [`HugePageHeaps`] alive: while any is, the heaps are padded by [`TOP_PAD_BYTES`].
static PADDING_HEAPS: std::sync::Mutex<usize> = std::sync::Mutex::new(0);

/// Keeps memory freed in the process for its next allocations ([`MAPPED_FROM_BYTES`],
/// [`KEPT_FREE_BYTES`]), and lets restores ask for huge pages ([`HugePageHeaps`]),
/// for jobs on the heap backend. The CEL pipeline took about 2% less
/// CPU (its system time 0.68–0.73 s → 0.44–0.48 s) and peaked at 4% more resident memory; the
/// 1M-key count no more CPU (`runtime/BENCHMARKS.md`, session 29). Does nothing where the C
/// library is not glibc, and should not be called in a process that runs a job on the rocksdb
/// backend, which must return memory ([`keep_returning_free_memory`]).
pub fn keep_freed_memory_for_reuse() {
    static SET: Once = Once::new();
    SET.call_once(|| {
        if TRIMS && !reuse_freed_memory() {
            tracing::warn!("the C library refused to keep freed memory for reuse");
        } else if TRIMS {
            HUGE_PAGES.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    });
}

/// Sets glibc's thresholds for [`keep_freed_memory_for_reuse`]; whether both were taken.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn reuse_freed_memory() -> bool {
    // SAFETY: mallopt takes two integers and the arenas' locks itself; glibc documents it as
    // thread-safe (MT-Safe).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MAPPED_FROM_BYTES) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, KEPT_FREE_BYTES) == 1
    }
}

/// Nothing to set outside glibc.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn reuse_freed_memory() -> bool {
    true
}

/// The size of a heap of a thread's malloc arena, and its alignment: glibc's `HEAP_MAX_SIZE`
/// on 64-bit (twice its largest mapping threshold, 32 MiB). Each is a mapping of its own.
const HEAP_BYTES: usize = 64 << 20;

/// Asks the kernel to back with transparent huge pages the malloc heaps a thread fills, for a
/// thread that allocates gigabytes it keeps: a heap restore's decoding threads, which allocate
/// every long value of the state. A fresh page costs the kernel a fault and its zeroing; a
/// 10 GiB restore faulted in 3.3M pages of 4 KiB, and zeroing them was 42% of the process's
/// samples (`perf`; `runtime/BENCHMARKS.md`, session 44). Huge pages take one fault per 2 MiB.
///
/// While one is alive the heaps grow by [`TOP_PAD_BYTES`]. glibc does the like when told to at
/// the process's start (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`), for all it allocates in every
/// job the process runs; this applies to the threads that ask, after the heap backend asked
/// for it ([`keep_freed_memory_for_reuse`]), and does nothing where the kernel's transparent
/// huge pages are off (`never`) or the C library is not glibc.
#[derive(Debug)]
pub struct HugePageHeaps {
    /// The heap advised last, by its address.
    advised: usize,
    /// Whether this one counts in [`PADDING_HEAPS`].
    padding: bool,
}

impl HugePageHeaps {
    /// Pads the heaps until this and every other one are dropped, if the heap backend asked for
    /// huge pages.
    pub fn new() -> Self {
        let padding = HUGE_PAGES.load(std::sync::atomic::Ordering::Relaxed);
        if padding {
            let mut alive = PADDING_HEAPS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if *alive == 0 {
                set_top_pad(TOP_PAD_BYTES);
            }
            *alive += 1;
        }
        Self { advised: 0, padding }
    }

    /// Advises the heap this thread's allocations come from now, if it was not advised yet.
    /// Call it every few hundred allocations: the pages of a new heap that were touched
    /// before the call stay small (at most the first 2 MiB of each 64 MiB heap when called
    /// every 256 values of the 10 GiB restore).
    pub fn advise_current(&mut self) {
        if self.padding {
            advise_current_heap(&mut self.advised);
        }
    }
}

impl Default for HugePageHeaps {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for HugePageHeaps {
    fn drop(&mut self) {
        if self.padding {
            let mut alive = PADDING_HEAPS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            *alive -= 1;
            if *alive == 0 {
                set_top_pad(DEFAULT_TOP_PAD_BYTES);
            }
        }
    }
}

/// Sets glibc's `M_TOP_PAD`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_top_pad(bytes: i32) {
    // SAFETY: mallopt takes two integers and the arenas' locks itself (MT-Safe).
    unsafe { libc::mallopt(libc::M_TOP_PAD, bytes) };
}

/// Nothing to pad outside glibc.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_top_pad(_bytes: i32) {}

/// Finds the heap the arena allocates from by a probe of 128 KiB (above what glibc caches per
/// thread, and seldom found free in the arena's bins, so it is split from the top of the
/// current heap, or makes the next heap), freed at once (back into the top), and advises that
/// heap with `MADV_HUGEPAGE` if it is a thread arena's: one below the program break is the
/// main arena's, which grows by `brk` and is left alone.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn advise_current_heap(advised: &mut usize) {
    const PROBE_BYTES: usize = 128 << 10;
    // SAFETY: the probe is allocated and freed by the C library and never read or written;
    // sbrk(0) only reads the program break; madvise takes an address range, reads or writes
    // no memory through it, and MADV_HUGEPAGE changes how the kernel backs the pages it
    // faults in later, not their contents (it fails where nothing is mapped).
    unsafe {
        let probe = libc::malloc(PROBE_BYTES);
        if probe.is_null() {
            return;
        }
        let at = probe as usize;
        libc::free(probe);
        let heap = at & !(HEAP_BYTES - 1);
        if heap == *advised {
            return;
        }
        *advised = heap;
        if at < libc::sbrk(0) as usize {
            return;
        }
        libc::madvise(heap as *mut libc::c_void, HEAP_BYTES, libc::MADV_HUGEPAGE);
    }
}

/// Nothing to advise outside glibc on Linux.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn advise_current_heap(_advised: &mut usize) {}

/// Whether [`trim`] returns memory on this platform.
const TRIMS: bool = cfg!(all(target_os = "linux", target_env = "gnu"));

/// Returns the free memory of every arena to the kernel (glibc's `malloc_trim`, which since
/// glibc 2.8 also releases free pages in the middle of an arena).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn trim() {
    // SAFETY: malloc_trim takes no pointer and takes each arena's lock itself; glibc documents
    // it as thread-safe (MT-Safe).
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Returns the free memory of every arena to the kernel: nothing to do outside glibc.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn trim() {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Taken by the tests that map blocks of their own or count the process's mapped bytes
    /// (`mallinfo2`), which would see each other's.
    static MAPPING_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn trimming_returns_memory_freed_in_the_middle_of_an_arena() {
        // On a thread of its own, so that the blocks come from a non-main arena, which glibc
        // only shrinks from the top: a block still allocated at the top keeps the freed ones
        // below it resident.
        let resident_after = std::thread::spawn(|| {
            let blocks: Vec<Vec<u8>> = (0..8192).map(|i| vec![i as u8; 16 << 10]).collect(); // 128 MiB
            let last = blocks.last().cloned();
            drop(blocks);
            let before = resident_kib();
            trim();
            let after = resident_kib();
            drop(last);
            (before, after)
        })
        .join()
        .unwrap();
        let (before, after) = resident_after;
        assert!(
            before.saturating_sub(after) > 64 << 10,
            "trimming returned {} KiB of 128 MiB freed (resident {before} KiB before, {after} KiB after)",
            before.saturating_sub(after)
        );
    }

    /// Once the heap backend asked for it, a block below [`MAPPED_FROM_BYTES`] comes from an
    /// arena rather than a mapping of its own, which glibc would unmap when it is freed and the
    /// next one fault in again (before, glibc mapped such blocks until one was freed).
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn freed_memory_is_kept_for_reuse_once_asked() {
        let _alone = MAPPING_TESTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        keep_freed_memory_for_reuse();
        let mapped_growth = std::thread::spawn(|| {
            // SAFETY: mallinfo2 takes no pointer; it reads the allocator's statistics.
            let mapped = || unsafe { libc::mallinfo2() }.hblkhd;
            let before = mapped();
            let block = vec![1u8; 24 << 20];
            let during = mapped();
            drop(std::hint::black_box(block));
            during.saturating_sub(before)
        })
        .join()
        .unwrap();
        assert!(mapped_growth < 24 << 20, "a 24 MiB block was mapped on its own ({mapped_growth} bytes)");
    }

    /// The blocks a reserve allocates inside [`record_tables`] are listed (and only those);
    /// populating them makes their pages resident before anything is written to them, on one
    /// thread or several, and keeps what is already written in them.
    #[test]
    #[cfg(target_os = "linux")]
    fn tables_reserved_while_recording_are_listed_faulted_in_and_keep_their_contents() {
        let _alone = MAPPING_TESTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let table_of = || allocator_api2::vec::Vec::<u64, TableAlloc>::new_in(TableAlloc);
        let (mut untouched, mut filled) = (table_of(), table_of());
        let blocks = record_tables(|| untouched.reserve(4 << 20));
        assert_eq!(blocks.len(), 1, "{blocks:?}");
        assert_eq!(blocks[0].0, untouched.as_ptr() as usize);
        assert!(blocks[0].1 >= 32 << 20);
        let mut small = table_of();
        assert!(record_tables(|| small.reserve(16)).is_empty(), "a small block is not listed");
        let mut unrecorded = table_of();
        unrecorded.reserve(1 << 20);
        assert!(record_tables(|| ()).is_empty(), "only what is allocated while recording");

        let (address, len) = blocks[0];
        let before = resident_pages(address, len);
        let populated = populate(&blocks, 3);
        assert!(populated >= (32 << 20) - 8192, "{populated} bytes faulted in");
        let (after, pages) = (resident_pages(address, len), len / 4096);
        // Mapped on its own, the block is not resident before; while a restore elsewhere in
        // this process pads the heaps (`HugePageHeaps`), it may come from the free top of one,
        // already resident.
        assert!(after + 2 >= pages, "{before} then {after} of {pages} pages resident");

        let value = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let blocks = record_tables(|| filled.reserve(4 << 20));
        filled.extend((0..1u64 << 20).map(value));
        assert!(populate(&blocks, 1) >= (32 << 20) - 8192);
        filled.extend((1u64 << 20..4u64 << 20).map(value));
        assert!(filled.iter().enumerate().all(|(i, &v)| v == value(i as u64)), "a value changed");
        drop(untouched);
    }

    /// How many of the pages inside `[address, address + len)` are resident (`mincore`).
    fn resident_pages(address: usize, len: usize) -> usize {
        let start = address.next_multiple_of(4096);
        let pages = (address + len - start) / 4096;
        let mut resident = vec![0u8; pages];
        // SAFETY: the range is mapped (a live allocation, page-aligned inward) and `resident`
        // holds one byte per page of it.
        let failed = unsafe { libc::mincore(start as *mut libc::c_void, pages * 4096, resident.as_mut_ptr()) } != 0;
        assert!(!failed, "mincore: {}", std::io::Error::last_os_error());
        resident.iter().filter(|&&b| b & 1 == 1).count()
    }

    /// The heap backend's page advice: a thread arena's heaps that [`HugePageHeaps`] was asked
    /// about while they filled are marked for huge pages (`hg` in their mapping's `VmFlags`,
    /// set whether or not the kernel then finds huge pages to back them with), and a table
    /// over [`MAPPED_FROM_BYTES`] that [`populate`] faults in is marked for small ones (`nh`),
    /// even where the kernel would give any mapping huge pages.
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn heaps_filled_by_a_restore_get_huge_pages_and_large_tables_small_ones() {
        let _alone = MAPPING_TESTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        keep_freed_memory_for_reuse();
        std::thread::spawn(|| {
            let mut heaps = HugePageHeaps::new();
            // 96 MiB of values of 1,000 bytes, as a restore decodes them: two heaps or more.
            let values: Vec<Vec<u8>> = (0..(96 << 20) / 1000)
                .map(|i| {
                    if i % 256 == 0 {
                        heaps.advise_current();
                    }
                    vec![i as u8; 1000]
                })
                .collect();
            let (first, last) = (values[300].as_ptr() as usize, values.last().unwrap().as_ptr() as usize);
            // A process with more threads than arenas may hand this one the main arena, which
            // grows by brk and is left alone: nothing to check then.
            // SAFETY: sbrk(0) only reads the program break.
            if last < unsafe { libc::sbrk(0) } as usize {
                return;
            }
            assert_ne!(first / HEAP_BYTES, last / HEAP_BYTES, "the values filled more than one heap");
            for at in [first, last] {
                let flags = vm_flags_of(at);
                assert!(flags.split_whitespace().any(|f| f == "hg"), "heap at {at:#x}: VmFlags {flags}");
            }
        })
        .join()
        .unwrap();
        // 160 MiB: more than a thread arena's heap holds, so not from one that a restore
        // elsewhere in this process advised.
        let mut table = allocator_api2::vec::Vec::<u64, TableAlloc>::new_in(TableAlloc);
        let blocks = record_tables(|| table.reserve(20 << 20));
        assert_eq!(blocks.len(), 1, "{blocks:?}");
        populate(&blocks, 2);
        let after = vm_flags_of(blocks[0].0 + (80 << 20));
        assert!(after.split_whitespace().any(|f| f == "nh"), "table: VmFlags {after}");
        assert!(!after.split_whitespace().any(|f| f == "hg"), "table: VmFlags {after}");
    }

    /// The `VmFlags` of the mapping holding `address` (`/proc/self/smaps`).
    fn vm_flags_of(address: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().and_then(|r| r.split_once('-'));
            if let Some((Ok(start), Ok(end))) =
                range.map(|(s, e)| (usize::from_str_radix(s, 16), usize::from_str_radix(e, 16)))
            {
                inside = (start..end).contains(&address);
            } else if let (true, Some(flags)) = (inside, line.strip_prefix("VmFlags:")) {
                return flags.trim().to_string();
            }
        }
        panic!("no mapping holds {address:#x}");
    }

    fn resident_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}
