//! The FLOPs profiler (`workshop bench --flops-prof-step K`), in the shape DeepSpeed's users
//! know: one forward pass's params, MACs, FLOPs and latency, per module of the network's tree
//! (resnet50 → layer1 → layer1.0 → conv1), with the achieved FLOPS, the efficiency against the
//! device's peak, and each layer's arithmetic intensity against the machine balance.
//!
//! Modules come from the node names, which follow torchvision's module paths; a name used by
//! several nodes (torchvision's shared `relu`) is one module called several times, as in
//! PyTorch. MACs count conv and linear layers only (torchvision's and DeepSpeed's
//! convention); FLOPs add the element-wise work. Latency is the device time of the step's
//! kernels (CPU timers on the CPU backend, timestamp queries on GPUs).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::backend::KernelTime;
use crate::model::{Graph, Plan, Precision};

/// One module of the tree: a layer (leaf) or a container of layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Module {
    /// The dotted path (`layer1.0.conv1`); the root is the network's name.
    pub name: String,
    pub depth: usize,
    /// The layer as PyTorch would print it (`Conv2d(64, 64, kernel_size=(3, 3), ...)`), empty
    /// for containers.
    pub layer: String,
    /// The op kind of a layer (`conv2d`), empty for containers.
    pub kind: String,
    /// Times the layer runs in one forward pass.
    pub calls: usize,
    pub params: u64,
    pub macs: u64,
    pub flops: u64,
    /// Bytes the layers read and write (inputs, weights, outputs) at the run's precision.
    pub bytes: u64,
    pub latency_ns: u64,
}

impl Module {
    /// Achieved GFLOP/s (0 when the module took no measurable time).
    pub fn gflops(&self) -> f64 {
        if self.latency_ns == 0 {
            0.0
        } else {
            self.flops as f64 / self.latency_ns as f64
        }
    }

    /// FLOPs per byte moved.
    pub fn intensity(&self) -> f64 {
        self.flops as f64 / self.bytes.max(1) as f64
    }
}

/// The machine's limits the profile is judged against.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Limits {
    /// Measured GEMM GFLOP/s at the run's precision.
    pub peak_gflops: Option<f64>,
    /// Where the peak comes from (`workshop peak` on a date, or a probe run now).
    pub peak_source: String,
    /// Measured memory bandwidth (triad), GB/s.
    pub bandwidth_gbps: Option<f64>,
    /// The specification's peak, where the device gives one.
    pub theoretical: Option<super::peak::Theoretical>,
}

impl Limits {
    /// FLOPs per byte at which the machine is as fast at computing as at moving data:
    /// layers below it are memory-bound, above it compute-bound (the roofline's ridge point).
    pub fn balance(&self) -> Option<f64> {
        Some(self.peak_gflops? / self.bandwidth_gbps?)
    }

    /// `memory-bound` or `compute-bound` for an intensity, when the balance is known.
    pub fn bound(&self, intensity: f64) -> Option<&'static str> {
        self.balance().map(|b| {
            if intensity < b {
                "memory-bound"
            } else {
                "compute-bound"
            }
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlopsProfile {
    /// The profiled timed iteration, counted from 1.
    pub step: usize,
    pub network: String,
    pub batch_size: usize,
    pub precision: Precision,
    /// Host wall time of the step (run, sync, read back).
    pub host_s: f64,
    pub limits: Limits,
    /// The tree in preorder; `modules[0]` is the whole network.
    pub modules: Vec<Module>,
}

impl FlopsProfile {
    pub fn root(&self) -> &Module {
        &self.modules[0]
    }

    /// Achieved FLOPS over the measured peak.
    pub fn efficiency(&self) -> Option<f64> {
        Some(self.root().gflops() / self.limits.peak_gflops?)
    }

    pub fn module(&self, name: &str) -> Option<&Module> {
        self.modules.iter().find(|m| m.name == name)
    }

    /// Modules at `depth`, in network order.
    pub fn at_depth(&self, depth: usize) -> impl Iterator<Item = &Module> {
        self.modules.iter().filter(move |m| m.depth == depth)
    }

    pub fn max_depth(&self) -> usize {
        self.modules.iter().map(|m| m.depth).max().unwrap_or(0)
    }
}

/// The network's top-level modules (`conv1`, `layer1`, ..., `fc`), in network order.
pub fn top_modules(graph: &Graph) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for n in &graph.nodes {
        let top = n.name.split('.').next().unwrap_or(&n.name);
        if !out.iter().any(|m| m == top) {
            out.push(top.to_string());
        }
    }
    out
}

/// A module's metric, given the module and the whole network.
pub type ModuleMetric = fn(&Module, &Module) -> f64;

/// Per-module metrics a course step records: the name, then the value from a module.
pub const MODULE_METRICS: [(&str, ModuleMetric); 4] = [
    ("latency_ms", |m, _| m.latency_ns as f64 / 1e6),
    ("latency_pct", |m, root| {
        100.0 * m.latency_ns as f64 / root.latency_ns.max(1) as f64
    }),
    ("gflops", |m, _| m.gflops()),
    ("intensity", |m, _| m.intensity()),
];

/// The names of the per-module (`layer1.latency_ms`) and per-op-kind (`op.conv2d.time_pct`)
/// metrics of a network, as a course's profile step records them.
pub fn metric_names(graph: &Graph) -> Vec<String> {
    let mut out = Vec::new();
    for m in top_modules(graph) {
        out.extend(MODULE_METRICS.iter().map(|(k, _)| format!("{m}.{k}")));
    }
    let mut kinds: Vec<&str> = graph.nodes.iter().map(|n| n.op.kind_name()).collect();
    kinds.sort_unstable();
    kinds.dedup();
    out.extend(kinds.iter().map(|k| format!("op.{k}.time_pct")));
    out
}

/// The module tree of `plan` with the kernel times of one iteration.
pub fn profile(
    plan: &Plan,
    precision: Precision,
    kernels: &[KernelTime],
    step: usize,
    host_s: f64,
    limits: Limits,
) -> FlopsProfile {
    let graph = &plan.graph;
    let mut tree = Tree::new(&graph.name);
    let mut leaf_of: HashMap<String, usize> = HashMap::new();
    for (id, node) in graph.nodes.iter().enumerate() {
        let m = tree.path(&node.name);
        leaf_of.insert(node.name.clone(), m);
        let row = &mut tree.rows[m];
        if row.calls == 0 {
            row.layer = node.op.to_string();
            row.kind = node.op.kind_name().to_string();
            // A module's parameters count once however often it runs.
            row.params = node
                .op
                .params()
                .iter()
                .filter(|p| p.kind == crate::model::op::ParamKind::Trainable)
                .map(|p| p.shape.iter().product::<usize>() as u64)
                .sum();
        }
        row.calls += 1;
        row.macs += node.op.macs(&plan.shapes[id]);
        row.flops += plan.node_flops(id);
        row.bytes += plan.node_bytes(id, precision);
    }
    for k in kernels {
        // Kernels outside the graph (the final conversion of the output) become their own leaf.
        let m = match leaf_of.get(k.node.as_str()) {
            Some(&m) => m,
            None => {
                let m = tree.path(&k.node);
                tree.rows[m].kind = k.op.clone();
                tree.rows[m].layer = "(layout and precision conversion of the output)".into();
                leaf_of.insert(k.node.clone(), m);
                m
            }
        };
        tree.rows[m].latency_ns += k.ns;
    }
    FlopsProfile {
        step,
        network: graph.name.clone(),
        batch_size: plan.batch(),
        precision,
        host_s,
        limits,
        modules: tree.preorder(),
    }
}

/// Modules by path with their children in first-seen order.
struct Tree {
    rows: Vec<Module>,
    children: Vec<Vec<usize>>,
    index: HashMap<String, usize>,
}

impl Tree {
    fn new(root: &str) -> Self {
        let mut t = Tree {
            rows: Vec::new(),
            children: Vec::new(),
            index: HashMap::new(),
        };
        t.add(root.to_string(), 0);
        t
    }

    fn add(&mut self, name: String, depth: usize) -> usize {
        self.rows.push(Module {
            name: name.clone(),
            depth,
            layer: String::new(),
            kind: String::new(),
            calls: 0,
            params: 0,
            macs: 0,
            flops: 0,
            bytes: 0,
            latency_ns: 0,
        });
        self.children.push(Vec::new());
        self.index.insert(name, self.rows.len() - 1);
        self.rows.len() - 1
    }

    /// The module of a dotted path, created with its ancestors when new.
    fn path(&mut self, name: &str) -> usize {
        let mut parent = 0;
        let mut end = 0;
        for (depth, part) in name.split('.').enumerate() {
            end += part.len() + usize::from(depth > 0);
            let prefix = &name[..end];
            parent = match self.index.get(prefix) {
                Some(&m) => m,
                None => {
                    let m = self.add(prefix.to_string(), depth + 1);
                    self.children[parent].push(m);
                    m
                }
            };
        }
        parent
    }

    /// Rows in preorder, containers summing their children.
    fn preorder(mut self) -> Vec<Module> {
        fn total(t: &mut Tree, m: usize) {
            for c in t.children[m].clone() {
                total(t, c);
                let child = t.rows[c].clone();
                let row = &mut t.rows[m];
                row.params += child.params;
                row.macs += child.macs;
                row.flops += child.flops;
                row.bytes += child.bytes;
                row.latency_ns += child.latency_ns;
            }
        }
        fn walk(t: &Tree, m: usize, out: &mut Vec<Module>) {
            out.push(t.rows[m].clone());
            for &c in &t.children[m] {
                walk(t, c, out);
            }
        }
        total(&mut self, 0);
        self.rows[0].calls = 1;
        let mut out = Vec::with_capacity(self.rows.len());
        walk(&self, 0, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::zoo;

    fn kt(node: &str, ns: u64) -> KernelTime {
        KernelTime {
            node: node.into(),
            op: "x".into(),
            kernel: "k".into(),
            start_ns: 0,
            ns,
        }
    }

    #[test]
    fn resnet_tree_sums_and_nests() {
        let plan = zoo::build("resnet18").unwrap().plan(2, 224, 224).unwrap();
        let kernels = vec![
            kt("conv1", 100),
            kt("layer1.0.conv1", 30),
            kt("layer1.0.relu", 5),
            kt("layer1.0.relu", 5),
            kt("layer4.1.bn2", 60),
            kt("output", 1),
        ];
        let p = profile(&plan, Precision::Fp32, &kernels, 3, 0.5, Limits::default());
        let root = p.root();
        assert_eq!(root.name, "resnet18");
        assert_eq!(root.params, 11_689_512);
        assert_eq!(
            root.macs,
            2 * 1_814_073_344,
            "torchvision's MACs for batch 2"
        );
        assert_eq!(root.latency_ns, 201);
        let names: Vec<&str> = p.at_depth(1).map(|m| m.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "input", "conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4",
                "avgpool", "flatten", "fc", "output"
            ]
        );
        let l1 = p.module("layer1").unwrap();
        assert_eq!(l1.latency_ns, 40);
        assert_eq!(l1.params, 147_968);
        // The shared relu of a basic block runs twice per pass.
        assert_eq!(p.module("layer1.0.relu").unwrap().calls, 2);
        // Preorder: every module follows its parent, children sum to the parent.
        for (i, m) in p.modules.iter().enumerate().skip(1) {
            let parent = m.name.rsplit_once('.').map_or("resnet18", |(a, _)| a);
            let pi = p.modules.iter().position(|x| x.name == parent).unwrap();
            assert!(pi < i, "{} before its parent", m.name);
        }
        let depth1: u64 = p.at_depth(1).map(|m| m.flops).sum();
        assert_eq!(depth1, root.flops);
        assert_eq!(root.flops, plan.flops());
    }

    #[test]
    fn bound_follows_the_balance() {
        let limits = Limits {
            peak_gflops: Some(80.0),
            bandwidth_gbps: Some(20.0),
            ..Limits::default()
        };
        assert_eq!(limits.balance(), Some(4.0));
        assert_eq!(limits.bound(1.0), Some("memory-bound"));
        assert_eq!(limits.bound(50.0), Some("compute-bound"));
        assert_eq!(Limits::default().bound(1.0), None);
    }
}
