//! CEL expressions of a job file: the environment they compile in, and the compile step that
//! checks an expression parses and reads only fields of its input.
//!
//! The environment is CEL's standard library plus its `strings`, `lists` and `math` extensions
//! (`lowerAscii`, `split`, `join`, ...). An expression sees every field of the input record as a
//! variable of the same name. Compiling needs no I/O, so [`crate::validate`] compiles every
//! expression: the operator refuses a job whose expression does not compile before it deploys
//! anything, and the runtime evaluates the same compiled program.

use std::sync::{Arc, OnceLock};

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
    for name in program.references().variables() {
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
    fn refuses_syntax_errors_and_unknown_fields() {
        assert!(matches!(compile("a +", &fields(&["a"])), Err(CompileError::Syntax { .. })));
        let e = compile("b > 1", &fields(&["a"])).err().unwrap();
        assert_eq!(e.to_string(), "CEL expression `b > 1` uses `b`, which is not an input field (fields: a)");
    }
}
