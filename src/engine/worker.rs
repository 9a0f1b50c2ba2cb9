//! The engine's threads and what they do to a chunk.
//!
//! - I/O workers (a pool sharing one queue): disk reads and writes, host memcpy; a
//!   chunk's next such stage at once (`next_here`); in a shallow ring also the device
//!   copy after a read (`Router::read_done`).
//! - The copy thread: device copies, issued in order on the device's streams.
//! - Fence threads, one per stream lane: wait for issued device copies and move their
//!   chunks on, so the copy thread never blocks on the device.
//!
//! Where a chunk goes after a stage is the router's (`router.rs`).

use super::bounce::BounceRing;
use super::chunk::Chunk;
use super::class::ClassQueue;
use super::fanout::Part;
use super::plan::Op;
use super::router::{issue_copy, Job, Router};
use super::stages::Stage;
use super::stats::Counters;
use crate::error::{Error, Result, Status};
use crate::file::checksum::WriteIds;
use crate::gpu::{CopyOp, Fence, Gpu};
use crate::io::Port;
use crate::memory::Layout;
use crate::remote::{PostFailed, Posted};
use crossbeam_channel::Receiver;
use std::sync::Arc;

/// I/O worker: disk I/O and host memcpy. It binds the device's context first: it
/// issues the device copy after a read in a shallow ring (`Router::read_done`), and with
/// cuFile it moves disk <-> device bytes itself.
pub fn io_worker(router: Arc<Router>, gpu: Arc<dyn Gpu>, rx: Arc<ClassQueue<Job>>, mut port: Port) {
    let bound = gpu.bind_thread();
    loop {
        match rx.recv() {
            Ok(Job::Run(chunk)) => run_io_stage(&router, &mut port, &bound, chunk),
            Ok(Job::Part(part)) => run_part(&router, &mut port, &bound, part),
            Ok(Job::Stop) | Err(_) => return,
        }
    }
}

/// Reads one part; the worker that finishes the last one moves the chunk on.
fn run_part(router: &Router, port: &mut Port, bound: &Result<()>, part: Part) {
    match part.read(port, &router.counters) {
        None => {}
        Some((chunk, None)) if next_here(router, &chunk) => run_io_stage(router, port, bound, chunk),
        Some((chunk, None)) => router.read_done(bound, chunk),
        Some((chunk, Some(e))) => router.fail(chunk, e),
    }
}

/// Whether the worker that ran a chunk's stage runs its next one too, at once: a read
/// then the copy out of the slot, a copy into the slot then the write (or a read then a
/// write, file to file). The slot's bytes are still in this core's cache, and the chunk
/// skips a trip through the queue and a wake-up: vLLM's tier over tmpfs moved 2 MiB
/// chunks 11-15 % faster (docs/benchmarks.md#kvxfers-vllm-tier-against-vllms-fs-tier).
/// It counts as a pick by the queue's rule (`class.rs`): critical first, bulk every
/// fourth while both wait, so the other class's turn goes through the queue instead.
fn next_here(router: &Router, chunk: &Chunk) -> bool {
    let io_stage = matches!(chunk.stages.get(chunk.next).and_then(|s| s.as_ref()), Some(Op::HostCopy(_) | Op::WriteDisk { .. }));
    io_stage && !chunk.req.stopped() && router.io_tx.keep(chunk.req.class())
}

/// The file `chunk`'s next stage writes through the page cache, if it does: its key in
/// the router's write gates (`writes.rs`).
fn page_cache_write(chunk: &Chunk) -> Option<usize> {
    match chunk.stages.get(chunk.next).and_then(|s| s.as_ref()) {
        Some(Op::WriteDisk { file, .. }) => file.disk().filter(|f| !f.is_direct()).map(|f| Arc::as_ptr(f.key()) as usize),
        _ => None,
    }
}

/// Runs the chunk's next I/O stage, unless it writes a file through the page cache that
/// another worker is writing: then it is parked, and that worker runs it (`writes.rs`).
/// A worker that is a file's writer runs the file's parked writes when its own is done.
fn run_io_stage(router: &Router, port: &mut Port, bound: &Result<()>, chunk: Chunk) {
    let Some(key) = page_cache_write(&chunk) else {
        run_stage(router, port, bound, chunk, None);
        return;
    };
    let mut writer = router.writes.enter(key, chunk);
    while let Some(chunk) = writer {
        writer = run_stage(router, port, bound, chunk, Some(key));
    }
}

/// Runs the chunk's next I/O stage and moves the chunk on. `gate`: the file it writes
/// through the page cache, whose writer this worker is; the next write parked behind it,
/// which this worker runs next, as the file's writer.
fn run_stage(router: &Router, port: &mut Port, bound: &Result<()>, mut chunk: Chunk, gate: Option<usize>) -> Option<Chunk> {
    let op = Router::take_op(&mut chunk);
    let start = std::time::Instant::now();
    chunk.req.mark(Stage::IoStart);
    let result = run_host_op(&op, router, port, bound, chunk.req.write_ids());
    chunk.req.mark(Stage::IoDone);
    let next_writer = gate.and_then(|key| router.writes.leave(key));
    let c = &router.counters;
    Counters::add_since(
        match op {
            Op::ReadDisk { .. } | Op::DiskDevice { write: false, .. } => &c.disk_read_ns,
            Op::WriteDisk { .. } | Op::DiskDevice { write: true, .. } => &c.disk_write_ns,
            _ => &c.host_copy_ns,
        },
        start,
    );
    match result {
        Ok(()) => {
            let read = matches!(op, Op::ReadDisk { .. });
            drop(op);
            if next_here(router, &chunk) {
                run_io_stage(router, port, bound, chunk)
            } else if read {
                router.read_done(bound, chunk)
            } else {
                router.advance(chunk)
            }
        }
        Err(e) => router.fail(chunk, e),
    }
    next_writer
}

/// Runs an I/O worker's stage; `bound`: whether this thread could bind the device (for
/// cuFile); `ids`: the request's write identities (`Engine::submit_for_store`).
fn run_host_op(op: &Op, router: &Router, port: &mut Port, bound: &Result<()>, ids: Option<&WriteIds>) -> Result<()> {
    let counters = &router.counters;
    match op {
        Op::ReadDisk { file, extents, for_device } => {
            let f = file.disk().expect("disk layout");
            // SAFETY: the extents lie in this chunk's slot, which this stage owns.
            unsafe { f.read_extents(port, &file.placement, extents, router.stream_read(*for_device)) }?;
            Counters::add(&counters.bytes_disk_read, extents.iter().map(|e| e.len).sum());
            Ok(())
        }
        Op::WriteDisk { file, extents } => {
            let f = file.disk().expect("disk layout");
            // SAFETY: as above; the padding after each extent is this chunk's too.
            unsafe { f.write_extents(port, &file.placement, extents, ids) }?;
            Counters::add(&counters.bytes_disk_written, extents.iter().map(|e| e.len).sum());
            Ok(())
        }
        Op::HostCopy(ops) => {
            memcpy_all(ops);
            Ok(())
        }
        Op::DeviceCopy { .. } => unreachable!("device copies run on the copy thread"),
        Op::Remote { .. } => unreachable!("remote transfers run on the remote thread"),
        Op::DiskDevice { file, write, ios } => {
            let gds = router.gds.as_ref().expect("cuFile chunks are planned only when the engine opened cuFile");
            bound.clone()?;
            gds.run(*write, file.disk().expect("disk layout").key(), ios)?;
            let bytes = ios.iter().map(|io| io.len).sum();
            Counters::add(if *write { &counters.bytes_disk_written } else { &counters.bytes_disk_read }, bytes);
            Ok(())
        }
    }
}

fn memcpy_all(ops: &[CopyOp]) {
    for op in ops {
        // SAFETY: planner invariant: inside validated layouts and this chunk's slot.
        unsafe { std::ptr::copy_nonoverlapping(op.src as *const u8, op.dst as *mut u8, op.len as usize) };
    }
}

/// Copy thread: issues device copies in order; a finished fence moves the chunk on at
/// once, a pending one goes to the fence thread.
pub fn copy_thread(router: Arc<Router>, gpu: Arc<dyn Gpu>, rx: Arc<ClassQueue<Job>>) {
    let bound = gpu.bind_thread();
    while let Ok(Job::Run(mut chunk)) = recv_spinning(&*rx) {
        let op = Router::take_op(&mut chunk);
        issue_copy(&router, &*gpu, bound.clone(), op, chunk);
    }
}

/// How long the copy and fence threads keep looking for their next job after one
/// before they sleep: back-to-back requests then find them awake (a sleeping thread
/// costs a futex wake-up, tens of microseconds on a busy host), and an idle engine
/// still uses no CPU once this has passed.
const STAY_AWAKE: std::time::Duration = std::time::Duration::from_micros(50);

/// What `recv_spinning` waits on: a channel, or a stage's queue in two classes.
trait Queue<T> {
    fn try_recv(&self) -> std::result::Result<T, crossbeam_channel::TryRecvError>;
    fn recv(&self) -> std::result::Result<T, crossbeam_channel::RecvError>;
}

impl<T> Queue<T> for Receiver<T> {
    fn try_recv(&self) -> std::result::Result<T, crossbeam_channel::TryRecvError> {
        Receiver::try_recv(self)
    }
    fn recv(&self) -> std::result::Result<T, crossbeam_channel::RecvError> {
        Receiver::recv(self)
    }
}

impl<T> Queue<T> for ClassQueue<T> {
    fn try_recv(&self) -> std::result::Result<T, crossbeam_channel::TryRecvError> {
        ClassQueue::try_recv(self)
    }
    fn recv(&self) -> std::result::Result<T, crossbeam_channel::RecvError> {
        ClassQueue::recv(self)
    }
}

fn recv_spinning<T>(rx: &impl Queue<T>) -> std::result::Result<T, crossbeam_channel::RecvError> {
    let start = std::time::Instant::now();
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return Err(crossbeam_channel::RecvError),
            // Yield, not pause: a thread woken on this core (the scheduler often puts a
            // wakee beside its waker, e.g. the caller's) runs at once instead of after
            // the whole stay.
            Err(crossbeam_channel::TryRecvError::Empty) if start.elapsed() < STAY_AWAKE => std::thread::yield_now(),
            Err(crossbeam_channel::TryRecvError::Empty) => return rx.recv(),
        }
    }
}

/// Fence thread: waits for one stream's copies in issue order.
pub fn fence_thread(router: Arc<Router>, gpu: Arc<dyn Gpu>, rx: Receiver<Option<(Fence, Chunk)>>) {
    // A fence with nothing queued behind it polls in short sleeps (`PendingCopy::wait`).
    tight_timer_slack();
    if let Err(e) = gpu.bind_thread() {
        log::error!("fence thread cannot use the device: {e}");
    }
    while let Ok(Some((fence, chunk))) = recv_spinning(&rx) {
        // Spin only with nothing queued behind: a busy lane sleeps, leaving the cores
        // and the driver's locks to the threads moving bytes.
        let waited = fence.wait(rx.is_empty());
        router.copy_done(&chunk);
        match waited {
            Ok(()) => router.advance(chunk),
            Err(e) => router.fail(chunk, e),
        }
    }
}

/// Remote thread: posts each chunk's NIXL transfer and checks every posted one until it
/// ends, fails, or passes its peer's timeout, so many chunks (of many requests) are in
/// flight at once. Right after a post or a completion it checks without sleeping for
/// `REMOTE_SPIN` (a small transfer ends within it: 256 KiB by CUDA IPC takes some 20 us,
/// docs/benchmarks.md, "Remote layouts"), then every `REMOTE_POLL`; with nothing posted
/// it sleeps on its queue.
///
/// A transfer that timed out or failed ends its request with `KVX_ERR_REMOTE` and closes
/// its peer's import (`Peer::close`), but is not released while it may still run:
/// NIXL's release of a running transfer cancels it, and UCX does not stop the reads and
/// writes already under way. It is kept (`Stalled`), with its slot held out of the ring
/// when the transfer goes through the slot, until NIXL reports it ended; then it is
/// released and the slot given back. One that NIXL reported failed is released at once
/// (NIXL tells nothing more of it), and its slot stays out of the ring for good; so does
/// the slot of one whose post failed after NIXL may have issued parts of it. A transfer
/// straight to or from a local layout keeps that layout (its memory and registration)
/// alive the same way, though its request ended and the caller dropped it.
///
/// Held slots never take the whole ring (`BounceRing::max_held`): a transfer through a
/// slot is posted only while the slots held and those of the transfers through slots
/// already posted stay below that bound, so that even if all of these were held, one
/// slot would be left for the work that waits on no peer. It waits its turn meanwhile,
/// and fails with `KVX_ERR_REMOTE` once the held slots alone reach the bound.
pub fn remote_thread(router: Arc<Router>, rx: Receiver<Job>) {
    tight_timer_slack();
    let mut posted: Vec<InFlight> = Vec::new();
    let mut waiting: Vec<(Chunk, Op)> = Vec::new();
    let mut stalled: Vec<Stalled> = Vec::new();
    let mut progress = std::time::Instant::now();
    loop {
        let job = if posted.is_empty() && stalled.is_empty() {
            rx.recv().ok()
        } else if !posted.is_empty() && progress.elapsed() < REMOTE_SPIN {
            match rx.try_recv() {
                Ok(job) => Some(job),
                Err(crossbeam_channel::TryRecvError::Empty) => None,
                Err(crossbeam_channel::TryRecvError::Disconnected) => Some(Job::Stop),
            }
        } else {
            match rx.recv_timeout(if posted.is_empty() { STALLED_POLL } else { REMOTE_POLL }) {
                Ok(job) => Some(job),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Some(Job::Stop),
            }
        };
        if job.is_some() {
            progress = std::time::Instant::now();
        }
        match job {
            // Stop comes only after every slot not held, hence every posted or waiting
            // chunk, came back. Stalled transfers are released here; their held slots
            // stay out, and so do the local layouts they may still write.
            Some(Job::Stop) => {
                stalled.into_iter().for_each(|s| keep_for_good(s.layout));
                return;
            }
            Some(Job::Part(_)) => unreachable!("read parts go to the I/O workers"),
            Some(Job::Run(mut chunk)) => {
                let op = Router::take_op(&mut chunk);
                waiting.push((chunk, op));
            }
            None => {}
        }
        post_waiting(&router, &mut waiting, &mut posted);
        let now = std::time::Instant::now();
        let mut i = 0;
        while i < posted.len() {
            let p = &mut posted[i].posted;
            // A replaced import dropped the metadata NIXL checks the transfer against:
            // it is not asked about it again (`Stalled::settle`).
            let outcome = match if p.peer.stale() { Err(p.replaced()) } else { p.done() } {
                Ok(false) if now < p.deadline => None,
                Ok(false) => Some(Err(p.timed_out())),
                Ok(true) => Some(Ok(())),
                Err(e) => Some(Err(e)),
            };
            match outcome {
                None => i += 1,
                Some(result) => {
                    progress = now;
                    let InFlight { posted: p, chunk, through_slot, layout } = posted.swap_remove(i);
                    match result {
                        Ok(()) => {
                            drop(p); // ended: released before the chunk's slot is reused
                            router.advance(chunk)
                        }
                        Err(e) => {
                            p.peer.close();
                            let slot = if through_slot {
                                Some(router.fail_holding_slot(chunk, e))
                            } else {
                                router.fail(chunk, e);
                                None
                            };
                            stalled.push(Stalled { posted: p, slot, layout });
                        }
                    }
                }
            }
        }
        stalled.retain_mut(|s| s.settle(&router.ring));
    }
}

/// Posts the waiting chunks that may go now, in the order they came; one through a
/// bounce slot waits while posting it could let held slots take the whole ring.
fn post_waiting(router: &Router, waiting: &mut Vec<(Chunk, Op)>, posted: &mut Vec<InFlight>) {
    let ring = &router.ring;
    let mut out = posted.iter().filter(|p| p.through_slot).count() as u32;
    let mut i = 0;
    while i < waiting.len() {
        let (chunk, Op::Remote { peer, write, ops, .. }) = &waiting[i] else { unreachable!("only remote transfers are queued here") };
        let slot = ring.addr(chunk.slot)..ring.addr(chunk.slot) + ring.slot_bytes();
        let through_slot = ops.iter().any(|o| slot.contains(if *write { &o.src } else { &o.dst }));
        if through_slot {
            let held = ring.held();
            if held >= ring.max_held() {
                let err = too_many_held(&peer.name, held, ring.slots());
                router.fail(waiting.remove(i).0, err);
                continue;
            }
            if held + out >= ring.max_held() {
                i += 1;
                continue;
            }
        }
        let (chunk, op) = waiting.remove(i);
        let Op::Remote { peer, write, local, remote, ops, layout } = op else { unreachable!("checked above") };
        match peer.post(write, local, remote, &ops) {
            Ok(posted_now) => {
                out += through_slot as u32;
                posted.push(InFlight { posted: posted_now, chunk, through_slot, layout })
            }
            // Parts of a transfer whose post failed may still run, and NIXL tells
            // nothing more of it: its slot stays out of the ring for good.
            Err(PostFailed { error, maybe_issued: true }) if through_slot => {
                peer.close();
                let slot = router.fail_holding_slot(chunk, error);
                log::warn!("a remote transfer through bounce slot {slot} failed to post after NIXL may have issued parts of it; the slot stays out of the ring for good");
            }
            Err(PostFailed { error, maybe_issued }) => {
                if maybe_issued {
                    peer.close();
                    keep_for_good(layout);
                }
                router.fail(chunk, error)
            }
        }
    }
}

/// The error of a transfer through a bounce slot refused because held slots reached
/// `BounceRing::max_held`.
fn too_many_held(peer: &str, held: u32, slots: u32) -> Error {
    if slots == 1 {
        return Error::new(
            Status::Remote,
            format!("remote peer {peer}: a transfer between a remote layout and a disk layout needs a bounce ring of 2 slots or more (bounce_bytes / slot_bytes)"),
        );
    }
    Error::new(
        Status::Remote,
        format!(
            "remote peer {peer}: {held} of the engine's {slots} bounce slots are held by remote transfers that timed out or failed and that NIXL has not reported ended, and the last one is kept for local work. A held slot comes back when its transfer ends (a peer that was stalled and resumes); destroy and recreate the engine to get back the rest"
        ),
    )
}

/// A remote transfer that timed out or failed, kept until NIXL reports it ended.
struct Stalled {
    posted: Posted,
    /// Its chunk's slot, held out of the ring, when the transfer goes through it.
    slot: Option<u32>,
    /// The local layout it reads or writes, when not through a slot: its request
    /// ended, and the caller may have dropped the layout, whose memory and NIXL
    /// registration must outlive the transfer.
    layout: Option<Arc<Layout>>,
}

/// A posted remote transfer, checked until it ends, fails or times out.
struct InFlight {
    posted: Posted,
    chunk: Chunk,
    /// Whether it reads or writes its chunk's bounce slot (remote ↔ disk).
    through_slot: bool,
    /// The local layout it reads or writes, when not through a slot.
    layout: Option<Arc<Layout>>,
}

/// Keeps a local layout alive for good: a remote transfer that NIXL tells nothing
/// more of may still write its memory.
fn keep_for_good(layout: Option<Arc<Layout>>) {
    if let Some(layout) = layout {
        log::warn!("a remote transfer was given up while parts of it may still run; the local layout it reads or writes is never freed");
        std::mem::forget(layout);
    }
}

impl Stalled {
    /// Checks the transfer; `true` while it may still run. One that ended is released,
    /// its slot given back and its layout let go. One NIXL reported failed is released
    /// (NIXL tells nothing more of the parts it may still run) and its slot stays out
    /// and its layout alive for good; so is one whose peer was imported again, which
    /// dropped the metadata NIXL checks it against (some NIXL releases free a transfer
    /// checked after that).
    fn settle(&mut self, ring: &BounceRing) -> bool {
        let status = if self.posted.peer.stale() { Err(()) } else { self.posted.done().map_err(drop) };
        match status {
            Ok(false) => true,
            Ok(true) => {
                if let Some(slot) = self.slot {
                    ring.unhold(slot);
                }
                false
            }
            Err(_) => {
                if let Some(slot) = self.slot {
                    log::warn!("a remote transfer through bounce slot {slot} was given up while parts of it may still run; the slot stays out of the ring for good");
                }
                keep_for_good(self.layout.take());
                false
            }
        }
    }
}

/// How often posted remote transfers are checked while new chunks may still arrive.
const REMOTE_POLL: std::time::Duration = std::time::Duration::from_micros(20);
/// How often stalled remote transfers are checked when nothing is posted.
const STALLED_POLL: std::time::Duration = std::time::Duration::from_millis(10);
/// How long after a post or a completion posted transfers are checked without sleeping.
const REMOTE_SPIN: std::time::Duration = std::time::Duration::from_micros(100);

/// Linux stretches a sleep by the thread's timer slack (50 us by default). The fence and
/// remote threads sleep between polls of microseconds, whose interval is the point:
/// keep it to within a microsecond.
fn tight_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK only changes the calling thread's slack.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong) };
}
