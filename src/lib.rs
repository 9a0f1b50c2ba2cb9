//! kvxfer moves LLM KV-cache blocks between GPU memory, host memory and disk, through a
//! pipelined ring of pinned bounce slots, behind a stable C ABI (`include/kvxfer.h`).
//!
//! Module map (dependencies point downward):
//! - [`ffi`]: the C ABI only — handles, status codes, panic boundary, dlopen table.
//! - [`engine`]: Engine, request queue, planner, bounce ring, stage threads, completion.
//! - [`layout`]: block → region math and coalescing.
//! - [`memory`]: device, pinned, host and disk storage; registration of caller memory.
//! - [`gpu`]: the device behind a trait: CUDA, or the emulated device.
//! - [`io`]: disk I/O backends.

pub mod engine;
pub mod error;
pub mod fault;
pub mod ffi;
pub mod file;
pub mod gpu;
pub mod host;
pub mod io;
pub mod layout;
pub mod memory;

pub use engine::{Engine, EngineConfig, Request, Stats, TransferOptions};
pub use error::{Error, Result, Status};
pub use layout::{LayoutConfig, LayoutKind};
pub use memory::{Layout, StorageKind};
