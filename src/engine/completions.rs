//! The engine's completion file descriptor: an eventfd that becomes readable when a
//! request of the engine ends (a transfer, or a request of a store on it), for callers
//! that wait on many things at once (poll, epoll, an asyncio loop) instead of a thread per
//! request.
//!
//! ```text
//! request ends: final status set ─► counter += 1 (the fd is readable)
//! caller:       fd readable ─► read (counter = 0) ─► poll its requests
//! ```
//! A request adds to the counter as its final status is set, under the lock its status is
//! read under, so a caller that drains the fd and then polls loses no wake-up (a request
//! that ended before the drain is seen by the poll, one that ends after it makes the fd
//! readable again), and a request seen to have ended leaves no wake-up still to come. A
//! store's own transfers signal nothing: its request signals once all of them ended.
//! The fd is made on the first ask (until then an ending request only reads a flag) and
//! closed when the engine shuts down.

use crate::error::{bail, Error, Result, Status};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

#[derive(Debug, Default)]
enum State {
    #[default]
    Unmade,
    Open(OwnedFd),
    Closed,
}

#[derive(Debug, Default)]
pub struct Completions {
    state: RwLock<State>,
    /// Whether the fd was ever made: an ending request takes the lock only then.
    made: AtomicBool,
}

impl Completions {
    /// The eventfd (non-blocking, close-on-exec), made on the first call; `Shutdown` once
    /// the engine has shut down.
    pub fn fd(&self) -> Result<RawFd> {
        if let State::Open(fd) = &*self.state.read().unwrap() {
            return Ok(fd.as_raw_fd());
        }
        let mut state = self.state.write().unwrap();
        match &*state {
            State::Open(fd) => return Ok(fd.as_raw_fd()),
            State::Closed => bail!(Shutdown, "the engine is shut down; its completion fd is closed"),
            State::Unmade => {}
        }
        // SAFETY: eventfd takes no pointers; a non-negative result is a new fd we own.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::new(Status::Io, format!("making the completion eventfd: {e}; raise the process's open-file limit")));
        }
        // SAFETY: `raw` is a valid fd that nothing else owns.
        *state = State::Open(unsafe { OwnedFd::from_raw_fd(raw) });
        self.made.store(true, Ordering::Release);
        Ok(raw)
    }

    /// A request ended (its final status is set): the fd becomes readable.
    pub fn signal(&self) {
        if !self.made.load(Ordering::Acquire) {
            return;
        }
        if let State::Open(fd) = &*self.state.read().unwrap() {
            let one = 1u64;
            // SAFETY: writes 8 bytes from a live u64 to an fd the read lock keeps open.
            // It fails only when the counter is at its maximum, where the fd is readable.
            let _ = unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    /// Closes the fd; later asks are refused and ends signal nothing.
    pub fn close(&self) {
        *self.state.write().unwrap() = State::Closed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(fd: RawFd) -> bool {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    fn drain(fd: RawFd) -> u64 {
        let mut n = 0u64;
        // SAFETY: reads 8 bytes into a live u64.
        let r = unsafe { libc::read(fd, (&mut n as *mut u64).cast(), 8) };
        if r == 8 {
            n
        } else {
            0
        }
    }

    #[test]
    fn the_fd_is_readable_after_a_signal_until_drained_and_refused_once_closed() {
        let c = Completions::default();
        c.signal(); // before the fd is made: nothing to signal
        let fd = c.fd().unwrap();
        assert_eq!(c.fd().unwrap(), fd, "one fd per engine");
        assert!(!readable(fd));
        c.signal();
        c.signal();
        assert!(readable(fd));
        assert_eq!(drain(fd), 2);
        assert!(!readable(fd));
        c.close();
        c.signal();
        assert_eq!(c.fd().unwrap_err().status, Status::Shutdown);
    }
}
