//! Disk I/O backends. Today: POSIX pread/pwrite from the engine's I/O worker threads.

#[doc(hidden)]
pub mod fault;
pub mod posix;
