//! The canonical binary format of state files, independent of any state backend.
//!
//! ```text
//! file    := magic "WST1" | kind u8 | body | crc32c u32-le (of everything before it)
//! kind    := 0 keyed full image | 1 keyed increment | 2 operator state
//!          | 3 keyed increment by key group
//! keyed   := entry*           entry := key_group varint | key bytes | op u8 (0 delete, 1 put) [| value bytes]
//! by key group := index_len u32-le | index | entry*   (entries ordered by key group)
//! index   := (key_group_step varint | entries_len varint)*   (key groups increasing)
//! operator:= bytes            (an opaque document owned by the operator)
//! bytes   := len varint | raw
//! ```
//! Keyed entries carry their key group, so a restore at another parallelism reads only what
//! falls into its range. An increment ordered by key group (kind 3, written by the rocksdb
//! backend) reads like any other ([`open`] and [`read_keyed_parts`] skip its index; it opens as
//! [`FileKind::KeyedIncrement`]), and its index ([`read_increment_index`]) says where each key
//! group's entries are, so that a restore can read a range of key groups without the rest.
//! The entries of one key group keep the order they were written in.

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
}

/// Reads what [`Encoder`] wrote.
#[derive(Debug)]
pub struct Decoder<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Decoder<'a> {
    /// Reads from `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Decoder { data, pos: 0 }
    }

    /// Whether everything was read.
    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    /// Current offset.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// LEB128 unsigned varint.
    #[inline]
    pub fn varint(&mut self) -> Result<u64, FormatError> {
        let mut v: u64 = 0;
        let mut shift = 0;
        loop {
            let b = *self.data.get(self.pos).ok_or(FormatError::Malformed(self.pos))?;
            self.pos += 1;
            if shift >= 64 {
                return Err(FormatError::Malformed(self.pos));
            }
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Ok(v);
            }
            shift += 7;
        }
    }

    /// Zig-zag signed varint.
    #[inline]
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

/// The kind byte of an increment ordered by key group.
const KIND_INCREMENT_BY_KEY_GROUP: u8 = 3;

/// Bytes before the entries of a file: magic and kind.
const HEADER_LEN: usize = MAGIC.len() + 1;

/// Builds one state file.
#[derive(Debug)]
pub struct StateFileWriter {
    enc: Encoder,
    scratch: Encoder,
    entries: u64,
    /// For an increment ordered by key group: each entry's key group and length, in the
    /// order written (the file is ordered when finished).
    by_key_group: Option<Vec<(u32, u32)>>,
}

impl StateFileWriter {
    /// Starts a file of `kind`.
    pub fn new(kind: FileKind, capacity: usize) -> Self {
        let mut enc = Encoder::with_capacity(capacity + 16);
        enc.buf.extend_from_slice(MAGIC);
        enc.u8(kind as u8);
        StateFileWriter { enc, scratch: Encoder::with_capacity(64), entries: 0, by_key_group: None }
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
        self.length_prefixed(key);
        self.enc.u8(1);
        self.length_prefixed(value);
        self.entry_written(key_group, at);
    }

    /// Adds a keyed deletion whose key is encoded in place.
    #[inline]
    pub fn delete_encoded(&mut self, key_group: u32, key: impl FnOnce(&mut Encoder)) {
        let at = self.enc.buf.len();
        self.enc.varint(u64::from(key_group));
        self.length_prefixed(key);
        self.enc.u8(0);
        self.entry_written(key_group, at);
    }

    /// Writes what `write` encodes behind its exact length, as [`Encoder::bytes`] would. The
    /// bytes are encoded in place behind a one-byte length that is patched afterwards; the rare
    /// key or value of 128 bytes or more moves its bytes to make room for a longer varint.
    #[inline]
    fn length_prefixed(&mut self, write: impl FnOnce(&mut Encoder)) {
        let at = self.enc.buf.len();
        self.enc.buf.push(0);
        write(&mut self.enc);
        let len = self.enc.buf.len() - at - 1;
        if len < 0x80 {
            self.enc.buf[at] = len as u8;
        } else {
            self.scratch.buf.clear();
            self.scratch.varint(len as u64);
            self.enc.buf.splice(at..=at, self.scratch.buf.iter().copied());
        }
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

    /// Seals the file with its checksum; returns the bytes and their CRC-32C.
    pub fn finish(mut self) -> (Bytes, u32) {
        if let Some(entries) = self.by_key_group.take() {
            self.enc.buf = ordered_by_key_group(&self.enc.buf, &entries);
        }
        let crc = crc32c::crc32c(&self.enc.buf);
        self.enc.buf.extend_from_slice(&crc.to_le_bytes());
        (Bytes::from(self.enc.buf), crc32c::crc32c_append(crc, &crc.to_le_bytes()))
    }
}

/// The file `written` (header, then entries of the given key groups and lengths, in that
/// order) as an increment ordered by key group: header, index, then the entries moved to their
/// key group's place (a counting sort: one pass to count, one to move).
fn ordered_by_key_group(written: &[u8], entries: &[(u32, u32)]) -> Vec<u8> {
    let (lowest, highest) =
        entries.iter().fold((u32::MAX, 0), |(lo, hi), &(key_group, _)| (lo.min(key_group), hi.max(key_group)));
    let mut bytes_of: Vec<u64> = vec![0; if entries.is_empty() { 0 } else { (highest - lowest) as usize + 1 }];
    for &(key_group, len) in entries {
        bytes_of[(key_group - lowest) as usize] += u64::from(len);
    }
    let mut index = Encoder::with_capacity(bytes_of.len() * 4);
    let mut previous = 0u32;
    for (i, &bytes) in bytes_of.iter().enumerate().filter(|(_, &bytes)| bytes > 0) {
        let key_group = lowest + i as u32;
        index.varint(u64::from(key_group - previous));
        index.varint(bytes);
        previous = key_group;
    }
    let entries_at = HEADER_LEN + 4 + index.buf.len();
    let mut out = vec![0u8; written.len() + 4 + index.buf.len()];
    out[..HEADER_LEN].copy_from_slice(&written[..HEADER_LEN]);
    out[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&(index.buf.len() as u32).to_le_bytes());
    out[HEADER_LEN + 4..entries_at].copy_from_slice(&index.buf);
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
}

/// The index of an increment ordered by key group: where each key group's entries are.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IncrementIndex {
    /// Key groups that have entries, increasing; their entries follow each other.
    pub key_groups: Vec<KeyGroupEntries>,
}

impl IncrementIndex {
    /// The bytes holding the entries of key groups `[first, last)`: one stretch of the file,
    /// as an offset and a length (length 0 when none of them has entries).
    pub fn stretch_of(&self, (first, last): (u32, u32)) -> (u64, u64) {
        let from = self.key_groups.partition_point(|k| k.key_group < first);
        let to = self.key_groups.partition_point(|k| k.key_group < last);
        match (self.key_groups.get(from), to > from) {
            (Some(start), true) => {
                let end = &self.key_groups[to - 1];
                (start.offset, end.offset + end.len - start.offset)
            }
            _ => (0, 0),
        }
    }
}

/// Reads the index of an increment ordered by key group from the start of `file` (its length
/// `len`): `None` for a file of another kind. Only the header and the index are read; the
/// file must be verified to trust what the index says (as a restore does while downloading).
pub fn read_increment_index(
    mut file: impl std::io::Read,
    len: u64,
) -> Result<Option<IncrementIndex>, PartsError<std::convert::Infallible>> {
    let Some(index_len) = read_header(&mut file, len)?.1 else { return Ok(None) };
    let mut raw = vec![0u8; index_len as usize];
    file.read_exact(&mut raw)?;
    let entries_at = (HEADER_LEN + 4) as u64 + index_len;
    let entries_len = len - entries_at - 4;
    let mut dec = Decoder::new(&raw);
    let (mut key_groups, mut key_group, mut offset) = (Vec::new(), 0u64, entries_at);
    while !dec.is_empty() {
        let step = dec.varint().map_err(PartsError::Format)?;
        let bytes = dec.varint().map_err(PartsError::Format)?;
        key_group = key_group.saturating_add(step);
        if key_group > u64::from(u32::MAX) || (step == 0 && !key_groups.is_empty()) {
            return Err(PartsError::Format(FormatError::BadIndex("key groups not increasing")));
        }
        if bytes == 0 {
            return Err(PartsError::Format(FormatError::BadIndex("a key group without entries")));
        }
        key_groups.push(KeyGroupEntries { key_group: key_group as u32, offset, len: bytes });
        offset = offset.checked_add(bytes).ok_or(PartsError::Format(FormatError::BadIndex("too long")))?;
    }
    if offset - entries_at != entries_len {
        return Err(PartsError::Format(FormatError::BadIndex("its lengths do not add up to the entries'")));
    }
    Ok(Some(IncrementIndex { key_groups }))
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
        KIND_INCREMENT_BY_KEY_GROUP => {
            let mut index_len = [0u8; 4];
            file.read_exact(&mut index_len)?;
            let index_len = u64::from(u32::from_le_bytes(index_len));
            if len < (HEADER_LEN + 4 + 4) as u64 + index_len {
                return Err(PartsError::Format(FormatError::Truncated(len as usize)));
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
}

impl<W: std::io::Write> StateFileStream<W> {
    /// Bytes buffered before they are written out.
    const FLUSH_AT: usize = 1 << 20;

    /// Starts a file of `kind` on `out`.
    pub fn new(kind: FileKind, out: W) -> Self {
        let mut buf = Encoder::with_capacity(Self::FLUSH_AT + 4096);
        buf.buf.extend_from_slice(MAGIC);
        buf.u8(kind as u8);
        StateFileStream { out, buf, crc: 0, len: 0, entries: 0 }
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

    /// Seals the file with its checksum; returns the writer, the file's length and its CRC-32C.
    pub fn finish(mut self) -> std::io::Result<(W, u64, u32)> {
        self.flush_buf()?;
        let trailer = self.crc.to_le_bytes();
        self.out.write_all(&trailer)?;
        self.out.flush()?;
        Ok((self.out, self.len + 4, crc32c::crc32c_append(self.crc, &trailer)))
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
pub fn keyed_entries(body: &[u8]) -> impl Iterator<Item = Result<KeyedEntry<'_>, FormatError>> {
    let mut dec = Decoder::new(body);
    std::iter::from_fn(move || {
        if dec.is_empty() {
            return None;
        }
        let mut next = || -> Result<KeyedEntry<'_>, FormatError> {
            let key_group = dec.varint()? as u32;
            let key = dec.bytes()?;
            let value = match dec.u8()? {
                0 => None,
                1 => Some(dec.bytes()?),
                _ => return Err(FormatError::Malformed(dec.position())),
            };
            Ok(KeyedEntry { key_group, key, value })
        };
        Some(next())
    })
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

/// The length of the longest prefix of `body` made of whole keyed entries.
fn whole_entries_len(body: &[u8]) -> usize {
    let mut dec = Decoder::new(body);
    let mut whole = 0;
    while !dec.is_empty() {
        let entry = (|| -> Result<(), FormatError> {
            dec.varint()?;
            dec.bytes()?;
            if dec.u8()? == 1 {
                dec.bytes()?;
            }
            Ok(())
        })();
        if entry.is_err() {
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
        assert_eq!(crc, crc32c::crc32c(&bytes));
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

    /// Entries of scattered key groups (deletions, and values long enough to move their bytes
    /// for a longer length), written to an increment ordered by key group.
    fn scattered_increment() -> (Bytes, Vec<Owned>) {
        let mut w = StateFileWriter::increment_by_key_group(64);
        let mut written = Vec::new();
        for i in 0..400u32 {
            let key_group = (i * 37 + i / 50) % 23 + 5;
            let key = format!("key-{}", i % 150).into_bytes();
            if i % 9 == 0 {
                w.delete_encoded(key_group, |e| e.buf.extend_from_slice(&key));
                written.push((key_group, key, None));
            } else {
                let value = vec![i as u8; if i % 31 == 0 { 300 } else { (i % 5) as usize }];
                w.put_encoded(key_group, |e| e.buf.extend_from_slice(&key), |e| e.buf.extend_from_slice(&value));
                written.push((key_group, key, Some(value)));
            }
        }
        assert_eq!(w.entries(), 400);
        (w.finish().0, written)
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
        let mut ordered = written.clone();
        // Stable: the entries of a key group keep the order they were written in.
        ordered.sort_by_key(|(key_group, _, _)| *key_group);
        let (kind, body) = open(&bytes).unwrap();
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
    fn varints_round_trip() {
        let mut e = Encoder::default();
        for v in [0i64, 1, -1, i64::MAX, i64::MIN, 300, -300] {
            e.svarint(v);
        }
        let mut d = Decoder::new(&e.buf);
        for v in [0i64, 1, -1, i64::MAX, i64::MIN, 300, -300] {
            assert_eq!(d.svarint().unwrap(), v);
        }
    }
}
