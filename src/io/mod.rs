//! Disk I/O backends, run by the engine's I/O workers: POSIX pread/pwrite, io_uring,
//! NIXL's POSIX backend (each a `Port`, one per worker), and cuFile (`gds`), which moves
//! bytes between the file and device memory with no bounce slot.

pub mod gds;
pub mod nixl;
pub mod posix;
mod posted;
pub mod uring;

/// One I/O: file descriptor, memory address (host, or device for cuFile), length, file
/// offset.
#[derive(Clone, Copy, Debug)]
pub struct Io {
    pub fd: std::os::fd::RawFd,
    pub addr: u64,
    pub len: u64,
    pub off: u64,
}

/// How one I/O worker moves bytes between a file and its bounce slots.
pub enum Port {
    Posix,
    // Boxed: a ring with its bookkeeping is far larger than the other ports.
    Uring(Box<uring::Ring>),
    Nixl(nixl::Port),
}
