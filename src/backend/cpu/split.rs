//! Batch tiles for a network's first layers: where a batch's early activations outgrow the
//! last-level cache, a pass runs the nodes up to a cut a few images at a time, then joins the
//! images and runs the rest on the whole batch.
//!
//! Every op still runs on its own, unfused, in graph order, with the same kernels and the same
//! results bit for bit (each image's values depend on that image alone); what changes is how
//! many images each call sees. ResNet-50's layer1 holds 3.2 MB per image for every tensor, so
//! at batch 8 each of its batch norms, ReLUs and adds streams 26 MB tensors that barely miss
//! a 32 MB L3 and go to memory; in tiles of 4 images they stay in cache. Past the cut the
//! weights outweigh the activations and the whole batch shares each read of them.

use std::ops::Range;

use crate::model::Plan;

/// Nodes `0..=end` run once per part of the batch (images `parts[i]`), the rest once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    pub end: usize,
    pub parts: Vec<Range<usize>>,
}

impl Split {
    /// The largest part's image count.
    pub fn tile(&self) -> usize {
        self.parts.iter().map(|p| p.len()).max().unwrap_or(0)
    }
}

/// The split of `plan`'s batch for a last-level cache of `cache` bytes at `elem` bytes per
/// value, or `None` where no split pays.
///
/// A node *spills* where the values it reads and writes for the whole batch (an in-place
/// operand counted as read and written) exceed the cache: tiling the batch saves about those
/// bytes of memory traffic. It costs a read of the node's weights for every part after the
/// first. A tile is as many images as keep the values live up to the cut (the most at any node,
/// as [`Plan::memory_estimate`] counts them) within [`TILE_SHARE`] of the cache, at least one,
/// and the parts are as even as they go. The cut is the point, among those that leave a single
/// value live (a block's output: the only place to join the images without holding more), where
/// the bytes saved minus the bytes spent are largest, if that is above zero.
pub fn plan(plan: &Plan, elem: usize, cache: usize) -> Option<Split> {
    let n = plan.batch();
    let nodes = plan.graph.nodes.len();
    if n < 2 || nodes < 2 || cache == 0 {
        return None;
    }
    let bytes = |id: usize| plan.shapes[id].iter().product::<usize>() * elem;
    let weights = |id: usize| {
        let params: usize = (plan.graph.nodes[id].op.params().iter())
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        params * elem
    };
    let (mut saved, mut spent, mut live, mut peak) = (0, 0, 0, 1);
    let mut best: Option<(isize, Split)> = None;
    for (e, node) in plan.graph.nodes.iter().enumerate().take(nodes - 1) {
        // Only tensors whose first dimension is the batch can be cut into images.
        if !matches!(plan.shapes[e].len(), 2 | 4) {
            break;
        }
        let read: usize = node.inputs.iter().map(|&i| bytes(i)).sum();
        if read + bytes(e) > cache {
            saved += read + bytes(e);
        }
        spent += weights(e);
        live += bytes(e);
        peak = peak.max(live);
        for &i in &node.inputs {
            if plan.last_use[i] == e {
                live -= bytes(i);
            }
        }
        let tile = ((cache as f64 * TILE_SHARE) as usize * n / peak).clamp(1, n);
        if tile >= n || !is_cut(plan, e) {
            continue;
        }
        let split = even(e, n, tile);
        let score = saved as isize - ((split.parts.len() - 1) * spent) as isize;
        // The later cut of two that score the same: its last ops run on the tiles too.
        if score > 0 && best.as_ref().is_none_or(|(s, _)| score >= *s) {
            best = Some((score, split));
        }
    }
    best.map(|(_, s)| s)
}

/// The share of the last-level cache a tile's live values may fill; the rest holds weights,
/// the kernels' scratch (im2col columns, Winograd's transformed tiles) and whatever else runs.
/// ResNet-50 FP32 on a Zen 5 VM (32 MB L3, 9.6 MB live an image in layer1), cut after layer2,
/// interleaved: batch 8 in tiles of 1, 2, 3, 4 images ran 9%, 9%, 8%, 5% faster than whole;
/// batch 32 in tiles of 1, 2, 4, 8: 1%, 6%, 7%, 4%. Two thirds makes tiles of 2.
pub const TILE_SHARE: f64 = 2.0 / 3.0;

/// Whether the images can be joined after node `e`: nothing before it is read after it, it is
/// read after it, and it is not the output.
fn is_cut(plan: &Plan, e: usize) -> bool {
    e != plan.graph.output && (0..e).all(|v| plan.last_use[v] <= e) && plan.last_use[e] > e
}

/// Cut after `e`, `n` images in parts of at most `tile`, as even as they go.
fn even(end: usize, n: usize, tile: usize) -> Split {
    let count = n.div_ceil(tile.max(1));
    let parts = (0..count)
        .map(|i| i * n / count..(i + 1) * n / count)
        .collect();
    Split { end, parts }
}

/// The split that cuts after the last node named `node`, in tiles of `tile` images.
pub fn at(plan: &Plan, node: &str, tile: usize) -> Result<Split, String> {
    let end = (plan.graph.nodes.iter())
        .rposition(|n| n.name == node)
        .ok_or_else(|| format!("the network has no node `{node}`"))?;
    if !is_cut(plan, end) {
        return Err(format!(
            "the images cannot be joined after `{node}`: values before it are read after it"
        ));
    }
    Ok(even(end, plan.batch(), tile))
}

/// The last-level cache in bytes: Linux's report for cpu0's deepest unified cache, else AMD's
/// CPUID leaf 0x8000_0006 (EDX: L3 in 512 KiB units), else 8 MiB.
pub fn last_level_cache() -> usize {
    const FALLBACK: usize = 8 << 20;
    if let Some(bytes) = sysfs_llc() {
        return bytes;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // SAFETY: CPUID exists on every x86-64 CPU; leaf 0x8000_0006 is read only where the
        // highest extended leaf includes it.
        #[allow(unused_unsafe)]
        let units = unsafe {
            if __cpuid(0x8000_0000).eax >= 0x8000_0006 {
                (__cpuid(0x8000_0006).edx >> 18) as usize
            } else {
                0
            }
        };
        if units > 0 {
            return units * (512 << 10);
        }
    }
    FALLBACK
}

fn sysfs_llc() -> Option<usize> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best: Option<(u32, usize)> = None;
    for entry in std::fs::read_dir(dir).ok()? {
        let path = entry.ok()?.path();
        let read = |f: &str| std::fs::read_to_string(path.join(f)).ok();
        let (Some(level), Some(kind), Some(size)) = (read("level"), read("type"), read("size"))
        else {
            continue;
        };
        if kind.trim() == "Instruction" {
            continue;
        }
        let level: u32 = level.trim().parse().ok()?;
        let bytes = parse_size(size.trim())?;
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, bytes));
        }
    }
    best.map(|(_, b)| b)
}

/// "32768K" / "1M" / "512" as bytes.
fn parse_size(s: &str) -> Option<usize> {
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let v: usize = digits.parse().ok()?;
    match unit.trim() {
        "" => Some(v),
        "K" | "KB" | "KiB" => Some(v << 10),
        "M" | "MB" | "MiB" => Some(v << 20),
        "G" | "GB" | "GiB" => Some(v << 30),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::zoo;

    #[test]
    fn cache_sizes_parse() {
        assert_eq!(parse_size("32768K"), Some(32 << 20));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("12Q"), None);
    }

    /// ResNet-50 at batch 8 with a 32 MB cache: its stem, layer1 and layer2's adds spill
    /// (layer2's touch 38.5 MB), layer3's do not, and its weights would be read once more.
    #[test]
    fn resnet50_splits_its_early_layers() {
        let graph = zoo::build("resnet50").unwrap();
        let plan = graph.plan(8, 224, 224).unwrap();
        let split = plan_for(&plan, 32 << 20).expect("a split at batch 8");
        assert_eq!(plan.graph.nodes[split.end].name, "layer2.3.relu");
        assert_eq!(split.parts, vec![0..2, 2..4, 4..6, 6..8]);
        let small = graph.plan(1, 224, 224).unwrap();
        assert_eq!(
            plan_for(&small, 32 << 20),
            None,
            "one image: nothing to split"
        );
        let tiny = graph.plan(2, 32, 32).unwrap();
        assert_eq!(plan_for(&tiny, 32 << 20), None, "everything fits");
        let wide = graph.plan(32, 224, 224).unwrap();
        let split = plan_for(&wide, 32 << 20).unwrap();
        assert_eq!((split.parts.len(), split.tile()), (16, 2));
    }

    fn plan_for(plan: &Plan, cache: usize) -> Option<Split> {
        super::plan(plan, 4, cache)
    }
}
