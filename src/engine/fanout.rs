//! Fan-out: one chunk's disk read spread over the I/O workers that sleep.
//!
//! A request of one block, or of one layer of a prefix, is one or a few chunks, and one
//! worker reads each: a `pread` from the page cache runs at one core's copy speed (1 MiB
//! of a hot tmpfs file in ~170 us on the H200) while the other workers wait for work.
//! An I/O worker that takes such a read (its request's only chunk) while others are idle
//! cuts it into parts, queues all but the first for them and reads the first itself;
//! whichever finishes the last part moves the chunk on. Requests of several chunks are
//! never cut, and busy workers never split, so only requests that leave cores idle pay
//! the hand-off.

use super::stats::Counters;
use super::worker::{Chunk, Job, Router};
use crate::error::Error;
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
        let fan = Arc::new(Fanout { chunk: Mutex::new(Some(chunk)), left: AtomicUsize::new(pieces.len()), failure: Mutex::new(None) });
        pieces.into_iter().map(|extents| Part { fan: fan.clone(), file: file.clone(), extents, stream }).collect()
    }

    /// Records a part's outcome; the chunk and the failure (if any part failed) once
    /// every part is done.
    fn part_done(&self, outcome: Result<(), Error>) -> Option<(Chunk, Option<Error>)> {
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

/// How many parts a read of `bytes` gets with `idle` workers sleeping: at most one per
/// worker (the caller and the idle ones), none smaller than `MIN_PART`.
fn parts_for(bytes: u64, idle: usize) -> usize {
    (idle + 1).min((bytes / MIN_PART) as usize).max(1)
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

/// How many parts a read gets: more than one only for a request of one chunk while other
/// I/O workers sleep, and never for a checksummed file (its regions are verified whole,
/// by one reader). A request of several chunks already gives the workers a chunk each;
/// cutting those in parts too only adds hand-offs (measured: a 32-layer request 4-8 %
/// slower).
pub(super) fn fan_out(router: &Router, chunk: &Chunk, file: &Layout, extents: &[Extent]) -> Option<usize> {
    let f = file.disk().expect("disk layout");
    if !chunk.whole || f.checksum.is_some() {
        return None;
    }
    let idle = router.io_idle.load(Ordering::Acquire);
    let parts = parts_for(extents.iter().map(|e| e.len).sum(), idle);
    (parts > 1).then_some(parts)
}

/// Queues all parts of the chunk's read but the first for the idle workers, and reads
/// the first here.
pub(super) fn share_read(router: &Router, port: &mut Port, chunk: Chunk, file: Arc<Layout>, extents: Vec<Extent>, stream: bool, parts: usize) {
    let align = file.disk().expect("disk layout").align();
    let mut parts = Fanout::parts(chunk, &file, &extents, stream, parts, align).into_iter();
    // The parts hold the layout now; the request may complete as soon as they are done.
    drop((file, extents));
    let mine = parts.next().expect("a read has a part");
    Counters::add(&router.counters.reads_fanned_out, 1);
    for part in parts {
        router.io_tx.send(Job::Part(part)).unwrap_or_else(|_| unreachable!("I/O workers gone with chunks in flight"));
    }
    run_part(router, port, mine);
}

/// Reads one part; the worker that finishes the last one moves the chunk on.
pub(super) fn run_part(router: &Router, port: &mut Port, part: Part) {
    let start = std::time::Instant::now();
    let f = part.file.disk().expect("disk layout");
    // SAFETY: the part lies in its chunk's slot, which stays the chunk's until every
    // part is done.
    let result = unsafe { f.read_extents(port, &part.file.placement, &part.extents, part.stream) };
    let c = &router.counters;
    Counters::add_since(&c.disk_read_ns, start);
    if result.is_ok() {
        Counters::add(&c.bytes_disk_read, part.extents.iter().map(|e| e.len).sum());
    }
    let Part { fan, file, .. } = part;
    drop(file);
    match fan.part_done(result) {
        None => {}
        Some((chunk, None)) => router.advance(chunk),
        Some((chunk, Some(e))) => router.fail(chunk, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(file_off: u64, addr: u64, len: u64) -> Extent {
        Extent { file_off, addr, len, aligned: file_off % 4096 == 0 && addr % 4096 == 0 && len % 4096 == 0, zero_tail: 0, payload: (file_off, addr, len) }
    }

    /// Every byte of `extents` exactly once, file offset and address moving together.
    fn covers(extents: &[Extent], parts: &[Vec<Extent>]) {
        let want: Vec<(u64, u64)> = extents.iter().flat_map(|e| (0..e.len).step_by(512).map(move |k| (e.file_off + k, e.addr + k))).collect();
        let got: Vec<(u64, u64)> = parts.iter().flatten().flat_map(|e| (0..e.len).step_by(512).map(move |k| (e.file_off + k, e.addr + k))).collect();
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
        assert_eq!(parts_for(MIN_PART - 1, 11), 1);
        assert_eq!(parts_for(2 * MIN_PART, 11), 2);
        assert_eq!(parts_for(64 << 20, 3), 4);
        assert_eq!(parts_for(64 << 20, 0), 1);
    }
}
