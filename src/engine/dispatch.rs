//! Dispatching: planning a request chunk by chunk and handing each chunk a bounce slot.
//! Waiting for a free slot is the pipeline's back-pressure: at most N chunks are in
//! flight, and while slot k drains, slots k+1… are filling.
//!
//! A request is dispatched on the submitting thread when the dispatcher has nothing in
//! hand: its chunks go out while slots are free, and its first device copies are issued
//! right there, so a small request costs no thread hand-off before the DMA starts. What
//! would wait for a slot (and every request behind one that does, to keep their order)
//! goes to the dispatcher thread, which may block.

use super::bounce::BounceRing;
use super::plan::Planner;
use super::request::Request;
use super::stats::Counters;
use super::worker::{Chunk, Router};
use crate::layout::segments;
use crossbeam_channel::Receiver;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What the dispatcher thread is handed.
pub enum Work {
    /// A request not yet started.
    Start(Arc<Request>),
    /// A request the submitting thread began: the rest of its chunks.
    Rest(Arc<Request>, Box<Planner>),
    /// A request whose chunks all finished while its submitter still held the
    /// dispatcher's token: completing it runs the callback, which must not happen on
    /// the caller's thread.
    Release(Arc<Request>),
}

/// Runs until the stop message (`None`), which the engine sends last, after raising its
/// shutdown flag: requests still queued then are cancelled, not started.
pub fn dispatcher(router: Arc<Router>, ring: Arc<BounceRing>, rx: Receiver<Option<Work>>) {
    while let Ok(Some(work)) = rx.recv() {
        match work {
            Work::Start(req) => {
                if req.claim() {
                    if router.shutting_down() {
                        req.cancel_from_engine();
                    } else if let Some(planner) = planner(&req, &ring, &router) {
                        dispatch(&router, &ring, &req, planner, true);
                    }
                    req.release_one();
                }
            }
            Work::Rest(req, planner) => {
                dispatch(&router, &ring, &req, *planner, true);
                req.release_one();
            }
            Work::Release(req) => req.release_one(),
        }
        router.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The request's planner; `None` if it no longer has a transfer (it completed).
pub fn planner(req: &Request, ring: &BounceRing, router: &Router) -> Option<Planner> {
    let p = req.plan_inputs()?;
    let segs = segments(&p.src.placement, &p.dst.placement, &p.pairs, p.layers);
    Some(Planner::new(p.src, p.dst, segs, ring.slot_bytes(), p.after, router.gds.is_some()))
}

/// Issues the request's chunks; stops early when it is cancelled, fails, or the engine
/// shuts down (chunks already issued finish). With `block` false (the submitting thread)
/// it returns the planner instead of waiting for a slot, with chunks still to issue.
pub fn dispatch(router: &Router, ring: &BounceRing, req: &Arc<Request>, mut planner: Planner, block: bool) -> Option<Planner> {
    loop {
        let slot = if block {
            let waiting = std::time::Instant::now();
            let slot = ring.acquire();
            Counters::add_since(&router.counters.slot_wait_ns, waiting);
            slot
        } else {
            match ring.try_acquire() {
                Some(slot) => slot,
                None => return Some(planner),
            }
        };
        if router.shutting_down() && !req.stopped() {
            req.cancel_from_engine();
        }
        if req.stopped() {
            ring.release(slot);
            return None;
        }
        match planner.next_chunk(ring.addr(slot)) {
            None => {
                ring.release(slot);
                return None;
            }
            Some(stages) => {
                req.chunk_issued();
                let chunk = Chunk { req: req.clone(), slot, stages, next: 0, issued: None };
                if block { router.advance(chunk) } else { router.advance_here(chunk) }
            }
        }
    }
}
