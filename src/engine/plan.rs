//! The planner: turns a transfer's coalesced segments into chunks, one bounce slot each,
//! and says which stages each chunk goes through.
//!
//! The strategy depends only on the (source, destination) storage pair, never on whether
//! the device is real or emulated, so CI exercises the same paths a GPU machine runs:
//! - memory ↔ memory where the hardware can: one direct stage (device copy or memcpy);
//! - disk, or pageable host ↔ device: two stages through a bounce slot (fill, drain);
//! - disk ↔ device with cuFile (`KVX_IO_GDS`, unchecksummed files): one stage, no slot
//!   memory (the chunk still holds a slot, which bounds the I/Os in flight).
//!
//! Disk bytes are placed in a slot at the same offset modulo the I/O alignment as in the
//! file, so reads can be widened to aligned `O_DIRECT` reads and writes stay aligned.

use crate::gpu::{CopyKind, CopyOp, Gate, HostSide, MAX_OPS_PER_COPY};
use crate::io::{Extent, Io};
use crate::layout::{align_down, align_up, push_run, Loc, Run, Segment};
use crate::memory::{Layout, StorageKind};
use crate::remote::{blob::Mem, Peer};
use std::sync::Arc;

/// One stage of a chunk.
pub enum Op {
    /// `for_device`: a device copy out of the slot comes next (`DiskFile::read_extents`).
    ReadDisk {
        file: Arc<Layout>,
        extents: Vec<Extent>,
        for_device: bool,
    },
    WriteDisk {
        file: Arc<Layout>,
        extents: Vec<Extent>,
    },
    /// memcpy on an I/O worker.
    HostCopy(Vec<CopyOp>),
    /// On the copy thread. `host`: what the host side is (a slot, mapped or pinned memory).
    /// `after`: a captured caller event the copies wait for.
    DeviceCopy {
        kind: CopyKind,
        ops: Vec<CopyOp>,
        host: HostSide,
        after: Option<Gate>,
    },
    /// cuFile between the file and device memory, on an I/O worker (`Io::addr` is a
    /// device address).
    DiskDevice {
        file: Arc<Layout>,
        write: bool,
        ios: Vec<Io>,
    },
    /// One NIXL transfer with an imported peer, on the remote thread: `write` local →
    /// remote (each op's `src` local, `dst` in the peer), else remote → local.
    Remote {
        peer: Arc<Peer>,
        write: bool,
        local: Mem,
        remote: Mem,
        ops: Vec<CopyOp>,
        /// The local layout whose memory the transfer reads or writes (none through a
        /// slot): kept while the transfer may run, even after its request ended.
        layout: Option<Arc<Layout>>,
    },
}

impl Op {
    /// Whether the copy thread (not an I/O worker) runs it.
    pub fn on_copy_thread(&self) -> bool {
        matches!(self, Op::DeviceCopy { .. })
    }
}

/// The stages of one chunk, run in order.
pub type Stages = [Option<Op>; 2];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    /// One stage moves the bytes.
    Direct,
    /// Fill a slot from the source, drain it into the destination.
    Bounce,
    /// cuFile moves file bytes straight to or from device memory.
    DiskDevice,
}

fn strategy(src: &Layout, dst: &Layout) -> Strategy {
    use StorageKind::*;
    // Between a peer's host memory and our device UCX has no direct path of its own
    // unless the fabric does GPUDirect RDMA: it emulates one over TCP, at under 1 GB/s
    // (`docs/benchmarks.md#remote-layouts`). Through a pinned slot the peer's side
    // becomes host to host, which every UCX transport moves zero-copy, and the PCIe leg
    // is our copy thread's, pipelined over the ring.
    let remote_host = |l: &Layout| l.remote().is_some_and(|(_, m)| m == Mem::Dram);
    match (src.kind(), dst.kind()) {
        // Remote bytes reach a disk through a slot, like any other memory.
        (Disk, _) | (_, Disk) => Strategy::Bounce,
        (Remote, Device) if remote_host(src) => Strategy::Bounce,
        (Device, Remote) if remote_host(dst) => Strategy::Bounce,
        (Remote, _) | (_, Remote) => Strategy::Direct,
        // A DMA engine cannot read pageable memory at full speed (and CUDA stages it
        // synchronously); bounce through pinned slots instead.
        (Host, Device) | (Device, Host) => Strategy::Bounce,
        _ => Strategy::Direct,
    }
}

/// Small regions scattered over pinned memory: the device could only copy them one by
/// one, so gather them on the CPU into a slot and move the slot as one copy instead.
fn scattered_small(segs: &[Segment], host_is_src: bool) -> bool {
    // A few runs cost a few copies issued at once, cheaper than a gather on an I/O
    // worker and the hand-off to the copy thread (a single 256 KiB block takes about
    // eight times as long through a slot as its raw copy).
    if segs.len() < MIN_SCATTERED_RUNS {
        return false;
    }
    let avg = segs.iter().map(|s| s.len).sum::<u64>() / segs.len() as u64;
    let host = |s: &Segment| if host_is_src { s.src } else { s.dst };
    let contiguous = segs.windows(2).filter(|w| {
        let (a, b) = (host(&w[0]), host(&w[1]));
        a.base == b.base && a.offset + w[0].len == b.offset
    });
    avg < LARGE_SEGMENT && 2 * contiguous.count() < segs.len()
}

const MIN_SCATTERED_RUNS: usize = 8;

fn host_like(k: StorageKind) -> bool {
    matches!(k, StorageKind::Host | StorageKind::Pinned)
}

/// Alignment of slot placement when no disk is involved (keeps copies cache-line friendly).
const MEMORY_SLOT_ALIGN: u64 = 256;

/// Direct device copies of large segments use no slot memory, so their chunks can be
/// larger than a slot: fewer copy calls and events, closer to one raw copy's speed.
/// Small segments keep slot-sized chunks, which the region kernel's staging area holds.
const DIRECT_DEVICE_CHUNK: u64 = 64 << 20;
const LARGE_SEGMENT: u64 = 1 << 20;

/// One piece of a segment placed in the current chunk.
#[derive(Clone, Copy, Debug)]
struct Piece {
    /// Source address (memory) or file offset (disk).
    src: u64,
    dst: u64,
    /// Offset in the slot (bounce) — unused for direct chunks.
    slot_off: u64,
    len: u64,
    /// The allocations (layout bases) the piece lies in: pieces of different
    /// allocations never merge, even when their addresses happen to touch, because a
    /// device copy may not cross an allocation's end.
    src_base: u32,
    dst_base: u32,
}

pub struct Planner {
    src: Arc<Layout>,
    dst: Arc<Layout>,
    strategy: Strategy,
    segs: Vec<Segment>,
    /// Next segment and the bytes of it already planned.
    idx: usize,
    done_in_seg: u64,
    slot_bytes: u64,
    /// Bytes per direct chunk (`slot_bytes`, or more for large device copies).
    direct_chunk: u64,
    /// Placement alignment: the primary disk side's I/O alignment.
    align: u64,
    primary_is_src: bool,
    after: Option<Gate>,
    /// With checksums, chunks end on region boundaries of the primary disk side.
    region_cut: Option<crate::layout::Placement>,
    /// Memory ↔ remote: what NIXL calls the local side's memory (set when the engine
    /// registered it with its link, before submitting).
    local_mem: Option<Mem>,
}

impl Planner {
    /// `gds`: the engine opened cuFile, so unchecksummed disk <-> device transfers skip
    /// the bounce slots (checksums are computed and verified on host bytes).
    pub fn new(src: Arc<Layout>, dst: Arc<Layout>, segs: Vec<Segment>, slot_bytes: u64, after: Option<Gate>, gds: bool) -> Planner {
        let mut strategy = strategy(&src, &dst);
        let pinned_device = match (src.kind(), dst.kind()) {
            (StorageKind::Pinned, StorageKind::Device) => Some(true),
            (StorageKind::Device, StorageKind::Pinned) => Some(false),
            _ => None,
        };
        // Scattered small regions of pinned memory: the device's kernels reach them in
        // place if it maps that memory (one launch per chunk, no CPU), else the CPU
        // gathers them into a slot.
        let scattered = pinned_device.filter(|&host_is_src| scattered_small(&segs, host_is_src));
        let host_maps = |host_is_src: bool| if host_is_src { src.device_maps() } else { dst.device_maps() };
        // Scattered small on the device side only (a mapped file or a contiguous pinned
        // layout to random ids of vLLM's layout) moves in place too, in chunks as large:
        // staged in slot-sized chunks instead, every 2 MiB DMA costs the copy engine a
        // gap (0.90 of PCIe staged against 0.92-0.95 in place).
        // Host to device, only where the kernel reads the host about as fast as a DMA
        // (`Layout::device_reads`); elsewhere the span goes staged. Scattered host regions
        // stay in place either way (why: `gpu/cuda/host_reads.rs`).
        let reads_fast = |host_is_src: bool| if host_is_src { src.device_reads() } else { dst.device_maps() };
        let zero_copy = scattered.is_some_and(host_maps)
            || pinned_device.is_some_and(|host_is_src| reads_fast(host_is_src) && scattered_small(&segs, !host_is_src));
        if scattered.is_some() && !zero_copy {
            strategy = Strategy::Bounce;
        }
        let primary_is_src = src.kind() == StorageKind::Disk;
        let align = match (src.disk(), dst.disk()) {
            (Some(f), _) | (None, Some(f)) => f.align(),
            (None, None) => MEMORY_SLOT_ALIGN,
        };
        debug_assert!(slot_bytes % align == 0 && slot_bytes >= 2 * align);
        let checksummed = |l: &Layout| l.disk().is_some_and(|f| f.checksum.is_some());
        let disk_device =
            matches!((src.kind(), dst.kind()), (StorageKind::Disk, StorageKind::Device) | (StorageKind::Device, StorageKind::Disk));
        if gds && disk_device && !checksummed(&src) && !checksummed(&dst) {
            strategy = Strategy::DiskDevice;
        }
        // cuFile chunks stay slot-sized, so several I/O workers share even one block.
        let device = src.kind() == StorageKind::Device || dst.kind() == StorageKind::Device;
        let avg = segs.iter().map(|s| s.len).sum::<u64>() / segs.len().max(1) as u64;
        let remote = src.kind() == StorageKind::Remote || dst.kind() == StorageKind::Remote;
        let direct_chunk = match strategy {
            // Many descriptors in one NIXL transfer; several transfers in flight.
            Strategy::Direct if remote => DIRECT_DEVICE_CHUNK,
            Strategy::Direct if device && (avg >= LARGE_SEGMENT || zero_copy) => DIRECT_DEVICE_CHUNK.max(slot_bytes),
            _ => slot_bytes,
        };
        let region_cut = (checksummed(&src) || checksummed(&dst)).then(|| if primary_is_src { src.placement } else { dst.placement });
        let local_mem = match (src.remote(), dst.remote()) {
            (Some(_), None) if strategy == Strategy::Direct => dst.registration.lock().unwrap().as_ref().map(|r| r.mem()),
            (None, Some(_)) if strategy == Strategy::Direct => src.registration.lock().unwrap().as_ref().map(|r| r.mem()),
            _ => None,
        };
        debug_assert!(
            !remote || strategy != Strategy::Direct || local_mem.is_some(),
            "the local side of a remote transfer is registered in validate"
        );
        Planner {
            src,
            dst,
            strategy,
            segs,
            idx: 0,
            done_in_seg: 0,
            slot_bytes,
            direct_chunk,
            align,
            primary_is_src,
            after,
            region_cut,
            local_mem,
        }
    }

    fn addr(layout: &Layout, loc: Loc) -> u64 {
        match layout.bases() {
            Some(bases) => bases[loc.base as usize] + loc.offset,
            None => loc.offset,
        }
    }

    /// Every chunk has been planned.
    pub fn done(&self) -> bool {
        self.idx == self.segs.len()
    }

    /// The stages of the next chunk, using the slot at `slot_addr`; `None` when done.
    pub fn next_chunk(&mut self, slot_addr: u64) -> Option<Stages> {
        if self.done() {
            return None;
        }
        let pieces = match self.strategy {
            Strategy::Direct | Strategy::DiskDevice => self.take_direct(),
            Strategy::Bounce if self.src.kind() == StorageKind::Disk || self.dst.kind() == StorageKind::Disk => self.take_disk(),
            Strategy::Bounce => self.take_packed(),
        };
        debug_assert!(!pieces.is_empty());
        Some(match self.strategy {
            Strategy::Direct => [Some(self.direct_op(&pieces)), None],
            Strategy::Bounce => [Some(self.fill_op(&pieces, slot_addr)), Some(self.drain_op(&pieces, slot_addr))],
            Strategy::DiskDevice => [Some(self.disk_device_op(&pieces)), None],
        })
    }

    /// The current segment's remainder as (src, dst, len) addresses/offsets.
    fn current(&self) -> (u64, u64, u64) {
        let s = &self.segs[self.idx];
        let k = self.done_in_seg;
        (Self::addr(&self.src, s.src) + k, Self::addr(&self.dst, s.dst) + k, s.len - k)
    }

    fn piece(&self, src: u64, dst: u64, slot_off: u64, len: u64) -> Piece {
        let s = &self.segs[self.idx];
        Piece { src, dst, slot_off, len, src_base: s.src.base, dst_base: s.dst.base }
    }

    fn advance(&mut self, n: u64) {
        self.done_in_seg += n;
        if self.done_in_seg == self.segs[self.idx].len {
            self.idx += 1;
            self.done_in_seg = 0;
        }
    }

    /// Up to `direct_chunk` bytes in at most `MAX_OPS_PER_COPY` pieces, cut anywhere.
    fn take_direct(&mut self) -> Vec<Piece> {
        let mut pieces = Vec::new();
        let mut total = 0;
        while self.idx < self.segs.len() && total < self.direct_chunk && pieces.len() < MAX_OPS_PER_COPY {
            let (s, d, rem) = self.current();
            let take = rem.min(self.direct_chunk - total);
            pieces.push(self.piece(s, d, 0, take));
            total += take;
            self.advance(take);
        }
        pieces
    }

    /// Memory through a slot: packed back to back at `MEMORY_SLOT_ALIGN`.
    fn take_packed(&mut self) -> Vec<Piece> {
        let mut pieces = Vec::new();
        let mut pos = 0;
        while self.idx < self.segs.len() {
            let start = align_up(pos, self.align).unwrap();
            if start >= self.slot_bytes {
                break;
            }
            let (s, d, rem) = self.current();
            let take = rem.min(self.slot_bytes - start);
            pieces.push(self.piece(s, d, start, take));
            pos = start + take;
            self.advance(take);
        }
        pieces
    }

    /// Disk through a slot: a run of file-contiguous bytes keeps its offset modulo the
    /// alignment; a run cut by the slot's end is cut at an aligned file offset.
    fn take_disk(&mut self) -> Vec<Piece> {
        let a = self.align;
        let mut pieces: Vec<Piece> = Vec::new();
        let mut pos = 0;
        while self.idx < self.segs.len() {
            let (s, d, rem) = self.current();
            let (p, other) = if self.primary_is_src { (s, d) } else { (d, s) };
            let both_disk = self.src.kind() == StorageKind::Disk && self.dst.kind() == StorageKind::Disk;
            let continues = pieces.last().is_some_and(|l| {
                let (lp, lo) = if self.primary_is_src { (l.src, l.dst) } else { (l.dst, l.src) };
                lp + l.len == p && (!both_disk || lo + l.len == other)
            });
            let start = if continues { pos } else { align_up(pos, a).unwrap() + p % a };
            if start >= self.slot_bytes {
                break;
            }
            let mut take = rem.min(self.slot_bytes - start);
            let cut = take < rem;
            if cut {
                let end = match &self.region_cut {
                    Some(pl) => region_boundary_at_or_below(pl, p + take),
                    None => align_down(p + take, a),
                };
                if end <= p {
                    break;
                }
                take = end - p;
            }
            pieces.push(self.piece(s, d, start, take));
            pos = start + take;
            self.advance(take);
            if cut {
                break;
            }
        }
        pieces
    }

    /// The pieces as copies, adjacent ones within one allocation merged.
    fn runs(pieces: &[Piece]) -> Vec<CopyOp> {
        coalesce(pieces.iter().map(|p| (CopyOp { dst: p.dst, src: p.src, len: p.len }, (p.src_base, p.dst_base))))
    }

    /// A NIXL transfer between the peer and `local`: the memory of `layout`, the local
    /// layout, or (none) a slot.
    fn remote_op(&self, ops: Vec<CopyOp>, local: Mem, layout: Option<Arc<Layout>>) -> Op {
        let (write, remote) = match (self.src.remote(), self.dst.remote()) {
            (Some((p, m)), _) => (false, (p, m)),
            (_, Some((p, m))) => (true, (p, m)),
            (None, None) => unreachable!("a remote op needs a remote side"),
        };
        Op::Remote { peer: remote.0.clone(), write, local, remote: remote.1, ops, layout }
    }

    fn direct_op(&self, pieces: &[Piece]) -> Op {
        let ops = Self::runs(pieces);
        if let Some(local) = self.local_mem {
            let layout = if self.src.remote().is_some() { &self.dst } else { &self.src };
            return self.remote_op(ops, local, Some(layout.clone()));
        }
        let kind = match (self.src.kind(), self.dst.kind()) {
            (StorageKind::Device, StorageKind::Device) => CopyKind::DeviceToDevice,
            (StorageKind::Device, _) => CopyKind::DeviceToHost,
            (_, StorageKind::Device) => CopyKind::HostToDevice,
            _ => return Op::HostCopy(ops),
        };
        let host_layout = if kind == CopyKind::HostToDevice { &self.src } else { &self.dst };
        let one_allocation = pieces.iter().all(|p| p.src_base == pieces[0].src_base);
        let host = match host_layout.device_maps() {
            true if kind == CopyKind::HostToDevice && one_allocation => HostSide::MappedSpan,
            true => HostSide::Mapped,
            false => HostSide::Pinned,
        };
        Op::DeviceCopy { kind, ops, host, after: self.after }
    }

    /// File ↔ device through cuFile: aligned runs on the `O_DIRECT` descriptor (which
    /// GPUDirect Storage needs), the rest on the buffered one.
    fn disk_device_op(&self, pieces: &[Piece]) -> Op {
        let write = self.dst.kind() == StorageKind::Disk;
        let file = if write { &self.dst } else { &self.src };
        let f = file.disk().expect("disk layout");
        let a = f.align();
        let ios = Self::runs(pieces)
            .iter()
            .map(|r| {
                let (off, addr) = if write { (r.dst, r.src) } else { (r.src, r.dst) };
                let aligned = off % a == 0 && r.len % a == 0 && addr % a == 0;
                Io { fd: std::os::fd::AsRawFd::as_raw_fd(&f.fd_for(aligned)), addr, len: r.len, off }
            })
            .collect();
        Op::DiskDevice { file: file.clone(), write, ios }
    }

    /// Source → slot.
    fn fill_op(&self, pieces: &[Piece], slot: u64) -> Op {
        let to_slot = || coalesce(pieces.iter().map(|p| (CopyOp { dst: slot + p.slot_off, src: p.src, len: p.len }, (p.src_base, 0))));
        match self.src.kind() {
            StorageKind::Disk => Op::ReadDisk {
                file: self.src.clone(),
                extents: self.extents(&self.src, pieces.iter().map(|p| (p.src, p.slot_off, p.len)), slot, false),
                for_device: self.dst.kind() == StorageKind::Device,
            },
            StorageKind::Device => {
                Op::DeviceCopy { kind: CopyKind::DeviceToHost, ops: to_slot(), host: HostSide::Bounce, after: self.after }
            }
            StorageKind::Remote => self.remote_op(to_slot(), Mem::Dram, None),
            k => {
                debug_assert!(host_like(k));
                Op::HostCopy(to_slot())
            }
        }
    }

    /// Slot → destination.
    fn drain_op(&self, pieces: &[Piece], slot: u64) -> Op {
        let from_slot = || coalesce(pieces.iter().map(|p| (CopyOp { dst: p.dst, src: slot + p.slot_off, len: p.len }, (0, p.dst_base))));
        match self.dst.kind() {
            StorageKind::Disk => Op::WriteDisk {
                file: self.dst.clone(),
                extents: self.extents(&self.dst, pieces.iter().map(|p| (p.dst, p.slot_off, p.len)), slot, true),
            },
            StorageKind::Device => {
                Op::DeviceCopy { kind: CopyKind::HostToDevice, ops: from_slot(), host: HostSide::Bounce, after: self.after }
            }
            StorageKind::Remote => self.remote_op(from_slot(), Mem::Dram, None),
            k => {
                debug_assert!(host_like(k));
                Op::HostCopy(from_slot())
            }
        }
    }

    /// File-side I/Os for (file offset, slot offset, len) pieces: contiguous pieces merge,
    /// then each is widened to the file's alignment where that is safe.
    fn extents(&self, file: &Layout, pieces: impl Iterator<Item = (u64, u64, u64)>, slot: u64, write: bool) -> Vec<Extent> {
        let f = file.disk().expect("disk layout");
        let a = f.align();
        let placement = &file.placement;
        // Widening may only touch slot bytes this run owns, which the placement guarantees
        // for the alignment it was made with.
        let may_widen = a == self.align;
        let mut runs: Vec<(u64, u64, u64)> = Vec::new();
        pieces.for_each(|p| push_run(&mut runs, p));
        runs.into_iter()
            .map(|(off, so, len)| {
                let payload = (off, slot + so, len);
                let exact = Extent { file_off: off, addr: slot + so, len, aligned: false, zero_tail: 0, payload };
                if !may_widen || (slot + so) % a != off % a {
                    return exact;
                }
                let head = off % a;
                let end = off + len;
                let tail = align_up(end, a).unwrap() - end;
                if write {
                    // Only the block padding after a block's last byte may be overwritten.
                    let at_block_end = end % placement.block_stride == placement.geom.block_bytes % placement.block_stride;
                    if head != 0 || (tail != 0 && !at_block_end) {
                        return exact;
                    }
                    Extent { file_off: off, addr: slot + so, len: len + tail, aligned: true, zero_tail: tail, payload }
                } else {
                    Extent { file_off: off - head, addr: slot + so - head, len: head + len + tail, aligned: true, zero_tail: 0, payload }
                }
            })
            .collect()
    }
}

/// The last region boundary of a disk placement at or before file offset `x`.
fn region_boundary_at_or_below(pl: &crate::layout::Placement, x: u64) -> u64 {
    let (stride, bb, r) = (pl.block_stride, pl.geom.block_bytes, pl.geom.region_bytes);
    let (b, within) = (x / stride, x % stride);
    b * stride + within.min(bb) / r * r
}

/// A copy and the allocations (source and destination base) it lies in: copies merge
/// only within the same ones, since a device copy may not cross an allocation's end.
struct Keyed(CopyOp, (u32, u32));

impl Run for Keyed {
    fn absorb(&mut self, next: &Self) -> bool {
        let (a, b) = (&mut self.0, &next.0);
        let ok = self.1 == next.1 && a.src + a.len == b.src && a.dst + a.len == b.dst;
        if ok {
            a.len += b.len;
        }
        ok
    }
}

/// Merges copies that are contiguous on both sides and lie in the same allocations
/// (`key`: source and destination base).
fn coalesce(ops: impl Iterator<Item = (CopyOp, (u32, u32))>) -> Vec<CopyOp> {
    let mut out: Vec<Keyed> = Vec::new();
    ops.for_each(|(op, key)| push_run(&mut out, Keyed(op, key)));
    out.into_iter().map(|k| k.0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{Emulated, Gpu};
    use crate::layout::{segments, LayoutConfig, LayoutKind};

    /// Two layers whose allocations touch (layer 1 starts where layer 0 ends) must still
    /// be copied separately: CUDA refuses a copy that runs past an allocation's end.
    #[test]
    fn copies_never_span_two_allocations_even_when_they_touch() {
        let gpu: Arc<dyn Gpu> = Arc::new(Emulated::default());
        let cfg = LayoutConfig { num_blocks: 4, num_layers: 2, outer_dim: 2, page_size: 4, inner_dim: 8, dtype_bytes: 2 };
        let g = cfg.validate().unwrap();
        let kind = LayoutKind::LayerSeparate { block_first: true };
        let per_layer = 4 * 2 * g.region_bytes;
        let mut mem = vec![0u8; 4 * per_layer as usize];
        let a = mem.as_mut_ptr() as u64;
        let src = Arc::new(Layout::register_memory(1, &gpu, kind, g, StorageKind::Device, &[a, a + per_layer]).unwrap());
        let dst =
            Arc::new(Layout::register_memory(1, &gpu, kind, g, StorageKind::Device, &[a + 2 * per_layer, a + 3 * per_layer]).unwrap());
        let pairs: Vec<(u64, u64)> = (0..4).map(|b| (b, b)).collect();
        let segs = segments(&src.placement, &dst.placement, &pairs, 0..2);
        assert_eq!(segs.len(), 2, "one segment per layer");
        let mut planner = Planner::new(src, dst, segs, 1 << 20, None, false);
        let Some([Some(Op::DeviceCopy { ops, .. }), None]) = planner.next_chunk(0) else { panic!("one direct device copy") };
        assert_eq!(ops.len(), 2, "{ops:?}");
        assert!(ops.iter().all(|o| o.len == per_layer));
    }

    /// Scattered small regions of pinned memory the device maps go as direct chunks of
    /// zero-copy ops, never more per copy than a backend's region table holds. A
    /// host-to-device chunk whose ops all lie in one host allocation says so
    /// (`MappedSpan`: its span may be read whole), one that crosses allocations does not.
    #[test]
    fn scattered_mapped_pinned_regions_are_direct_chunks_of_bounded_ops() {
        let gpu: Arc<dyn Gpu> = Arc::new(Emulated::default());
        let cfg = LayoutConfig { num_blocks: 4096, num_layers: 3, outer_dim: 2, page_size: 1, inner_dim: 8, dtype_bytes: 2 };
        let g = cfg.validate().unwrap();
        let kind = LayoutKind::LayerSeparate { block_first: true };
        let host = Arc::new(Layout::create_memory(1, &gpu, kind, g, StorageKind::Pinned).unwrap());
        let dev = Arc::new(Layout::create_memory(1, &gpu, kind, g, StorageKind::Device).unwrap());
        assert!(host.device_maps(), "the emulated device maps pinned memory");
        // Reversed ids: no two regions are adjacent on either side.
        let pairs: Vec<(u64, u64)> = (0..4096).map(|b| (4095 - b, b)).collect();
        let base_bytes = host.placement.base_bytes();
        let allocation =
            |addr: u64| host.bases().unwrap().iter().position(|&b| (b..b + base_bytes).contains(&addr)).expect("in the host layout");
        for (src, dst, want) in [(host.clone(), dev.clone(), CopyKind::HostToDevice), (dev.clone(), host.clone(), CopyKind::DeviceToHost)] {
            let segs = segments(&src.placement, &dst.placement, &pairs, 0..3);
            let total: u64 = segs.iter().map(|s| s.len).sum();
            assert!(segs.len() > MAX_OPS_PER_COPY, "the case must need more than one copy");
            let mut planner = Planner::new(src, dst, segs, 64 << 10, None, false);
            let mut moved = 0;
            let mut spans = 0;
            while let Some(stages) = planner.next_chunk(0) {
                let [Some(Op::DeviceCopy { kind, ops, host, .. }), None] = stages else { panic!("one direct device copy per chunk") };
                assert_eq!(kind, want);
                let host_addr = |o: &CopyOp| if want == CopyKind::HostToDevice { o.src } else { o.dst };
                let one_allocation = ops.iter().all(|o| allocation(host_addr(o)) == allocation(host_addr(&ops[0])));
                let expect = if want == CopyKind::HostToDevice && one_allocation { HostSide::MappedSpan } else { HostSide::Mapped };
                assert_eq!(host, expect, "one allocation: {one_allocation}");
                spans += (host == HostSide::MappedSpan) as usize;
                assert!(ops.len() <= MAX_OPS_PER_COPY, "{} ops in one copy", ops.len());
                moved += ops.iter().map(|o| o.len).sum::<u64>();
            }
            assert_eq!(moved, total);
            assert_eq!(spans > 0, want == CopyKind::HostToDevice, "host-to-device chunks within one layer's allocation");
        }
    }

    /// A block-contiguous pinned host layout the device maps (a mapped file's shape), to
    /// and from reversed block ids of a layer-separate device (no two blocks adjacent
    /// there): dense on the host, scattered small on the device. For each direction, the
    /// largest chunk's bytes and the host sides of its chunks.
    fn dense_span_to_scattered_device(gpu: Emulated) -> ([(CopyKind, u64, Vec<HostSide>); 2], u64) {
        let gpu: Arc<dyn Gpu> = Arc::new(gpu);
        let cfg = LayoutConfig { num_blocks: 256, num_layers: 4, outer_dim: 2, page_size: 1, inner_dim: 64, dtype_bytes: 2 };
        let g = cfg.validate().unwrap();
        let host = Arc::new(Layout::create_memory(1, &gpu, LayoutKind::FullyContiguous, g, StorageKind::Pinned).unwrap());
        let dev =
            Arc::new(Layout::create_memory(1, &gpu, LayoutKind::LayerSeparate { block_first: true }, g, StorageKind::Device).unwrap());
        assert!(host.device_maps(), "the emulated device maps pinned memory");
        let slot_bytes = 4 << 10;
        let pairs: Vec<(u64, u64)> = (0..256).map(|b| (b, 255 - b)).collect();
        let seen = [(host.clone(), dev.clone(), CopyKind::HostToDevice), (dev, host, CopyKind::DeviceToHost)].map(|(src, dst, want)| {
            let segs = segments(&src.placement, &dst.placement, &pairs, 0..4);
            let total: u64 = segs.iter().map(|s| s.len).sum();
            let mut planner = Planner::new(src, dst, segs, slot_bytes, None, false);
            let (mut moved, mut largest, mut hosts) = (0, 0, Vec::new());
            while let Some(stages) = planner.next_chunk(0) {
                let [Some(Op::DeviceCopy { kind, ops, host, .. }), None] = stages else {
                    panic!("{want:?}: one direct device copy per chunk")
                };
                assert_eq!(kind, want);
                let bytes: u64 = ops.iter().map(|o| o.len).sum();
                largest = largest.max(bytes);
                moved += bytes;
                hosts.push(host);
            }
            assert_eq!(moved, total);
            (want, largest, hosts)
        });
        (seen, slot_bytes)
    }

    /// Such a dense span moves in place in chunks larger than a slot, as scattered pinned
    /// regions do, not in slot-sized ones, whose every DMA costs the copy engine a gap.
    #[test]
    fn a_dense_mapped_host_span_to_scattered_device_regions_moves_in_chunks_larger_than_a_slot() {
        let (seen, slot_bytes) = dense_span_to_scattered_device(Emulated::default());
        for (want, largest, _) in seen {
            assert!(largest > slot_bytes, "{want:?}: largest chunk {largest} bytes, a slot holds {slot_bytes}");
        }
    }

    /// Where the device's kernels read host memory slowly, the host-to-device span is
    /// staged instead: slot-sized chunks whose host side is the dense span, which the
    /// backend moves by one DMA and a scatter on the device. The other direction, where
    /// the kernel writes the host, still goes in place.
    #[test]
    fn where_kernels_read_the_host_slowly_a_dense_span_to_the_device_is_staged_in_slot_sized_chunks() {
        let (seen, slot_bytes) = dense_span_to_scattered_device(Emulated::with_slow_host_reads());
        let [(_, up, up_hosts), (_, down, _)] = seen;
        assert!(up <= slot_bytes, "host to device: largest chunk {up} bytes, a slot holds {slot_bytes}");
        assert!(up_hosts.iter().all(|&h| h == HostSide::MappedSpan), "host to device: {up_hosts:?}");
        assert!(down > slot_bytes, "device to host: largest chunk {down} bytes, a slot holds {slot_bytes}");
    }

    /// With cuFile, a disk <-> device transfer is planned as one stage per chunk whose
    /// I/Os pair each file byte with the device byte the segments say, aligned runs on
    /// the O_DIRECT descriptor; a checksummed file still goes through the slots.
    #[test]
    fn gds_chunks_map_every_file_byte_to_its_device_byte() {
        use crate::file::DiskFlags;
        let gpu: Arc<dyn Gpu> = Arc::new(Emulated::default());
        let cfg = LayoutConfig { num_blocks: 6, num_layers: 3, outer_dim: 2, page_size: 16, inner_dim: 64, dtype_bytes: 2 };
        let g = cfg.validate().unwrap();
        let dir = std::env::temp_dir();
        let path = dir.join(format!("kvx-plan-gds-{}", std::process::id()));
        let disk = Arc::new(Layout::create_disk(1, &gpu, g, &path, DiskFlags::CREATE, 64 << 10).unwrap());
        let dev =
            Arc::new(Layout::create_memory(1, &gpu, LayoutKind::LayerSeparate { block_first: true }, g, StorageKind::Device).unwrap());
        let pairs: Vec<(u64, u64)> = (0..6).map(|b| (b, 5 - b)).collect();
        for (src, dst) in [(disk.clone(), dev.clone()), (dev.clone(), disk.clone())] {
            let write = dst.kind() == StorageKind::Disk;
            let segs = segments(&src.placement, &dst.placement, &pairs, 1..3);
            // Expected (file offset, device address) for every byte run, from the segments.
            let mut want: Vec<(u64, u64, u64)> = segs
                .iter()
                .map(|s| {
                    let (f, d) = if write { (s.dst, s.src) } else { (s.src, s.dst) };
                    (f.offset, dev.bases().unwrap()[d.base as usize] + d.offset, s.len)
                })
                .collect();
            let slot = 8 << 10;
            let mut planner = Planner::new(src.clone(), dst.clone(), segs, slot, None, true);
            let mut got = Vec::new();
            while let Some(stages) = planner.next_chunk(0) {
                let [Some(Op::DiskDevice { write: w, ios, .. }), None] = stages else { panic!("one cuFile stage per chunk") };
                assert_eq!(w, write);
                assert!(ios.iter().map(|io| io.len).sum::<u64>() <= slot, "a chunk stays slot-sized");
                let f = disk.disk().unwrap();
                for io in ios {
                    let aligned = io.off % f.align() == 0 && io.len % f.align() == 0;
                    assert_eq!(io.fd, std::os::fd::AsRawFd::as_raw_fd(&f.fd_for(aligned)));
                    got.push((io.off, io.addr, io.len));
                }
            }
            // Same bytes to the same places: both lists with contiguous runs merged.
            let expand = |v: &mut Vec<(u64, u64, u64)>| {
                v.sort();
                let mut out: Vec<(u64, u64, u64)> = Vec::new();
                v.iter().for_each(|&r| push_run(&mut out, r));
                out
            };
            assert_eq!(expand(&mut got), expand(&mut want), "write {write}");
        }
        // A checksummed file: two stages through a slot.
        let sum_path = dir.join(format!("kvx-plan-gds-sum-{}", std::process::id()));
        let sum = Arc::new(Layout::create_disk(1, &gpu, g, &sum_path, DiskFlags::CREATE | DiskFlags::CHECKSUM, 64 << 10).unwrap());
        let segs = segments(&sum.placement, &dev.placement, &pairs, 0..3);
        let mut planner = Planner::new(sum, dev, segs, 64 << 10, None, true);
        assert!(matches!(planner.next_chunk(0), Some([Some(Op::ReadDisk { .. }), Some(Op::DeviceCopy { .. })])));
        let _ = (std::fs::remove_file(&path), std::fs::remove_file(&sum_path));
    }
}
