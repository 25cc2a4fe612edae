//! CEL expressions over a record's fields, compiled once per operator (by
//! [`weir_crds::expr::compile`], which validation runs too) and evaluated here: on the
//! record path by a lowered tree ([`tree`]), else (and wherever the tree cannot answer) by the
//! `cel` interpreter.

pub mod tree;

use std::sync::Arc;

use cel::{Context, Program};
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

/// A compiled expression bound to an input schema.
pub struct Expr {
    text: String,
    program: Program,
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
        Ok(Expr { text: text.to_string(), program, inputs, root: Context::with_env(weir_crds::expr::env()), tree })
    }

    /// Whether the record path evaluates it by the lowered tree (not the interpreter).
    pub fn is_lowered(&self) -> bool {
        self.tree.is_some()
    }

    /// The tree's answer, when it has one.
    fn eval_tree(&self, record: &Record) -> Option<tree::V> {
        self.tree.as_ref()?.eval(record).ok()
    }

    /// Evaluates the expression on a record with the `cel` interpreter.
    pub fn eval(&self, record: &Record) -> Result<cel::Value, ExprError> {
        let mut scope = self.root.new_inner_scope();
        for (pos, name) in &self.inputs {
            scope.add_variable_from_value(name.as_str(), to_cel(&record.fields[*pos]));
        }
        self.program.execute(&scope).map_err(|e| ExprError::Eval { expr: self.text.clone(), reason: e.to_string() })
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
    fn evaluation_errors_name_the_expression() {
        let e = Expr::compile("a / 0", &["a".to_string()]).unwrap();
        let err = e.eval_value(&rec(vec![Value::Int(1)])).unwrap_err().to_string();
        assert!(err.contains("a / 0"), "{err}");
    }
}
