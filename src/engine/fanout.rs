//! Fan-out: in a shallow ring, each chunk's disk read is shared by all I/O workers, in
//! the chunks' order.
//!
//! A `pread` from the page cache runs at one core's copy speed. A request of one block
//! read a slot per worker finishes all its reads together, after one core's time for a
//! whole slot, and only then do the device copies start. So while the ring is shallow
//! (`BounceRing::shallow`), a read is cut into a part per worker when it is routed,
//! and the parts are queued in the chunks' order: the workers fill slot 0 together, then
//! slot 1, and the first copy starts after a part's time, not a slot's. Whichever worker
//! finishes a chunk's last part moves it on. Every chunk is cut, not only while workers
//! sleep: a request's last chunks are routed while the first ones' parts keep every
//! worker busy, and cut only among the workers idle at that moment they became the
//! request's tail (one block's sixth slot was read 135 us after its fifth:
//! docs/decisions.md, "Shared reads only among idle workers"). In a deep ring every
//! worker has a chunk of its own and the copies have work queued, so nothing is cut.
//!
//! This file only cuts; the router queues the parts, and the I/O workers run them.

use super::chunk::Chunk;
use super::plan::Op;
use super::request::Request;
use super::stages::Stage;
use super::stats::Counters;
use crate::error::{Error, Result};
use crate::io::{Extent, Port};
use crate::memory::Layout;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The smallest part worth a worker of its own: a hand-off costs a wake-up (tens of
/// microseconds on a busy host), about what reading 128 KiB from the page cache takes.
const MIN_PART: u64 = 128 << 10;

/// A chunk whose read is in parts.
struct Fanout {
    /// Taken by the worker that finishes the last part.
    chunk: Mutex<Option<Chunk>>,
    /// The chunk's request, for its stage times while the chunk is held above.
    req: Arc<Request>,
    left: AtomicUsize,
    /// The first part's failure, if any; the chunk fails with it.
    failure: Mutex<Option<Error>>,
}

/// One part of a fanned-out read, run by any I/O worker.
pub struct Part {
    fan: Arc<Fanout>,
    file: Arc<Layout>,
    extents: Vec<Extent>,
    /// The read leaves the slot's lines in memory (`DiskFile::read_extents`).
    stream: bool,
}

impl Fanout {
    /// The parts of `chunk`'s read of `extents` from `file`, cut into `parts` pieces.
    fn parts(chunk: Chunk, file: &Arc<Layout>, extents: &[Extent], stream: bool, parts: usize, align: u64) -> Vec<Part> {
        let pieces = split(extents, parts, align);
        let fan = Arc::new(Fanout {
            req: chunk.req.clone(),
            chunk: Mutex::new(Some(chunk)),
            left: AtomicUsize::new(pieces.len()),
            failure: Mutex::new(None),
        });
        pieces.into_iter().map(|extents| Part { fan: fan.clone(), file: file.clone(), extents, stream }).collect()
    }

    /// Records a part's outcome; the chunk and the failure (if any part failed) once
    /// every part is done.
    fn part_done(&self, outcome: Result<()>) -> Option<(Chunk, Option<Error>)> {
        if let Err(e) = outcome {
            self.failure.lock().unwrap().get_or_insert(e);
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return None;
        }
        let chunk = self.chunk.lock().unwrap().take().expect("the last part takes the chunk once");
        Some((chunk, self.failure.lock().unwrap().take()))
    }
}

/// How many parts a read of `bytes` gets: at most one per worker, none smaller than
/// `MIN_PART`.
fn parts_for(bytes: u64, workers: usize) -> usize {
    workers.min((bytes / MIN_PART) as usize).max(1)
}

/// Cuts `extents` into at most `parts` runs of about equal bytes, in order. An extent
/// is cut only at multiples of `align` from its start, so the pieces of an aligned
/// extent stay aligned (and may use `O_DIRECT`); each piece reads what it covers.
fn split(extents: &[Extent], parts: usize, align: u64) -> Vec<Vec<Extent>> {
    let total: u64 = extents.iter().map(|e| e.len).sum();
    let target = total.div_ceil(parts.max(1) as u64).next_multiple_of(align);
    let mut out: Vec<Vec<Extent>> = vec![Vec::new()];
    let mut filled = 0;
    for e in extents {
        let mut done = 0;
        while done < e.len {
            if filled == target && out.len() < parts {
                out.push(Vec::new());
                filled = 0;
            }
            // What this part still takes, whole multiples of `align` unless it is the
            // extent's end (or the last part, which takes the rest).
            let room = if out.len() == parts { e.len - done } else { target - filled };
            let n = (e.len - done).min(room);
            out.last_mut().unwrap().push(piece(e, done, n, align));
            done += n;
            filled += n;
        }
    }
    out.retain(|p| !p.is_empty());
    out
}

/// `e`'s bytes `at..at + len`, for a read.
fn piece(e: &Extent, at: u64, len: u64, align: u64) -> Extent {
    let (p_off, p_addr, p_len) = e.payload;
    let lo = (e.file_off + at).max(p_off);
    let hi = (e.file_off + at + len).min(p_off + p_len);
    let payload = if hi > lo { (lo, p_addr + (lo - p_off), hi - lo) } else { (lo, p_addr, 0) };
    let aligned = e.aligned && at % align == 0 && len % align == 0;
    Extent { file_off: e.file_off + at, addr: e.addr + at, len, aligned, zero_tail: 0, payload }
}

/// How many parts the chunk's next stage, a disk read, gets: more than one only while
/// the ring is `shallow`, and never for a checksummed file (its regions are verified
/// whole, by one reader).
fn fan_out(shallow: bool, workers: usize, file: &Layout, extents: &[Extent]) -> Option<usize> {
    let f = file.disk().expect("disk layout");
    if f.checksum.is_some() || !shallow {
        return None;
    }
    let parts = parts_for(extents.iter().map(|e| e.len).sum(), workers);
    (parts > 1).then_some(parts)
}

/// What became of a chunk's disk read: cut into parts, or left whole.
pub(super) enum Cut {
    /// The parts, to be queued in order; they hold the chunk until the last is done.
    Parts(Vec<Part>),
    /// Not cut: the chunk as it was.
    Whole(Chunk),
}

/// Cuts the disk read that is `chunk`'s next stage into parts for `workers` I/O workers;
/// `stream`: the parts' reads leave the slot's lines in memory.
pub(super) fn cut_read(mut chunk: Chunk, shallow: bool, workers: usize, stream: bool) -> Cut {
    let Some(Some(Op::ReadDisk { file, extents, .. })) = chunk.stages.get(chunk.next) else {
        unreachable!("cut_read cuts chunks whose next stage is a disk read")
    };
    let Some(parts) = fan_out(shallow, workers, file, extents) else {
        return Cut::Whole(chunk);
    };
    let Some(Op::ReadDisk { file, extents, .. }) = chunk.stages[chunk.next].take() else { unreachable!("checked above") };
    chunk.next += 1;
    let align = file.disk().expect("disk layout").align();
    let parts = Fanout::parts(chunk, &file, &extents, stream, parts, align);
    // The parts hold the layout now; the request may complete as soon as they are done.
    drop((file, extents));
    Cut::Parts(parts)
}

impl Part {
    /// Reads the part; once it was its chunk's last, the chunk and the first part's
    /// failure (if any), for the worker to move the chunk on.
    pub(super) fn read(self, port: &mut Port, c: &Counters) -> Option<(Chunk, Option<Error>)> {
        let start = std::time::Instant::now();
        self.fan.req.mark(Stage::IoStart);
        let f = self.file.disk().expect("disk layout");
        // SAFETY: the part lies in its chunk's slot, which stays the chunk's until every
        // part is done.
        let result = unsafe { f.read_extents(port, &self.file.placement, &self.extents, self.stream) };
        Counters::add_since(&c.disk_read_ns, start);
        if result.is_ok() {
            Counters::add(&c.bytes_disk_read, self.extents.iter().map(|e| e.len).sum());
        }
        self.fan.req.mark(Stage::IoDone);
        let Part { fan, file, .. } = self;
        drop(file);
        fan.part_done(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(file_off: u64, addr: u64, len: u64) -> Extent {
        Extent {
            file_off,
            addr,
            len,
            aligned: file_off % 4096 == 0 && addr % 4096 == 0 && len % 4096 == 0,
            zero_tail: 0,
            payload: (file_off, addr, len),
        }
    }

    /// Every byte of `extents` exactly once, file offset and address moving together.
    fn covers(extents: &[Extent], parts: &[Vec<Extent>]) {
        let want: Vec<(u64, u64)> =
            extents.iter().flat_map(|e| (0..e.len).step_by(512).map(move |k| (e.file_off + k, e.addr + k))).collect();
        let got: Vec<(u64, u64)> =
            parts.iter().flatten().flat_map(|e| (0..e.len).step_by(512).map(move |k| (e.file_off + k, e.addr + k))).collect();
        assert_eq!(got, want);
        for e in parts.iter().flatten() {
            assert_eq!(e.payload, (e.file_off, e.addr, e.len), "a piece's payload is what it reads");
        }
    }

    #[test]
    fn one_extent_is_cut_into_aligned_parts_of_equal_size() {
        let e = [extent(1 << 20, 64 << 20, 2 << 20)];
        let parts = split(&e, 8, 4096);
        assert_eq!(parts.len(), 8);
        assert!(parts.iter().all(|p| p.len() == 1 && p[0].len == 256 << 10 && p[0].aligned));
        covers(&e, &parts);
    }

    #[test]
    fn many_extents_spread_over_parts_in_order() {
        // 16 extents of 64 KiB (one layer of 16 blocks), and an odd-sized tail.
        let mut e: Vec<Extent> = (0..16).map(|i| extent(i * (2 << 20), (1 << 30) + i * (64 << 10), 64 << 10)).collect();
        e.push(extent(1 << 40, 1 << 31, 12_345));
        for parts in [1, 2, 3, 5, 8, 40] {
            let got = split(&e, parts, 4096);
            assert!(got.len() <= parts && !got.is_empty());
            covers(&e, &got);
            let sizes: Vec<u64> = got.iter().map(|p| p.iter().map(|x| x.len).sum()).collect();
            let (lo, hi) = (*sizes.iter().min().unwrap(), *sizes.iter().max().unwrap());
            assert!(hi - lo <= (64 << 10) + 12_345, "parts {parts}: sizes {sizes:?}");
        }
    }

    #[test]
    fn unaligned_extents_are_cut_only_at_aligned_offsets_from_their_start() {
        let e = [extent(100, 7, 1_000_000)];
        let got = split(&e, 3, 4096);
        covers(&e, &got);
        for p in &got[..got.len() - 1] {
            assert_eq!(p.iter().map(|x| x.len).sum::<u64>() % 4096, 0);
        }
    }

    #[test]
    fn a_payload_narrower_than_its_extent_is_cut_with_it() {
        // An aligned read widened around the bytes asked for (1000..9000 of 0..12288).
        let e = Extent { file_off: 0, addr: 1 << 20, len: 12288, aligned: true, zero_tail: 0, payload: (1000, (1 << 20) + 1000, 8000) };
        let got = split(&[e], 3, 4096);
        let payload: u64 = got.iter().flatten().map(|x| x.payload.2).sum();
        assert_eq!(payload, 8000);
        for x in got.iter().flatten() {
            let (off, addr, len) = x.payload;
            assert!(len == 0 || (off >= x.file_off && off + len <= x.file_off + x.len && addr - x.addr == off - x.file_off));
        }
    }

    #[test]
    fn parts_never_go_below_the_minimum_or_past_the_workers() {
        assert_eq!(parts_for(2 << 20, 12), 12);
        assert_eq!(parts_for(MIN_PART - 1, 11), 1);
        assert_eq!(parts_for(2 * MIN_PART, 11), 2);
        assert_eq!(parts_for(64 << 20, 3), 3);
        assert_eq!(parts_for(64 << 20, 1), 1);
        assert_eq!(parts_for(64 << 20, 0), 1);
    }
}
