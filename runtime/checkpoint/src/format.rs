//! The canonical binary format of state files, independent of any state backend.
//!
//! ```text
//! file    := magic "WST1" | kind u8 | body | crc32c u32-le (of everything before it)
//! kind    := 0 keyed full image | 1 keyed increment | 2 operator state
//!          | 3 keyed increment by key group (unchecked index, read only)
//!          | 4 keyed increment by key group
//! keyed   := entry*           entry := key_group varint | key bytes | op u8 (0 delete, 1 put) [| value bytes]
//! by key group := index_len u32-le | index | entry*   (entries ordered by key group)
//! index   := (key_group_step varint | entries_len varint | entries_crc32c u32-le)* | index_crc32c u32-le
//! index (kind 3) := (key_group_step varint | entries_len varint)*
//! operator:= bytes            (an opaque document owned by the operator)
//! bytes   := len varint | raw
//! ```
//! Keyed entries carry their key group, so a restore at another parallelism reads only what
//! falls into its range. An increment ordered by key group (kind 4, written by the rocksdb
//! backend) reads like any other ([`open`] and [`read_keyed_parts`] skip its index; it opens as
//! [`FileKind::KeyedIncrement`]), and its index ([`read_increment_index`]) says where each key
//! group's entries are, so that a restore can read a range of key groups without the rest.
//! The entries of one key group keep the order they were written in. Each key group's entries
//! carry their own CRC-32C in the index, and the index one of its own (over the file's bytes
//! before it), so that a stretch of key groups read alone from object storage is verified
//! without the rest of the file ([`IncrementIndex::verify`]). Kind 3, the first such
//! increments, had neither: they are still read, but only whole.

use bytes::Bytes;

const MAGIC: &[u8; 4] = b"WST1";

/// What a state file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// All keyed entries of a subtask.
    KeyedFull = 0,
    /// Keyed entries changed (or deleted) since the previous file of the chain.
    KeyedIncrement = 1,
    /// An operator's non-keyed state document.
    OperatorState = 2,
}

/// Why a state file could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    /// Shorter than the smallest valid file.
    #[error("state file truncated ({0} bytes)")]
    Truncated(usize),
    /// Wrong magic bytes.
    #[error("not a Weir state file")]
    BadMagic,
    /// The trailing checksum does not match.
    #[error("state file checksum mismatch: corrupt")]
    ChecksumMismatch,
    /// Unknown kind byte.
    #[error("unknown state file kind {0}")]
    UnknownKind(u8),
    /// The entries of a key group of an increment do not match their checksum.
    #[error("state file checksum mismatch in the entries of key group {0}: corrupt")]
    KeyGroupChecksumMismatch(u32),
    /// An increment's key-group index does not match its entries.
    #[error("state file key-group index malformed: {0}")]
    BadIndex(&'static str),
    /// The body ended in the middle of an entry.
    #[error("state file body malformed at byte {0}")]
    Malformed(usize),
}

/// Appends little building blocks to a byte buffer.
#[derive(Default, Debug)]
pub struct Encoder {
    /// The bytes written so far.
    pub buf: Vec<u8>,
}

impl Encoder {
    /// An empty encoder with room for `cap` bytes.
    pub fn with_capacity(cap: usize) -> Self {
        Encoder { buf: Vec::with_capacity(cap) }
    }

    /// LEB128 unsigned varint.
    #[inline]
    pub fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.buf.push(v as u8);
    }

    /// Zig-zag signed varint.
    #[inline]
    pub fn svarint(&mut self, v: i64) {
        self.varint(((v << 1) ^ (v >> 63)) as u64);
    }

    /// One byte.
    #[inline]
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }

    /// Eight bytes, little-endian.
    #[inline]
    pub fn f64(&mut self, v: f64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Length-prefixed bytes.
    #[inline]
    pub fn bytes(&mut self, b: &[u8]) {
        self.varint(b.len() as u64);
        self.buf.extend_from_slice(b);
    }

    /// Writes what `write` encodes behind its exact length, as [`Self::bytes`] would. The bytes
    /// are encoded in place behind `*prefix` bytes reserved for the length, patched afterwards:
    /// the caller keeps `*prefix` per field, the size of that field's last length, so that
    /// fields of similar lengths never move. A length of another size moves the bytes once and
    /// updates `*prefix` (a 630-byte value behind a one-byte guess was copied twice, half of
    /// a full image's encoding of long values).
    #[inline]
    pub fn length_prefixed(&mut self, prefix: &mut usize, write: impl FnOnce(&mut Encoder)) {
        let at = self.buf.len();
        let reserved = *prefix;
        if reserved == 1 {
            self.buf.push(0);
        } else {
            self.buf.resize(at + reserved, 0);
        }
        write(self);
        let len = self.buf.len() - at - reserved;
        if reserved == 1 && len < 0x80 {
            self.buf[at] = len as u8;
        } else {
            self.patch_length(at, reserved, len, prefix);
        }
    }

    /// Writes the varint of `len` at `at`, where `reserved` bytes were kept for it, moving the
    /// `len` bytes behind them when it takes another size (then `*prefix` becomes that size).
    fn patch_length(&mut self, at: usize, reserved: usize, len: usize, prefix: &mut usize) {
        // Encoded at the end, then taken off again.
        let end = self.buf.len();
        self.varint(len as u64);
        let mut varint = [0u8; 10];
        let n = self.buf.len() - end;
        varint[..n].copy_from_slice(&self.buf[end..]);
        self.buf.truncate(end);
        if n != reserved {
            if n > reserved {
                self.buf.resize(end + n - reserved, 0);
            }
            self.buf.copy_within(at + reserved..end, at + n);
            self.buf.truncate(end + n - reserved);
            *prefix = n;
        }
        self.buf[at..at + n].copy_from_slice(&varint[..n]);
    }
}

/// Reads what [`Encoder`] wrote.
#[derive(Debug)]
pub struct Decoder<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Decoder<'a> {
    /// Reads from `data`.
    #[inline]
    pub fn new(data: &'a [u8]) -> Self {
        Decoder { data, pos: 0 }
    }

    /// Whether everything was read.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    /// Current offset.
    #[inline]
    pub fn position(&self) -> usize {
        self.pos
    }

    /// LEB128 unsigned varint.
    #[inline]
    pub fn varint(&mut self) -> Result<u64, FormatError> {
        // Most varints in state files (key groups, lengths, small counts) are one byte.
        if let Some(&b) = self.data.get(self.pos) {
            if b < 0x80 {
                self.pos += 1;
                return Ok(u64::from(b));
            }
        }
        self.varint_long().ok_or(FormatError::Malformed(self.pos))
    }

    /// [`Self::varint`] of two or more bytes; `None` when malformed (or none left), with the
    /// position where it failed. An `Option` comes back in two registers: the `Result` this
    /// returned before came back through memory, its tag written as a byte, and a restore's
    /// decoding loop, which read those bytes four at a time, waited for the write on every key
    /// of two bytes or more (`perf annotate`: four fifths of the decoding thread's samples).
    #[inline(never)]
    fn varint_long(&mut self) -> Option<u64> {
        let mut v: u64 = 0;
        let mut shift = 0;
        loop {
            let b = *self.data.get(self.pos)?;
            self.pos += 1;
            if shift >= 64 {
                return None;
            }
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Some(v);
            }
            shift += 7;
        }
    }

    /// Zig-zag signed varint. Always inlined: a restore's decoding loop called it for every
    /// count it read (`perf`: 2-3% of a 90M-key chain's restore in the call alone).
    #[inline(always)]
    pub fn svarint(&mut self) -> Result<i64, FormatError> {
        let v = self.varint()?;
        Ok(((v >> 1) as i64) ^ -((v & 1) as i64))
    }

    /// One byte.
    #[inline]
    pub fn u8(&mut self) -> Result<u8, FormatError> {
        let b = *self.data.get(self.pos).ok_or(FormatError::Malformed(self.pos))?;
        self.pos += 1;
        Ok(b)
    }

    /// Eight bytes, little-endian.
    #[inline]
    pub fn f64(&mut self) -> Result<f64, FormatError> {
        let end = self.pos + 8;
        let raw = self.data.get(self.pos..end).ok_or(FormatError::Malformed(self.pos))?;
        self.pos = end;
        Ok(f64::from_le_bytes(raw.try_into().expect("8 bytes")))
    }

    /// Four bytes, little-endian.
    #[inline]
    pub fn u32_le(&mut self) -> Result<u32, FormatError> {
        let end = self.pos + 4;
        let raw = self.data.get(self.pos..end).ok_or(FormatError::Malformed(self.pos))?;
        self.pos = end;
        Ok(u32::from_le_bytes(raw.try_into().expect("4 bytes")))
    }

    /// Length-prefixed bytes.
    #[inline]
    pub fn bytes(&mut self) -> Result<&'a [u8], FormatError> {
        let len = self.varint()? as usize;
        let end = self.pos.checked_add(len).ok_or(FormatError::Malformed(self.pos))?;
        let raw = self.data.get(self.pos..end).ok_or(FormatError::Malformed(self.pos))?;
        self.pos = end;
        Ok(raw)
    }
}

/// The kind byte of the first increments ordered by key group, without checksums in their
/// index (read, no longer written).
const KIND_INCREMENT_BY_KEY_GROUP_UNCHECKED: u8 = 3;

/// The kind byte of an increment ordered by key group.
const KIND_INCREMENT_BY_KEY_GROUP: u8 = 4;

/// Bytes before the entries of a file: magic and kind.
const HEADER_LEN: usize = MAGIC.len() + 1;

/// Builds one state file.
#[derive(Debug)]
pub struct StateFileWriter {
    enc: Encoder,
    /// The length sizes reserved for the next key and value ([`Encoder::length_prefixed`]).
    key_prefix: usize,
    value_prefix: usize,
    entries: u64,
    /// For an increment ordered by key group: each entry's key group and length, in the
    /// order written (the file is ordered when finished).
    by_key_group: Option<Vec<(u32, u32)>>,
}

impl StateFileWriter {
    /// Bytes of entries written so far: where the next entry starts among the file's entries
    /// (for a file without an index).
    pub fn entries_len(&self) -> usize {
        self.enc.buf.len() - HEADER_LEN
    }

    /// Starts a file of `kind`.
    pub fn new(kind: FileKind, capacity: usize) -> Self {
        // Increments are written at every checkpoint: into memory an earlier one gave back.
        let mut enc = match kind {
            FileKind::KeyedIncrement => Encoder { buf: crate::spare::take(capacity + 16) },
            _ => Encoder::with_capacity(capacity + 16),
        };
        enc.buf.extend_from_slice(MAGIC);
        enc.u8(kind as u8);
        StateFileWriter { enc, key_prefix: 1, value_prefix: 1, entries: 0, by_key_group: None }
    }

    /// Starts an increment ordered by key group, with an index of where each key group's
    /// entries are (see the module's documentation). Entries may come in any order; those of
    /// one key group keep theirs.
    pub fn increment_by_key_group(capacity: usize) -> Self {
        let mut w = Self::new(FileKind::KeyedIncrement, capacity);
        w.enc.buf[HEADER_LEN - 1] = KIND_INCREMENT_BY_KEY_GROUP;
        w.by_key_group = Some(Vec::with_capacity(capacity / 24));
        w
    }

    /// Records the entry that starts at `at` (for an increment ordered by key group).
    #[inline]
    fn entry_written(&mut self, key_group: u32, at: usize) {
        self.entries += 1;
        if let Some(entries) = &mut self.by_key_group {
            entries.push((key_group, (self.enc.buf.len() - at) as u32));
        }
    }

    /// Adds a keyed put.
    #[inline]
    pub fn put(&mut self, key_group: u32, key: &[u8], value: &[u8]) {
        let at = self.enc.buf.len();
        self.enc.varint(u64::from(key_group));
        self.enc.bytes(key);
        self.enc.u8(1);
        self.enc.bytes(value);
        self.entry_written(key_group, at);
    }

    /// Adds a keyed deletion.
    #[inline]
    pub fn delete(&mut self, key_group: u32, key: &[u8]) {
        let at = self.enc.buf.len();
        self.enc.varint(u64::from(key_group));
        self.enc.bytes(key);
        self.enc.u8(0);
        self.entry_written(key_group, at);
    }

    /// Adds a keyed put whose value is encoded in place by `value`.
    pub fn put_with(&mut self, key_group: u32, key: &[u8], value: impl FnOnce(&mut Encoder)) {
        self.put_encoded(key_group, |e| e.buf.extend_from_slice(key), value);
    }

    /// Adds a keyed put whose key and value are encoded in place (no intermediate buffers).
    #[inline]
    pub fn put_encoded(&mut self, key_group: u32, key: impl FnOnce(&mut Encoder), value: impl FnOnce(&mut Encoder)) {
        let at = self.enc.buf.len();
        self.enc.varint(u64::from(key_group));
        self.enc.length_prefixed(&mut self.key_prefix, key);
        self.enc.u8(1);
        self.enc.length_prefixed(&mut self.value_prefix, value);
        self.entry_written(key_group, at);
    }

    /// Adds a keyed deletion whose key is encoded in place.
    #[inline]
    pub fn delete_encoded(&mut self, key_group: u32, key: impl FnOnce(&mut Encoder)) {
        let at = self.enc.buf.len();
        self.enc.varint(u64::from(key_group));
        self.enc.length_prefixed(&mut self.key_prefix, key);
        self.enc.u8(0);
        self.entry_written(key_group, at);
    }

    /// Sets the operator-state document (for [`FileKind::OperatorState`] files).
    pub fn document(&mut self, doc: &[u8]) {
        self.enc.bytes(doc);
    }

    /// Number of keyed entries written.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// The keyed entries written, in the order written, without the file's header, and their
    /// number: for appending to a [`StateFileStream`] with [`StateFileStream::put_entries`].
    pub fn into_entries(self) -> (Vec<u8>, u64) {
        let mut buf = self.enc.buf;
        buf.drain(..HEADER_LEN);
        (buf, self.entries)
    }

    /// Seals the file with its checksum; returns the bytes and that checksum, the file's seal
    /// (the CRC-32C of everything before it, as a checkpoint lists the file: see
    /// [`crate::FileRef::check`]).
    pub fn finish(mut self) -> (Bytes, u32) {
        if let Some(entries) = self.by_key_group.take() {
            let ordered = ordered_by_key_group(&self.enc.buf, &entries, true);
            crate::spare::give_back(std::mem::replace(&mut self.enc.buf, ordered));
        }
        let crc = crc32c::crc32c(&self.enc.buf);
        self.enc.buf.extend_from_slice(&crc.to_le_bytes());
        (Bytes::from(self.enc.buf), crc)
    }
}

/// The file `written` (header, then entries of the given key groups and lengths, in that
/// order) as an increment ordered by key group: header, index, then the entries moved to their
/// key group's place (a counting sort: one pass to count, one to move). With `checked` (kind 4)
/// the index holds each key group's checksum and its own; without (kind 3, for tests of
/// reading old files) neither.
fn ordered_by_key_group(written: &[u8], entries: &[(u32, u32)], checked: bool) -> Vec<u8> {
    let (lowest, highest) =
        entries.iter().fold((u32::MAX, 0), |(lo, hi), &(key_group, _)| (lo.min(key_group), hi.max(key_group)));
    let mut bytes_of: Vec<u64> = vec![0; if entries.is_empty() { 0 } else { (highest - lowest) as usize + 1 }];
    for &(key_group, len) in entries {
        bytes_of[(key_group - lowest) as usize] += u64::from(len);
    }
    let mut index = Encoder::with_capacity(bytes_of.len() * 8 + 4);
    // Where each key group's checksum goes in the index, patched once its entries are in place.
    let mut crc_at = Vec::with_capacity(bytes_of.len());
    let mut previous = 0u32;
    for (i, &bytes) in bytes_of.iter().enumerate().filter(|(_, &bytes)| bytes > 0) {
        let key_group = lowest + i as u32;
        index.varint(u64::from(key_group - previous));
        index.varint(bytes);
        if checked {
            crc_at.push(index.buf.len());
            index.buf.extend_from_slice(&[0; 4]);
        }
        previous = key_group;
    }
    if checked {
        index.buf.extend_from_slice(&[0; 4]);
    }
    let index_at = HEADER_LEN + 4;
    let entries_at = index_at + index.buf.len();
    let mut out = crate::spare::take(written.len() + 4 + index.buf.len() + 4);
    out.resize(written.len() + 4 + index.buf.len(), 0);
    out[..HEADER_LEN].copy_from_slice(&written[..HEADER_LEN]);
    out[HEADER_LEN - 1] = if checked { KIND_INCREMENT_BY_KEY_GROUP } else { KIND_INCREMENT_BY_KEY_GROUP_UNCHECKED };
    out[HEADER_LEN..index_at].copy_from_slice(&(index.buf.len() as u32).to_le_bytes());
    out[index_at..entries_at].copy_from_slice(&index.buf);
    // Where the next entry of each key group goes.
    let mut next_at = Vec::with_capacity(bytes_of.len());
    let mut at = entries_at;
    for bytes in &bytes_of {
        next_at.push(at);
        at += *bytes as usize;
    }
    let mut from = HEADER_LEN;
    for &(key_group, len) in entries {
        let len = len as usize;
        let to = &mut next_at[(key_group - lowest) as usize];
        out[*to..*to + len].copy_from_slice(&written[from..from + len]);
        *to += len;
        from += len;
    }
    if checked {
        let mut at = entries_at;
        for (&bytes, &slot) in bytes_of.iter().filter(|&&bytes| bytes > 0).zip(&crc_at) {
            let crc = crc32c::crc32c(&out[at..at + bytes as usize]);
            out[index_at + slot..index_at + slot + 4].copy_from_slice(&crc.to_le_bytes());
            at += bytes as usize;
        }
        let crc = crc32c::crc32c(&out[..entries_at - 4]);
        out[entries_at - 4..entries_at].copy_from_slice(&crc.to_le_bytes());
    }
    out
}

/// Where one key group's entries are in an increment ordered by key group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyGroupEntries {
    /// The key group.
    pub key_group: u32,
    /// Offset of its first entry from the start of the file.
    pub offset: u64,
    /// Length of its entries in bytes.
    pub len: u64,
    /// The CRC-32C of its entries (`None` in the unchecked increments of kind 3).
    pub crc32c: Option<u32>,
}

/// The index of an increment ordered by key group: where each key group's entries are.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IncrementIndex {
    /// Key groups that have entries, increasing; their entries follow each other.
    pub key_groups: Vec<KeyGroupEntries>,
    /// Whether each key group's entries carry their checksum (kind 4), so that a stretch can
    /// be read and verified alone.
    pub checked: bool,
}

impl IncrementIndex {
    /// The key groups of `[first, last)` that have entries, as indices into `key_groups`.
    fn within(&self, (first, last): (u32, u32)) -> std::ops::Range<usize> {
        let from = self.key_groups.partition_point(|k| k.key_group < first);
        let to = self.key_groups.partition_point(|k| k.key_group < last);
        from..to.max(from)
    }

    /// The bytes holding the entries of key groups `[first, last)`: one stretch of the file,
    /// as an offset and a length (length 0 when none of them has entries).
    pub fn stretch_of(&self, key_groups: (u32, u32)) -> (u64, u64) {
        let within = self.within(key_groups);
        match (self.key_groups.get(within.start), within.end > within.start) {
            (Some(start), true) => {
                let end = &self.key_groups[within.end - 1];
                (start.offset, end.offset + end.len - start.offset)
            }
            _ => (0, 0),
        }
    }

    /// The stretch of key groups `[first, last)` cut at key groups into pieces of at most
    /// `bytes` (a key group longer than that is a piece of its own), as offsets and lengths
    /// in file order: for reading a stretch from object storage a piece at a time.
    pub fn pieces_of(&self, key_groups: (u32, u32), bytes: u64) -> Vec<(u64, u64)> {
        let mut pieces: Vec<(u64, u64)> = Vec::new();
        for k in &self.key_groups[self.within(key_groups)] {
            match pieces.last_mut() {
                Some((offset, len)) if *offset + *len == k.offset && *len + k.len <= bytes => *len += k.len,
                _ => pieces.push((k.offset, k.len)),
            }
        }
        pieces
    }

    /// Verifies `data`, the bytes of the file from `offset` on, against the checksums of the
    /// key groups they hold: they must begin and end where key groups do, and each key
    /// group's entries must match their checksum.
    pub fn verify(&self, offset: u64, data: &[u8]) -> Result<(), FormatError> {
        if !self.checked {
            return Err(FormatError::BadIndex("no checksums of key groups in this increment"));
        }
        let first = self.key_groups.partition_point(|k| k.offset < offset);
        let mut at = offset;
        let end = offset + data.len() as u64;
        for k in self.key_groups[first..].iter().take_while(|k| k.offset < end) {
            if k.offset != at || k.offset + k.len > end {
                break;
            }
            let bytes = &data[(k.offset - offset) as usize..(k.offset - offset + k.len) as usize];
            if Some(crc32c::crc32c(bytes)) != k.crc32c {
                return Err(FormatError::KeyGroupChecksumMismatch(k.key_group));
            }
            at += k.len;
        }
        if at != end {
            return Err(FormatError::BadIndex("a stretch that does not cover whole key groups"));
        }
        Ok(())
    }
}

/// The bytes at the start of a state file of `len` bytes that hold its header and, for an
/// increment ordered by key group, its index, read from `head` (at least
/// [`HEAD_BYTES`] of them, or the whole file if shorter): what to read before
/// [`read_increment_index`] when only the start of the file is fetched.
pub fn head_len(head: &[u8], len: u64) -> Result<u64, FormatError> {
    match read_header::<std::convert::Infallible>(&mut &head[..], len) {
        Ok((_, index_len)) => Ok((HEADER_LEN + 4) as u64 + index_len.unwrap_or(0)),
        Err(PartsError::Format(e)) => Err(e),
        Err(_) => Err(FormatError::Truncated(head.len())),
    }
}

/// Longest index of an increment ordered by key group: 12 bytes for each of at most 32,768 key
/// groups, and its checksum, with room to spare. A longer one is a defect, refused before
/// anything is allocated for it.
pub const MAX_INDEX_BYTES: u64 = 1 << 20;

/// Bytes to fetch first from the start of a state file to read its header and index length.
pub const HEAD_BYTES: u64 = (HEADER_LEN + 4) as u64;

/// Reads the index of an increment ordered by key group from the start of `file` (its length
/// `len`): `None` for a file of another kind. Only the header and the index are read. The
/// index's own checksum is verified (kind 4); the kind 3 index is trusted only once the whole
/// file is verified (as a restore does while downloading it).
pub fn read_increment_index(
    mut file: impl std::io::Read,
    len: u64,
) -> Result<Option<IncrementIndex>, PartsError<std::convert::Infallible>> {
    if len < HEAD_BYTES {
        return Err(PartsError::Format(FormatError::Truncated(len as usize)));
    }
    let mut head = [0u8; HEAD_BYTES as usize];
    file.read_exact(&mut head)?;
    let (_, Some(index_len)) = read_header(&mut &head[..], len)? else {
        return Ok(None);
    };
    let checked = head[HEADER_LEN - 1] == KIND_INCREMENT_BY_KEY_GROUP;
    let mut raw = vec![0u8; index_len as usize];
    file.read_exact(&mut raw)?;
    let entries_at = (HEADER_LEN + 4) as u64 + index_len;
    let entries_len = len - entries_at - 4;
    if checked {
        let bad = || PartsError::Format(FormatError::BadIndex("its checksum does not match"));
        let (index, crc) = raw.split_at(raw.len().checked_sub(4).ok_or_else(bad)?);
        let covered = crc32c::crc32c_append(crc32c::crc32c(&head), index);
        if covered.to_le_bytes() != crc {
            return Err(bad());
        }
        raw.truncate(index.len());
    }
    let mut dec = Decoder::new(&raw);
    let (mut key_groups, mut key_group, mut offset) = (Vec::new(), 0u64, entries_at);
    while !dec.is_empty() {
        let step = dec.varint().map_err(PartsError::Format)?;
        let bytes = dec.varint().map_err(PartsError::Format)?;
        let crc32c = if checked { Some(dec.u32_le().map_err(PartsError::Format)?) } else { None };
        key_group = key_group.saturating_add(step);
        if key_group > u64::from(u32::MAX) || (step == 0 && !key_groups.is_empty()) {
            return Err(PartsError::Format(FormatError::BadIndex("key groups not increasing")));
        }
        if bytes == 0 {
            return Err(PartsError::Format(FormatError::BadIndex("a key group without entries")));
        }
        key_groups.push(KeyGroupEntries { key_group: key_group as u32, offset, len: bytes, crc32c });
        offset = offset.checked_add(bytes).ok_or(PartsError::Format(FormatError::BadIndex("too long")))?;
    }
    if offset - entries_at != entries_len {
        return Err(PartsError::Format(FormatError::BadIndex("its lengths do not add up to the entries'")));
    }
    Ok(Some(IncrementIndex { key_groups, checked }))
}

/// Writes the increments ordered by key group `inputs` (each a reader of the whole file and
/// its [`IncrementIndex`], oldest first) to `out` as one increment ordered by key group (kind
/// 4): each key group's entries are those of the first input, then the second's, and so on.
/// Applying it applies the inputs in order (a later entry of a key wins, deletions included),
/// and a range of key groups reads from it alone, as from any increment. Nothing is decoded:
/// each input's stretch of a key group is copied, verified against its checksum on the way,
/// and the new index's checksums are combined from the inputs'. Returns `out`, the file's
/// length and its seal (the CRC-32C of all but its last four bytes, as a checkpoint lists it).
pub fn concat_increments<R: std::io::Read + std::io::Seek, W: std::io::Write>(
    inputs: &mut [(R, IncrementIndex)],
    mut out: W,
) -> Result<(W, u64, u32), ConcatError> {
    // Each key group's stretches, in input order.
    let mut stretches: std::collections::BTreeMap<u32, Vec<(usize, KeyGroupEntries)>> = Default::default();
    for (i, (_, index)) in inputs.iter().enumerate() {
        if !index.checked {
            let source = FormatError::BadIndex("no checksums of key groups in this increment");
            return Err(ConcatError::Format { input: i, source });
        }
        for k in &index.key_groups {
            stretches.entry(k.key_group).or_default().push((i, *k));
        }
    }
    let mut index = Encoder::with_capacity(stretches.len() * 12 + 4);
    let mut previous = 0u32;
    for (&key_group, parts) in &stretches {
        let len: u64 = parts.iter().map(|(_, k)| k.len).sum();
        // The checksum of the stretches one after the other, from theirs.
        let crc_of = |k: &KeyGroupEntries| k.crc32c.expect("checked above");
        let crc = parts[1..]
            .iter()
            .fold(crc_of(&parts[0].1), |crc, (_, k)| crc32c::crc32c_combine(crc, crc_of(k), k.len as usize));
        index.varint(u64::from(key_group - previous));
        index.varint(len);
        index.buf.extend_from_slice(&crc.to_le_bytes());
        previous = key_group;
    }
    let mut head = Vec::with_capacity(HEADER_LEN + 4);
    head.extend_from_slice(MAGIC);
    head.push(KIND_INCREMENT_BY_KEY_GROUP);
    head.extend_from_slice(&(index.buf.len() as u32 + 4).to_le_bytes());
    let index_crc = crc32c::crc32c_append(crc32c::crc32c(&head), &index.buf);
    index.buf.extend_from_slice(&index_crc.to_le_bytes());
    let mut crc = crc32c::crc32c_append(crc32c::crc32c(&head), &index.buf);
    out.write_all(&head).map_err(ConcatError::Write)?;
    out.write_all(&index.buf).map_err(ConcatError::Write)?;
    let mut len = (head.len() + index.buf.len()) as u64;
    let mut buf = vec![0u8; 1 << 20];
    for (&key_group, parts) in &stretches {
        for (i, k) in parts {
            let input = &mut inputs[*i].0;
            let read_failed = |source| ConcatError::Read { input: *i, source };
            input.seek(std::io::SeekFrom::Start(k.offset)).map_err(read_failed)?;
            let (mut left, mut stretch_crc) = (k.len, 0u32);
            while left > 0 {
                let piece = &mut buf[..left.min(1 << 20) as usize];
                input.read_exact(piece).map_err(read_failed)?;
                stretch_crc = crc32c::crc32c_append(stretch_crc, piece);
                crc = crc32c::crc32c_append(crc, piece);
                out.write_all(piece).map_err(ConcatError::Write)?;
                left -= piece.len() as u64;
            }
            if Some(stretch_crc) != k.crc32c {
                return Err(ConcatError::Format {
                    input: *i,
                    source: FormatError::KeyGroupChecksumMismatch(key_group),
                });
            }
            len += k.len;
        }
    }
    out.write_all(&crc.to_le_bytes()).map_err(ConcatError::Write)?;
    Ok((out, len + 4, crc))
}

/// Why [`concat_increments`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConcatError {
    /// Input `input` (counted from 0) could not be read.
    #[error("reading increment {input} of the run: {source}")]
    Read {
        /// Which input.
        input: usize,
        /// Why.
        source: std::io::Error,
    },
    /// Input `input` is not what its index says, or its index has no checksums.
    #[error("increment {input} of the run: {source}")]
    Format {
        /// Which input.
        input: usize,
        /// Why.
        source: FormatError,
    },
    /// The output could not be written.
    #[error("writing the concatenated increment: {0}")]
    Write(std::io::Error),
}

/// Reads a state file's header from `file` (its length `len`): its kind, and for an increment
/// ordered by key group the length of its index.
fn read_header<E>(file: &mut impl std::io::Read, len: u64) -> Result<(FileKind, Option<u64>), PartsError<E>> {
    if len < (HEADER_LEN + 4) as u64 {
        return Err(PartsError::Format(FormatError::Truncated(len as usize)));
    }
    let mut header = [0u8; HEADER_LEN];
    file.read_exact(&mut header)?;
    if &header[..4] != MAGIC {
        return Err(PartsError::Format(FormatError::BadMagic));
    }
    match header[4] {
        0 => Ok((FileKind::KeyedFull, None)),
        1 => Ok((FileKind::KeyedIncrement, None)),
        2 => Ok((FileKind::OperatorState, None)),
        KIND_INCREMENT_BY_KEY_GROUP | KIND_INCREMENT_BY_KEY_GROUP_UNCHECKED => {
            let mut index_len = [0u8; 4];
            file.read_exact(&mut index_len)?;
            let index_len = u64::from(u32::from_le_bytes(index_len));
            if len < (HEADER_LEN + 4 + 4) as u64 + index_len {
                return Err(PartsError::Format(FormatError::Truncated(len as usize)));
            }
            // The readers allocate the index from this length before it is verified.
            if index_len > MAX_INDEX_BYTES {
                return Err(PartsError::Format(FormatError::BadIndex("longer than any key-group index")));
            }
            Ok((FileKind::KeyedIncrement, Some(index_len)))
        }
        k => Err(PartsError::Format(FormatError::UnknownKind(k))),
    }
}

/// Writes one keyed state file to a [`std::io::Write`] as it is built, for files too large to
/// hold in memory (the rocksdb backend's full images). The bytes are those
/// [`StateFileWriter`] would produce for the same entries.
pub struct StateFileStream<W: std::io::Write> {
    out: W,
    buf: Encoder,
    /// CRC-32C of the bytes written to `out` so far.
    crc: u32,
    len: u64,
    entries: u64,
    /// The length sizes reserved for the next key and value ([`Encoder::length_prefixed`]).
    key_prefix: usize,
    value_prefix: usize,
}

impl<W: std::io::Write> StateFileStream<W> {
    /// Bytes buffered before they are written out.
    const FLUSH_AT: usize = 1 << 20;

    /// Starts a file of `kind` on `out`.
    pub fn new(kind: FileKind, out: W) -> Self {
        let mut buf = Encoder::with_capacity(Self::FLUSH_AT + 4096);
        buf.buf.extend_from_slice(MAGIC);
        buf.u8(kind as u8);
        StateFileStream { out, buf, crc: 0, len: 0, entries: 0, key_prefix: 1, value_prefix: 1 }
    }

    /// Adds a keyed put of an encoded key and value.
    pub fn put(&mut self, key_group: u32, key: &[u8], value: &[u8]) -> std::io::Result<()> {
        self.buf.varint(u64::from(key_group));
        self.buf.bytes(key);
        self.buf.u8(1);
        self.buf.bytes(value);
        self.entries += 1;
        if self.buf.buf.len() >= Self::FLUSH_AT {
            self.flush_buf()?;
        }
        Ok(())
    }

    /// Adds a keyed put whose key and value are encoded in place, as
    /// [`StateFileWriter::put_encoded`] does.
    #[inline]
    pub fn put_encoded(
        &mut self,
        key_group: u32,
        key: impl FnOnce(&mut Encoder),
        value: impl FnOnce(&mut Encoder),
    ) -> std::io::Result<()> {
        self.buf.varint(u64::from(key_group));
        self.buf.length_prefixed(&mut self.key_prefix, key);
        self.buf.u8(1);
        self.buf.length_prefixed(&mut self.value_prefix, value);
        self.entries += 1;
        if self.buf.buf.len() >= Self::FLUSH_AT {
            self.flush_buf()?;
        }
        Ok(())
    }

    /// Appends `count` entries encoded by [`StateFileWriter::into_entries`].
    pub fn put_entries(&mut self, encoded: &[u8], count: u64) -> std::io::Result<()> {
        self.flush_buf()?;
        self.crc = crc32c::crc32c_append(self.crc, encoded);
        self.out.write_all(encoded)?;
        self.len += encoded.len() as u64;
        self.entries += count;
        Ok(())
    }

    fn flush_buf(&mut self) -> std::io::Result<()> {
        self.crc = crc32c::crc32c_append(self.crc, &self.buf.buf);
        self.out.write_all(&self.buf.buf)?;
        self.len += self.buf.buf.len() as u64;
        self.buf.buf.clear();
        Ok(())
    }

    /// Number of keyed entries written.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// Bytes of entries written so far (for a file without an index): where the next entry
    /// starts among them.
    pub fn entries_len(&self) -> u64 {
        self.len + self.buf.buf.len() as u64 - HEADER_LEN as u64
    }

    /// Seals the file with its checksum; returns the writer, the file's length and its seal
    /// (as [`StateFileWriter::finish`]).
    pub fn finish(mut self) -> std::io::Result<(W, u64, u32)> {
        self.flush_buf()?;
        self.out.write_all(&self.crc.to_le_bytes())?;
        self.out.flush()?;
        Ok((self.out, self.len + 4, self.crc))
    }
}

/// One keyed entry read back.
#[derive(Debug, PartialEq, Eq)]
pub struct KeyedEntry<'a> {
    /// Its key group.
    pub key_group: u32,
    /// The encoded key.
    pub key: &'a [u8],
    /// The encoded value, or `None` for a deletion.
    pub value: Option<&'a [u8]>,
}

/// Verifies a state file and returns its kind and body.
pub fn open(file: &[u8]) -> Result<(FileKind, &[u8]), FormatError> {
    if file.len() < MAGIC.len() + 1 + 4 {
        return Err(FormatError::Truncated(file.len()));
    }
    let (content, crc) = file.split_at(file.len() - 4);
    if crc32c::crc32c(content).to_le_bytes() != crc {
        return Err(FormatError::ChecksumMismatch);
    }
    open_verified(file)
}

/// [`open`] of a file whose bytes were verified whole already, against a checksum kept
/// elsewhere (a checkpoint's metadata lists each file's CRC-32C): its own trailing checksum is
/// not computed again. A restore read a 259 MB image's bytes three times over for checksums.
pub fn open_verified(file: &[u8]) -> Result<(FileKind, &[u8]), FormatError> {
    if file.len() < MAGIC.len() + 1 + 4 {
        return Err(FormatError::Truncated(file.len()));
    }
    let content = &file[..file.len() - 4];
    let (kind, index_len) =
        read_header::<std::convert::Infallible>(&mut &content[..], file.len() as u64).map_err(|e| match e {
            PartsError::Format(e) => e,
            // Shorter than its header says.
            PartsError::Read(_) => FormatError::Truncated(file.len()),
            PartsError::Consume(never) => match never {},
        })?;
    Ok((kind, &content[HEADER_LEN + index_len.map_or(0, |len| 4 + len as usize)..]))
}

/// Iterates the keyed entries of a verified body.
#[inline]
pub fn keyed_entries(body: &[u8]) -> KeyedEntries<'_> {
    KeyedEntries { dec: Decoder::new(body), end: body.len() }
}

/// The keyed entries of a verified body that start at byte offsets in `[from, to)`, for
/// threads that read one body at once, each the entries of its own stretch: consecutive
/// stretches (`[0, a)`, `[a, b)`, ..., `[z, body.len())`) read every entry once, in order,
/// whatever offsets cut them. The entries before `from` are read past without decoding their
/// keys and values. A malformed entry before `from` is where the iteration starts, and
/// reports it.
pub fn keyed_entries_in(body: &[u8], from: usize, to: usize) -> KeyedEntries<'_> {
    let mut dec = Decoder::new(body);
    while dec.position() < from {
        let at = dec.position();
        if skip_entry(&mut dec).is_err() {
            dec.pos = at;
            break;
        }
    }
    KeyedEntries { dec, end: to.min(body.len()) }
}

/// The keyed entries of a body ([`keyed_entries`]). Its `next` is inlined into the loops that
/// read entries: called across the crate boundary, it returned each entry through memory
/// written in pieces that the caller's read had to wait for, four fifths of a heap
/// restore's decoding thread.
pub struct KeyedEntries<'a> {
    dec: Decoder<'a>,
    /// No entry starts at or after this offset.
    end: usize,
}

impl<'a> KeyedEntries<'a> {
    /// Where the next entry starts, in bytes from the start of the body.
    pub fn position(&self) -> usize {
        self.dec.position()
    }

    #[inline(always)]
    fn entry(&mut self) -> Result<KeyedEntry<'a>, FormatError> {
        let dec = &mut self.dec;
        let key_group = dec.varint()? as u32;
        let key = dec.bytes()?;
        let value = match dec.u8()? {
            0 => None,
            1 => Some(dec.bytes()?),
            _ => return Err(FormatError::Malformed(dec.position())),
        };
        Ok(KeyedEntry { key_group, key, value })
    }
}

impl<'a> Iterator for KeyedEntries<'a> {
    type Item = Result<KeyedEntry<'a>, FormatError>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        if self.dec.position() >= self.end {
            return None;
        }
        Some(self.entry())
    }
}

/// Why a keyed state file could not be read in parts.
#[derive(Debug, thiserror::Error)]
pub enum PartsError<E> {
    /// Reading the file failed.
    #[error("reading the state file: {0}")]
    Read(#[from] std::io::Error),
    /// The file is not a keyed state file.
    #[error(transparent)]
    Format(FormatError),
    /// The consumer of a part failed.
    #[error(transparent)]
    Consume(E),
}

/// Reads past one keyed entry without decoding its key or value.
#[inline]
fn skip_entry(dec: &mut Decoder<'_>) -> Result<(), FormatError> {
    dec.varint()?;
    dec.bytes()?;
    match dec.u8()? {
        0 => {}
        1 => {
            dec.bytes()?;
        }
        _ => return Err(FormatError::Malformed(dec.position() - 1)),
    }
    Ok(())
}

/// The length of the longest prefix of `body` made of whole keyed entries.
fn whole_entries_len(body: &[u8]) -> usize {
    let mut dec = Decoder::new(body);
    let mut whole = 0;
    while !dec.is_empty() {
        if skip_entry(&mut dec).is_err() {
            break;
        }
        whole = dec.position();
    }
    whole
}

/// Reads a keyed state file of `len` bytes from `file` in parts of about `part` bytes, each
/// made of whole entries, and hands each part to `consume` as a body that [`keyed_entries`]
/// reads (in file order): for files larger than memory. The trailing checksum is not read, so
/// the file must have been verified already (as a restore does while downloading it). Returns
/// the file's kind.
///
/// A part grows beyond `part` only to hold an entry larger than it. A malformed entry stops
/// the parts early: the rest of the file becomes one part, whose reading reports the defect.
pub fn read_keyed_parts<E>(
    mut file: impl std::io::Read,
    len: u64,
    part: usize,
    consume: impl FnMut(&[u8]) -> Result<(), E>,
) -> Result<FileKind, PartsError<E>> {
    let (kind, index_len) = read_header(&mut file, len)?;
    if kind == FileKind::OperatorState {
        return Err(PartsError::Format(FormatError::UnknownKind(FileKind::OperatorState as u8)));
    }
    let mut entries_at = HEADER_LEN as u64;
    if let Some(index_len) = index_len {
        // A few bytes per key group.
        let mut index = vec![0u8; index_len as usize];
        file.read_exact(&mut index)?;
        entries_at += 4 + index_len;
    }
    read_entry_parts(file, len - entries_at - 4, part, consume)?;
    Ok(kind)
}

/// Reads `len` bytes of whole keyed entries from `entries` in parts of about `part` bytes, as
/// [`read_keyed_parts`] does with a file's: for one stretch of an increment ordered by key
/// group ([`IncrementIndex::stretch_of`]).
pub fn read_entry_parts<E>(
    mut entries: impl std::io::Read,
    len: u64,
    part: usize,
    mut consume: impl FnMut(&[u8]) -> Result<(), E>,
) -> Result<(), PartsError<E>> {
    let part = part.max(1);
    let mut remaining = len;
    let mut buf: Vec<u8> = Vec::with_capacity(part.min(remaining as usize));
    let mut want = part;
    while remaining > 0 {
        let take = (want.saturating_sub(buf.len()) as u64).min(remaining) as usize;
        let start = buf.len();
        buf.resize(start + take, 0);
        entries.read_exact(&mut buf[start..])?;
        remaining -= take as u64;
        let whole = if remaining == 0 { buf.len() } else { whole_entries_len(&buf) };
        if whole == 0 && remaining > 0 {
            // One entry longer than the part read so far.
            want = buf.len() * 2;
            continue;
        }
        consume(&buf[..whole]).map_err(PartsError::Consume)?;
        buf.drain(..whole);
        want = part;
    }
    Ok(())
}

/// Reads the document of a verified operator-state body.
pub fn operator_document(body: &[u8]) -> Result<&[u8], FormatError> {
    Decoder::new(body).bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_round_trip_with_patched_lengths() {
        let mut w = StateFileWriter::new(FileKind::KeyedIncrement, 64);
        w.put(3, b"k1", b"v1");
        w.delete(4, b"k2");
        w.put_with(5, b"k3", |e| e.bytes(&vec![7u8; 300]));
        let (bytes, crc) = w.finish();
        assert_eq!(crc, crc32c::crc32c(&bytes[..bytes.len() - 4]), "the seal");
        assert_eq!(crc32c::crc32c(&bytes), crate::metadata::SEALED_RESIDUE);
        crate::FileRef::new("f".into(), bytes.len() as u64, crc).check(&crate::FileDigest::of(&bytes)).unwrap();
        let (kind, body) = open(&bytes).unwrap();
        assert_eq!(kind, FileKind::KeyedIncrement);
        let entries: Vec<_> = keyed_entries(body).collect::<Result<_, _>>().unwrap();
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[0], KeyedEntry { key_group: 3, key: b"k1", value: Some(b"v1") });
        assert_eq!(entries[1].value, None);
        let mut d = Decoder::new(entries[2].value.unwrap());
        assert_eq!(d.bytes().unwrap().len(), 300);
    }

    #[test]
    fn any_flipped_bit_is_detected() {
        let mut w = StateFileWriter::new(FileKind::OperatorState, 8);
        w.document(b"{\"a\":1}");
        let (bytes, _) = w.finish();
        for i in 0..bytes.len() {
            let mut bad = bytes.to_vec();
            bad[i] ^= 1;
            assert!(open(&bad).is_err(), "flip at {i} undetected");
        }
        assert_eq!(open(&bytes[..3]), Err(FormatError::Truncated(3)));
    }

    /// A file verified elsewhere opens as [`open`] opens it, without its checksum computed
    /// again: a changed entry is not noticed there (the caller's checksum must have been), a
    /// changed header still is.
    #[test]
    fn a_file_verified_elsewhere_opens_without_its_checksum() {
        let mut w = StateFileWriter::new(FileKind::KeyedIncrement, 64);
        w.put(3, b"k1", b"v1");
        let (bytes, _) = w.finish();
        assert_eq!(open_verified(&bytes), open(&bytes));
        let mut changed = bytes.to_vec();
        let last = changed.len() - 5;
        changed[last] ^= 1;
        assert_eq!(open(&changed), Err(FormatError::ChecksumMismatch));
        assert_eq!(open_verified(&changed).map(|(kind, _)| kind), Ok(FileKind::KeyedIncrement));
        changed[0] ^= 1;
        assert!(open_verified(&changed).is_err(), "not a state file");
        assert_eq!(open_verified(&bytes[..3]), Err(FormatError::Truncated(3)));
    }

    #[test]
    fn keyed_parts_hold_whole_entries_in_file_order() {
        let mut w = StateFileWriter::new(FileKind::KeyedFull, 64);
        let mut expected = Vec::new();
        for i in 0..500u32 {
            let key = format!("key-{i}").into_bytes();
            // Some values longer than a part: the part grows to hold them.
            let value = vec![i as u8; if i % 97 == 0 { 700 } else { (i % 13) as usize }];
            if i % 7 == 0 {
                w.delete(i % 128, &key);
                expected.push((i % 128, key, None));
            } else {
                w.put(i % 128, &key, &value);
                expected.push((i % 128, key, Some(value)));
            }
        }
        let (bytes, _) = w.finish();
        for part in [1, 16, 100, 4096, 1 << 20] {
            let mut read = Vec::new();
            let mut parts = 0;
            let kind = read_keyed_parts(&bytes[..], bytes.len() as u64, part, |body| {
                parts += 1;
                for e in keyed_entries(body) {
                    let e = e?;
                    read.push((e.key_group, e.key.to_vec(), e.value.map(<[u8]>::to_vec)));
                }
                Ok::<_, FormatError>(())
            })
            .unwrap();
            assert_eq!(kind, FileKind::KeyedFull);
            assert_eq!(read, expected, "parts of {part} bytes");
            assert!(part >= bytes.len() || parts > 1, "{part}-byte parts of a {}-byte file", bytes.len());
        }
    }

    #[test]
    fn stretches_cut_anywhere_read_every_entry_once_in_order() {
        let mut w = StateFileWriter::new(FileKind::KeyedFull, 64);
        for i in 0..1000u32 {
            let value = vec![i as u8; if i % 101 == 0 { 900 } else { (i % 11) as usize }];
            if i % 9 == 0 {
                w.delete(i % 128, format!("key-{i}").as_bytes());
            } else {
                w.put(i % 128, format!("key-{i}").as_bytes(), &value);
            }
        }
        let (bytes, _) = w.finish();
        let (_, body) = open(&bytes).unwrap();
        let all: Vec<_> = keyed_entries(body).collect::<Result<_, _>>().unwrap();
        let n = body.len();
        // Cuts inside entries, on their starts, at the ends, and past the end.
        for cuts in [vec![], vec![n / 2], vec![1, 2, 3], vec![n / 3, n / 3, 2 * n / 3], vec![0, n - 1, n, n + 5]] {
            let mut bounds = vec![0];
            bounds.extend(&cuts);
            bounds.push(n);
            let read: Vec<_> = bounds
                .windows(2)
                .flat_map(|w| keyed_entries_in(body, w[0], w[1]))
                .collect::<Result<_, _>>()
                .expect("whole entries");
            assert_eq!(read, all, "cut at {cuts:?}");
        }
        assert_eq!(keyed_entries_in(body, n / 2, n / 2).count(), 0);
        // An entry that is neither a put nor a deletion: a stretch past it reports it too.
        let mut bad = body.to_vec();
        let mut dec = Decoder::new(body);
        while dec.position() < n / 3 {
            skip_entry(&mut dec).unwrap();
        }
        let at = dec.position();
        dec.varint().unwrap();
        dec.bytes().unwrap();
        bad[dec.position()] = 7;
        assert!(keyed_entries_in(&bad, 0, at).all(|e| e.is_ok()));
        assert!(keyed_entries_in(&bad, at, n).next().unwrap().is_err());
        assert!(keyed_entries_in(&bad, 2 * n / 3, n).next().unwrap().is_err());
    }

    #[test]
    fn a_stream_with_appended_entries_equals_the_writer() {
        let mut whole = StateFileWriter::new(FileKind::KeyedFull, 64);
        let mut stream = StateFileStream::new(FileKind::KeyedFull, Vec::new());
        let mut tail = StateFileWriter::new(FileKind::KeyedFull, 64);
        for i in 0..100u32 {
            whole.put(i % 8, &i.to_le_bytes(), b"first");
            stream.put(i % 8, &i.to_le_bytes(), b"first").unwrap();
        }
        for i in 0..10u32 {
            whole.put(i, &i.to_le_bytes(), b"second");
            tail.put(i, &i.to_le_bytes(), b"second");
        }
        let (encoded, count) = tail.into_entries();
        stream.put_entries(&encoded, count).unwrap();
        assert_eq!(stream.entries(), 110);
        let (out, len, crc) = stream.finish().unwrap();
        let (bytes, whole_crc) = whole.finish();
        assert_eq!((&out[..], len, crc), (&bytes[..], bytes.len() as u64, whole_crc));
    }

    /// Entries encoded in place by a stream, across its flushes and with values whose length
    /// takes more than one byte, are the bytes the writer makes of them.
    #[test]
    fn a_stream_encoding_in_place_equals_the_writer() {
        let mut whole = StateFileWriter::new(FileKind::KeyedFull, 64);
        let mut stream = StateFileStream::new(FileKind::KeyedFull, Vec::new());
        let mut entries_len = Vec::new();
        // 0 to 1499 bytes, one-byte and two-byte lengths, and a few three-byte ones: every
        // guess of a length's size wrong now and then, in both directions; 2 MB, past a flush.
        let len_of = |i: usize| if i % 500 == 499 { 20_000 + i } else { (i * 7) % 1500 };
        for i in 0..3000u32 {
            let value = vec![i as u8; len_of(i as usize)];
            // Keys of one to five bytes.
            let key = |e: &mut Encoder| e.varint(u64::from(i) << (i % 25));
            whole.put_encoded(i % 128, key, |e| e.buf.extend_from_slice(&value));
            stream.put_encoded(i % 128, key, |e| e.buf.extend_from_slice(&value)).unwrap();
            entries_len.push((whole.entries_len() as u64, stream.entries_len()));
        }
        assert!(entries_len.iter().all(|(w, s)| w == s), "where each entry ends");
        assert_eq!((stream.entries(), whole.entries()), (3000, 3000));
        let (out, len, crc) = stream.finish().unwrap();
        let (bytes, whole_crc) = whole.finish();
        assert!(bytes.len() > 2 << 20);
        assert_eq!((len, crc), (bytes.len() as u64, whole_crc));
        assert!(out == bytes[..], "the same bytes");
        let (_, body) = open(&out).unwrap();
        let values: Vec<usize> = keyed_entries(body).map(|e| e.unwrap().value.unwrap().len()).collect();
        assert_eq!(values, (0..3000).map(len_of).collect::<Vec<_>>());
    }

    #[test]
    fn keyed_parts_refuse_what_is_not_a_keyed_file() {
        let mut w = StateFileWriter::new(FileKind::OperatorState, 8);
        w.document(b"{}");
        let (doc, _) = w.finish();
        let none = |_: &[u8]| Ok::<_, FormatError>(());
        assert!(matches!(
            read_keyed_parts(&doc[..], doc.len() as u64, 64, none),
            Err(PartsError::Format(FormatError::UnknownKind(2)))
        ));
        assert!(matches!(read_keyed_parts(&doc[..3], 3, 64, none), Err(PartsError::Format(FormatError::Truncated(3)))));
        // Shorter than its stated length: a read error, not a silent end.
        let (keyed, _) = StateFileWriter::new(FileKind::KeyedFull, 8).finish();
        assert!(matches!(read_keyed_parts(&keyed[..], keyed.len() as u64 + 10, 64, none), Err(PartsError::Read(_))));
    }

    /// A keyed entry read back, owned: key group, key, value (`None`: deleted).
    type Owned = (u32, Vec<u8>, Option<Vec<u8>>);

    /// [`scattered_entries`] written to an increment ordered by key group.
    fn scattered_increment() -> (Bytes, Vec<Owned>) {
        let mut w = StateFileWriter::increment_by_key_group(64);
        let written = scattered_entries();
        for (key_group, key, value) in &written {
            match value {
                None => w.delete_encoded(*key_group, |e| e.buf.extend_from_slice(key)),
                Some(value) => {
                    w.put_encoded(*key_group, |e| e.buf.extend_from_slice(key), |e| e.buf.extend_from_slice(value))
                }
            }
        }
        assert_eq!(w.entries(), 400);
        (w.finish().0, written)
    }

    /// The same entries as an increment of kind 3 (no checksums in its index), as the
    /// runtimes before kind 4 wrote them.
    fn scattered_unchecked_increment() -> (Bytes, Vec<Owned>) {
        let mut w = StateFileWriter::increment_by_key_group(64);
        let written = scattered_entries();
        for (key_group, key, value) in &written {
            match value {
                Some(value) => w.put(*key_group, key, value),
                None => w.delete(*key_group, key),
            }
        }
        let entries = w.by_key_group.take().unwrap();
        let mut unchecked = ordered_by_key_group(&w.enc.buf, &entries, false);
        let crc = crc32c::crc32c(&unchecked);
        unchecked.extend_from_slice(&crc.to_le_bytes());
        (Bytes::from(unchecked), written)
    }

    /// Entries of scattered key groups: deletions, and values long enough to move their bytes
    /// for a longer length.
    fn scattered_entries() -> Vec<Owned> {
        (0..400u32)
            .map(|i| {
                let key_group = (i * 37 + i / 50) % 23 + 5;
                let key = format!("key-{}", i % 150).into_bytes();
                let value = (i % 9 != 0).then(|| vec![i as u8; if i % 31 == 0 { 300 } else { (i % 5) as usize }]);
                (key_group, key, value)
            })
            .collect()
    }

    fn read_all(body: &[u8]) -> Vec<Owned> {
        keyed_entries(body)
            .map(|e| e.map(|e| (e.key_group, e.key.to_vec(), e.value.map(<[u8]>::to_vec))))
            .collect::<Result<_, _>>()
            .unwrap()
    }

    #[test]
    fn an_increment_by_key_group_reads_as_its_entries_ordered_by_key_group_and_its_index_finds_each() {
        let (bytes, written) = scattered_increment();
        assert_eq!(bytes[HEADER_LEN - 1], KIND_INCREMENT_BY_KEY_GROUP);
        reads_as_entries_ordered_by_key_group(&bytes, written);
        // An increment of kind 3, from before its index had checksums, reads the same.
        let (bytes, written) = scattered_unchecked_increment();
        assert_eq!(bytes[HEADER_LEN - 1], KIND_INCREMENT_BY_KEY_GROUP_UNCHECKED);
        reads_as_entries_ordered_by_key_group(&bytes, written);
    }

    fn reads_as_entries_ordered_by_key_group(bytes: &Bytes, written: Vec<Owned>) {
        let mut ordered = written.clone();
        // Stable: the entries of a key group keep the order they were written in.
        ordered.sort_by_key(|(key_group, _, _)| *key_group);
        let (kind, body) = open(bytes).unwrap();
        assert_eq!(kind, FileKind::KeyedIncrement);
        assert_eq!(read_all(body), ordered);
        let mut parts = Vec::new();
        let kind = read_keyed_parts(&bytes[..], bytes.len() as u64, 100, |body| {
            parts.extend(read_all(body));
            Ok::<_, FormatError>(())
        })
        .unwrap();
        assert_eq!((kind, &parts), (FileKind::KeyedIncrement, &ordered));

        let index = read_increment_index(&bytes[..], bytes.len() as u64).unwrap().unwrap();
        assert_eq!(index.key_groups.len(), 23);
        for (first, last) in [(0, 5), (5, 6), (7, 8), (5, 28), (10, 20), (27, 100), (28, 100), (12, 12)] {
            let (offset, len) = index.stretch_of((first, last));
            let mut read = Vec::new();
            read_entry_parts(&bytes[offset as usize..], len, 64, |body| {
                read.extend(read_all(body));
                Ok::<_, FormatError>(())
            })
            .unwrap();
            let expected: Vec<_> = ordered.iter().filter(|(kg, _, _)| (first..last).contains(kg)).cloned().collect();
            assert_eq!(read, expected, "key groups {first}..{last}");
        }
        // A stretch read alone is verified by the index's checksums, and refused when it is not
        // one (kind 3 has none).
        let checked = index.checked;
        assert_eq!(checked, bytes[HEADER_LEN - 1] == KIND_INCREMENT_BY_KEY_GROUP);
        for (first, last) in [(5, 6), (5, 28), (10, 20), (27, 100)] {
            let (offset, len) = index.stretch_of((first, last));
            let stretch = &bytes[offset as usize..(offset + len) as usize];
            assert_eq!(index.verify(offset, stretch).is_ok(), checked, "key groups {first}..{last}");
        }
        // Other kinds have no index.
        let (full, _) = StateFileWriter::new(FileKind::KeyedFull, 8).finish();
        assert_eq!(read_increment_index(&full[..], full.len() as u64).unwrap(), None);
        // An empty increment has an empty index.
        let (empty, _) = StateFileWriter::increment_by_key_group(8).finish();
        let index = read_increment_index(&empty[..], empty.len() as u64).unwrap().unwrap();
        assert_eq!((index.stretch_of((0, 10)), open(&empty).unwrap().1.len()), ((0, 0), 0));
    }

    #[test]
    fn an_increment_by_key_group_with_any_flipped_bit_or_a_wrong_index_is_refused() {
        let (bytes, _) = scattered_increment();
        for i in 0..bytes.len() {
            let mut bad = bytes.to_vec();
            bad[i] ^= 1;
            assert!(open(&bad).is_err(), "flip at {i} undetected");
        }
        // The index's lengths must add up to the entries' (read without the checksum).
        let mut bad = bytes.to_vec();
        let index_at = HEADER_LEN + 4;
        bad[index_at + 1] ^= 1;
        assert!(matches!(
            read_increment_index(&bad[..], bad.len() as u64),
            Err(PartsError::Format(FormatError::BadIndex(_) | FormatError::Malformed(_)))
        ));
        assert!(matches!(read_increment_index(&bytes[..8], 8), Err(PartsError::Format(FormatError::Truncated(8)))));
    }

    #[test]
    fn a_stretch_of_an_increment_read_alone_is_verified_piece_by_piece_and_any_flipped_bit_is_named() {
        let (bytes, _) = scattered_increment();
        let len = bytes.len() as u64;
        // Only the head is needed to know how much of the file the index takes.
        let head = head_len(&bytes[..HEAD_BYTES as usize], len).unwrap();
        let index = read_increment_index(&bytes[..head as usize], len).unwrap().unwrap();
        assert!(index.checked);
        assert_eq!(open(&bytes).unwrap().1.len() as u64, len - head - 4);
        let (offset, stretch_len) = index.stretch_of((8, 20));
        // Pieces cut at key groups, in order, covering the stretch; none longer than asked
        // unless one key group is.
        for max in [1, 40, 200, 1 << 20] {
            let pieces = index.pieces_of((8, 20), max);
            assert_eq!(pieces.first().unwrap().0, offset);
            assert_eq!(pieces.iter().map(|p| p.1).sum::<u64>(), stretch_len);
            assert!(pieces.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
            for &(at, piece) in &pieces {
                let one_key_group = index.key_groups.iter().any(|k| k.offset == at && k.len == piece);
                assert!(piece <= max || one_key_group, "piece of {piece} bytes at {at} for {max}");
                index.verify(at, &bytes[at as usize..(at + piece) as usize]).unwrap();
            }
        }
        assert_eq!(index.pieces_of((1000, 2000), 64), vec![]);
        // Any flipped bit of the stretch names its key group.
        let stretch = &bytes[offset as usize..(offset + stretch_len) as usize];
        for i in 0..stretch.len() {
            let mut bad = stretch.to_vec();
            bad[i] ^= 0x10;
            let at = offset + i as u64;
            let key_group = index.key_groups.iter().find(|k| (k.offset..k.offset + k.len).contains(&at)).unwrap();
            assert_eq!(index.verify(offset, &bad), Err(FormatError::KeyGroupChecksumMismatch(key_group.key_group)));
        }
        // A stretch that does not begin or end where key groups do is not one.
        assert!(matches!(index.verify(offset + 1, &stretch[1..]), Err(FormatError::BadIndex(_))));
        assert!(matches!(index.verify(offset, &stretch[..stretch.len() - 1]), Err(FormatError::BadIndex(_))));
        // Any flipped bit of the head is refused by the index's checksum (or its shape).
        for i in 0..head as usize {
            let mut bad = bytes[..head as usize].to_vec();
            bad[i] ^= 0x04;
            assert!(read_increment_index(&bad[..], len).map_or(true, |index| index.is_none()), "flip at {i}");
        }
    }

    /// Increments concatenated by key group hold each key group's entries in input order (so
    /// that applying the result applies the inputs in order), read and index like any
    /// increment, and refuse an input whose stretch is not what its index says.
    #[test]
    fn increments_concatenated_by_key_group_apply_as_the_inputs_in_order() {
        let mut written: Vec<Vec<Owned>> = Vec::new();
        let mut files = Vec::new();
        for f in 0..4u32 {
            // Overlapping keys and key groups, deletions, one input without entries.
            let entries: Vec<Owned> = if f == 2 {
                Vec::new()
            } else {
                scattered_entries()
                    .into_iter()
                    .skip(f as usize * 40)
                    .map(|(kg, k, v)| {
                        (
                            kg + f,
                            k,
                            v.map(|mut v| {
                                v.push(f as u8);
                                v
                            }),
                        )
                    })
                    .collect()
            };
            let mut w = StateFileWriter::increment_by_key_group(64);
            for (key_group, key, value) in &entries {
                match value {
                    Some(value) => w.put(*key_group, key, value),
                    None => w.delete(*key_group, key),
                }
            }
            files.push(w.finish().0);
            written.push(entries);
        }
        let indexed = |files: &[Bytes]| -> Vec<(std::io::Cursor<Bytes>, IncrementIndex)> {
            files
                .iter()
                .map(|b| {
                    let index = read_increment_index(&b[..], b.len() as u64).unwrap().unwrap();
                    (std::io::Cursor::new(b.clone()), index)
                })
                .collect()
        };
        let (out, len, crc) = concat_increments(&mut indexed(&files), Vec::new()).unwrap();
        assert_eq!((len, crc), (out.len() as u64, crc32c::crc32c(&out[..out.len() - 4])));
        // Every entry, each key group's in input order (and within an input, as written).
        let mut expected: Vec<(u32, usize, usize)> = Vec::new();
        for (f, entries) in written.iter().enumerate() {
            expected.extend(entries.iter().enumerate().map(|(i, (kg, _, _))| (*kg, f, i)));
        }
        expected.sort();
        let expected: Vec<Owned> = expected.into_iter().map(|(_, f, i)| written[f][i].clone()).collect();
        let (kind, body) = open(&out).unwrap();
        assert_eq!(kind, FileKind::KeyedIncrement);
        assert_eq!(read_all(body), expected);
        let index = read_increment_index(&out[..], len).unwrap().unwrap();
        for k in &index.key_groups {
            index.verify(k.offset, &out[k.offset as usize..(k.offset + k.len) as usize]).unwrap();
        }
        // Applied in order, the result holds what the inputs applied in order hold.
        let apply = |entries: &mut dyn Iterator<Item = Owned>| {
            let mut state = std::collections::BTreeMap::new();
            for (kg, k, v) in entries {
                match v {
                    Some(v) => state.insert((kg, k), v),
                    None => state.remove(&(kg, k)),
                };
            }
            state
        };
        assert_eq!(apply(&mut read_all(body).into_iter()), apply(&mut written.clone().into_iter().flatten()));
        // No inputs: an empty increment.
        let (empty, _, _) = concat_increments::<std::io::Cursor<Bytes>, _>(&mut [], Vec::new()).unwrap();
        assert_eq!(open(&empty).unwrap().1.len(), 0);
        // A flipped bit in an input's entries names its key group, even though the index is
        // intact; an input without checksums in its index is refused.
        let mut inputs = indexed(&files);
        let k = inputs[1].1.key_groups[3];
        let mut bad = files[1].to_vec();
        bad[k.offset as usize + 1] ^= 0x08;
        inputs[1].0 = std::io::Cursor::new(Bytes::from(bad));
        let refused = concat_increments(&mut inputs, Vec::new());
        let mismatch = FormatError::KeyGroupChecksumMismatch(k.key_group);
        assert!(matches!(refused, Err(ConcatError::Format { input: 1, source }) if source == mismatch));
        let (unchecked, _) = scattered_unchecked_increment();
        let mut inputs = indexed(&[files[0].clone(), unchecked]);
        assert!(matches!(
            concat_increments(&mut inputs, Vec::new()),
            Err(ConcatError::Format { input: 1, source: FormatError::BadIndex(_) })
        ));
    }

    #[test]
    fn an_index_longer_than_any_key_group_index_is_refused_before_it_is_allocated() {
        for kind in [KIND_INCREMENT_BY_KEY_GROUP, KIND_INCREMENT_BY_KEY_GROUP_UNCHECKED] {
            let mut file = MAGIC.to_vec();
            file.push(kind);
            file.extend_from_slice(&u32::MAX.to_le_bytes());
            // A length said in metadata, long enough for the index it claims.
            let said = 1u64 << 40;
            let index = read_increment_index(&file[..], said);
            assert!(matches!(index, Err(PartsError::Format(FormatError::BadIndex(_)))), "{index:?}");
            assert_eq!(head_len(&file, said), Err(FormatError::BadIndex("longer than any key-group index")));
            let parts = read_keyed_parts(&file[..], said, 64, |_| Ok::<(), ()>(()));
            assert!(matches!(parts, Err(PartsError::Format(FormatError::BadIndex(_)))));
        }
        // The largest index a job can have is within the bound.
        let mut w = StateFileWriter::increment_by_key_group(64);
        for kg in 0..32_768 {
            w.put(kg, b"k", b"v");
        }
        let (file, _) = w.finish();
        assert!(head_len(&file[..HEAD_BYTES as usize], file.len() as u64).is_ok());
    }

    #[test]
    fn varints_round_trip() {
        let mut e = Encoder::default();
        for v in [0i64, 1, -1, i64::MAX, i64::MIN, 300, -300] {
            e.svarint(v);
        }
        let mut d = Decoder::new(&e.buf);
        for v in [0i64, 1, -1, i64::MAX, i64::MIN, 300, -300] {
            assert_eq!(d.svarint().unwrap(), v);
        }
        assert!(d.is_empty());
    }

    /// Unsigned varints at the one-byte fast path's edges, one after another (the position
    /// must advance by each one's length), and the malformed ones refused where they end.
    #[test]
    fn varints_of_every_length_and_malformed_ones() {
        let values = [0u64, 1, 0x7f, 0x80, 0x3fff, 0x4000, u64::from(u32::MAX), u64::MAX];
        let mut e = Encoder::default();
        for v in values {
            e.varint(v);
        }
        let mut d = Decoder::new(&e.buf);
        for v in values {
            assert_eq!(d.varint().unwrap(), v);
        }
        assert!(d.is_empty());
        assert!(matches!(Decoder::new(&[]).varint(), Err(FormatError::Malformed(0))));
        // A continuation bit on the last byte: the varint runs past the end.
        assert!(matches!(Decoder::new(&[0x80, 0x80]).varint(), Err(FormatError::Malformed(2))));
        // Eleven bytes of continuation: longer than any u64.
        assert!(matches!(Decoder::new(&[0xff; 11]).varint(), Err(FormatError::Malformed(_))));
    }
}
