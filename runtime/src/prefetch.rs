//! Prefetch hints: asking the CPU to bring a cache line in before the program writes it.
//!
//! A dedupe inserts a new key per record into a map far larger than the CPU's caches, and each
//! insert's write missed them: the writes filled the store buffer and the task waited on one
//! miss after another (a fifth of the CEL pipeline's CPU time). Lookups overlap their misses
//! when run back to back ([`crate::state::KeyedState::prefetch`]); a write needs the line first,
//! which only a prefetch instruction asks for without waiting.
//!
//! The second module allowed `unsafe` (with `malloc`): the intrinsic is declared `unsafe` for
//! its target feature, though a prefetch never faults, whatever the address, and reads or
//! writes nothing the program can see.
#![allow(unsafe_code)]

/// Asks the CPU to bring the cache line holding `p` into its caches, for writing. A hint only:
/// any address is allowed (a wrong one costs a useless fetch) and nothing is read or written.
#[inline]
pub fn for_write<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    hint::<{ std::arch::x86_64::_MM_HINT_ET0 }, T>(p);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Asks the CPU to bring the cache line holding `p` into its caches, for reading. A hint only,
/// as [`for_write`].
#[inline]
pub fn for_read<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    hint::<{ std::arch::x86_64::_MM_HINT_T0 }, T>(p);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The prefetch instruction of `STRATEGY` for the line holding `p`.
#[cfg(target_arch = "x86_64")]
#[inline]
fn hint<const STRATEGY: i32, T>(p: *const T) {
    // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has; a prefetch does not fault on
    // any address and has no effect the program can observe.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<STRATEGY>(p.cast());
    }
}
