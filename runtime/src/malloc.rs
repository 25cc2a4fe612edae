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
//! One of two modules allowed `unsafe` (with `prefetch`): calls into the C library.
#![allow(unsafe_code)]

use std::sync::Once;
use std::time::Duration;

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

/// Keeps memory freed in the process for its next allocations ([`MAPPED_FROM_BYTES`],
/// [`KEPT_FREE_BYTES`]), for jobs on the heap backend. The CEL pipeline took about 2% less
/// CPU (its system time 0.68–0.73 s → 0.44–0.48 s) and peaked at 4% more resident memory; the
/// 1M-key count no more CPU (`runtime/BENCHMARKS.md`, session 29). Does nothing where the C
/// library is not glibc, and should not be called in a process that runs a job on the rocksdb
/// backend, which must return memory ([`keep_returning_free_memory`]).
pub fn keep_freed_memory_for_reuse() {
    static SET: Once = Once::new();
    SET.call_once(|| {
        if TRIMS && !reuse_freed_memory() {
            tracing::warn!("the C library refused to keep freed memory for reuse");
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

    fn resident_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}
