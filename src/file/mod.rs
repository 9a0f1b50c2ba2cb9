//! File storage: a disk layout's file (its descriptors, sizing and the moves between it
//! and slot memory), the checksum sidecar of a checksummed file, and a mapped file.
//! Above `io`, whose ports move the bytes, and `gpu`, which pins a mapping; `memory`
//! builds disk layouts on it.

pub mod checksum;
mod disk;
pub mod mapped;
mod place;

pub use disk::*;
pub use mapped::Mapping;
