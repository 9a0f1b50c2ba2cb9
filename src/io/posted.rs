//! The rule every queue-based port keeps: memory that I/Os were posted into (a chunk's
//! bounce slot) is not the chunk's to give back until every one of them has completed,
//! also when one failed and the port's `run` returns early. Otherwise the kernel (or
//! NIXL) could still write into a slot another chunk owns by then, and the port's next
//! run would reap a completion it never queued.
//!
//! `Posted` expresses it once: a port's `run` works through a `Posted` of itself, and
//! dropping that, on every way out (`?`, early return, panic), settles what is left.
//! cuFile needs none: its calls are synchronous, so nothing is posted when they return.

use std::ops::{Deref, DerefMut};

/// A port that may have I/Os in flight.
pub trait Settle {
    /// Blocks until nothing this port posted is still running; their outcomes are
    /// dropped (the run that posted them has already failed or finished).
    fn settle(&mut self);
}

/// A port borrowed by one run; settles it when dropped.
pub struct Posted<'a, P: Settle>(&'a mut P);

impl<'a, P: Settle> Posted<'a, P> {
    pub fn new(port: &'a mut P) -> Posted<'a, P> {
        Posted(port)
    }
}

impl<P: Settle> Deref for Posted<'_, P> {
    type Target = P;
    fn deref(&self) -> &P {
        self.0
    }
}

impl<P: Settle> DerefMut for Posted<'_, P> {
    fn deref_mut(&mut self) -> &mut P {
        self.0
    }
}

impl<P: Settle> Drop for Posted<'_, P> {
    fn drop(&mut self) {
        self.0.settle();
    }
}
