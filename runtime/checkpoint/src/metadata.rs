//! The versioned, checksummed `_metadata` document of a checkpoint or savepoint.
//!
//! On disk: one header line `weir-checkpoint v<version> crc32c=<hex>` followed by the JSON body;
//! the checksum covers the body bytes. A document that fails the check is never trusted.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Current metadata format version. 2: a state file's [`FileRef::crc32c`] is its seal (the
/// CRC-32C it ends with); 1 held the whole file's CRC-32C, the same for every state file. A
/// Weir that reads only version 1 refuses version 2 at its metadata, before it reads a file
/// (where it would have found every state file's checksum wrong and recorded them damaged).
/// Version 1 is still read.
pub const FORMAT_VERSION: u32 = 2;
const MAGIC: &str = "weir-checkpoint";

/// Checkpoint or savepoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SnapshotKind {
    /// Periodic; may share files with other checkpoints.
    Checkpoint,
    /// Full and self-contained.
    Savepoint,
}

/// A reference to one state file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRef {
    /// Path relative to the directory holding `_metadata`.
    pub path: String,
    /// Length in bytes.
    pub len: u64,
    /// The file's checksum: for a state file sealed by its own CRC-32C (the `WST1` format of
    /// [`crate::format`]) that CRC, its last four bytes, which differs from file to file; for
    /// any other file (RocksDB tables) the CRC-32C of the whole file. Checkpoints written
    /// before state files recorded their seal hold the whole sealed file's CRC-32C there,
    /// which is [`SEALED_RESIDUE`] for every such file (see [`FileRef::check`]).
    pub crc32c: u32,
    /// A table file's first store key, in hex (tables of `store_tables` only). The first keys
    /// say which table holds a key before any table is fetched, so that a restore onto the
    /// rocksdb backend can start before its tables are in (checkpoints written before this
    /// field existed restore by fetching every table first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_key: Option<String>,
    /// A keyed state file that lists its deletions, then each key's put once (or again with
    /// the same value, in a set of keys): where its puts start among its entries (bytes from
    /// the first; 0 for a full image). The heap backend's increments and full images, and
    /// merged images, say so, and a restore applies the deletions on several threads at once,
    /// then the puts. Absent (the rocksdb backend's files, whose later entry of a key wins, and
    /// files written before this field existed): the entries apply in file order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub puts_from: Option<u64>,
    /// A keyed state file of the heap backend, which lists its entries by the shards of the
    /// backend's map: the bytes of each shard's entries, in shard order, separated by spaces
    /// (their sum is the entries' bytes, after the deletions of an increment). A restore that
    /// applies a chain of files shard by shard takes each shard's entries from every file
    /// without reading the files first to find them. Absent (other files, and files written
    /// before this field existed), or not as the restore expects: it reads the files for them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_bytes: Option<String>,
    /// A keyed state file of the heap backend with [`FileRef::shard_bytes`] whose entries of
    /// each shard are in window order: by the bits of their key's hash from the 13th up, the
    /// lowest first (`weir_runtime::state::map::window_order`). In a table of 4096 buckets or
    /// more of any size, the keys of 4096 neighbouring buckets then lie together in the file,
    /// so a restore of a chain of such files reads each one front to back, once, filling its
    /// tables window by window. The heap backend's increments written from its changed keys,
    /// and merged images, are. Absent (false: other files, and files written before this
    /// field existed): the restore sorts the file's entries first. A file that says so and
    /// is not is found out as it is read, and the chain is then applied file by file.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_window_order: bool,
}

impl FileRef {
    /// A reference to a file of `len` bytes whose CRC-32C is `crc32c`.
    pub fn new(path: String, len: u64, crc32c: u32) -> Self {
        FileRef { path, len, crc32c, first_key: None, puts_from: None, shard_bytes: None, in_window_order: false }
    }

    /// The same reference, for a file whose shards' entries take `lens` bytes each (see
    /// [`FileRef::shard_bytes`]).
    pub fn with_shard_bytes(mut self, lens: Option<&[u64]>) -> Self {
        self.shard_bytes = lens.map(|lens| lens.iter().map(u64::to_string).collect::<Vec<_>>().join(" "));
        self
    }

    /// The same reference, for a file whose shards' entries are in window order or not (see
    /// [`FileRef::in_window_order`]).
    pub fn with_window_order(mut self, in_window_order: bool) -> Self {
        self.in_window_order = in_window_order;
        self
    }

    /// Where each shard's entries start, from the first put (bytes, in shard order), and where
    /// the last one ends: [`FileRef::shard_bytes`] added up. `None` when the reference has none,
    /// or one that is not a list of numbers.
    pub fn shard_starts(&self) -> Option<Vec<u64>> {
        let mut starts = vec![0u64];
        for len in self.shard_bytes.as_deref()?.split(' ') {
            let len: u64 = len.parse().ok()?;
            starts.push(starts.last()?.checked_add(len)?);
        }
        Some(starts)
    }

    /// The same reference, for an increment whose puts start at `puts_from` among its entries
    /// (see [`FileRef::puts_from`]).
    pub fn with_puts_from(mut self, puts_from: Option<u64>) -> Self {
        self.puts_from = puts_from;
        self
    }

    /// The same reference, for a table file whose first store key is `key`.
    pub fn with_first_key(mut self, key: &[u8]) -> Self {
        self.first_key = Some(key.iter().map(|b| format!("{b:02x}")).collect());
        self
    }

    /// Whether `found`, what a read of the whole file found, is the file this refers to:
    /// `Err` says how it differs.
    ///
    /// A file sealed by its own checksum is this one when it is intact (its whole CRC-32C is
    /// [`SEALED_RESIDUE`]) and its seal is the recorded checksum; any other file when its whole
    /// CRC-32C is. A reference written before seals were recorded holds the residue itself,
    /// and is satisfied by any intact sealed file of its length, as it always was.
    pub fn check(&self, found: &FileDigest) -> Result<(), String> {
        if found.len != self.len {
            return Err(format!("{} bytes, metadata says {}", found.len, self.len));
        }
        if found.crc32c == self.crc32c {
            return Ok(());
        }
        let seal = u32::from_le_bytes(found.tail);
        match found.crc32c == SEALED_RESIDUE {
            true if seal == self.crc32c => Ok(()),
            true => Err(format!(
                "an intact state file, but another one: sealed by crc32c {seal:08x}, metadata says {:08x}",
                self.crc32c
            )),
            false => Err(format!("crc32c {:08x}, metadata says {:08x} (damaged)", found.crc32c, self.crc32c)),
        }
    }

    /// The table file's first store key, when the reference has one that is valid hex.
    pub fn first_key_bytes(&self) -> Option<Vec<u8>> {
        let hex = self.first_key.as_deref()?;
        if hex.len() % 2 != 0 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect()
    }
}

/// The CRC-32C of any bytes followed by their own CRC-32C (little-endian): a state file that
/// is intact has it, whatever it holds.
pub const SEALED_RESIDUE: u32 = 0x4867_4bc7;

/// What a read of a whole file found: its length, its CRC-32C and its last four bytes (the
/// seal of a state file), to [`FileRef::check`] against the reference that names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FileDigest {
    /// Bytes read.
    pub len: u64,
    /// CRC-32C of all of them.
    pub crc32c: u32,
    /// The last four (fewer in a shorter file, zero-padded at the front).
    pub tail: [u8; 4],
}

impl FileDigest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        let mut digest = FileDigest::default();
        digest.update(bytes);
        digest
    }

    /// The digest of bytes `(crc32c, len)` describe whose last bytes are `last`.
    pub fn from_parts(len: u64, crc32c: u32, last: &[u8]) -> Self {
        let mut tail = [0u8; 4];
        let n = last.len().min(4);
        tail[4 - n..].copy_from_slice(&last[last.len() - n..]);
        FileDigest { len, crc32c, tail }
    }

    /// Takes the next bytes of the file.
    pub fn update(&mut self, bytes: &[u8]) {
        self.crc32c = crc32c::crc32c_append(self.crc32c, bytes);
        self.len += bytes.len() as u64;
        let n = bytes.len().min(4);
        self.tail.rotate_left(n);
        self.tail[4 - n..].copy_from_slice(&bytes[bytes.len() - n..]);
    }
}

/// What one subtask of one operator contributed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct SubtaskSnapshot {
    /// Subtask index.
    pub subtask: u32,
    /// Key groups `[start, end)` this subtask owned.
    pub key_groups: (u32, u32),
    /// Non-keyed state (source positions, pending transactions), if any.
    pub operator_state: Option<FileRef>,
    /// Keyed state: a full image first, then increments in order. Empty means no keyed state.
    pub keyed_state: Vec<FileRef>,
    /// The entries of `keyed_state`'s first file (a full image merged in the background for
    /// the rocksdb backend) as RocksDB table files, in key order and not overlapping: that
    /// backend restores by taking them into its store whole, without reading the image.
    /// Empty when there are none; the heap backend never reads them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub store_tables: Vec<FileRef>,
    /// How many keys the keyed state held when the snapshot was taken (`keyed_state` applied
    /// in full): a restore makes room for them at once, where a map grown as a chain's
    /// increments add keys moves every entry again at each doubling. The rocksdb backend
    /// counts only its full images (savepoints, and checkpoints that write one), by their
    /// puts; absent for its increments and in snapshots written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keyed_entries: Option<u64>,
    /// Every key of `keyed_state` is one integer: the state held its keys as integers alone
    /// (a map entry of a running count then takes 24 bytes instead of 40), and a restore may
    /// hold them so again. Absent (false) when a key may be anything else, and in snapshots
    /// written before it was recorded.
    #[serde(default, skip_serializing_if = "is_false")]
    pub int_keys: bool,
    /// The bytes a key and its value took in the heap backend's hash tables (a slot): with
    /// `keyed_entries`, what a heap restore knows of its tables' size before it reads the
    /// files, to fault their memory in while it reads them. Absent on the rocksdb backend and
    /// in snapshots written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table_slot_bytes: Option<u32>,
}

/// Whether a flag is unset (left out of the document).
fn is_false(flag: &bool) -> bool {
    !flag
}

/// What one operator (by uid) contributed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct OperatorSnapshot {
    /// Parallelism at snapshot time.
    pub parallelism: u32,
    /// One entry per subtask, by index.
    pub subtasks: Vec<SubtaskSnapshot>,
    /// What the operator's state holds, as the job that wrote it names it (for example
    /// `aggregate[count,sum]`): a restore into a job whose operator of this uid holds other
    /// state is refused before anything is read. Absent in snapshots written before it was
    /// recorded, which restore unchecked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_layout: Option<String>,
}

/// The `_metadata` document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointMetadata {
    /// Format version of this document.
    pub format_version: u32,
    /// Checkpoint id.
    pub checkpoint_id: u64,
    /// Checkpoint or savepoint.
    pub kind: SnapshotKind,
    /// Job name.
    pub job_name: String,
    /// Fencing epoch of the run that wrote it (0: written before epochs existed).
    #[serde(default)]
    pub epoch: u64,
    /// Completion time, ms since the Unix epoch.
    pub created_at_ms: u64,
    /// Key groups of the job (fixed at the first run).
    pub max_parallelism: u32,
    /// State by operator uid.
    pub operators: BTreeMap<String, OperatorSnapshot>,
}

/// Why a metadata document was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MetadataError {
    /// The header line is missing or malformed.
    #[error("not a Weir checkpoint metadata document (bad header)")]
    BadHeader,
    /// Written by a newer Weir.
    #[error("metadata format v{0} is newer than this Weir understands (v{FORMAT_VERSION})")]
    UnsupportedVersion(u32),
    /// The checksum does not match: the document is corrupt or truncated.
    #[error("metadata checksum mismatch (expected {expected:08x}, found {found:08x}): corrupt or truncated")]
    ChecksumMismatch {
        /// From the header.
        expected: u32,
        /// Of the body read.
        found: u32,
    },
    /// The body is not the expected JSON.
    #[error("metadata body unreadable: {0}")]
    Body(String),
    /// The document is larger than its reader accepts (it was not read).
    #[error("metadata document of {len} bytes is larger than the {limit} bytes read")]
    TooLarge {
        /// Its size in storage.
        len: u64,
        /// The reader's bound.
        limit: u64,
    },
}

impl CheckpointMetadata {
    /// Encodes header + body.
    pub fn encode(&self) -> Vec<u8> {
        let body = serde_json::to_vec_pretty(self).expect("metadata serializes");
        let mut out = format!("{MAGIC} v{} crc32c={:08x}\n", self.format_version, crc32c::crc32c(&body)).into_bytes();
        out.extend_from_slice(&body);
        out
    }

    /// Decodes and verifies a document.
    pub fn decode(bytes: &[u8]) -> Result<CheckpointMetadata, MetadataError> {
        let newline = bytes.iter().position(|b| *b == b'\n').ok_or(MetadataError::BadHeader)?;
        let header = std::str::from_utf8(&bytes[..newline]).map_err(|_| MetadataError::BadHeader)?;
        let mut parts = header.split(' ');
        if parts.next() != Some(MAGIC) {
            return Err(MetadataError::BadHeader);
        }
        let version: u32 = parts
            .next()
            .and_then(|v| v.strip_prefix('v'))
            .and_then(|v| v.parse().ok())
            .ok_or(MetadataError::BadHeader)?;
        if version > FORMAT_VERSION {
            return Err(MetadataError::UnsupportedVersion(version));
        }
        let expected = parts
            .next()
            .and_then(|c| c.strip_prefix("crc32c="))
            .and_then(|c| u32::from_str_radix(c, 16).ok())
            .ok_or(MetadataError::BadHeader)?;
        let body = &bytes[newline + 1..];
        let found = crc32c::crc32c(body);
        if found != expected {
            return Err(MetadataError::ChecksumMismatch { expected, found });
        }
        serde_json::from_slice(body).map_err(|e| MetadataError::Body(e.to_string()))
    }

    /// Every file the document references, as `(path relative to its directory, ref)`.
    pub fn files(&self) -> impl Iterator<Item = &FileRef> {
        self.operators
            .values()
            .flat_map(|op| op.subtasks.iter())
            .flat_map(|s| s.operator_state.iter().chain(s.keyed_state.iter()).chain(s.store_tables.iter()))
    }

    /// The files a restore cannot do without: every file but the table files, which stand for
    /// a full image the document also lists (a restore that finds one missing or damaged reads
    /// the image instead).
    pub fn required_files(&self) -> impl Iterator<Item = &FileRef> {
        self.operators
            .values()
            .flat_map(|op| op.subtasks.iter())
            .flat_map(|s| s.operator_state.iter().chain(s.keyed_state.iter()))
    }

    /// Total bytes of state referenced.
    pub fn state_bytes(&self) -> u64 {
        self.files().map(|f| f.len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CheckpointMetadata {
        let mut operators = BTreeMap::new();
        operators.insert(
            "counts".to_string(),
            OperatorSnapshot {
                parallelism: 1,
                subtasks: vec![SubtaskSnapshot {
                    subtask: 0,
                    key_groups: (0, 128),
                    operator_state: None,
                    keyed_state: vec![FileRef::new("../shared/counts/0-1-0-merged.kv".into(), 10, 7)],
                    store_tables: vec![
                        FileRef::new("../shared/counts/0-1-0-merged-0.sst".into(), 4, 9).with_first_key(&[0, 3, 0xab])
                    ],
                    keyed_entries: Some(12),
                    int_keys: false,
                    table_slot_bytes: Some(24),
                }],
                state_layout: Some("aggregate[count]".into()),
            },
        );
        CheckpointMetadata {
            format_version: FORMAT_VERSION,
            checkpoint_id: 1,
            kind: SnapshotKind::Checkpoint,
            job_name: "j".into(),
            epoch: 1,
            created_at_ms: 5,
            max_parallelism: 128,
            operators,
        }
    }

    #[test]
    fn round_trips() {
        let m = sample();
        assert_eq!(CheckpointMetadata::decode(&m.encode()).unwrap(), m);
        // Table files are state too: retention keeps them and recovery checks them.
        assert_eq!(m.state_bytes(), 14);
    }

    /// Neither table files, a key count, integer keys nor a state layout (the rocksdb backend's,
    /// or a document written before they existed): the fields are left out, and a document
    /// without them reads.
    #[test]
    fn documents_without_table_files_key_counts_or_layouts_read_and_are_written_as_before() {
        let mut m = sample();
        m.operators.get_mut("counts").unwrap().subtasks[0].int_keys = true;
        let text = String::from_utf8(m.encode()).unwrap();
        assert!(text.contains("aggregate[count]") && text.contains(r#""int_keys": true"#), "{text}");
        assert!(text.contains(r#""table_slot_bytes": 24"#), "{text}");
        assert_eq!(CheckpointMetadata::decode(text.as_bytes()).unwrap(), m);
        m.operators.get_mut("counts").unwrap().subtasks[0].int_keys = false;
        m.operators.get_mut("counts").unwrap().subtasks[0].store_tables.clear();
        m.operators.get_mut("counts").unwrap().subtasks[0].keyed_entries = None;
        m.operators.get_mut("counts").unwrap().subtasks[0].table_slot_bytes = None;
        m.operators.get_mut("counts").unwrap().state_layout = None;
        let text = String::from_utf8(m.encode()).unwrap();
        assert!(!text.contains("store_tables"), "an empty list is left out: {text}");
        assert!(!text.contains("keyed_entries"), "an unknown count is left out: {text}");
        assert!(!text.contains("state_layout"), "an unknown layout is left out: {text}");
        assert!(!text.contains("int_keys"), "keys not known to be integers are left out: {text}");
        assert!(!text.contains("table_slot_bytes"), "an unknown slot size is left out: {text}");
        assert_eq!(CheckpointMetadata::decode(text.as_bytes()).unwrap(), m);
    }

    /// A table's first key survives the document; other files and documents written before
    /// the field existed have none, and a damaged one reads as none (the restore then fetches
    /// every table first) rather than as another key.
    #[test]
    fn table_first_keys_round_trip_and_are_optional() {
        let m = sample();
        let table = &m.operators["counts"].subtasks[0].store_tables[0];
        assert_eq!(table.first_key.as_deref(), Some("0003ab"));
        assert_eq!(table.first_key_bytes(), Some(vec![0, 3, 0xab]));
        let text = String::from_utf8(m.encode()).unwrap();
        assert_eq!(text.matches("first_key").count(), 1, "only the table has one: {text}");
        let old = r#"{"path":"t.sst","len":4,"crc32c":9}"#;
        assert_eq!(serde_json::from_str::<FileRef>(old).unwrap(), FileRef::new("t.sst".into(), 4, 9));
        for bad in ["0", "zz", "0g", "+1"] {
            let f = FileRef { first_key: Some(bad.into()), ..FileRef::new("t.sst".into(), 4, 9) };
            assert_eq!(f.first_key_bytes(), None, "{bad}");
        }
        assert_eq!(FileRef::new("t.sst".into(), 4, 9).with_first_key(&[]).first_key_bytes(), Some(vec![]));
    }

    /// The bytes of a file's shards survive the document as one line, and read back as where
    /// each shard starts; files written before the field existed have none, and a damaged list
    /// reads as none (the restore then reads the files for them) rather than as other starts.
    /// Whether the file is in window order survives the document too, and is false when absent.
    #[test]
    fn shard_bytes_and_window_order_round_trip_and_are_optional() {
        let mut m = sample();
        let file = &mut m.operators.get_mut("counts").unwrap().subtasks[0].keyed_state[0];
        *file = file.clone().with_shard_bytes(Some(&[3, 0, 12, 7]));
        assert_eq!(file.shard_bytes.as_deref(), Some("3 0 12 7"));
        assert_eq!(file.shard_starts(), Some(vec![0, 3, 3, 15, 22]));
        let text = String::from_utf8(m.encode()).unwrap();
        assert!(text.contains(r#""shard_bytes": "3 0 12 7""#), "{text}");
        assert_eq!(CheckpointMetadata::decode(text.as_bytes()).unwrap(), m);
        let old = r#"{"path":"a.kv","len":4,"crc32c":9,"puts_from":0}"#;
        assert_eq!(serde_json::from_str::<FileRef>(old).unwrap().shard_starts(), None);
        // Window order: written only when true, false when absent.
        assert!(!text.contains("in_window_order"), "{text}");
        assert!(!serde_json::from_str::<FileRef>(old).unwrap().in_window_order);
        let file = &mut m.operators.get_mut("counts").unwrap().subtasks[0].keyed_state[0];
        *file = file.clone().with_window_order(true);
        let text = String::from_utf8(m.encode()).unwrap();
        assert!(text.contains(r#""in_window_order": true"#), "{text}");
        assert_eq!(CheckpointMetadata::decode(text.as_bytes()).unwrap(), m);
        for bad in ["", "1  2", "1 -2", "x", "18446744073709551615 1"] {
            let f = FileRef { shard_bytes: Some(bad.into()), ..FileRef::new("a.kv".into(), 4, 9) };
            assert_eq!(f.shard_starts(), None, "{bad:?}");
        }
    }

    #[test]
    fn detects_corruption_and_truncation() {
        let mut bytes = sample().encode();
        let last = bytes.len() - 3;
        bytes[last] ^= 0x20;
        assert!(matches!(CheckpointMetadata::decode(&bytes), Err(MetadataError::ChecksumMismatch { .. })));
        let full = sample().encode();
        assert!(matches!(
            CheckpointMetadata::decode(&full[..full.len() / 2]),
            Err(MetadataError::ChecksumMismatch { .. })
        ));
        assert_eq!(CheckpointMetadata::decode(b"garbage"), Err(MetadataError::BadHeader));
    }

    #[test]
    fn refuses_newer_versions() {
        let mut m = sample();
        m.format_version = FORMAT_VERSION + 1;
        assert_eq!(CheckpointMetadata::decode(&m.encode()), Err(MetadataError::UnsupportedVersion(FORMAT_VERSION + 1)));
        // Version 1 (whole files' checksums) is still read.
        m.format_version = 1;
        assert_eq!(CheckpointMetadata::decode(&m.encode()), Ok(m.clone()));
    }

    fn sealed(values: &[u8]) -> (Vec<u8>, FileRef) {
        let mut w = crate::format::StateFileWriter::new(crate::format::FileKind::KeyedFull, 64);
        for (i, v) in values.iter().enumerate() {
            w.put(i as u32, &[i as u8], &[*v]);
        }
        let (bytes, seal) = w.finish();
        let reference = FileRef::new("0-1-1.kv".into(), bytes.len() as u64, seal);
        (bytes.to_vec(), reference)
    }

    #[test]
    fn a_reference_names_one_state_file_not_any_intact_one() {
        let (a, a_ref) = sealed(&[1, 2, 3]);
        let (b, b_ref) = sealed(&[1, 2, 4]);
        assert_eq!(a.len(), b.len());
        assert_ne!(a_ref.crc32c, b_ref.crc32c, "files that differ are sealed differently");
        a_ref.check(&FileDigest::of(&a)).unwrap();
        b_ref.check(&FileDigest::of(&b)).unwrap();
        // Both intact, of the same length: only the seal tells them apart.
        let other = a_ref.check(&FileDigest::of(&b)).unwrap_err();
        assert!(other.contains("another one"), "{other}");
        let mut damaged = a.clone();
        damaged[6] ^= 1;
        let why = a_ref.check(&FileDigest::of(&damaged)).unwrap_err();
        assert!(why.contains("damaged"), "{why}");
        let why = a_ref.check(&FileDigest::of(&a[..a.len() - 1])).unwrap_err();
        assert!(why.contains("metadata says"), "{why}");
        // A checkpoint written before seals were recorded lists the residue: any intact state
        // file of the length passes, as it did, and a damaged one still fails.
        let old = FileRef::new(a_ref.path.clone(), a_ref.len, SEALED_RESIDUE);
        old.check(&FileDigest::of(&a)).unwrap();
        old.check(&FileDigest::of(&b)).unwrap();
        assert!(old.check(&FileDigest::of(&damaged)).is_err());
    }

    #[test]
    fn a_file_without_a_seal_is_named_by_its_whole_checksum() {
        let table = b"not a state file: a rocksdb table".to_vec();
        let reference = FileRef::new("t.sst".into(), table.len() as u64, crc32c::crc32c(&table));
        reference.check(&FileDigest::of(&table)).unwrap();
        let mut changed = table.clone();
        changed[0] ^= 1;
        assert!(reference.check(&FileDigest::of(&changed)).is_err());
    }

    #[test]
    fn a_digest_taken_piece_by_piece_is_the_whole_files() {
        let (file, _) = sealed(&(0..200).map(|i| i as u8).collect::<Vec<_>>());
        let whole = FileDigest::of(&file);
        assert_eq!(whole.tail, file[file.len() - 4..]);
        for piece in [1, 2, 3, 5, 64, file.len()] {
            let mut digest = FileDigest::default();
            for chunk in file.chunks(piece) {
                digest.update(chunk);
                digest.update(&[]);
            }
            assert_eq!(digest, whole, "pieces of {piece}");
        }
        assert_eq!(FileDigest::from_parts(whole.len, whole.crc32c, &file), whole);
        assert_eq!(FileDigest::of(b"ab").tail, [0, 0, b'a', b'b']);
    }
}
