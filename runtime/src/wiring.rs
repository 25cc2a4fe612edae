//! The channels between subtasks, planned from the vertices alone (no channel is created here).
//!
//! Each channel has an id and joins one producer subtask to one consumer subtask. A forward
//! edge joins subtask `i` to subtask `i`; any other edge joins every producer subtask to every
//! consumer subtask. A producer's output on an edge lists its channels in consumer-subtask
//! order (the partitioner picks a channel by consumer subtask); a consumer reads its channels
//! edge by edge, producer subtasks in order.

use crate::plan::{Partition, Vertex};

/// A producer or consumer subtask: `(vertex index, subtask)`.
pub type SubtaskRef = (usize, u32);

/// One output of a subtask: its partitioning and the channels it sends to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedOutput {
    /// How records are spread over `channels`.
    pub partition: Partition,
    /// Channel ids, in consumer-subtask order.
    pub channels: Vec<usize>,
}

/// The channels of a job graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wiring {
    /// `(producer, consumer)` of each channel id.
    pub channels: Vec<(SubtaskRef, SubtaskRef)>,
    /// `inputs[vertex][subtask]`: the channel ids the subtask reads.
    pub inputs: Vec<Vec<Vec<usize>>>,
    /// `outputs[vertex][subtask]`: the subtask's outputs, one per consuming edge.
    pub outputs: Vec<Vec<Vec<PlannedOutput>>>,
}

/// Plans the channels of `vertices` (in topological order, as [`crate::plan::build`] gives them).
pub fn wire(vertices: &[Vertex]) -> Wiring {
    let mut w = Wiring {
        channels: Vec::new(),
        inputs: vertices.iter().map(|v| vec![Vec::new(); v.parallelism as usize]).collect(),
        outputs: vertices.iter().map(|v| vec![Vec::new(); v.parallelism as usize]).collect(),
    };
    for (to, v) in vertices.iter().enumerate() {
        for edge in &v.inputs {
            let from_p = vertices[edge.from].parallelism;
            let mut outputs: Vec<Vec<usize>> = vec![Vec::new(); from_p as usize];
            for j in 0..v.parallelism {
                let producers = if edge.partition == Partition::Forward { j..j + 1 } else { 0..from_p };
                for i in producers {
                    let id = w.channels.len();
                    w.channels.push(((edge.from, i), (to, j)));
                    w.inputs[to][j as usize].push(id);
                    outputs[i as usize].push(id);
                }
            }
            for (i, channels) in outputs.into_iter().enumerate() {
                w.outputs[edge.from][i].push(PlannedOutput { partition: edge.partition.clone(), channels });
            }
        }
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Edge;

    fn vertex(parallelism: u32, inputs: Vec<Edge>) -> Vertex {
        Vertex { nodes: vec![], parallelism, inputs, outputs: vec![] }
    }

    #[test]
    fn forward_joins_equal_subtasks_and_keyed_joins_all() {
        // source (2) ─forward→ map (2) ─keyed→ window (3); source ─rebalance→ sink (1)
        let vertices = vec![
            vertex(2, vec![]),
            vertex(2, vec![Edge { from: 0, partition: Partition::Forward }]),
            vertex(3, vec![Edge { from: 1, partition: Partition::Keyed(vec![0]) }]),
            vertex(1, vec![Edge { from: 0, partition: Partition::Rebalance }]),
        ];
        let w = wire(&vertices);
        assert_eq!(w.channels.len(), 2 + 2 * 3 + 2);
        // Every channel is read by its consumer and written by its producer, exactly once.
        for (id, &((pv, ps), (cv, cs))) in w.channels.iter().enumerate() {
            assert_eq!(w.inputs[cv][cs as usize].iter().filter(|&&c| c == id).count(), 1);
            let written: usize =
                w.outputs[pv][ps as usize].iter().map(|o| o.channels.iter().filter(|&&c| c == id).count()).sum();
            assert_eq!(written, 1);
        }
        let consumers = |v: usize, s: usize, out: usize| -> Vec<SubtaskRef> {
            w.outputs[v][s][out].channels.iter().map(|&c| w.channels[c].1).collect()
        };
        assert_eq!(consumers(0, 1, 0), vec![(1, 1)], "forward: subtask 1 to subtask 1");
        assert_eq!(consumers(0, 1, 1), vec![(3, 0)], "the source's second edge, to the sink");
        assert_eq!(consumers(1, 0, 0), vec![(2, 0), (2, 1), (2, 2)], "keyed: in consumer-subtask order");
        let producers: Vec<SubtaskRef> = w.inputs[2][2].iter().map(|&c| w.channels[c].0).collect();
        assert_eq!(producers, vec![(1, 0), (1, 1)], "a consumer reads its producers in order");
        assert_eq!(w.outputs[2], vec![Vec::<PlannedOutput>::new(); 3], "the window has no consumers");
    }
}
