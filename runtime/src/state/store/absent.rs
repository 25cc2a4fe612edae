//! A runtime built without the `rocksdb` feature has no store: [`StateStore::open`] says so,
//! and since no store can exist, nothing else here can be called (each method matches on an
//! uninhabited field).

use std::marker::PhantomData;
use std::ops::Deref;
use std::path::{Path, PathBuf};

use super::super::bulk::BulkLoad;
use super::StoreError;

/// A value read from the store: cannot exist in this build.
pub struct StoredValue<'s> {
    never: Never,
    _store: PhantomData<&'s StateStore>,
}

impl Deref for StoredValue<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self.never {}
    }
}

/// The engine's own error: there is no engine, so none can occur.
pub type EngineError = std::convert::Infallible;

/// Has no values.
#[derive(Debug)]
enum Never {}

/// One subtask's store: cannot exist in this build.
pub struct StateStore {
    never: Never,
}

/// A batch of puts and deletes: cannot exist in this build.
pub struct WriteBatch {
    never: Never,
}

impl WriteBatch {
    /// Adds a put.
    pub fn put(&mut self, _key: &[u8], _value: &[u8]) {
        match self.never {}
    }

    /// Adds a deletion.
    pub fn delete(&mut self, _key: &[u8]) {
        match self.never {}
    }
}

impl StateStore {
    /// Fails: this runtime was built without the `rocksdb` feature.
    pub fn open(parent_dir: &Path, _label: &str) -> Result<Self, StoreError> {
        Err(StoreError::NotBuiltIn { dir: parent_dir.display().to_string() })
    }

    /// The directory the store's own directory is in.
    pub fn parent_dir(&self) -> &Path {
        match self.never {}
    }

    /// The store's own directory.
    pub fn dir(&self) -> &Path {
        match self.never {}
    }

    /// An empty batch for [`Self::write`].
    pub fn batch(&self) -> WriteBatch {
        match self.never {}
    }

    /// Loads a restore's entries into this store.
    pub fn bulk_load(&self, _load: BulkLoad, _over_existing: bool) -> Result<(), StoreError> {
        match self.never {}
    }

    /// Takes a checkpoint's table files into this empty store.
    pub fn take_tables(&self, _tables: &[PathBuf]) -> Result<(), StoreError> {
        match self.never {}
    }

    /// Counts this store while a lazy restore loads into it.
    pub fn count_lazy_restores_in(&mut self, _: std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        match self.never {}
    }

    /// Whether a lazy restore is still bringing table files in.
    pub fn loading(&self) -> bool {
        match self.never {}
    }

    /// Starts a lazy restore into this store.
    pub fn load_lazily(
        &mut self,
        _source: std::sync::Arc<dyn super::super::lazy::TableSource>,
        _ranges: super::super::lazy::Ranges,
        _increments: super::super::bulk::RangeGroups,
        _keep: Option<(u32, u32)>,
        _loaders: usize,
    ) -> Result<(), StoreError> {
        match self.never {}
    }

    /// Deletes every entry outside key groups `[start, end)`.
    pub fn keep_only_key_groups(&self, _key_groups: (u32, u32)) -> Result<(), StoreError> {
        match self.never {}
    }

    /// The value stored under a store key.
    pub fn get(&self, _store_key: &[u8]) -> Result<Option<StoredValue<'_>>, StoreError> {
        match self.never {}
    }

    /// The values stored under several store keys.
    pub fn multi_get(&self, _store_keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        match self.never {}
    }

    /// Applies a batch of puts and deletes.
    pub fn write(&self, _batch: WriteBatch) -> Result<(), StoreError> {
        match self.never {}
    }

    /// The estimated number of entries stored.
    pub fn estimated_entries(&self) -> u64 {
        match self.never {}
    }

    /// The estimated bytes of the entries stored.
    pub fn estimated_bytes(&self) -> u64 {
        match self.never {}
    }

    /// Calls `f` with every entry's store key and value.
    pub fn scan<E: From<StoreError>>(&self, _f: impl FnMut(&[u8], &[u8]) -> Result<(), E>) -> Result<(), E> {
        match self.never {}
    }
}
