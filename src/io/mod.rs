//! Disk I/O backends: POSIX pread/pwrite, or io_uring, from the engine's I/O workers.

#[doc(hidden)]
pub mod fault;
pub mod posix;
pub mod uring;
