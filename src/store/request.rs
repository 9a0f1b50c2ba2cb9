//! A put or get of n keys: each key gets its own status once its part is done; the
//! request is done when every key has one.
//!
//! A key's status is `Ok`, or why it failed alone: `NotFound` (a get of a key not held),
//! `Integrity` (a failed check: a miss, the entry dropped), `Busy` (a put that found no
//! room), or the engine's status for its transfer. The request's own status, once done, is
//! `Ok` when every key is, else the status of the first key (by index) that is not, so a
//! caller that reads only the request's status never counts a miss as loaded.

use crate::engine::{Completions, Engine};
use crate::error::{Result, Status};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug)]
struct State {
    keys: Vec<Option<(Status, String)>>,
    left: usize,
    status: Option<Status>,
}

#[derive(Debug)]
pub struct StoreRequest {
    state: Mutex<State>,
    done: Condvar,
    /// The engine's completion fd, signalled once every key has its status, and the
    /// engine's id (none for the store's bookkeeping requests, which no caller is handed).
    engine: Option<(Arc<Completions>, u64)>,
}

impl StoreRequest {
    pub(super) fn new(n: usize) -> StoreRequest {
        StoreRequest { state: Mutex::new(State { keys: vec![None; n], left: n, status: None }), done: Condvar::new(), engine: None }
    }

    /// A request the caller gets back, whose transfers `engine` runs: its end signals the
    /// engine's completion fd.
    pub(super) fn signalling(n: usize, engine: &Engine) -> StoreRequest {
        StoreRequest { engine: Some((engine.completions().clone(), engine.id())), ..StoreRequest::new(n) }
    }

    /// Gives key `i` its status (once; a second is ignored).
    pub(super) fn settle(&self, i: usize, status: Status, message: impl Into<String>) {
        let mut s = self.state.lock().unwrap();
        if s.keys[i].is_some() {
            return;
        }
        s.keys[i] = Some((status, message.into()));
        s.left -= 1;
        if s.left == 0 {
            let first_failed = s.keys.iter().flatten().map(|k| k.0).find(|&st| st != Status::Ok);
            s.status = Some(first_failed.unwrap_or(Status::Ok));
            // Under the lock, as for a transfer: the status is seen only after the signal.
            if let Some((c, _)) = &self.engine {
                c.signal();
            }
            self.done.notify_all();
        }
    }

    /// Keys in the request.
    pub fn len(&self) -> usize {
        self.state.lock().unwrap().keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `Pending` until every key has its status, then the request's status.
    pub fn poll(&self) -> Status {
        self.state.lock().unwrap().status.unwrap_or(Status::Pending)
    }

    /// Waits up to `timeout` (`None`: forever) for the request's status; `Timeout`
    /// otherwise. `InvalidArg` (logged) where `try_wait` refuses the wait.
    pub fn wait(&self, timeout: Option<Duration>) -> Status {
        self.try_wait(timeout).unwrap_or_else(|e| {
            log::error!("{e}");
            e.status
        })
    }

    /// As `wait`; a wait refused from inside a completion callback of the engine that
    /// runs the request's transfers (with a non-zero timeout) is an error saying why: the
    /// callback may hold the very thread those transfers need.
    pub fn try_wait(&self, timeout: Option<Duration>) -> Result<Status> {
        if let Some(e) = self.engine.as_ref().and_then(|&(_, id)| crate::engine::wait_refusal(id, timeout)) {
            return Err(e);
        }
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut s = self.state.lock().unwrap();
        loop {
            if let Some(st) = s.status {
                return Ok(st);
            }
            match deadline {
                None => s = self.done.wait(s).unwrap(),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(Status::Timeout);
                    }
                    s = self.done.wait_timeout(s, d - now).unwrap().0;
                }
            }
        }
    }

    /// Key `i`'s status: `Pending` until its part is done; `None` when `i` is past the keys.
    pub fn key_status(&self, i: usize) -> Option<Status> {
        self.state.lock().unwrap().keys.get(i).map(|k| k.as_ref().map_or(Status::Pending, |k| k.0))
    }

    /// Why key `i` failed ("" while pending, when it succeeded, or past the keys).
    pub fn key_message(&self, i: usize) -> String {
        self.state.lock().unwrap().keys.get(i).and_then(|k| k.as_ref()).map_or(String::new(), |k| k.1.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_is_done_when_every_key_is_and_reports_the_first_failed_key() {
        let r = StoreRequest::new(3);
        r.settle(2, Status::NotFound, "not held");
        r.settle(0, Status::Ok, "");
        assert_eq!(r.poll(), Status::Pending);
        assert_eq!(r.key_status(1), Some(Status::Pending));
        assert_eq!(r.wait(Some(Duration::from_millis(1))), Status::Timeout);
        r.settle(1, Status::Integrity, "bad");
        r.settle(1, Status::Ok, "");
        assert_eq!(r.wait(None), Status::Integrity);
        assert_eq!(r.key_status(1), Some(Status::Integrity));
        assert_eq!(r.key_message(2), "not held");
        assert_eq!(r.key_status(3), None);
    }
}
