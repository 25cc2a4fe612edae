//! Records and their values: a compact typed row (event time + fields in schema order), keys,
//! a stable key hash for key groups, and the binary encoding used in state files.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use smol_str::SmolStr;
use weir_checkpoint::format::{Decoder, Encoder, FormatError};

/// One field value.
#[derive(Clone, Debug)]
pub enum Value {
    /// Absent.
    Null,
    /// Boolean.
    Bool(bool),
    /// 64-bit integer.
    Int(i64),
    /// 64-bit float.
    Float(f64),
    /// Immutable string, cheaply cloned: up to 23 bytes held inline (no allocation, and no
    /// pointer to follow when a key is hashed or compared), longer ones shared.
    Str(SmolStr),
}

impl PartialEq for Value {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Value::Null, Value::Null) => true,
            (Value::Bool(a), Value::Bool(b)) => a == b,
            (Value::Int(a), Value::Int(b)) => a == b,
            (Value::Float(a), Value::Float(b)) => a.to_bits() == b.to_bits(),
            (Value::Str(a), Value::Str(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for Value {}

impl Hash for Value {
    fn hash<H: Hasher>(&self, state: &mut H) {
        match self {
            Value::Null => state.write_u8(0),
            Value::Bool(b) => state.write_u8(if *b { 2 } else { 1 }),
            Value::Int(i) => state.write_i64(*i),
            Value::Float(f) => state.write_u64(f.to_bits()),
            Value::Str(s) => state.write(s.as_bytes()),
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Null => write!(f, "null"),
            Value::Bool(b) => write!(f, "{b}"),
            Value::Int(i) => write!(f, "{i}"),
            Value::Float(x) => write!(f, "{x}"),
            Value::Str(s) => write!(f, "{s}"),
        }
    }
}

impl Value {
    /// A string value.
    pub fn str(s: &str) -> Value {
        Value::Str(SmolStr::new(s))
    }

    /// Appends the value as JSON.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        match self {
            Value::Null => out.extend_from_slice(b"null"),
            Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
            Value::Int(i) => out.extend_from_slice(i.to_string().as_bytes()),
            Value::Float(x) if x.is_finite() => {
                let s = serde_json::to_string(x).unwrap_or_else(|_| "null".into());
                out.extend_from_slice(s.as_bytes());
            }
            Value::Float(_) => out.extend_from_slice(b"null"),
            Value::Str(s) => {
                let s = serde_json::to_string(&**s).unwrap_or_else(|_| "\"\"".into());
                out.extend_from_slice(s.as_bytes());
            }
        }
    }

    /// Converts to a JSON value.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Value::Null => serde_json::Value::Null,
            Value::Bool(b) => (*b).into(),
            Value::Int(i) => (*i).into(),
            Value::Float(f) => {
                serde_json::Number::from_f64(*f).map(serde_json::Value::Number).unwrap_or(serde_json::Value::Null)
            }
            Value::Str(s) => serde_json::Value::String(s.to_string()),
        }
    }

    /// Binary encoding (state files).
    pub fn encode(&self, e: &mut Encoder) {
        match self {
            Value::Null => e.u8(0),
            Value::Bool(b) => e.u8(if *b { 2 } else { 1 }),
            Value::Int(i) => {
                e.u8(3);
                e.svarint(*i);
            }
            Value::Float(f) => {
                e.u8(4);
                e.f64(*f);
            }
            Value::Str(s) => {
                e.u8(5);
                e.bytes(s.as_bytes());
            }
        }
    }

    /// Reads what [`Value::encode`] wrote. Inlined (a string's decoding is not): a restore
    /// decodes a value per entry, and a value returned through memory made the caller wait
    /// for the writes (see `weir_checkpoint::format::KeyedEntries`).
    #[inline(always)]
    pub fn decode(d: &mut Decoder<'_>) -> Result<Value, FormatError> {
        Ok(match d.u8()? {
            0 => Value::Null,
            1 => Value::Bool(false),
            2 => Value::Bool(true),
            3 => Value::Int(d.svarint()?),
            4 => Value::Float(d.f64()?),
            5 => Self::decode_str(d)?,
            _ => return Err(FormatError::Malformed(d.position())),
        })
    }

    /// [`Self::decode`] of a string, after its tag.
    #[inline(never)]
    fn decode_str(d: &mut Decoder<'_>) -> Result<Value, FormatError> {
        let at = d.position();
        let raw = d.bytes()?;
        Ok(Value::Str(SmolStr::new(std::str::from_utf8(raw).map_err(|_| FormatError::Malformed(at))?)))
    }

    /// Numeric view.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(i) => Some(*i as f64),
            Value::Float(f) => Some(*f),
            _ => None,
        }
    }

    /// Total order used by `min`/`max`: nulls first, then bools, numbers (ints and floats
    /// compared numerically), strings.
    pub fn cmp_total(&self, other: &Value) -> std::cmp::Ordering {
        use std::cmp::Ordering;
        fn rank(v: &Value) -> u8 {
            match v {
                Value::Null => 0,
                Value::Bool(_) => 1,
                Value::Int(_) | Value::Float(_) => 2,
                Value::Str(_) => 3,
            }
        }
        match (self, other) {
            (Value::Bool(a), Value::Bool(b)) => a.cmp(b),
            (Value::Int(a), Value::Int(b)) => a.cmp(b),
            (Value::Str(a), Value::Str(b)) => a.cmp(b),
            (a, b) if rank(a) == 2 && rank(b) == 2 => a.as_f64().unwrap_or(0.0).total_cmp(&b.as_f64().unwrap_or(0.0)),
            (a, b) => rank(a).cmp(&rank(b)).then(Ordering::Equal),
        }
    }
}

/// Fields a record holds inline, without a heap allocation of its own.
pub const INLINE_FIELDS: usize = 3;

/// A record's field values: up to [`INLINE_FIELDS`] live inside the record itself, so that
/// creating, moving and dropping the records of a batch allocates nothing per record (the
/// keyed count spent a third of its time in `malloc` and `free` with a `Vec` per record).
pub type Fields = smallvec::SmallVec<[Value; INLINE_FIELDS]>;

/// One record: its event time (ms) and its fields in schema order.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// Event time, milliseconds.
    pub time: i64,
    /// Field values, in the order of the producing node's schema.
    pub fields: Fields,
}

/// A key: one or several field values.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    /// A single-field key (the common case, no allocation for ints).
    One(Value),
    /// A composite key.
    Many(Arc<[Value]>),
}

impl Key {
    /// Extracts the key fields of a record.
    #[inline]
    pub fn of(record: &Record, fields: &[usize]) -> Key {
        if let [one] = fields {
            Key::One(record.fields[*one].clone())
        } else {
            Key::Many(fields.iter().map(|&i| record.fields[i].clone()).collect())
        }
    }

    /// The key's values in order.
    pub fn values(&self) -> &[Value] {
        match self {
            Key::One(v) => std::slice::from_ref(v),
            Key::Many(vs) => vs,
        }
    }

    /// Binary encoding.
    pub fn encode(&self, e: &mut Encoder) {
        let vs = self.values();
        e.varint(vs.len() as u64);
        for v in vs {
            v.encode(e);
        }
    }

    /// Reads what [`Key::encode`] wrote. A key of one value inlined, as [`Value::decode`].
    #[inline(always)]
    pub fn decode(d: &mut Decoder<'_>) -> Result<Key, FormatError> {
        let n = d.varint()? as usize;
        if n == 1 {
            return Ok(Key::One(Value::decode(d)?));
        }
        Self::decode_many(d, n)
    }

    /// [`Self::decode`] of a key of `n` values other than one, after its count.
    #[inline(never)]
    fn decode_many(d: &mut Decoder<'_>, n: usize) -> Result<Key, FormatError> {
        let mut vs = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            vs.push(Value::decode(d)?);
        }
        Ok(Key::Many(vs.into()))
    }

    /// A hash that never changes across runs, machines or versions: key groups depend on it.
    #[inline]
    pub fn stable_hash(&self) -> u64 {
        stable_hash_of(self.values().iter().map(value_hash))
    }

    /// The key group (`0..max_parallelism`) of this key.
    #[inline]
    pub fn key_group(&self, max_parallelism: u32) -> u32 {
        (self.stable_hash() % u64::from(max_parallelism)) as u32
    }

    /// The key group of the key of `record`'s `fields`, without building the key (a composite
    /// key would allocate).
    #[inline]
    pub fn key_group_of(record: &Record, fields: &[usize], max_parallelism: u32) -> u32 {
        let hash = stable_hash_of(fields.iter().map(|&i| value_hash(&record.fields[i])));
        (hash % u64::from(max_parallelism)) as u32
    }
}

/// One value's part of [`Key::stable_hash`].
#[inline]
fn value_hash(v: &Value) -> u64 {
    match v {
        Value::Null => 0x51,
        Value::Bool(b) => 0x52 + u64::from(*b),
        Value::Int(i) => *i as u64,
        Value::Float(f) => f.to_bits() ^ 0x5bd1_e995,
        Value::Str(s) => fnv1a(s.as_bytes()),
    }
}

/// [`Key::stable_hash`] from its values' parts, in order.
#[inline]
fn stable_hash_of(parts: impl Iterator<Item = u64>) -> u64 {
    parts.fold(STABLE_HASH_SEED, stable_hash_step)
}

/// Where [`stable_hash_of`] starts.
const STABLE_HASH_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// One value's part folded into [`stable_hash_of`].
#[inline]
fn stable_hash_step(hash: u64, part: u64) -> u64 {
    mix64(hash ^ mix64(part))
}

/// A key as keyed state holds it: hashed and compared in the state's map, and written to state
/// files and store keys in the one canonical encoding of [`Key::encode`], so that every
/// representation reads what another wrote.
pub trait StateKey: Clone + Eq + Hash + fmt::Debug + Send + 'static {
    /// Whether every key of this type is one integer ([`IntKey`]): a state of them says so in
    /// its snapshots, and a restore of those may hold their keys so again.
    const INTEGERS_ONLY: bool = false;
    /// The key of `record`'s `fields`.
    fn of(record: &Record, fields: &[usize]) -> Self;
    /// Its key group (`0..max_parallelism`): [`Key::key_group`] of the same values.
    fn key_group(&self, max_parallelism: u32) -> u32;
    /// Appends its encoding ([`Key::encode`]).
    fn encode(&self, e: &mut Encoder);
    /// Reads a whole encoded key.
    fn decode(encoded: &[u8]) -> Result<Self, FormatError>;
    /// Reads a whole encoded key and hands it to `then`: for a restore, whose keys go from here
    /// into the map, so that a key built here is not copied through memory on its way there.
    #[inline(always)]
    fn decode_then<R>(encoded: &[u8], then: impl FnOnce(Self) -> R) -> Result<R, FormatError> {
        Ok(then(Self::decode(encoded)?))
    }
    /// Appends its values to `out`.
    fn push_values(&self, out: &mut Fields);
    /// A key that owns nothing, left in a batch's slot when its key is moved out whole (see
    /// [`crate::state::KeyedState::insert_new_all`]); never looked up or stored.
    fn vacated() -> Self;
}

impl StateKey for Key {
    #[inline]
    fn of(record: &Record, fields: &[usize]) -> Self {
        Key::of(record, fields)
    }

    #[inline]
    fn key_group(&self, max_parallelism: u32) -> u32 {
        Key::key_group(self, max_parallelism)
    }

    fn encode(&self, e: &mut Encoder) {
        Key::encode(self, e)
    }

    #[inline(always)]
    fn decode(encoded: &[u8]) -> Result<Self, FormatError> {
        Key::decode(&mut Decoder::new(encoded))
    }

    /// A key of one integer (count 1, tag 3, [`Value::encode`]) is built where `then` takes
    /// it: returned as a `Result` first, its bytes between the enum's tag and its number
    /// were copied in pieces through the stack, and the restore's next read of the key waited
    /// on those stores (`perf annotate`: a quarter of a restoring thread's samples).
    #[inline(always)]
    fn decode_then<R>(encoded: &[u8], then: impl FnOnce(Self) -> R) -> Result<R, FormatError> {
        let mut d = Decoder::new(encoded);
        if let [1, 3, ..] = encoded {
            d.u8()?;
            d.u8()?;
            return Ok(then(Key::One(Value::Int(d.svarint()?))));
        }
        Ok(then(Key::decode(&mut d)?))
    }

    fn push_values(&self, out: &mut Fields) {
        out.extend(self.values().iter().cloned());
    }

    #[inline]
    fn vacated() -> Self {
        Key::One(Value::Null)
    }
}

/// A key of one integer field as keyed state holds it: the integer alone, 8 bytes where a
/// [`Key`] takes 24, so that a running count's map entry is 16 bytes instead of 32. Hashed,
/// grouped and encoded exactly as the [`Key`] of the same value, so that either reads the state
/// files of the other, in the same order.
///
/// Keyed state holds a one-field key as an `IntKey` only while every key it has seen is an
/// integer (`crate::operators::keyed`): it never builds one of another value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntKey(pub i64);

impl Hash for IntKey {
    /// As [`Key::One`] of [`Value::Int`] hashes: the variant's discriminant, then the integer.
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_isize(0);
        state.write_i64(self.0);
    }
}

impl StateKey for IntKey {
    const INTEGERS_ONLY: bool = true;

    /// The integer of `record`'s one key field. A field of another value is the caller's
    /// mistake (it keeps such keys as [`Key`]s); it reads as 0 in release builds.
    #[inline]
    fn of(record: &Record, fields: &[usize]) -> Self {
        match record.fields[fields[0]] {
            Value::Int(i) => IntKey(i),
            ref other => {
                debug_assert!(false, "an integer key held a {other:?}");
                IntKey(0)
            }
        }
    }

    #[inline]
    fn key_group(&self, max_parallelism: u32) -> u32 {
        let hash = stable_hash_of(std::iter::once(self.0 as u64));
        (hash % u64::from(max_parallelism)) as u32
    }

    fn encode(&self, e: &mut Encoder) {
        e.varint(1);
        e.u8(3);
        e.svarint(self.0);
    }

    /// Refuses any key but one integer's (count 1, tag 3).
    #[inline(always)]
    fn decode(encoded: &[u8]) -> Result<Self, FormatError> {
        let mut d = Decoder::new(encoded);
        if let [1, 3, ..] = encoded {
            d.u8()?;
            d.u8()?;
            let key = IntKey(d.svarint()?);
            if d.position() == encoded.len() {
                return Ok(key);
            }
        }
        Err(FormatError::Malformed(0))
    }

    fn push_values(&self, out: &mut Fields) {
        out.push(Value::Int(self.0));
    }

    #[inline]
    fn vacated() -> Self {
        IntKey(0)
    }
}

/// Bytes of a [`PackedKey`] held without an allocation: the most that keeps the key 24 bytes
/// (a length and the bytes; or a boxed slice, told apart by a length no inline key has).
pub const PACKED_KEY_INLINE: usize = 23;

/// A composite key as keyed state holds it: its encoding ([`Key::encode`]), inline up to
/// [`PACKED_KEY_INLINE`] bytes.
///
/// [`Key::Many`] allocates a shared slice per key. A state of millions of composite keys (a
/// dedupe on (word, count) keeps one per record) then spent its time allocating, following a
/// pointer at every comparison, and freeing them one by one when the job ended. Equal keys have
/// equal encodings (floats compare by their bits, as they are encoded; strings by their bytes),
/// so the bytes are what is hashed and compared.
///
/// 24 bytes, where a `SmallVec` of as many inline bytes takes 32: a dedupe's entry (key and
/// slot) is 32 bytes instead of 40, and the 8M keys of the CEL pipeline's dedupe take a fifth
/// less memory.
#[derive(Clone)]
pub struct PackedKey(PackedBytes);

/// A [`PackedKey`]'s bytes.
///
/// The inline length is an [`InlineLen`], not a `u8`: the byte values it cannot take tell the
/// variants apart, so the enum has no tag byte of its own (the inline variant fills all 24
/// bytes, so a tag would make the key 32) and a move copies it as whole words. With a tag
/// byte, moving a key copied the 23 bytes after it in two overlapping pieces, and the next
/// read of the key waited for both to reach the cache: 65% of a dedupe's insert loop stood
/// on that read, behind the inserts' writes to missing buckets.
#[derive(Clone)]
enum PackedBytes {
    /// Up to [`PACKED_KEY_INLINE`] bytes: the first `len` of `bytes`.
    Inline { len: InlineLen, bytes: [u8; PACKED_KEY_INLINE] },
    /// Longer.
    Heap(Box<[u8]>),
}

/// The length of an inline [`PackedBytes`], `0..=PACKED_KEY_INLINE`.
#[derive(Clone, Copy)]
#[repr(u8)]
#[rustfmt::skip]
enum InlineLen {
    L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11, L12, L13, L14, L15, L16, L17, L18, L19,
    L20, L21, L22, L23,
}

impl InlineLen {
    /// Every length, indexed by itself.
    #[rustfmt::skip]
    const ALL: [InlineLen; PACKED_KEY_INLINE + 1] = {
        use InlineLen::*;
        [
            L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11, L12, L13, L14, L15, L16, L17, L18, L19, L20, L21,
            L22, L23,
        ]
    };

    /// The length `len`, if it fits inline.
    #[inline]
    fn of(len: usize) -> Option<Self> {
        Self::ALL.get(len).copied()
    }

    #[inline]
    fn get(self) -> usize {
        usize::from(self as u8)
    }
}

impl PackedBytes {
    fn from_slice(encoded: &[u8]) -> Self {
        match InlineLen::of(encoded.len()) {
            Some(len) => {
                let mut bytes = [0u8; PACKED_KEY_INLINE];
                bytes[..encoded.len()].copy_from_slice(encoded);
                PackedBytes::Inline { len, bytes }
            }
            _ => PackedBytes::Heap(encoded.into()),
        }
    }

    #[inline]
    fn as_slice(&self) -> &[u8] {
        match self {
            PackedBytes::Inline { len, bytes } => &bytes[..len.get()],
            PackedBytes::Heap(bytes) => bytes,
        }
    }
}

impl PartialEq for PackedKey {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.0.as_slice() == other.0.as_slice()
    }
}

impl Eq for PackedKey {}

impl Hash for PackedKey {
    /// The bytes, hashed as a slice (as the `SmallVec` this replaced hashed them).
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.as_slice().hash(state)
    }
}

thread_local! {
    /// Scratch space for encoding keys.
    static KEY_SCRATCH: std::cell::RefCell<Encoder> = std::cell::RefCell::new(Encoder::default());
}

impl PackedKey {
    /// The key's values, decoded.
    pub fn values(&self) -> Fields {
        let mut out = Fields::new();
        self.push_values(&mut out);
        out
    }

    /// The values of an encoded key, each passed to `f` as it is read (strings checked to be
    /// UTF-8, as [`Value::decode`] does).
    fn for_each_value(encoded: &[u8], mut f: impl FnMut(Value)) -> Result<(), FormatError> {
        let mut d = Decoder::new(encoded);
        for _ in 0..d.varint()? {
            f(Value::decode(&mut d)?);
        }
        if !d.is_empty() {
            return Err(FormatError::Malformed(d.position()));
        }
        Ok(())
    }

    /// [`Key::stable_hash`] of an encoded key, read from its encoding: each value's
    /// [`value_hash`] without building the value (no string is copied or checked again; a
    /// dedupe computes this for every new key).
    fn stable_hash_of_encoded(encoded: &[u8]) -> Result<u64, FormatError> {
        let mut d = Decoder::new(encoded);
        let mut hash = STABLE_HASH_SEED;
        for _ in 0..d.varint()? {
            let at = d.position();
            let part = match d.u8()? {
                0 => value_hash(&Value::Null),
                1 => value_hash(&Value::Bool(false)),
                2 => value_hash(&Value::Bool(true)),
                3 => value_hash(&Value::Int(d.svarint()?)),
                4 => value_hash(&Value::Float(d.f64()?)),
                5 => fnv1a(d.bytes()?),
                _ => return Err(FormatError::Malformed(at)),
            };
            hash = stable_hash_step(hash, part);
        }
        Ok(hash)
    }
}

/// Whether keyed state holds a key of `arity` fields as a [`PackedKey`] (several fields, or
/// none) rather than as a [`Key`] (one field). The executor picks the operator's key type by
/// it, and merges order entries by the hash of that type.
pub fn is_packed(arity: usize) -> bool {
    arity != 1
}

impl StateKey for PackedKey {
    fn of(record: &Record, fields: &[usize]) -> Self {
        KEY_SCRATCH.with_borrow_mut(|e| {
            e.buf.clear();
            e.varint(fields.len() as u64);
            for &i in fields {
                record.fields[i].encode(e);
            }
            PackedKey(PackedBytes::from_slice(&e.buf))
        })
    }

    fn key_group(&self, max_parallelism: u32) -> u32 {
        let hash = Self::stable_hash_of_encoded(self.0.as_slice())
            .expect("a packed key holds a valid encoding (checked when read)");
        (hash % u64::from(max_parallelism)) as u32
    }

    fn encode(&self, e: &mut Encoder) {
        e.buf.extend_from_slice(self.0.as_slice());
    }

    fn decode(encoded: &[u8]) -> Result<Self, FormatError> {
        Self::for_each_value(encoded, drop)?;
        Ok(PackedKey(PackedBytes::from_slice(encoded)))
    }

    fn push_values(&self, out: &mut Fields) {
        Self::for_each_value(self.0.as_slice(), |v| out.push(v))
            .expect("a packed key holds a valid encoding (checked when read)");
    }

    #[inline]
    fn vacated() -> Self {
        PackedKey(PackedBytes::Inline { len: InlineLen::L0, bytes: [0; PACKED_KEY_INLINE] })
    }
}

impl fmt::Debug for PackedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PackedKey").field(&self.values()).finish()
    }
}

/// FNV-1a over bytes.
#[inline]
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A strong 64-bit mixer (splitmix64's finalizer).
#[inline]
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The subtask (of `parallelism`) owning a key group, as in Flink.
#[inline]
pub fn subtask_for_key_group(key_group: u32, max_parallelism: u32, parallelism: u32) -> u32 {
    ((u64::from(key_group) * u64::from(parallelism)) / u64::from(max_parallelism)) as u32
}

/// The key groups `[start, end)` owned by a subtask: the inverse of [`subtask_for_key_group`].
pub fn key_group_range(subtask: u32, max_parallelism: u32, parallelism: u32) -> (u32, u32) {
    let start = (u64::from(subtask) * u64::from(max_parallelism)).div_ceil(u64::from(parallelism));
    let end = (u64::from(subtask + 1) * u64::from(max_parallelism)).div_ceil(u64::from(parallelism));
    (start as u32, end as u32)
}

/// Writes a record as one JSON object line, fields named by `schema`.
pub fn write_json_line(schema: &[String], record: &Record, out: &mut Vec<u8>) {
    out.push(b'{');
    for (i, (name, value)) in schema.iter().zip(record.fields.iter()).enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.push(b'"');
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b"\":");
        value.write_json(out);
    }
    out.extend_from_slice(b"}\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An integer key held alone is the [`Key`] of the same value to everything that reads
    /// it: the same hash (by any hasher: the same writes), key group and encoding, decoded
    /// back whole; any other encoded key is refused, not misread.
    #[test]
    fn int_keys_hash_group_and_encode_as_the_same_value_keys_and_refuse_others() {
        use std::hash::BuildHasher;
        let std_hash = std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default();
        let samples = [0, 1, -1, 42, -18, i64::MAX, i64::MIN, 1 << 40, -(1 << 33)];
        for i in samples.into_iter().chain((0..2000).map(|n| mix64(n) as i64)) {
            let (int, key) = (IntKey(i), Key::One(Value::Int(i)));
            assert_eq!(crate::state::map::hash_of(&int), crate::state::map::hash_of(&key), "{i}");
            assert_eq!(std_hash.hash_one(int), std_hash.hash_one(&key), "{i}");
            assert_eq!(StateKey::key_group(&int, 128), key.key_group(128), "{i}");
            let (mut a, mut b) = (Encoder::default(), Encoder::default());
            StateKey::encode(&int, &mut a);
            key.encode(&mut b);
            assert_eq!(a.buf, b.buf, "{i}");
            assert_eq!(IntKey::decode(&a.buf).unwrap(), int);
            let mut values = Fields::new();
            int.push_values(&mut values);
            assert_eq!(values.as_slice(), key.values());
        }
        assert_eq!(std::mem::size_of::<IntKey>(), 8);
        let encoded = |key: Key| {
            let mut e = Encoder::default();
            key.encode(&mut e);
            e.buf
        };
        for other in [
            Key::One(Value::str("7")),
            Key::One(Value::Float(7.0)),
            Key::One(Value::Null),
            Key::One(Value::Bool(true)),
            Key::Many(vec![Value::Int(7), Value::Int(8)].into()),
        ] {
            assert!(IntKey::decode(&encoded(other.clone())).is_err(), "{other:?}");
        }
        let mut trailing = encoded(Key::One(Value::Int(7)));
        trailing.push(0);
        assert!(IntKey::decode(&trailing).is_err(), "a byte after the integer");
    }

    /// A value stays 24 bytes with strings inline (state entries and records are sized by it),
    /// and a short string needs no allocation while a long one is shared, both read back whole.
    #[test]
    fn strings_up_to_23_bytes_are_inline_and_values_stay_24_bytes() {
        assert_eq!(std::mem::size_of::<Value>(), 24);
        let short = Value::str("kalomine-23-bytes-long!");
        let Value::Str(s) = &short else { unreachable!() };
        assert!(!s.is_heap_allocated(), "23 bytes are held inline");
        let long = Value::str("kalomine-24-bytes-long!!");
        let Value::Str(l) = &long else { unreachable!() };
        assert!(l.is_heap_allocated());
        for v in [short, long] {
            let mut e = Encoder::default();
            v.encode(&mut e);
            assert_eq!(Value::decode(&mut Decoder::new(&e.buf)).unwrap(), v);
        }
    }

    #[test]
    fn key_group_ranges_partition_and_invert() {
        for (m, p) in [(128u32, 1u32), (128, 3), (128, 2), (10, 7), (7, 7)] {
            let mut next = 0;
            for s in 0..p {
                let (a, b) = key_group_range(s, m, p);
                assert_eq!(a, next);
                for kg in a..b {
                    assert_eq!(subtask_for_key_group(kg, m, p), s, "m={m} p={p} kg={kg}");
                }
                next = b;
            }
            assert_eq!(next, m);
        }
    }

    const PINNED_HELLO: u64 = 0x4ab8_81b8_1b24_373b;
    const PINNED_42_KG: u32 = 3;

    #[test]
    fn keys_encode_and_hash_stably() {
        let k =
            Key::Many(vec![Value::str("a"), Value::Int(-5), Value::Float(1.5), Value::Null, Value::Bool(true)].into());
        let mut e = Encoder::default();
        k.encode(&mut e);
        let back = Key::decode(&mut Decoder::new(&e.buf)).unwrap();
        assert_eq!(back, k);
        // Pinned: changing the hash would move existing state to the wrong key groups.
        assert_eq!(Key::One(Value::str("hello")).stable_hash(), PINNED_HELLO);
        assert_eq!(Key::One(Value::Int(42)).key_group(128), PINNED_42_KG);
    }

    /// Composite keys packed into bytes behave as the keys they encode: the same encoding,
    /// key group, equality and values, read back from a state file whole; a damaged encoding is
    /// refused when read.
    #[test]
    fn packed_keys_are_the_keys_they_encode() {
        let long = "a string longer than the twenty-three inline bytes";
        // 24 bytes with 23 inline: no tag byte (the inline length's unused values are the tag).
        assert_eq!(std::mem::size_of::<PackedKey>(), 24);
        assert_eq!(std::mem::size_of::<Option<PackedKey>>(), 24);
        // Encodings of 22, 23 and 24 bytes: the last inline length and the first boxed one.
        let edge = |n: usize| smallvec::smallvec![Value::str(&"e".repeat(n)), Value::Int(0)];
        let records: Vec<Fields> = vec![
            edge(17),
            edge(18),
            edge(19),
            smallvec::smallvec![Value::str("word"), Value::Int(17)],
            smallvec::smallvec![Value::str("word"), Value::Int(-17)],
            smallvec::smallvec![Value::str(long), Value::Int(i64::MAX)],
            smallvec::smallvec![Value::Float(-0.0), Value::Float(0.0), Value::Null],
            smallvec::smallvec![Value::Float(f64::NAN), Value::Bool(true), Value::Bool(false)],
            smallvec::smallvec![Value::str(""), Value::Null, Value::Int(0)],
        ];
        let fields = [0usize, 1, 2];
        let mut keys = Vec::new();
        for values in &records {
            let record = Record { time: 0, fields: values.clone() };
            let arity = values.len();
            let key = Key::of(&record, &fields[..arity]);
            let packed = PackedKey::of(&record, &fields[..arity]);
            let mut e = Encoder::default();
            Key::encode(&key, &mut e);
            let mut p = Encoder::default();
            StateKey::encode(&packed, &mut p);
            assert_eq!(p.buf, e.buf, "{key:?}");
            assert_eq!(PackedKey::decode(&e.buf).unwrap(), packed);
            let decoded = PackedKey::decode(&e.buf).unwrap();
            assert_eq!(crate::state::map::hash_of(&decoded), crate::state::map::hash_of(&packed), "{key:?}");
            for m in [1, 7, 128, 32768] {
                assert_eq!(StateKey::key_group(&packed, m), key.key_group(m), "{key:?}");
                assert_eq!(Key::key_group_of(&record, &fields[..arity], m), key.key_group(m));
            }
            assert_eq!(packed.values().as_slice(), key.values());
            keys.push((key, packed));
        }
        for (a, pa) in &keys {
            for (b, pb) in &keys {
                assert_eq!(a == b, pa == pb, "{a:?} against {b:?}");
            }
        }
        let one = Key::One(Value::str("hello"));
        let mut e = Encoder::default();
        one.encode(&mut e);
        assert_eq!(StateKey::key_group(&PackedKey::decode(&e.buf).unwrap(), 128), one.key_group(128));
        // Damaged: a truncated string, bytes left over, an unknown tag, bad UTF-8.
        for bad in [&[2u8, 5, 4, b'a'][..], &[1, 0, 9], &[1, 9], &[1, 5, 2, 0xff, 0xfe]] {
            assert!(PackedKey::decode(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn json_lines() {
        let mut out = Vec::new();
        write_json_line(
            &["w".into(), "n".into(), "x".into()],
            &Record { time: 0, fields: smallvec::smallvec![Value::str("a\"b"), Value::Int(3), Value::Float(0.5)] },
            &mut out,
        );
        assert_eq!(String::from_utf8(out).unwrap(), "{\"w\":\"a\\\"b\",\"n\":3,\"x\":0.5}\n");
    }
}
