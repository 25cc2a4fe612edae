//! Built-in operators.

pub mod accumulators;
pub mod keyed;
pub mod stateless;
pub mod window;

use weir_crds::job::{AggregateFn, AggregateKind};
use weir_crds::validate::NodeKind;

/// What the state of an operator of this kind holds, as recorded with each of its snapshots
/// (`OperatorSnapshot::state_layout`) and compared at restore: a snapshot's state is read only
/// by an operator that holds the same. An aggregate's or a window's accumulators are encoded
/// one after another without their functions' names, so the same bytes would be read as other
/// aggregates (a count as a sum), or not at all (a count as a count and a sum): its layout
/// lists its functions, in order. The fields they read and the names of their outputs may
/// change; so may a window's size. `None` for operators without state.
///
/// These names are stored in snapshots: a name changed here makes every earlier snapshot of
/// that kind of operator unrestorable.
pub fn state_layout(kind: &NodeKind) -> Option<String> {
    let aggregates = |fns: &[AggregateFn]| {
        let names: Vec<&str> = fns
            .iter()
            .map(|f| match f.function {
                AggregateKind::Count => "count",
                AggregateKind::Sum => "sum",
                AggregateKind::Min => "min",
                AggregateKind::Max => "max",
                AggregateKind::Avg => "avg",
            })
            .collect();
        names.join(",")
    };
    Some(match kind {
        NodeKind::Aggregate(a) => format!("aggregate[{}]", aggregates(&a.aggregates)),
        NodeKind::Window(w) => format!("window[{}]", aggregates(&w.aggregates)),
        NodeKind::Dedupe => "dedupe".into(),
        NodeKind::Generator(_) => "generator".into(),
        NodeKind::FileSource(_) => "file source".into(),
        NodeKind::KafkaSource(_) => "kafka source".into(),
        NodeKind::FileSink(_) => "file sink".into(),
        NodeKind::KafkaSink(_) => "kafka sink".into(),
        NodeKind::Map(_)
        | NodeKind::Filter(_)
        | NodeKind::FlatMap(_)
        | NodeKind::KeyBy(_)
        | NodeKind::Stdout
        | NodeKind::Blackhole => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every stateful operator records a layout and only they do; the names are pinned, as
    /// snapshots store them.
    #[test]
    fn stateful_operators_name_their_state_and_the_names_stay_put() {
        let job = crate::load_job(
            r#"
name: layouts
sources:
  - name: lines
    uid: lines
    generator: { count: 10, fields: [ { name: line, text: { words: 3, vocabulary: 5 } }, { name: ts, sequence: {} } ] }
operators:
  - { name: words, flatMap: { split: { field: line, into: word } } }
  - { name: kept, input: words, filter: { expr: "true" } }
  - { name: by-word, input: kept, keyBy: { fields: [word] } }
  - name: counts
    uid: counts
    aggregate: { aggregates: [ { fn: count, as: n }, { fn: sum, field: ts, as: s }, { fn: avg, field: ts, as: a } ] }
  - { name: by-word-2, input: kept, keyBy: { fields: [word] } }
  - name: windows
    uid: windows
    window: { type: tumbling, size: 1s, aggregates: [ { fn: min, field: ts, as: lo }, { fn: max, field: ts, as: hi } ] }
  - { name: by-word-3, input: kept, keyBy: { fields: [word] } }
  - { name: unique, uid: unique, dedupe: {} }
sinks:
  - { name: out, input: counts, uid: out, file: { path: /tmp/x } }
  - { name: w, input: windows, stdout: {} }
  - { name: u, input: unique, blackhole: {} }
"#,
        )
        .unwrap();
        let layouts: Vec<(String, Option<String>)> =
            job.nodes.iter().map(|n| (n.name.clone(), state_layout(&n.kind))).collect();
        let named = |name: &str| layouts.iter().find(|(n, _)| n == name).unwrap().1.as_deref();
        assert_eq!(named("lines"), Some("generator"));
        assert_eq!(named("counts"), Some("aggregate[count,sum,avg]"));
        assert_eq!(named("windows"), Some("window[min,max]"));
        assert_eq!(named("unique"), Some("dedupe"));
        assert_eq!(named("out"), Some("file sink"));
        for (node, (name, layout)) in job.nodes.iter().zip(&layouts) {
            assert_eq!(layout.is_some(), node.kind.is_stateful(), "{name}");
        }
    }
}
