//! A cost budget per record for the `cel` interpreter, which has none: an expression is
//! bounded in size when it compiles, but `lists.range(1000000).map(i, lists.range(1000000))`
//! or `s.replace('', s)` are short and would take a task thread for hours or all its memory.
//!
//! The interpreter runs a copy of the expression's syntax tree in which the steps whose work
//! is not bounded by the expression's size are preceded by a charge ([`instrument`]): each
//! comprehension (`map`, `filter`, `all`, `exists`, ...) charges the size of what it iterates
//! before its first iteration, so nested loops charge their product; `lists.range(n)` charges
//! `n` before it builds the list; `replace` and `join` charge the most bytes they can create
//! before they create them, `+` the bytes it did create, and a list literal the bytes of
//! the strings it copies into itself (the interpreter's strings are copied, not shared). Each record starts with
//! [`RECORD_BUDGET`] steps; a charge past it fails the evaluation ([`Exceeded`]) before the
//! work it stands for is done.

use std::cell::Cell;

use cel::common::ast::{CallExpr, EntryExpr, Expr, IdedExpr};
use cel::common::functions::Function;
use cel::common::types::{CelInt, CelList, CelString, DYN_TYPE};
use cel::common::value::{CowVal, Val};
use cel::{Context, Env, ExecutionError, Value};

/// Steps one evaluation may take: a loop iteration or a list element is a step, and so are
/// [`BYTES_PER_STEP`] bytes of string.
pub const RECORD_BUDGET: u64 = 1_000_000;
/// Bytes of created string that count as one step (a record's evaluation creates at most
/// 64 MiB by `replace`, `join` and `+`).
pub const BYTES_PER_STEP: u64 = 64;

/// The charging functions, named so that an expression cannot call them (`@` is not CEL).
const ITERATIONS: &str = "@weir_iterations";
const RANGE: &str = "@weir_range";
const REPLACE: &str = "@weir_replace";
const JOIN: &str = "@weir_join";
const CREATED: &str = "@weir_created";

thread_local! {
    /// Steps the evaluation on this thread has left.
    static LEFT: Cell<u64> = const { Cell::new(RECORD_BUDGET) };
    /// Whether a charge failed (an `all` or `exists` may swallow the error it returned).
    static EXCEEDED: Cell<bool> = const { Cell::new(false) };
}

/// An evaluation went over its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exceeded;

impl std::fmt::Display for Exceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "it exceeded the cost budget of one record, {RECORD_BUDGET} steps (a step is a loop iteration, \
             a list element or {BYTES_PER_STEP} bytes of string it creates): make it do less per record"
        )
    }
}

/// Runs one evaluation with a fresh budget; `Err(Exceeded)` when it went over, whatever it
/// returned.
pub fn run<T>(evaluate: impl FnOnce() -> T) -> Result<T, Exceeded> {
    LEFT.with(|l| l.set(RECORD_BUDGET));
    EXCEEDED.with(|e| e.set(false));
    let result = evaluate();
    match EXCEEDED.with(Cell::get) {
        true => Err(Exceeded),
        false => Ok(result),
    }
}

/// Takes `steps` from the budget, or fails (and marks the evaluation as over budget).
fn charge(steps: u64) -> Result<(), ExecutionError> {
    let left = LEFT.with(Cell::get);
    match left.checked_sub(steps) {
        Some(rest) if !EXCEEDED.with(Cell::get) => {
            LEFT.with(|l| l.set(rest));
            Ok(())
        }
        _ => {
            LEFT.with(|l| l.set(0));
            EXCEEDED.with(|e| e.set(true));
            Err(ExecutionError::function_error("cost budget", Exceeded.to_string()))
        }
    }
}

fn string_steps(bytes: u64) -> u64 {
    bytes.div_ceil(BYTES_PER_STEP)
}

/// Elements (a list's or a map's) or bytes (a string's, in steps) that iterating or holding
/// `v` stands for: read from the value as it is, never copied.
fn size_steps(v: &dyn Val) -> u64 {
    if let Some(s) = v.downcast_ref::<CelString>() {
        return string_steps(s.inner().len() as u64);
    }
    // A list's elements, each a step and its bytes: iterating copies each element.
    if v.downcast_ref::<CelList>().is_some() {
        if let Some(items) = v.as_iterable() {
            let (mut steps, mut items) = (0u64, items.iter());
            while let Some(item) = items.next() {
                steps = steps.saturating_add(1 + string_steps(str_len(item)));
            }
            return steps;
        }
    }
    v.as_sizer().map(|s| (*s.size().inner()).max(0) as u64).unwrap_or(0)
}

/// The most bytes `s.replace(from, to)` can create: every occurrence of `from` (at each
/// character boundary when it is empty) replaced by `to`.
fn replace_bound(s: u64, from: u64, to: u64) -> u64 {
    let occurrences = s.checked_div(from).unwrap_or(s + 1);
    s.saturating_add(occurrences.saturating_mul(to.saturating_sub(from)))
}

fn str_len(v: &dyn Val) -> u64 {
    v.downcast_ref::<CelString>().map_or(0, |s| s.inner().len() as u64)
}

fn one<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let count = args.len();
    let [v]: [CowVal<'b, 'v>; 1] = args.try_into().map_err(|_| ExecutionError::invalid_argument_count(1, count))?;
    Ok(v)
}

fn charge_iterations<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let v = one(args)?;
    charge(size_steps(v.as_ref()))?;
    Ok(v)
}

fn charge_range<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let v = one(args)?;
    if let Some(n) = v.as_ref().downcast_ref::<CelInt>() {
        charge((*n.inner()).max(0) as u64)?;
    }
    Ok(v)
}

fn charge_replace<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let count = args.len();
    let [s, from, to]: [CowVal<'b, 'v>; 3] =
        args.try_into().map_err(|_| ExecutionError::invalid_argument_count(3, count))?;
    charge(string_steps(replace_bound(str_len(s.as_ref()), str_len(from.as_ref()), str_len(to.as_ref()))))?;
    Ok(s)
}

fn charge_join<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let list = one(args)?;
    if let Some(items) = list.as_ref().as_iterable() {
        // The separators are short against the elements; each element counts one byte more
        // for them.
        let mut bytes = 0u64;
        let mut items = items.iter();
        while let Some(item) = items.next() {
            bytes = bytes.saturating_add(str_len(item) + 1);
        }
        charge(string_steps(bytes))?;
    }
    Ok(list)
}

fn charge_created<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let v = one(args)?;
    if v.as_ref().downcast_ref::<CelString>().is_some() {
        charge(size_steps(v.as_ref()))?;
    }
    Ok(v)
}

/// Registers the charging functions on the environment expressions are evaluated in. They
/// take any value and look at it in place (converted to `cel::Value`, a list of a million
/// references to one long string would be copied a million times).
pub fn register(env: &mut Env) -> Result<(), cel::DeclarationError> {
    let functions: [(&str, Function, usize); 5] = [
        (ITERATIONS, charge_iterations, 1),
        (RANGE, charge_range, 1),
        (REPLACE, charge_replace, 3),
        (JOIN, charge_join, 1),
        (CREATED, charge_created, 1),
    ];
    for (name, op, arity) in functions {
        env.add_overload(name, name, (0..arity).map(|_| DYN_TYPE).collect(), op)?;
    }
    Ok(())
}

/// A call of `function` on `args`, with the id of the node it stands before.
fn call(id: u64, function: &str, args: Vec<IdedExpr>) -> IdedExpr {
    IdedExpr { id, expr: Expr::Call(CallExpr { func_name: function.to_string(), target: None, args }) }
}

/// A variable a macro introduces (`@result`, ...): `@` cannot be written in CEL.
fn is_internal(e: &IdedExpr) -> bool {
    matches!(&e.expr, Expr::Ident(name) if name.starts_with('@'))
}

fn is_lists_range(c: &CallExpr) -> bool {
    c.func_name == "lists.range"
        || (c.func_name == "range"
            && matches!(c.target.as_deref(), Some(IdedExpr { expr: Expr::Ident(n), .. }) if n == "lists"))
}

/// A copy of `e` with a charge before every step the budget covers (see the module's doc).
pub fn instrument(e: &IdedExpr) -> IdedExpr {
    let mut e = e.clone();
    rewrite(&mut e);
    e
}

fn rewrite(e: &mut IdedExpr) {
    let id = e.id;
    match &mut e.expr {
        Expr::Call(c) => {
            if let Some(t) = c.target.as_deref_mut() {
                rewrite(t);
            }
            c.args.iter_mut().for_each(rewrite);
            if is_lists_range(c) && c.args.len() == 1 {
                let n = std::mem::take(&mut c.args[0]);
                c.args[0] = call(n.id, RANGE, vec![n]);
            } else if c.func_name == "replace" && c.args.len() >= 2 {
                if let Some(target) = c.target.take() {
                    let args = vec![*target, c.args[0].clone(), c.args[1].clone()];
                    c.target = Some(Box::new(call(id, REPLACE, args)));
                }
            } else if c.func_name == "join" {
                if let Some(target) = c.target.take() {
                    c.target = Some(Box::new(call(id, JOIN, vec![*target])));
                }
            } else if c.func_name == "_+_" && !c.args.iter().any(is_internal) {
                // (Not a macro's `@result + [x]`: wrapped, the interpreter would no longer
                // see the shape it appends in place, and each `map` would take quadratic time.)
                let sum = std::mem::take(e);
                *e = call(id, CREATED, vec![sum]);
            }
        }
        Expr::Comprehension(c) => {
            rewrite(&mut c.iter_range);
            rewrite(&mut c.accu_init);
            rewrite(&mut c.loop_cond);
            rewrite(&mut c.loop_step);
            rewrite(&mut c.result);
            let range = std::mem::take(&mut c.iter_range);
            c.iter_range = call(range.id, ITERATIONS, vec![range]);
        }
        Expr::List(l) => {
            l.elements.iter_mut().for_each(rewrite);
            // Building the list copies each element (a string of the record, in full).
            for element in l.elements.iter_mut().filter(|e| !matches!(e.expr, Expr::Literal(_))) {
                let value = std::mem::take(element);
                *element = call(value.id, CREATED, vec![value]);
            }
        }
        Expr::Map(m) => m.entries.iter_mut().for_each(|entry| rewrite_entry(&mut entry.expr)),
        Expr::Struct(s) => s.entries.iter_mut().for_each(|entry| rewrite_entry(&mut entry.expr)),
        Expr::Select(s) => rewrite(&mut s.operand),
        Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => {}
    }
}

fn rewrite_entry(entry: &mut EntryExpr) {
    match entry {
        EntryExpr::MapEntry(me) => {
            rewrite(&mut me.key);
            rewrite(&mut me.value);
        }
        EntryExpr::StructField(f) => rewrite(&mut f.value),
    }
}

/// Evaluates `e` (instrumented) in `ctx` within a fresh budget.
pub fn evaluate(e: &IdedExpr, ctx: &Context) -> Result<cel::ResolveResult, Exceeded> {
    run(|| Value::resolve(e, ctx))
}
