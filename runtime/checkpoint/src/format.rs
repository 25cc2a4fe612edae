//! The canonical binary format of state files, independent of any state backend.
//!
//! ```text
//! file    := magic "WST1" | kind u8 | body | crc32c u32-le (of everything before it)
//! kind    := 0 keyed full image | 1 keyed increment | 2 operator state
//! keyed   := entry*           entry := key_group varint | key bytes | op u8 (0 delete, 1 put) [| value bytes]
//! operator:= bytes            (an opaque document owned by the operator)
//! bytes   := len varint | raw
//! ```
//! Keyed entries carry their key group, so a restore at another parallelism reads only what
//! falls into its range.

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

/// Builds one state file.
#[derive(Debug)]
pub struct StateFileWriter {
    enc: Encoder,
    scratch: Encoder,
    entries: u64,
}

impl StateFileWriter {
    /// Starts a file of `kind`.
    pub fn new(kind: FileKind, capacity: usize) -> Self {
        let mut enc = Encoder::with_capacity(capacity + 16);
        enc.buf.extend_from_slice(MAGIC);
        enc.u8(kind as u8);
        StateFileWriter { enc, scratch: Encoder::with_capacity(64), entries: 0 }
    }

    /// Adds a keyed put.
    #[inline]
    pub fn put(&mut self, key_group: u32, key: &[u8], value: &[u8]) {
        self.enc.varint(u64::from(key_group));
        self.enc.bytes(key);
        self.enc.u8(1);
        self.enc.bytes(value);
        self.entries += 1;
    }

    /// Adds a keyed deletion.
    #[inline]
    pub fn delete(&mut self, key_group: u32, key: &[u8]) {
        self.enc.varint(u64::from(key_group));
        self.enc.bytes(key);
        self.enc.u8(0);
        self.entries += 1;
    }

    /// Adds a keyed put whose value is encoded in place by `value`.
    pub fn put_with(&mut self, key_group: u32, key: &[u8], value: impl FnOnce(&mut Encoder)) {
        self.put_encoded(key_group, |e| e.buf.extend_from_slice(key), value);
    }

    /// Adds a keyed put whose key and value are encoded in place (no intermediate buffers).
    #[inline]
    pub fn put_encoded(&mut self, key_group: u32, key: impl FnOnce(&mut Encoder), value: impl FnOnce(&mut Encoder)) {
        self.enc.varint(u64::from(key_group));
        self.length_prefixed(key);
        self.enc.u8(1);
        self.length_prefixed(value);
        self.entries += 1;
    }

    /// Adds a keyed deletion whose key is encoded in place.
    #[inline]
    pub fn delete_encoded(&mut self, key_group: u32, key: impl FnOnce(&mut Encoder)) {
        self.enc.varint(u64::from(key_group));
        self.length_prefixed(key);
        self.enc.u8(0);
        self.entries += 1;
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

    /// The keyed entries written, without the file's header, and their number: for appending
    /// to a [`StateFileStream`] with [`StateFileStream::put_entries`].
    pub fn into_entries(self) -> (Vec<u8>, u64) {
        let mut buf = self.enc.buf;
        buf.drain(..MAGIC.len() + 1);
        (buf, self.entries)
    }

    /// Seals the file with its checksum; returns the bytes and their CRC-32C.
    pub fn finish(mut self) -> (Bytes, u32) {
        let crc = crc32c::crc32c(&self.enc.buf);
        self.enc.buf.extend_from_slice(&crc.to_le_bytes());
        (Bytes::from(self.enc.buf), crc32c::crc32c_append(crc, &crc.to_le_bytes()))
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
    if &content[..4] != MAGIC {
        return Err(FormatError::BadMagic);
    }
    let kind = match content[4] {
        0 => FileKind::KeyedFull,
        1 => FileKind::KeyedIncrement,
        2 => FileKind::OperatorState,
        k => return Err(FormatError::UnknownKind(k)),
    };
    Ok((kind, &content[5..]))
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
    mut consume: impl FnMut(&[u8]) -> Result<(), E>,
) -> Result<FileKind, PartsError<E>> {
    if len < (MAGIC.len() + 1 + 4) as u64 {
        return Err(PartsError::Format(FormatError::Truncated(len as usize)));
    }
    let mut header = [0u8; 5];
    file.read_exact(&mut header)?;
    if &header[..4] != MAGIC {
        return Err(PartsError::Format(FormatError::BadMagic));
    }
    let kind = match header[4] {
        0 => FileKind::KeyedFull,
        1 => FileKind::KeyedIncrement,
        k => return Err(PartsError::Format(FormatError::UnknownKind(k))),
    };
    let part = part.max(1);
    let mut remaining = len - (MAGIC.len() + 1 + 4) as u64;
    let mut buf: Vec<u8> = Vec::with_capacity(part.min(remaining as usize));
    let mut want = part;
    loop {
        let take = (want.saturating_sub(buf.len()) as u64).min(remaining) as usize;
        let start = buf.len();
        buf.resize(start + take, 0);
        file.read_exact(&mut buf[start..])?;
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
        if remaining == 0 {
            return Ok(kind);
        }
    }
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
