//! Spare buffers for state files: a checkpoint's file is encoded into memory that an earlier
//! checkpoint's file gave back, whose pages the process still holds.
//!
//! A state file is encoded into a buffer of its own, uploaded, and freed. A buffer of tens of
//! MB comes from the kernel and goes back to it when freed (glibc maps allocations over 32 MB
//! of their own, and the rocksdb backend returns freed memory every second,
//! `crate::malloc` in the runtime), so every checkpoint touched fresh pages again: the
//! 10 GiB job of `runtime/BENCHMARKS.md` (an increment of about 30 MB each second, written in
//! one buffer and ordered by key group into another) took 24,000 page faults a second on its
//! keyed task, each costing microseconds in this VM, inside the snapshot that stops the task's
//! records. Kept here, the same pages serve the next checkpoint.
//!
//! At most [`SPARES`] buffers of at most [`MAX_SPARE_BYTES`] each, and [`MAX_KEPT_BYTES`] in
//! all, are kept: about what a checkpoint of that size needs anyway (its entries and the
//! ordered file, and the previous one's file still uploading); a full image larger than that
//! is freed as before. Only increments are written into kept buffers; other files are small
//! or rare.

use std::sync::Mutex;

/// Buffers kept at most.
pub const SPARES: usize = 4;

/// Bytes kept at most, in capacity: about two checkpoints' increments of the 10 GiB job.
pub const MAX_KEPT_BYTES: usize = 128 << 20;

/// The largest buffer kept (its capacity).
pub const MAX_SPARE_BYTES: usize = 64 << 20;

/// The smallest buffer kept: malloc serves smaller ones from memory it already holds.
pub const MIN_SPARE_BYTES: usize = 1 << 20;

/// Kept buffers. The process has one ([`take`], [`give_back`]); tests make their own.
#[derive(Debug, Default)]
pub struct Spares {
    kept: Mutex<Vec<Vec<u8>>>,
}

static OF_THE_PROCESS: Spares = Spares::new();

/// [`Spares::take`] from the process's spares.
pub fn take(capacity: usize) -> Vec<u8> {
    OF_THE_PROCESS.take(capacity)
}

/// [`Spares::give_back`] to the process's spares.
pub fn give_back(buffer: Vec<u8>) {
    OF_THE_PROCESS.give_back(buffer)
}

/// [`Spares::give_back_bytes`] to the process's spares.
pub fn give_back_bytes(bytes: bytes::Bytes) {
    OF_THE_PROCESS.give_back_bytes(bytes)
}

impl Spares {
    /// None kept.
    pub const fn new() -> Self {
        Spares { kept: Mutex::new(Vec::new()) }
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, Vec<Vec<u8>>> {
        self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// An empty buffer with room for at least `capacity` bytes: the smallest kept one that
    /// has it, else the largest kept one grown to it, else a new one. Below
    /// [`MIN_SPARE_BYTES`] always a new one: a small file does not take a large buffer.
    pub fn take(&self, capacity: usize) -> Vec<u8> {
        if capacity < MIN_SPARE_BYTES {
            return Vec::with_capacity(capacity);
        }
        let mut kept = self.kept();
        let fits = kept.iter().enumerate().filter(|(_, b)| b.capacity() >= capacity).min_by_key(|(_, b)| b.capacity());
        let chosen = match fits {
            Some((i, _)) => Some(i),
            None => kept.iter().enumerate().max_by_key(|(_, b)| b.capacity()).map(|(i, _)| i),
        };
        match chosen {
            Some(i) => {
                let mut buffer = kept.swap_remove(i);
                drop(kept);
                buffer.reserve_exact(capacity);
                buffer
            }
            None => Vec::with_capacity(capacity),
        }
    }

    /// Keeps `buffer` for a later [`Self::take`], emptied, unless it is too small or too
    /// large; while more than [`SPARES`] or [`MAX_KEPT_BYTES`] are kept, the smallest goes.
    pub fn give_back(&self, mut buffer: Vec<u8>) {
        if !(MIN_SPARE_BYTES..=MAX_SPARE_BYTES).contains(&buffer.capacity()) {
            return;
        }
        buffer.clear();
        let mut kept = self.kept();
        kept.push(buffer);
        let mut freed = Vec::new();
        while kept.len() > SPARES || kept.iter().map(Vec::capacity).sum::<usize>() > MAX_KEPT_BYTES {
            let Some((smallest, _)) = kept.iter().enumerate().min_by_key(|(_, b)| b.capacity()) else { break };
            freed.push(kept.swap_remove(smallest));
        }
        drop(kept);
        drop(freed);
    }

    /// [`Self::give_back`] of the buffer under `bytes` once nothing else shares it (an
    /// upload's clones are gone); shared bytes are only dropped.
    pub fn give_back_bytes(&self, bytes: bytes::Bytes) {
        if let Ok(unique) = bytes.try_into_mut() {
            self.give_back(Vec::from(unique));
        }
    }

    /// Bytes kept, in capacity.
    pub fn kept_bytes(&self) -> usize {
        self.kept().iter().map(Vec::capacity).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_given_back_is_taken_again_with_its_memory() {
        let spares = Spares::new();
        let mut buffer = spares.take(1 << 20);
        buffer.extend_from_slice(&[7; 1000]);
        let at = buffer.as_ptr();
        spares.give_back(buffer);
        assert_eq!(spares.take(4096).capacity(), 4096, "a small file takes no kept buffer");
        let again = spares.take(MIN_SPARE_BYTES);
        assert_eq!(again.as_ptr(), at, "the same allocation comes back");
        assert!(again.is_empty() && again.capacity() >= 1 << 20);
    }

    #[test]
    fn the_smallest_that_fits_is_taken_and_too_large_or_too_many_are_freed() {
        let spares = Spares::new();
        for capacity in [1 << 20, 2 << 20, 4 << 20] {
            spares.give_back(Vec::with_capacity(capacity));
        }
        assert_eq!(spares.take(1_500_000).capacity(), 2 << 20, "the smallest that fits");
        spares.give_back(Vec::with_capacity(MAX_SPARE_BYTES + 1));
        spares.give_back(Vec::with_capacity(MIN_SPARE_BYTES - 1));
        assert_eq!(spares.kept_bytes(), (1 << 20) + (4 << 20), "buffers out of bounds are not kept");
        assert_eq!(spares.take(5 << 20).capacity(), 5 << 20, "the largest grown when none fits");
        for _ in 0..SPARES + 2 {
            spares.give_back(Vec::with_capacity(1 << 20));
        }
        spares.give_back(Vec::with_capacity(8 << 20));
        assert_eq!(spares.kept().len(), SPARES);
        assert_eq!(spares.take(7 << 20).capacity(), 8 << 20, "the largest survives");
        for _ in 0..3 {
            spares.give_back(Vec::with_capacity(MAX_SPARE_BYTES));
        }
        assert!(spares.kept_bytes() <= MAX_KEPT_BYTES, "{} bytes kept", spares.kept_bytes());
        assert_eq!(spares.kept().len(), MAX_KEPT_BYTES / MAX_SPARE_BYTES);
    }

    #[test]
    fn bytes_come_back_only_once_unshared() {
        let spares = Spares::new();
        let bytes = bytes::Bytes::from(vec![1u8; MIN_SPARE_BYTES]);
        let clone = bytes.clone();
        spares.give_back_bytes(bytes);
        assert_eq!(spares.kept_bytes(), 0, "still shared by the clone");
        spares.give_back_bytes(clone);
        assert!(spares.kept_bytes() >= MIN_SPARE_BYTES);
    }
}
