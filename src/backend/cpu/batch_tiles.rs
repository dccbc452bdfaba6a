//! Batch tiles for a network's first layers: where a batch's early activations outgrow the
//! last-level cache, a pass runs the nodes up to a cut a few images at a time, then joins the
//! images and runs the rest on the whole batch. Tiles nest: the largest activations (the first
//! layers') get the smallest tiles, the next layers larger ones.
//!
//! Every op still runs on its own, unfused, in graph order, with the same kernels and the same
//! results bit for bit (each image's values depend on that image alone); what changes is how
//! many images each call sees. ResNet-50's layer1 holds 3.2 MB per image in every tensor, so
//! at batch 8 each of its batch norms, ReLUs and adds streams 26 MB tensors that barely miss
//! a 32 MB L3 and go to memory; in tiles of 2 images they stay in cache. Past the last cut the
//! weights outweigh the activations and the whole batch shares each read of them.

use std::ops::Range;

use crate::model::Plan;

/// One level of tiles: nodes up to `end` (inclusive) run `tile` images at a time, or fewer
/// (the parts of a batch or of an outer level's tile are cut as evenly as they go).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Level {
    pub end: usize,
    pub tile: usize,
}

/// The levels, innermost (earliest cut, smallest tile) first; each later one ends later and
/// has larger tiles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    pub levels: Vec<Level>,
}

impl Split {
    /// The most images one call of node `id` sees in a batch of `n`.
    pub fn images(&self, id: usize, n: usize) -> usize {
        let mut size = n;
        for level in self.levels.iter().rev().filter(|l| id <= l.end) {
            size = parts(0..size, level.tile)
                .map(|p| p.len())
                .max()
                .unwrap_or(size);
        }
        size
    }

    /// "2 images up to layer2.0.relu, 4 up to layer2.3.relu", with the images per call a batch
    /// of `n` gets and the node names from `name`.
    pub fn describe(&self, n: usize, name: impl Fn(usize) -> String) -> String {
        let said: Vec<String> = (self.levels.iter())
            .map(|l| (self.images(l.end, n), l.end))
            .map(|(images, end)| {
                let s = if images == 1 { "" } else { "s" };
                format!("{images} image{s} up to {}", name(end))
            })
            .collect();
        said.join(", ")
    }

    /// The (node name, tile) pairs [`at`] takes back, names from `name`.
    pub fn spec(&self, name: impl Fn(usize) -> String) -> Vec<(String, usize)> {
        self.levels.iter().map(|l| (name(l.end), l.tile)).collect()
    }
}

/// `images` cut into parts of at most `tile`, as even as they go.
pub fn parts(images: Range<usize>, tile: usize) -> impl Iterator<Item = Range<usize>> {
    let (start, n) = (images.start, images.len());
    let count = n.div_ceil(tile.max(1)).max(1);
    (0..count).map(move |i| start + i * n / count..start + (i + 1) * n / count)
}

/// The split of `plan`'s batch for a last-level cache of `cache` bytes at `elem` bytes per
/// value, or `None` where no split pays.
///
/// A node *spills* where the values it reads and writes for the whole batch (an in-place
/// operand counted as read and written) exceed the share of the cache tiles may fill
/// ([`TILE_SHARE`]; the rest holds weights and scratch): tiling the batch saves about those
/// bytes of memory traffic. (Counted against the whole cache, a fused graph's convolutions —
/// their residual add and activation inside — never spilled, so `--compile` got no tiles
/// where eager did, and ResNet-50 b8 ran 5% slower fused than with tiles, in FP32 and BF16
/// alike, on a Zen 4 with 32 MB of L3; eager's tiles stayed as they were.) It costs a read of
/// the node's weights for every part after the first. The last cut is the point, among those
/// that leave a single value live (a block's output: the only place to join the images
/// without holding more), where the bytes saved minus the bytes spent (counting every node up
/// to it in the smallest tiles) are largest, if that is above zero. Up to it, each node asks
/// for as many images as keep the values live while it runs ([`Plan::live_bytes`], as the
/// memory estimate counts them) within [`TILE_SHARE`] of the cache; each tile size asked for
/// ends at the first cut after the last node asking for it or less (and after the ops that
/// only map that cut's value), the largest at the last cut.
pub fn plan(plan: &Plan, elem: usize, cache: usize) -> Option<Split> {
    within(plan, elem, (cache as f64 * TILE_SHARE) as usize)
}

/// [`plan`] with `budget` bytes of cache for a tile's live values.
fn within(plan: &Plan, elem: usize, budget: usize) -> Option<Split> {
    let n = plan.batch();
    let nodes = plan.graph.nodes.len();
    if n < 2 || nodes < 2 || budget == 0 {
        return None;
    }
    let bytes = |id: usize| plan.shapes[id].iter().product::<usize>() * elem;
    let weights = |id: usize| {
        let params: usize = (plan.graph.nodes[id].op.params().iter())
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        params * elem
    };
    let live = plan.live_bytes(elem as u64);
    // Images each node may see at a time.
    let mut asks = Vec::new();
    let (mut saved, mut spent) = (0, 0);
    let mut best: Option<(isize, usize)> = None;
    for (e, node) in plan.graph.nodes.iter().enumerate().take(nodes - 1) {
        // Only tensors whose first dimension is the batch can be cut into images: (N, F),
        // tokens (N, T, D) and images (N, C, H, W). (Tokens stopped the tiles at ConvNeXt's
        // stem until they counted: its first stage's 4×-wide MLP tensors, 38.5 MB at batch
        // 8 in FP32, then went through memory.)
        if !matches!(plan.shapes[e].len(), 2..=4) || plan.shapes[e][0] != n {
            break;
        }
        let read: usize = node.inputs.iter().map(|&i| bytes(i)).sum();
        if read + bytes(e) > budget {
            saved += read + bytes(e);
        }
        spent += weights(e);
        asks.push((budget * n / (live[e] as usize).max(1)).clamp(1, n));
        let smallest = asks.iter().copied().min().unwrap_or(n);
        if smallest >= n || !is_cut(plan, e) {
            continue;
        }
        let again = (n.div_ceil(smallest) - 1) * spent;
        let score = saved as isize - again as isize;
        // A cut must save at least twice the weight bytes it reads again: each part's GEMMs
        // also pack those weights anew and run on fewer rows, which the bytes leave out.
        // ViT-B/16 at batch 8 (FP32, 32 MB L3) saved 1.8× with tiles of 3 images through its
        // whole encoder and ran 1.0% slower (7 of 8 interleaved rounds, Zen 5); the networks
        // that gain save 5× (ConvNeXt-T) to hundreds of times (EfficientNet-B0).
        // The later cut of two that score the same: its last ops run on the tiles too.
        if score > 0 && saved >= 2 * again && best.is_none_or(|(s, _)| score >= s) {
            best = Some((score, e));
        }
    }
    let (_, last) = best?;
    let mut tiles: Vec<usize> = asks[..=last].to_vec();
    tiles.sort_unstable();
    tiles.dedup();
    let mut levels: Vec<Level> = Vec::new();
    for tile in tiles.into_iter().filter(|&t| t < n) {
        let asker = (0..=last).rev().find(|&id| asks[id] <= tile)?;
        let mut end = (asker..=last).find(|&e| is_cut(plan, e))?;
        // Through the ops that only map the cut's value (a block's last ReLU): the join then
        // comes after them, at the block's output.
        while end < last && is_cut(plan, end + 1) && plan.graph.nodes[end + 1].inputs == [end] {
            end += 1;
        }
        match levels.last() {
            // Not past the smaller tiles' cut: they cover it.
            Some(l) if l.end >= end => {}
            _ => levels.push(Level { end, tile }),
        }
    }
    // The largest tiles reach the last cut: the nodes past the last one asking for them
    // spill, or the cut would not be there.
    if let Some(outer) = levels.last_mut() {
        outer.end = last;
    }
    // A level whose parts come out no larger than the level inside it (4 images in tiles of
    // 3 are 2 + 2) adds a join and nothing else.
    let mut split = Split { levels };
    while let Some(i) = (1..split.levels.len()).find(|&i| {
        let l = &split.levels;
        split.images(l[i].end, n) <= split.images(l[i - 1].end, n)
    }) {
        split.levels[i - 1].end = split.levels[i].end;
        split.levels.remove(i);
    }
    Some(split).filter(|s| !s.levels.is_empty())
}

/// The share of the last-level cache a tile's live values may fill; the rest holds weights,
/// the kernels' scratch (im2col columns, Winograd's transformed tiles) and whatever else runs.
/// ResNet-50 FP32 on a Zen 5 VM (32 MB L3, 9.6 MB live an image in layer1), one cut after
/// layer2, interleaved: batch 8 in tiles of 1, 2, 3, 4 images ran 9%, 9%, 8%, 5% faster than
/// whole; batch 32 in tiles of 1, 2, 4, 8: 1%, 6%, 7%, 4%. Two thirds makes tiles of 2 for
/// layer1, 4 for most of layer2. A third fits a cache shared with other tenants better (a VM's
/// 2 vCPUs on a Zen 4 with 32 MB of L3, five interleaved rounds against two thirds): the fused
/// MobileNetV3-Large FP32 b8 28.6 vs 31.5 ms (two thirds gave it larger tiles than eager's,
/// and `--compile` ran 3% slower than eager; now 5% faster), ResNet-50 FP32 b8 251.5 vs 254.6,
/// b32 1046 vs 1062, BF16 b8 159.0 vs 160.6, MobileNetV3 BF16 equal.
pub const TILE_SHARE: f64 = 1.0 / 3.0;

/// The shares of the cache max-autotune plans splits for besides [`TILE_SHARE`]: which one
/// runs fastest depends on the network and on what else fills the cache. MobileNetV3-Large
/// FP32 b8 on a Zen 4 VM ran 4–6% faster with a twelfth (smaller tiles, later cuts), while
/// EfficientNet-B0 BF16 ran 2–3% slower with it.
const OTHER_SHARES: [f64; 3] = [2.0 / 3.0, 1.0 / 6.0, 1.0 / 12.0];

/// The splits worth timing for `plan`, each once, the default ([`plan`]) first: those
/// planned for other shares of the cache, and none (`None`). Only splits [`at`] can name
/// (see [`Split::spec`]) are offered.
pub fn candidates(plan: &Plan, elem: usize, cache: usize) -> Vec<Option<Split>> {
    let name = |id: usize| plan.graph.nodes[id].name.clone();
    let mut found = vec![self::plan(plan, elem, cache)];
    for share in OTHER_SHARES {
        found.push(within(plan, elem, (cache as f64 * share) as usize));
    }
    found.push(None);
    let mut distinct: Vec<Option<Split>> = Vec::new();
    for split in found {
        let named = (split.as_ref()).is_none_or(|s| at(plan, &s.spec(name)).as_ref() == Ok(s));
        if named && !distinct.contains(&split) {
            distinct.push(split);
        }
    }
    distinct
}

/// Whether the images can be joined after node `e`: nothing before it is read after it, it is
/// read after it, and it is not the output.
fn is_cut(plan: &Plan, e: usize) -> bool {
    e != plan.graph.output && (0..e).all(|v| plan.last_use[v] <= e) && plan.last_use[e] > e
}

/// The split asked for by name: (node, tile) pairs, each cut after the last node of its name,
/// in order along the network with tiles growing.
pub fn at(plan: &Plan, asked: &[(impl AsRef<str>, usize)]) -> Result<Split, String> {
    let mut levels: Vec<Level> = Vec::new();
    for (node, tile) in asked {
        let (node, tile) = (node.as_ref(), *tile);
        let end = (plan.graph.nodes.iter())
            .rposition(|n| n.name == node)
            .ok_or_else(|| format!("the network has no node `{node}`"))?;
        if !is_cut(plan, end) {
            return Err(format!(
                "the images cannot be joined after `{node}`: values before it are read after it"
            ));
        }
        if tile == 0 {
            return Err(format!("`{node}`: a tile holds at least one image"));
        }
        if let Some(inner) = levels.last()
            && (inner.end >= end || inner.tile >= tile)
        {
            return Err(format!(
                "`{node}:{tile}` must come after its inner level's node and have more images"
            ));
        }
        levels.push(Level { end, tile });
    }
    Ok(Split { levels })
}

/// The last-level cache in bytes: Linux's report for cpu0's deepest unified cache, else AMD's
/// CPUID leaf 0x8000_0006 (EDX: L3 in 512 KiB units), else 8 MiB.
pub fn last_level_cache() -> usize {
    if let Some(bytes) = sysfs_llc() {
        return bytes;
    }
    match super::cache_leaf() {
        Some((_, edx)) if edx >> 18 > 0 => (edx >> 18) as usize * (512 << 10),
        _ => 8 << 20,
    }
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

    /// ResNet-50 at batch 8 with a 32 MB cache, a third of it for tiles (10.7 MB): its stem,
    /// layer1, layer2 and layer3's first adds spill, and its weights would be read once more.
    /// layer1 and layer2's first block ask for 1 image (9.6 MB live an image), the rest of
    /// layer2 for 2, layer3 for 4.
    #[test]
    fn resnet50_splits_its_early_layers() {
        let graph = zoo::build("resnet50").unwrap();
        let plan = graph.plan(8, 224, 224).unwrap();
        let name = |id: usize| plan.graph.nodes[id].name.clone();
        let split = plan_for(&plan, 32 << 20).expect("a split at batch 8");
        assert_eq!(
            split.describe(8, name),
            "1 image up to layer2.0.relu, 2 images up to layer3.0.relu, 4 images up to layer3.5.relu"
        );
        let conv1 = plan.graph.nodes.iter().position(|n| n.name == "conv1");
        assert_eq!(split.images(conv1.unwrap(), 8), 1);
        assert_eq!(split.images(plan.graph.output, 8), 8);
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
        assert_eq!(split.images(conv1.unwrap(), 32), 1);
        // bf16 values take half the bytes: twice the images a tile.
        let half = super::plan(&plan, 2, 32 << 20).unwrap();
        assert_eq!(
            half.describe(8, name),
            "2 images up to layer2.0.relu, 4 images up to layer2.3.relu"
        );
    }

    /// Tokens (N, T, D) are cut into images as well: ConvNeXt-T at batch 8 with a 32 MB cache
    /// runs its first stage (whose MLP widens 56² tokens to 384 values, 38.5 MB at batch 8)
    /// one image at a time, the second two at a time and the third four, while ViT-B/16, which
    /// would save only 1.8× the weight bytes it read again, keeps its batch whole.
    #[test]
    fn tokens_split_where_the_saving_outweighs_the_weights() {
        let plan = zoo::build("convnext_tiny")
            .unwrap()
            .plan(8, 224, 224)
            .unwrap();
        let name = |id: usize| plan.graph.nodes[id].name.clone();
        let split = plan_for(&plan, 32 << 20).expect("a split at batch 8");
        assert_eq!(
            split.describe(8, name),
            "1 image up to features.2.1, 2 images up to features.4.1, 4 images up to features.5.8.add"
        );
        let mlp = plan
            .graph
            .nodes
            .iter()
            .position(|n| n.name == "features.1.0.block.3");
        assert_eq!(plan.shapes[mlp.unwrap()], [8, 56 * 56, 384]);
        assert_eq!(split.images(mlp.unwrap(), 8), 1);
        let vit = zoo::build("vit_b_16").unwrap().plan(8, 224, 224).unwrap();
        assert_eq!(plan_for(&vit, 32 << 20), None);
    }

    /// The splits max-autotune times for ResNet-50 at batch 8 with a 32 MB cache: the default
    /// first, none last, each once, each named so that [`at`] gives it back; a smaller share
    /// runs single images further (1 up to layer3.5.relu where the default's end at
    /// layer2.0.relu), a larger one has larger tiles.
    #[test]
    fn candidates_are_distinct_and_named() {
        let plan = zoo::build("resnet50").unwrap().plan(8, 224, 224).unwrap();
        let name = |id: usize| plan.graph.nodes[id].name.clone();
        let found = candidates(&plan, 4, 32 << 20);
        assert_eq!(found[0], plan_for(&plan, 32 << 20));
        assert_eq!(found.last(), Some(&None));
        assert!(found.len() >= 3, "{found:?}");
        for (i, split) in found.iter().enumerate() {
            assert!(!found[..i].contains(split), "{split:?} twice");
            if let Some(split) = split {
                assert_eq!(at(&plan, &split.spec(name)).as_ref(), Ok(split));
            }
        }
        // The smallest share runs one image a call further than the default.
        let first_cut = |s: &Split| s.levels[0].end;
        let ones = found.iter().flatten().filter(|s| s.images(0, 8) == 1);
        let furthest = ones.max_by_key(|s| first_cut(s)).unwrap();
        assert!(first_cut(furthest) > first_cut(found[0].as_ref().unwrap()));
        assert_eq!(
            candidates(&plan.graph.plan(1, 224, 224).unwrap(), 4, 32 << 20),
            vec![None]
        );
    }

    #[test]
    fn parts_are_even() {
        let cut = |n: usize, tile| parts(3..3 + n, tile).collect::<Vec<_>>();
        assert_eq!(cut(8, 3), vec![3..5, 5..8, 8..11]);
        assert_eq!(cut(4, 3), vec![3..5, 5..7]);
        assert_eq!(cut(2, 4), vec![3..5]);
        assert_eq!(cut(5, 1).len(), 5);
    }

    fn plan_for(plan: &Plan, cache: usize) -> Option<Split> {
        super::plan(plan, 4, cache)
    }
}
