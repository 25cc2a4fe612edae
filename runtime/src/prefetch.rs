//! Prefetch hints: asking the CPU to bring a cache line in before the program reads it.
//!
//! A batch's lookups in a map far larger than the CPU's caches each miss twice, the control
//! bytes and then the bucket they point to, one miss after the other. Prefetching both for
//! every key of the batch before its lookups run lets all the misses overlap
//! ([`crate::state::map::ShardedMap::prefetch_probes`]).
//!
//! The second module allowed `unsafe` (with `malloc`): the intrinsic is declared `unsafe` for
//! its target feature, though a prefetch never faults, whatever the address, and reads or
//! writes nothing the program can see.
#![allow(unsafe_code)]

/// Asks the CPU to bring the cache line holding `p` into its caches, for reading. A hint only:
/// any address is allowed (a wrong one costs a useless fetch) and nothing is read or written.
#[inline]
pub fn for_read<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has; a prefetch does not fault on
    // any address and has no effect the program can observe.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
