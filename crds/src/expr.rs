//! CEL expressions of a job file: the environment they compile in, and the compile step that
//! checks an expression parses and reads only fields of its input.
//!
//! The environment is CEL's standard library plus its `strings`, `lists` and `math` extensions
//! (`lowerAscii`, `split`, `join`, ...). An expression sees every field of the input record as a
//! variable of the same name. Compiling needs no I/O, so [`crate::validate`] compiles every
//! expression: the operator refuses a job whose expression does not compile before it deploys
//! anything, and the runtime evaluates the same compiled program.
//!
//! Expressions come from tenants, and the operator compiles them for every namespace: a parse
//! that overflows its stack would take the operator down for all of them. So an expression is
//! bounded before it is parsed ([`check_shape`]: length, nesting, operators), and parsing and
//! checking run on a thread of their own with a stack sized for the largest expression the
//! bounds let through ([`COMPILE_STACK_BYTES`]), whoever calls.

use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

use cel::common::ast::{EntryExpr, Expr, IdedExpr};
use cel::{Env, Program};

/// Longest expression, in bytes (also the CRD's `maxLength` of expression fields).
pub const MAX_EXPR_BYTES: usize = 4096;
/// Deepest nesting of parentheses, brackets, braces and calls, unary operators in a row
/// included (CEL asks implementations for at least 12). Each level costs the parser about
/// 200 KiB of stack in a debug build and a tenth of that in a release build.
pub const MAX_EXPR_NESTING: usize = 16;
/// Most operators in one expression (binary and unary operators, member selections, calls'
/// commas): each can add a level to the syntax tree that parsing and evaluation recurse into.
pub const MAX_EXPR_OPERATORS: usize = 256;
/// Stack of the thread that parses and checks an expression (address space, touched only as
/// deep as a parse goes): the largest expression within the bounds above needs less than a
/// tenth of it, even in a debug build (`expressions_at_the_bounds_compile_on_a_tenth_of_the_
/// compile_stack`).
pub const COMPILE_STACK_BYTES: usize = 64 << 20;

/// Why an expression does not compile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    /// It exceeds a bound that keeps parsing and evaluation within a bounded stack.
    #[error("CEL expression of {length} bytes is too {what}: {found} where at most {limit} are allowed")]
    TooComplex {
        /// Its length in bytes (the expression itself is not repeated: it may be huge).
        length: usize,
        /// `long` (bytes), `deeply nested` (levels) or `complex` (operators).
        what: &'static str,
        /// What it has.
        found: usize,
        /// The bound.
        limit: usize,
    },
    /// The thread that compiles expressions could not be started, or failed.
    #[error("CEL expression could not be compiled: {0}")]
    Compiler(String),
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
    ENV.get_or_init(|| Arc::new(new_env())).clone()
}

/// A new environment like [`env`]'s, for a caller that adds functions of its own (the
/// runtime's cost budget).
pub fn new_env() -> Env {
    let mut env = Env::stdlib();
    // The extensions are part of cel; failing to add them is a programming error.
    env.add_extension(cel::extensions::strings).expect("CEL strings extension");
    env.add_extension(cel::extensions::lists).expect("CEL lists extension");
    env.add_extension(cel::extensions::math).expect("CEL math extension");
    env
}

/// Compiles `text` against the fields of `schema` (the input record's field names). The
/// expression is bounded first ([`check_shape`]), then parsed and checked on a thread with a
/// stack of [`COMPILE_STACK_BYTES`].
pub fn compile(text: &str, schema: &[String]) -> Result<Compiled, CompileError> {
    check_shape(text)?;
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("weir-cel-compile".into())
            .stack_size(COMPILE_STACK_BYTES)
            .spawn_scoped(scope, || compile_checked(text, schema))
            .map_err(|e| CompileError::Compiler(format!("starting its thread: {e}")))?
            .join()
            .map_err(|_| CompileError::Compiler("its thread panicked".into()))?
    })
}

/// Refuses an expression longer than [`MAX_EXPR_BYTES`], nested deeper than
/// [`MAX_EXPR_NESTING`] or with more than [`MAX_EXPR_OPERATORS`] operators, without parsing it
/// (string literals are skipped, so brackets and operators inside them do not count).
pub fn check_shape(text: &str) -> Result<(), CompileError> {
    let too = |what, found, limit| Err(CompileError::TooComplex { length: text.len(), what, found, limit });
    if text.len() > MAX_EXPR_BYTES {
        return too("long", text.len(), MAX_EXPR_BYTES);
    }
    let shape = shape_of(text.as_bytes());
    if shape.nesting > MAX_EXPR_NESTING {
        return too("deeply nested", shape.nesting, MAX_EXPR_NESTING);
    }
    if shape.operators > MAX_EXPR_OPERATORS {
        return too("complex", shape.operators, MAX_EXPR_OPERATORS);
    }
    Ok(())
}

/// How deep an expression nests and how many operators it has, read token by token.
#[derive(Debug, Default, PartialEq, Eq)]
struct Shape {
    nesting: usize,
    operators: usize,
}

fn shape_of(text: &[u8]) -> Shape {
    let mut shape = Shape::default();
    let (mut depth, mut unary_run, mut i) = (0usize, 0usize, 0usize);
    // Whether the previous token ends an operand (so a `-` after it is binary, not unary).
    let mut after_operand = false;
    while i < text.len() {
        let c = text[i];
        match c {
            b'\'' | b'"' => {
                i = skip_string(text, i);
                after_operand = true;
                unary_run = 0;
                continue;
            }
            b'(' | b'[' | b'{' => {
                depth += 1;
                after_operand = false;
            }
            b')' | b']' | b'}' => {
                depth = depth.saturating_sub(1);
                after_operand = true;
                unary_run = 0;
            }
            b'!' | b'-' if !after_operand && text.get(i + 1) != Some(&b'=') => {
                unary_run += 1;
                shape.operators += 1;
            }
            b'+' | b'-' | b'*' | b'/' | b'%' | b'<' | b'>' | b'=' | b'!' | b'&' | b'|' | b'?' | b':' | b'.' | b',' => {
                // Two-character operators (`==`, `&&`, `<=`, ...) count once.
                let pair = matches!(text.get(i + 1), Some(b'=' | b'&' | b'|')) && c != b'.' && c != b',';
                i += usize::from(pair);
                shape.operators += 1;
                after_operand = false;
                unary_run = 0;
            }
            c if c.is_ascii_whitespace() => {}
            _ => {
                after_operand = true;
                unary_run = 0;
            }
        }
        shape.nesting = shape.nesting.max(depth + unary_run);
        i += 1;
    }
    shape
}

/// The index after the string literal opening at `start` (quotes `'`, `"`, or three of
/// either; a backslash escapes the next byte unless the literal is raw, `r'...'`). An
/// unterminated literal runs to the end.
fn skip_string(text: &[u8], start: usize) -> usize {
    let quote = text[start];
    let prefix = |back: usize| start.checked_sub(back).map(|i| text[i].to_ascii_lowercase());
    let word = |c: Option<u8>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_');
    let raw = match (prefix(1), prefix(2), prefix(3)) {
        (Some(b'r'), Some(b'b'), before) | (Some(b'b'), Some(b'r'), before) => !word(before),
        (Some(b'r'), before, _) => !word(before),
        _ => false,
    };
    let triple = text.get(start..start + 3) == Some(&[quote; 3][..]);
    let mut i = start + if triple { 3 } else { 1 };
    while i < text.len() {
        match text[i] {
            b'\\' if !raw => i += 2,
            c if c == quote && (!triple || text.get(i..i + 3) == Some(&[quote; 3][..])) => {
                return i + if triple { 3 } else { 1 };
            }
            _ => i += 1,
        }
    }
    text.len()
}

fn compile_checked(text: &str, schema: &[String]) -> Result<Compiled, CompileError> {
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
/// The extensions' namespaced global functions (`math.greatest` and `math.least` are macros).
const NAMESPACED_FUNCTIONS: [&str; 18] = [
    "lists.range",
    "strings.quote",
    "math.abs",
    "math.bitAnd",
    "math.bitNot",
    "math.bitOr",
    "math.bitShiftLeft",
    "math.bitShiftRight",
    "math.bitXor",
    "math.ceil",
    "math.floor",
    "math.isFinite",
    "math.isInf",
    "math.isNaN",
    "math.round",
    "math.sign",
    "math.sqrt",
    "math.trunc",
];

fn free_variables<'a>(e: &'a IdedExpr, bound: &mut Vec<&'a str>, out: &mut BTreeSet<&'a str>) {
    match &e.expr {
        Expr::Ident(name) => {
            if !bound.contains(&name.as_str()) {
                out.insert(name);
            }
        }
        Expr::Select(select) => free_variables(&select.operand, bound, out),
        Expr::Call(call) => {
            // `lists.range(n)`, `math.greatest(a, b)`, `strings.quote(s)`: the extensions'
            // namespaced functions parse as calls on an identifier that is no variable.
            let namespaced = matches!(
                call.target.as_deref(),
                Some(IdedExpr { expr: Expr::Ident(ns), .. })
                    if !bound.contains(&ns.as_str())
                        && NAMESPACED_FUNCTIONS.contains(&format!("{ns}.{}", call.func_name).as_str())
            );
            let target = call.target.as_deref().filter(|_| !namespaced);
            for operand in target.into_iter().chain(&call.args) {
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
    fn the_extensions_namespaced_functions_are_not_variables() {
        let c = compile("lists.range(n).size() + math.abs(n) + strings.quote(s).size()", &fields(&["n", "s"]));
        let c = c.unwrap();
        let mut read: Vec<_> = c.inputs.iter().map(|(_, name)| name.as_str()).collect();
        read.sort();
        assert_eq!(read, ["n", "s"]);
        // A field of that name is still read where it is used as one.
        let c = compile("lists.size() > 0", &fields(&["lists"])).unwrap();
        assert_eq!(c.inputs.iter().map(|(_, n)| n.as_str()).collect::<Vec<_>>(), ["lists"]);
    }

    #[test]
    fn refuses_syntax_errors_and_unknown_fields() {
        assert!(matches!(compile("a +", &fields(&["a"])), Err(CompileError::Syntax { .. })));
        let e = compile("b > 1", &fields(&["a"])).err().unwrap();
        assert_eq!(e.to_string(), "CEL expression `b > 1` uses `b`, which is not an input field (fields: a)");
    }

    /// Expressions a hostile tenant may write, growing to 200 KB, compiled from a thread with a
    /// 128 KiB stack (a sixteenth of a tokio worker's): each compiles or is refused, and none
    /// overflows a stack (which would abort this test's process).
    #[test]
    fn growing_hostile_expressions_are_refused_without_overflowing_a_small_stack() {
        type Grow = fn(usize) -> String;
        let shapes: [(&str, Grow); 9] = [
            ("sum", |n| vec!["a"; n].join(" + ")),
            ("and", |n| vec!["a > 1"; n].join(" && ")),
            ("parens", |n| format!("{}a{}", "(".repeat(n), ")".repeat(n))),
            ("lists", |n| format!("{}a{}", "[".repeat(n), "]".repeat(n))),
            ("maps", |n| format!("{}a{}", "{a: ".repeat(n), "}".repeat(n))),
            ("not", |n| format!("{}a", "!".repeat(n))),
            ("minus", |n| format!("{}a", "- ".repeat(n))),
            ("calls", |n| format!("{}a{}", "size(".repeat(n), ")".repeat(n))),
            ("members", |n| format!("a{}", ".b".repeat(n))),
        ];
        let small = std::thread::Builder::new().stack_size(128 << 10);
        small
            .spawn(move || {
                for (name, make) in shapes {
                    for n in [1, 10, 30, 100, 1_000, 10_000, 50_000] {
                        let text = make(n);
                        let outcome = compile(&text, &fields(&["a"]));
                        let refused = matches!(outcome, Err(CompileError::TooComplex { .. }));
                        // Past a bound an expression is refused before it is parsed.
                        if text.len() > MAX_EXPR_BYTES || n > MAX_EXPR_OPERATORS {
                            assert!(refused, "{name} × {n} ({} bytes) was not refused", text.len());
                        }
                        if n == 1 {
                            assert!(!refused, "{name} × 1 refused");
                        }
                    }
                }
            })
            .unwrap()
            .join()
            .unwrap();
    }

    /// The deepest and most complex expressions the bounds let through parse and check on a
    /// tenth of [`COMPILE_STACK_BYTES`]: the compile thread's stack has a tenfold margin.
    #[test]
    fn expressions_at_the_bounds_compile_on_a_tenth_of_the_compile_stack() {
        let chain = vec!["a"; MAX_EXPR_OPERATORS - MAX_EXPR_NESTING].join(" + ");
        let worst = [
            format!("{}{chain}{}", "(".repeat(MAX_EXPR_NESTING), ")".repeat(MAX_EXPR_NESTING)),
            format!("{}a", "!".repeat(MAX_EXPR_NESTING)),
            format!("{}a{}", "size(".repeat(MAX_EXPR_NESTING), ")".repeat(MAX_EXPR_NESTING)),
            format!("{}a{}", "[".repeat(MAX_EXPR_NESTING), "]".repeat(MAX_EXPR_NESTING)),
            vec!["a"; MAX_EXPR_OPERATORS + 1].join("+"),
            format!("a{}", ".b".repeat(MAX_EXPR_OPERATORS)),
        ];
        for text in worst {
            assert!(text.len() <= MAX_EXPR_BYTES, "{} bytes", text.len());
            check_shape(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            let schema = fields(&["a"]);
            std::thread::Builder::new()
                .stack_size(COMPILE_STACK_BYTES / 10)
                .spawn(move || {
                    // Compiles (or fails as a type error), and drops, within the stack.
                    let _ = compile_checked(&text, &schema);
                })
                .unwrap()
                .join()
                .unwrap();
        }
    }

    #[test]
    fn string_literals_do_not_count_as_nesting_or_operators() {
        let shape = |t: &str| shape_of(t.as_bytes());
        assert_eq!(shape("a + b"), Shape { nesting: 0, operators: 1 });
        assert_eq!(shape("(a == 'x(((+++')"), Shape { nesting: 1, operators: 1 });
        assert_eq!(shape(r#"a + "\"(((" + b"#), Shape { nesting: 0, operators: 2 });
        assert_eq!(shape("'''a'b(((''' + b"), Shape { nesting: 0, operators: 1 });
        // A raw string ends at its quote: what follows is counted.
        assert_eq!(shape(r"r'\' + a + ((b))"), Shape { nesting: 2, operators: 2 });
        assert_eq!(shape("!!-a - -b"), Shape { nesting: 3, operators: 5 });
        assert_eq!(shape("a.b.c(d, e)"), Shape { nesting: 1, operators: 3 });
        assert!(check_shape(&"a+".repeat(MAX_EXPR_BYTES)).unwrap_err().to_string().contains("too long"));
    }
}
