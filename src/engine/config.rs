//! Engine settings: `EngineConfig` with its defaults and checks, per-submit
//! `TransferOptions`, and the choice of disk I/O backend.

use super::class::Class;
use super::request::OnComplete;
use crate::error::{bail, Result};
use crate::gpu::{Device, Gpu};
use crate::io::gds::Gds;
use crate::io::uring::Ring;
use crate::io::{nixl, Port};
use std::sync::Arc;

/// How disk bytes move (`KVX_IO_*` at the C ABI).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IoBackend {
    /// Probe each and take the fastest that works here.
    #[default]
    Auto,
    Posix,
    Uring,
    Nixl,
    Gds,
}

impl IoBackend {
    /// The backend's name, for logs.
    pub fn name(self) -> &'static str {
        match self {
            IoBackend::Auto => "automatic",
            IoBackend::Posix => "pread/pwrite",
            IoBackend::Uring => "io_uring",
            IoBackend::Nixl => "NIXL",
            IoBackend::Gds => "cuFile",
        }
    }
}

/// 2 MiB slots, 32 of them: a slot written by an I/O worker is still in the CPU's
/// last-level cache when the DMA engine reads it, so the page-cache copies and the PCIe
/// reads do not both go to DRAM; a larger ring loses that
/// (`docs/decisions.md#a-larger-ring-of-larger-slots`).
pub const DEFAULT_SLOT_BYTES: u64 = 2 << 20;
pub const DEFAULT_BOUNCE_BYTES: u64 = 64 << 20;
pub const DEFAULT_MAX_INFLIGHT: u32 = 1024;
/// Smallest slot: large enough for an aligned run on any filesystem we accept.
pub const MIN_SLOT_BYTES: u64 = 64 << 10;

/// Engine settings; zero means "default" as in `kvx_engine_config`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineConfig {
    pub device: Device,
    pub io_threads: u32,
    pub io_backend: IoBackend,
    pub bounce_bytes: u64,
    pub slot_bytes: u64,
    pub max_inflight: u32,
}

/// The I/O thread count when the caller leaves it to us: three quarters of the cores
/// (the copy, fence and dispatch threads and the caller need the rest:
/// `docs/decisions.md#more-io-workers-than-three-quarters-of-the-cores`), at least 4 so an
/// NVMe queue stays busy, at most 16.
fn default_io_threads() -> u32 {
    let n = std::thread::available_parallelism().map_or(4, |n| n.get() as u32);
    (n * 3 / 4).clamp(4, 16)
}

impl EngineConfig {
    /// The effective values after defaults, or what is wrong with them (what
    /// `Engine::new` checks before it starts anything).
    pub fn resolve(&self) -> Result<EngineConfig> {
        let mut c = *self;
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
#[derive(Clone, Default)]
pub struct TransferOptions {
    pub layer_begin: u32,
    /// Exclusive; 0 means all layers.
    pub layer_end: u32,
    pub on_complete: Option<OnComplete>,
    /// A caller `CUevent` (0: none): every device copy of the transfer starts after the
    /// work it marks as of submit.
    pub wait_event: u64,
    /// Latency-critical: its caller waits for it (a prefix hit before a request's first
    /// token). Every stage it shares with bulk work serves it first, while bulk work keeps
    /// at least one turn in four (`class.rs`).
    pub critical: bool,
}

impl TransferOptions {
    /// Which queue of each stage the transfer's work goes to.
    pub(crate) fn class(&self) -> Class {
        if self.critical {
            Class::Critical
        } else {
            Class::Bulk
        }
    }
}

/// Queue depth of each I/O worker's io_uring: a chunk's extents are submitted at once.
const URING_DEPTH: u32 = 64;

/// The disk I/O an engine uses: what `kvx_engine_io_backend` reports, one port per I/O
/// worker, and cuFile when disk <-> device bytes bypass the bounce slots.
pub(super) struct IoChoice {
    pub backend: IoBackend,
    pub ports: Vec<Port>,
    pub gds: Option<Arc<Gds>>,
}

fn uring_ports(workers: u32, slots: (u64, u64)) -> std::io::Result<Vec<Port>> {
    (0..workers).map(|_| Ring::new(URING_DEPTH, Some(slots)).map(|r| Port::Uring(Box::new(r)))).collect()
}

fn posix_ports(workers: u32) -> Vec<Port> {
    (0..workers).map(|_| Port::Posix).collect()
}

/// Opens the backend the caller named, or `KVX_ERR_UNSUPPORTED` saying why it cannot work
/// here; for `KVX_IO_AUTO`, probes each and takes the fastest that works
/// (`docs/storage.md#io-backends`), logging the choice and why the others were not taken.
/// `slots` is the bounce ring (address, bytes); the engine's threads have not started.
pub(super) fn choose_io(asked: IoBackend, workers: u32, gpu: &Arc<dyn Gpu>, slots: (u64, u64)) -> Result<IoChoice> {
    let choice = |backend, ports, gds| Ok(IoChoice { backend, ports, gds });
    match asked {
        IoBackend::Posix => choice(IoBackend::Posix, posix_ports(workers), None),
        IoBackend::Uring => match uring_ports(workers, slots) {
            Ok(ports) => choice(IoBackend::Uring, ports, None),
            Err(e) => bail!(Unsupported, "KVX_IO_URING: this kernel or its seccomp policy refuses io_uring ({e}); use KVX_IO_POSIX"),
        },
        IoBackend::Nixl => {
            let ports = (0..workers).map(|_| nixl::Port::new(slots).map(Port::Nixl)).collect::<Result<Vec<_>>>()?;
            log::info!("I/O backend: NIXL POSIX plugin, one agent per I/O worker");
            choice(IoBackend::Nixl, ports, None)
        }
        IoBackend::Gds => {
            let gds = Gds::open(gpu, slots)?;
            log::info!("I/O backend: {}; checksummed files and host <-> disk transfers use the bounce slots", gds.mode());
            choice(IoBackend::Gds, posix_ports(workers), Some(Arc::new(gds)))
        }
        IoBackend::Auto => {
            let mut not_taken = Vec::new();
            // cuFile only pays when it skips the host: without nvidia-fs it reads through
            // its own bounce buffers, the same two hops as ours, one copy at a time.
            if gpu.device() == Device::Emulated {
                not_taken.push("GDS: no CUDA device".to_string());
            } else if !crate::io::gds::nvidia_fs_loaded() {
                not_taken.push(
                    "GDS: no nvidia-fs kernel module, so cuFile would run in compatibility mode (two hops, like the bounce ring)".into(),
                );
            } else {
                match Gds::open(gpu, slots) {
                    Ok(gds) => {
                        log::info!("I/O backend: {} (KVX_IO_AUTO)", gds.mode());
                        return choice(IoBackend::Gds, posix_ports(workers), Some(Arc::new(gds)));
                    }
                    Err(e) => not_taken.push(format!("GDS: {}", e.message)),
                }
            }
            not_taken.push(match nixl::missing() {
                Some(why) => format!("NIXL: {why}"),
                None => "NIXL: found, but its POSIX plugin adds a transfer request per chunk over the same kernel I/O; ask for KVX_IO_NIXL"
                    .into(),
            });
            let (backend, ports) = match uring_ports(workers, slots) {
                Ok(ports) => (IoBackend::Uring, ports),
                Err(e) => {
                    not_taken.push(format!("io_uring: refused here ({e})"));
                    (IoBackend::Posix, posix_ports(workers))
                }
            };
            log::info!("I/O backend: {} (KVX_IO_AUTO); not taken: {}", backend.name(), not_taken.join("; "));
            choice(backend, ports, None)
        }
    }
}
