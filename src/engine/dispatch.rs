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
//!
//! Critical requests take their turns ahead of bulk ones, by the rule every stage shares
//! (`class.rs`): while bulk requests are in hand, every fourth turn is theirs.

use super::bounce::BounceRing;
use super::chunk::Chunk;
use super::class::{Class, Credit};
use super::plan::Planner;
use super::request::Request;
use super::router::Router;
use super::stages::Stage;
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

/// A request in hand and the rest of its chunks.
type Turn = (Arc<Request>, Box<Planner>);

/// The requests in hand, each with chunks still to issue, in the order of their turns:
/// critical ones and bulk ones apart, the next turn picked by `Credit`.
#[derive(Default)]
struct Turns {
    critical: VecDeque<Turn>,
    bulk: VecDeque<Turn>,
    credit: Credit,
}

impl Turns {
    fn is_empty(&self) -> bool {
        self.critical.is_empty() && self.bulk.is_empty()
    }

    fn class_of(&mut self, turn: &Turn) -> &mut VecDeque<Turn> {
        match turn.0.class() {
            Class::Critical => &mut self.critical,
            Class::Bulk => &mut self.bulk,
        }
    }

    fn push_back(&mut self, turn: Turn) {
        self.class_of(&turn).push_back(turn)
    }

    /// Puts a turn that `next` gave back at the front of its class.
    fn put_back(&mut self, turn: Turn) {
        self.class_of(&turn).push_front(turn)
    }

    /// The request whose turn is next; the stopped ones (cancelled, failed) found on the
    /// way are let go: they wait for no slot.
    fn next(&mut self, router: &Router) -> Option<Turn> {
        loop {
            let class = self.credit.pick(!self.critical.is_empty(), !self.bulk.is_empty())?;
            let turn = match class {
                Class::Critical => self.critical.pop_front(),
                Class::Bulk => self.bulk.pop_front(),
            }?;
            if !turn.0.stopped() {
                return Some(turn);
            }
            done_with(router, &turn.0);
        }
    }

    fn drain(&mut self) -> impl Iterator<Item = Arc<Request>> + '_ {
        self.critical.drain(..).chain(self.bulk.drain(..)).map(|(req, _)| req)
    }
}

/// Runs until the stop message (`None`), which the engine sends last, after raising its
/// shutdown flag: requests still in hand or queued then are cancelled, not continued.
pub fn dispatcher(router: Arc<Router>, ring: Arc<BounceRing>, rx: Receiver<Option<Work>>) {
    let mut turns = Turns::default();
    loop {
        match next_step(&rx, turns.is_empty()) {
            Step::Take(work) => take_in(&router, &ring, &mut turns, work),
            Step::Turn => {
                if !take_turn(&router, &ring, &rx, &mut turns) {
                    stop(&router, &mut turns);
                    return;
                }
            }
            // The shutdown flag is up, so what is in hand is cancelled.
            Step::Stop => {
                stop(&router, &mut turns);
                return;
            }
        }
    }
}

/// Cancels every request in hand: the engine is shutting down.
fn stop(router: &Router, turns: &mut Turns) {
    for req in turns.drain() {
        if !req.stopped() {
            req.cancel_from_engine();
        }
        done_with(router, &req);
    }
}

/// Waits for a slot and issues a chunk in it for the request whose turn it is. What was
/// queued while the slot was awaited is taken in first: a critical request among it takes
/// the turn of the bulk one that waited, unless that turn was bulk's by the floor.
/// `false` when the stop message came meanwhile.
fn take_turn(router: &Router, ring: &BounceRing, rx: &Receiver<Option<Work>>, turns: &mut Turns) -> bool {
    let critical_waited = !turns.critical.is_empty();
    let Some(mut turn) = turns.next(router) else { return true };
    let waiting = std::time::Instant::now();
    let slot = ring.acquire();
    Counters::add_since(&router.counters.slot_wait_ns, waiting);
    let Some(slot) = slot else {
        // The ring closed: the engine is shutting down, and its stop message follows.
        turns.put_back(turn);
        stop(router, turns);
        return true;
    };
    loop {
        match rx.try_recv() {
            Ok(Some(work)) => take_in(router, ring, turns, work),
            Ok(None) | Err(TryRecvError::Disconnected) => {
                turns.put_back(turn);
                ring.release(slot);
                return false;
            }
            Err(TryRecvError::Empty) => break,
        }
    }
    if turn.0.class() == Class::Bulk && !critical_waited && !turns.critical.is_empty() {
        turns.put_back(turn);
        // `None` when every request in hand was stopped meanwhile.
        let Some(next) = turns.next(router) else {
            ring.release(slot);
            return true;
        };
        turn = next;
    }
    let (req, mut planner) = turn;
    // The slot is the chunk's now, or given back if the request has none left to issue
    // (it was stopped while the slot was awaited).
    if issue(router, ring, &req, &mut planner, slot, false) {
        turns.push_back((req, planner));
    } else {
        done_with(router, &req);
    }
    true
}

/// What the dispatcher does next.
enum Step {
    /// New work joins the turns.
    Take(Work),
    /// A request in hand issues a chunk.
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
    req.mark(Stage::Slot);
    let chunk = Chunk { req: req.clone(), slot, stages, next: 0, issued: None };
    if here {
        router.advance_here(chunk)
    } else {
        router.advance(chunk)
    }
    !planner.done()
}
