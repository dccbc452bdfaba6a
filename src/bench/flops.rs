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
    /// Where the layer ran inside a kernel of several layers (fused at run time): that group's
    /// name (see [`FlopsProfile::fused`]). Its time is the group's, counted in the group's
    /// nearest container, not in the layer's own row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fused_in: Option<String>,
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
    /// Layers that ran as one kernel (the CPU's fused pointwise and depthwise convolutions),
    /// each group as one row: its layers' params, MACs, FLOPs and bytes, the kernel's time.
    /// Named after the layers (`features.2.block.{0.0, 1.0, 2.0}`), the kernel as its layer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fused: Vec<Module>,
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
    // What a layer's output costs in memory, written and read back: a group that runs as one
    // kernel keeps its inner layers' outputs on chip.
    let id_of: HashMap<&str, usize> = (graph.nodes.iter().enumerate())
        .map(|(id, n)| (n.name.as_str(), id))
        .collect();
    let round_trip = |name: &str| {
        id_of.get(name).map_or(0, |&id| {
            (plan.shapes[id].iter()).fold(2 * precision.bytes() as u64, |n, &d| {
                n.saturating_mul(d as u64)
            })
        })
    };
    let mut fused: Vec<Module> = Vec::new();
    for k in kernels {
        if !k.fused.is_empty() {
            fused_kernel(&mut tree, &leaf_of, &round_trip, &mut fused, k);
            continue;
        }
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
        fused,
    }
}

/// A kernel of several layers into `tree`: its time to the layers' nearest container, each
/// layer marked as run in the group, the group's row in `groups` made or its time added to.
/// The group's bytes are its layers' less `round_trip` of each output but the last.
fn fused_kernel(
    tree: &mut Tree,
    leaf_of: &HashMap<String, usize>,
    round_trip: &dyn Fn(&str) -> u64,
    groups: &mut Vec<Module>,
    k: &KernelTime,
) {
    // The layers in network order (the tree's rows are in first-seen order).
    let mut layers: Vec<&str> = std::iter::once(&k.node)
        .chain(&k.fused)
        .map(String::as_str)
        .collect();
    layers.sort_by_key(|n| leaf_of.get(*n).copied().unwrap_or(usize::MAX));
    let parts: Vec<Vec<&str>> = layers.iter().map(|n| n.split('.').collect()).collect();
    // The path all the layers share, short of every layer's own name.
    let shortest = parts.iter().map(Vec::len).min().unwrap_or(1);
    let shared = (0..shortest - 1)
        .take_while(|&i| parts.iter().all(|p| p[i] == parts[0][i]))
        .count();
    let container = parts[0][..shared].join(".");
    let rest: Vec<String> = parts.iter().map(|p| p[shared..].join(".")).collect();
    let name = if container.is_empty() {
        format!("{{{}}}", rest.join(", "))
    } else {
        format!("{container}.{{{}}}", rest.join(", "))
    };
    let at = if container.is_empty() {
        0
    } else {
        tree.path(&container)
    };
    tree.rows[at].latency_ns += k.ns;
    if let Some(g) = groups.iter_mut().find(|g| g.name == name) {
        g.latency_ns += k.ns;
        return;
    }
    let mut group = Module {
        name: name.clone(),
        depth: tree.rows[at].depth + 1,
        layer: format!("{} (one kernel)", k.kernel),
        kind: format!("{} ×{}", k.op, layers.len()),
        calls: 1,
        params: 0,
        macs: 0,
        flops: 0,
        bytes: 0,
        latency_ns: k.ns,
        fused_in: None,
    };
    let mut kept = 0u64;
    for (i, layer) in layers.iter().enumerate() {
        let Some(&m) = leaf_of.get(*layer) else {
            continue;
        };
        let row = &mut tree.rows[m];
        row.fused_in = Some(name.clone());
        group.params += row.params;
        group.macs += row.macs;
        group.flops += row.flops;
        group.bytes += row.bytes;
        if i + 1 < layers.len() {
            kept = kept.saturating_add(round_trip(layer));
        }
    }
    group.bytes = group.bytes.saturating_sub(kept);
    groups.push(group);
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
            fused_in: None,
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
            fused: Vec::new(),
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

    /// A kernel of three layers (the CPU's fused pointwise → depthwise → pointwise) is one
    /// row named after them, timed once, in their block's total; its layers say where their
    /// time went, and the group's bytes leave out the two outputs it keeps on chip.
    #[test]
    fn a_fused_kernel_is_one_row_timed_in_its_block() {
        let plan = zoo::build("mobilenet_v3_large")
            .unwrap()
            .plan(1, 224, 224)
            .unwrap();
        let layers = [
            "features.2.block.0.0",
            "features.2.block.1.0",
            "features.2.block.2.0",
        ];
        let fused = KernelTime {
            fused: vec![layers[0].into(), layers[2].into()],
            ..kt(layers[1], 700)
        };
        // Timed in two parts, as a kernel run over the batch in pieces would be.
        let kernels = vec![fused.clone(), fused, kt("features.3.block.0.0", 50)];
        let p = profile(&plan, Precision::Fp32, &kernels, 1, 0.1, Limits::default());
        assert_eq!(p.root().latency_ns, 1450);
        assert_eq!(p.module("features.2.block").unwrap().latency_ns, 1400);
        assert_eq!(p.module("features.2").unwrap().latency_ns, 1400);
        let [group] = &p.fused[..] else {
            panic!("one group: {:?}", p.fused);
        };
        assert_eq!(group.name, "features.2.block.{0.0, 1.0, 2.0}");
        assert_eq!(group.latency_ns, 1400);
        let rows: Vec<&Module> = layers.iter().map(|l| p.module(l).unwrap()).collect();
        for row in &rows {
            assert_eq!(row.fused_in.as_deref(), Some(group.name.as_str()));
            assert_eq!(row.latency_ns, 0, "{}: its time is the group's", row.name);
        }
        assert_eq!(group.flops, rows.iter().map(|r| r.flops).sum::<u64>());
        assert_eq!(group.macs, rows.iter().map(|r| r.macs).sum::<u64>());
        // 16 → 64 channels at 112², then 64 at 56² (stride 2): written and read back, 4 bytes.
        let inner = 2 * 4 * (64 * 112 * 112 + 64 * 56 * 56);
        assert_eq!(
            group.bytes,
            rows.iter().map(|r| r.bytes).sum::<u64>() - inner
        );
        assert!(p.module("features.3.block.0.0").unwrap().fused_in.is_none());
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
