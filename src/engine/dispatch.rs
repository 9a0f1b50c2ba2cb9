//! The dispatcher thread: takes requests in order, plans them chunk by chunk and hands
//! each chunk a bounce slot. Waiting for a free slot is the pipeline's back-pressure:
//! at most N chunks are in flight, and while slot k drains, slots k+1… are filling.

use super::bounce::BounceRing;
use super::plan::Planner;
use super::request::Request;
use super::stats::Counters;
use super::worker::{Chunk, Router};
use crate::layout::segments;
use crossbeam_channel::Receiver;
use std::sync::Arc;

/// Runs until the stop message (`None`), which the engine sends last, after raising its
/// shutdown flag: requests still queued then are cancelled, not started.
pub fn dispatcher(router: Arc<Router>, ring: Arc<BounceRing>, rx: Receiver<Option<Arc<Request>>>) {
    while let Ok(Some(req)) = rx.recv() {
        if !req.claim() {
            continue; // cancelled while queued, and already complete
        }
        if router.shutting_down() {
            req.cancel_from_engine();
        } else {
            run(&router, &ring, &req);
        }
        req.release_one();
    }
}

/// Issues the request's chunks; stops early when it is cancelled, fails, or the engine
/// shuts down (chunks already issued finish).
fn run(router: &Router, ring: &BounceRing, req: &Arc<Request>) {
    let Some(p) = req.plan_inputs() else { return };
    let segs = segments(&p.src.placement, &p.dst.placement, &p.pairs, p.layers);
    let mut planner = Planner::new(p.src, p.dst, segs, ring.slot_bytes(), p.after, router.gds.is_some());
    loop {
        let waiting = std::time::Instant::now();
        let slot = ring.acquire();
        Counters::add_since(&router.counters.slot_wait_ns, waiting);
        if router.shutting_down() && !req.stopped() {
            req.cancel_from_engine();
        }
        if req.stopped() {
            ring.release(slot);
            return;
        }
        match planner.next_chunk(ring.addr(slot)) {
            None => {
                ring.release(slot);
                return;
            }
            Some(stages) => {
                req.chunk_issued();
                router.advance(Chunk { req: req.clone(), slot, stages, next: 0, issued: None });
            }
        }
    }
}
