//! The zoo against torchvision's counts (tests/fixtures/zoo-reference.json, made by
//! bench/zoo_reference.py): parameters, state_dict floats and MACs at the network's input size.

use serde_json::Value;
use workshop::model::zoo;

use crate::common::fixture;

#[test]
fn every_network_matches_torchvision_counts() {
    let text = std::fs::read_to_string(fixture("zoo-reference.json")).unwrap();
    let reference: Value = serde_json::from_str(&text).unwrap();
    let models = reference["models"].as_object().unwrap();
    assert_eq!(
        models.len(),
        zoo::NETWORKS.len(),
        "the zoo and the reference list different networks"
    );
    for name in zoo::NETWORKS {
        let r = &models[*name];
        let graph = zoo::build(name).unwrap();
        let size = r["input_size"].as_u64().unwrap() as usize;
        assert_eq!(graph.default_input_size(), size, "{name} input size");
        let plan = graph.plan(1, size, size).unwrap();
        let floats: u64 = graph
            .params()
            .iter()
            .map(|p| p.shape.iter().product::<usize>() as u64)
            .sum();
        assert_eq!(
            graph.param_count(),
            r["params"].as_u64().unwrap(),
            "{name} parameters"
        );
        assert_eq!(
            floats,
            r["state_dict_floats"].as_u64().unwrap(),
            "{name} state_dict floats"
        );
        assert_eq!(
            plan.macs(),
            r["macs_per_image"].as_u64().unwrap(),
            "{name} MACs"
        );
        assert_eq!(plan.output_shape(), &[1, 1000], "{name} output");
    }
}

/// A layer is never also a module holding other layers (a residual add named after its
/// block): the FLOPs profile would list the whole block as that one layer.
#[test]
fn no_layer_is_also_a_container() {
    let mut both = Vec::new();
    for name in zoo::NETWORKS {
        let graph = zoo::build(name).unwrap();
        let names: std::collections::HashSet<&str> =
            graph.nodes.iter().map(|n| n.name.as_str()).collect();
        for n in &graph.nodes {
            let parts: Vec<&str> = n.name.split('.').collect();
            for k in 1..parts.len() {
                let prefix = parts[..k].join(".");
                if names.contains(prefix.as_str()) {
                    both.push(format!("{name}: `{prefix}` (holds `{}`)", n.name));
                }
            }
        }
    }
    both.dedup_by(|a, b| a.split(" (").next() == b.split(" (").next());
    assert!(
        both.is_empty(),
        "layers that are also modules:\n{}",
        both.join("\n")
    );
}

#[test]
fn names_follow_torchvision_state_dicts() {
    let names: Vec<String> = zoo::build("resnet50")
        .unwrap()
        .params()
        .into_iter()
        .map(|p| p.name)
        .collect();
    for expected in [
        "conv1.weight",
        "bn1.running_var",
        "layer1.0.downsample.0.weight",
        "layer4.2.conv3.weight",
        "fc.bias",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "resnet50 lacks {expected}"
        );
    }
    let names: Vec<String> = zoo::build("mobilenet_v2")
        .unwrap()
        .params()
        .into_iter()
        .map(|p| p.name)
        .collect();
    for expected in [
        "features.0.0.weight",
        "features.1.conv.0.0.weight",
        "features.2.conv.1.0.weight",
        "features.18.1.bias",
        "classifier.1.weight",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "mobilenet_v2 lacks {expected}"
        );
    }
    let names: Vec<String> = zoo::build("vgg11_bn")
        .unwrap()
        .params()
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert!(
        names.contains(&"features.1.running_mean".to_string())
            && names.contains(&"classifier.6.weight".to_string())
    );
}

#[test]
fn unknown_network_suggests_the_closest_names() {
    let e = zoo::build("resnet51").unwrap_err().to_string();
    assert!(
        e.contains("unknown network `resnet51` (did you mean `resnet50`?);")
            && e.contains("`workshop models` lists all 80 networks"),
        "{e}"
    );
    // Nothing close: no guess.
    let e = zoo::build("gpt2").unwrap_err().to_string();
    assert!(!e.contains("did you mean"), "{e}");
    let e = zoo::build("ViT_B_16").unwrap_err().to_string();
    assert!(e.contains("(did you mean `vit_b_16`?)"), "{e}");
    let e = zoo::build("resnet").unwrap_err().to_string();
    assert!(
        e.contains("(did you mean `resnet18`, `resnet34` or `resnet50`?)"),
        "{e}"
    );
}

#[test]
fn small_inputs_are_refused_with_the_layer_named() {
    // AlexNet's 11×11 stride-4 stem and three 3×3 stride-2 pools need more than 32×32.
    let e = zoo::build("alexnet")
        .unwrap()
        .plan(1, 32, 32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("alexnet (`features."), "{e}");
}

/// The memory plan counts an attention layer's intermediates (q/k/v and the heads) while it
/// runs, as the CPU allocates them and the GPU programs lay them out: at least its input and
/// four times its output.
#[test]
fn attention_intermediates_are_in_the_memory_plan() {
    let g = zoo::vit_custom("tiny_vit", &crate::common::tiny_vit());
    let plan = g.plan(2, 40, 40).unwrap();
    let live = plan.live_bytes(4);
    let numel = |id: usize| plan.shapes[id].iter().product::<usize>() as u64 * 4;
    let (id, node) = (g.nodes.iter().enumerate())
        .find(|(_, n)| matches!(n.op, workshop::model::op::Op::Attention { .. }))
        .unwrap();
    assert!(
        live[id] >= numel(node.inputs[0]) + 4 * numel(id),
        "{}",
        live[id]
    );
    let peak = plan
        .memory_estimate(workshop::model::Precision::Fp32)
        .activations;
    assert!(peak >= live[id]);
}
