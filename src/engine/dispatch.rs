//! Dispatching: planning a request chunk by chunk and handing each chunk a bounce slot.
//! Waiting for a free slot is the pipeline's back-pressure: at most N chunks are in
//! flight, and while slot k drains, slots k+1… are filling.
//!
//! A request is dispatched on the submitting thread when the dispatcher has nothing in
//! hand: its chunks go out while slots are free, and its first device copies are issued
//! right there, so a small request costs no thread hand-off before the DMA starts. What
//! would wait for a slot (and every request behind one that does) goes to the dispatcher
//! thread, which may block.
//!
//! The dispatcher hands the slots out in turns, a chunk per request in hand, not a
//! request's every chunk before the next request's first: a request queued behind a
//! large one gets the next free slot but a few, instead of waiting for the large one to
//! be all but done. Served whole, an upload and a download submitted together would run
//! one after the other instead of both ways at once, which moves the same bytes about
//! 1.4 times as fast.

use super::bounce::BounceRing;
use super::chunk::Chunk;
use super::plan::Planner;
use super::request::Request;
use super::router::Router;
use super::stats::Counters;
use crate::layout::segments;
use crossbeam_channel::{Receiver, TryRecvError};
use std::collections::VecDeque;
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

/// The requests in hand, each with chunks still to issue, in the order of their turns.
type Turns = VecDeque<(Arc<Request>, Box<Planner>)>;

/// Runs until the stop message (`None`), which the engine sends last, after raising its
/// shutdown flag: requests still in hand or queued then are cancelled, not continued.
pub fn dispatcher(router: Arc<Router>, ring: Arc<BounceRing>, rx: Receiver<Option<Work>>) {
    let mut turns = Turns::new();
    loop {
        match next_step(&rx, turns.is_empty()) {
            Step::Take(work) => take_in(&router, &ring, &mut turns, work),
            Step::Turn => {
                let (req, mut planner) = turns.pop_front().expect("a turn is taken only with requests in hand");
                if issue_next(&router, &ring, &req, &mut planner) {
                    turns.push_back((req, planner));
                } else {
                    done_with(&router, &req);
                }
            }
            // The shutdown flag is up, so what is in hand is cancelled.
            Step::Stop => {
                for (req, _) in turns.drain(..) {
                    if !req.stopped() {
                        req.cancel_from_engine();
                    }
                    done_with(&router, &req);
                }
                return;
            }
        }
    }
}

/// What the dispatcher does next.
enum Step {
    /// New work joins the turns.
    Take(Work),
    /// The request at the front of the turns issues a chunk.
    Turn,
    Stop,
}

/// Everything queued joins the turns before the next turn; with nothing in hand, waits
/// for work.
fn next_step(rx: &Receiver<Option<Work>>, idle: bool) -> Step {
    let msg = if idle {
        rx.recv().ok()
    } else {
        match rx.try_recv() {
            Ok(msg) => Some(msg),
            Err(TryRecvError::Empty) => return Step::Turn,
            Err(TryRecvError::Disconnected) => None,
        }
    };
    match msg {
        Some(Some(work)) => Step::Take(work),
        Some(None) | None => Step::Stop,
    }
}

/// Adds `work` to the turns, or finishes with it when it has no chunk to issue.
fn take_in(router: &Router, ring: &BounceRing, turns: &mut Turns, work: Work) {
    match work {
        Work::Start(req) => {
            if !req.claim() {
                router.queued.fetch_sub(1, Ordering::AcqRel);
                return;
            }
            if router.shutting_down() {
                req.cancel_from_engine();
            } else if let Some(planner) = planner(&req, ring, router).filter(|p| !p.done()) {
                return turns.push_back((req, Box::new(planner)));
            }
            done_with(router, &req);
        }
        Work::Rest(req, planner) => turns.push_back((req, planner)),
        Work::Release(req) => done_with(router, &req),
    }
}

/// Gives up the dispatcher's hold on a request and its count of work in hand.
fn done_with(router: &Router, req: &Arc<Request>) {
    req.release_one();
    router.queued.fetch_sub(1, Ordering::AcqRel);
}

/// The request's planner; `None` if it no longer has a transfer (it completed).
pub fn planner(req: &Request, ring: &BounceRing, router: &Router) -> Option<Planner> {
    let p = req.plan_inputs()?;
    let segs = segments(&p.src.placement, &p.dst.placement, &p.pairs, p.layers);
    Some(Planner::new(p.src, p.dst, segs, ring.slot_bytes(), p.after, router.gds.is_some()))
}

/// On the submitting thread: issues the request's chunks while slots are free, the
/// first device copies right here. The planner when chunks are left to issue.
pub fn dispatch_here(router: &Router, ring: &BounceRing, req: &Arc<Request>, mut planner: Planner) -> Option<Planner> {
    while let Some(slot) = ring.try_acquire() {
        if !issue(router, ring, req, &mut planner, slot, true) {
            return None;
        }
    }
    Some(planner)
}

/// On the dispatcher: waits for a slot and issues the request's next chunk in it. A
/// request that was stopped, or an engine shutting down, waits for no slot: one may
/// not come back soon.
fn issue_next(router: &Router, ring: &BounceRing, req: &Arc<Request>, planner: &mut Planner) -> bool {
    if router.shutting_down() && !req.stopped() {
        req.cancel_from_engine();
    }
    if req.stopped() {
        return false;
    }
    let waiting = std::time::Instant::now();
    let slot = ring.acquire();
    Counters::add_since(&router.counters.slot_wait_ns, waiting);
    match slot {
        Some(slot) => issue(router, ring, req, planner, slot, false),
        None => {
            if !req.stopped() {
                req.cancel_from_engine();
            }
            false
        }
    }
}

/// Plans the request's next chunk into `slot` and sends it on (`here`: from the
/// submitting thread). `false` when the request has no chunk left to issue: every chunk
/// is out, or it was cancelled, failed, or the engine is shutting down (chunks already
/// issued finish).
fn issue(router: &Router, ring: &BounceRing, req: &Arc<Request>, planner: &mut Planner, slot: u32, here: bool) -> bool {
    if router.shutting_down() && !req.stopped() {
        req.cancel_from_engine();
    }
    let stages = if req.stopped() { None } else { planner.next_chunk(ring.addr(slot)) };
    let Some(stages) = stages else {
        ring.release(slot);
        return false;
    };
    req.chunk_issued();
    let chunk = Chunk { req: req.clone(), slot, stages, next: 0, issued: None };
    if here {
        router.advance_here(chunk)
    } else {
        router.advance(chunk)
    }
    !planner.done()
}
