//! The engine: request queue, dispatcher, bounce ring and stage threads.
//!
//! ```text
//! submit ─► request queue ─► dispatcher: plan chunks, take a slot for each
//!                               │
//!        I/O workers (disk, memcpy) ◄──► copy thread (device copies) ──► fence thread
//!                               │
//!                     last chunk: request complete
//! ```

mod bounce;
mod chunk;
mod class;
mod completions;
mod config;
mod dispatch;
mod fanout;
mod plan;
mod remote;
mod request;
mod router;
mod stages;
pub mod stats;
mod worker;
mod writes;

pub use config::*;
pub use remote::DEFAULT_TIMEOUT as DEFAULT_REMOTE_TIMEOUT;
pub use request::{OnComplete, Request};
pub use stats::Stats;

use crate::error::{bail, Error, Result, Status};
use crate::file::DiskFlags;
use crate::gpu::{self, Device, Gpu};
use crate::layout::{LayoutConfig, LayoutKind};
use crate::memory::{Layout, StorageKind};
use bounce::BounceRing;
pub(crate) use completions::Completions;
use crossbeam_channel::Sender;
pub(crate) use request::wait_refusal;
use request::Transfer;
use router::{Job, Router};
use stats::Counters;
use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(1);

/// Submission side. Submits hold the read lock while they check `accepting`, dispatch on
/// their own thread and queue work; shutdown takes the write lock to stop accepting, so
/// no request slips in behind the dispatcher's stop message and none is half dispatched
/// when the teardown starts. The queue is unbounded, so no send under the lock waits.
struct Intake {
    accepting: bool,
    tx: Sender<Option<dispatch::Work>>,
}

pub struct Engine {
    id: u64,
    cfg: EngineConfig,
    gpu: Arc<dyn Gpu>,
    counters: Arc<Counters>,
    ring: Arc<BounceRing>,
    router: Arc<Router>,
    intake: RwLock<Intake>,
    threads: Mutex<Threads>,
    /// NIXL with UCX, for remote layouts: started by the first export or import.
    link: Mutex<Option<Arc<crate::remote::Link>>>,
    /// The completion fd, signalled by every request of this engine (and of its stores).
    completions: Arc<Completions>,
}

/// The engine's threads: the dispatcher is joined first (it stops taking requests),
/// then the stage threads once every slot is back.
#[derive(Default)]
struct Threads {
    dispatcher: Option<JoinHandle<()>>,
    stages: Vec<JoinHandle<()>>,
}

thread_local! {
    /// The id of the engine whose thread this is (0: none), where its callbacks run.
    static ENGINE_OF_THREAD: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn spawn(engine: u64, name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            ENGINE_OF_THREAD.with(|t| t.set(engine));
            f()
        })
        .map_err(|e| Error::new(Status::NoMemory, format!("starting an engine thread: {e}")))
}

impl Engine {
    pub fn new(config: &EngineConfig) -> Result<Engine> {
        let cfg = config.resolve()?;
        let gpu = gpu::open_device(cfg.device)?;
        let slots = (cfg.bounce_bytes / cfg.slot_bytes) as u32;
        let ring = Arc::new(BounceRing::new(gpu.clone(), slots, cfg.slot_bytes)?);
        gpu.prepare_slots(slots, cfg.slot_bytes)?;
        let io = config::choose_io(cfg.io_backend, cfg.io_threads, &gpu, ring.memory())?;
        let io_backend = io.backend;
        let counters = Arc::new(Counters::default());
        let io_tx = Arc::new(class::ClassQueue::default());
        let copy_tx = Arc::new(class::ClassQueue::default());
        let (remote_tx, remote_rx) = crossbeam_channel::unbounded();
        let (fence_tx, fence_rx): (Vec<_>, Vec<_>) = (0..gpu::FENCE_LANES).map(|_| crossbeam_channel::unbounded()).unzip();
        // Unbounded: admission is the in-flight count, checked in `submit`. A request
        // cancelled while queued leaves that count but stays in the queue until the
        // dispatcher reaches it, so a queue bounded by the count could make `send` wait.
        let (req_tx, req_rx) = crossbeam_channel::unbounded();
        let router = Arc::new(Router {
            ring: ring.clone(),
            counters: counters.clone(),
            io_tx: io_tx.clone(),
            copy_tx: copy_tx.clone(),
            remote_tx,
            fence_tx,
            shutdown: Default::default(),
            gds: io.gds,
            gpu: gpu.clone(),
            queued: AtomicU64::new(0),
            io_workers: cfg.io_threads as usize,
            writes: Default::default(),
        });
        let id = NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed);
        let engine = Engine {
            id,
            // What the caller's Auto choices resolved to.
            cfg: EngineConfig { io_backend, device: gpu.device(), ..cfg },
            gpu: gpu.clone(),
            counters,
            ring: ring.clone(),
            router: router.clone(),
            intake: RwLock::new(Intake { accepting: true, tx: req_tx }),
            threads: Mutex::new(Threads::default()),
            link: Mutex::new(None),
            completions: Arc::default(),
        };
        // If a spawn fails, dropping `engine` stops the threads already started.
        {
            let mut threads = engine.threads.lock().unwrap();
            for (i, port) in io.ports.into_iter().enumerate() {
                let (r, g, rx) = (router.clone(), gpu.clone(), io_tx.clone());
                threads.stages.push(spawn(id, format!("kvx-io-{i}"), move || worker::io_worker(r, g, rx, port))?);
            }
            let (r, g) = (router.clone(), gpu.clone());
            threads.stages.push(spawn(id, "kvx-copy".into(), move || worker::copy_thread(r, g, copy_tx))?);
            let r = router.clone();
            threads.stages.push(spawn(id, "kvx-remote".into(), move || worker::remote_thread(r, remote_rx))?);
            for (lane, rx) in fence_rx.into_iter().enumerate() {
                let (r, g) = (router.clone(), gpu.clone());
                threads.stages.push(spawn(id, format!("kvx-fence-{lane}"), move || worker::fence_thread(r, g, rx))?);
            }
            let (r, rg) = (router, ring);
            threads.dispatcher = Some(spawn(id, "kvx-dispatch".into(), move || dispatch::dispatcher(r, rg, req_rx))?);
        }
        log::info!(
            "engine {id}: {}, {} I/O threads ({}), {} bounce slots of {} KiB",
            gpu.describe(),
            cfg.io_threads,
            io_backend.name(),
            slots,
            cfg.slot_bytes >> 10
        );
        Ok(engine)
    }

    /// The resolved device: a CUDA ordinal or the emulated device, never `Auto`.
    pub fn device(&self) -> Device {
        self.cfg.device
    }

    /// The disk I/O backend in use, never `Auto`.
    pub fn io_backend(&self) -> IoBackend {
        self.cfg.io_backend
    }

    /// The settings the engine runs with: defaults filled in, `Auto` choices resolved.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Bounce slots: (free now, total). All free when no chunk is in flight.
    pub fn slots(&self) -> (u32, u32) {
        (self.ring.free_slots(), self.ring.slots())
    }

    /// An eventfd (non-blocking, close-on-exec) that becomes readable once a request of
    /// this engine has ended since the caller last read it: a transfer, or a put or get
    /// of a store on this engine. Read it (8 bytes) to reset it, then poll the requests;
    /// a request that ends after the read makes it readable again, so none is missed.
    /// Made by the first call; ends before it are not counted. Owned by the engine and
    /// closed when it shuts down (`Shutdown` after that); the caller never closes it.
    pub fn completion_fd(&self) -> Result<std::os::fd::RawFd> {
        if self.is_shut_down() {
            bail!(Shutdown, "the engine is shutting down");
        }
        self.completions.fd()
    }

    pub(crate) fn completions(&self) -> &Arc<Completions> {
        &self.completions
    }

    /// The engine's id, which its layouts and requests carry.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub fn stats(&self) -> Stats {
        Stats { slots_quarantined: self.ring.held() as u64, ..self.counters.snapshot() }
    }

    pub fn create_layout(&self, cfg: &LayoutConfig, kind: LayoutKind, storage: StorageKind) -> Result<Arc<Layout>> {
        let geom = cfg.validate()?;
        Ok(Arc::new(Layout::create_memory(self.id, &self.gpu, kind, geom, storage)?))
    }

    pub fn register_layout(&self, cfg: &LayoutConfig, kind: LayoutKind, storage: StorageKind, bases: &[u64]) -> Result<Arc<Layout>> {
        let geom = cfg.validate()?;
        Ok(Arc::new(Layout::register_memory(self.id, &self.gpu, kind, geom, storage, bases)?))
    }

    pub fn create_disk_layout(&self, cfg: &LayoutConfig, path: &Path, flags: DiskFlags) -> Result<Arc<Layout>> {
        let geom = cfg.validate()?;
        Ok(Arc::new(Layout::create_disk(self.id, &self.gpu, geom, path, flags, self.cfg.slot_bytes)?))
    }

    /// Validates everything, then queues the transfer; nothing starts if this fails.
    pub fn submit(
        &self,
        src: &Arc<Layout>,
        src_blocks: &[u64],
        dst: &Arc<Layout>,
        dst_blocks: &[u64],
        opts: &TransferOptions,
    ) -> Result<Arc<Request>> {
        self.submit_signalling(src, src_blocks, dst, dst_blocks, opts, Some(self.completions.clone()), true, None)
    }

    /// As `submit`, for a transfer the store makes for one of its requests: its end does
    /// not signal the completion fd, which the store request signals when it ends (a
    /// signal of its own would come after the store request is seen to end). It is never
    /// refused for `max_inflight` nor counted against it: a refusal would fail keys whose
    /// blocks are sound, and the store's calls (a transfer per shard each touches) are the
    /// caller's to pace. Into a checksummed disk layout, `write_ids[i]` is the identity of
    /// the write of `dst_blocks[i]` (a store's slots), which its checksums' tags carry.
    pub(crate) fn submit_for_store(
        &self,
        src: &Arc<Layout>,
        src_blocks: &[u64],
        dst: &Arc<Layout>,
        dst_blocks: &[u64],
        opts: &TransferOptions,
        write_ids: Option<&[u64]>,
    ) -> Result<Arc<Request>> {
        self.submit_signalling(src, src_blocks, dst, dst_blocks, opts, None, false, write_ids)
    }

    #[allow(clippy::too_many_arguments)]
    fn submit_signalling(
        &self,
        src: &Arc<Layout>,
        src_blocks: &[u64],
        dst: &Arc<Layout>,
        dst_blocks: &[u64],
        opts: &TransferOptions,
        completions: Option<Arc<Completions>>,
        admitted: bool,
        write_ids: Option<&[u64]>,
    ) -> Result<Arc<Request>> {
        let transfer = self.validate(src, src_blocks, dst, dst_blocks, opts)?;
        let write_ids = write_ids.map(|ids| Arc::new(dst_blocks.iter().copied().zip(ids.iter().copied()).collect()));
        if admitted && self.counters.inflight.fetch_add(1, Ordering::AcqRel) >= self.cfg.max_inflight {
            self.counters.inflight.fetch_sub(1, Ordering::AcqRel);
            bail!(Busy, "{} requests are in flight (max_inflight); wait for one to complete and submit again", self.cfg.max_inflight);
        }
        let req = Arc::new(Request::new(
            self.id,
            opts.class(),
            transfer,
            self.counters.clone(),
            completions,
            admitted,
            opts.on_complete.clone(),
            write_ids,
        ));
        let intake = self.intake.read().unwrap();
        if !intake.accepting {
            if admitted {
                self.counters.inflight.fetch_sub(1, Ordering::AcqRel);
            }
            bail!(Shutdown, "the engine is shutting down");
        }
        let queue = |work| {
            self.router.queued.fetch_add(1, Ordering::AcqRel);
            // The dispatcher lives until the stop message, which is sent under the write lock.
            intake.tx.send(Some(work)).unwrap_or_else(|_| unreachable!("the dispatcher stopped while the engine accepts requests"));
        };
        if self.router.queued.load(Ordering::Acquire) > 0 || !req.claim() {
            queue(dispatch::Work::Start(req.clone()));
            return Ok(req);
        }
        // The dispatcher has nothing in hand: dispatch here while slots are free.
        if let Some(planner) = dispatch::planner(&req, &self.ring, &self.router) {
            if let Some(rest) = dispatch::dispatch_here(&self.router, &self.ring, &req, planner) {
                queue(dispatch::Work::Rest(req.clone(), Box::new(rest)));
                return Ok(req);
            }
        }
        // Every chunk is out; give up the dispatcher's count, unless the chunks already
        // finished, so completing (and the callback) would happen on this thread.
        if !req.release_unless_last() {
            queue(dispatch::Work::Release(req.clone()));
        }
        Ok(req)
    }

    /// Runs every check `submit` makes, without starting anything (a dry run).
    pub fn check(
        &self,
        src: &Arc<Layout>,
        src_blocks: &[u64],
        dst: &Arc<Layout>,
        dst_blocks: &[u64],
        opts: &TransferOptions,
    ) -> Result<()> {
        self.validate(src, src_blocks, dst, dst_blocks, opts).map(drop)
    }

    fn validate(
        &self,
        src: &Arc<Layout>,
        src_blocks: &[u64],
        dst: &Arc<Layout>,
        dst_blocks: &[u64],
        opts: &TransferOptions,
    ) -> Result<Transfer> {
        if src.engine_id != self.id || dst.engine_id != self.id {
            bail!(InvalidArg, "a layout belongs to another engine; create layouts on the engine that transfers them");
        }
        if src_blocks.is_empty() {
            bail!(InvalidArg, "num_blocks is 0; a transfer moves at least one block");
        }
        if src_blocks.len() != dst_blocks.len() {
            bail!(InvalidArg, "{} source blocks but {} destination blocks", src_blocks.len(), dst_blocks.len());
        }
        let (sg, dg) = (src.geometry(), dst.geometry());
        if !sg.same_block_shape(dg) {
            let (a, b) = (&sg.cfg, &dg.cfg);
            bail!(
                Incompatible,
                "block geometry differs: source (layers {}, outer {}, page {}, inner {}, dtype {}) vs destination ({}, {}, {}, {}, {})",
                a.num_layers,
                a.outer_dim,
                a.page_size,
                a.inner_dim,
                a.dtype_bytes,
                b.num_layers,
                b.outer_dim,
                b.page_size,
                b.inner_dim,
                b.dtype_bytes
            );
        }
        let num_layers = sg.cfg.num_layers;
        let begin = opts.layer_begin as u64;
        let end = if opts.layer_end == 0 { num_layers } else { opts.layer_end as u64 };
        if end > num_layers {
            bail!(OutOfRange, "layer_end {end} is past the layout's {num_layers} layers");
        }
        if begin >= end {
            bail!(InvalidArg, "layer range [{begin}, {end}) is empty");
        }
        for (side, blocks, layout) in [("source", src_blocks, src), ("destination", dst_blocks, dst)] {
            let n = layout.geometry().cfg.num_blocks;
            if let Some((i, b)) = blocks.iter().enumerate().find(|(_, &b)| b >= n) {
                bail!(OutOfRange, "{side} block id {b} (index {i}) is out of range; the layout has {n} blocks");
            }
        }
        let mut seen = HashSet::with_capacity(dst_blocks.len());
        for (i, &b) in dst_blocks.iter().enumerate() {
            if !seen.insert(b) {
                bail!(InvalidArg, "destination block {b} appears twice (index {i}); each destination block may be written once");
            }
        }
        if src.id == dst.id {
            if let Some(b) = src_blocks.iter().find(|b| seen.contains(b)) {
                bail!(InvalidArg, "block {b} is both a source and a destination in the same layout; the result would depend on timing");
            }
        }
        self.validate_remote(src, dst)?;
        let wait = match opts.wait_event {
            0 => None,
            ev => Some(request::CapturedEvent::new(self.gpu.clone(), ev)?),
        };
        Ok(Transfer {
            src: src.clone(),
            dst: dst.clone(),
            pairs: src_blocks.iter().copied().zip(dst_blocks.iter().copied()).collect(),
            layers: begin..end,
            wait,
        })
    }

    /// Whether `shutdown` has begun: the engine takes no more requests.
    pub fn is_shut_down(&self) -> bool {
        !self.intake.read().unwrap().accepting
    }

    /// Cancels queued requests, waits for chunks in flight, then joins every thread.
    /// Called by `Drop`; safe to call twice. From a completion callback on this engine's
    /// own thread the joining is handed to a helper thread instead of deadlocking.
    pub fn shutdown(&self) {
        {
            let mut intake = self.intake.write().unwrap();
            if !intake.accepting {
                return;
            }
            intake.accepting = false;
            self.router.shutdown.store(true, Ordering::Release);
            self.ring.close();
            let _ = intake.tx.send(None);
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap());
        let (router, ring) = (self.router.clone(), self.ring.clone());
        let workers = self.cfg.io_threads;
        let completions = self.completions.clone();
        let teardown = move || {
            if let Some(t) = threads.dispatcher {
                let _ = t.join();
            }
            ring.drain_all();
            for _ in 0..workers {
                router.io_tx.send(class::Class::Bulk, Job::Stop);
            }
            router.copy_tx.send(class::Class::Bulk, Job::Stop);
            let _ = router.remote_tx.send(Job::Stop);
            for tx in &router.fence_tx {
                let _ = tx.send(None);
            }
            for t in threads.stages {
                let _ = t.join();
            }
            // Every request of the engine has ended: nothing signals it any more.
            completions.close();
        };
        // On one of this engine's own threads (a completion callback) the joining would
        // wait for this very thread: hand it to a helper.
        if ENGINE_OF_THREAD.with(|t| t.get()) == self.id {
            log::warn!("engine destroyed from one of its own threads (a completion callback); finishing shutdown in the background");
            let _ = std::thread::Builder::new().name("kvx-teardown".into()).spawn(teardown);
        } else {
            teardown();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
