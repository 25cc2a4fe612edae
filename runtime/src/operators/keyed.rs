//! Keyed operators without windows: running `aggregate` and `dedupe`.

use weir_crds::job::AggregateFn;

use crate::message::Barrier;
use crate::operator::{Operator, StateParts, TaskError};
use crate::operators::accumulators::{AccCount, AccList, AccOne, AccPair, AccState, Aggregates};
use crate::restore::{KeyedFile, KeyedRestore, LOCAL_COPY_PART_BYTES};
use crate::state::{
    ChainFile, FullImageBudget, KeyedState, StateStore, StateValue, StoreError, StoreSettings, PREFETCH_CHUNK,
};
use crate::value::{Fields, IntKey, Key, Record, StateKey, Value};

/// Below this many bytes of files a restored chain is applied file by file: a shard by shard
/// apply starts a thread per core twice, and a chain this small fits the caches anyway.
const CHAIN_BY_SHARD_MIN_BYTES: usize = 1 << 20;

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
    /// Incremental checkpoints on (and checkpoints at all: without them the state tracks no
    /// changes).
    pub incremental: bool,
    /// Full image every N checkpoints.
    pub full_every: u32,
    /// Above this many entries (on the rocksdb backend counting stored bytes too, 14 bytes an
    /// entry), periodic full images are merged by the uploader in the background instead of
    /// written by the task.
    pub background_full_image_above: u64,
    /// Where full images written by the task go: memory up to a bound, local disk beyond.
    pub full_images: FullImageBudget,
    /// The rocksdb backend's settings; `None` for the heap backend.
    pub store: Option<StoreSettings>,
}

impl KeyedContext {
    /// Empty state on the job's backend, filled from `restore` when given.
    pub fn state<V: StateValue, K: StateKey>(
        &self,
        restore: Option<&KeyedRestore>,
    ) -> Result<KeyedState<V, K>, TaskError> {
        let mut state = KeyedState::new(self.max_parallelism, self.incremental, self.full_every)
            .with_background_full_image_above(self.background_full_image_above)
            .with_full_image_budget(self.full_images.clone());
        if let Some(settings) = &self.store {
            let label = format!("{}-kg{}", self.uid, self.key_groups.0);
            let mut store = StateStore::open(&settings.parent_dir, &label).map_err(|e| self.state_failed(e))?;
            store.count_lazy_restores_in(settings.restores_loading.clone());
            state = state.on_store(store, settings.cache_entries);
        }
        if let Some(r) = restore {
            for (source, tables) in &r.tables {
                let paths: Vec<std::path::PathBuf> = tables
                    .iter()
                    .filter_map(|t| match t {
                        KeyedFile::Local(copy) => Some(copy.path.clone()),
                        KeyedFile::Memory { .. } | KeyedFile::Stored(_) | KeyedFile::Streamed(_) => None,
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
            for (source, tables) in &r.lazy_tables {
                let taken = state
                    .restore_lazy_tables(tables.clone(), *source, self.key_groups)
                    .map_err(|e| self.state_failed(e))?;
                if !taken {
                    return Err(TaskError::Restore {
                        uid: self.uid.clone(),
                        reason: "table files were restored for a backend that cannot take them".into(),
                    });
                }
            }
            let started = std::time::Instant::now();
            if let Some(entries) = r.entries {
                state.reserve_restored_entries(entries, r.faulted_tables.as_deref());
            }
            if !self.restore_chain_by_shard(&mut state, r)? {
                for (i, file) in r.files.iter().enumerate() {
                    // The next file's first ranges come while this one is applied.
                    if let Some(KeyedFile::Streamed(next)) = r.files.get(i + 1) {
                        next.prefetch();
                    }
                    self.restore_file(&mut state, file, r.entries.is_none())?;
                }
            }
            state.after_restore(r.continue_chain, r.chain_len()).map_err(|e| self.state_failed(e))?;
            tracing::info!(
                uid = %self.uid,
                key_groups = ?self.key_groups,
                files = r.chain_len(),
                in_memory = state.cached_len(),
                ms = started.elapsed().as_millis() as u64,
                "keyed state restored"
            );
        }
        Ok(state)
    }

    /// Applies a restored chain of files in memory shard by shard
    /// ([`KeyedState::restore_chain_by_shard`]) when it is worth it and they allow it: two files
    /// or more, of [`CHAIN_BY_SHARD_MIN_BYTES`] or more in all, each listing only puts, into a
    /// map that reserved room for their keys. Whether it did; if not, the state is as it was.
    fn restore_chain_by_shard<V: StateValue, K: StateKey>(
        &self,
        state: &mut KeyedState<V, K>,
        r: &KeyedRestore,
    ) -> Result<bool, TaskError> {
        if r.entries.is_none() || r.files.len() < 2 {
            return Ok(false);
        }
        let mut files = Vec::with_capacity(r.files.len());
        for file in &r.files {
            let KeyedFile::Memory { data, puts_from: Some(0), shard_starts, in_window_order } = file else {
                return Ok(false);
            };
            // A file that does not open is left to `restore_file`, which says why.
            let Ok((_, body)) = weir_checkpoint::format::open_verified(data) else { return Ok(false) };
            files.push(ChainFile { body, recorded_starts: shard_starts.as_deref(), in_window_order: *in_window_order });
        }
        if files.iter().map(|f| f.body.len()).sum::<usize>() < CHAIN_BY_SHARD_MIN_BYTES {
            return Ok(false);
        }
        state.restore_chain_by_shard(&files, self.key_groups).map_err(|e| self.restore_failed(e))
    }

    /// A restore's failure: a file that does not decode says so; the store's own failures are
    /// the state's ([`Self::state_failed`]).
    fn restore_failed(&self, e: StoreError) -> TaskError {
        match e {
            StoreError::Decode(e) => TaskError::Restore { uid: self.uid.clone(), reason: e.to_string() },
            e => self.state_failed(e),
        }
    }

    /// Applies one file of a restored chain: from memory, or read back in parts from its local
    /// copy (so that a state larger than memory restores within it). `reserve_for_image`: a
    /// full image's entries are counted first and room made for them (the snapshot did not
    /// count its keys).
    fn restore_file<V: StateValue, K: StateKey>(
        &self,
        state: &mut KeyedState<V, K>,
        file: &KeyedFile,
        reserve_for_image: bool,
    ) -> Result<(), TaskError> {
        use weir_checkpoint::format::{FileKind, PartsError};
        let failed = |reason: String| TaskError::Restore { uid: self.uid.clone(), reason };
        let store_failed = |e: StoreError| self.restore_failed(e);
        match file {
            KeyedFile::Memory { data, puts_from, .. } => {
                let (kind, body) = weir_checkpoint::format::open_verified(data).map_err(|e| failed(e.to_string()))?;
                if kind == FileKind::KeyedFull && reserve_for_image {
                    state.reserve_for_full_image(body, self.key_groups).map_err(|e| failed(e.to_string()))?;
                }
                match puts_from {
                    // Deletions, then each key put once: applied on several threads.
                    Some(at) => state.restore_unordered(body, *at, self.key_groups),
                    // In file order: a later entry of a key wins.
                    None => state.restore_file(body, self.key_groups),
                }
                .map_err(store_failed)
            }
            KeyedFile::Stored(stored) => {
                let increment = crate::state::bulk::IncrementByKeyGroup {
                    file: crate::state::bulk::IncrementFile::Stored(stored.clone()),
                    index: stored.index.clone(),
                    key_groups: self.key_groups,
                    keep: Box::new(()),
                };
                if state.restore_increment_by_key_group(increment).map_err(store_failed)? {
                    return Ok(());
                }
                // Not restoring lazily after all: the whole file, then as any local copy.
                let copy = stored.copy_whole().map_err(failed)?;
                self.restore_file(state, &KeyedFile::Local(copy), reserve_for_image)
            }
            KeyedFile::Local(copy) => {
                let open = || {
                    std::fs::File::open(&copy.path)
                        .map_err(|e| failed(format!("opening the local copy {}: {e}", copy.path.display())))
                };
                // An increment ordered by key group stays where it is when the store restores
                // lazily: its loaders read each range's stretch of it.
                let index = match weir_checkpoint::format::read_increment_index(open()?, copy.len) {
                    Ok(index) => index,
                    Err(PartsError::Read(e)) => {
                        return Err(failed(format!("reading the local copy {}: {e}", copy.path.display())))
                    }
                    Err(PartsError::Format(e)) => return Err(failed(e.to_string())),
                    Err(PartsError::Consume(never)) => match never {},
                };
                if let Some(index) = index {
                    let increment = crate::state::bulk::IncrementByKeyGroup {
                        file: crate::state::bulk::IncrementFile::Local(copy.path.clone()),
                        index,
                        key_groups: self.key_groups,
                        keep: Box::new(copy.clone()),
                    };
                    if state.restore_increment_by_key_group(increment).map_err(store_failed)? {
                        return Ok(());
                    }
                }
                let verify = |digest: &weir_checkpoint::FileDigest| copy.verify_read(digest);
                let checks = FileChecks {
                    what: format!("the local copy {}", copy.path.display()),
                    verify: copy.unverified().then_some(&verify),
                    verify_whole: &|| copy.verify_whole(),
                };
                self.restore_in_parts(state, open()?, copy.len, copy.puts_from, &checks)
            }
            // Only a heap restore streams its files, and the heap state never restores lazily.
            KeyedFile::Streamed(file) => {
                let verify = |digest: &weir_checkpoint::FileDigest| file.source.verify(digest);
                let checks = FileChecks {
                    what: file.source.url(),
                    verify: Some(&verify),
                    verify_whole: &|| file.verify_whole(),
                };
                self.restore_in_parts(state, file.reader(), file.len(), file.puts_from(), &checks)
            }
        }
    }

    /// Applies the keyed state file `read` (`len` bytes) in parts of [`LOCAL_COPY_PART_BYTES`],
    /// so that a state larger than memory restores within it: `puts_from` as
    /// [`KeyedFile::Memory`]'s. An unverified file is verified once read to its end; one that
    /// was not (damaged, or its reading failed) is verified whole, so that a damage is
    /// recorded.
    fn restore_in_parts<V: StateValue, K: StateKey>(
        &self,
        state: &mut KeyedState<V, K>,
        read: impl std::io::Read,
        len: u64,
        puts_from: Option<u64>,
        checks: &FileChecks<'_>,
    ) -> Result<(), TaskError> {
        use weir_checkpoint::format::{FormatError, PartsError};
        let failed = |reason: String| TaskError::Restore { uid: self.uid.clone(), reason };
        let mut read = crate::restore::DigestingReader::new(read, checks.verify.is_some());
        // Where the part starts among the file's entries.
        let mut part_at = 0u64;
        let parts = weir_checkpoint::format::read_keyed_parts(&mut read, len, LOCAL_COPY_PART_BYTES, |part| {
            let applied = match puts_from {
                Some(puts_from) => state.restore_unordered_part(part, part_at, puts_from, self.key_groups),
                None => state.restore_file(part, self.key_groups),
            };
            part_at += part.len() as u64;
            applied
        });
        let read_failed = |e: std::io::Error| failed(format!("reading {}: {e}", checks.what));
        if let (Ok(_), Some(verify)) = (&parts, checks.verify) {
            // The trailing checksum too: the whole file against the snapshot's reference (a
            // digest not computed is of nothing, and fails).
            std::io::copy(&mut read, &mut std::io::sink()).map_err(read_failed)?;
            verify(&read.digest.unwrap_or_default()).map_err(failed)?;
        }
        if parts.is_err() {
            (checks.verify_whole)().map_err(failed)?;
        }
        match parts {
            Ok(_) => Ok(()),
            Err(PartsError::Read(e)) => Err(read_failed(e)),
            Err(PartsError::Format(e)) => Err(failed(FormatError::to_string(&e))),
            Err(PartsError::Consume(e)) => Err(self.restore_failed(e)),
        }
    }

    /// Whether the key has several fields: keyed state then holds its keys packed
    /// ([`crate::value::PackedKey`], no allocation per key) rather than as [`Key`]s.
    pub fn composite(&self) -> bool {
        crate::value::is_packed(self.key.len())
    }

    /// The task error for a failure of the state's store.
    pub fn state_failed(&self, source: StoreError) -> TaskError {
        TaskError::State { uid: self.uid.clone(), source }
    }

    /// Calls `each` with every record of a batch in order, its key and the key's hash in the
    /// state's map. The keys are prepared for the updates ([`KeyedState::prefetch`]) in runs of
    /// [`PREFETCH_CHUNK`], each just before `each` takes its records.
    pub fn each_prefetched<V: StateValue, K: StateKey>(
        &self,
        state: &mut KeyedState<V, K>,
        batch: Vec<Record>,
        mut each: impl FnMut(&mut KeyedState<V, K>, Record, K, u64) -> Result<(), TaskError>,
    ) -> Result<(), TaskError> {
        let mut keys = batch.iter().map(|r| K::of(r, &self.key)).collect::<Vec<K>>().into_iter();
        let mut records = batch.into_iter();
        let mut chunk = Vec::with_capacity(PREFETCH_CHUNK.min(keys.len()));
        loop {
            chunk.extend(keys.by_ref().take(PREFETCH_CHUNK));
            if chunk.is_empty() {
                return Ok(());
            }
            let hashes = state.prefetch(&chunk).map_err(|e| self.state_failed(e))?;
            for ((key, hash), record) in chunk.drain(..).zip(hashes).zip(records.by_ref()) {
                each(state, record, key, hash)?;
            }
        }
    }

    /// The snapshot parts of keyed state for a barrier.
    pub fn snapshot<V: StateValue, K: StateKey>(
        &self,
        state: &mut KeyedState<V, K>,
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

/// Checks a whole file's digest against the snapshot's reference; says why not.
type VerifyDigest<'a> = &'a dyn Fn(&weir_checkpoint::FileDigest) -> Result<(), String>;

/// How a keyed state file applied in parts is checked ([`KeyedContext::restore_in_parts`]).
struct FileChecks<'a> {
    /// The file, for messages.
    what: String,
    /// For a file not verified yet: its digest, once read whole, against the snapshot's.
    verify: Option<VerifyDigest<'a>>,
    /// The whole file read again and verified: for a reading that stopped early.
    verify_whole: &'a dyn Fn() -> Result<(), String>,
}

/// Running aggregates per key, emitted (key fields + aggregates) on every update. Keys are held
/// as `K`: [`Key`] for one field, [`crate::value::PackedKey`] for several (see
/// [`KeyedContext::composite`]); accumulators as `V`: an [`AccList`] of any aggregates, or an
/// [`crate::operators::accumulators::AccPair`] of two counts or sums.
pub struct AggregateOperator<K = Key, V: StateValue = AccList> {
    ctx: KeyedContext,
    aggregates: Aggregates,
    state: KeyedState<V, K>,
}

impl<K: StateKey, V: AccState> AggregateOperator<K, V> {
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

/// A key type a keyed operator holds its keys as, and how such an operator is boxed for its
/// task: as itself, or, for [`IntKey`], ready to move its keys to [`Key`]s
/// ([`IntKeysWhileIntegers`]).
pub trait HeldKey: StateKey {
    /// An aggregate holding its keys as `Self`, boxed.
    fn boxed_aggregate<V: AccState>(op: AggregateOperator<Self, V>) -> Box<dyn Operator> {
        Box::new(op)
    }
    /// A dedupe holding its keys as `Self`, boxed.
    fn boxed_dedupe(op: DedupeOperator<Self>) -> Box<dyn Operator> {
        Box::new(op)
    }
}

impl HeldKey for Key {}

impl HeldKey for crate::value::PackedKey {}

/// Integers, held so while every key is one.
impl HeldKey for IntKey {
    fn boxed_aggregate<V: AccState>(op: AggregateOperator<Self, V>) -> Box<dyn Operator> {
        Box::new(IntKeysWhileIntegers::Ints(op))
    }
    fn boxed_dedupe(op: DedupeOperator<Self>) -> Box<dyn Operator> {
        Box::new(IntKeysWhileIntegers::Ints(op))
    }
}

/// A running aggregate of `specs` whose keys are held as `K`, its accumulators inline when
/// they are a count alone ([`AccCount`]) or one or two counts or sums ([`AccOne`], [`AccPair`]:
/// no heap slice, smaller map entries), else as an [`AccList`].
pub fn aggregate_operator<K: HeldKey>(
    ctx: KeyedContext,
    specs: &[AggregateFn],
    input: &[String],
    restore: Option<&KeyedRestore>,
) -> Result<Box<dyn Operator>, TaskError> {
    Ok(if AccCount::holds(specs) {
        K::boxed_aggregate(AggregateOperator::<K, AccCount>::new(ctx, specs, input, restore)?)
    } else if AccOne::holds(specs) {
        K::boxed_aggregate(AggregateOperator::<K, AccOne>::new(ctx, specs, input, restore)?)
    } else if AccPair::holds(specs) {
        K::boxed_aggregate(AggregateOperator::<K, AccPair>::new(ctx, specs, input, restore)?)
    } else {
        K::boxed_aggregate(AggregateOperator::<K, AccList>::new(ctx, specs, input, restore)?)
    })
}

/// A dedupe whose keys are held as `K`.
pub fn dedupe_operator<K: HeldKey>(
    ctx: KeyedContext,
    restore: Option<&KeyedRestore>,
) -> Result<Box<dyn Operator>, TaskError> {
    Ok(K::boxed_dedupe(DedupeOperator::<K>::new(ctx, restore)?))
}

/// A keyed operator of one key field whose keys are held as [`IntKey`]s while every key it
/// has met is an integer, and as [`Key`]s from the first batch with one that is not.
///
/// Keys are values of any type, but most jobs key by an integer (an id, a user, an account).
/// Held as a [`Key`], an integer takes 24 bytes and is hashed and compared through its enum;
/// held alone, a running count's map entry was 24 bytes instead of 40 (16 since its flags are
/// held in the count's spare bits, [`crate::state::slot`]), and the keyed count ran
/// at 8.76–9.02M records per CPU-second instead of 5.77M with checkpoints every second
/// (`runtime/BENCHMARKS.md`, session 46). The first key of another value moves the state to
/// [`Key`]s once ([`KeyedState::into_keys`]: the same hashes, the same encodings, so the chain
/// written so far goes on); nothing moves back.
pub enum IntKeysWhileIntegers<I: HoldsIntKeys> {
    /// Every key so far an integer.
    Ints(I),
    /// A key of another value came.
    Any(I::AnyKeys),
    /// Only while the state moves from one to the other (a move that panicked leaves it so,
    /// and its task is rebuilt): the operator's uid.
    Moving(String),
}

/// A keyed operator holding its keys as [`IntKey`]s, which can hold them as [`Key`]s instead.
pub trait HoldsIntKeys: Operator + Sized {
    /// The same operator holding its keys as [`Key`]s.
    type AnyKeys: Operator;
    /// The key's field in the input.
    fn key_field(&self) -> usize;
    /// The operator's uid.
    fn uid(&self) -> &str;
    /// The same operator and state, its keys held as [`Key`]s.
    fn into_any_keys(self) -> Self::AnyKeys;
}

/// `Key` of an `IntKey`: the same value, hash and encoding.
fn any_key(key: IntKey) -> Key {
    Key::One(Value::Int(key.0))
}

impl<V: AccState> HoldsIntKeys for AggregateOperator<IntKey, V> {
    type AnyKeys = AggregateOperator<Key, V>;

    fn key_field(&self) -> usize {
        self.ctx.key[0]
    }

    fn uid(&self) -> &str {
        &self.ctx.uid
    }

    fn into_any_keys(self) -> Self::AnyKeys {
        let AggregateOperator { ctx, aggregates, state } = self;
        AggregateOperator { ctx, aggregates, state: state.into_keys(any_key) }
    }
}

impl HoldsIntKeys for DedupeOperator<IntKey> {
    type AnyKeys = DedupeOperator<Key>;

    fn key_field(&self) -> usize {
        self.ctx.key[0]
    }

    fn uid(&self) -> &str {
        &self.ctx.uid
    }

    fn into_any_keys(self) -> Self::AnyKeys {
        let DedupeOperator { ctx, state } = self;
        DedupeOperator { ctx, state: state.into_keys(any_key) }
    }
}

impl<I: HoldsIntKeys> IntKeysWhileIntegers<I> {
    /// The operator for `batch`: the one holding [`Key`]s once a key of `batch` is not an
    /// integer (the state moved first).
    fn for_batch(&mut self, batch: &[Record]) -> Result<&mut dyn Operator, TaskError> {
        // The uid of a state whose keys `batch` outgrows.
        let outgrown = match self {
            IntKeysWhileIntegers::Ints(ints) => {
                let field = ints.key_field();
                let all_ints = batch.iter().all(|r| matches!(r.fields.get(field), Some(Value::Int(_))));
                (!all_ints).then(|| ints.uid().to_string())
            }
            IntKeysWhileIntegers::Any(_) | IntKeysWhileIntegers::Moving(_) => None,
        };
        if let Some(uid) = outgrown {
            if let IntKeysWhileIntegers::Ints(ints) = std::mem::replace(self, IntKeysWhileIntegers::Moving(uid)) {
                let started = std::time::Instant::now();
                *self = IntKeysWhileIntegers::Any(ints.into_any_keys());
                tracing::info!(
                    ms = started.elapsed().as_millis() as u64,
                    "a key that is not an integer came: keyed state holds its keys as values from now on"
                );
            }
        }
        self.current()
    }

    /// The operator in place.
    fn current(&mut self) -> Result<&mut dyn Operator, TaskError> {
        match self {
            IntKeysWhileIntegers::Ints(ints) => Ok(ints),
            IntKeysWhileIntegers::Any(any) => Ok(any),
            IntKeysWhileIntegers::Moving(uid) => Err(TaskError::State {
                uid: uid.clone(),
                source: StoreError::MoveKeys("a move of the state's keys did not finish"),
            }),
        }
    }
}

impl<I: HoldsIntKeys> Operator for IntKeysWhileIntegers<I> {
    fn process(&mut self, batch: Vec<Record>, out: &mut Vec<Record>) -> Result<(), TaskError> {
        self.for_batch(&batch)?.process(batch, out)
    }

    fn on_watermark(&mut self, watermark: i64, out: &mut Vec<Record>) -> Result<(), TaskError> {
        self.current()?.on_watermark(watermark, out)
    }

    fn snapshot(&mut self, barrier: &Barrier) -> Result<StateParts, TaskError> {
        self.current()?.snapshot(barrier)
    }

    fn on_checkpoint_complete(&mut self, id: u64) -> Result<Vec<crate::sinks::file::Committable>, TaskError> {
        self.current()?.on_checkpoint_complete(id)
    }

    fn end_of_input(&mut self) -> Result<(), TaskError> {
        self.current()?.end_of_input()
    }

    fn has_uncommitted(&self) -> bool {
        match self {
            IntKeysWhileIntegers::Ints(ints) => ints.has_uncommitted(),
            IntKeysWhileIntegers::Any(any) => any.has_uncommitted(),
            IntKeysWhileIntegers::Moving(_) => false,
        }
    }
}

impl<K: StateKey, V: AccState> Operator for AggregateOperator<K, V> {
    fn process(&mut self, batch: Vec<Record>, out: &mut Vec<Record>) -> Result<(), TaskError> {
        out.reserve(batch.len());
        let (ctx, aggregates) = (&self.ctx, &self.aggregates);
        ctx.each_prefetched(&mut self.state, batch, |state, r, key, hash| {
            let mut fields = Fields::with_capacity(ctx.key.len() + aggregates.len());
            key.push_values(&mut fields);
            let accs = state.update_hashed(hash, key, || V::init(aggregates)).map_err(|e| ctx.state_failed(e))?;
            accs.add(aggregates, &r);
            accs.results(&mut fields);
            out.push(Record { time: r.time, fields });
            Ok(())
        })
    }

    fn snapshot(&mut self, barrier: &Barrier) -> Result<StateParts, TaskError> {
        self.ctx.snapshot(&mut self.state, barrier)
    }
}

/// Passes the first record of each key, drops the rest. Keys are held as `K`, as in
/// [`AggregateOperator`].
pub struct DedupeOperator<K = Key> {
    ctx: KeyedContext,
    state: KeyedState<(), K>,
}

impl<K: StateKey> DedupeOperator<K> {
    /// Builds the operator, restoring its state when given.
    pub fn new(ctx: KeyedContext, restore: Option<&KeyedRestore>) -> Result<Self, TaskError> {
        let state = ctx.state(restore)?;
        Ok(DedupeOperator { ctx, state })
    }
}

impl<K: StateKey> Operator for DedupeOperator<K> {
    fn process(&mut self, batch: Vec<Record>, out: &mut Vec<Record>) -> Result<(), TaskError> {
        let keys: Vec<K> = batch.iter().map(|r| K::of(r, &self.ctx.key)).collect();
        let inserted = self.state.insert_new_all(keys, ()).map_err(|e| self.ctx.state_failed(e))?;
        out.extend(batch.into_iter().zip(inserted).filter_map(|(r, new)| new.then_some(r)));
        Ok(())
    }

    fn snapshot(&mut self, barrier: &Barrier) -> Result<StateParts, TaskError> {
        self.ctx.snapshot(&mut self.state, barrier)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::SnapshotTarget;

    use crate::restore::KeyedFile;
    use crate::value::{PackedKey, Value};
    use bytes::Bytes;
    use weir_crds::job::AggregateKind;

    fn ctx(key: Vec<usize>, key_groups: (u32, u32)) -> KeyedContext {
        KeyedContext {
            uid: "op".into(),
            key,
            max_parallelism: 8,
            key_groups,
            incremental: true,
            full_every: 3,
            background_full_image_above: u64::MAX,
            // Full images over 256 bytes go to local files, so that the operators' tests
            // restore from those too.
            full_images: FullImageBudget { in_memory_max: 256, dir: std::env::temp_dir().join("weir-state-tests") },
            store: None,
        }
    }

    const INPUT: [&str; 3] = ["word", "n", "v"];

    fn count_and_sum() -> Vec<AggregateFn> {
        vec![
            AggregateFn { function: AggregateKind::Count, field: None, output: "count".into() },
            AggregateFn { function: AggregateKind::Sum, field: Some("v".into()), output: "sum".into() },
        ]
    }

    /// Record `i`: a word of 5 (some longer than a packed key holds inline), a small number,
    /// and `i` to sum.
    fn rec(i: i64) -> Record {
        let word = if i % 7 == 0 { format!("a-word-far-longer-than-inline-{}", i % 5) } else { format!("w{}", i % 5) };
        Record { time: i, fields: smallvec::smallvec![Value::str(&word), Value::Int(i % 3), Value::Int(i)] }
    }

    fn restore_of(files: &[Bytes]) -> KeyedRestore {
        KeyedRestore {
            files: files
                .iter()
                .cloned()
                .map(|data| KeyedFile::Memory { data, puts_from: None, shard_starts: None, in_window_order: false })
                .collect(),
            continue_chain: false,
            chain: vec![],
            chain_tables: vec![],
            tables: vec![],
            lazy_tables: vec![],
            operator_docs: vec![],
            entries: None,
            adoptable: None,
            int_keys: false,
            faulted_tables: None,
        }
    }

    /// A running count and sum on `key`, its keys held as `K`, its accumulators as `V`.
    fn aggregate<K: StateKey, V: AccState>(
        key: &[usize],
        key_groups: (u32, u32),
        restore: Option<&KeyedRestore>,
    ) -> AggregateOperator<K, V> {
        aggregate_of(&count_and_sum(), key, key_groups, restore)
    }

    /// The running aggregates `specs` on `key`, as [`aggregate`].
    fn aggregate_of<K: StateKey, V: AccState>(
        specs: &[AggregateFn],
        key: &[usize],
        key_groups: (u32, u32),
        restore: Option<&KeyedRestore>,
    ) -> AggregateOperator<K, V> {
        let input: Vec<String> = INPUT.iter().map(|s| s.to_string()).collect();
        AggregateOperator::<K, V>::new(ctx(key.to_vec(), key_groups), specs, &input, restore).unwrap()
    }

    /// Counts and sums held inline aggregate as a list of them does, and either's checkpoints
    /// restore on the other (a job whose version changes how its accumulators are held keeps
    /// its state), at another parallelism too: `V` holds `specs`.
    fn held_inline_aggregates_and_restores_as_a_list_does<V: AccState>(specs: &[AggregateFn]) {
        let batches: Vec<Vec<Record>> = (0..4).map(|b| (b * 60..b * 60 + 60).map(rec).collect()).collect();
        let key = vec![0];
        let mut inline = aggregate_of::<Key, V>(specs, &key, (0, 8), None);
        let mut list = aggregate_of::<Key, AccList>(specs, &key, (0, 8), None);
        let (mut inline_files, mut list_files) = (Vec::new(), Vec::new());
        for (b, batch) in batches.iter().enumerate().take(3) {
            same_output(&mut inline, &mut list, batch.clone());
            inline_files.push(checkpoint(&mut inline, b as u64));
            list_files.push(checkpoint(&mut list, b as u64));
        }
        assert_eq!(inline_files, list_files, "the same state files");
        let mut expected = Vec::new();
        list.process(batches[3].clone(), &mut expected).unwrap();
        let mut got = Vec::new();
        for key_groups in [(0, 5), (5, 8)] {
            let mut i = aggregate_of::<Key, V>(specs, &key, key_groups, Some(&restore_of(&list_files)));
            let mut l = aggregate_of::<Key, AccList>(specs, &key, key_groups, Some(&restore_of(&inline_files)));
            got.extend(same_output(&mut i, &mut l, of_key_groups(&batches[3], &key, key_groups)));
        }
        got.sort_by_key(|r| r.time);
        expected.sort_by_key(|r| r.time);
        assert_eq!(got, expected, "restored at parallelism 2, the aggregates go on");
    }

    /// A count and a sum held inline ([`AccPair`]), a count or a sum alone ([`AccOne`]), and a
    /// count alone as its integer ([`AccCount`], the keyed count's state).
    #[test]
    fn counts_and_sums_held_inline_aggregate_and_restore_as_a_list_does() {
        assert!(AccPair::holds(&count_and_sum()));
        held_inline_aggregates_and_restores_as_a_list_does::<AccPair>(&count_and_sum());
        for one in count_and_sum() {
            assert!(AccOne::holds(std::slice::from_ref(&one)));
            held_inline_aggregates_and_restores_as_a_list_does::<AccOne>(&[one]);
        }
        let count = &count_and_sum()[..1];
        assert!(AccCount::holds(count), "{count:?}");
        held_inline_aggregates_and_restores_as_a_list_does::<AccCount>(count);
    }

    /// A batch longer than several prefetch runs ([`PREFETCH_CHUNK`]), its keys repeated
    /// within runs and across them, aggregates and dedupes as the same records one at a time
    /// do: on the heap backend, and on rocksdb with a cache of a few entries (a later run's
    /// prefetch evicts the keys an earlier one brought in).
    #[test]
    fn a_batch_of_many_prefetch_runs_updates_as_records_one_at_a_time_do() {
        let records: Vec<Record> = (0..(PREFETCH_CHUNK as i64 * 5 + 17))
            .map(|i| {
                let r = rec(i);
                // 900 keys: each run holds some twice, and later runs hold the earlier runs' keys.
                let word = format!("k{}", crate::value::mix64(i as u64 / 2) % 900);
                Record { fields: smallvec::smallvec![Value::str(&word), r.fields[1].clone(), r.fields[2].clone()], ..r }
            })
            .collect();
        for cache_entries in [None, Some(3)] {
            let with_store = |mut c: KeyedContext| {
                c.store = cache_entries.map(|cache_entries| StoreSettings {
                    parent_dir: std::env::temp_dir().join("weir-state-tests"),
                    cache_entries,
                    restores_loading: Default::default(),
                });
                c
            };
            if cache_entries.is_some() && !cfg!(feature = "rocksdb") {
                continue;
            }
            let input: Vec<String> = INPUT.iter().map(|s| s.to_string()).collect();
            let agg = || {
                AggregateOperator::<Key, AccPair>::new(with_store(ctx(vec![0], (0, 8))), &count_and_sum(), &input, None)
                    .unwrap()
            };
            let dedupe = || DedupeOperator::<PackedKey>::new(with_store(ctx(vec![0, 1], (0, 8))), None).unwrap();
            let (mut whole, mut one_by_one) = (agg(), agg());
            let (mut first_whole, mut first_one_by_one) = (dedupe(), dedupe());
            let (mut a, mut b, mut c, mut d) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            whole.process(records.clone(), &mut a).unwrap();
            first_whole.process(records.clone(), &mut c).unwrap();
            for r in &records {
                one_by_one.process(vec![r.clone()], &mut b).unwrap();
                first_one_by_one.process(vec![r.clone()], &mut d).unwrap();
            }
            assert_eq!(a.len(), records.len());
            assert!(a == b, "cache {cache_entries:?}: running aggregates differ");
            assert!(c.len() < records.len() && c == d, "cache {cache_entries:?}: first records differ");
            assert_eq!(checkpoint(&mut whole, 1), checkpoint(&mut one_by_one, 1), "cache {cache_entries:?}");
        }
    }

    /// The records of `batch` whose key (of `key`'s fields) is in `key_groups` (of 8).
    fn of_key_groups(batch: &[Record], key: &[usize], key_groups: (u32, u32)) -> Vec<Record> {
        batch.iter().filter(|r| (key_groups.0..key_groups.1).contains(&Key::of(r, key).key_group(8))).cloned().collect()
    }

    /// Runs `batch` through both operators, checks that they emit the same records, and
    /// returns them.
    fn same_output(a: &mut dyn Operator, b: &mut dyn Operator, batch: Vec<Record>) -> Vec<Record> {
        let (mut from_a, mut from_b) = (Vec::new(), Vec::new());
        a.process(batch.clone(), &mut from_a).unwrap();
        b.process(batch, &mut from_b).unwrap();
        assert_eq!(from_a, from_b);
        from_a
    }

    fn checkpoint(op: &mut dyn Operator, id: u64) -> Bytes {
        op.snapshot(&Barrier { id, target: SnapshotTarget::Checkpoint }).unwrap().keyed.unwrap().bytes()
    }

    /// A composite key held packed gives what the same key held as values gives: the same
    /// running aggregates (key fields first) and the same first records, and state files that
    /// restore on either (checkpoints taken by one, restored by the other, at another
    /// parallelism), so that a job keeps its state when a version changes how keys are held.
    #[test]
    fn packed_composite_keys_aggregate_dedupe_and_restore_as_value_keys_do() {
        let batches: Vec<Vec<Record>> = (0..6).map(|b| (b * 50..b * 50 + 50).map(rec).collect()).collect();
        let key = vec![0, 1];
        // Aggregates: packed and value keys side by side, checkpoints after batches 1 and 3.
        let mut packed = aggregate::<PackedKey, AccList>(&key, (0, 8), None);
        let mut values = aggregate::<Key, AccList>(&key, (0, 8), None);
        let (mut packed_files, mut value_files) = (Vec::new(), Vec::new());
        for (b, batch) in batches.iter().enumerate().take(4) {
            let a = same_output(&mut packed, &mut values, batch.clone());
            assert_eq!(a[0].fields.len(), 4, "key fields, count, sum, batch {b}");
            if b == 1 || b == 3 {
                packed_files.push(checkpoint(&mut packed, b as u64));
                value_files.push(checkpoint(&mut values, b as u64));
            }
        }
        // Each side's checkpoints restored by the other, split over two subtasks.
        let mut expected = Vec::new();
        values.process(batches[4].clone(), &mut expected).unwrap();
        let mut got = Vec::new();
        for key_groups in [(0, 3), (3, 8)] {
            let mut p = aggregate::<PackedKey, AccList>(&key, key_groups, Some(&restore_of(&value_files)));
            let mut v = aggregate::<Key, AccList>(&key, key_groups, Some(&restore_of(&packed_files)));
            got.extend(same_output(&mut p, &mut v, of_key_groups(&batches[4], &key, key_groups)));
        }
        let sorted = |mut r: Vec<Record>| {
            r.sort_by_key(|r| r.time);
            r
        };
        assert_eq!(sorted(got), sorted(expected), "restored at parallelism 2, the counts go on");
        // Dedupe: the first record of each (word, n), then none after a restore.
        let mut dedupe = DedupeOperator::<PackedKey>::new(ctx(key.clone(), (0, 8)), None).unwrap();
        let mut first = Vec::new();
        dedupe.process(batches[0].clone(), &mut first).unwrap();
        let distinct: std::collections::BTreeSet<(String, i64)> = batches[0]
            .iter()
            .map(|r| (r.fields[0].to_string(), if let Value::Int(n) = r.fields[1] { n } else { unreachable!() }))
            .collect();
        assert_eq!(first.len(), distinct.len());
        let file = checkpoint(&mut dedupe, 1);
        let mut restored = DedupeOperator::<Key>::new(ctx(key, (0, 8)), Some(&restore_of(&[file]))).unwrap();
        let mut again = Vec::new();
        restored.process(batches[0].clone(), &mut again).unwrap();
        assert!(again.is_empty(), "every key was seen before the checkpoint: {again:?}");
    }

    /// Record `i` keyed by an integer (negative ones too) in field 0, or by a text where
    /// `texts` says, with `n` and `v` as [`rec`]'s.
    fn int_keyed(i: i64, texts: bool) -> Record {
        let key = if texts && i % 3 == 0 { Value::str(&format!("t{}", i % 11)) } else { Value::Int(i % 37 - 18) };
        Record { time: i, fields: smallvec::smallvec![key, Value::Int(i % 3), Value::Int(i)] }
    }

    /// The keyed snapshot of a checkpoint `id` of `op`.
    fn checkpoint_of(op: &mut dyn Operator, id: u64) -> crate::state::KeyedSnapshot {
        op.snapshot(&Barrier { id, target: SnapshotTarget::Checkpoint }).unwrap().keyed.unwrap()
    }

    /// A one-field key held as an integer gives what the key held as a value gives: the same
    /// running aggregates and first records, the same state files, which say their keys are
    /// integers; until a batch brings a key of another value, when the state moves to values
    /// and goes on as if it had always held them (nothing lost, nothing counted twice), its
    /// snapshots no longer saying so. Either's checkpoints restore on the other, at another
    /// parallelism too; a chain with a key of another value does not restore as integers.
    #[test]
    fn int_keys_aggregate_dedupe_and_restore_as_value_keys_do_until_a_key_of_another_value_comes() {
        let batches: Vec<Vec<Record>> =
            (0..6).map(|b| (b * 80..b * 80 + 80).map(|i| int_keyed(i, b >= 3)).collect()).collect();
        let key = vec![0];
        let mut ints = IntKeysWhileIntegers::Ints(aggregate::<IntKey, AccPair>(&key, (0, 8), None));
        let mut values = aggregate::<Key, AccPair>(&key, (0, 8), None);
        let (mut int_files, mut value_files) = (Vec::new(), Vec::new());
        for (b, batch) in batches.iter().enumerate().take(5) {
            same_output(&mut ints, &mut values, batch.clone());
            let (i, v) = (checkpoint_of(&mut ints, b as u64), checkpoint_of(&mut values, b as u64));
            assert_eq!(i.bytes(), v.bytes(), "batch {b}: the same state file");
            assert_eq!(i.int_keys, b < 3, "batch {b}: whether the keys are integers");
            assert!(!v.int_keys);
            assert_eq!(matches!(ints, IntKeysWhileIntegers::Ints(_)), b < 3, "batch {b}");
            int_files.push(i.bytes());
            value_files.push(v.bytes());
        }
        // The chain while every key was an integer, restored by either on two subtasks; the
        // whole chain by values.
        let mut expected = Vec::new();
        values.process(batches[5].clone(), &mut expected).unwrap();
        let mut got = Vec::new();
        let mut int_era = aggregate::<Key, AccPair>(&key, (0, 8), Some(&restore_of(&value_files[..3])));
        int_era.process(batches[3].clone(), &mut Vec::new()).unwrap();
        int_era.process(batches[4].clone(), &mut Vec::new()).unwrap();
        for key_groups in [(0, 3), (3, 8)] {
            let restored = aggregate::<IntKey, AccPair>(&key, key_groups, Some(&restore_of(&value_files[..3])));
            let mut i = IntKeysWhileIntegers::Ints(restored);
            let mut v = aggregate::<Key, AccPair>(&key, key_groups, Some(&restore_of(&int_files[..3])));
            for batch in &batches[3..5] {
                same_output(&mut i, &mut v, of_key_groups(batch, &key, key_groups));
            }
            let mut whole = aggregate::<Key, AccPair>(&key, key_groups, Some(&restore_of(&int_files)));
            let next = of_key_groups(&batches[5], &key, key_groups);
            let from_whole = same_output(&mut i, &mut whole, next.clone());
            assert_eq!(from_whole, same_output(&mut v, &mut int_era, next.clone()));
            got.extend(from_whole);
        }
        let sorted = |mut r: Vec<Record>| {
            r.sort_by_key(|r| r.time);
            r
        };
        assert_eq!(sorted(got), sorted(expected), "restored at parallelism 2, the aggregates go on");
        let refused = AggregateOperator::<IntKey, AccPair>::new(
            ctx(key.clone(), (0, 8)),
            &count_and_sum(),
            &INPUT.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            Some(&restore_of(&int_files)),
        );
        assert!(refused.is_err(), "a key of another value is not restored as an integer");

        // On the rocksdb backend, with a cache of a few entries (most keys in the store, some
        // evicted while changed), the same across the move.
        if cfg!(feature = "rocksdb") {
            let on_store = || {
                let mut c = ctx(key.clone(), (0, 8));
                c.store = Some(StoreSettings {
                    parent_dir: std::env::temp_dir().join("weir-state-tests"),
                    cache_entries: 3,
                    restores_loading: Default::default(),
                });
                let input: Vec<String> = INPUT.iter().map(|s| s.to_string()).collect();
                (c, input)
            };
            let (c, input) = on_store();
            let mut ints = IntKeysWhileIntegers::Ints(
                AggregateOperator::<IntKey, AccPair>::new(c, &count_and_sum(), &input, None).unwrap(),
            );
            let (c, input) = on_store();
            let mut values = AggregateOperator::<Key, AccPair>::new(c, &count_and_sum(), &input, None).unwrap();
            for (b, batch) in batches.iter().enumerate() {
                same_output(&mut ints, &mut values, batch.clone());
                let (i, v) = (checkpoint_of(&mut ints, b as u64), checkpoint_of(&mut values, b as u64));
                assert_eq!((i.bytes(), i.int_keys), (v.bytes(), b < 3), "rocksdb, batch {b}");
            }
        }

        // Dedupe: the first record of each key, the same files, across the move.
        let mut ints =
            IntKeysWhileIntegers::Ints(DedupeOperator::<IntKey>::new(ctx(key.clone(), (0, 8)), None).unwrap());
        let mut values = DedupeOperator::<Key>::new(ctx(key.clone(), (0, 8)), None).unwrap();
        for (b, batch) in batches.iter().enumerate() {
            let first = same_output(&mut ints, &mut values, batch.clone());
            assert_eq!(b == 0 || b == 3, !first.is_empty(), "batch {b}: new keys in the first batch and with texts");
            let (i, v) = (checkpoint_of(&mut ints, b as u64), checkpoint_of(&mut values, b as u64));
            assert_eq!((i.bytes(), i.int_keys), (v.bytes(), b < 3), "batch {b}");
        }
    }
}
