//! Latency-critical work ahead of bulk work, with a floor for bulk.
//!
//! A request is critical when its caller waits for it (an onboard before a request's
//! first token), bulk otherwise (an offload nobody waits for). Wherever both share a
//! stage (the dispatcher's turns, hence the bounce slots; the I/O workers' queue; the
//! copy thread's queue), the stage serves them by one rule, `Credit`: critical first,
//! but while bulk work waits, at most `CRITICAL_RUN` critical picks in a row, so bulk
//! keeps at least a quarter of the stage and never starves. A stage thread that runs a
//! chunk's next stage at once, without the queue, counts it as a pick (`Credit::keep`).
//! Within a class, work is served in the order it came.

use crossbeam_channel::{Receiver, RecvError, Select, Sender, TryRecvError};
use std::sync::atomic::{AtomicU32, Ordering};

/// Which queue of a stage a request's work goes to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Class {
    /// Nobody waits for it now: served in arrival order, behind critical work, with a floor.
    #[default]
    Bulk,
    /// Its caller waits for it: served ahead of bulk work.
    Critical,
}

/// The most critical picks in a row while bulk work waits: one pick in four is bulk.
pub const CRITICAL_RUN: u32 = 3;

/// The scheduling rule every stage shares: which class to serve next. Shared by the
/// threads of a stage (the I/O workers), where it counts picks approximately: two
/// workers picking at once may both take critical work.
#[derive(Default)]
pub struct Credit {
    /// Critical picks since the last bulk one, counted only while bulk work waited.
    run: AtomicU32,
}

impl Credit {
    /// The class to serve next, given which classes have work; `None` when neither has.
    pub fn pick(&self, critical: bool, bulk: bool) -> Option<Class> {
        match (critical, bulk) {
            (false, false) => None,
            (true, false) => Some(Class::Critical),
            (false, true) => {
                self.run.store(0, Ordering::Relaxed);
                Some(Class::Bulk)
            }
            (true, true) => {
                if self.run.fetch_add(1, Ordering::Relaxed) < CRITICAL_RUN {
                    Some(Class::Critical)
                } else {
                    self.run.store(0, Ordering::Relaxed);
                    Some(Class::Bulk)
                }
            }
        }
    }

    /// Whether a stage thread that just ran a stage of `class` work runs that work's next
    /// stage too, at once, as a pick of `class` by the same rule; `other`: whether the
    /// other class has work waiting. A "no" changes nothing, so the thread's next pick
    /// from the queue goes to the other class.
    pub fn keep(&self, class: Class, other: bool) -> bool {
        match (class, other) {
            (Class::Critical, false) => true,
            (Class::Bulk, false) => {
                self.run.store(0, Ordering::Relaxed);
                true
            }
            (Class::Critical, true) => {
                self.run.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| (r < CRITICAL_RUN).then_some(r + 1)).is_ok()
            }
            (Class::Bulk, true) => {
                self.run.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| (r >= CRITICAL_RUN).then_some(0)).is_ok()
            }
        }
    }
}

/// A stage thread's queue in two classes, served by `Credit`; any number of threads may
/// send and receive. It never disconnects: its threads stop on a message of their own.
pub struct ClassQueue<T> {
    critical: (Sender<T>, Receiver<T>),
    bulk: (Sender<T>, Receiver<T>),
    credit: Credit,
}

impl<T> Default for ClassQueue<T> {
    fn default() -> Self {
        ClassQueue { critical: crossbeam_channel::unbounded(), bulk: crossbeam_channel::unbounded(), credit: Credit::default() }
    }
}

impl<T> ClassQueue<T> {
    pub fn send(&self, class: Class, msg: T) {
        let tx = match class {
            Class::Critical => &self.critical.0,
            Class::Bulk => &self.bulk.0,
        };
        // Both ends live in `self`: a send cannot find the queue disconnected.
        tx.send(msg).unwrap_or_else(|_| unreachable!("a class queue holds its own receivers"));
    }

    /// Whether the thread that ran a stage of `class` work runs its next stage at once
    /// (`Credit::keep`): then it counts as a pick of this queue.
    pub fn keep(&self, class: Class) -> bool {
        let other = match class {
            Class::Critical => &self.bulk.1,
            Class::Bulk => &self.critical.1,
        };
        self.credit.keep(class, !other.is_empty())
    }

    /// The next message by `Credit`, if either class has one now. Another receiver may
    /// take the message picked first; then the other class's is taken, if any.
    pub fn try_recv(&self) -> Result<T, TryRecvError> {
        let (c, b) = (&self.critical.1, &self.bulk.1);
        let (first, second) = match self.credit.pick(!c.is_empty(), !b.is_empty()) {
            None => return Err(TryRecvError::Empty),
            Some(Class::Critical) => (c, b),
            Some(Class::Bulk) => (b, c),
        };
        first.try_recv().or_else(|_| second.try_recv())
    }

    /// Blocks (sleeping) until a message comes; never fails (the queue holds both ends).
    pub fn recv(&self) -> Result<T, RecvError> {
        loop {
            if let Ok(msg) = self.try_recv() {
                return Ok(msg);
            }
            let mut ready = Select::new();
            ready.recv(&self.critical.1);
            ready.recv(&self.bulk.1);
            ready.ready();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn critical_goes_first_and_bulk_keeps_one_pick_in_four() {
        let q = ClassQueue::default();
        for i in 0..4 {
            q.send(Class::Bulk, ('b', i));
        }
        for i in 0..8 {
            q.send(Class::Critical, ('c', i));
        }
        let order: Vec<_> = std::iter::from_fn(|| q.try_recv().ok()).collect();
        let want = [('c', 0), ('c', 1), ('c', 2), ('b', 0), ('c', 3), ('c', 4), ('c', 5), ('b', 1), ('c', 6), ('c', 7), ('b', 2), ('b', 3)];
        assert_eq!(order, want);
    }

    #[test]
    fn critical_picks_with_no_bulk_waiting_take_nothing_from_the_floor() {
        let c = Credit::default();
        for _ in 0..10 {
            assert_eq!(c.pick(true, false), Some(Class::Critical));
        }
        assert_eq!(c.pick(true, true), Some(Class::Critical), "the run starts when bulk work waits");
        assert_eq!(c.pick(false, false), None);
    }

    #[test]
    fn a_stage_run_at_once_counts_as_a_pick_of_its_class() {
        let c = Credit::default();
        for _ in 0..CRITICAL_RUN {
            assert!(c.keep(Class::Critical, true), "critical work runs on while its run lasts");
        }
        assert!(!c.keep(Class::Critical, true), "the fourth turn is bulk's");
        assert_eq!(c.pick(true, true), Some(Class::Bulk), "and the queue serves it");
        assert!(!c.keep(Class::Bulk, true), "bulk runs on only on its turn while critical work waits");
        assert!(c.keep(Class::Bulk, false), "or while none waits");
        assert!(c.keep(Class::Critical, false));
    }

    #[test]
    fn a_blocking_receive_wakes_for_either_class() {
        let q = std::sync::Arc::new(ClassQueue::default());
        for class in [Class::Bulk, Class::Critical] {
            let q2 = q.clone();
            let t = std::thread::spawn(move || q2.recv().unwrap());
            q.send(class, 7u32);
            assert_eq!(t.join().unwrap(), 7);
        }
        assert!(q.try_recv().is_err());
    }
}
