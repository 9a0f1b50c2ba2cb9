//! io_uring: one ring per I/O worker, the bounce ring registered as a fixed buffer, and
//! every extent of a chunk submitted at once, so a worker keeps many I/Os in flight with
//! one system call. Short transfers and `EINTR`/`EAGAIN` are resubmitted for the rest,
//! as the POSIX path retries them.

use super::fault::{self, Fault, Site};
use super::Io;
use crate::error::{Error, Result, Status};
use io_uring::{opcode, types, IoUring};


pub struct Ring {
    ring: IoUring,
    /// The registered buffer (address, length): I/Os inside it use the fixed opcodes.
    fixed: Option<(u64, u64)>,
}

impl Ring {
    /// A ring of `depth` entries; `fixed` is registered as buffer 0 when the kernel allows
    /// (pinning may exceed RLIMIT_MEMLOCK: then plain reads and writes are used).
    pub fn new(depth: u32, fixed: Option<(u64, u64)>) -> std::io::Result<Ring> {
        let ring = IoUring::new(depth)?;
        let fixed = fixed.filter(|&(addr, len)| {
            let iov = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len as usize };
            // SAFETY: the bounce ring outlives every worker's ring (the engine joins the
            // workers before it frees the bounce memory).
            match unsafe { ring.submitter().register_buffers(&[iov]) } {
                Ok(()) => true,
                Err(e) => {
                    log::info!("io_uring: bounce slots not registered as fixed buffers ({e}); using plain reads/writes");
                    false
                }
            }
        });
        Ok(Ring { ring, fixed })
    }

    fn entry(&self, write: bool, io: &Io, user_data: u64) -> io_uring::squeue::Entry {
        let fd = types::Fd(io.fd);
        let fixed = self.fixed.is_some_and(|(a, l)| io.addr >= a && io.addr + io.len <= a + l);
        let len = io.len.min(u32::MAX as u64 & !4095) as u32;
        let e = match (write, fixed) {
            (false, true) => opcode::ReadFixed::new(fd, io.addr as *mut u8, len, 0).offset(io.off).build(),
            (true, true) => opcode::WriteFixed::new(fd, io.addr as *const u8, len, 0).offset(io.off).build(),
            (false, false) => opcode::Read::new(fd, io.addr as *mut u8, len).offset(io.off).build(),
            (true, false) => opcode::Write::new(fd, io.addr as *const u8, len).offset(io.off).build(),
        };
        e.user_data(user_data)
    }

    /// Moves every byte of `ios` (all reads or all writes); the first error otherwise.
    ///
    /// # Safety
    /// Every `Io`'s memory must stay valid (and, for reads, unused by anyone else) until
    /// this returns.
    pub unsafe fn run(&mut self, write: bool, ios: &[Io]) -> Result<()> {
        let site = if write { Site::DiskWrite } else { Site::DiskRead };
        let what = if write { "pwrite" } else { "pread" };
        let mut todo: Vec<Io> = ios.iter().copied().filter(|io| io.len > 0).collect();
        let mut inflight: Vec<Option<Io>> = Vec::new();
        while !todo.is_empty() || inflight.iter().any(Option::is_some) {
            // Queue what fits; an injected fault stands in for the kernel's answer.
            let mut injected: Vec<(u64, i32)> = Vec::new();
            while let Some(mut io) = todo.pop() {
                let slot = inflight.iter().position(Option::is_none).unwrap_or_else(|| {
                    inflight.push(None);
                    inflight.len() - 1
                });
                match fault::check(site) {
                    Some(Fault::Errno(e)) => {
                        inflight[slot] = Some(io);
                        injected.push((slot as u64, -e));
                        continue;
                    }
                    Some(Fault::Short) if io.len >= 8192 => {
                        // As if the kernel had moved only the first half: the rest follows.
                        let half = (io.len / 2) & !4095;
                        todo.push(Io { addr: io.addr + half, len: io.len - half, off: io.off + half, ..io });
                        io.len = half;
                    }
                    _ => {}
                }
                let entry = self.entry(write, &io, slot as u64);
                if self.ring.submission().push(&entry).is_err() {
                    todo.push(io);
                    break;
                }
                inflight[slot] = Some(io);
            }
            let queued = inflight.iter().filter(|s| s.is_some()).count() - injected.len();
            if queued > 0 {
                loop {
                    match self.ring.submit_and_wait(1) {
                        Ok(_) => break,
                        Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                        Err(e) => return Err(Error::io("io_uring_enter", e)),
                    }
                }
            }
            let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).chain(injected).collect();
            for (slot, res) in done {
                let io = inflight[slot as usize].take().expect("a completion for a queued I/O");
                match res {
                    r if r == -libc::EINTR || r == -libc::EAGAIN => todo.push(io),
                    r if r < 0 => {
                        return Err(Error::io(
                            format_args!("{what} of {} bytes at offset {} (io_uring)", io.len, io.off),
                            std::io::Error::from_raw_os_error(-r),
                        ))
                    }
                    0 => {
                        return Err(Error::new(
                            Status::Io,
                            format!("{what} at offset {}: no progress (end of file?) (io_uring)", io.off),
                        ))
                    }
                    n => {
                        let n = n as u64;
                        if n < io.len {
                            todo.push(Io { fd: io.fd, addr: io.addr + n, len: io.len - n, off: io.off + n });
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
