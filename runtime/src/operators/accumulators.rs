//! Aggregate accumulators (`count`, `sum`, `min`, `max`, `avg`) shared by windows and running
//! aggregates.

use weir_checkpoint::format::{Decoder, Encoder, FormatError};
use weir_crds::job::{AggregateFn, AggregateKind};

use crate::state::slot::{FlagsInside, Slot, SpareBits};
use crate::state::StateValue;
use crate::value::{Fields, Record, Value};

/// One aggregate's running value.
#[derive(Clone, Debug, PartialEq)]
pub enum Acc {
    /// Record count.
    Count(i64),
    /// Integer sum (promoted to float when a float arrives).
    SumInt(i64),
    /// Float sum.
    SumFloat(f64),
    /// Smallest value (`Null` before the first).
    Min(Value),
    /// Largest value.
    Max(Value),
    /// Sum and count for the mean.
    Avg(f64, i64),
}

/// The accumulators of one key (or window): inline for a single aggregate, so that the hash
/// map entry holds them without a second allocation (and a second cache miss); a boxed slice
/// for none or several. 32 bytes, where a `SmallVec` of one took 40 (8 of them its length):
/// a running count's state entry is 64 bytes, one cache line, instead of 72.
#[derive(Clone, Debug, PartialEq)]
pub enum Accs {
    /// One accumulator.
    One(Acc),
    /// None, or two or more.
    Many(Box<[Acc]>),
}

impl Accs {
    /// Whether the accumulators are in a slice of their own on the heap.
    pub fn spilled(&self) -> bool {
        matches!(self, Accs::Many(many) if !many.is_empty())
    }
}

impl From<Vec<Acc>> for Accs {
    fn from(mut accs: Vec<Acc>) -> Self {
        match accs.pop() {
            Some(one) if accs.is_empty() => Accs::One(one),
            Some(last) => {
                accs.push(last);
                Accs::Many(accs.into_boxed_slice())
            }
            None => Accs::Many(Box::default()),
        }
    }
}

impl FromIterator<Acc> for Accs {
    fn from_iter<I: IntoIterator<Item = Acc>>(iter: I) -> Self {
        Accs::from(iter.into_iter().collect::<Vec<_>>())
    }
}

impl std::ops::Deref for Accs {
    type Target = [Acc];

    #[inline]
    fn deref(&self) -> &[Acc] {
        match self {
            Accs::One(one) => std::slice::from_ref(one),
            Accs::Many(many) => many,
        }
    }
}

impl<'a> IntoIterator for &'a Accs {
    type Item = &'a Acc;
    type IntoIter = std::slice::Iter<'a, Acc>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<'a> IntoIterator for &'a mut Accs {
    type Item = &'a mut Acc;
    type IntoIter = std::slice::IterMut<'a, Acc>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter_mut()
    }
}

impl std::ops::DerefMut for Accs {
    #[inline]
    fn deref_mut(&mut self) -> &mut [Acc] {
        match self {
            Accs::One(one) => std::slice::from_mut(one),
            Accs::Many(many) => many,
        }
    }
}

/// Aggregates bound to input field positions.
#[derive(Clone, Debug)]
pub struct Aggregates {
    specs: Vec<(AggregateKind, Option<usize>)>,
}

impl Aggregates {
    /// Binds aggregate specs to an input schema.
    pub fn new(specs: &[AggregateFn], input: &[String]) -> Self {
        Aggregates {
            specs: specs
                .iter()
                .map(|a| (a.function, a.field.as_ref().and_then(|f| input.iter().position(|x| x == f))))
                .collect(),
        }
    }

    /// Number of aggregates (fields that [`Aggregates::results`] appends).
    pub fn len(&self) -> usize {
        self.specs.len()
    }

    /// Whether there is no aggregate.
    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    /// Fresh accumulators.
    pub fn init(&self) -> Accs {
        self.specs.iter().map(|(k, _)| Acc::fresh(*k)).collect()
    }

    /// Adds one record.
    #[inline]
    pub fn add(&self, accs: &mut [Acc], record: &Record) {
        for (acc, (_, field)) in accs.iter_mut().zip(&self.specs) {
            acc.add(field.map(|i| &record.fields[i]));
        }
    }

    /// Folds `from` into `into` (accumulators of the same aggregates): the result is what
    /// adding both inputs' records to one accumulator would give.
    pub fn merge(into: &mut Accs, from: &Accs) {
        for (a, b) in into.iter_mut().zip(from.iter()) {
            match (a, b) {
                (Acc::Count(x), Acc::Count(y)) => *x += y,
                (Acc::SumInt(x), Acc::SumInt(y)) => *x = x.wrapping_add(*y),
                (a @ Acc::SumInt(_), Acc::SumFloat(y)) => {
                    let Acc::SumInt(x) = *a else { unreachable!() };
                    *a = Acc::SumFloat(x as f64 + y)
                }
                (Acc::SumFloat(x), Acc::SumInt(y)) => *x += *y as f64,
                (Acc::SumFloat(x), Acc::SumFloat(y)) => *x += y,
                (Acc::Min(x), Acc::Min(y))
                    if !matches!(y, Value::Null) && (matches!(x, Value::Null) || y.cmp_total(x).is_lt()) =>
                {
                    *x = y.clone();
                }
                (Acc::Max(x), Acc::Max(y))
                    if !matches!(y, Value::Null) && (matches!(x, Value::Null) || y.cmp_total(x).is_gt()) =>
                {
                    *x = y.clone();
                }
                (Acc::Avg(s, n), Acc::Avg(t, m)) => {
                    *s += t;
                    *n += m;
                }
                _ => {}
            }
        }
    }

    /// The output values.
    pub fn results(accs: &[Acc], out: &mut Fields) {
        for acc in accs {
            out.push(match acc {
                Acc::Count(n) => Value::Int(*n),
                Acc::SumInt(s) => Value::Int(*s),
                Acc::SumFloat(s) => Value::Float(*s),
                Acc::Min(v) | Acc::Max(v) => v.clone(),
                Acc::Avg(_, 0) => Value::Null,
                Acc::Avg(s, n) => Value::Float(*s / *n as f64),
            });
        }
    }
}

impl Acc {
    /// A fresh accumulator of `kind`.
    pub fn fresh(kind: AggregateKind) -> Acc {
        match kind {
            AggregateKind::Count => Acc::Count(0),
            AggregateKind::Sum => Acc::SumInt(0),
            AggregateKind::Min => Acc::Min(Value::Null),
            AggregateKind::Max => Acc::Max(Value::Null),
            AggregateKind::Avg => Acc::Avg(0.0, 0),
        }
    }

    /// Adds one record's value of the aggregate's field (`None`: it has no field).
    #[inline]
    pub fn add(&mut self, v: Option<&Value>) {
        match self {
            Acc::Count(n) => *n += 1,
            Acc::SumInt(s) => {
                let mut num = Num::SumInt(*s);
                num.add(v);
                *self = num.acc();
            }
            Acc::SumFloat(s) => {
                let mut num = Num::SumFloat(*s);
                num.add(v);
                *self = num.acc();
            }
            Acc::Min(m) => {
                if let Some(x) = v {
                    if !matches!(x, Value::Null) && (matches!(m, Value::Null) || x.cmp_total(m).is_lt()) {
                        *m = x.clone();
                    }
                }
            }
            Acc::Max(m) => {
                if let Some(x) = v {
                    if !matches!(x, Value::Null) && (matches!(m, Value::Null) || x.cmp_total(m).is_gt()) {
                        *m = x.clone();
                    }
                }
            }
            Acc::Avg(s, n) => {
                if let Some(x) = v.and_then(Value::as_f64) {
                    *s += x;
                    *n += 1;
                }
            }
        }
    }

    /// Binary encoding.
    pub fn encode(&self, e: &mut Encoder) {
        match self {
            Acc::Count(n) => {
                e.u8(0);
                e.svarint(*n)
            }
            Acc::SumInt(s) => {
                e.u8(1);
                e.svarint(*s)
            }
            Acc::SumFloat(s) => {
                e.u8(2);
                e.f64(*s)
            }
            Acc::Min(v) => {
                e.u8(3);
                v.encode(e)
            }
            Acc::Max(v) => {
                e.u8(4);
                v.encode(e)
            }
            Acc::Avg(s, n) => {
                e.u8(5);
                e.f64(*s);
                e.svarint(*n)
            }
        }
    }

    /// Reads what [`Acc::encode`] wrote (inlined, as [`Value::decode`] is).
    #[inline(always)]
    pub fn decode(d: &mut Decoder<'_>) -> Result<Acc, FormatError> {
        Ok(match d.u8()? {
            0 => Acc::Count(d.svarint()?),
            1 => Acc::SumInt(d.svarint()?),
            2 => Acc::SumFloat(d.f64()?),
            3 => Acc::Min(Value::decode(d)?),
            4 => Acc::Max(Value::decode(d)?),
            5 => Acc::Avg(d.f64()?, d.svarint()?),
            _ => return Err(FormatError::Malformed(d.position())),
        })
    }
}

/// Accumulators of one key (running aggregate state).
#[derive(Clone, Debug, PartialEq)]
pub struct AccList(pub Accs);

impl AccList {
    /// [`StateValue::decode`] of `n` accumulators other than one, after their count.
    #[inline(never)]
    fn decode_many(d: &mut Decoder<'_>, n: u64) -> Result<Self, FormatError> {
        Ok(AccList((0..n).map(|_| Acc::decode(d)).collect::<Result<Vec<_>, _>>()?.into()))
    }
}

impl StateValue for AccList {
    type Slot = Slot<Self>;

    fn encode(&self, e: &mut Encoder) {
        e.varint(self.0.len() as u64);
        for a in self.0.iter() {
            a.encode(e);
        }
    }

    /// Two or more accumulators are a heap slice: the first word of its first and of its last
    /// accumulator (the slice is aligned to 16 bytes, so two may straddle a cache line).
    #[inline]
    fn touch_outside(&self) -> usize {
        fn word(acc: &Acc) -> usize {
            match acc {
                Acc::Count(n) | Acc::SumInt(n) => *n as usize,
                _ => 1,
            }
        }
        match (self.0.first(), self.0.last()) {
            (Some(first), Some(last)) if self.0.spilled() => word(first).wrapping_add(word(last)),
            _ => 0,
        }
    }

    /// One accumulator (a running count's) is decoded without a `Vec` to hold it: a restore
    /// decodes one per entry, and an allocation and a free each were 5% of a heap restore's
    /// CPU time (`perf`, 20M keys).
    #[inline(always)]
    fn decode(d: &mut Decoder<'_>) -> Result<Self, FormatError> {
        match d.varint()? {
            1 => Ok(AccList(Accs::One(Acc::decode(d)?))),
            n => Self::decode_many(d, n),
        }
    }
}

/// The accumulators of a running aggregate as its operator's state holds them per key: a list
/// of any aggregates ([`AccList`]), or one or two counts or sums inline ([`AccNums`]). Both
/// encode the same way, so state written by one restores on the other.
pub trait AccState: StateValue {
    /// Fresh accumulators of `aggregates`.
    fn init(aggregates: &Aggregates) -> Self;
    /// Adds one record.
    fn add(&mut self, aggregates: &Aggregates, record: &Record);
    /// Appends the output values.
    fn results(&self, out: &mut Fields);
}

impl AccState for AccList {
    #[inline]
    fn init(aggregates: &Aggregates) -> Self {
        AccList(aggregates.init())
    }

    #[inline]
    fn add(&mut self, aggregates: &Aggregates, record: &Record) {
        aggregates.add(&mut self.0, record)
    }

    #[inline]
    fn results(&self, out: &mut Fields) {
        Aggregates::results(&self.0, out)
    }
}

/// A count or a sum: an accumulator that [`AccNums`] hold inline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Num {
    /// Record count.
    Count(i64),
    /// Integer sum (promoted to float when a float arrives).
    SumInt(i64),
    /// Float sum.
    SumFloat(f64),
}

impl Num {
    /// The accumulator as an [`Acc`].
    fn acc(self) -> Acc {
        match self {
            Num::Count(n) => Acc::Count(n),
            Num::SumInt(s) => Acc::SumInt(s),
            Num::SumFloat(s) => Acc::SumFloat(s),
        }
    }

    /// Adds a record whose aggregated field is `v` ([`Acc::add`]): a count counts it, an
    /// integer sum adds an integer and turns into a float sum at the first float, a float sum
    /// adds any number; a sum skips anything else.
    #[inline]
    pub fn add(&mut self, v: Option<&Value>) {
        match self {
            Num::Count(n) => *n += 1,
            Num::SumInt(s) => match v {
                Some(Value::Int(i)) => *s = s.wrapping_add(*i),
                Some(Value::Float(f)) => *self = Num::SumFloat(*s as f64 + f),
                _ => {}
            },
            Num::SumFloat(s) => {
                if let Some(x) = v.and_then(Value::as_f64) {
                    *s += x
                }
            }
        }
    }

    /// An [`Acc`] that is a count or a sum.
    #[inline(always)]
    fn of(acc: Acc) -> Option<Num> {
        match acc {
            Acc::Count(n) => Some(Num::Count(n)),
            Acc::SumInt(s) => Some(Num::SumInt(s)),
            Acc::SumFloat(s) => Some(Num::SumFloat(s)),
            Acc::Min(_) | Acc::Max(_) | Acc::Avg(..) => None,
        }
    }
}

/// `N` accumulators, each a count or a sum, held in the map's entry instead of an [`AccList`]:
/// encoded as an [`AccList`] of the same accumulators, so state written by one restores on the
/// other.
///
/// - Two ([`AccPair`], 32 bytes): a list of two is a heap slice, and a running count and sum
///   per key (the CEL pipeline's `counts`) read that slice on every record: a second cache
///   miss per record, which was 63% of the lookups' time (`perf`).
/// - One ([`AccOne`], 16 bytes): a list holds one accumulator inline, but as an [`Acc`] of 32
///   bytes (its minimum and maximum are values). A running sum's map entry (key, value and
///   the slot's flags) is 48 bytes with it instead of 64: a quarter less memory to fill on a
///   restore and to miss in the caches on every record (`runtime/BENCHMARKS.md`). A count
///   alone is held in 8 ([`AccCount`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AccNums<const N: usize>(pub [Num; N]);

/// One count or sum held inline ([`AccNums`]).
pub type AccOne = AccNums<1>;

/// Two counts or sums held inline ([`AccNums`]).
pub type AccPair = AccNums<2>;

impl<const N: usize> AccNums<N> {
    /// Whether an `AccNums<N>` holds the accumulators of `specs`: `N`, each a count or a sum.
    pub fn holds(specs: &[AggregateFn]) -> bool {
        specs.len() == N && specs.iter().all(|a| matches!(a.function, AggregateKind::Count | AggregateKind::Sum))
    }
}

impl<const N: usize> StateValue for AccNums<N> {
    type Slot = Slot<Self>;

    fn encode(&self, e: &mut Encoder) {
        e.varint(N as u64);
        for n in self.0 {
            n.acc().encode(e);
        }
    }

    /// Reads an [`AccList`] of `N` counts or sums; another list is malformed here (the job's
    /// aggregates are not the ones its state was written by).
    #[inline(always)]
    fn decode(d: &mut Decoder<'_>) -> Result<Self, FormatError> {
        if d.varint()? != N as u64 {
            return Err(FormatError::Malformed(d.position()));
        }
        let mut nums = [Num::Count(0); N];
        for num in &mut nums {
            *num = Num::of(Acc::decode(d)?).ok_or(FormatError::Malformed(d.position()))?;
        }
        Ok(AccNums(nums))
    }
}

/// Added to by [`Num::add`], which holds a count's and a sum's logic for [`Acc`] too.
impl<const N: usize> AccState for AccNums<N> {
    fn init(aggregates: &Aggregates) -> Self {
        debug_assert!(aggregates.len() == N, "AccNums::holds the aggregates");
        AccNums(std::array::from_fn(|i| {
            aggregates.specs.get(i).and_then(|(kind, _)| Num::of(Acc::fresh(*kind))).unwrap_or(Num::Count(0))
        }))
    }

    #[inline(always)]
    fn add(&mut self, aggregates: &Aggregates, record: &Record) {
        for (num, (_, field)) in self.0.iter_mut().zip(&aggregates.specs) {
            num.add(field.map(|i| &record.fields[i]));
        }
    }

    #[inline]
    fn results(&self, out: &mut Fields) {
        for num in self.0 {
            out.push(match num {
                Num::Count(n) | Num::SumInt(n) => Value::Int(n),
                Num::SumFloat(s) => Value::Float(s),
            });
        }
    }
}

/// A single count held in the map's entry as the integer alone: encoded as an [`AccList`] of one
/// count, so state written by it restores on an [`AccOne`] or a list and the other way round.
/// The keyed count's entry is 40 bytes with it instead of 48 with an [`AccOne`], whose tag
/// (count, integer sum or float sum) pads it to 16 bytes (`runtime/BENCHMARKS.md`, session 39).
///
/// The count takes the low 61 bits of the integer; the top three hold the state's flags of
/// its entry ([`SpareBits`], [`crate::state::slot::FlagsInside`]), so that the entry of an
/// integer key and its count is 16 bytes, without a slot beside the value: a restore faults
/// in and fills a third less table (session 49). A count stops at [`AccCount::MAX`], 2^61 - 1
/// (2.3 quintillion records of one key: 73 years at a billion a second).
#[derive(Clone, Copy)]
pub struct AccCount(i64);

/// The bits of an [`AccCount`]'s integer that hold the count.
const COUNT_BITS: i64 = AccCount::MAX;

/// Where an [`AccCount`]'s flag bits start.
const COUNT_FLAGS_SHIFT: u32 = 61;

impl AccCount {
    /// The largest count held; counting on from it stays there.
    pub const MAX: i64 = (1 << COUNT_FLAGS_SHIFT) - 1;

    /// A count of `n` (0 to [`AccCount::MAX`]; beyond, [`AccCount::MAX`]; below, 0).
    pub fn new(n: i64) -> Self {
        AccCount(n.clamp(0, Self::MAX))
    }

    /// The count.
    #[inline(always)]
    pub fn count(&self) -> i64 {
        self.0 & COUNT_BITS
    }

    /// Whether an `AccCount` holds the accumulators of `specs`: a single count.
    pub fn holds(specs: &[AggregateFn]) -> bool {
        matches!(specs, [only] if only.function == AggregateKind::Count)
    }
}

impl PartialEq for AccCount {
    /// Counts are equal, whatever flags their entries hold in them.
    fn eq(&self, other: &Self) -> bool {
        self.count() == other.count()
    }
}

impl std::fmt::Debug for AccCount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AccCount").field(&self.count()).finish()
    }
}

impl SpareBits for AccCount {
    #[inline(always)]
    fn spare_bits(&self) -> u8 {
        ((self.0 as u64) >> COUNT_FLAGS_SHIFT) as u8
    }

    #[inline(always)]
    fn set_spare_bits(&mut self, bits: u8) {
        self.0 = self.count() | ((u64::from(bits & 7) << COUNT_FLAGS_SHIFT) as i64);
    }
}

impl StateValue for AccCount {
    type Slot = FlagsInside<Self>;

    fn encode(&self, e: &mut Encoder) {
        AccNums([Num::Count(self.count())]).encode(e)
    }

    /// Reads an [`AccList`] of one count ([`Acc::encode`] of an [`Acc::Count`] after the list's
    /// length, read here without making an [`Acc`]: a restore of the keyed count decodes one
    /// per entry); another list, or a count outside 0 to [`AccCount::MAX`], is malformed here.
    #[inline(always)]
    fn decode(d: &mut Decoder<'_>) -> Result<Self, FormatError> {
        const COUNT_TAG: u8 = 0;
        if d.varint()? != 1 || d.u8()? != COUNT_TAG {
            return Err(FormatError::Malformed(d.position()));
        }
        match d.svarint()? {
            n if (0..=Self::MAX).contains(&n) => Ok(AccCount(n)),
            _ => Err(FormatError::Malformed(d.position())),
        }
    }
}

impl AccState for AccCount {
    fn init(aggregates: &Aggregates) -> Self {
        debug_assert!(aggregates.len() == 1, "AccCount::holds the aggregates");
        AccCount(0)
    }

    /// One more, up to [`AccCount::MAX`] (the flag bits above it untouched).
    #[inline(always)]
    fn add(&mut self, _: &Aggregates, _: &Record) {
        if self.count() != Self::MAX {
            self.0 += 1;
        }
    }

    #[inline]
    fn results(&self, out: &mut Fields) {
        out.push(Value::Int(self.count()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// None, one and several accumulators come back from their encoding as they were; one is
    /// held inline, the others in a slice.
    #[test]
    fn accumulator_lists_round_trip_and_one_is_inline() {
        assert_eq!(std::mem::size_of::<Accs>(), 32);
        let lists: [Vec<Acc>; 3] = [
            vec![],
            vec![Acc::Count(7)],
            vec![Acc::SumFloat(1.5), Acc::Min(Value::str("a string of more than 23 bytes")), Acc::Avg(2.0, 3)],
        ];
        for list in lists {
            let accs = AccList(Accs::from(list.clone()));
            assert_eq!(accs.0.spilled(), list.len() > 1, "{list:?}");
            assert_eq!(&*accs.0, list.as_slice());
            let mut e = Encoder::default();
            accs.encode(&mut e);
            assert_eq!(AccList::decode(&mut Decoder::new(&e.buf)).unwrap(), accs);
            assert_eq!(list.iter().cloned().collect::<Accs>(), accs.0);
        }
    }

    /// `N` counts or sums held inline give what the same accumulators in a list give, record
    /// after record (integers, floats that promote a sum, fields missing), and their state is
    /// the same bytes: written by one, read by the other.
    fn held_inline_as_a_list_does<const N: usize>(specs: &[AggregateFn]) {
        assert!(AccNums::<N>::holds(specs), "{specs:?}");
        aggregates_and_encodes_as_a_list_does::<AccNums<N>>(specs);
    }

    /// `V` gives what a list of the accumulators of `specs` gives, record after record
    /// (integers, floats that promote a sum, fields missing), and its state is the same bytes.
    fn aggregates_and_encodes_as_a_list_does<V: AccState + PartialEq + std::fmt::Debug>(specs: &[AggregateFn]) {
        let input = ["x".to_string(), "y".to_string()];
        let a = Aggregates::new(specs, &input);
        let (mut nums, mut list) = (V::init(&a), AccList::init(&a));
        for i in 0..40i64 {
            let x = if i == 17 { Value::Float(0.25) } else { Value::Int(i * 3 - 50) };
            let y = if i % 5 == 0 { Value::Null } else { Value::Int(i) };
            let r = Record { time: i, fields: smallvec::smallvec![x, y] };
            nums.add(&a, &r);
            list.add(&a, &r);
            let (mut p, mut l) = (Fields::new(), Fields::new());
            nums.results(&mut p);
            list.results(&mut l);
            assert_eq!(p, l, "{specs:?}, record {i}");
            let (mut pe, mut le) = (Encoder::default(), Encoder::default());
            nums.encode(&mut pe);
            list.encode(&mut le);
            assert_eq!(pe.buf, le.buf);
            assert_eq!(V::decode(&mut Decoder::new(&le.buf)).unwrap(), nums);
            assert_eq!(AccList::decode(&mut Decoder::new(&pe.buf)).unwrap(), list);
        }
    }

    fn spec(function: AggregateKind, field: Option<&str>) -> AggregateFn {
        AggregateFn { function, field: field.map(str::to_string), output: "o".into() }
    }

    /// One or two counts or sums held inline ([`AccOne`], [`AccPair`]) aggregate and encode as
    /// a list of them does, in less memory than a list; other accumulators are not theirs, and
    /// a list of others is malformed state for them.
    #[test]
    fn counts_and_sums_held_inline_aggregate_and_encode_as_a_list_does() {
        assert_eq!(std::mem::size_of::<AccOne>(), 16);
        assert!(std::mem::size_of::<AccPair>() <= 32);
        for specs in [
            vec![spec(AggregateKind::Count, None), spec(AggregateKind::Sum, Some("x"))],
            vec![spec(AggregateKind::Sum, Some("y")), spec(AggregateKind::Sum, Some("x"))],
            vec![spec(AggregateKind::Sum, Some("missing")), spec(AggregateKind::Count, None)],
        ] {
            held_inline_as_a_list_does::<2>(&specs);
        }
        for specs in [
            vec![spec(AggregateKind::Count, None)],
            vec![spec(AggregateKind::Sum, Some("x"))],
            vec![spec(AggregateKind::Sum, Some("missing"))],
        ] {
            held_inline_as_a_list_does::<1>(&specs);
        }
        assert!(!AccPair::holds(&[spec(AggregateKind::Count, None)]));
        assert!(!AccPair::holds(&[spec(AggregateKind::Count, None), spec(AggregateKind::Min, Some("x"))]));
        assert!(!AccOne::holds(&[spec(AggregateKind::Avg, Some("x"))]));
        assert!(!AccOne::holds(&[spec(AggregateKind::Count, None), spec(AggregateKind::Count, None)]));
        // A list of other accumulators is not their state.
        for other in [vec![Acc::Count(1), Acc::Avg(1.0, 1)], vec![Acc::Count(1); 3], vec![Acc::Max(Value::Int(1))]] {
            let mut e = Encoder::default();
            AccList(Accs::from(other.clone())).encode(&mut e);
            assert!(AccPair::decode(&mut Decoder::new(&e.buf)).is_err(), "{other:?}");
            assert!(AccOne::decode(&mut Decoder::new(&e.buf)).is_err(), "{other:?}");
        }
        let mut e = Encoder::default();
        AccList(Accs::from(vec![Acc::Count(1)])).encode(&mut e);
        assert!(AccPair::decode(&mut Decoder::new(&e.buf)).is_err());
    }

    /// A count alone held as its integer ([`AccCount`], 8 bytes) counts and encodes as a list
    /// of one count and as an [`AccOne`] do, and reads what they write; a sum, or a count
    /// among others, is not its state.
    #[test]
    fn a_count_alone_is_held_as_its_integer_and_encodes_as_a_list_does() {
        assert_eq!(std::mem::size_of::<AccCount>(), 8);
        let count = [spec(AggregateKind::Count, None)];
        assert!(AccCount::holds(&count));
        aggregates_and_encodes_as_a_list_does::<AccCount>(&count);
        let a = Aggregates::new(&count, &[]);
        let mut alone = AccCount::init(&a);
        for i in 0..300i64 {
            alone.add(&a, &Record { time: i, fields: smallvec::smallvec![Value::Int(i)] });
        }
        let mut ae = Encoder::default();
        alone.encode(&mut ae);
        assert_eq!(AccOne::decode(&mut Decoder::new(&ae.buf)).unwrap(), AccNums([Num::Count(300)]));
        for other in [
            vec![spec(AggregateKind::Sum, Some("x"))],
            vec![spec(AggregateKind::Count, None), spec(AggregateKind::Count, None)],
            vec![],
        ] {
            assert!(!AccCount::holds(&other), "{other:?}");
        }
        for other in [vec![Acc::SumInt(3)], vec![Acc::Count(1), Acc::Count(2)], vec![Acc::Min(Value::Int(1))]] {
            let mut e = Encoder::default();
            AccList(Accs::from(other.clone())).encode(&mut e);
            assert!(AccCount::decode(&mut Decoder::new(&e.buf)).is_err(), "{other:?}");
        }
    }

    /// A count lends its top three bits to its entry's flags: it counts up to
    /// [`AccCount::MAX`] and stays there, and whatever the flags, it reads, encodes and gives
    /// the same count and the flags stay as they were set. A file saying a count beyond the
    /// maximum, or below 0, does not restore as one (it reads as an [`AccOne`]).
    #[test]
    fn a_count_keeps_its_entry_flags_apart_and_stops_at_its_maximum() {
        use crate::state::slot::SpareBits;
        let count = [spec(AggregateKind::Count, None)];
        let a = Aggregates::new(&count, &[]);
        let record = Record { time: 0, fields: smallvec::smallvec![Value::Int(1)] };
        for flags in 0..8u8 {
            let mut c = AccCount::new(AccCount::MAX - 2);
            c.set_spare_bits(flags);
            for _ in 0..5 {
                c.add(&a, &record);
            }
            assert_eq!((c.count(), c.spare_bits()), (AccCount::MAX, flags));
            let mut results = Fields::new();
            c.results(&mut results);
            assert_eq!(results.as_slice(), &[Value::Int(AccCount::MAX)]);
            let mut e = Encoder::default();
            c.encode(&mut e);
            let read = AccCount::decode(&mut Decoder::new(&e.buf)).unwrap();
            assert_eq!((read.count(), read.spare_bits()), (AccCount::MAX, 0), "flags {flags}");
        }
        for beyond in [AccCount::MAX + 1, i64::MAX, -1] {
            let mut e = Encoder::default();
            AccNums([Num::Count(beyond)]).encode(&mut e);
            assert!(AccCount::decode(&mut Decoder::new(&e.buf)).is_err(), "{beyond}");
            assert_eq!(AccOne::decode(&mut Decoder::new(&e.buf)).unwrap(), AccNums([Num::Count(beyond)]));
        }
    }

    #[test]
    fn all_functions() {
        let specs: Vec<AggregateFn> = [
            (AggregateKind::Count, None),
            (AggregateKind::Sum, Some("x")),
            (AggregateKind::Min, Some("x")),
            (AggregateKind::Max, Some("x")),
            (AggregateKind::Avg, Some("x")),
        ]
        .into_iter()
        .enumerate()
        .map(|(i, (function, field))| AggregateFn {
            function,
            field: field.map(str::to_string),
            output: format!("o{i}"),
        })
        .collect();
        let a = Aggregates::new(&specs, &["x".to_string()]);
        let mut accs = a.init();
        for x in [3, -1, 10] {
            a.add(&mut accs, &Record { time: 0, fields: smallvec::smallvec![Value::Int(x)] });
        }
        let mut out = Fields::new();
        Aggregates::results(&accs, &mut out);
        assert_eq!(out.as_slice(), [Value::Int(3), Value::Int(12), Value::Int(-1), Value::Int(10), Value::Float(4.0)]);
        a.add(&mut accs, &Record { time: 0, fields: smallvec::smallvec![Value::Float(0.5)] });
        let mut out = Fields::new();
        Aggregates::results(&accs, &mut out);
        assert_eq!(out[1], Value::Float(12.5), "sum promotes to float");
        // Merging two halves equals aggregating everything at once.
        let mut left = a.init();
        let mut right = a.init();
        for (i, x) in [3i64, -1, 10].into_iter().enumerate() {
            a.add(
                if i % 2 == 0 { &mut left } else { &mut right },
                &Record { time: 0, fields: smallvec::smallvec![Value::Int(x)] },
            );
        }
        a.add(&mut right, &Record { time: 0, fields: smallvec::smallvec![Value::Float(0.5)] });
        Aggregates::merge(&mut left, &right);
        assert_eq!(left, accs);
        let mut e = Encoder::default();
        AccList(accs.clone()).encode(&mut e);
        assert_eq!(AccList::decode(&mut Decoder::new(&e.buf)).unwrap().0, accs);
    }
}
