//! The state-backend spike of issue 12 (see README.md next to this file).
//!
//! One workload, three stores: the keyed count's state access, a counter per key read,
//! incremented and written back, in batches of 1,024 records with uniformly random keys,
//! with a checkpoint every second of wall time. Keys are laid out as an on-disk backend would
//! lay them out: the key group (2 bytes, big-endian) then the key (8 bytes), so that one
//! subtask's key-group range is one contiguous key range.
//!
//! - `heap`: an `FxHashMap<u64, i64>`, the ceiling (no checkpoint: it is the reference).
//! - `rocksdb`: multi-get, write batch without WAL; a checkpoint is RocksDB's own (flush,
//!   hard links) followed by the upload of the SST files not uploaded before (incremental)
//!   to an object store; a restore downloads the newest checkpoint's files and opens them.
//! - `slatedb`: gets, write batch without WAL, on the object store itself; a checkpoint is
//!   `Db::create_checkpoint` (flush the memtable as an L0 SST, write a manifest); a restore
//!   clones the database at that checkpoint (a manifest over the same SSTs: nothing copied).
//!
//! Every run prints one `RESULT` line: records per CPU-second of the whole process (all
//! threads, as for Flink), the checkpoints' durations (p50, p99, max), bytes written to the
//! object store, resident memory, and the restore's time to the first read and to a full scan.
//!
//!   weir-state-spike STORE [--keys N] [--records N] [--dir DIR]

use std::path::{Path, PathBuf};
#[allow(unused_imports)]
use std::sync::Arc;
use std::time::{Duration, Instant};

#[allow(unused_imports)]
use object_store::{local::LocalFileSystem, ObjectStore};

const BATCH: usize = 1024;
const MAX_PARALLELISM: u64 = 128;

struct Args {
    store: String,
    keys: u64,
    records: u64,
    dir: PathBuf,
}

fn args() -> Args {
    let mut a = std::env::args().skip(1);
    let store = a.next().unwrap_or_else(|| "heap".into());
    let mut args =
        Args { store, keys: 1_000_000, records: 20_000_000, dir: std::env::temp_dir().join("weir-state-spike") };
    while let Some(flag) = a.next() {
        let v = a.next().expect("a flag needs a value");
        match flag.as_str() {
            "--keys" => args.keys = v.parse().expect("--keys N"),
            "--records" => args.records = v.parse().expect("--records N"),
            "--dir" => args.dir = v.into(),
            _ => panic!("unknown flag {flag}"),
        }
    }
    args
}

/// The record stream: xorshift64*, the same in every store.
struct Keys(u64, u64);
impl Keys {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % self.1
    }
}

fn encode_key(k: u64) -> [u8; 10] {
    // Any stable hash spreads keys over key groups; the murmur finalizer is enough here.
    let mut h = k ^ (k >> 33);
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    let kg = (h % MAX_PARALLELISM) as u16;
    let mut out = [0u8; 10];
    out[..2].copy_from_slice(&kg.to_be_bytes());
    out[2..].copy_from_slice(&k.to_be_bytes());
    out
}

fn cpu_seconds() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn max_rss_mib() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    u.ru_maxrss as f64 / 1024.0
}

fn dir_bytes(p: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else { return 0 };
    rd.flatten()
        .map(|e| {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                dir_bytes(&e.path())
            } else {
                m.len()
            }
        })
        .sum()
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// What each store does; the driver is shared.
#[allow(dead_code)]
trait Store {
    /// Reads the counters of a batch of keys.
    fn get_batch(&mut self, keys: &[[u8; 10]], out: &mut Vec<Option<i64>>);
    /// Writes the counters back.
    fn put_batch(&mut self, keys: &[[u8; 10]], values: &[i64]);
    /// A checkpoint: returns its duration on the task thread and in the background.
    fn checkpoint(&mut self, id: u64) -> (Duration, Duration);
    /// Drops the store as a crash would and reopens the newest checkpoint: the time to the
    /// first read, then the time to read every key.
    fn restore(self: Box<Self>) -> (Duration, Duration, u64);
}

#[allow(dead_code)]
fn drive(mut store: Box<dyn Store>, a: &Args, objects: &Path) {
    let mut keys = Keys(0x9e37_79b9_7f4a_7c15, a.keys);
    let (mut batch, mut values, mut got) =
        (Vec::with_capacity(BATCH), Vec::with_capacity(BATCH), Vec::with_capacity(BATCH));
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let mut last_checkpoint = Instant::now();
    let (mut sync_ms, mut async_ms) = (Vec::new(), Vec::new());
    let mut done = 0u64;
    let mut checkpoint_id = 0;
    while done < a.records {
        batch.clear();
        for _ in 0..BATCH {
            batch.push(encode_key(keys.next()));
        }
        // Within a batch a key may repeat: the batch reads once and counts in a small map,
        // as a keyed operator would with a write-back cache.
        batch.sort_unstable();
        let mut counts: Vec<i64> = Vec::with_capacity(BATCH);
        let mut uniq: Vec<[u8; 10]> = Vec::with_capacity(BATCH);
        for k in &batch {
            if uniq.last() == Some(k) {
                *counts.last_mut().unwrap() += 1;
            } else {
                uniq.push(*k);
                counts.push(1);
            }
        }
        store.get_batch(&uniq, &mut got);
        values.clear();
        values.extend(got.iter().zip(&counts).map(|(g, c)| g.unwrap_or(0) + c));
        store.put_batch(&uniq, &values);
        done += BATCH as u64;
        if last_checkpoint.elapsed() >= Duration::from_secs(1) {
            checkpoint_id += 1;
            let (s, b) = store.checkpoint(checkpoint_id);
            sync_ms.push(s.as_secs_f64() * 1e3);
            async_ms.push(b.as_secs_f64() * 1e3);
            last_checkpoint = Instant::now();
        }
    }
    checkpoint_id += 1;
    let (s, b) = store.checkpoint(checkpoint_id);
    sync_ms.push(s.as_secs_f64() * 1e3);
    async_ms.push(b.as_secs_f64() * 1e3);
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
    let rss = max_rss_mib();
    let n = sync_ms.len();
    let (s50, s99, smax) =
        (percentile(&mut sync_ms, 0.5), percentile(&mut sync_ms, 0.99), percentile(&mut sync_ms, 1.0));
    let (b50, b99) = (percentile(&mut async_ms, 0.5), percentile(&mut async_ms, 0.99));
    let stored = dir_bytes(objects);
    let (first, all, read) = store.restore();
    println!(
        "RESULT store={} keys={} records={} wall_s={wall:.2} cpu_s={cpu:.2} rec_per_cpu_s={:.0} \
         checkpoints={n} sync_ms_p50={s50:.1} sync_ms_p99={s99:.1} sync_ms_max={smax:.1} \
         async_ms_p50={b50:.1} async_ms_p99={b99:.1} object_store_mib={:.1} max_rss_mib={rss:.0} \
         restore_first_read_ms={:.1} restore_full_scan_ms={:.1} restored_keys={read}",
        a.store,
        a.keys,
        done,
        done as f64 / cpu,
        stored as f64 / 1048576.0,
        first.as_secs_f64() * 1e3,
        all.as_secs_f64() * 1e3,
    );
}

fn heap(a: &Args) {
    let mut keys = Keys(0x9e37_79b9_7f4a_7c15, a.keys);
    let mut map: rustc_hash::FxHashMap<u64, i64> = Default::default();
    let (t0, c0) = (Instant::now(), cpu_seconds());
    for _ in 0..a.records {
        *map.entry(keys.next()).or_default() += 1;
    }
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
    println!(
        "RESULT store=heap keys={} records={} wall_s={wall:.2} cpu_s={cpu:.2} rec_per_cpu_s={:.0} \
         distinct={} max_rss_mib={:.0}",
        a.keys,
        a.records,
        a.records as f64 / cpu,
        map.len(),
        max_rss_mib()
    );
}

#[cfg(feature = "rocksdb")]
mod rocks {
    use super::*;
    use rocksdb::{checkpoint::Checkpoint, IteratorMode, Options, WriteBatch, WriteOptions, DB};
    use std::collections::HashSet;

    pub struct Rocks {
        db: Option<DB>,
        dir: PathBuf,
        objects: Arc<LocalFileSystem>,
        uploaded: HashSet<String>,
        newest: Vec<String>,
        rt: tokio::runtime::Runtime,
    }

    fn options() -> Options {
        let mut o = Options::default();
        o.create_if_missing(true);
        o.set_compression_type(rocksdb::DBCompressionType::Lz4);
        o.set_write_buffer_size(64 << 20);
        let mut t = rocksdb::BlockBasedOptions::default();
        t.set_bloom_filter(10.0, false);
        t.set_block_cache(&rocksdb::Cache::new_lru_cache(256 << 20));
        o.set_block_based_table_factory(&t);
        o
    }

    impl Rocks {
        pub fn open(dir: &Path, objects: &Path) -> Rocks {
            let db = DB::open(&options(), dir.join("db")).unwrap();
            Rocks {
                db: Some(db),
                dir: dir.to_path_buf(),
                objects: Arc::new(LocalFileSystem::new_with_prefix(objects).unwrap()),
                uploaded: HashSet::new(),
                newest: Vec::new(),
                rt: tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap(),
            }
        }
    }

    impl Store for Rocks {
        fn get_batch(&mut self, keys: &[[u8; 10]], out: &mut Vec<Option<i64>>) {
            out.clear();
            for r in self.db.as_ref().unwrap().multi_get(keys) {
                out.push(r.unwrap().map(|v| i64::from_le_bytes(v[..8].try_into().unwrap())));
            }
        }
        fn put_batch(&mut self, keys: &[[u8; 10]], values: &[i64]) {
            let mut b = WriteBatch::default();
            for (k, v) in keys.iter().zip(values) {
                b.put(k, v.to_le_bytes());
            }
            let mut wo = WriteOptions::default();
            wo.disable_wal(true);
            self.db.as_ref().unwrap().write_opt(b, &wo).unwrap();
        }
        fn checkpoint(&mut self, id: u64) -> (Duration, Duration) {
            let t = Instant::now();
            let local = self.dir.join(format!("chk-{id}"));
            Checkpoint::new(self.db.as_ref().unwrap()).unwrap().create_checkpoint(&local).unwrap();
            let sync = t.elapsed();
            let t = Instant::now();
            // Upload: SST files once (their names are unique), the rest per checkpoint.
            let mut files = Vec::new();
            for e in std::fs::read_dir(&local).unwrap().flatten() {
                let name = e.file_name().into_string().unwrap();
                let dest = if name.ends_with(".sst") { format!("shared/{name}") } else { format!("chk-{id}/{name}") };
                files.push(dest.clone());
                if name.ends_with(".sst") && !self.uploaded.insert(name.clone()) {
                    continue;
                }
                let data = std::fs::read(e.path()).unwrap();
                self.rt.block_on(self.objects.put(&dest.as_str().into(), data.into())).unwrap();
            }
            std::fs::remove_dir_all(&local).unwrap();
            self.newest = files;
            (sync, t.elapsed())
        }
        fn restore(mut self: Box<Self>) -> (Duration, Duration, u64) {
            drop(self.db.take());
            let t = Instant::now();
            let into = self.dir.join("restored");
            std::fs::create_dir_all(&into).unwrap();
            for f in &self.newest {
                let data = self
                    .rt
                    .block_on(async { self.objects.get(&f.as_str().into()).await.unwrap().bytes().await.unwrap() });
                std::fs::write(into.join(f.rsplit('/').next().unwrap()), data).unwrap();
            }
            let db = DB::open(&options(), &into).unwrap();
            let _ = db.get(encode_key(1)).unwrap();
            let first = t.elapsed();
            let n = db.iterator(IteratorMode::Start).count() as u64;
            (first, t.elapsed(), n)
        }
    }
}

#[cfg(feature = "slatedb")]
mod slate {
    use super::*;
    use slatedb::admin::Admin;
    use slatedb::config::{CheckpointOptions, CheckpointScope, Settings, WriteOptions};
    use slatedb::{Db, WriteBatch};

    pub struct Slate {
        db: Option<Db>,
        objects: Arc<dyn ObjectStore>,
        newest: Option<uuid::Uuid>,
        rt: tokio::runtime::Runtime,
    }

    fn settings() -> Settings {
        Settings { flush_interval: None, wal_enabled: false, ..Settings::default() }
    }

    impl Slate {
        pub fn open(objects: &Path) -> Slate {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            let objects: Arc<dyn ObjectStore> = Arc::new(LocalFileSystem::new_with_prefix(objects).unwrap());
            let db = rt.block_on(Db::builder("db", objects.clone()).with_settings(settings()).build()).unwrap();
            Slate { db: Some(db), objects, newest: None, rt }
        }
    }

    impl Store for Slate {
        fn get_batch(&mut self, keys: &[[u8; 10]], out: &mut Vec<Option<i64>>) {
            let db = self.db.as_ref().unwrap();
            out.clear();
            let got = self.rt.block_on(futures::future::join_all(keys.iter().map(|k| db.get(k))));
            out.extend(got.into_iter().map(|r| r.unwrap().map(|v| i64::from_le_bytes(v[..8].try_into().unwrap()))));
        }
        fn put_batch(&mut self, keys: &[[u8; 10]], values: &[i64]) {
            let mut b = WriteBatch::new();
            for (k, v) in keys.iter().zip(values) {
                b.put(k, v.to_le_bytes());
            }
            let wo = WriteOptions { await_durable: false, ..Default::default() };
            self.rt.block_on(self.db.as_ref().unwrap().write_with_options(b, &wo)).unwrap();
        }
        fn checkpoint(&mut self, _id: u64) -> (Duration, Duration) {
            let t = Instant::now();
            let r = self
                .rt
                .block_on(
                    self.db.as_ref().unwrap().create_checkpoint(CheckpointScope::All, &CheckpointOptions::default()),
                )
                .unwrap();
            self.newest = Some(r.id);
            (t.elapsed(), Duration::ZERO)
        }
        fn restore(mut self: Box<Self>) -> (Duration, Duration, u64) {
            let db = self.db.take().unwrap();
            self.rt.block_on(db.close()).unwrap();
            let t = Instant::now();
            let admin = Admin::builder("restored", self.objects.clone()).build();
            self.rt.block_on(admin.create_clone_builder("db", self.newest).build()).unwrap();
            let db = self
                .rt
                .block_on(Db::builder("restored", self.objects.clone()).with_settings(settings()).build())
                .unwrap();
            let _ = self.rt.block_on(db.get(encode_key(1))).unwrap();
            let first = t.elapsed();
            let n = self.rt.block_on(async {
                let mut it = db.scan::<Vec<u8>, _>(..).await.unwrap();
                let mut n = 0u64;
                while it.next().await.unwrap().is_some() {
                    n += 1;
                }
                n
            });
            (first, t.elapsed(), n)
        }
    }
}

fn main() {
    let a = args();
    let _ = std::fs::remove_dir_all(&a.dir);
    std::fs::create_dir_all(&a.dir).unwrap();
    let objects = a.dir.join("objects");
    std::fs::create_dir_all(&objects).unwrap();
    match a.store.as_str() {
        "heap" => heap(&a),
        #[cfg(feature = "rocksdb")]
        "rocksdb" => drive(Box::new(rocks::Rocks::open(&a.dir, &objects)), &a, &objects),
        #[cfg(feature = "slatedb")]
        "slatedb" => drive(Box::new(slate::Slate::open(&objects)), &a, &objects),
        s => panic!("store {s} is not built in (cargo features rocksdb, slatedb)"),
    }
}
