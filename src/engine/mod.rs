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
mod dispatch;
mod plan;
mod request;
pub mod stats;
mod worker;

pub use request::{Callback, CompletionFn, Request};
pub use stats::Stats;

use crate::error::{bail, Error, Result, Status};
use crate::gpu::{self, Gpu};
use crate::layout::{LayoutConfig, LayoutKind};
use crate::memory::{self, Layout, StorageKind};
use bounce::BounceRing;
use crossbeam_channel::Sender;
use request::Transfer;
use stats::Counters;
use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use worker::{Job, Router};

/// `KVX_IO_*`: how disk bytes move.
pub const IO_AUTO: u32 = 0;
pub const IO_POSIX: u32 = 1;
pub const IO_URING: u32 = 2;
pub const IO_NIXL: u32 = 3;
pub const IO_GDS: u32 = 4;

pub const DEFAULT_SLOT_BYTES: u64 = 4 << 20;
pub const DEFAULT_BOUNCE_BYTES: u64 = 128 << 20;
pub const DEFAULT_MAX_INFLIGHT: u32 = 1024;
/// Smallest slot: large enough for an aligned run on any filesystem we accept.
pub const MIN_SLOT_BYTES: u64 = 64 << 10;

/// Engine settings; zero means "default" as in `kvx_engine_config`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    pub device: i32,
    pub io_threads: u32,
    pub io_backend: u32,
    pub bounce_bytes: u64,
    pub slot_bytes: u64,
    pub max_inflight: u32,
    pub flags: u32,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            device: gpu::DEVICE_AUTO,
            io_threads: 0,
            io_backend: IO_AUTO,
            bounce_bytes: 0,
            slot_bytes: 0,
            max_inflight: 0,
            flags: 0,
        }
    }
}

/// The I/O thread count when the caller leaves it to us: enough parallel requests to keep
/// an NVMe queue or the page cache busy, bounded so small machines are not swamped.
fn default_io_threads() -> u32 {
    let n = std::thread::available_parallelism().map_or(4, |n| n.get() as u32);
    n.clamp(4, 16)
}

impl EngineConfig {
    /// The effective values after defaults, or what is wrong with them (what
    /// `Engine::new` checks before it starts anything).
    pub fn resolve(&self) -> Result<EngineConfig> {
        let mut c = *self;
        if c.flags != 0 {
            bail!(InvalidArg, "engine config: unknown flags {:#x}", c.flags);
        }
        match c.io_backend {
            IO_AUTO | IO_POSIX | IO_URING => {}
            IO_NIXL | IO_GDS => {
                bail!(
                    Unsupported,
                    "engine config: io_backend {} (NIXL/GDS) is not available in this build; use KVX_IO_AUTO, KVX_IO_POSIX or KVX_IO_URING",
                    c.io_backend
                )
            }
            b => bail!(InvalidArg, "engine config: io_backend {b} is not a KVX_IO_* value"),
        }
        if c.io_threads == 0 {
            c.io_threads = default_io_threads();
        }
        if c.io_threads > 256 {
            bail!(InvalidArg, "engine config: io_threads {} is more than 256", c.io_threads);
        }
        if c.slot_bytes == 0 {
            c.slot_bytes = DEFAULT_SLOT_BYTES;
        }
        if c.bounce_bytes == 0 {
            c.bounce_bytes = DEFAULT_BOUNCE_BYTES.max(2 * c.slot_bytes);
        }
        if c.slot_bytes < MIN_SLOT_BYTES || !c.slot_bytes.is_power_of_two() {
            bail!(InvalidArg, "engine config: slot_bytes {} must be a power of two of at least {MIN_SLOT_BYTES}", c.slot_bytes);
        }
        if c.bounce_bytes < c.slot_bytes || c.bounce_bytes % c.slot_bytes != 0 {
            bail!(InvalidArg, "engine config: bounce_bytes {} must be a non-zero multiple of slot_bytes {}", c.bounce_bytes, c.slot_bytes);
        }
        if c.bounce_bytes / c.slot_bytes > u32::MAX as u64 {
            bail!(InvalidArg, "engine config: bounce_bytes / slot_bytes is too many slots");
        }
        if c.max_inflight == 0 {
            c.max_inflight = DEFAULT_MAX_INFLIGHT;
        }
        Ok(c)
    }
}

/// Per-submit options, as in `kvx_transfer_options`.
#[derive(Clone, Copy, Default)]
pub struct TransferOptions {
    pub layer_begin: u32,
    /// Exclusive; 0 means all layers.
    pub layer_end: u32,
    pub flags: u32,
    pub on_complete: Option<Callback>,
    /// A caller `CUevent` (0: none): every device copy of the transfer starts after the
    /// work it marks as of submit.
    pub wait_event: u64,
}

/// Queue depth of each I/O worker's io_uring: a chunk's extents are submitted at once.
const URING_DEPTH: u32 = 64;

/// Resolves the I/O backend: POSIX as asked; io_uring as asked (one ring per worker) or
/// `KVX_ERR_UNSUPPORTED` with the kernel's reason; AUTO takes POSIX and says whether
/// io_uring would have been available (it is not yet measured faster on every host).
fn io_rings(asked: u32, workers: u32, bounce: (u64, u64)) -> Result<(u32, Vec<crate::io::uring::Ring>)> {
    use crate::io::uring::Ring;
    match asked {
        IO_URING => {
            let rings = (0..workers).map(|_| Ring::new(URING_DEPTH, Some(bounce))).collect::<std::io::Result<Vec<_>>>().map_err(|e| {
                Error::new(Status::Unsupported, format!("KVX_IO_URING: this kernel or its seccomp policy refuses io_uring ({e}); use KVX_IO_POSIX"))
            })?;
            Ok((IO_URING, rings))
        }
        IO_AUTO => {
            match Ring::new(2, None) {
                Ok(_) => log::info!("I/O backend: pread/pwrite (KVX_IO_AUTO); io_uring is available as KVX_IO_URING"),
                Err(e) => log::info!("I/O backend: pread/pwrite (KVX_IO_AUTO); io_uring is not available here ({e})"),
            }
            Ok((IO_POSIX, Vec::new()))
        }
        _ => Ok((IO_POSIX, Vec::new())),
    }
}

static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(1);

/// Submission side of the request queue. `accepting` is checked and the request sent
/// under one lock, so no request can slip in behind the dispatcher's stop message.
struct Intake {
    accepting: bool,
    tx: Sender<Option<Arc<Request>>>,
}

pub struct Engine {
    id: u64,
    cfg: EngineConfig,
    gpu: Arc<dyn Gpu>,
    counters: Arc<Counters>,
    ring: Arc<BounceRing>,
    router: Arc<Router>,
    intake: Mutex<Intake>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

thread_local! {
    /// Set on the engine's own threads, where callbacks run.
    static ON_ENGINE_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            ON_ENGINE_THREAD.with(|t| t.set(true));
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
        let (io_backend, mut rings) = io_rings(cfg.io_backend, cfg.io_threads, ring.memory())?;
        let counters = Arc::new(Counters::default());
        let (io_tx, io_rx) = crossbeam_channel::unbounded();
        let (copy_tx, copy_rx) = crossbeam_channel::unbounded();
        let (fence_tx, fence_rx): (Vec<_>, Vec<_>) = (0..gpu::FENCE_LANES).map(|_| crossbeam_channel::unbounded()).unzip();
        let (req_tx, req_rx) = crossbeam_channel::bounded(cfg.max_inflight as usize + 1);
        let router = Arc::new(Router {
            ring: ring.clone(),
            counters: counters.clone(),
            io_tx,
            copy_tx,
            fence_tx,
            shutdown: Default::default(),
        });
        let id = NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed);
        let engine = Engine {
            id,
            cfg: EngineConfig { io_backend, ..cfg },
            gpu: gpu.clone(),
            counters,
            ring: ring.clone(),
            router: router.clone(),
            intake: Mutex::new(Intake { accepting: true, tx: req_tx }),
            threads: Mutex::new(Vec::new()),
        };
        // If a spawn fails, dropping `engine` stops the threads already started.
        {
            let mut threads = engine.threads.lock().unwrap();
            for i in 0..cfg.io_threads {
                let (r, rx, uring) = (router.clone(), io_rx.clone(), rings.pop());
                threads.push(spawn(format!("kvx-io-{i}"), move || worker::io_worker(r, rx, uring))?);
            }
            let (r, g) = (router.clone(), gpu.clone());
            threads.push(spawn("kvx-copy".into(), move || worker::copy_thread(r, g, copy_rx))?);
            for (lane, rx) in fence_rx.into_iter().enumerate() {
                let (r, g) = (router.clone(), gpu.clone());
                threads.push(spawn(format!("kvx-fence-{lane}"), move || worker::fence_thread(r, g, rx))?);
            }
            let (r, rg) = (router, ring);
            threads.push(spawn("kvx-dispatch".into(), move || dispatch::dispatcher(r, rg, req_rx))?);
        }
        log::info!(
            "engine {id}: {}, {} I/O threads ({}), {} bounce slots of {} KiB",
            gpu.describe(),
            cfg.io_threads,
            if io_backend == IO_URING { "io_uring" } else { "pread/pwrite" },
            slots,
            cfg.slot_bytes >> 10
        );
        Ok(engine)
    }

    /// The resolved device: a CUDA ordinal, or -1 for the emulated device.
    pub fn device(&self) -> i32 {
        self.gpu.ordinal()
    }

    /// The disk I/O backend in use: `IO_POSIX` or `IO_URING`.
    pub fn io_backend(&self) -> u32 {
        self.cfg.io_backend
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Bounce slots: (free now, total). All free when no chunk is in flight.
    pub fn slots(&self) -> (u32, u32) {
        (self.ring.free_slots(), self.ring.slots())
    }

    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }

    pub fn create_layout(&self, cfg: &LayoutConfig, kind: LayoutKind, storage: StorageKind) -> Result<Arc<Layout>> {
        let geom = cfg.validate()?;
        Ok(Arc::new(Layout::create_memory(self.id, &self.gpu, kind, geom, storage)?))
    }

    pub fn register_layout(&self, cfg: &LayoutConfig, kind: LayoutKind, storage: StorageKind, bases: &[u64]) -> Result<Arc<Layout>> {
        let geom = cfg.validate()?;
        Ok(Arc::new(Layout::register_memory(self.id, &self.gpu, kind, geom, storage, bases)?))
    }

    pub fn create_disk_layout(&self, cfg: &LayoutConfig, path: &Path, flags: u32) -> Result<Arc<Layout>> {
        let geom = cfg.validate()?;
        let layout = Layout::create_disk(self.id, geom, path, flags)?;
        let align = layout.disk().map_or(0, |f| f.align());
        if self.cfg.slot_bytes < 2 * align {
            bail!(Unsupported, "{} needs {align}-byte aligned I/O; raise slot_bytes to at least {}", path.display(), 2 * align);
        }
        // Checksums are computed per region inside one slot, so a region must fit in one.
        let region = layout.geometry().region_bytes;
        if flags & DISK_CHECKSUM != 0 && region + 2 * align > self.cfg.slot_bytes {
            bail!(
                Unsupported,
                "KVX_DISK_CHECKSUM hashes whole {region}-byte regions inside one bounce slot; raise slot_bytes above {}",
                region + 2 * align
            );
        }
        Ok(Arc::new(layout))
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
        let transfer = self.validate(src, src_blocks, dst, dst_blocks, opts)?;
        if self.counters.inflight.fetch_add(1, Ordering::AcqRel) >= self.cfg.max_inflight {
            self.counters.inflight.fetch_sub(1, Ordering::AcqRel);
            bail!(Busy, "{} requests are in flight (max_inflight); wait for one to complete and submit again", self.cfg.max_inflight);
        }
        let req = Arc::new(Request::new(transfer, self.counters.clone(), opts.on_complete));
        req.c_handle.store(Arc::as_ptr(&req) as u64, Ordering::Release);
        let intake = self.intake.lock().unwrap();
        if !intake.accepting {
            self.counters.inflight.fetch_sub(1, Ordering::AcqRel);
            bail!(Shutdown, "the engine is shutting down");
        }
        intake.tx.send(Some(req.clone())).map_err(|_| Error::new(Status::Internal, "request queue closed"))?;
        Ok(req)
    }

    /// Runs every check `submit` makes, without starting anything (a dry run).
    pub fn check(&self, src: &Arc<Layout>, src_blocks: &[u64], dst: &Arc<Layout>, dst_blocks: &[u64], opts: &TransferOptions) -> Result<()> {
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
        if opts.flags != 0 {
            bail!(InvalidArg, "unknown transfer flags {:#x}", opts.flags);
        }
        let (sg, dg) = (src.geometry(), dst.geometry());
        if !sg.same_block_shape(dg) {
            let (a, b) = (&sg.cfg, &dg.cfg);
            bail!(
                Incompatible,
                "block geometry differs: source (layers {}, outer {}, page {}, inner {}, dtype {}) vs destination ({}, {}, {}, {}, {})",
                a.num_layers, a.outer_dim, a.page_size, a.inner_dim, a.dtype_bytes,
                b.num_layers, b.outer_dim, b.page_size, b.inner_dim, b.dtype_bytes
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

    /// Cancels queued requests, waits for chunks in flight, then joins every thread.
    /// Called by `Drop`; safe to call twice. From a completion callback (an engine
    /// thread) the joining is handed to a helper thread instead of deadlocking.
    pub fn shutdown(&self) {
        {
            let mut intake = self.intake.lock().unwrap();
            if !intake.accepting {
                return;
            }
            intake.accepting = false;
            self.router.shutdown.store(true, Ordering::Release);
            let _ = intake.tx.send(None);
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap());
        let (router, ring) = (self.router.clone(), self.ring.clone());
        let workers = self.cfg.io_threads;
        let teardown = move || {
            let me = std::thread::current().id();
            let (dispatcher, rest): (Vec<_>, Vec<_>) =
                threads.into_iter().partition(|t| t.thread().name() == Some("kvx-dispatch"));
            for t in dispatcher {
                let _ = t.join();
            }
            ring.drain_all();
            for _ in 0..workers {
                let _ = router.io_tx.send(Job::Stop);
            }
            let _ = router.copy_tx.send(Job::Stop);
            for tx in &router.fence_tx {
                let _ = tx.send(None);
            }
            for t in rest.into_iter().filter(|t| t.thread().id() != me) {
                let _ = t.join();
            }
        };
        if ON_ENGINE_THREAD.with(|t| t.get()) {
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

pub use memory::disk::{DISK_BUFFERED, DISK_CHECKSUM, DISK_CREATE, DISK_KEEP, DISK_SYNC};
