//! Engine settings: `EngineConfig` with its defaults and checks, per-submit
//! `TransferOptions`, and the choice of disk I/O backend.

use super::request::Callback;
use crate::error::{bail, Error, Result, Status};
use crate::gpu;

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
pub(super) fn io_rings(asked: u32, workers: u32, bounce: (u64, u64)) -> Result<(u32, Vec<crate::io::uring::Ring>)> {
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
