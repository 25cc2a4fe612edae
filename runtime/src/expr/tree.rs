//! The record path of CEL: a compiled expression lowered once into a tree of typed nodes
//! over the record's field positions, evaluated without building a CEL context per record.
//!
//! It covers what jobs write on their hot paths: literals, fields, list literals, arithmetic,
//! comparisons, `&&`, `||`, `!`, `?:`, `in`, indexing, `size`, `int`, `double`, `string`,
//! `contains`, `startsWith`, `endsWith`, `lowerAscii`, `upperAscii`, `trim` and `split`.
//! Anything else (macros such as `exists`, maps, other functions) is not lowered, and the
//! expression runs on the `cel` interpreter as before. Where the two could differ, the tree
//! does not guess: a type mix it does not handle the same way for certain, an overflow, a
//! division by zero or any other error yields [`Fallback`], and the caller asks the interpreter,
//! so results and error messages are the interpreter's. A differential test checks that the
//! tree, when it answers, answers as the interpreter does.

use cel::common::ast::{operators, Expr as Ast, IdedExpr, LiteralValue};
use smol_str::{SmolStr, StrExt};

use crate::value::{Record, Value};

/// The tree cannot answer for this record: evaluate with the interpreter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fallback;

/// A value during evaluation.
#[derive(Clone, Debug)]
pub enum V {
    /// `null`.
    Null,
    /// A bool.
    Bool(bool),
    /// A signed integer.
    Int(i64),
    /// A double.
    Float(f64),
    /// A string (field strings are shared, not copied).
    Str(SmolStr),
    /// A list.
    List(Vec<V>),
}

impl V {
    fn of(v: &Value) -> V {
        match v {
            Value::Null => V::Null,
            Value::Bool(b) => V::Bool(*b),
            Value::Int(i) => V::Int(*i),
            Value::Float(f) => V::Float(*f),
            Value::Str(s) => V::Str(s.clone()),
        }
    }

    /// As a record field, if it is a scalar.
    pub fn into_value(self) -> Option<Value> {
        Some(match self {
            V::Null => Value::Null,
            V::Bool(b) => Value::Bool(b),
            V::Int(i) => Value::Int(i),
            V::Float(f) => Value::Float(f),
            V::Str(s) => Value::Str(s),
            V::List(_) => return None,
        })
    }
}

/// Binary operators with both operands evaluated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    /// `+`: numbers, strings, lists.
    Add,
    /// `-`.
    Sub,
    /// `*`.
    Mul,
    /// `/`.
    Div,
    /// `%` (integers).
    Rem,
    /// `==`.
    Eq,
    /// `!=`.
    Ne,
    /// `<`.
    Lt,
    /// `<=`.
    Le,
    /// `>`.
    Gt,
    /// `>=`.
    Ge,
}

/// Functions of one string receiver and one string argument, giving a bool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StrTest {
    /// `s.contains(t)`.
    Contains,
    /// `s.startsWith(t)`.
    StartsWith,
    /// `s.endsWith(t)`.
    EndsWith,
}

/// Functions of one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unary {
    /// `!b`.
    Not,
    /// `-x`.
    Neg,
    /// `size(x)`, `x.size()`: code points of a string, elements of a list.
    Size,
    /// `int(x)`.
    ToInt,
    /// `double(x)`.
    ToDouble,
    /// `string(x)`.
    ToString,
    /// `s.lowerAscii()`.
    Lower,
    /// `s.upperAscii()`.
    Upper,
    /// `s.trim()`.
    Trim,
}

/// A lowered expression.
#[derive(Clone, Debug)]
pub enum Node {
    /// The record's field at this position.
    Field(usize),
    /// A constant.
    Lit(V),
    /// A list literal.
    List(Vec<Node>),
    /// `a && b`.
    And(Box<Node>, Box<Node>),
    /// `a || b`.
    Or(Box<Node>, Box<Node>),
    /// `c ? a : b`.
    Cond(Box<Node>, Box<Node>, Box<Node>),
    /// Arithmetic and comparisons.
    Bin(BinOp, Box<Node>, Box<Node>),
    /// A function of one value.
    Unary(Unary, Box<Node>),
    /// `s.contains(t)` and friends.
    StrTest(StrTest, Box<Node>, Box<Node>),
    /// `s.split(sep)`.
    Split(Box<Node>, Box<Node>),
    /// `x in list`.
    In(Box<Node>, Box<Node>),
    /// `list[i]`.
    Index(Box<Node>, Box<Node>),
}

/// Lowers a parsed expression whose variables are the fields named in `inputs`
/// (`(position, name)`); `None` when it uses anything the tree does not cover.
pub fn lower(e: &IdedExpr, inputs: &[(usize, String)]) -> Option<Node> {
    let b = |e: &IdedExpr| lower(e, inputs).map(Box::new);
    Some(match &e.expr {
        Ast::Ident(name) => Node::Field(inputs.iter().find(|(_, n)| n == name)?.0),
        Ast::Literal(l) => Node::Lit(match l {
            LiteralValue::Boolean(v) => V::Bool(*v.inner()),
            LiteralValue::Int(v) => V::Int(*v.inner()),
            LiteralValue::Double(v) => V::Float(*v.inner()),
            LiteralValue::String(v) => V::Str(SmolStr::new(v.inner())),
            LiteralValue::Null => V::Null,
            LiteralValue::Bytes(_) | LiteralValue::UInt(_) => return None,
        }),
        Ast::List(l) if l.optional_indices.is_empty() => {
            Node::List(l.elements.iter().map(|e| lower(e, inputs)).collect::<Option<_>>()?)
        }
        Ast::Call(call) => {
            let args = &call.args;
            match (call.target.as_deref(), call.func_name.as_str(), args.as_slice()) {
                (None, operators::LOGICAL_AND, [l, r]) => Node::And(b(l)?, b(r)?),
                (None, operators::LOGICAL_OR, [l, r]) => Node::Or(b(l)?, b(r)?),
                (None, operators::CONDITIONAL, [c, t, f]) => Node::Cond(b(c)?, b(t)?, b(f)?),
                (None, operators::LOGICAL_NOT, [x]) => Node::Unary(Unary::Not, b(x)?),
                (None, operators::NEGATE, [x]) => Node::Unary(Unary::Neg, b(x)?),
                (None, operators::IN, [x, list]) => Node::In(b(x)?, b(list)?),
                (None, operators::INDEX, [list, i]) => Node::Index(b(list)?, b(i)?),
                (None, op, [l, r]) if bin_op(op).is_some() => Node::Bin(bin_op(op)?, b(l)?, b(r)?),
                (None, "size", [x]) | (Some(x), "size", []) => Node::Unary(Unary::Size, b(x)?),
                (None, "int", [x]) => Node::Unary(Unary::ToInt, b(x)?),
                (None, "double", [x]) => Node::Unary(Unary::ToDouble, b(x)?),
                (None, "string", [x]) => Node::Unary(Unary::ToString, b(x)?),
                (Some(s), "lowerAscii", []) => Node::Unary(Unary::Lower, b(s)?),
                (Some(s), "upperAscii", []) => Node::Unary(Unary::Upper, b(s)?),
                (Some(s), "trim", []) => Node::Unary(Unary::Trim, b(s)?),
                (Some(s), "contains", [t]) => Node::StrTest(StrTest::Contains, b(s)?, b(t)?),
                (Some(s), "startsWith", [t]) => Node::StrTest(StrTest::StartsWith, b(s)?, b(t)?),
                (Some(s), "endsWith", [t]) => Node::StrTest(StrTest::EndsWith, b(s)?, b(t)?),
                (Some(s), "split", [sep]) => Node::Split(b(s)?, b(sep)?),
                _ => return None,
            }
        }
        _ => return None,
    })
}

fn bin_op(name: &str) -> Option<BinOp> {
    Some(match name {
        operators::ADD => BinOp::Add,
        operators::SUBSTRACT => BinOp::Sub,
        operators::MULTIPLY => BinOp::Mul,
        operators::DIVIDE => BinOp::Div,
        operators::MODULO => BinOp::Rem,
        operators::EQUALS => BinOp::Eq,
        operators::NOT_EQUALS => BinOp::Ne,
        operators::LESS => BinOp::Lt,
        operators::LESS_EQUALS => BinOp::Le,
        operators::GREATER => BinOp::Gt,
        operators::GREATER_EQUALS => BinOp::Ge,
        _ => return None,
    })
}

type R = Result<V, Fallback>;

/// An operand as an operator reads it: a record field or a literal borrowed where it lies, or a
/// value computed for it. Comparisons, `size`, `startsWith` and friends read their operands in
/// place; only a value that ends up in the result is copied (a filter such as
/// `size(word) > 3 && !word.startsWith('x')` copies nothing).
enum Arg<'a> {
    /// A record's field.
    Field(&'a Value),
    /// A literal of the expression.
    Lit(&'a V),
    /// A computed value.
    Owned(V),
}

/// A borrowed look at a value.
#[derive(Clone, Copy)]
enum View<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(&'a str),
    List(&'a [V]),
}

impl V {
    fn view(&self) -> View<'_> {
        match self {
            V::Null => View::Null,
            V::Bool(b) => View::Bool(*b),
            V::Int(i) => View::Int(*i),
            V::Float(f) => View::Float(*f),
            V::Str(s) => View::Str(s),
            V::List(l) => View::List(l),
        }
    }
}

impl Arg<'_> {
    fn view(&self) -> View<'_> {
        match self {
            Arg::Field(v) => match v {
                Value::Null => View::Null,
                Value::Bool(b) => View::Bool(*b),
                Value::Int(i) => View::Int(*i),
                Value::Float(f) => View::Float(*f),
                Value::Str(s) => View::Str(s),
            },
            Arg::Lit(v) => v.view(),
            Arg::Owned(v) => v.view(),
        }
    }

    /// The value itself: a field's or literal's copied (strings shared), a computed one moved.
    fn into_v(self) -> V {
        match self {
            Arg::Field(v) => V::of(v),
            Arg::Lit(v) => v.clone(),
            Arg::Owned(v) => v,
        }
    }
}

impl Node {
    /// Evaluates over `record`.
    pub fn eval(&self, record: &Record) -> R {
        match self {
            Node::Field(pos) => Ok(V::of(record.fields.get(*pos).ok_or(Fallback)?)),
            Node::Lit(v) => Ok(v.clone()),
            Node::List(items) => Ok(V::List(items.iter().map(|n| n.eval(record)).collect::<Result<_, _>>()?)),
            Node::And(l, r) => match l.eval(record)? {
                V::Bool(false) => Ok(V::Bool(false)),
                V::Bool(true) => bool_of(r.eval(record)?),
                _ => Err(Fallback),
            },
            Node::Or(l, r) => match l.eval(record)? {
                V::Bool(true) => Ok(V::Bool(true)),
                V::Bool(false) => bool_of(r.eval(record)?),
                _ => Err(Fallback),
            },
            Node::Cond(c, t, f) => match c.eval(record)? {
                V::Bool(true) => t.eval(record),
                V::Bool(false) => f.eval(record),
                _ => Err(Fallback),
            },
            Node::Bin(op, l, r) => binary(*op, l.arg(record)?, r.arg(record)?),
            Node::Unary(f, x) => unary(*f, x.arg(record)?),
            Node::StrTest(t, s, arg) => str_test(*t, s.arg(record)?, arg.arg(record)?).map(V::Bool),
            Node::Split(s, sep) => split(s.arg(record)?, sep.arg(record)?, V::Str).map(V::List),
            Node::In(x, list) => contains(x.arg(record)?, list.arg(record)?).map(V::Bool),
            Node::Index(list, i) => {
                let (list, i) = (list.arg(record)?, i.arg(record)?);
                let (View::List(items), View::Int(i)) = (list.view(), i.view()) else { return Err(Fallback) };
                let i = usize::try_from(i).map_err(|_| Fallback)?;
                if i >= items.len() {
                    return Err(Fallback);
                }
                match list {
                    Arg::Owned(V::List(mut items)) => Ok(items.swap_remove(i)),
                    _ => Ok(items[i].clone()),
                }
            }
        }
    }

    /// Evaluates a node whose value must be a bool (a filter's predicate, the operands of
    /// `&&`, `||`, `!` and `?:`'s condition) without building a value for it or its bool
    /// operands: what [`Self::eval`] answers, as a bool, and [`Fallback`] where it answers
    /// anything else. A filter of two comparisons joined by `&&` took half the time.
    pub fn test(&self, record: &Record) -> Result<bool, Fallback> {
        match self {
            Node::Field(pos) => match record.fields.get(*pos) {
                Some(Value::Bool(b)) => Ok(*b),
                _ => Err(Fallback),
            },
            Node::Lit(V::Bool(b)) => Ok(*b),
            Node::And(l, r) => Ok(l.test(record)? && r.test(record)?),
            Node::Or(l, r) => Ok(l.test(record)? || r.test(record)?),
            Node::Cond(c, t, f) => {
                if c.test(record)? {
                    t.test(record)
                } else {
                    f.test(record)
                }
            }
            Node::Unary(Unary::Not, x) => Ok(!x.test(record)?),
            Node::Bin(op, l, r) if op.is_comparison() => compare(*op, l.arg(record)?, r.arg(record)?),
            Node::StrTest(t, s, arg) => str_test(*t, s.arg(record)?, arg.arg(record)?),
            Node::In(x, list) => contains(x.arg(record)?, list.arg(record)?),
            other => match other.eval(record)? {
                V::Bool(b) => Ok(b),
                _ => Err(Fallback),
            },
        }
    }

    /// Evaluates a node whose value must be a list of scalars (a `flatMap`'s) into record
    /// values: what [`Self::eval`] answers, and [`Fallback`] where it answers anything else. A
    /// split builds the values directly, not a list of tree values copied into them.
    pub fn values(&self, record: &Record) -> Result<Vec<Value>, Fallback> {
        match self {
            Node::Split(s, sep) => split(s.arg(record)?, sep.arg(record)?, Value::Str),
            other => match other.eval(record)? {
                V::List(items) => items.into_iter().map(V::into_value).collect::<Option<_>>().ok_or(Fallback),
                _ => Err(Fallback),
            },
        }
    }

    /// The operand this node gives an operator: fields and literals borrowed, the rest evaluated.
    fn arg<'a>(&'a self, record: &'a Record) -> Result<Arg<'a>, Fallback> {
        match self {
            Node::Field(pos) => Ok(Arg::Field(record.fields.get(*pos).ok_or(Fallback)?)),
            Node::Lit(v) => Ok(Arg::Lit(v)),
            other => other.eval(record).map(Arg::Owned),
        }
    }
}

fn bool_of(v: V) -> R {
    match v {
        V::Bool(b) => Ok(V::Bool(b)),
        _ => Err(Fallback),
    }
}

/// Equality of two values of the same type; other mixes are the interpreter's to judge.
fn equal(a: View<'_>, b: View<'_>) -> Result<bool, Fallback> {
    Ok(match (a, b) {
        (View::Null, View::Null) => true,
        (View::Bool(x), View::Bool(y)) => x == y,
        (View::Int(x), View::Int(y)) => x == y,
        (View::Float(x), View::Float(y)) => x == y,
        (View::Str(x), View::Str(y)) => x == y,
        (View::List(x), View::List(y)) => {
            if x.len() != y.len() {
                return Ok(false);
            }
            for (x, y) in x.iter().zip(y) {
                if !equal(x.view(), y.view())? {
                    return Ok(false);
                }
            }
            true
        }
        _ => return Err(Fallback),
    })
}

fn order(a: View<'_>, b: View<'_>) -> Result<std::cmp::Ordering, Fallback> {
    match (a, b) {
        (View::Int(x), View::Int(y)) => Ok(x.cmp(&y)),
        (View::Float(x), View::Float(y)) => x.partial_cmp(&y).ok_or(Fallback),
        (View::Str(x), View::Str(y)) => Ok(x.cmp(y)),
        (View::Bool(x), View::Bool(y)) => Ok(x.cmp(&y)),
        _ => Err(Fallback),
    }
}

impl BinOp {
    /// `==`, `!=`, `<`, `<=`, `>` or `>=`.
    fn is_comparison(self) -> bool {
        matches!(self, BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge)
    }
}

/// A comparison ([`BinOp::is_comparison`]) of two operands.
fn compare(op: BinOp, l: Arg<'_>, r: Arg<'_>) -> Result<bool, Fallback> {
    use std::cmp::Ordering::{Greater, Less};
    Ok(match op {
        BinOp::Eq => equal(l.view(), r.view())?,
        BinOp::Ne => !equal(l.view(), r.view())?,
        BinOp::Lt => order(l.view(), r.view())? == Less,
        BinOp::Le => order(l.view(), r.view())? != Greater,
        BinOp::Gt => order(l.view(), r.view())? == Greater,
        BinOp::Ge => order(l.view(), r.view())? != Less,
        _ => return Err(Fallback),
    })
}

/// `s.contains(arg)` and friends.
fn str_test(t: StrTest, s: Arg<'_>, arg: Arg<'_>) -> Result<bool, Fallback> {
    match (s.view(), arg.view()) {
        (View::Str(s), View::Str(a)) => Ok(match t {
            StrTest::Contains => s.contains(a),
            StrTest::StartsWith => s.starts_with(a),
            StrTest::EndsWith => s.ends_with(a),
        }),
        _ => Err(Fallback),
    }
}

/// `s.split(sep)`, each part made an element by `element`.
fn split<T>(s: Arg<'_>, sep: Arg<'_>, element: impl Fn(SmolStr) -> T) -> Result<Vec<T>, Fallback> {
    match (s.view(), sep.view()) {
        (View::Str(s), View::Str(sep)) if !sep.is_empty() => {
            Ok(s.split(sep).map(|p| element(SmolStr::new(p))).collect())
        }
        _ => Err(Fallback),
    }
}

/// `x in list`.
fn contains(x: Arg<'_>, list: Arg<'_>) -> Result<bool, Fallback> {
    match list.view() {
        View::List(items) => {
            for item in items {
                if equal(x.view(), item.view())? {
                    return Ok(true);
                }
            }
            Ok(false)
        }
        _ => Err(Fallback),
    }
}

fn binary(op: BinOp, l: Arg<'_>, r: Arg<'_>) -> R {
    Ok(match op {
        BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge => V::Bool(compare(op, l, r)?),
        BinOp::Add => match (l.view(), r.view()) {
            (View::Int(x), View::Int(y)) => V::Int(x.checked_add(y).ok_or(Fallback)?),
            (View::Float(x), View::Float(y)) => V::Float(x + y),
            (View::Str(x), View::Str(y)) => {
                let mut s = String::with_capacity(x.len() + y.len());
                s.push_str(x);
                s.push_str(y);
                V::Str(SmolStr::from(s))
            }
            (View::List(_), View::List(_)) => match (l.into_v(), r.into_v()) {
                (V::List(mut x), V::List(y)) => {
                    x.extend(y);
                    V::List(x)
                }
                _ => return Err(Fallback),
            },
            _ => return Err(Fallback),
        },
        BinOp::Sub | BinOp::Mul | BinOp::Div | BinOp::Rem => match (l.view(), r.view()) {
            (View::Int(x), View::Int(y)) => V::Int(
                match op {
                    BinOp::Sub => x.checked_sub(y),
                    BinOp::Mul => x.checked_mul(y),
                    BinOp::Div => x.checked_div(y),
                    _ => x.checked_rem(y),
                }
                .ok_or(Fallback)?,
            ),
            (View::Float(x), View::Float(y)) => V::Float(match op {
                BinOp::Sub => x - y,
                BinOp::Mul => x * y,
                BinOp::Div => x / y,
                _ => return Err(Fallback),
            }),
            _ => return Err(Fallback),
        },
    })
}

fn unary(f: Unary, x: Arg<'_>) -> R {
    Ok(match (f, x.view()) {
        (Unary::Not, View::Bool(b)) => V::Bool(!b),
        (Unary::Neg, View::Int(i)) => V::Int(i.checked_neg().ok_or(Fallback)?),
        (Unary::Neg, View::Float(v)) => V::Float(-v),
        (Unary::Size, View::Str(s)) => V::Int(s.chars().count() as i64),
        (Unary::Size, View::List(l)) => V::Int(l.len() as i64),
        (Unary::ToInt, View::Int(i)) => V::Int(i),
        (Unary::ToInt, View::Str(s)) => V::Int(s.parse().map_err(|_| Fallback)?),
        (Unary::ToDouble, View::Int(i)) => V::Float(i as f64),
        (Unary::ToDouble, View::Float(v)) => V::Float(v),
        (Unary::ToString, View::Str(_)) => x.into_v(),
        (Unary::ToString, View::Int(i)) => V::Str(SmolStr::from(i.to_string())),
        (Unary::ToString, View::Bool(b)) => V::Str(SmolStr::new_static(if b { "true" } else { "false" })),
        (Unary::Lower, View::Str(s)) => V::Str(s.to_ascii_lowercase_smolstr()),
        (Unary::Upper, View::Str(s)) => V::Str(s.to_ascii_uppercase_smolstr()),
        (Unary::Trim, View::Str(s)) => V::Str(SmolStr::new(s.trim())),
        _ => return Err(Fallback),
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::expr::Expr;

    const SCHEMA: [&str; 6] = ["i", "j", "s", "t", "f", "b"];

    fn schema() -> Vec<String> {
        SCHEMA.iter().map(|s| s.to_string()).collect()
    }

    /// Whether the tree's answer is the interpreter's.
    fn same(v: &V, c: &cel::Value) -> bool {
        match (v, c) {
            (V::Null, cel::Value::Null) => true,
            (V::Bool(a), cel::Value::Bool(b)) => a == b,
            (V::Int(a), cel::Value::Int(b)) => a == b,
            (V::Float(a), cel::Value::Float(b)) => a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            (V::Str(a), cel::Value::String(b)) => **a == **b,
            (V::List(a), cel::Value::List(b)) => a.len() == b.len() && a.iter().zip(b.iter()).all(|(a, b)| same(a, b)),
            _ => false,
        }
    }

    fn expr() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("i".to_string()),
            Just("j".to_string()),
            Just("s".to_string()),
            Just("t".to_string()),
            Just("f".to_string()),
            Just("b".to_string()),
            (-3i64..20).prop_map(|n| n.to_string()),
            Just("9223372036854775807".to_string()),
            prop_oneof![Just("1.5"), Just("0.0"), Just("-2.25")].prop_map(String::from),
            prop_oneof![Just("'a'"), Just("'ab'"), Just("' '"), Just("''"), Just("'é B'"), Just("'12'")]
                .prop_map(String::from),
            prop_oneof![Just("true"), Just("false"), Just("null")].prop_map(String::from),
        ];
        leaf.prop_recursive(4, 40, 3, |inner| {
            let bin = ["+", "-", "*", "/", "%", "==", "!=", "<", "<=", ">", ">=", "&&", "||", "in"];
            prop_oneof![
                (inner.clone(), proptest::sample::select(bin.to_vec()), inner.clone())
                    .prop_map(|(a, op, b)| format!("({a} {op} {b})")),
                (inner.clone(), inner.clone(), inner.clone()).prop_map(|(c, a, b)| format!("({c} ? {a} : {b})")),
                inner.clone().prop_map(|a| format!("!{a}")),
                inner.clone().prop_map(|a| format!("-{a}")),
                (inner.clone(), proptest::sample::select(vec!["size", "int", "double", "string"]))
                    .prop_map(|(a, f)| format!("{f}({a})")),
                (inner.clone(), proptest::sample::select(vec!["size()", "lowerAscii()", "upperAscii()", "trim()"]))
                    .prop_map(|(a, m)| format!("{a}.{m}")),
                (
                    inner.clone(),
                    proptest::sample::select(vec!["contains", "startsWith", "endsWith", "split"]),
                    inner.clone()
                )
                    .prop_map(|(a, m, b)| format!("{a}.{m}({b})")),
                (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("[{a}, {b}]")),
                (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("{a}[{b}]")),
            ]
        })
    }

    fn record() -> impl Strategy<Value = Record> {
        let int = prop_oneof![-5i64..30, Just(i64::MAX), Just(i64::MIN), Just(0)];
        let s = proptest::sample::select(vec!["", "a", "ab", "A b", " x ", "é", "12", "a,b,,c"]);
        let f = proptest::sample::select(vec![0.0, -1.5, 2.25, 1e300, f64::NAN, f64::INFINITY]);
        (int.clone(), int, s.clone(), s, f, any::<bool>()).prop_map(|(i, j, s, t, f, b)| Record {
            time: 0,
            fields: smallvec::smallvec![
                Value::Int(i),
                Value::Int(j),
                Value::str(s),
                Value::str(t),
                Value::Float(f),
                Value::Bool(b)
            ],
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

        /// Wherever the tree answers, the interpreter gives the same value.
        #[test]
        fn the_tree_answers_as_the_interpreter(text in expr(), records in proptest::collection::vec(record(), 1..4)) {
            let Ok(e) = Expr::compile(&text, &schema()) else { return Ok(()) };
            let Some(tree) = &e.tree else { return Ok(()) };
            for r in &records {
                if let Ok(v) = tree.eval(r) {
                    let c = e.eval(r);
                    prop_assert!(
                        matches!(&c, Ok(c) if same(&v, c)),
                        "`{}` on {:?}: tree {:?}, interpreter {:?}", text, r.fields, v, c
                    );
                }
                // A predicate's answer is the bool the tree's value is, and none where the
                // tree has no bool.
                let tested = tree.test(r).ok();
                let valued = match tree.eval(r) {
                    Ok(V::Bool(b)) => Some(b),
                    _ => None,
                };
                prop_assert_eq!(tested, valued, "`{}` on {:?}", text, r.fields);
                // A list's elements as record values are the tree's, and there are none where
                // the tree has no list of scalars.
                let listed = tree.values(r).ok();
                let elements = match tree.eval(r) {
                    Ok(V::List(items)) => items.into_iter().map(V::into_value).collect::<Option<Vec<_>>>(),
                    _ => None,
                };
                prop_assert_eq!(listed, elements, "`{}` on {:?}", text, r.fields);
            }
        }
    }

    #[test]
    fn the_hot_paths_of_jobs_are_lowered_and_the_rest_is_not() {
        for text in
            ["s.split(' ')", "s.lowerAscii() + '-' + string(i * 2)", "i > 10 && s.startsWith('a')", "s in ['a', 'b']"]
        {
            assert!(Expr::compile(text, &schema()).unwrap().is_lowered(), "{text}");
        }
        for text in ["[1, 2].exists(x, x > i)", "s.matches('a+')", "{'a': 1}['a']", "1u + 2u"] {
            assert!(!Expr::compile(text, &schema()).unwrap().is_lowered(), "{text}");
        }
    }

    #[test]
    fn errors_and_unhandled_mixes_are_left_to_the_interpreter() {
        let e = Expr::compile("i / j", &schema()).unwrap();
        let r = Record { time: 0, fields: smallvec::smallvec![Value::Int(1), Value::Int(0)] };
        assert_eq!(e.tree.as_ref().unwrap().eval(&r).unwrap_err(), Fallback);
        assert!(e.eval_value(&r).unwrap_err().to_string().contains("i / j"), "the interpreter's error");
        let mixed = Expr::compile("i == f", &schema()).unwrap();
        let r = Record {
            time: 0,
            fields: smallvec::smallvec![Value::Int(1), Value::Int(0), Value::Null, Value::Null, Value::Float(1.0)],
        };
        assert_eq!(mixed.tree.as_ref().unwrap().eval(&r).unwrap_err(), Fallback);
        assert_eq!(mixed.eval_bool(&r).unwrap(), matches!(mixed.eval(&r).unwrap(), cel::Value::Bool(true)));
    }
}
