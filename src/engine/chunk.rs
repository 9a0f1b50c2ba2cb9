//! The chunk: a slot's worth of a request and the stages it still has to run.

use super::plan::Stages;
use super::request::Request;
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
