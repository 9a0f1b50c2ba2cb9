//! The engine's threads and what they do to a chunk.
//!
//! - I/O workers (a pool sharing one queue): disk reads and writes, host memcpy; in a
//!   shallow ring also the device copy after a read (`Router::read_done`).
//! - The copy thread: device copies, issued in order on the device's streams.
//! - Fence threads, one per stream lane: wait for issued device copies and move their
//!   chunks on, so the copy thread never blocks on the device.
//!
//! A chunk runs its stages in order and then gives its slot back; a stage of a cancelled
//! or failed request is skipped.

use super::plan::{Op, Stages};
use super::request::Request;
use super::stats::Counters;
use super::bounce::BounceRing;
use super::fanout::{run_part, send_read, Part};
use crate::error::{Error, Result};
use crate::gpu::{fence_lane, CopyError, CopyKind, CopyOp, Fence, Gpu};
use crate::io::gds::Gds;
use crate::io::Port;
use crate::remote::Posted;
use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// A slot's worth of a request, moving through its stages.
pub struct Chunk {
    pub req: Arc<Request>,
    pub slot: u32,
    pub stages: Stages,
    pub next: usize,
    /// When the current device copy was issued (for `device_copy_ns`).
    pub issued: Option<std::time::Instant>,
}

pub enum Job {
    Run(Chunk),
    /// A part of a chunk's disk read (`fanout`), for the I/O workers only.
    Part(Part),
    Stop,
}

/// What every stage thread needs to pass a chunk on.
pub struct Router {
    pub ring: Arc<BounceRing>,
    pub counters: Arc<Counters>,
    pub io_tx: Sender<Job>,
    pub copy_tx: Sender<Job>,
    /// The remote thread: NIXL transfers to and from imported layouts.
    pub remote_tx: Sender<Job>,
    /// One fence thread per lane (`gpu::fence_lane`), so a slow stream never holds up
    /// another; `None` tells a fence thread to stop.
    pub fence_tx: Vec<Sender<Option<(Fence, Chunk)>>>,
    /// Raised by `Engine::shutdown` before the dispatcher's stop message is queued.
    pub shutdown: AtomicBool,
    /// `KVX_IO_GDS`: cuFile moves disk <-> device bytes (`Op::DiskDevice`).
    pub gds: Option<Arc<Gds>>,
    pub gpu: Arc<dyn Gpu>,
    /// Work sent to the dispatcher thread and not yet done with: while it is non-zero,
    /// submits queue behind it instead of dispatching on their own thread.
    pub queued: AtomicU64,
    /// How many I/O workers share `io_tx`: a read in a shallow ring is cut into as many parts.
    pub io_workers: usize,
}

impl Router {
    pub fn shutting_down(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    /// Sends the chunk to the thread that runs its next stage, or finishes it.
    pub fn advance(&self, mut chunk: Chunk) {
        if chunk.req.stopped() {
            return self.finish(chunk);
        }
        match chunk.stages.get_mut(chunk.next).and_then(|s| s.as_ref()) {
            None => self.finish(chunk),
            Some(Op::ReadDisk { .. }) => send_read(self, chunk),
            Some(op) => {
                let tx = match op {
                    Op::Remote { .. } => &self.remote_tx,
                    op if op.on_copy_thread() => &self.copy_tx,
                    _ => &self.io_tx,
                };
                // The receivers live until `Stop`, which is sent only after every slot came back.
                tx.send(Job::Run(chunk)).unwrap_or_else(|_| unreachable!("stage thread gone with chunks in flight"));
            }
        }
    }

    /// As `advance`, on a thread of the caller's (a submit): a device copy is issued
    /// right here instead of on the copy thread, in the device context pushed for the
    /// call and popped after, so the caller's own current context is left as it was.
    pub fn advance_here(&self, mut chunk: Chunk) {
        if !Router::copy_next(&chunk) {
            return self.advance(chunk);
        }
        match self.gpu.enter() {
            Ok(()) => {
                issue_copy(self, &*self.gpu, Ok(()), Router::take_op(&mut chunk), chunk);
                self.gpu.leave();
            }
            Err(e) => self.fail(chunk, e),
        }
    }

    /// Whether a disk read leaves its slot's lines in memory (`io::streamed`): when the
    /// device copies the slot out next and half the ring or more is free. In a pipeline
    /// that shallow the copy follows the read at once, and a plain `pread` would leave
    /// the lines modified in the reading core's cache, where the DMA reads them at half
    /// speed. In a full ring the slot waits for its copy while its lines settle in the
    /// last-level cache, which spares DRAM a write and a read that streaming stores cost
    /// (H200, hot file, every such read streamed: one 12.6 MB block 16-20 % faster,
    /// batches of 16 blocks 6-10 % slower; gated, the batches keep their speed).
    pub fn stream_read(&self, for_device: bool) -> bool {
        for_device && self.ring.shallow()
    }

    /// Moves a chunk on from the I/O worker that finished its disk read. In a shallow
    /// ring a device copy is issued right here: the copy thread is then often asleep,
    /// and waking it cost 20-26 us on the H200 host (a trace of one 12.6 MB block, the
    /// first slot's read done to its copy issued), on every request's critical path.
    /// `bound`: whether this worker has the device's context current.
    pub(super) fn read_done(&self, bound: &Result<()>, mut chunk: Chunk) {
        if Router::copy_next(&chunk) && bound.is_ok() && self.ring.shallow() {
            let op = Router::take_op(&mut chunk);
            return issue_copy(self, &*self.gpu, Ok(()), op, chunk);
        }
        self.advance(chunk)
    }

    /// The chunk's next stage is a device copy of a request still running.
    fn copy_next(chunk: &Chunk) -> bool {
        !chunk.req.stopped() && chunk.stages.get(chunk.next).and_then(|s| s.as_ref()).is_some_and(Op::on_copy_thread)
    }

    fn copy_done(&self, chunk: &Chunk) {
        if let Some(t) = chunk.issued {
            Counters::add_since(&self.counters.device_copy_ns, t);
        }
    }

    fn finish(&self, chunk: Chunk) {
        let Chunk { req, slot, stages, .. } = chunk;
        drop(stages); // layout references go before the request may finalise
        self.ring.release(slot);
        req.release_one();
    }

    /// Hands a chunk's pending device copy (`gated`: after a caller's event) to its lane's
    /// fence thread.
    fn to_fence(&self, kind: CopyKind, gated: bool, fence: Fence, chunk: Chunk) {
        self.fence_tx[fence_lane(kind, chunk.slot, gated)].send(Some((fence, chunk))).unwrap_or_else(|_| unreachable!("fence thread gone"))
    }

    /// Records a stage's failure on its request and finishes the chunk.
    pub(super) fn fail(&self, chunk: Chunk, err: Error) {
        chunk.req.fail(err);
        self.finish(chunk);
    }

    /// As `fail`, but the chunk's slot stays out of the ring (`BounceRing::hold`): a
    /// remote transfer through it may still read or write it.
    fn fail_holding_slot(&self, chunk: Chunk, err: Error) -> u32 {
        chunk.req.fail(err);
        let Chunk { req, slot, stages, .. } = chunk;
        drop(stages);
        self.ring.hold(slot);
        req.release_one();
        slot
    }

    fn take_op(chunk: &mut Chunk) -> Op {
        let op = chunk.stages[chunk.next].take().expect("advance checked the stage");
        chunk.next += 1;
        op
    }
}

/// I/O worker: disk I/O and host memcpy. It binds the device's context first: it
/// issues the device copy after a read in a shallow ring (`Router::read_done`), and with
/// cuFile it moves disk <-> device bytes itself.
pub fn io_worker(router: Arc<Router>, gpu: Arc<dyn Gpu>, rx: Receiver<Job>, mut port: Port) {
    let bound = gpu.bind_thread();
    loop {
        match rx.recv() {
            Ok(Job::Run(chunk)) => run_io_stage(&router, &mut port, &bound, chunk),
            Ok(Job::Part(part)) => run_part(&router, &mut port, &bound, part),
            Ok(Job::Stop) | Err(_) => return,
        }
    }
}

fn run_io_stage(router: &Router, port: &mut Port, bound: &Result<()>, mut chunk: Chunk) {
    let op = Router::take_op(&mut chunk);
    let start = std::time::Instant::now();
    let result = run_host_op(&op, router, port, bound);
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
            if read { router.read_done(bound, chunk) } else { router.advance(chunk) }
        }
        Err(e) => router.fail(chunk, e),
    }
}

/// Runs an I/O worker's stage; `bound`: whether this thread could bind the device (for
/// cuFile).
fn run_host_op(op: &Op, router: &Router, port: &mut Port, bound: &Result<()>) -> Result<()> {
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
            unsafe { f.write_extents(port, &file.placement, extents) }?;
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
pub fn copy_thread(router: Arc<Router>, gpu: Arc<dyn Gpu>, rx: Receiver<Job>) {
    let bound = gpu.bind_thread();
    while let Ok(Job::Run(mut chunk)) = recv_spinning(&rx) {
        let op = Router::take_op(&mut chunk);
        issue_copy(&router, &*gpu, bound.clone(), op, chunk);
    }
}

/// Issues a chunk's device copies; a finished fence moves the chunk on at once, a
/// pending one goes to its lane's fence thread. So does a batch that failed after part of
/// it was queued: the chunk fails, and gives its slot back, once that part ran.
fn issue_copy(router: &Router, gpu: &dyn Gpu, bound: Result<()>, op: Op, mut chunk: Chunk) {
    let Op::DeviceCopy { kind, ops, host, after } = op else { unreachable!("only device copies are issued here") };
    chunk.issued = Some(std::time::Instant::now());
    let issued = bound.map_err(CopyError::from).and_then(|_| gpu.copy(kind, &ops, chunk.slot, host, after));
    match issued {
        Ok(fence) => {
            let bytes: u64 = ops.iter().map(|o| o.len).sum();
            match kind {
                CopyKind::HostToDevice => Counters::add(&router.counters.bytes_host_to_device, bytes),
                CopyKind::DeviceToHost => Counters::add(&router.counters.bytes_device_to_host, bytes),
                CopyKind::DeviceToDevice => {}
            }
            match fence {
                Fence::Done => {
                    router.copy_done(&chunk);
                    router.advance(chunk)
                }
                pending => router.to_fence(kind, after.is_some(), pending, chunk),
            }
        }
        Err(CopyError { error, queued: Fence::Done }) => router.fail(chunk, error),
        // Copies queued before the failure still use the slot: it goes back once they ran.
        Err(failed) => router.to_fence(kind, after.is_some(), failed.into_fence(), chunk),
    }
}

/// How long the copy and fence threads keep looking for their next job after one
/// before they sleep: back-to-back requests then find them awake (a sleeping thread
/// costs a futex wake-up, tens of microseconds on a busy host), and an idle engine
/// still uses no CPU once this has passed.
const STAY_AWAKE: std::time::Duration = std::time::Duration::from_micros(50);

fn recv_spinning<T>(rx: &Receiver<T>) -> std::result::Result<T, crossbeam_channel::RecvError> {
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
/// `REMOTE_SPIN` (a small transfer ends within it: 20 us for 256 KiB by CUDA IPC on the
/// H200), then every `REMOTE_POLL`; with nothing posted it sleeps on its queue.
///
/// A transfer that timed out or failed ends its request with `KVX_ERR_REMOTE` and closes
/// its peer's import (`Peer::close`), but is not released while it may still run:
/// NIXL's release of a running transfer cancels it, and UCX does not stop the reads and
/// writes already under way. It is kept (`Stalled`), with its slot held out of the ring
/// when the transfer goes through the slot, until NIXL reports it ended; then it is
/// released and the slot given back. One that NIXL reported failed is released at once
/// (NIXL tells nothing more of it), and its slot stays out of the ring for good.
pub fn remote_thread(router: Arc<Router>, rx: Receiver<Job>) {
    tight_timer_slack();
    let mut posted: Vec<(Posted, Chunk, bool)> = Vec::new();
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
            // Stop comes only after every slot not held, hence every posted chunk, came
            // back. Stalled transfers are released here; their held slots stay out.
            Some(Job::Stop) => return,
            Some(Job::Part(_)) => unreachable!("read parts go to the I/O workers"),
            Some(Job::Run(mut chunk)) => {
                let Op::Remote { peer, write, local, remote, ops } = Router::take_op(&mut chunk) else {
                    unreachable!("only remote transfers are queued here")
                };
                let slot = router.ring.addr(chunk.slot)..router.ring.addr(chunk.slot) + router.ring.slot_bytes();
                let through_slot = ops.iter().any(|o| slot.contains(if write { &o.src } else { &o.dst }));
                match peer.post(write, local, remote, &ops) {
                    Ok(p) => posted.push((p, chunk, through_slot)),
                    Err(e) => router.fail(chunk, e),
                }
            }
            None => {}
        }
        let now = std::time::Instant::now();
        let mut i = 0;
        while i < posted.len() {
            let p = &mut posted[i].0;
            let outcome = match p.done() {
                Ok(false) if now < p.deadline => None,
                Ok(false) => Some(Err(p.timed_out())),
                Ok(true) => Some(Ok(())),
                Err(e) => Some(Err(e)),
            };
            match outcome {
                None => i += 1,
                Some(result) => {
                    progress = now;
                    let (p, chunk, through_slot) = posted.swap_remove(i);
                    match result {
                        Ok(()) => {
                            drop(p); // ended: released before the chunk's slot is reused
                            router.advance(chunk)
                        }
                        Err(e) => {
                            p.peer.close();
                            let slot = if through_slot { Some(router.fail_holding_slot(chunk, e)) } else { router.fail(chunk, e); None };
                            stalled.push(Stalled { posted: p, slot });
                        }
                    }
                }
            }
        }
        stalled.retain_mut(|s| s.settle(&router.ring));
    }
}

/// A remote transfer that timed out or failed, kept until NIXL reports it ended.
struct Stalled {
    posted: Posted,
    /// Its chunk's slot, held out of the ring, when the transfer goes through it.
    slot: Option<u32>,
}

impl Stalled {
    /// Checks the transfer; `true` while it may still run. One that ended is released
    /// and its slot given back. One NIXL reported failed is released (NIXL tells
    /// nothing more of the parts it may still run) and its slot stays out for good; so
    /// is one whose peer was imported again, which dropped the metadata NIXL checks it
    /// against (some NIXL releases free a transfer checked after that).
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
