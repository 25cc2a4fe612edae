//! CEL expressions of a job file: the environment they compile in, and the compile step that
//! checks an expression parses and reads only fields of its input.
//!
//! The environment is CEL's standard library plus its `strings`, `lists` and `math` extensions
//! (`lowerAscii`, `split`, `join`, ...). An expression sees every field of the input record as a
//! variable of the same name. Compiling needs no I/O, so [`crate::validate`] compiles every
//! expression: the operator refuses a job whose expression does not compile before it deploys
//! anything, and the runtime evaluates the same compiled program.

use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

use cel::common::ast::{EntryExpr, Expr, IdedExpr};
use cel::{Env, Program};

/// Why an expression does not compile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    /// The parser or checker refused it.
    #[error("CEL expression `{expr}` does not compile: {reason}")]
    Syntax {
        /// The expression.
        expr: String,
        /// The parser's message.
        reason: String,
    },
    /// It reads a variable that is not a field of its input.
    #[error("CEL expression `{expr}` uses `{name}`, which is not an input field (fields: {fields})")]
    UnknownVariable {
        /// The expression.
        expr: String,
        /// The unknown name.
        name: String,
        /// The input fields.
        fields: String,
    },
}

/// An expression compiled against an input schema.
pub struct Compiled {
    /// The program, ready to execute.
    pub program: Program,
    /// `(field position, variable name)` of each input field the expression reads.
    pub inputs: Vec<(usize, String)>,
}

/// The environment every expression compiles and runs in, built once.
pub fn env() -> Arc<Env> {
    static ENV: OnceLock<Arc<Env>> = OnceLock::new();
    ENV.get_or_init(|| {
        let mut env = Env::stdlib();
        // The extensions are part of cel; failing to add them is a programming error.
        env.add_extension(cel::extensions::strings).expect("CEL strings extension");
        env.add_extension(cel::extensions::lists).expect("CEL lists extension");
        env.add_extension(cel::extensions::math).expect("CEL math extension");
        Arc::new(env)
    })
    .clone()
}

/// Compiles `text` against the fields of `schema` (the input record's field names).
pub fn compile(text: &str, schema: &[String]) -> Result<Compiled, CompileError> {
    let program =
        env().compile(text).map_err(|e| CompileError::Syntax { expr: text.to_string(), reason: e.to_string() })?;
    let mut inputs = Vec::new();
    let mut names = BTreeSet::new();
    free_variables(program.expression(), &mut Vec::new(), &mut names);
    for name in names {
        match schema.iter().position(|f| f == name) {
            Some(pos) => inputs.push((pos, name.to_string())),
            None => {
                return Err(CompileError::UnknownVariable {
                    expr: text.to_string(),
                    name: name.to_string(),
                    fields: schema.join(", "),
                })
            }
        }
    }
    Ok(Compiled { program, inputs })
}

/// Adds to `out` the variables `e` reads that are not bound by a comprehension around them
/// (`bound`): `[1, 2].exists(x, x > n)` reads `n` only. (The interpreter's reference list
/// counts `x` too, which would refuse every macro as reading an unknown field.)
fn free_variables<'a>(e: &'a IdedExpr, bound: &mut Vec<&'a str>, out: &mut BTreeSet<&'a str>) {
    match &e.expr {
        Expr::Ident(name) => {
            if !bound.contains(&name.as_str()) {
                out.insert(name);
            }
        }
        Expr::Select(select) => free_variables(&select.operand, bound, out),
        Expr::Call(call) => {
            for operand in call.target.as_deref().into_iter().chain(&call.args) {
                free_variables(operand, bound, out);
            }
        }
        Expr::List(list) => list.elements.iter().for_each(|e| free_variables(e, bound, out)),
        Expr::Map(map) => map.entries.iter().for_each(|e| entry_variables(&e.expr, bound, out)),
        Expr::Struct(s) => s.entries.iter().for_each(|e| entry_variables(&e.expr, bound, out)),
        Expr::Comprehension(c) => {
            free_variables(&c.iter_range, bound, out);
            free_variables(&c.accu_init, bound, out);
            let depth = bound.len();
            bound.push(&c.iter_var);
            bound.extend(c.iter_var2.as_deref());
            bound.push(&c.accu_var);
            for part in [&c.loop_cond, &c.loop_step, &c.result] {
                free_variables(part, bound, out);
            }
            bound.truncate(depth);
        }
        Expr::Literal(_) | Expr::Unspecified => {}
    }
}

fn entry_variables<'a>(entry: &'a EntryExpr, bound: &mut Vec<&'a str>, out: &mut BTreeSet<&'a str>) {
    match entry {
        EntryExpr::StructField(f) => free_variables(&f.value, bound, out),
        EntryExpr::MapEntry(m) => {
            free_variables(&m.key, bound, out);
            free_variables(&m.value, bound, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn compiles_against_the_input_fields() {
        let c = compile("line.split(' ').size() > n", &fields(&["n", "line"])).unwrap();
        let mut read: Vec<_> = c.inputs.iter().map(|(pos, name)| (*pos, name.as_str())).collect();
        read.sort();
        assert_eq!(read, vec![(0, "n"), (1, "line")]);
    }

    #[test]
    fn variables_bound_by_macros_are_not_fields() {
        let c = compile("[1, 2].exists(x, x > n) && words.all(w, w.size() < n)", &fields(&["n", "words"])).unwrap();
        let mut read: Vec<_> = c.inputs.iter().map(|(_, name)| name.as_str()).collect();
        read.sort();
        assert_eq!(read, ["n", "words"]);
        let e = compile("[1].exists(x, x > y)", &fields(&["n"])).err().unwrap();
        assert!(e.to_string().contains("uses `y`"), "{e}");
    }

    #[test]
    fn refuses_syntax_errors_and_unknown_fields() {
        assert!(matches!(compile("a +", &fields(&["a"])), Err(CompileError::Syntax { .. })));
        let e = compile("b > 1", &fields(&["a"])).err().unwrap();
        assert_eq!(e.to_string(), "CEL expression `b > 1` uses `b`, which is not an input field (fields: a)");
    }
}
