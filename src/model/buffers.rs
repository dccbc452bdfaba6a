//! Activation buffers for a planned graph, backend-free: which buffer holds each value, so that
//! a buffer is reused once every reader of its value has run, and a value that only renames its
//! input (dropout, a flatten in NCHW order) shares its input's buffer. The GPU backends (wgpu,
//! CUDA/HIP) lay their programs out with [`Plan::assign_buffers`]; the CPU backend, whose batch
//! tiles run parts of the batch through the same nodes, reuses buffers at run time with the
//! same best-fit rule ([`take_best_fit`]).

use super::Plan;

/// Remove and return the smallest buffer in `free` that holds at least `need` bytes (`size`
/// says how many a buffer holds): the best-fit rule every backend reuses buffers by.
pub fn take_best_fit<B>(free: &mut Vec<B>, need: u64, size: impl Fn(&B) -> u64) -> Option<B> {
    let best = (free.iter().enumerate())
        .filter(|(_, b)| size(b) >= need)
        .min_by_key(|(_, b)| size(b))
        .map(|(i, _)| i)?;
    Some(free.swap_remove(best))
}

/// The activation buffers of a plan and the buffer of each value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferAssignment {
    /// The buffer of each value (node id).
    pub of: Vec<usize>,
    /// Bytes of each buffer.
    pub bytes: Vec<u64>,
    /// Buffers free after the last node, best fit first when taken with [`Self::scratch`].
    free: Vec<usize>,
}

impl BufferAssignment {
    /// Bytes of all buffers: the activation memory the plan needs at once.
    pub fn total_bytes(&self) -> u64 {
        self.bytes.iter().sum()
    }

    /// A buffer of at least `bytes` for scratch work after the last node (the output's
    /// conversion): a free one that fits, else a new one.
    pub fn scratch(&mut self, bytes: u64) -> usize {
        let bytes_of = &self.bytes;
        match take_best_fit(&mut self.free, bytes, |&b| bytes_of[b]) {
            Some(b) => b,
            None => {
                self.bytes.push(bytes);
                self.bytes.len() - 1
            }
        }
    }
}

impl Plan {
    /// Assign a buffer to every value: node `id`'s output takes `bytes(id)` bytes, or shares
    /// its first input's buffer where `shares_input(id)`. Outputs are placed before the inputs
    /// read for the last time are freed, so no node writes a buffer it reads.
    pub fn assign_buffers(
        &self,
        bytes: impl Fn(usize) -> u64,
        shares_input: impl Fn(usize) -> bool,
    ) -> BufferAssignment {
        let n = self.graph.nodes.len();
        let mut a = BufferAssignment {
            of: vec![usize::MAX; n],
            bytes: Vec::new(),
            free: Vec::new(),
        };
        // Live values per buffer (aliases share one).
        let mut refs: Vec<usize> = Vec::new();
        for (id, node) in self.graph.nodes.iter().enumerate() {
            let b = if shares_input(id) && !node.inputs.is_empty() {
                a.of[node.inputs[0]]
            } else {
                let need = bytes(id);
                let sizes = &a.bytes;
                match take_best_fit(&mut a.free, need, |&b| sizes[b]) {
                    Some(b) => b,
                    None => {
                        a.bytes.push(need);
                        refs.push(0);
                        a.bytes.len() - 1
                    }
                }
            };
            refs[b] += 1;
            a.of[id] = b;
            for i in node.distinct_inputs() {
                if self.last_use[i] == id {
                    let b = a.of[i];
                    refs[b] -= 1;
                    if refs[b] == 0 {
                        a.free.push(b);
                    }
                }
            }
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::zoo;

    #[test]
    fn best_fit_takes_the_smallest_that_holds() {
        let mut free = vec![64u64, 16, 32, 8];
        assert_eq!(take_best_fit(&mut free, 20, |&b| b), Some(32));
        assert_eq!(take_best_fit(&mut free, 100, |&b| b), None);
        assert_eq!(take_best_fit(&mut free, 8, |&b| b), Some(8));
        assert_eq!(free.len(), 2);
    }

    /// Every value's buffer is large enough, no live value shares a buffer with another
    /// unless it renames it, and reuse keeps ResNet-18's buffers far fewer than its values.
    #[test]
    fn buffers_hold_their_values_and_are_reused() {
        let graph = zoo::build("resnet18").unwrap();
        let plan = graph.plan(2, 64, 64).unwrap();
        let bytes = |id: usize| plan.shapes[id].iter().product::<usize>() as u64 * 4;
        let renames = |id: usize| {
            matches!(
                plan.graph.nodes[id].op,
                crate::model::Op::Dropout { .. } | crate::model::Op::Flatten
            )
        };
        let a = plan.assign_buffers(bytes, renames);
        let n = plan.graph.nodes.len();
        assert_values_apart(&plan, &a, bytes, renames);
        assert!(
            a.bytes.len() * 4 < n,
            "{} buffers for {n} values",
            a.bytes.len()
        );
        let mut a2 = a.clone();
        let out = a2.of[plan.graph.output];
        assert_ne!(a2.scratch(1), out, "the output's buffer is still in use");
    }

    /// Every value's buffer holds it, and no two values live at once share a buffer unless
    /// one renames the other.
    fn assert_values_apart(
        plan: &Plan,
        a: &BufferAssignment,
        bytes: impl Fn(usize) -> u64,
        renames: impl Fn(usize) -> bool,
    ) {
        let n = plan.graph.nodes.len();
        for id in 0..n {
            assert!(a.bytes[a.of[id]] >= bytes(id), "value {id}");
        }
        // Live ranges: from the node that makes a value to its last reader.
        for x in 0..n {
            for y in x + 1..n {
                let overlap = y <= plan.last_use[x];
                let renamed = plan.graph.nodes[y].inputs.first() == Some(&x) && renames(y);
                if overlap && !renamed {
                    assert_ne!(a.of[x], a.of[y], "values {x} and {y} are live together");
                }
            }
        }
    }

    /// A node that reads one value twice (`conv(x) + x` fused: x as input and residual)
    /// releases it once: the buffer is not handed out again while a renaming of a later value
    /// still lives (it was, and a linear layer wrote over its own input).
    #[test]
    fn a_value_read_twice_is_released_once() {
        use crate::model::op::Op;
        let graph = crate::model::graph::convolution_mix();
        let w = crate::model::Weights::init(&graph, 1);
        let (graph, _, _) = crate::model::passes::optimize(&graph, w).unwrap();
        let twice = graph.nodes.iter().find(|n| n.inputs.len() == 2);
        assert!(
            twice.is_some_and(|n| n.inputs[0] == n.inputs[1]),
            "{:?}",
            graph.nodes
        );
        let plan = graph.plan(2, 9, 7).unwrap();
        let bytes = |id: usize| plan.shapes[id].iter().product::<usize>() as u64 * 4;
        let renames = |id: usize| matches!(plan.graph.nodes[id].op, Op::Flatten);
        let a = plan.assign_buffers(bytes, renames);
        assert_values_apart(&plan, &a, bytes, renames);
    }
}
