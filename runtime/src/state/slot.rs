//! What the map holds beside each key: its value and the state's bookkeeping of the entry
//! (changed since the last snapshot, recently used, held by the store).
//!
//! Most values are held in a [`Slot`], beside their key group and a byte of flags. A value
//! with bits to spare holds the flags in them ([`FlagsInside`]), and its entry is the key and
//! the value alone: the keyed count's entry (an integer key and its count) takes 16 bytes
//! instead of 24, so a restore of its 90M keys faults in and fills 2.28 GB of tables instead
//! of 3.36 (`runtime/BENCHMARKS.md`, session 49). Such a slot does not keep the key group
//! either: the state computes it from the key where it writes the entry.

use crate::value::StateKey;

/// The entry changed since the last snapshot: the next increment writes it.
pub const DIRTY: u8 = 1;

/// The entry was read or written since the cache last looked for entries to evict (the
/// rocksdb backend's second chance).
pub const TOUCHED: u8 = 2;

/// (rocksdb backend) The store holds this value: evicting the entry writes nothing.
pub const STORED: u8 = 4;

/// What the map holds beside a key: a value and the entry's flags ([`DIRTY`], [`TOUCHED`],
/// [`STORED`]), and perhaps its key group. A [`super::StateValue`] names its slot.
pub trait StateSlot<V>: Send + 'static {
    /// A slot of `value`, of key group `key_group`, with `flags`.
    fn new(value: V, key_group: u32, flags: u8) -> Self;
    /// The value.
    fn value(&self) -> &V;
    /// The value, for changing it (its flags are not its to change).
    fn value_mut(&mut self) -> &mut V;
    /// The value, without the slot.
    fn into_value(self) -> V;
    /// The key group the slot keeps, if it keeps it (else the key's, computed from it).
    fn key_group(&self) -> Option<u32>;
    /// Its flags.
    fn flags(&self) -> u8;
    /// Sets its flags to `flags`.
    fn set_flags(&mut self, flags: u8);

    /// The key group of the entry of `key`: the one the slot keeps, else the key's.
    #[inline(always)]
    fn key_group_of<K: StateKey>(&self, key: &K, max_parallelism: u32) -> u32 {
        self.key_group().unwrap_or_else(|| key.key_group(max_parallelism))
    }

    /// A restored entry's slot: clean (a checkpoint holds it), untouched, not in a store.
    #[inline(always)]
    fn restored(value: V, key_group: u32) -> Self
    where
        Self: Sized,
    {
        Self::new(value, key_group, 0)
    }

    /// Changed since the last snapshot.
    #[inline(always)]
    fn dirty(&self) -> bool {
        self.flags() & DIRTY != 0
    }

    /// Marks it changed (or not) since the last snapshot.
    #[inline(always)]
    fn set_dirty(&mut self, dirty: bool) {
        self.set_flag(DIRTY, dirty);
    }

    /// Read or written since the cache last looked for entries to evict.
    #[inline(always)]
    fn touched(&self) -> bool {
        self.flags() & TOUCHED != 0
    }

    /// Marks it read or written (or not) since the cache last looked.
    #[inline(always)]
    fn set_touched(&mut self, touched: bool) {
        self.set_flag(TOUCHED, touched);
    }

    /// The store holds this value.
    #[inline(always)]
    fn stored(&self) -> bool {
        self.flags() & STORED != 0
    }

    /// Marks it written by the task: changed since the last snapshot, recently used, and not
    /// what the store holds.
    #[inline(always)]
    fn mark_written(&mut self) {
        self.set_flags((self.flags() | DIRTY | TOUCHED) & !STORED);
    }

    /// Sets or clears `flag`.
    #[inline(always)]
    fn set_flag(&mut self, flag: u8, on: bool) {
        let flags = self.flags();
        self.set_flags(if on { flags | flag } else { flags & !flag });
    }
}

/// A value beside its key group and flags.
pub struct Slot<V> {
    value: V,
    key_group: u32,
    flags: u8,
}

impl<V: Send + 'static> StateSlot<V> for Slot<V> {
    #[inline(always)]
    fn new(value: V, key_group: u32, flags: u8) -> Self {
        Slot { value, key_group, flags }
    }

    #[inline(always)]
    fn value(&self) -> &V {
        &self.value
    }

    #[inline(always)]
    fn value_mut(&mut self) -> &mut V {
        &mut self.value
    }

    #[inline(always)]
    fn into_value(self) -> V {
        self.value
    }

    #[inline(always)]
    fn key_group(&self) -> Option<u32> {
        Some(self.key_group)
    }

    #[inline(always)]
    fn flags(&self) -> u8 {
        self.flags
    }

    #[inline(always)]
    fn set_flags(&mut self, flags: u8) {
        self.flags = flags;
    }
}

/// A value that lends the state three bits of its own for an entry's flags: every way it is
/// read (encoded, compared, given as a result) leaves them out, and changing it keeps them.
pub trait SpareBits {
    /// The three flag bits it holds ([`DIRTY`], [`TOUCHED`], [`STORED`]).
    fn spare_bits(&self) -> u8;
    /// Sets the three flag bits it holds to `bits`, the value itself unchanged.
    fn set_spare_bits(&mut self, bits: u8);
}

/// A value that holds its entry's flags in bits of its own ([`SpareBits`]): the slot is the
/// value alone, and the key group is computed from the key where the state needs it.
#[repr(transparent)]
pub struct FlagsInside<V>(V);

impl<V: SpareBits + Send + 'static> StateSlot<V> for FlagsInside<V> {
    #[inline(always)]
    fn new(mut value: V, _: u32, flags: u8) -> Self {
        value.set_spare_bits(flags);
        FlagsInside(value)
    }

    #[inline(always)]
    fn value(&self) -> &V {
        &self.0
    }

    #[inline(always)]
    fn value_mut(&mut self) -> &mut V {
        &mut self.0
    }

    #[inline(always)]
    fn into_value(mut self) -> V {
        self.0.set_spare_bits(0);
        self.0
    }

    #[inline(always)]
    fn key_group(&self) -> Option<u32> {
        None
    }

    #[inline(always)]
    fn flags(&self) -> u8 {
        self.0.spare_bits()
    }

    #[inline(always)]
    fn set_flags(&mut self, flags: u8) {
        self.0.set_spare_bits(flags);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operators::accumulators::AccCount;

    /// Both slots keep each flag apart from the others and from the value; the value lent
    /// its bits reads and encodes the same whatever the flags.
    #[test]
    fn flags_are_kept_apart_from_each_other_and_the_value() {
        fn check<S: StateSlot<AccCount>>(count: i64) {
            let mut s = S::new(AccCount::new(count), 9, DIRTY | STORED);
            assert!(s.dirty() && !s.touched() && s.stored());
            s.set_touched(true);
            s.set_dirty(false);
            assert!(!s.dirty() && s.touched() && s.stored());
            assert_eq!(s.value().count(), count);
            for flags in 0..8 {
                s.set_flags(flags);
                assert_eq!(s.flags(), flags);
                assert_eq!(s.value(), &AccCount::new(count), "flags {flags}");
                let mut e = weir_checkpoint::format::Encoder::default();
                crate::state::StateValue::encode(s.value(), &mut e);
                let mut plain = weir_checkpoint::format::Encoder::default();
                crate::state::StateValue::encode(&AccCount::new(count), &mut plain);
                assert_eq!(e.buf, plain.buf, "flags {flags}");
            }
            assert_eq!(S::restored(AccCount::new(count), 3).flags(), 0);
            assert_eq!(S::new(AccCount::new(count), 3, 7).into_value().count(), count);
        }
        for count in [0, 1, 1 << 40, AccCount::MAX] {
            check::<Slot<AccCount>>(count);
            check::<FlagsInside<AccCount>>(count);
        }
        assert_eq!(Slot::<AccCount>::new(AccCount::new(1), 9, 0).key_group(), Some(9));
        assert_eq!(FlagsInside::<AccCount>::new(AccCount::new(1), 9, 0).key_group(), None);
    }
}
