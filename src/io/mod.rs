//! Disk I/O backends, run by the engine's I/O workers: POSIX pread/pwrite, io_uring,
//! NIXL's POSIX backend (each a `Port`, one per worker), and cuFile (`gds`), which moves
//! bytes between the file and device memory with no bounce slot.

pub mod gds;
pub mod nixl;
pub mod posix;
mod posted;
pub mod streamed;
pub mod uring;

use crate::error::Result;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// One I/O: file descriptor, memory address (host, or device for cuFile), length, file
/// offset.
#[derive(Clone, Copy, Debug)]
pub struct Io {
    pub fd: std::os::fd::RawFd,
    pub addr: u64,
    pub len: u64,
    pub off: u64,
}

/// One disk I/O between a file range and slot memory, as the planner cuts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub file_off: u64,
    pub addr: u64,
    pub len: u64,
    /// Aligned in file, memory and length: may use the `O_DIRECT` descriptor.
    pub aligned: bool,
    /// Bytes of block padding after the data, zeroed before an aligned write.
    pub zero_tail: u64,
    /// The bytes the transfer asked for, inside the (possibly widened) extent:
    /// (file offset, slot address, length). Whole regions; checksums cover these.
    pub payload: (u64, u64, u64),
}

/// A file's identity for the ports that register files with a library (NIXL, cuFile):
/// a registration is kept while its key lives and dropped once it is gone, so a
/// descriptor number that a later file reuses is never served a stale registration.
#[derive(Debug)]
pub struct FileKey {
    /// Unique per opened file.
    pub id: u64,
    /// Bytes of the file that transfers address.
    pub bytes: u64,
}

impl FileKey {
    pub fn new(bytes: u64) -> Arc<FileKey> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Arc::new(FileKey { id: NEXT.fetch_add(1, Ordering::Relaxed), bytes })
    }
}

/// How one I/O worker moves bytes between a file and its bounce slots.
pub enum Port {
    Posix,
    // Boxed: a ring with its bookkeeping is far larger than the other ports.
    Uring(Box<uring::Ring>),
    Nixl(nixl::Port),
}

impl Port {
    /// Moves every byte of `ios` (all reads or all writes) between `file` and slot memory.
    ///
    /// # Safety
    /// Every `Io`'s memory must lie in slot memory the caller owns until this returns.
    pub unsafe fn run(&mut self, write: bool, file: &Arc<FileKey>, ios: &[Io]) -> Result<()> {
        match self {
            Port::Uring(ring) => ring.run(write, ios),
            Port::Nixl(nixl) => nixl.run(write, file, ios),
            Port::Posix => ios.iter().try_for_each(|io| {
                let fd = std::os::fd::BorrowedFd::borrow_raw(io.fd);
                match write {
                    true => posix::write_all_at(fd, io.addr as *const u8, io.len, io.off),
                    false => posix::read_exact_at(fd, io.addr as *mut u8, io.len, io.off),
                }
            }),
        }
    }

    /// Whether all I/O of a file must go through this port, page-cache I/O too (NIXL:
    /// its caller asked for NIXL's I/O), rather than that through a `pread`/`pwrite` of
    /// the caller's (`DiskFile::on_port`).
    pub fn makes_all_io(&self) -> bool {
        matches!(self, Port::Nixl(_))
    }
}
