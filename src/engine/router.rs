//! Routing: where a chunk goes next, and what a stage thread does when it hands one on.
//!
//! A chunk runs its stages in order and then gives its slot back; a stage of a cancelled
//! or failed request is skipped.

use super::bounce::BounceRing;
use super::chunk::Chunk;
use super::class::{Class, ClassQueue};
use super::fanout::{self, Part};
use super::plan::Op;
use super::stages::Stage;
use super::stats::Counters;
use super::writes::WriteGates;
use crate::error::{Error, Result};
use crate::gpu::{fence_lane, CopyError, CopyKind, Fence, Gate, Gpu};
use crate::io::gds::Gds;
use crossbeam_channel::Sender;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// What the stage threads' queues carry.
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
    /// The I/O workers' queue and the copy thread's, in two classes (`class.rs`).
    pub io_tx: Arc<ClassQueue<Job>>,
    pub copy_tx: Arc<ClassQueue<Job>>,
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
    /// Page-cache writes to one file, one worker at a time (`writes.rs`).
    pub writes: WriteGates,
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
            Some(Op::Remote { .. }) => {
                // The receiver lives until `Stop`, which is sent only after every slot came back.
                self.remote_tx.send(Job::Run(chunk)).unwrap_or_else(|_| unreachable!("remote thread gone with chunks in flight"))
            }
            Some(op) => {
                let tx = if op.on_copy_thread() {
                    &self.copy_tx
                } else {
                    chunk.req.mark(Stage::IoQueued);
                    &self.io_tx
                };
                tx.send(chunk.req.class(), Job::Run(chunk));
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
    /// last-level cache, which spares DRAM a write and a read that streaming stores cost:
    /// streaming every such read made large batches 6-10 % slower (docs/decisions.md,
    /// "Streaming every page-cache read").
    pub fn stream_read(&self, for_device: bool) -> bool {
        for_device && self.ring.shallow()
    }

    /// Moves a chunk on from the I/O worker that finished its disk read. In a shallow
    /// ring a device copy is issued right here: the copy thread is then often asleep,
    /// and waking it costs some 20 us (from a slot's read done to its copy issued) on
    /// every request's critical path (what a wake-up costs: docs/benchmarks.md, the
    /// layer-wise rows' "waking them").
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

    pub(super) fn copy_done(&self, chunk: &Chunk) {
        chunk.req.mark(Stage::CopyDone);
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

    /// Hands a chunk's pending device copy (`after`: its request's captured caller event)
    /// to its lane's fence thread.
    fn to_fence(&self, kind: CopyKind, after: Option<Gate>, fence: Fence, chunk: Chunk) {
        let critical = chunk.req.class() == Class::Critical;
        self.fence_tx[fence_lane(kind, chunk.slot, after, critical)]
            .send(Some((fence, chunk)))
            .unwrap_or_else(|_| unreachable!("fence thread gone"))
    }

    /// Records a stage's failure on its request and finishes the chunk.
    pub(super) fn fail(&self, chunk: Chunk, err: Error) {
        chunk.req.fail(err);
        self.finish(chunk);
    }

    /// As `fail`, but the chunk's slot stays out of the ring (`BounceRing::hold`): a
    /// remote transfer through it may still read or write it.
    pub(super) fn fail_holding_slot(&self, chunk: Chunk, err: Error) -> u32 {
        chunk.req.fail(err);
        let Chunk { req, slot, stages, .. } = chunk;
        drop(stages);
        self.ring.hold(slot);
        req.release_one();
        slot
    }

    pub(super) fn take_op(chunk: &mut Chunk) -> Op {
        let op = chunk.stages[chunk.next].take().expect("advance checked the stage");
        chunk.next += 1;
        op
    }
}

/// Routes a chunk whose next stage is a disk read: its parts to the I/O workers'
/// queue, in order, or (not cut) the chunk itself.
fn send_read(router: &Router, chunk: Chunk) {
    let Some(Some(Op::ReadDisk { for_device, .. })) = chunk.stages.get(chunk.next) else {
        unreachable!("send_read routes chunks whose next stage is a disk read")
    };
    let stream = router.stream_read(*for_device);
    let class = chunk.req.class();
    chunk.req.mark(Stage::IoQueued);
    let parts = match fanout::cut_read(chunk, router.ring.shallow(), router.io_workers, stream) {
        fanout::Cut::Parts(parts) => parts,
        fanout::Cut::Whole(chunk) => return router.io_tx.send(class, Job::Run(chunk)),
    };
    Counters::add(&router.counters.reads_fanned_out, 1);
    for part in parts {
        router.io_tx.send(class, Job::Part(part));
    }
}

/// Issues a chunk's device copies; a finished fence moves the chunk on at once, a
/// pending one goes to its lane's fence thread. So does a batch that failed after part of
/// it was queued: the chunk fails, and gives its slot back, once that part ran.
pub(super) fn issue_copy(router: &Router, gpu: &dyn Gpu, bound: Result<()>, op: Op, mut chunk: Chunk) {
    let Op::DeviceCopy { kind, ops, host, after } = op else { unreachable!("only device copies are issued here") };
    chunk.issued = Some(std::time::Instant::now());
    chunk.req.mark(Stage::CopyIssued);
    let critical = chunk.req.class() == Class::Critical;
    let issued = bound.map_err(CopyError::from).and_then(|_| gpu.copy(kind, &ops, chunk.slot, host, after, critical));
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
                pending => router.to_fence(kind, after, pending, chunk),
            }
        }
        Err(CopyError { error, queued: Fence::Done }) => router.fail(chunk, error),
        // Copies queued before the failure still use the slot: it goes back once they ran.
        Err(failed) => router.to_fence(kind, after, failed.into_fence(), chunk),
    }
}
