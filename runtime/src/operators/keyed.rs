//! Keyed operators without windows: running `aggregate` and `dedupe`.

use weir_crds::job::AggregateFn;

use crate::message::Barrier;
use crate::operator::{Operator, StateParts, TaskError};
use crate::operators::accumulators::{AccList, Aggregates};
use crate::restore::{KeyedFile, KeyedRestore};

/// How much of a state file's local copy a restore reads at once.
const RESTORE_PART_BYTES: usize = 8 << 20;
use crate::state::{KeyedState, StateStore, StateValue, StoreError, StoreSettings};
use crate::value::{Fields, Key, Record};

/// Settings every keyed operator needs.
#[derive(Clone, Debug)]
pub struct KeyedContext {
    /// Operator uid (for messages).
    pub uid: String,
    /// Key field positions in the input.
    pub key: Vec<usize>,
    /// Key groups of the job.
    pub max_parallelism: u32,
    /// This subtask's key groups.
    pub key_groups: (u32, u32),
    /// Incremental checkpoints on.
    pub incremental: bool,
    /// Full image every N checkpoints.
    pub full_every: u32,
    /// Above this many entries, periodic full images are merged by the uploader in the
    /// background instead of written by the task.
    pub background_full_image_above: u64,
    /// The rocksdb backend's settings; `None` for the heap backend.
    pub store: Option<StoreSettings>,
}

impl KeyedContext {
    /// Empty state on the job's backend, filled from `restore` when given.
    pub fn state<V: StateValue>(&self, restore: Option<&KeyedRestore>) -> Result<KeyedState<V>, TaskError> {
        let mut state = KeyedState::new(self.max_parallelism, self.incremental, self.full_every)
            .with_background_full_image_above(self.background_full_image_above);
        if let Some(settings) = &self.store {
            let label = format!("{}-kg{}", self.uid, self.key_groups.0);
            let store = StateStore::open(&settings.parent_dir, &label).map_err(|e| self.state_failed(e))?;
            state = state.on_store(store, settings.cache_entries);
        }
        if let Some(r) = restore {
            for (source, tables) in &r.tables {
                let paths: Vec<std::path::PathBuf> = tables
                    .iter()
                    .filter_map(|t| match t {
                        KeyedFile::Local(copy) => Some(copy.path.clone()),
                        KeyedFile::Memory(_) => None,
                    })
                    .collect();
                if paths.len() != tables.len() || !state.restore_tables(&paths, *source, self.key_groups) {
                    // Only a restore for the rocksdb backend reads table files, to local disk.
                    return Err(TaskError::Restore {
                        uid: self.uid.clone(),
                        reason: "table files were restored for a backend that cannot take them".into(),
                    });
                }
            }
            for file in &r.files {
                self.restore_file(&mut state, file)?;
            }
            state.after_restore(r.continue_chain, r.chain_len()).map_err(|e| self.state_failed(e))?;
        }
        Ok(state)
    }

    /// Applies one file of a restored chain: from memory, or read back in parts from its local
    /// copy (so that a state larger than memory restores within it).
    fn restore_file<V: StateValue>(&self, state: &mut KeyedState<V>, file: &KeyedFile) -> Result<(), TaskError> {
        use weir_checkpoint::format::{FileKind, FormatError, PartsError};
        let failed = |reason: String| TaskError::Restore { uid: self.uid.clone(), reason };
        let store_failed = |e: StoreError| match e {
            StoreError::Decode(e) => failed(e.to_string()),
            e => self.state_failed(e),
        };
        match file {
            KeyedFile::Memory(data) => {
                let (kind, body) = weir_checkpoint::format::open(data).map_err(|e| failed(e.to_string()))?;
                if kind == FileKind::KeyedFull {
                    state.reserve_for_full_image(body, self.key_groups).map_err(|e| failed(e.to_string()))?;
                }
                state.restore_file(body, self.key_groups).map_err(store_failed)
            }
            KeyedFile::Local(copy) => {
                let read = std::fs::File::open(&copy.path)
                    .map_err(|e| failed(format!("opening the local copy {}: {e}", copy.path.display())))?;
                let parts = weir_checkpoint::format::read_keyed_parts(read, copy.len, RESTORE_PART_BYTES, |body| {
                    state.restore_file(body, self.key_groups)
                });
                match parts {
                    Ok(_) => Ok(()),
                    Err(PartsError::Read(e)) => {
                        Err(failed(format!("reading the local copy {}: {e}", copy.path.display())))
                    }
                    Err(PartsError::Format(e)) => Err(failed(FormatError::to_string(&e))),
                    Err(PartsError::Consume(e)) => Err(store_failed(e)),
                }
            }
        }
    }

    /// The task error for a failure of the state's store.
    pub fn state_failed(&self, source: StoreError) -> TaskError {
        TaskError::State { uid: self.uid.clone(), source }
    }

    /// The keys of a batch's records, prepared for the batch's updates (see
    /// [`KeyedState::prefetch`]).
    pub fn prefetched_keys<V: StateValue>(
        &self,
        state: &mut KeyedState<V>,
        batch: &[Record],
    ) -> Result<Vec<Key>, TaskError> {
        let keys: Vec<Key> = batch.iter().map(|r| Key::of(r, &self.key)).collect();
        std::hint::black_box(state.prefetch(&keys).map_err(|e| self.state_failed(e))?);
        Ok(keys)
    }

    /// The snapshot parts of keyed state for a barrier.
    pub fn snapshot<V: StateValue>(
        &self,
        state: &mut KeyedState<V>,
        barrier: &Barrier,
    ) -> Result<StateParts, TaskError> {
        let keyed = if barrier.is_savepoint() { state.snapshot_full_copy() } else { state.snapshot_checkpoint() };
        Ok(StateParts {
            keyed: Some(keyed.map_err(|e| self.state_failed(e))?),
            force_full: (!barrier.is_savepoint()).then(|| state.force_full_flag()),
            ..StateParts::default()
        })
    }
}

/// Running aggregates per key, emitted (key fields + aggregates) on every update.
pub struct AggregateOperator {
    ctx: KeyedContext,
    aggregates: Aggregates,
    state: KeyedState<AccList>,
}

impl AggregateOperator {
    /// Builds the operator, restoring its state when given.
    pub fn new(
        ctx: KeyedContext,
        specs: &[AggregateFn],
        input: &[String],
        restore: Option<&KeyedRestore>,
    ) -> Result<Self, TaskError> {
        let state = ctx.state(restore)?;
        Ok(AggregateOperator { aggregates: Aggregates::new(specs, input), ctx, state })
    }
}

impl Operator for AggregateOperator {
    fn process(&mut self, batch: Vec<Record>, out: &mut Vec<Record>) -> Result<(), TaskError> {
        out.reserve(batch.len());
        let keys = self.ctx.prefetched_keys(&mut self.state, &batch)?;
        for (r, key) in batch.into_iter().zip(keys) {
            let aggregates = &self.aggregates;
            let mut fields = Fields::with_capacity(self.ctx.key.len() + self.aggregates.len());
            fields.extend(key.values().iter().cloned());
            let accs = match self.state.update(key, || AccList(aggregates.init())) {
                Ok(accs) => accs,
                Err(e) => return Err(self.ctx.state_failed(e)),
            };
            aggregates.add(&mut accs.0, &r);
            Aggregates::results(&accs.0, &mut fields);
            out.push(Record { time: r.time, fields });
        }
        Ok(())
    }

    fn snapshot(&mut self, barrier: &Barrier) -> Result<StateParts, TaskError> {
        self.ctx.snapshot(&mut self.state, barrier)
    }
}

/// Passes the first record of each key, drops the rest.
pub struct DedupeOperator {
    ctx: KeyedContext,
    state: KeyedState<()>,
}

impl DedupeOperator {
    /// Builds the operator, restoring its state when given.
    pub fn new(ctx: KeyedContext, restore: Option<&KeyedRestore>) -> Result<Self, TaskError> {
        let state = ctx.state(restore)?;
        Ok(DedupeOperator { ctx, state })
    }
}

impl Operator for DedupeOperator {
    fn process(&mut self, batch: Vec<Record>, out: &mut Vec<Record>) -> Result<(), TaskError> {
        let keys = self.ctx.prefetched_keys(&mut self.state, &batch)?;
        for (r, key) in batch.into_iter().zip(keys) {
            if self.state.insert_new(key, ()).map_err(|e| self.ctx.state_failed(e))? {
                out.push(r);
            }
        }
        Ok(())
    }

    fn snapshot(&mut self, barrier: &Barrier) -> Result<StateParts, TaskError> {
        self.ctx.snapshot(&mut self.state, barrier)
    }
}
