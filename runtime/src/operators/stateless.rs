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
                    for v in expr.eval_list(&r)? {
                        let mut fields = r.fields.clone();
                        match at {
                            Some(i) => fields[*i] = v,
                            None => fields.push(v),
                        }
                        out.push(Record { time: r.time, fields });
                    }
                }
            }
        }
        Ok(())
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
}
