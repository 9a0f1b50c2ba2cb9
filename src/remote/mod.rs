//! Remote layouts: memory of another engine (another process or host) reached through
//! NIXL's UCX backend, as one more storage of a transfer.
//!
//! An engine *exports* the layouts it chooses to share as one blob (`blob`): its agent's
//! connection metadata, and for each layout its geometry, bases and the metadata of
//! that layout's registrations only, so a peer holding the blob can reach those layouts
//! and nothing else the agent has registered. A peer *imports* the blob and gets remote
//! layouts; transfers to and from them are NIXL transfers posted by the engine's remote
//! thread (`link::Link`). UCX picks the transport (shared memory, CMA, TCP, RDMA,
//! NVLink), steered by its own environment (`UCX_TLS`, `UCX_NET_DEVICES`).

pub mod blob;
mod link;

pub use link::{abi_major, Link, Peer, PostFailed, Posted, Registration};

/// What an exported layout's memory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exported {
    Device,
    Pinned,
    Host,
}
