//! The physical plan: which nodes run chained in one task, how many subtasks each chain has,
//! and how records are partitioned between chains. `keyBy` nodes disappear here: they become
//! the key-group partitioning of the edge into their consumer.

use weir_crds::validate::{NodeKind, ValidatedJob};

/// How an edge distributes records over the consumer's subtasks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Partition {
    /// Subtask i sends to subtask i (same parallelism).
    Forward,
    /// Batches go round-robin to every consumer subtask.
    Rebalance,
    /// By key group of these fields (positions in the record).
    Keyed(Vec<usize>),
}

/// An edge into a vertex.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Edge {
    /// Producing vertex.
    pub from: usize,
    /// Partitioning.
    pub partition: Partition,
}

/// A chain of nodes run by the same tasks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vertex {
    /// Node indexes (into [`ValidatedJob::nodes`]), head first.
    pub nodes: Vec<usize>,
    /// Subtasks.
    pub parallelism: u32,
    /// Incoming edges.
    pub inputs: Vec<Edge>,
    /// Consuming vertices (indexes), in order.
    pub outputs: Vec<usize>,
}

/// Builds the vertices of a validated job, in topological order.
pub fn build(job: &ValidatedJob) -> Vec<Vertex> {
    let nodes = &job.nodes;
    // Effective inputs of every non-keyBy node: (upstream non-keyBy node, key fields if keyed).
    fn resolve(
        nodes: &[weir_crds::validate::Node],
        input: usize,
        key: Option<Vec<usize>>,
        out: &mut Vec<(usize, Option<Vec<usize>>)>,
    ) {
        match &nodes[input].kind {
            NodeKind::KeyBy(k) => {
                let schema = &nodes[input].schema;
                let key =
                    key.or_else(|| Some(k.fields.iter().filter_map(|f| schema.iter().position(|s| s == f)).collect()));
                for &up in &nodes[input].inputs {
                    resolve(nodes, up, key.clone(), out);
                }
            }
            _ => out.push((input, key)),
        }
    }
    let mut effective: Vec<Vec<(usize, Option<Vec<usize>>)>> = vec![Vec::new(); nodes.len()];
    let mut consumers = vec![0usize; nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        if matches!(n.kind, NodeKind::KeyBy(_)) {
            continue;
        }
        let mut ins = Vec::new();
        for &up in &n.inputs {
            resolve(nodes, up, None, &mut ins);
        }
        for (up, _) in &ins {
            consumers[*up] += 1;
        }
        effective[i] = ins;
    }
    let mut vertices: Vec<Vertex> = Vec::new();
    let mut vertex_of = vec![usize::MAX; nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        if matches!(n.kind, NodeKind::KeyBy(_)) {
            continue;
        }
        let ins = &effective[i];
        if let [(up, None)] = ins.as_slice() {
            let v = vertex_of[*up];
            if consumers[*up] == 1 && vertices[v].parallelism == n.parallelism && vertices[v].nodes.last() == Some(up) {
                vertices[v].nodes.push(i);
                vertex_of[i] = v;
                continue;
            }
        }
        let id = vertices.len();
        let inputs = ins
            .iter()
            .map(|(up, key)| {
                let from = vertex_of[*up];
                let partition = match key {
                    Some(k) => Partition::Keyed(k.clone()),
                    None if vertices[from].parallelism == n.parallelism => Partition::Forward,
                    None => Partition::Rebalance,
                };
                vertices[from].outputs.push(id);
                Edge { from, partition }
            })
            .collect();
        vertices.push(Vertex { nodes: vec![i], parallelism: n.parallelism, inputs, outputs: Vec::new() });
        vertex_of[i] = id;
    }
    vertices
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_crds::JobSpec;

    #[test]
    fn chains_stateless_nodes_and_cuts_at_key_by() {
        let job = JobSpec::from_yaml(
            r#"
name: wc
parallelism: 2
sources:
  - name: lines
    uid: lines
    generator: { count: 10, fields: [ { name: line, text: { words: 3, vocabulary: 5 } } ] }
operators:
  - name: words
    flatMap: { split: { field: line, into: word } }
  - name: by-word
    keyBy: { fields: [word] }
  - name: counts
    uid: counts
    aggregate: { aggregates: [ { fn: count, as: n } ] }
sinks:
  - name: out
    uid: out
    parallelism: 1
    file: { path: /tmp/x }
"#,
        )
        .unwrap();
        let v = build(&weir_crds::validate(&job).unwrap());
        assert_eq!(v.len(), 3);
        assert_eq!(v[0].nodes, vec![0, 1], "source + flatMap chained");
        assert_eq!(v[1].nodes, vec![3]);
        assert_eq!(v[1].inputs, vec![Edge { from: 0, partition: Partition::Keyed(vec![0]) }]);
        assert_eq!(v[2].inputs, vec![Edge { from: 1, partition: Partition::Rebalance }], "parallelism differs");
        assert_eq!(v[0].outputs, vec![1]);
    }
}
