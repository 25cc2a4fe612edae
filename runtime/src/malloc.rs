//! Returning freed memory to the kernel. Every allocation of the process goes through glibc's
//! malloc, Rust's and the state store's (RocksDB is C++). glibc gives each thread that contends
//! for the allocator an arena of its own (up to eight per core) and gives memory back only from
//! the top of an arena, so memory freed in the middle of one stays resident. A job on the
//! on-disk backend, whose memory must stay within the pod's limit while its state does not, grew
//! about 2 MB/s that way on a 5M-key count until the limit killed it.
//!
//! This is the only module allowed `unsafe`: two calls into the C library.
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

    fn resident_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}
