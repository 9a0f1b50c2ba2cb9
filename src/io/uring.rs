//! io_uring: one ring per I/O worker, the bounce ring registered as a fixed buffer, and
//! every extent of a chunk submitted at once, so a worker keeps many I/Os in flight with
//! one system call. Short transfers and `EINTR`/`EAGAIN` are resubmitted for the rest,
//! as the POSIX path retries them.

use super::posted::{Posted, Settle};
use super::Io;
use crate::error::{Error, Result, Status};
use crate::fault::{self, Fault, Site};
use io_uring::{opcode, types, IoUring};

pub struct Ring {
    ring: IoUring,
    /// The registered buffer (address, length): I/Os inside it use the fixed opcodes.
    fixed: Option<(u64, u64)>,
    /// The current run's I/Os by `user_data`: queued for the kernel, or answered by an
    /// injected fault (`injected`). Empty between runs.
    inflight: Vec<Option<Io>>,
    /// (user_data, -errno) of injected faults, answered with the next completions.
    injected: Vec<(u64, i32)>,
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
        Ok(Ring { ring, fixed, inflight: Vec::new(), injected: Vec::new() })
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

    fn in_flight(&self) -> bool {
        self.inflight.iter().any(Option::is_some)
    }

    /// A free `user_data` for a new I/O.
    fn free_slot(&mut self) -> usize {
        self.inflight.iter().position(Option::is_none).unwrap_or_else(|| {
            self.inflight.push(None);
            self.inflight.len() - 1
        })
    }

    /// Enters the kernel to submit what is queued and wait for at least one completion
    /// (unless only injected answers are pending).
    fn enter(&mut self) -> std::io::Result<()> {
        if self.inflight.iter().flatten().count() == self.injected.len() {
            return Ok(());
        }
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Completions seen so far, injected answers included; each frees its `user_data`.
    fn reap(&mut self) -> Vec<(Io, i32)> {
        let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).chain(self.injected.drain(..)).collect();
        done.into_iter().map(|(slot, res)| (self.inflight[slot as usize].take().expect("a completion for a queued I/O"), res)).collect()
    }

    /// Moves every byte of `ios` (all reads or all writes); the first error otherwise.
    /// Returns only when none of them is still in the kernel, also on error.
    ///
    /// # Safety
    /// Every `Io`'s memory must stay valid (and, for reads, unused by anyone else) until
    /// this returns.
    pub unsafe fn run(&mut self, write: bool, ios: &[Io]) -> Result<()> {
        Posted::new(self).move_all(write, ios)
    }

    /// `run`'s work; any early return leaves I/Os for `settle`.
    unsafe fn move_all(&mut self, write: bool, ios: &[Io]) -> Result<()> {
        let site = if write { Site::DiskWrite } else { Site::DiskRead };
        let what = if write { "pwrite" } else { "pread" };
        let mut todo: Vec<Io> = ios.iter().copied().filter(|io| io.len > 0).collect();
        while !todo.is_empty() || self.in_flight() {
            // Queue what fits; an injected fault stands in for the kernel's answer.
            while let Some(mut io) = todo.pop() {
                let slot = self.free_slot();
                match fault::check(site) {
                    Some(Fault::Errno(e)) => {
                        self.inflight[slot] = Some(io);
                        self.injected.push((slot as u64, -e));
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
                self.inflight[slot] = Some(io);
            }
            self.enter().map_err(|e| Error::io("io_uring_enter", e))?;
            for (io, res) in self.reap() {
                match res {
                    r if r == -libc::EINTR || r == -libc::EAGAIN => todo.push(io),
                    r if r < 0 => {
                        return Err(Error::io(
                            format_args!("{what} of {} bytes at offset {} (io_uring)", io.len, io.off),
                            std::io::Error::from_raw_os_error(-r),
                        ))
                    }
                    0 => return Err(Error::new(Status::Io, format!("{what} at offset {}: no progress (end of file?) (io_uring)", io.off))),
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

impl Settle for Ring {
    fn settle(&mut self) {
        let mut failures = 0u32;
        while self.in_flight() {
            if let Err(e) = self.enter() {
                // The kernel still owns the memory of what it accepted: keep waiting.
                if failures == 0 {
                    log::error!("io_uring_enter failed ({e}) while I/Os of a failed run are in flight; waiting for them before their slot is reused");
                }
                failures = failures.saturating_add(1);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            drop(self.reap());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// One I/O of a run fails at once (a bad descriptor) while another is still in the
    /// kernel (a read from an empty pipe, filled 200 ms later). `run` may return only
    /// once that read has completed: its memory is the caller's again only then, and the
    /// ring's next run must not reap a completion it never queued.
    #[test]
    fn a_failed_io_waits_for_the_others_still_in_the_kernel() {
        let mut ring = Ring::new(8, None).unwrap();
        let mut fds = [0; 2];
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let (rd, wr) = (fds[0], fds[1]);
        let mut buf = vec![0u8; 4096];
        let addr = buf.as_mut_ptr() as u64;
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            assert_eq!(unsafe { libc::write(wr, b"sixteen bytes!!!".as_ptr() as *const libc::c_void, 16) }, 16);
        });
        let ios = [Io { fd: -1, addr: addr + 2048, len: 16, off: 0 }, Io { fd: rd, addr, len: 16, off: 0 }];
        let failed = unsafe { ring.run(false, &ios) };
        let seen = buf[..16].to_vec();
        writer.join().unwrap();
        assert_eq!(failed.map_err(|e| e.status), Err(Status::Io));
        assert_eq!(&seen, b"sixteen bytes!!!", "run returned while the pipe read was still in the kernel");
        // The ring is clean: a new run reaps only its own completions.
        let file = std::env::temp_dir().join(format!("kvx-uring-settle-{}", std::process::id()));
        std::fs::write(&file, [7u8; 64]).unwrap();
        let f = std::fs::File::open(&file).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
        let mut back = [0u8; 64];
        let next = unsafe { ring.run(false, &[Io { fd, addr: back.as_mut_ptr() as u64, len: 64, off: 0 }]) };
        let _ = std::fs::remove_file(&file);
        assert_eq!(next, Ok(()));
        assert_eq!(back, [7u8; 64]);
        unsafe { libc::close(rd) };
        unsafe { libc::close(wr) };
    }
}
