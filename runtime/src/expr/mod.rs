//! CEL expressions over a record's fields, compiled once per operator (by
//! [`weir_crds::expr::compile`], which validation runs too) and evaluated here: on the
//! record path by a lowered tree ([`tree`]), else (and wherever the tree cannot answer) by the
//! `cel` interpreter, within a cost budget per record ([`budget`]).

pub mod budget;
pub mod tree;

use std::sync::Arc;

use cel::Context;
pub use weir_crds::expr::CompileError;

use crate::value::{Record, Value};

/// Why an expression could not be compiled or evaluated.
#[derive(Debug, thiserror::Error)]
pub enum ExprError {
    /// It does not compile against its input.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// Evaluation failed on a record.
    #[error("CEL expression `{expr}` failed: {reason}")]
    Eval {
        /// The expression.
        expr: String,
        /// What went wrong.
        reason: String,
    },
}

/// The environment expressions are evaluated in: the one they compile in
/// ([`weir_crds::expr::new_env`]) and the budget's charges, built once.
fn eval_env() -> Result<Arc<cel::Env>, String> {
    static ENV: std::sync::OnceLock<Result<Arc<cel::Env>, String>> = std::sync::OnceLock::new();
    ENV.get_or_init(|| {
        let mut env = weir_crds::expr::new_env();
        budget::register(&mut env).map_err(|e| e.to_string())?;
        Ok(Arc::new(env))
    })
    .clone()
}

/// A compiled expression bound to an input schema.
pub struct Expr {
    text: String,
    /// The program's syntax tree with the budget's charges ([`budget::instrument`]): what the
    /// interpreter runs.
    budgeted: cel::common::ast::IdedExpr,
    /// `(field position, variable name)` of the fields the expression reads.
    inputs: Vec<(usize, String)>,
    root: Context<'static, 'static>,
    /// The lowered tree, when the expression uses only what it covers.
    tree: Option<tree::Node>,
}

impl std::fmt::Debug for Expr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Expr({})", self.text)
    }
}

impl Expr {
    /// Compiles `text` against the fields of `schema`.
    pub fn compile(text: &str, schema: &[String]) -> Result<Expr, ExprError> {
        let weir_crds::expr::Compiled { program, inputs } = weir_crds::expr::compile(text, schema)?;
        let tree = tree::lower(program.expression(), &inputs);
        let root = Context::with_env(eval_env().map_err(|e| CompileError::Compiler(format!("its cost budget: {e}")))?);
        let budgeted = budget::instrument(program.expression());
        Ok(Expr { text: text.to_string(), budgeted, inputs, root, tree })
    }

    /// Whether the record path evaluates it by the lowered tree (not the interpreter).
    pub fn is_lowered(&self) -> bool {
        self.tree.is_some()
    }

    /// The tree's answer, when it has one.
    fn eval_tree(&self, record: &Record) -> Option<tree::V> {
        self.tree.as_ref()?.eval(record).ok()
    }

    /// Evaluates the expression on a record with the `cel` interpreter, within the budget.
    pub fn eval(&self, record: &Record) -> Result<cel::Value, ExprError> {
        let mut scope = self.root.new_inner_scope();
        for (pos, name) in &self.inputs {
            scope.add_variable_from_value(name.as_str(), to_cel(&record.fields[*pos]));
        }
        let fail = |reason: String| ExprError::Eval { expr: self.text.clone(), reason };
        budget::evaluate(&self.budgeted, &scope).map_err(|e| fail(e.to_string()))?.map_err(|e| fail(e.to_string()))
    }

    /// Evaluates to a field value.
    pub fn eval_value(&self, record: &Record) -> Result<Value, ExprError> {
        if let Some(v) = self.eval_tree(record).and_then(tree::V::into_value) {
            return Ok(v);
        }
        let v = self.eval(record)?;
        from_cel(&v)
            .ok_or_else(|| ExprError::Eval { expr: self.text.clone(), reason: format!("result {v:?} is not a scalar") })
    }

    /// Evaluates a predicate.
    pub fn eval_bool(&self, record: &Record) -> Result<bool, ExprError> {
        if let Some(Ok(b)) = self.tree.as_ref().map(|t| t.test(record)) {
            return Ok(b);
        }
        match self.eval(record)? {
            cel::Value::Bool(b) => Ok(b),
            other => Err(ExprError::Eval { expr: self.text.clone(), reason: format!("must be a bool, got {other:?}") }),
        }
    }

    /// Evaluates to a list of field values.
    pub fn eval_list(&self, record: &Record) -> Result<Vec<Value>, ExprError> {
        if let Some(Ok(values)) = self.tree.as_ref().map(|t| t.values(record)) {
            return Ok(values);
        }
        match self.eval(record)? {
            cel::Value::List(items) => items
                .iter()
                .map(|v| {
                    from_cel(v).ok_or_else(|| ExprError::Eval {
                        expr: self.text.clone(),
                        reason: format!("list element {v:?} is not a scalar"),
                    })
                })
                .collect(),
            other => Err(ExprError::Eval { expr: self.text.clone(), reason: format!("must be a list, got {other:?}") }),
        }
    }
}

fn to_cel(v: &Value) -> cel::Value {
    match v {
        Value::Null => cel::Value::Null,
        Value::Bool(b) => cel::Value::Bool(*b),
        Value::Int(i) => cel::Value::Int(*i),
        Value::Float(f) => cel::Value::Float(*f),
        Value::Str(s) => cel::Value::String(Arc::new(s.to_string())),
    }
}

fn from_cel(v: &cel::Value) -> Option<Value> {
    Some(match v {
        cel::Value::Null => Value::Null,
        cel::Value::Bool(b) => Value::Bool(*b),
        cel::Value::Int(i) => Value::Int(*i),
        cel::Value::UInt(u) => Value::Int(i64::try_from(*u).ok()?),
        cel::Value::Float(f) => Value::Float(*f),
        cel::Value::String(s) => Value::str(s),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(fields: Vec<Value>) -> Record {
        Record { time: 0, fields: fields.into() }
    }

    #[test]
    fn evaluates_over_named_fields() {
        let schema = vec!["word".to_string(), "n".to_string()];
        let e = Expr::compile("word.lowerAscii() + '-' + string(n * 2)", &schema).unwrap();
        assert_eq!(e.eval_value(&rec(vec![Value::str("HeLLo"), Value::Int(21)])).unwrap(), Value::str("hello-42"));
        let p = Expr::compile("n > 10 && word.startsWith('a')", &schema).unwrap();
        assert!(p.eval_bool(&rec(vec![Value::str("abc"), Value::Int(11)])).unwrap());
        let l = Expr::compile("word.split(' ')", &schema).unwrap();
        assert_eq!(
            l.eval_list(&rec(vec![Value::str("a b"), Value::Int(0)])).unwrap(),
            vec![Value::str("a"), Value::str("b")]
        );
    }

    #[test]
    fn reports_compile_errors_and_unknown_fields() {
        let schema = vec!["a".to_string()];
        assert!(matches!(Expr::compile("a +", &schema), Err(ExprError::Compile(CompileError::Syntax { .. }))));
        let err = Expr::compile("b + 1", &schema).unwrap_err().to_string();
        assert!(err.contains("`b`") && err.contains("fields: a"), "{err}");
    }

    #[test]
    fn work_beyond_the_budget_fails_the_record_with_a_clear_error() {
        let schema = vec!["s".to_string(), "n".to_string()];
        let r = |s: &str, n: i64| rec(vec![Value::str(s), Value::Int(n)]);
        let over = |text: &str, record: &Record| {
            let e = Expr::compile(text, &schema).unwrap();
            let started = std::time::Instant::now();
            let err = e.eval(record).expect_err(text).to_string();
            assert!(err.contains("cost budget") && err.contains(text), "{text}: {err}");
            // Refused before the work: a thousandth of it would take longer.
            assert!(started.elapsed() < std::time::Duration::from_secs(5), "{text}: {:?}", started.elapsed());
        };
        let big = "x".repeat(1 << 20);
        // Nested loops (10^12 iterations), a huge range from a field, a quadratic replace,
        // a join of a million copies, doubling by `+` in a loop, a loop inside `all` (whose
        // error a later `false` would swallow).
        over("lists.range(1000000).map(i, lists.range(1000000).size()).size() > 0", &r("", 0));
        over("lists.range(n).size()", &r("", 999_999_999));
        over("s.replace('', s).size()", &r(&big, 0));
        over("lists.range(100000).map(i, s).join().size()", &r(&big, 0));
        over("lists.range(1000).map(i, s + s + s).size()", &r(&big, 0));
        over("[1, 2].all(x, x == 2 || lists.range(1000000).map(i, lists.range(1000000)).size() > 0)", &r("", 0));
        // Within it, the same shapes work, and the budget is per record.
        let within = Expr::compile("lists.range(1000).map(i, i * 2).size() + s.replace('a', 'bb').size()", &schema);
        let within = within.unwrap();
        for _ in 0..3 {
            assert_eq!(within.eval_value(&r("aaa", 0)).unwrap(), Value::Int(1006));
        }
        assert!(Expr::compile("[1, 2, 3].exists(x, x == 2)", &schema).unwrap().eval_bool(&r("", 0)).unwrap());
        // A long map is still appended in place (linear), within the budget.
        let long = Expr::compile("lists.range(200000).map(i, i + 1).filter(i, i % 2 == 0).size()", &schema).unwrap();
        assert_eq!(long.eval_value(&r("", 0)).unwrap(), Value::Int(100_000));
        let join = Expr::compile("s.split(',').join('-')", &schema).unwrap();
        assert_eq!(join.eval_value(&r("a,b", 0)).unwrap(), Value::str("a-b"));
    }

    #[test]
    fn evaluation_errors_name_the_expression() {
        let e = Expr::compile("a / 0", &["a".to_string()]).unwrap();
        let err = e.eval_value(&rec(vec![Value::Int(1)])).unwrap_err().to_string();
        assert!(err.contains("a / 0"), "{err}");
    }
}
