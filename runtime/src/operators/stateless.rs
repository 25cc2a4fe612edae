//! `map`, `filter` and `flatMap`: stateless record transformations.

use weir_crds::job::{FlatMapSpec, MapSpec};

use crate::expr::{Expr, ExprError};
use crate::operator::{Operator, TaskError};
use crate::value::{Fields, Record, Value};

/// Computes output fields from CEL expressions.
pub struct MapOperator {
    /// For each output field: copy input field `i`, or evaluate an expression.
    outputs: Vec<MapOutput>,
}

enum MapOutput {
    Copy(usize),
    Eval(Box<Expr>),
}

impl MapOperator {
    /// Compiles a `map` against its input schema; `output_schema` is the validated result.
    pub fn new(spec: &MapSpec, input: &[String], output_schema: &[String]) -> Result<Self, ExprError> {
        let mut outputs = Vec::with_capacity(output_schema.len());
        for name in output_schema {
            match spec.fields.0.iter().find(|(n, _)| n == name) {
                Some((_, text)) => outputs.push(MapOutput::Eval(Box::new(Expr::compile(text, input)?))),
                None => outputs
                    .push(MapOutput::Copy(input.iter().position(|f| f == name).expect("validated: kept input field"))),
            }
        }
        Ok(MapOperator { outputs })
    }
}

impl Operator for MapOperator {
    fn process(&mut self, batch: Vec<Record>, out: &mut Vec<Record>) -> Result<(), TaskError> {
        out.reserve(batch.len());
        for r in batch {
            let mut fields = Fields::with_capacity(self.outputs.len());
            for o in &self.outputs {
                fields.push(match o {
                    MapOutput::Copy(i) => r.fields[*i].clone(),
                    MapOutput::Eval(e) => e.eval_value(&r)?,
                });
            }
            out.push(Record { time: r.time, fields });
        }
        Ok(())
    }
}

/// Keeps records for which a CEL predicate holds.
pub struct FilterOperator {
    predicate: Expr,
}

impl FilterOperator {
    /// Compiles the predicate.
    pub fn new(expr: &str, input: &[String]) -> Result<Self, ExprError> {
        Ok(FilterOperator { predicate: Expr::compile(expr, input)? })
    }
}

impl Operator for FilterOperator {
    fn process(&mut self, batch: Vec<Record>, out: &mut Vec<Record>) -> Result<(), TaskError> {
        for r in batch {
            if self.predicate.eval_bool(&r)? {
                out.push(r);
            }
        }
        Ok(())
    }
}

/// One record in, zero or more out.
pub enum FlatMapOperator {
    /// Built-in whitespace split of field `field` (replaced by each token).
    Split {
        /// Position of the split field.
        field: usize,
        /// Lower-case tokens.
        lowercase: bool,
    },
    /// A CEL list; each element goes into field `at` (replacing or appending).
    Expr {
        /// The list expression.
        expr: Box<Expr>,
        /// Where the element goes; `None` appends.
        at: Option<usize>,
    },
}

impl FlatMapOperator {
    /// Builds a `flatMap` for its input schema.
    pub fn new(spec: &FlatMapSpec, input: &[String]) -> Result<Self, ExprError> {
        if let Some(split) = &spec.split {
            let field = input.iter().position(|f| *f == split.field).expect("validated: split field exists");
            return Ok(FlatMapOperator::Split { field, lowercase: split.lowercase });
        }
        let text = spec.expr.as_deref().expect("validated: split or expr");
        let name = spec.as_field.as_deref().expect("validated: as with expr");
        Ok(FlatMapOperator::Expr {
            expr: Box::new(Expr::compile(text, input)?),
            at: input.iter().position(|f| f == name),
        })
    }
}

impl Operator for FlatMapOperator {
    fn process(&mut self, batch: Vec<Record>, out: &mut Vec<Record>) -> Result<(), TaskError> {
        match self {
            FlatMapOperator::Split { field, lowercase } => {
                for r in batch {
                    let Value::Str(text) = &r.fields[*field] else { continue };
                    for token in text.split_whitespace() {
                        let mut fields = r.fields.clone();
                        fields[*field] = if *lowercase { Value::str(&token.to_lowercase()) } else { Value::str(token) };
                        out.push(Record { time: r.time, fields });
                    }
                }
            }
            FlatMapOperator::Expr { expr, at } => {
                for r in batch {
                    let mut values = expr.eval_list(&r)?.into_iter();
                    let Some(mut v) = values.next() else { continue };
                    // Each element gets a copy of the input's fields but the last, which takes
                    // them (a line split into words is shared once less per line).
                    for next in values {
                        let mut fields = r.fields.clone();
                        put(&mut fields, *at, std::mem::replace(&mut v, next));
                        out.push(Record { time: r.time, fields });
                    }
                    let Record { time, mut fields } = r;
                    put(&mut fields, *at, v);
                    out.push(Record { time, fields });
                }
            }
        }
        Ok(())
    }
}

/// Puts a `flatMap` element in its field: replacing field `at`, or appended.
fn put(fields: &mut Fields, at: Option<usize>, v: Value) {
    match at {
        Some(i) => fields[i] = v,
        None => fields.push(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_crds::job::{NamedExprs, SplitSpec};

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn map_keeps_and_computes_fields() {
        let spec = MapSpec {
            fields: NamedExprs(vec![("n".into(), "n * 10".into()), ("tag".into(), "'x'".into())]),
            keep_input: true,
        };
        let mut m = MapOperator::new(&spec, &s(&["w", "n"]), &s(&["w", "n", "tag"])).unwrap();
        let mut out = Vec::new();
        m.process(vec![Record { time: 5, fields: smallvec::smallvec![Value::str("a"), Value::Int(2)] }], &mut out)
            .unwrap();
        assert_eq!(out[0].fields.as_slice(), [Value::str("a"), Value::Int(20), Value::str("x")]);
        assert_eq!(out[0].time, 5);
    }

    #[test]
    fn split_and_filter() {
        let spec = FlatMapSpec {
            split: Some(SplitSpec { field: "line".into(), into: "word".into(), lowercase: true }),
            expr: None,
            as_field: None,
        };
        let mut f = FlatMapOperator::new(&spec, &s(&["line"])).unwrap();
        let mut out = Vec::new();
        f.process(vec![Record { time: 0, fields: smallvec::smallvec![Value::str("A b  C")] }], &mut out).unwrap();
        assert_eq!(
            out.iter().map(|r| r.fields[0].clone()).collect::<Vec<_>>(),
            vec![Value::str("a"), Value::str("b"), Value::str("c")]
        );
        let mut filter = FilterOperator::new("word != 'b'", &s(&["word"])).unwrap();
        let mut kept = Vec::new();
        filter.process(out, &mut kept).unwrap();
        assert_eq!(kept.len(), 2);
    }

    #[test]
    fn flat_map_expr_emits_each_element_with_the_input_fields_in_order() {
        let spec = |as_field: &str| FlatMapSpec {
            split: None,
            expr: Some("line.split(' ')".into()),
            as_field: Some(as_field.into()),
        };
        let input = || {
            vec![
                Record { time: 7, fields: smallvec::smallvec![Value::str("a bb c"), Value::Int(1)] },
                Record { time: 8, fields: smallvec::smallvec![Value::str("one"), Value::Int(2)] },
            ]
        };
        let mut appended = Vec::new();
        FlatMapOperator::new(&spec("word"), &s(&["line", "n"])).unwrap().process(input(), &mut appended).unwrap();
        let rows: Vec<(i64, Vec<Value>)> = appended.into_iter().map(|r| (r.time, r.fields.to_vec())).collect();
        let row = |t, l: &str, n, w: &str| (t, vec![Value::str(l), Value::Int(n), Value::str(w)]);
        assert_eq!(
            rows,
            [row(7, "a bb c", 1, "a"), row(7, "a bb c", 1, "bb"), row(7, "a bb c", 1, "c"), row(8, "one", 2, "one")]
        );

        let mut replaced = Vec::new();
        FlatMapOperator::new(&spec("line"), &s(&["line", "n"])).unwrap().process(input(), &mut replaced).unwrap();
        let words: Vec<Value> = replaced.iter().map(|r| r.fields[0].clone()).collect();
        assert_eq!(words, [Value::str("a"), Value::str("bb"), Value::str("c"), Value::str("one")]);
        assert!(replaced.iter().all(|r| r.fields.len() == 2));
    }
}
