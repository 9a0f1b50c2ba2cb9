//! Layout math: where every region of every block lives, and how a transfer's regions
//! coalesce into as few copies and I/Os as possible.
//!
//! A *region* is the bytes of one (block, layer, outer) triple. A layout places regions
//! in one allocation (`FullyContiguous`, and every disk file) or in one allocation per
//! layer (`LayerSeparate`). All math is checked u64 arithmetic done once, in `validate`,
//! so later address computations cannot overflow.

use crate::error::{bail, Result};
use std::ops::Range;

/// Block geometry as given by the caller. Zero means "not set" and is rejected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayoutConfig {
    pub num_blocks: u64,
    pub num_layers: u64,
    /// 2 for separate K and V, 1 for MLA.
    pub outer_dim: u64,
    /// Tokens per block.
    pub page_size: u64,
    /// Elements per token (kv_heads × head_dim).
    pub inner_dim: u64,
    pub dtype_bytes: u64,
}

/// How regions are arranged in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutKind {
    /// One allocation shaped `[block][layer][outer][page][inner]` (TensorRT-LLM's pool).
    FullyContiguous,
    /// One allocation per layer: `[block][outer][page][inner]` when `block_first`, else
    /// `[outer][block][page][inner]` (vLLM's per-layer `[2, num_blocks, ...]`).
    LayerSeparate { block_first: bool },
}

impl LayoutKind {
    /// Number of separate allocations (bases) a layout of this kind needs.
    pub fn num_bases(self, num_layers: u64) -> u64 {
        match self {
            LayoutKind::FullyContiguous => 1,
            LayoutKind::LayerSeparate { .. } => num_layers,
        }
    }
}

/// A validated geometry: the config plus derived sizes that are known not to overflow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub cfg: LayoutConfig,
    /// `page_size × inner_dim × dtype_bytes`.
    pub region_bytes: u64,
    /// `num_layers × outer_dim × region_bytes`.
    pub block_bytes: u64,
}

impl LayoutConfig {
    /// Checks every field and every derived byte size; the error names the field.
    pub fn validate(&self) -> Result<Geometry> {
        let fields = [
            ("num_blocks", self.num_blocks),
            ("num_layers", self.num_layers),
            ("outer_dim", self.outer_dim),
            ("page_size", self.page_size),
            ("inner_dim", self.inner_dim),
            ("dtype_bytes", self.dtype_bytes),
        ];
        for (name, v) in fields {
            if v == 0 {
                bail!(InvalidArg, "layout config: {name} is 0; every dimension must be at least 1");
            }
        }
        if self.outer_dim > 2 {
            bail!(InvalidArg, "layout config: outer_dim is {}; use 2 for separate K and V or 1 for MLA", self.outer_dim);
        }
        if self.num_layers > u32::MAX as u64 {
            bail!(InvalidArg, "layout config: num_layers is {}; at most {} layers are addressable", self.num_layers, u32::MAX);
        }
        let overflow = |field: &str| {
            crate::error::Error::new(
                crate::error::Status::InvalidArg,
                format!("layout config: {field} makes the byte size overflow 64 bits; check the dimensions"),
            )
        };
        let region_bytes = self
            .page_size
            .checked_mul(self.inner_dim)
            .ok_or_else(|| overflow("inner_dim"))?
            .checked_mul(self.dtype_bytes)
            .ok_or_else(|| overflow("dtype_bytes"))?;
        let block_bytes = region_bytes
            .checked_mul(self.outer_dim)
            .ok_or_else(|| overflow("outer_dim"))?
            .checked_mul(self.num_layers)
            .ok_or_else(|| overflow("num_layers"))?;
        // The largest allocation any layout of this geometry needs: the padded disk file.
        let padded = align_up(block_bytes, MAX_IO_ALIGN).ok_or_else(|| overflow("num_layers"))?;
        // Allocations are also addressed as isize, so the total must fit that too.
        padded.checked_mul(self.num_blocks).filter(|&total| total <= isize::MAX as u64).ok_or_else(|| overflow("num_blocks"))?;
        Ok(Geometry { cfg: *self, region_bytes, block_bytes })
    }
}

/// The largest direct-I/O alignment a disk layout may ask for; `validate` checks that a
/// block stride padded to it still fits in 64 bits.
pub const MAX_IO_ALIGN: u64 = 1 << 20;

pub fn align_up(v: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    Some(v.checked_add(align - 1)? & !(align - 1))
}

pub fn align_down(v: u64, align: u64) -> u64 {
    v & !(align - 1)
}

impl Geometry {
    /// Same block geometry (everything but `num_blocks`): what src and dst must share.
    pub fn same_block_shape(&self, other: &Geometry) -> bool {
        let (a, b) = (&self.cfg, &other.cfg);
        (a.num_layers, a.outer_dim, a.page_size, a.inner_dim, a.dtype_bytes)
            == (b.num_layers, b.outer_dim, b.page_size, b.inner_dim, b.dtype_bytes)
    }
}

/// Where one region lives: which base (allocation) and the byte offset inside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loc {
    pub base: u32,
    pub offset: u64,
}

/// A layout's placement rule: kind, geometry and (for fully contiguous) the block stride,
/// which is `block_bytes` in memory and `block_bytes` padded to the I/O alignment on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub kind: LayoutKind,
    pub geom: Geometry,
    pub block_stride: u64,
}

impl Placement {
    pub fn memory(kind: LayoutKind, geom: Geometry) -> Placement {
        Placement { kind, geom, block_stride: geom.block_bytes }
    }

    /// A disk file: fully contiguous, each block padded to `align` (a power of two ≤ MAX_IO_ALIGN).
    pub fn disk(geom: Geometry, align: u64) -> Placement {
        assert!(align.is_power_of_two() && align <= MAX_IO_ALIGN);
        let block_stride = align_up(geom.block_bytes, align).expect("checked by validate");
        Placement { kind: LayoutKind::FullyContiguous, geom, block_stride }
    }

    pub fn num_bases(&self) -> u64 {
        self.kind.num_bases(self.geom.cfg.num_layers)
    }

    /// Bytes each base must hold.
    pub fn base_bytes(&self) -> u64 {
        let c = &self.geom.cfg;
        match self.kind {
            LayoutKind::FullyContiguous => self.block_stride * c.num_blocks,
            LayoutKind::LayerSeparate { .. } => c.num_blocks * c.outer_dim * self.geom.region_bytes,
        }
    }

    /// Location of region (block, layer, outer). Indices must be in range (checked by callers).
    pub fn region(&self, block: u64, layer: u64, outer: u64) -> Loc {
        let c = &self.geom.cfg;
        let r = self.geom.region_bytes;
        debug_assert!(block < c.num_blocks && layer < c.num_layers && outer < c.outer_dim);
        match self.kind {
            LayoutKind::FullyContiguous => Loc { base: 0, offset: block * self.block_stride + (layer * c.outer_dim + outer) * r },
            LayoutKind::LayerSeparate { block_first: true } => Loc { base: layer as u32, offset: (block * c.outer_dim + outer) * r },
            LayoutKind::LayerSeparate { block_first: false } => Loc { base: layer as u32, offset: (outer * c.num_blocks + block) * r },
        }
    }
}

/// A span of bytes with a start on each of its sides (source and destination, file and
/// slot …) that grows by a neighbour contiguous on every side: regions into segments,
/// copies into runs, extents into I/Os all merge through `push_run`.
pub trait Run {
    /// Appends `next` to `self` if it continues `self` on every side; whether it did.
    fn absorb(&mut self, next: &Self) -> bool;
}

/// Pushes `next` onto `runs`, merged into the last run when it continues it.
pub fn push_run<R: Run>(runs: &mut Vec<R>, next: R) {
    if !runs.last_mut().is_some_and(|last| last.absorb(&next)) {
        runs.push(next);
    }
}

/// (start on one side, start on the other, length).
impl Run for (u64, u64, u64) {
    fn absorb(&mut self, next: &Self) -> bool {
        let ok = self.0 + self.2 == next.0 && self.1 + self.2 == next.1;
        if ok {
            self.2 += next.2;
        }
        ok
    }
}

/// One coalesced copy: `len` bytes from `src` to `dst`, contiguous on both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub src: Loc,
    pub dst: Loc,
    pub len: u64,
}

/// Contiguous in the same allocations on both sides.
impl Run for Segment {
    fn absorb(&mut self, next: &Self) -> bool {
        let ok = self.src.base == next.src.base
            && self.dst.base == next.dst.base
            && self.src.offset + self.len == next.src.offset
            && self.dst.offset + self.len == next.dst.offset;
        if ok {
            self.len += next.len;
        }
        ok
    }
}

/// The order in which regions are visited: the storage order both layouts share, so
/// that contiguous neighbours are visited one after the other and merge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WalkOrder {
    /// (block pair, layer, outer): fully contiguous layouts and disk files.
    BlockLayerOuter,
    /// (layer, block pair, outer): block-first layer-separate layouts.
    LayerBlockOuter,
    /// (layer, outer, block pair): outer-first layer-separate layouts.
    LayerOuterBlock,
}

fn walk_order(src: &Placement, dst: &Placement) -> WalkOrder {
    use LayoutKind::*;
    match (src.kind, dst.kind) {
        (LayerSeparate { block_first: false }, LayerSeparate { block_first: false }) => WalkOrder::LayerOuterBlock,
        (LayerSeparate { .. }, LayerSeparate { .. }) => WalkOrder::LayerBlockOuter,
        _ => WalkOrder::BlockLayerOuter,
    }
}

/// Every region a transfer moves, walked in the storage order the two layouts share,
/// with neighbours that are contiguous on both sides merged. Runs of consecutive block
/// ids therefore become single segments: whole runs of blocks between fully contiguous
/// layouts, a run's slice of each layer between layer-separate ones.
pub fn segments(src: &Placement, dst: &Placement, pairs: &[(u64, u64)], layers: Range<u64>) -> Vec<Segment> {
    let outer = src.geom.cfg.outer_dim;
    let r = src.geom.region_bytes;
    let mut out: Vec<Segment> = Vec::new();
    let mut visit = |(sb, db): (u64, u64), layer: u64, o: u64| {
        push_run(&mut out, Segment { src: src.region(sb, layer, o), dst: dst.region(db, layer, o), len: r });
    };
    match walk_order(src, dst) {
        WalkOrder::BlockLayerOuter => {
            for &p in pairs {
                for layer in layers.clone() {
                    (0..outer).for_each(|o| visit(p, layer, o));
                }
            }
        }
        WalkOrder::LayerBlockOuter => {
            for layer in layers.clone() {
                for &p in pairs {
                    (0..outer).for_each(|o| visit(p, layer, o));
                }
            }
        }
        WalkOrder::LayerOuterBlock => {
            for layer in layers.clone() {
                for o in 0..outer {
                    pairs.iter().for_each(|&p| visit(p, layer, o));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(nb: u64, nl: u64, od: u64, ps: u64, id: u64, dt: u64) -> LayoutConfig {
        LayoutConfig { num_blocks: nb, num_layers: nl, outer_dim: od, page_size: ps, inner_dim: id, dtype_bytes: dt }
    }

    const KINDS: [LayoutKind; 3] =
        [LayoutKind::FullyContiguous, LayoutKind::LayerSeparate { block_first: true }, LayoutKind::LayerSeparate { block_first: false }];

    /// Walks storage order with a cursor, the way the shapes in DESIGN.md read.
    fn reference(p: &Placement) -> HashMap<(u64, u64, u64), Loc> {
        let c = p.geom.cfg;
        let r = p.geom.region_bytes;
        let mut m = HashMap::new();
        match p.kind {
            LayoutKind::FullyContiguous => {
                for b in 0..c.num_blocks {
                    let mut cur = b * p.block_stride;
                    for l in 0..c.num_layers {
                        for o in 0..c.outer_dim {
                            m.insert((b, l, o), Loc { base: 0, offset: cur });
                            cur += r;
                        }
                    }
                }
            }
            LayoutKind::LayerSeparate { block_first } => {
                for l in 0..c.num_layers {
                    let mut cur = 0;
                    if block_first {
                        for b in 0..c.num_blocks {
                            for o in 0..c.outer_dim {
                                m.insert((b, l, o), Loc { base: l as u32, offset: cur });
                                cur += r;
                            }
                        }
                    } else {
                        for o in 0..c.outer_dim {
                            for b in 0..c.num_blocks {
                                m.insert((b, l, o), Loc { base: l as u32, offset: cur });
                                cur += r;
                            }
                        }
                    }
                }
            }
        }
        m
    }

    #[test]
    fn region_math_matches_brute_force_for_every_kind() {
        for c in [cfg(5, 3, 2, 4, 7, 2), cfg(1, 1, 1, 1, 1, 1), cfg(9, 4, 1, 16, 33, 4), cfg(3, 2, 2, 32, 4096, 2)] {
            let g = c.validate().unwrap();
            let mut placements: Vec<Placement> = KINDS.iter().map(|k| Placement::memory(*k, g)).collect();
            placements.push(Placement::disk(g, 4096));
            for p in placements {
                let want = reference(&p);
                assert_eq!(want.len() as u64, c.num_blocks * c.num_layers * c.outer_dim);
                for (&(b, l, o), loc) in &want {
                    assert_eq!(p.region(b, l, o), *loc, "{:?} {:?} ({b},{l},{o})", p.kind, c);
                    assert!(loc.offset + g.region_bytes <= p.base_bytes());
                    assert!((loc.base as u64) < p.num_bases());
                }
            }
        }
    }

    #[test]
    fn disk_stride_is_padded_to_the_alignment() {
        let g = cfg(4, 3, 2, 3, 5, 2).validate().unwrap(); // 540-byte blocks
        let p = Placement::disk(g, 4096);
        assert_eq!(p.block_stride, 4096);
        assert_eq!(p.region(2, 0, 0).offset, 8192);
        assert_eq!(p.base_bytes(), 4 * 4096);
    }

    #[test]
    fn validation_names_the_field() {
        let good = cfg(2, 2, 2, 2, 2, 2);
        let cases: [(&str, LayoutConfig); 8] = [
            ("num_blocks", LayoutConfig { num_blocks: 0, ..good }),
            ("num_layers", LayoutConfig { num_layers: 0, ..good }),
            ("outer_dim", LayoutConfig { outer_dim: 0, ..good }),
            ("outer_dim", LayoutConfig { outer_dim: 3, ..good }),
            ("page_size", LayoutConfig { page_size: 0, ..good }),
            ("inner_dim", LayoutConfig { inner_dim: u64::MAX, ..good }),
            ("dtype_bytes", LayoutConfig { dtype_bytes: 0, ..good }),
            ("num_blocks", LayoutConfig { num_blocks: u64::MAX / 8, ..good }),
        ];
        for (field, c) in cases {
            let e = c.validate().unwrap_err();
            assert_eq!(e.status, crate::error::Status::InvalidArg);
            assert!(e.message.contains(field), "{field}: {}", e.message);
        }
        assert!(good.validate().is_ok());
    }

    #[test]
    fn consecutive_blocks_in_contiguous_layouts_coalesce_into_one_segment() {
        let g = cfg(8, 4, 2, 4, 8, 2).validate().unwrap();
        let fc = Placement::memory(LayoutKind::FullyContiguous, g);
        let pairs: Vec<(u64, u64)> = (2..6).map(|b| (b, b + 1)).collect();
        let segs = segments(&fc, &fc, &pairs, 0..4);
        assert_eq!(segs, vec![Segment { src: fc.region(2, 0, 0), dst: fc.region(3, 0, 0), len: 4 * g.block_bytes }]);
        // A gap in the ids splits the run.
        let segs = segments(&fc, &fc, &[(0, 0), (1, 1), (3, 2)], 0..4);
        assert_eq!(segs.len(), 2);
        assert_eq!(segs[0].len, 2 * g.block_bytes);
        // A layer range makes each block its own run: layers 1..3 of block b are contiguous,
        // but layer 3 separates block b from block b+1.
        let segs = segments(&fc, &fc, &pairs, 1..3);
        assert_eq!(segs.len(), 4);
        assert!(segs.iter().all(|s| s.len == 2 * 2 * g.region_bytes));
    }

    #[test]
    fn layer_separate_coalesces_k_and_v_of_a_block_first_layer() {
        let g = cfg(8, 3, 2, 4, 8, 2).validate().unwrap();
        let bf = Placement::memory(LayoutKind::LayerSeparate { block_first: true }, g);
        let of = Placement::memory(LayoutKind::LayerSeparate { block_first: false }, g);
        let disk = Placement::disk(g, 4096);
        let pairs = [(0, 4), (1, 5)];
        // disk → block-first: each (block, layer) is K+V contiguous on both sides.
        let segs = segments(&disk, &bf, &pairs, 0..3);
        assert_eq!(segs.len(), 6);
        assert!(segs.iter().all(|s| s.len == 2 * g.region_bytes));
        // disk → outer-first: K and V of a layer are far apart, so every region stands alone.
        assert_eq!(segments(&disk, &of, &pairs, 0..3).len(), 12);
        // Between layer-separate layouts the walk goes layer by layer, so a run of
        // consecutive ids is one segment per layer (and per outer, outer-first).
        let run: Vec<(u64, u64)> = (0..4).map(|b| (b, b + 2)).collect();
        let segs = segments(&bf, &bf, &run, 0..3);
        assert_eq!(segs.len(), 3);
        assert!(segs.iter().all(|s| s.len == 4 * 2 * g.region_bytes));
        assert_eq!(segments(&of, &of, &run, 0..3).len(), 6);
        assert_eq!(segments(&bf, &of, &run, 0..3).len(), 4 * 3 * 2);
    }

    #[test]
    fn every_segment_byte_maps_to_the_right_region() {
        // Expand segments back into regions and compare with the direct per-region walk.
        let g = cfg(6, 3, 2, 3, 5, 2).validate().unwrap();
        let pairs = [(0, 5), (1, 0), (2, 1), (5, 2)];
        for sk in KINDS {
            for dk in KINDS {
                let (s, d) = (Placement::memory(sk, g), Placement::memory(dk, g));
                let segs = segments(&s, &d, &pairs, 1..3);
                let mut expanded = Vec::new();
                for seg in &segs {
                    assert_eq!(seg.len % g.region_bytes, 0);
                    for i in 0..seg.len / g.region_bytes {
                        let k = i * g.region_bytes;
                        expanded.push((seg.src.base, seg.src.offset + k, seg.dst.base, seg.dst.offset + k));
                    }
                }
                let mut want = Vec::new();
                for &(sb, db) in &pairs {
                    for l in 1..3 {
                        for o in 0..2 {
                            let (a, b) = (s.region(sb, l, o), d.region(db, l, o));
                            want.push((a.base, a.offset, b.base, b.offset));
                        }
                    }
                }
                expanded.sort();
                want.sort();
                assert_eq!(expanded, want, "{sk:?} → {dk:?}");
            }
        }
    }
}
