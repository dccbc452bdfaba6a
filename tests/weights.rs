//! Weights: torchvision's init schemes, safetensors round trips, and load errors that name the
//! tensor at fault.

use workshop::model::weights::{Weights, write_tensors};
use workshop::model::{Tensor, zoo};

#[test]
fn seeded_init_is_deterministic_and_follows_torchvision() {
    let g = zoo::build("resnet18").unwrap();
    let a = Weights::init(&g, 3);
    assert_eq!(a, Weights::init(&g, 3));
    assert_ne!(
        a.get("conv1.weight"),
        Weights::init(&g, 4).get("conv1.weight")
    );
    // kaiming_normal_(mode="fan_out"): std = sqrt(2 / (64·7·7)) ≈ 0.0289 for conv1.
    let w = &a.get("conv1.weight").unwrap().data;
    let std = (w.iter().map(|v| (v * v) as f64).sum::<f64>() / w.len() as f64).sqrt();
    assert!(
        (std - (2.0f64 / (64.0 * 49.0)).sqrt()).abs() < 0.002,
        "conv1 std {std}"
    );
    // The fc layer keeps PyTorch's default: uniform(±1/sqrt(512)).
    let fc = &a.get("fc.weight").unwrap().data;
    let bound = 1.0 / 512f32.sqrt();
    assert!(fc.iter().all(|v| v.abs() <= bound) && fc.iter().any(|v| v.abs() > 0.9 * bound));
    assert!(
        a.get("bn1.running_var")
            .unwrap()
            .data
            .iter()
            .all(|&v| v == 1.0)
    );
}

#[test]
fn safetensors_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let g = zoo::build("mobilenet_v2").unwrap();
    let w = Weights::init(&g, 1);
    w.save(&path, &g).unwrap();
    assert_eq!(Weights::load(&path, &g).unwrap(), w);
}

#[test]
fn load_errors_name_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let g = zoo::build("resnet18").unwrap();
    let w = Weights::init(&g, 1);
    let path = dir.path().join("r.safetensors");

    // Wrong shape.
    let mut bad = w.clone();
    bad.tensors.insert(
        "layer2.0.conv1.weight".into(),
        Tensor::zeros(vec![128, 64, 1, 1]),
    );
    bad.save(&path, &g).unwrap();
    let e = Weights::load(&path, &g).unwrap_err().to_string();
    assert!(
        e.contains("`layer2.0.conv1.weight` has shape [128, 64, 1, 1]")
            && e.contains("[128, 64, 3, 3]"),
        "{e}"
    );

    // Missing tensor.
    let mut bad = w.clone();
    bad.tensors.remove("fc.bias");
    bad.save(&path, &g).unwrap();
    let e = Weights::load(&path, &g).unwrap_err().to_string();
    assert!(e.contains("tensor `fc.bias` is missing"), "{e}");

    // A file for another network.
    let other = zoo::build("resnet34").unwrap();
    Weights::init(&other, 1).save(&path, &other).unwrap();
    let e = Weights::load(&path, &g).unwrap_err().to_string();
    assert!(
        e.contains("`layer1.2.bn1.bias` is not part of resnet18"),
        "{e}"
    );

    // Not a safetensors file at all.
    std::fs::write(&path, b"definitely not safetensors").unwrap();
    let e = Weights::load(&path, &g).unwrap_err().to_string();
    assert!(e.contains("is not a safetensors file"), "{e}");

    // Tensor files written by `infer` read back.
    let t = Tensor::new(vec![2, 2], vec![1.0, 2.0, 3.0, 4.0]);
    write_tensors(&path, &[("logits", &t)]).unwrap();
    assert_eq!(
        workshop::model::weights::read_tensor(&path, "logits").unwrap(),
        t
    );
}
