//! Whether a job can restore a snapshot's state: what each operator's state holds, as
//! snapshots record it ([`state_layout`]), and the changes between two versions of a job that
//! leave state nobody can read ([`restore_conflict`]). Pure: the runtime checks a snapshot with
//! it before restoring, and the operator checks a spec change before it stops the running job.

use std::collections::BTreeMap;

use crate::job::{AggregateFn, AggregateKind};
use crate::validate::{NodeKind, ValidatedJob};

/// What the state of an operator of this kind holds, as recorded with each of its snapshots
/// and compared at restore: a snapshot's state is read only by an operator that holds the
/// same. An aggregate's or a window's accumulators are encoded one after another without their
/// functions' names, so the same bytes would be read as other aggregates (a count as a sum),
/// or not at all (a count as a count and a sum): its layout lists its functions, in order
/// (`aggregate[count,sum]`). The fields they read and the names of their outputs may change;
/// so may a window's size. `None` for operators without state.
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

/// Why a job of `max_parallelism` key groups cannot restore a snapshot of `held` key groups:
/// keyed state is partitioned by them.
pub fn max_parallelism_conflict(held: u32, max_parallelism: u32) -> Option<String> {
    (held != max_parallelism).then(|| {
        format!(
            "maxParallelism is {held} in the snapshot and {max_parallelism} in the job; it cannot change once \
             state exists"
        )
    })
}

/// Where a keyed operator's layout says how many fields key its state: `aggregate[count]/key[2]`.
const KEY_PART: &str = "/key[";

/// What the state of `job`'s operator `uid` holds ([`state_layout`]), and for a keyed operator
/// how many fields key it (`aggregate[count]/key[2]`): a key of two values is found under
/// another hash, in another key group, than a key of one, so a snapshot's keys are none of
/// the job's once the keyBy's arity changed. `None` when the job has no stateful operator of
/// that uid.
pub fn state_layout_of(job: &ValidatedJob, uid: &str) -> Option<String> {
    let node = job.nodes.iter().find(|n| n.uid.as_deref() == Some(uid) && state_layout(&n.kind).is_some())?;
    let layout = state_layout(&node.kind)?;
    Some(match node.key.len() {
        0 => layout,
        fields => format!("{layout}{KEY_PART}{fields}]"),
    })
}

/// A layout's parts: what the state holds, and the number of key fields when recorded
/// (layouts written before it was are the first part alone).
fn layout_parts(layout: &str) -> (&str, Option<&str>) {
    match layout.split_once(KEY_PART) {
        Some((holds, key)) => (holds, Some(key.trim_end_matches(']'))),
        None => (layout, None),
    }
}

/// Why `job` cannot restore a snapshot holding state of the uids of `held` (each with the
/// layout the snapshot recorded for it, `None` in snapshots written before layouts were
/// recorded, which are not compared): an operator of a restored uid whose state holds
/// something else or is keyed by another number of fields (compared when the snapshot
/// recorded it), or state of a uid the job no longer has (unless `allow_non_restored_state`).
/// `Ok` lists the uids whose state is dropped (allowed).
pub fn restore_conflict(
    job: &ValidatedJob,
    held: &BTreeMap<String, Option<String>>,
    allow_non_restored_state: bool,
) -> Result<Vec<String>, String> {
    let mut dropped = Vec::new();
    for (uid, layout) in held {
        let Some(wanted) = state_layout_of(job, uid) else {
            dropped.push(uid.clone());
            continue;
        };
        let Some(held) = layout else { continue };
        let ((held, held_key), (wanted, wanted_key)) = (layout_parts(held), layout_parts(&wanted));
        if held != wanted {
            return Err(format!(
                "operator uid `{uid}` holds {held} state in the snapshot and is {wanted} in the job, which \
                 cannot read it; keep its kind and aggregates, or give the changed operator a new uid \
                 (it then starts empty; allowNonRestoredState drops the old uid's state)"
            ));
        }
        if let (Some(held_key), Some(wanted_key)) = (held_key, wanted_key) {
            if held_key != wanted_key {
                return Err(format!(
                    "operator uid `{uid}` holds state keyed by {held_key} field(s) in the snapshot and is keyed \
                     by {wanted_key} in the job, whose keys would find none of it (a key of other values \
                     falls in another key group); keep the keyBy's fields, or give the changed operator a \
                     new uid (it then starts empty; allowNonRestoredState drops the old uid's state)"
                ));
            }
        }
    }
    if !dropped.is_empty() && !allow_non_restored_state {
        return Err(format!(
            "it holds state of operator uid(s) {} that the job no longer has; \
             restore with allowNonRestoredState to drop it",
            dropped.join(", ")
        ));
    }
    Ok(dropped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JobSpec;

    fn job(aggregates: &str) -> ValidatedJob {
        job_keyed_by(aggregates, "word")
    }

    /// The job, its keyed operators keyed by `key` (fields of the words: `word`, `ts`).
    fn job_keyed_by(aggregates: &str, key: &str) -> ValidatedJob {
        let yaml = format!(
            r#"
name: layouts
sources:
  - name: lines
    uid: lines
    generator:
      count: 10
      fields: [ {{ name: line, text: {{ words: 3, vocabulary: 5 }} }}, {{ name: ts, sequence: {{}} }} ]
operators:
  - {{ name: words, flatMap: {{ split: {{ field: line, into: word }} }} }}
  - {{ name: kept, input: words, filter: {{ expr: "true" }} }}
  - {{ name: by-word, input: kept, keyBy: {{ fields: [{key}] }} }}
  - name: counts
    uid: counts
    aggregate: {{ aggregates: [ {aggregates} ] }}
  - {{ name: by-word-2, input: kept, keyBy: {{ fields: [{key}] }} }}
  - name: windows
    uid: windows
    window:
      type: tumbling
      size: 1s
      aggregates: [ {{ fn: min, field: ts, as: lo }}, {{ fn: max, field: ts, as: hi }} ]
  - {{ name: by-word-3, input: kept, keyBy: {{ fields: [{key}] }} }}
  - {{ name: unique, uid: unique, dedupe: {{}} }}
sinks:
  - {{ name: out, input: counts, uid: out, file: {{ path: /tmp/x }} }}
  - {{ name: w, input: windows, stdout: {{}} }}
  - {{ name: u, input: unique, blackhole: {{}} }}
"#
        );
        crate::validate(&JobSpec::from_yaml(&yaml).unwrap()).unwrap()
    }

    const THREE: &str = "{ fn: count, as: n }, { fn: sum, field: ts, as: s }, { fn: avg, field: ts, as: a }";

    /// Every stateful operator has a layout and only they do; the names are pinned, as
    /// snapshots store them.
    #[test]
    fn stateful_operators_name_their_state_and_the_names_stay_put() {
        let job = job(THREE);
        let named = |name: &str| state_layout(&job.nodes.iter().find(|n| n.name == name).unwrap().kind);
        assert_eq!(named("lines").as_deref(), Some("generator"));
        assert_eq!(named("counts").as_deref(), Some("aggregate[count,sum,avg]"));
        assert_eq!(named("windows").as_deref(), Some("window[min,max]"));
        assert_eq!(named("unique").as_deref(), Some("dedupe"));
        assert_eq!(named("out").as_deref(), Some("file sink"));
        for node in &job.nodes {
            assert_eq!(state_layout(&node.kind).is_some(), node.kind.is_stateful(), "{}", node.name);
        }
        assert_eq!(state_layout_of(&job, "counts").as_deref(), Some("aggregate[count,sum,avg]/key[1]"));
        assert_eq!(state_layout_of(&job, "unique").as_deref(), Some("dedupe/key[1]"));
        assert_eq!(state_layout_of(&job, "lines").as_deref(), Some("generator"));
        assert_eq!(state_layout_of(&job, "gone"), None);
    }

    /// Changed aggregates are a conflict naming the uid and both layouts; renamed outputs are
    /// not; unrecorded layouts are not compared; a vanished uid needs
    /// allowNonRestoredState.
    #[test]
    fn a_conflict_names_the_uid_and_what_changed() {
        let held: BTreeMap<String, Option<String>> =
            job(THREE).nodes.iter().filter_map(|n| Some((n.uid.clone()?, state_layout(&n.kind)))).collect();
        assert_eq!(restore_conflict(&job(THREE), &held, false), Ok(vec![]));
        let renamed = "{ fn: count, as: total }, { fn: sum, field: ts, as: s2 }, { fn: avg, field: ts, as: m }";
        assert_eq!(restore_conflict(&job(renamed), &held, false), Ok(vec![]));

        let err = restore_conflict(&job("{ fn: count, as: n }"), &held, false).unwrap_err();
        assert!(
            err.starts_with(
                "operator uid `counts` holds aggregate[count,sum,avg] state in the snapshot and is \
                             aggregate[count] in the job"
            ),
            "{err}"
        );
        let reordered = "{ fn: sum, field: ts, as: s }, { fn: count, as: n }, { fn: avg, field: ts, as: a }";
        assert!(restore_conflict(&job(reordered), &held, true).is_err(), "order matters, allowed or not");

        let mut unrecorded = held.clone();
        unrecorded.insert("counts".into(), None);
        assert_eq!(restore_conflict(&job("{ fn: count, as: n }"), &unrecorded, false), Ok(vec![]));

        let mut more = held.clone();
        more.insert("gone".into(), Some("dedupe".into()));
        let err = restore_conflict(&job(THREE), &more, false).unwrap_err();
        assert!(err.contains("uid(s) gone that the job no longer has"), "{err}");
        assert_eq!(restore_conflict(&job(THREE), &more, true), Ok(vec!["gone".to_string()]));
    }

    /// A keyBy of another number of fields is a conflict (its keys hash elsewhere), named as
    /// such; a snapshot that did not record its key fields is compared by what it holds only.
    #[test]
    fn a_keys_arity_changed_is_a_conflict_when_recorded() {
        let held: BTreeMap<String, Option<String>> = job(THREE)
            .nodes
            .iter()
            .filter_map(|n| Some((n.uid.clone()?, state_layout_of(&job(THREE), n.uid.as_deref()?))))
            .collect();
        assert_eq!(restore_conflict(&job(THREE), &held, false), Ok(vec![]));
        let rekeyed = job_keyed_by(THREE, "word, ts");
        assert_eq!(state_layout_of(&rekeyed, "counts").as_deref(), Some("aggregate[count,sum,avg]/key[2]"));
        let err = restore_conflict(&rekeyed, &held, false).unwrap_err();
        assert!(
            err.starts_with("operator uid `counts` holds state keyed by 1 field(s) in the snapshot and is keyed by 2"),
            "{err}"
        );
        assert!(restore_conflict(&rekeyed, &held, true).is_err(), "allowed or not");
        // Written before key fields were recorded: what it holds is still compared.
        let old: BTreeMap<String, Option<String>> =
            job(THREE).nodes.iter().filter_map(|n| Some((n.uid.clone()?, state_layout(&n.kind)))).collect();
        assert_eq!(restore_conflict(&rekeyed, &old, false), Ok(vec![]));
        let err = restore_conflict(&job_keyed_by("{ fn: count, as: n }", "word, ts"), &old, false).unwrap_err();
        assert!(
            err.contains("holds aggregate[count,sum,avg] state in the snapshot and is aggregate[count] in"),
            "{err}"
        );
    }
}
