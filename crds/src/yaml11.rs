//! The YAML 1.1 trap. kubectl reads manifests as YAML 1.1, where a plain (unquoted) `y`, `n`,
//! `yes`, `no`, `on` or `off`, in any capitalisation, is a boolean; Weir reads job files as
//! YAML 1.2, where they are strings. `aggregates: [{fn: count, as: n}]` is a valid job file, but
//! pasted into a StreamJob it reaches the API server as `as: false`, whose refusal ("must be of
//! type string") does not say why. [`ambiguous_scalars`] finds every such value, with its line
//! and path, so `weir-runtime validate` can refuse a manifest naming the fix.

use std::fmt;

use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::TScalarStyle;

/// The plain scalars YAML 1.1 reads as booleans and YAML 1.2 as strings (`true` and `false`
/// are booleans in both).
const YAML11_ONLY_BOOLEANS: [&str; 16] =
    ["y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "on", "On", "ON", "off", "Off", "OFF"];

/// A value whose meaning differs between YAML 1.1 (kubectl) and YAML 1.2 (Weir).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ambiguous {
    /// 1-based line of the value.
    pub line: usize,
    /// Where it is, e.g. `spec.job.inline.operators[1].window.aggregates[0].as`.
    pub path: String,
    /// The value as written, e.g. `n`.
    pub word: String,
}

impl Ambiguous {
    /// The boolean YAML 1.1 reads.
    pub fn yaml11_value(&self) -> bool {
        matches!(self.word.to_ascii_lowercase().as_str(), "y" | "yes" | "on")
    }
}

impl fmt::Display for Ambiguous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = self.path.rsplit('.').next().unwrap_or(&self.path);
        let fix = if key.ends_with(']') { format!("- \"{}\"", self.word) } else { format!("{key}: \"{}\"", self.word) };
        write!(
            f,
            "line {}: {}: `{}` is the string \"{}\" to Weir but the boolean {} to kubectl (YAML 1.1); quote it: {fix}",
            self.line,
            self.path,
            self.word,
            self.word,
            self.yaml11_value()
        )
    }
}

/// One level of nesting while walking the events.
enum Frame {
    /// A mapping: the key being read or whose value is being read.
    Map { key: Option<String>, awaiting_key: bool },
    /// A sequence: the index of the next item.
    Seq { index: usize },
}

/// Every unquoted value in `text` that YAML 1.1 reads as a boolean and YAML 1.2 as a string,
/// in document order. Keys are not reported. Fails only when `text` is not YAML.
pub fn ambiguous_scalars(text: &str) -> Result<Vec<Ambiguous>, String> {
    let mut parser = Parser::new_from_str(text);
    let mut stack: Vec<Frame> = Vec::new();
    let mut found = Vec::new();
    loop {
        let (event, marker) = parser.next_token().map_err(|e| e.to_string())?;
        match event {
            Event::StreamEnd => return Ok(found),
            Event::Scalar(value, style, ..) => {
                if let Some(Frame::Map { key, awaiting_key: awaiting @ true }) = stack.last_mut() {
                    *key = Some(value);
                    *awaiting = false;
                    continue;
                }
                if style == TScalarStyle::Plain && YAML11_ONLY_BOOLEANS.contains(&value.as_str()) {
                    found.push(Ambiguous { line: marker.line(), path: path(&stack), word: value });
                }
                advance(&mut stack);
            }
            Event::Alias(_) => {
                if let Some(Frame::Map { awaiting_key: awaiting @ true, .. }) = stack.last_mut() {
                    *awaiting = false;
                    continue;
                }
                advance(&mut stack);
            }
            Event::MappingStart(..) => stack.push(Frame::Map { key: None, awaiting_key: true }),
            Event::SequenceStart(..) => stack.push(Frame::Seq { index: 0 }),
            Event::MappingEnd | Event::SequenceEnd => {
                stack.pop();
                advance(&mut stack);
            }
            Event::DocumentStart | Event::DocumentEnd => stack.clear(),
            Event::Nothing | Event::StreamStart => {}
        }
    }
}

/// A value ended: the enclosing mapping expects a key next, the enclosing sequence its next item.
fn advance(stack: &mut [Frame]) {
    match stack.last_mut() {
        Some(Frame::Map { awaiting_key, .. }) => *awaiting_key = true,
        Some(Frame::Seq { index }) => *index += 1,
        None => {}
    }
}

fn path(stack: &[Frame]) -> String {
    let mut out = String::new();
    for frame in stack {
        match frame {
            Frame::Map { key, .. } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key.as_deref().unwrap_or("?"));
            }
            Frame::Seq { index } => out.push_str(&format!("[{index}]")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_unquoted_yaml11_booleans_with_their_paths() {
        let text = "\
apiVersion: weir.dev/v1alpha1
kind: StreamJob
metadata: {name: counts}
spec:
  job:
    inline:
      operators:
        - name: k
          keyBy: {fields: [word, n]}
        - name: w
          window: {type: tumbling, size: 10s, aggregates: [{fn: count, as: n}, {fn: sum, field: x, as: \"y\"}]}
        - name: m
          map:
            fields:
              - {name: Yes, expr: '1'}
              - name: 'off'
                expr: \"on\"
              - name: ok
                expr: ON
";
        let found = ambiguous_scalars(text).unwrap();
        let at: Vec<(usize, &str, &str)> = found.iter().map(|a| (a.line, a.path.as_str(), a.word.as_str())).collect();
        assert_eq!(
            at,
            vec![
                (9, "spec.job.inline.operators[0].keyBy.fields[1]", "n"),
                (11, "spec.job.inline.operators[1].window.aggregates[0].as", "n"),
                (15, "spec.job.inline.operators[2].map.fields[0].name", "Yes"),
                (19, "spec.job.inline.operators[2].map.fields[2].expr", "ON"),
            ]
        );
        assert_eq!(
            found[1].to_string(),
            "line 11: spec.job.inline.operators[1].window.aggregates[0].as: `n` is the string \"n\" to Weir \
             but the boolean false to kubectl (YAML 1.1); quote it: as: \"n\""
        );
        assert!(found[0].to_string().ends_with("quote it: - \"n\""), "{}", found[0]);
        assert!(found[2].yaml11_value());
    }

    #[test]
    fn quoted_values_keys_and_yaml12_booleans_are_fine() {
        let text = "a: \"n\"\nb: 'yes'\nc: true\nd: false\n'on': 1\ne: [\"y\", 'N', x]\nf: |\n  n\n";
        assert_eq!(ambiguous_scalars(text).unwrap(), vec![]);
        let docs = "a: n\n---\nb: [off]\n";
        let found = ambiguous_scalars(docs).unwrap();
        assert_eq!(found.iter().map(|a| a.path.as_str()).collect::<Vec<_>>(), ["a", "b[0]"]);
        assert!(ambiguous_scalars("a: [").is_err());
    }
}
