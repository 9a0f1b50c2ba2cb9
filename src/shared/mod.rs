//! The shared tier: KV blocks shared by any number of processes on any number of hosts,
//! one object per block, in an existing system (a shared directory; S3-compatible object
//! storage), with no owner and no lock, verified on every read.
//!
//! ```text
//! store get ─► local misses ─► tier: read objects (threads, bounded) ─► header and checksum
//!                 checked ─► staging ─► engine: staging → dst ─► key Ok (and admitted locally)
//! store put ─► local put ─► committed keys ─► tier: write objects (behind, or through)
//! ```
//!
//! An object names its namespace and key in full and checksums its payload (`object`), so
//! what a reader serves is the block stored under the key asked for, or a miss with the
//! reason: torn, damaged, renamed and foreign objects included. Publishing is whole or
//! nothing (`Backend::write`). Keys name content, so two writers of a key write the same
//! bytes and the order of their writes does not matter.

mod backend;
mod dir;
pub mod object;
pub mod read;
mod s3;
pub mod tier;

pub use backend::{Backend, Sink};
pub use dir::DirBackend;
pub use s3::S3Backend;
pub use tier::{Tier, TierStats};

use crate::error::{bail, Result};
use std::path::PathBuf;
use std::time::Duration;

/// Where a shared tier's objects live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// A directory many processes (or hosts, over NFS, Lustre, CephFS) open at once. Past
    /// `capacity_bytes` (0: unbounded) writers evict the least recently used objects.
    Dir { path: PathBuf, capacity_bytes: u64 },
    /// An S3-compatible bucket: objects under `prefix`. Credentials come from the standard
    /// AWS environment variables and files, never from here, and are never logged.
    S3(S3Location),
}

/// An S3-compatible bucket, as every S3 client is pointed at one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct S3Location {
    /// `http(s)://host:port`; empty: AWS_ENDPOINT_URL, else AWS's own endpoint for the region.
    pub endpoint: String,
    /// Empty: AWS_REGION, else AWS_DEFAULT_REGION, else `us-east-1`.
    pub region: String,
    pub bucket: String,
    /// Prepended to every object's name (`prefix/ab/<digest>`); may be empty.
    pub prefix: String,
}

/// How puts reach the shared tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteMode {
    /// A put's keys report once the local store holds them; their objects are written
    /// after, at bulk priority, and dropped (counted) when more are waiting than
    /// `SharedConfig::pending_puts`.
    Behind,
    /// A put's keys report once their objects are published too.
    Through,
}

/// A shared tier, as a store is opened with it.
#[derive(Clone, Debug)]
pub struct SharedConfig {
    pub location: Location,
    /// Threads that run the backend's calls (each call may block); 0: 16.
    pub threads: u32,
    /// The longest a lookup or get waits for the shared tier; past it, its keys are misses
    /// (`Timeout`). 0: 5 seconds.
    pub timeout: Duration,
    pub write: WriteMode,
    /// A block a get loads from the shared tier is also put into the local store.
    pub admit: bool,
    /// Blocks waiting to be written behind, at most; 0: 1024.
    pub pending_puts: u32,
}

impl SharedConfig {
    pub fn new(location: Location) -> SharedConfig {
        SharedConfig { location, threads: 0, timeout: Duration::ZERO, write: WriteMode::Behind, admit: true, pending_puts: 0 }
    }

    pub(crate) fn threads(&self) -> usize {
        if self.threads == 0 {
            16
        } else {
            self.threads as usize
        }
    }

    pub(crate) fn timeout(&self) -> Duration {
        if self.timeout.is_zero() {
            Duration::from_secs(5)
        } else {
            self.timeout
        }
    }

    pub(crate) fn pending_puts(&self) -> usize {
        if self.pending_puts == 0 {
            1024
        } else {
            self.pending_puts as usize
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.threads > 256 {
            bail!(InvalidArg, "shared tier threads is {}; use 1 to 256 (0 for 16)", self.threads);
        }
        match &self.location {
            Location::Dir { path, .. } if path.as_os_str().is_empty() => {
                bail!(InvalidArg, "the shared directory's path is empty; name a directory every process can reach")
            }
            Location::S3(s) if s.bucket.is_empty() => bail!(InvalidArg, "the shared tier's S3 bucket is empty; name a bucket"),
            _ => Ok(()),
        }
    }

    /// Opens the backend the location names.
    pub(crate) fn open_backend(&self) -> Result<std::sync::Arc<dyn Backend>> {
        match &self.location {
            Location::Dir { path, capacity_bytes } => Ok(std::sync::Arc::new(DirBackend::open(path, *capacity_bytes)?)),
            Location::S3(s) => Ok(std::sync::Arc::new(S3Backend::open(s, self.timeout())?)),
        }
    }
}
