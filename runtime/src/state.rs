//! The heap keyed-state backend: a hash map per operator subtask whose entries carry their key
//! group, with change tracking so that a checkpoint's synchronous part costs O(changed keys).
//!
//! A snapshot copies the entries changed since the previous snapshot (or all of them for a full
//! image) into an owned [`KeyedSnapshot`]; encoding and upload happen later, off the task
//! thread. Savepoints take full copies without disturbing change tracking, so the next
//! incremental checkpoint still holds every change since the previous checkpoint.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustc_hash::FxHashMap;
use weir_checkpoint::format::{keyed_entries, Decoder, Encoder, FileKind, FormatError, StateFileWriter};

use crate::value::Key;

/// A state value that can be written to and read from state files.
pub trait StateValue: Clone + Send + 'static {
    /// Binary encoding.
    fn encode(&self, e: &mut Encoder);
    /// Reads what `encode` wrote.
    fn decode(d: &mut Decoder<'_>) -> Result<Self, FormatError>;
}

impl StateValue for () {
    fn encode(&self, _: &mut Encoder) {}
    fn decode(_: &mut Decoder<'_>) -> Result<Self, FormatError> {
        Ok(())
    }
}

struct Slot<V> {
    value: V,
    key_group: u32,
    dirty: bool,
}

/// Keyed state of one operator subtask.
pub struct KeyedState<V> {
    map: FxHashMap<Key, Slot<V>>,
    changed: Vec<Key>,
    deleted: Vec<(u32, Key)>,
    max_parallelism: u32,
    incremental: bool,
    full_every: u32,
    increments_since_full: u32,
    force_full: Arc<AtomicBool>,
}

/// An owned copy of (part of) keyed state, ready to be encoded off the task thread.
pub struct KeyedSnapshot<V> {
    /// Full image or increment.
    pub kind: FileKind,
    puts: Vec<(u32, Key, V)>,
    deletes: Vec<(u32, Key)>,
}

/// Type-erased snapshot, as handed to the uploader.
pub trait EncodeSnapshot: Send {
    /// Full image or increment.
    fn kind(&self) -> FileKind;
    /// Encodes into a state file; returns the bytes and CRC-32C.
    fn encode(self: Box<Self>) -> (bytes::Bytes, u32);
}

impl<V: StateValue> EncodeSnapshot for KeyedSnapshot<V> {
    fn kind(&self) -> FileKind {
        self.kind
    }

    fn encode(self: Box<Self>) -> (bytes::Bytes, u32) {
        let mut w = StateFileWriter::new(self.kind, self.puts.len() * 24 + self.deletes.len() * 16);
        let mut key_buf = Encoder::with_capacity(64);
        for (kg, key, value) in &self.puts {
            key_buf.buf.clear();
            key.encode(&mut key_buf);
            w.put_with(*kg, &key_buf.buf, |e| value.encode(e));
        }
        for (kg, key) in &self.deletes {
            key_buf.buf.clear();
            key.encode(&mut key_buf);
            w.delete(*kg, &key_buf.buf);
        }
        w.finish()
    }
}

impl<V: StateValue> KeyedState<V> {
    /// Empty state. `incremental` and `full_every` come from the job's checkpointing settings.
    pub fn new(max_parallelism: u32, incremental: bool, full_every: u32) -> Self {
        KeyedState {
            map: FxHashMap::default(),
            changed: Vec::new(),
            deleted: Vec::new(),
            max_parallelism,
            incremental,
            full_every: full_every.max(1),
            increments_since_full: 0,
            // The first checkpoint of a run is always a full image.
            force_full: Arc::new(AtomicBool::new(true)),
        }
    }

    /// The flag the uploader raises when an upload failed (the next snapshot must be full).
    pub fn force_full_flag(&self) -> Arc<AtomicBool> {
        self.force_full.clone()
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether there is no key.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The key group of a key.
    #[inline]
    pub fn key_group(&self, key: &Key) -> u32 {
        key.key_group(self.max_parallelism)
    }

    /// The value of a key, for reading.
    pub fn get(&self, key: &Key) -> Option<&V> {
        self.map.get(key).map(|s| &s.value)
    }

    /// The value of a key for update, created with `init` when absent; marks it changed.
    #[inline]
    pub fn update(&mut self, key: Key, init: impl FnOnce() -> V) -> &mut V {
        use std::collections::hash_map::Entry;
        match self.map.entry(key) {
            Entry::Occupied(o) => {
                if !o.get().dirty {
                    self.changed.push(o.key().clone());
                }
                let slot = o.into_mut();
                slot.dirty = true;
                &mut slot.value
            }
            Entry::Vacant(v) => {
                let key_group = v.key().key_group(self.max_parallelism);
                self.changed.push(v.key().clone());
                &mut v.insert(Slot { value: init(), key_group, dirty: true }).value
            }
        }
    }

    /// Like [`Self::update`] for an existing key; `None` when absent.
    pub fn update_existing(&mut self, key: &Key) -> Option<&mut V> {
        let changed = &mut self.changed;
        self.map.get_mut(key).map(|slot| {
            if !slot.dirty {
                slot.dirty = true;
                changed.push(key.clone());
            }
            &mut slot.value
        })
    }

    /// Removes a key.
    pub fn remove(&mut self, key: &Key) -> Option<V> {
        let slot = self.map.remove(key)?;
        self.deleted.push((slot.key_group, key.clone()));
        Some(slot.value)
    }

    /// Iterates all entries (for rebuilding derived indexes after a restore).
    pub fn iter(&self) -> impl Iterator<Item = (&Key, &V)> {
        self.map.iter().map(|(k, s)| (k, &s.value))
    }

    /// Takes the synchronous part of a checkpoint: an increment of the changes since the
    /// previous snapshot, or a full image when due.
    pub fn snapshot_checkpoint(&mut self) -> KeyedSnapshot<V> {
        let full = !self.incremental || self.force_full.swap(false, Ordering::AcqRel) || self.increments_since_full + 1 >= self.full_every;
        if full {
            self.increments_since_full = 0;
            self.changed.clear();
            self.deleted.clear();
            let mut puts = Vec::with_capacity(self.map.len());
            for (k, s) in self.map.iter_mut() {
                s.dirty = false;
                puts.push((s.key_group, k.clone(), s.value.clone()));
            }
            return KeyedSnapshot { kind: FileKind::KeyedFull, puts, deletes: Vec::new() };
        }
        self.increments_since_full += 1;
        let mut puts = Vec::with_capacity(self.changed.len());
        for k in self.changed.drain(..) {
            if let Some(s) = self.map.get_mut(&k) {
                if s.dirty {
                    s.dirty = false;
                    puts.push((s.key_group, k, s.value.clone()));
                }
            }
        }
        KeyedSnapshot { kind: FileKind::KeyedIncrement, puts, deletes: std::mem::take(&mut self.deleted) }
    }

    /// A full copy for a savepoint; change tracking is left as it is.
    pub fn snapshot_full_copy(&self) -> KeyedSnapshot<V> {
        let puts = self.map.iter().map(|(k, s)| (s.key_group, k.clone(), s.value.clone())).collect();
        KeyedSnapshot { kind: FileKind::KeyedFull, puts, deletes: Vec::new() }
    }

    /// Applies one restored state file body, keeping only key groups in `[start, end)`.
    pub fn restore_file(&mut self, body: &[u8], key_groups: (u32, u32)) -> Result<(), FormatError> {
        for entry in keyed_entries(body) {
            let entry = entry?;
            if entry.key_group < key_groups.0 || entry.key_group >= key_groups.1 {
                continue;
            }
            let key = Key::decode(&mut Decoder::new(entry.key))?;
            match entry.value {
                Some(raw) => {
                    let value = V::decode(&mut Decoder::new(raw))?;
                    self.map.insert(key, Slot { value, key_group: entry.key_group, dirty: false });
                }
                None => {
                    self.map.remove(&key);
                }
            }
        }
        Ok(())
    }

    /// After a restore: continue the restored incremental chain (same key groups) or start a
    /// new one with a full image.
    pub fn after_restore(&mut self, continue_chain: bool) {
        self.changed.clear();
        self.deleted.clear();
        self.force_full.store(!continue_chain, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::Value;
    use weir_checkpoint::format::open;

    impl StateValue for i64 {
        fn encode(&self, e: &mut Encoder) {
            e.svarint(*self)
        }
        fn decode(d: &mut Decoder<'_>) -> Result<Self, FormatError> {
            d.svarint()
        }
    }

    fn key(i: i64) -> Key {
        Key::One(Value::Int(i))
    }

    fn restore_chain(files: &[bytes::Bytes], range: (u32, u32)) -> KeyedState<i64> {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        for f in files {
            let (_, body) = open(f).unwrap();
            s.restore_file(body, range).unwrap();
        }
        s
    }

    #[test]
    fn increments_hold_only_changes_and_chains_restore_exactly() {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        for i in 0..100 {
            *s.update(key(i), || 0) += i;
        }
        let full = Box::new(s.snapshot_checkpoint());
        assert_eq!(full.kind(), FileKind::KeyedFull, "the first snapshot is full");
        *s.update(key(5), || 0) += 1000;
        *s.update(key(500), || 0) += 1;
        s.remove(&key(7));
        let inc = Box::new(s.snapshot_checkpoint());
        assert_eq!(inc.kind(), FileKind::KeyedIncrement);
        assert_eq!(inc.puts.len(), 2);
        assert_eq!(inc.deletes.len(), 1);
        let files = vec![full.encode().0, inc.encode().0];
        let r = restore_chain(&files, (0, 16));
        assert_eq!(r.len(), 100);
        assert_eq!(r.get(&key(5)), Some(&1005));
        assert_eq!(r.get(&key(7)), None);
        assert_eq!(r.get(&key(500)), Some(&1));
    }

    #[test]
    fn savepoint_copies_do_not_disturb_change_tracking() {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        s.update(key(1), || 1);
        let _ = s.snapshot_checkpoint();
        s.update(key(2), || 2);
        let sp = s.snapshot_full_copy();
        assert_eq!(sp.puts.len(), 2);
        let inc = s.snapshot_checkpoint();
        assert_eq!(inc.puts.len(), 1, "key 2 changed since the last checkpoint");
    }

    #[test]
    fn full_image_every_n_and_after_a_failed_upload() {
        let mut s = KeyedState::<i64>::new(16, true, 3);
        s.update(key(1), || 1);
        assert_eq!(s.snapshot_checkpoint().kind, FileKind::KeyedFull);
        assert_eq!(s.snapshot_checkpoint().kind, FileKind::KeyedIncrement);
        assert_eq!(s.snapshot_checkpoint().kind, FileKind::KeyedIncrement);
        assert_eq!(s.snapshot_checkpoint().kind, FileKind::KeyedFull, "every third checkpoint is full");
        s.force_full_flag().store(true, Ordering::Release);
        assert_eq!(s.snapshot_checkpoint().kind, FileKind::KeyedFull);
    }

    #[test]
    fn restore_filters_key_groups() {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        for i in 0..1000 {
            s.update(key(i), || i);
        }
        let file = Box::new(s.snapshot_checkpoint()).encode().0;
        let a = restore_chain(std::slice::from_ref(&file), (0, 8));
        let b = restore_chain(std::slice::from_ref(&file), (8, 16));
        assert_eq!(a.len() + b.len(), 1000);
        assert!(a.iter().all(|(k, _)| k.key_group(16) < 8));
    }
}
