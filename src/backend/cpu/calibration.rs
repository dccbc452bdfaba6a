//! Seeded weights made realistic: batch norm's running statistics measured on a calibration
//! batch (as a trained network's would be), and the calibration session's packed convolutions
//! handed on to the session that runs next where they fit (the [`Donor`]).

use super::session::NodeKernel;
use super::*;
use super::{BackendError, ExecOptions, Session};

/// Batch norm epsilon used in calibration (every zoo network uses PyTorch's default).
pub(super) const BN_EPS: f32 = 1e-5;

/// Per-channel mean and biased variance of an NHWC (or N×C) buffer, accumulated in f64.
pub(super) fn channel_stats<T: Elem>(buf: &[T], c: usize) -> (Vec<f32>, Vec<f32>) {
    let mut sum = vec![0f64; c];
    let mut sq = vec![0f64; c];
    for px in buf.chunks_exact(c) {
        for (i, v) in px.iter().enumerate() {
            let v = v.to_f32() as f64;
            sum[i] += v;
            sq[i] += v * v;
        }
    }
    let n = (buf.len() / c.max(1)).max(1) as f64;
    let mean: Vec<f64> = sum.iter().map(|s| s / n).collect();
    let var = sq
        .iter()
        .zip(&mean)
        .map(|(q, m)| (q / n - m * m).max(0.0) as f32)
        .collect();
    (mean.into_iter().map(|m| m as f32).collect(), var)
}

/// Give randomly initialised batch-norm layers the running statistics of one batch (what a
/// train-mode forward pass with momentum 1 would record). A freshly initialised network in
/// eval mode has mean 0 / variance 1 everywhere, so its activations grow layer after layer
/// and the logits explode (PyTorch gives a loss near 80 for resnet50); calibrated, every layer
/// sees normalised inputs as in training, and the loss on random labels sits near ln(1000).
pub fn calibrate_batch_norm(
    plan: &Plan,
    weights: &mut Weights,
    input: &Tensor,
) -> Result<Calibration, BackendError> {
    let threads = default_threads();
    let pool = worker_pool(threads, Vec::new())?;
    // A calibrating session runs whole batches (the statistics are the whole batch's), but
    // plans the tiles the run's own session will, so that its packed layers fit that session
    // (`Calibration::prepare`); not those of a WORKSHOP_CPU_SPLIT, which may name a compiled
    // graph's nodes that this eager one cannot join at.
    let by_hand =
        crate::settings::get().is_ok_and(|s| s.cpu_split != crate::settings::SplitChoice::Auto);
    let whole = ExecOptions {
        schedule: by_hand.then(|| "off".into()),
        ..ExecOptions::default()
    };
    let mut session = CpuSession::<f32>::new(
        plan,
        Cow::Borrowed(weights),
        pool,
        threads,
        &whole,
        &mut Donor::default(),
    )?;
    // Calibration normalises with batch statistics, so the steps carry gamma and beta.
    for (step, node) in session.steps.iter_mut().zip(&plan.graph.nodes) {
        if let NodeKernel::Affine { scale, shift } = step {
            scale.copy_from_slice(weights.param(&node.name, "weight")?);
            shift.copy_from_slice(weights.param(&node.name, "bias")?);
        }
    }
    session.calibrate = true;
    session.run(input)?;
    for (id, mean, var) in std::mem::take(&mut session.batch_stats) {
        let name = &plan.graph.nodes[id].name;
        let c = mean.len();
        weights.insert(format!("{name}.running_mean"), Tensor::new(vec![c], mean));
        weights.insert(format!("{name}.running_var"), Tensor::new(vec![c], var));
    }
    Ok(Calibration(session))
}

/// The FP32 session that calibrated a network's batch norm, on every core. Its packed weights
/// (Winograd transforms, GEMM panels: most of a session's preparation) do not depend on the
/// statistics, so a CPU run of the same network takes them instead of packing them again.
pub struct Calibration(CpuSession<f32>);

impl Calibration {
    /// The CPU backend's session for `plan` with `opt` on device `dev`, with `weights` (the
    /// weights this calibrated, now with their running statistics): at FP32 it takes over the
    /// packed convolutions that fit its batch (all but the layers whose Winograd tile changes).
    pub fn prepare(
        self,
        dev: usize,
        plan: &Plan,
        weights: Weights,
        opt: &ExecOptions,
    ) -> Result<Box<dyn Session>, BackendError> {
        let mut session = self.0;
        let mut donor = Donor::default();
        if session.plan.graph == plan.graph && opt.precision == Precision::Fp32 {
            donor.0 = std::mem::take(&mut session.steps)
                .into_iter()
                .map(|step| match step {
                    NodeKernel::Conv(p) => Some(p),
                    _ => None,
                })
                .collect();
        }
        // Its activations go before the new session allocates.
        drop(session);
        CpuBackend.prepare_with(dev, plan, Cow::Owned(weights), opt, &mut donor)
    }
}

/// Packed FP32 convolutions by node id, from a session of the same graph, that a new session
/// takes where they fit instead of packing the weights again.
#[derive(Default)]
pub(super) struct Donor(pub(super) Vec<Option<PackedConv<f32>>>);

impl Donor {
    /// Node `id`'s packed convolution as `T`, for output `out` run with `tile`, where there is
    /// one and it fits (only FP32 sessions take any).
    pub(super) fn take<T: Elem>(
        &mut self,
        id: usize,
        tile: Option<winograd::Tile>,
        out: &[usize],
    ) -> Option<PackedConv<T>> {
        let packed = self.0.get_mut(id)?.take()?.for_output(tile, out)?;
        let packed: Box<dyn std::any::Any> = Box::new(packed);
        packed.downcast::<PackedConv<T>>().ok().map(|p| *p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::winograd::Tile;
    use crate::model::zoo;

    /// A session's packed convolutions go to a new session where its layer runs as they were
    /// packed (another batch, the same Winograd tile or none), and only to FP32 sessions.
    #[test]
    fn donor_gives_only_what_fits() {
        let graph = zoo::build("resnet18").unwrap();
        let weights = Weights::init(&graph, 1);
        // At 32 px, layer1 is 8×8: F(4×4) from batch 4 up, F(2×2) below.
        let at = |batch| graph.plan(batch, 32, 32).unwrap();
        let donor = || {
            let plan = at(4);
            let pool = worker_pool(1, Vec::new()).unwrap();
            let session = CpuSession::<f32>::new(
                &plan,
                Cow::Borrowed(&weights),
                pool,
                1,
                &ExecOptions::default(),
                &mut Donor::default(),
            )
            .unwrap();
            let convs = session.steps.into_iter().map(|s| match s {
                NodeKernel::Conv(p) => Some(p),
                _ => None,
            });
            Donor(convs.collect())
        };
        let id = |name: &str| graph.nodes.iter().position(|n| n.name == name).unwrap();
        let (winograd, stem) = (id("layer1.0.conv1"), id("conv1"));
        let shape = |batch: usize, node: usize| at(batch).shapes[node].clone();
        let tile = |p: &PackedConv<f32>| p.winograd.as_ref().map(|w| w.tile());

        let mut d = donor();
        let taken = d.take::<f32>(winograd, Some(Tile::F4), &shape(8, winograd));
        assert_eq!(taken.as_ref().map(tile), Some(Some(Tile::F4)));
        assert!(
            d.take::<f32>(winograd, Some(Tile::F4), &shape(8, winograd))
                .is_none(),
            "taken once only"
        );
        let stem_conv = d.take::<f32>(stem, None, &shape(8, stem));
        assert_eq!(stem_conv.as_ref().map(tile), Some(None));

        let mut d = donor();
        assert!(
            d.take::<f32>(winograd, Some(Tile::F2), &shape(2, winograd))
                .is_none(),
            "packed for F(4×4), asked for F(2×2)"
        );
        assert!(
            d.take::<f32>(stem, Some(Tile::F2), &shape(2, stem))
                .is_none()
        );
        assert!(
            donor()
                .take::<f16>(winograd, Some(Tile::F4), &shape(4, winograd))
                .is_none(),
            "FP32 packing for an FP16 session"
        );
    }
}
