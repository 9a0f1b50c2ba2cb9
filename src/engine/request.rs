//! A submitted transfer's life: queued → dispatched in chunks → complete, with wait,
//! poll, cancel and a completion callback.
//!
//! Completion is counted, not polled: `outstanding` starts at 1 (the dispatcher's token),
//! each issued chunk adds 1, and whoever brings it to 0 — the last chunk or the
//! dispatcher — finalises the request exactly once.

use super::class::Class;
use super::stages::{self, Stage, StageTimes};
use super::stats::Counters;
use super::Completions;
use crate::error::{Error, Status};
use crate::file::checksum::WriteIds;
use crate::gpu::{Gate, Gpu};
use crate::memory::Layout;
use std::cell::Cell;
use std::ffi::CString;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Runs once on one of the engine's threads when the request completes, with its final
/// status, before `wait` and `poll` report it. Shared, so one callback can serve many
/// submits (the options are reused).
pub type OnComplete = Arc<dyn Fn(&Request, Status) + Send + Sync>;

/// What a request moves; owned by the request until it completes.
pub struct Transfer {
    pub src: Arc<Layout>,
    pub dst: Arc<Layout>,
    /// (source block, destination block) pairs.
    pub pairs: Vec<(u64, u64)>,
    pub layers: Range<u64>,
    /// The caller's event captured at submit; released when the request completes.
    pub wait: Option<CapturedEvent>,
}

/// An event of ours recorded after the caller's `wait_event` (see `Gpu::capture_event`).
pub struct CapturedEvent {
    gpu: Arc<dyn Gpu>,
    gate: Gate,
}

impl CapturedEvent {
    pub fn new(gpu: Arc<dyn Gpu>, caller_event: u64) -> crate::error::Result<CapturedEvent> {
        let gate = gpu.capture_event(caller_event)?;
        Ok(CapturedEvent { gpu, gate })
    }
}

impl Drop for CapturedEvent {
    fn drop(&mut self) {
        self.gpu.release_event(self.gate);
    }
}

/// What the dispatcher needs to plan a request.
pub struct PlanInputs {
    pub src: Arc<Layout>,
    pub dst: Arc<Layout>,
    pub pairs: Vec<(u64, u64)>,
    pub layers: Range<u64>,
    pub after: Option<Gate>,
}

/// How long `wait` looks for completion before it sleeps.
const WAIT_SPIN: Duration = Duration::from_micros(50);

thread_local! {
    /// The request whose completion callback this thread is running (its address, its
    /// engine and the status the callback was given); `None` outside callbacks.
    static DELIVERING: Cell<Option<(usize, u64, Status)>> = const { Cell::new(None) };
}

/// Why a wait of `timeout` for a request of engine `engine` (a transfer, or a store's put
/// or get) is refused on this thread, if it is: from inside a completion callback of that
/// engine, for longer than no time. The callback runs on a thread that may be the one to
/// complete that request (and every request behind it), so such a wait could never end.
pub(crate) fn wait_refusal(engine: u64, timeout: Option<Duration>) -> Option<Error> {
    let (_, delivering, _) = DELIVERING.with(|d| d.get())?;
    if delivering != engine || timeout == Some(Duration::ZERO) {
        return None;
    }
    Some(Error::new(
        Status::InvalidArg,
        "waiting for a request from a completion callback of the same engine: callbacks run on the engine's \
         threads and must not block, and this wait could hold up the request it waits for; poll it (wait with \
         timeout 0) or wait on a thread of your own",
    ))
}

const QUEUED: u8 = 0;
const CLAIMED: u8 = 1;

pub struct Request {
    /// The engine that runs it (`Engine`'s id).
    engine: u64,
    /// Which queue of each stage its chunks go to.
    class: Class,
    transfer: Mutex<Option<Transfer>>,
    counters: Arc<Counters>,
    /// The engine's completion fd, signalled as the final status is set (none for the
    /// store's own transfers).
    completions: Option<Arc<Completions>>,
    /// Counted in `Counters::inflight` until it completes: a caller's transfer, admitted
    /// under `max_inflight` (not a store's own: `Engine::submit_for_store`).
    admitted: bool,
    on_complete: Mutex<Option<OnComplete>>,
    phase: AtomicU8,
    outstanding: AtomicU64,
    cancelled: AtomicBool,
    failed: AtomicBool,
    first_error: Mutex<Option<Error>>,
    final_status: Mutex<Option<Status>>,
    /// Set with `final_status`, for waiters that look before they sleep.
    finished: AtomicBool,
    done: Condvar,
    message: OnceLock<CString>,
    /// The identity of each destination block's write, for its checksums' tags.
    write_ids: Option<Arc<WriteIds>>,
    /// When each stage happened, where `KVX_STAGE_TIMES` asks for it (`stages.rs`).
    stages: Option<Box<StageTimes>>,
}

impl Request {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        engine: u64,
        class: Class,
        transfer: Transfer,
        counters: Arc<Counters>,
        completions: Option<Arc<Completions>>,
        admitted: bool,
        on_complete: Option<OnComplete>,
        write_ids: Option<Arc<WriteIds>>,
    ) -> Request {
        Request {
            engine,
            class,
            transfer: Mutex::new(Some(transfer)),
            counters,
            completions,
            admitted,
            on_complete: Mutex::new(on_complete),
            phase: AtomicU8::new(QUEUED),
            outstanding: AtomicU64::new(1),
            cancelled: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            first_error: Mutex::new(None),
            final_status: Mutex::new(None),
            finished: AtomicBool::new(false),
            done: Condvar::new(),
            message: OnceLock::new(),
            write_ids,
            stages: stages::enabled().then(|| Box::new(StageTimes::new())),
        }
    }

    /// Notes that `stage` happened now, where stage times are kept.
    pub(crate) fn mark(&self, stage: Stage) {
        if let Some(t) = &self.stages {
            t.mark(stage);
        }
    }

    pub(crate) fn class(&self) -> Class {
        self.class
    }

    /// The identity of each destination block's write, where the submitter gave them.
    pub(crate) fn write_ids(&self) -> Option<&WriteIds> {
        self.write_ids.as_deref()
    }

    /// The dispatcher takes the request; false if a cancel already finished it.
    pub(crate) fn claim(&self) -> bool {
        self.phase.compare_exchange(QUEUED, CLAIMED, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Source and destination, while the request runs.
    pub(crate) fn plan_inputs(&self) -> Option<PlanInputs> {
        let t = self.transfer.lock().unwrap();
        t.as_ref().map(|t| PlanInputs {
            src: t.src.clone(),
            dst: t.dst.clone(),
            pairs: t.pairs.clone(),
            layers: t.layers.clone(),
            after: t.wait.as_ref().map(|w| w.gate),
        })
    }

    /// Whether remaining stages should be skipped.
    pub(crate) fn stopped(&self) -> bool {
        self.cancelled.load(Ordering::Acquire) || self.failed.load(Ordering::Acquire)
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Records a failure; the first one wins and becomes the request's status.
    pub(crate) fn fail(&self, err: Error) {
        let mut first = self.first_error.lock().unwrap();
        if first.is_none() {
            log::debug!("request failed: {err}");
            *first = Some(err);
        }
        self.failed.store(true, Ordering::Release);
    }

    pub(crate) fn chunk_issued(&self) {
        self.outstanding.fetch_add(1, Ordering::AcqRel);
    }

    /// Gives up one count unless it is the last (which would complete the request here):
    /// false then, and the caller hands it to one of the engine's threads.
    pub(crate) fn release_unless_last(&self) -> bool {
        self.outstanding.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n > 1).then(|| n - 1)).is_ok()
    }

    /// A chunk finished (or was skipped), or the dispatcher is done issuing.
    pub(crate) fn release_one(self: &Arc<Self>) {
        if self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.finalize();
        }
    }

    fn finalize(self: &Arc<Self>) {
        let transfer = self.transfer.lock().unwrap().take();
        let mut error = self.first_error.lock().unwrap().take();
        // Read once: the status must say what was done, and a cancel landing during the
        // seal and sync below comes too late to undo them.
        let cancelled = self.is_cancelled();
        if error.is_none() && !cancelled {
            if let Some(t) = &transfer {
                if let Err(e) = Self::complete_disk_writes(t) {
                    error = Some(e);
                }
            }
        }
        if let (Some(times), Some(t)) = (&self.stages, &transfer) {
            times.mark(Stage::Completed);
            let class = match self.class {
                Class::Critical => "critical",
                Class::Bulk => "bulk",
            };
            let kind = |l: &Layout| format!("{:?}", l.kind()).to_ascii_lowercase();
            times.log(&format!("{class} {}->{} blocks={}", kind(&t.src), kind(&t.dst), t.pairs.len()));
        }
        drop(transfer); // layouts destroyed by the caller go away here
        let status = match (&error, cancelled) {
            (Some(e), _) => {
                Counters::add(&self.counters.requests_failed, 1);
                e.status
            }
            (None, true) => {
                Counters::add(&self.counters.requests_cancelled, 1);
                Status::Cancelled
            }
            (None, false) => {
                Counters::add(&self.counters.requests_completed, 1);
                Status::Ok
            }
        };
        let message = match (&error, status) {
            (Some(e), _) => e.message.clone(),
            (None, Status::Cancelled) => "cancelled before all of its stages ran".to_string(),
            _ => String::new(),
        };
        let _ = self.message.set(CString::new(message.replace('\0', " ")).unwrap_or_default());
        if self.admitted {
            self.counters.inflight.fetch_sub(1, Ordering::AcqRel);
        }
        // The callback runs before wait/poll report completion, so a caller that waited
        // knows its callback has returned.
        if let Some(f) = self.on_complete.lock().unwrap().take() {
            // Inside the callback the request reports the status it was given (see
            // `delivered`). Restored after: a callback that cancels a queued request
            // runs that one's callback here too.
            let outer = DELIVERING.with(|d| d.replace(Some((self.addr(), self.engine, status))));
            // A panicking callback must not take the engine's thread (and every request
            // after this one) with it.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(self, status))).is_err() {
                log::error!("a completion callback panicked; the request's status stands and the engine goes on");
            }
            DELIVERING.with(|d| d.set(outer));
        }
        {
            let mut final_status = self.final_status.lock().unwrap();
            *final_status = Some(status);
            // Under the lock: whoever sees the status (poll and wait take the lock) sees
            // it after the fd was made readable, so a caller's read of the fd after that
            // never leaves a stale wake-up of this request behind.
            if let Some(c) = &self.completions {
                c.signal();
            }
        }
        self.finished.store(true, Ordering::Release);
        self.done.notify_all();
    }

    /// After every chunk of a write to disk succeeded: seal the blocks written
    /// (`KVX_DISK_CHECKSUM`), then make everything durable (`KVX_DISK_SYNC`).
    fn complete_disk_writes(t: &Transfer) -> crate::error::Result<()> {
        let Some(f) = t.dst.file() else { return Ok(()) };
        if let Some(sums) = &f.checksum {
            for &(_, block) in &t.pairs {
                sums.seal(block)?;
            }
        }
        if f.sync {
            f.sync_data()?;
        }
        Ok(())
    }

    /// Asks the request to stop: stages not yet started are skipped and the final status
    /// is `Cancelled` (unless it already finished or failed).
    pub fn cancel(self: &Arc<Self>) {
        if self.final_status.lock().unwrap().is_some() {
            return;
        }
        self.cancel_from_engine();
        // Not dispatched yet: finish it now instead of when the dispatcher reaches it.
        if self.claim() {
            self.release_one();
        }
    }

    /// Marks the request cancelled (engine shutdown, or the caller's cancel).
    pub(crate) fn cancel_from_engine(&self) {
        self.cancelled.store(true, Ordering::Release);
    }

    fn addr(&self) -> usize {
        self as *const Request as usize
    }

    /// The status this thread's running callback was given, if it is this request's:
    /// the request is done for the callback, though `wait` and `poll` on other threads
    /// report it only once the callback returned.
    fn delivered(&self) -> Option<Status> {
        DELIVERING.with(|d| d.get()).and_then(|(addr, _, st)| (addr == self.addr()).then_some(st))
    }

    /// Why a wait is refused, if it is (`wait_refusal`); never inside the request's own
    /// callback, where it is done.
    fn refusal(&self, timeout: Option<Duration>) -> Option<Error> {
        let (addr, _, _) = DELIVERING.with(|d| d.get())?;
        if addr == self.addr() {
            return None;
        }
        wait_refusal(self.engine, timeout)
    }

    /// `Pending` until done, then the final status (inside the request's own callback:
    /// the status the callback was given).
    pub fn poll(&self) -> Status {
        if let Some(st) = self.delivered() {
            return st;
        }
        self.final_status.lock().unwrap().unwrap_or(Status::Pending)
    }

    /// Waits up to `timeout` (`None`: forever) for the final status; `Timeout` otherwise.
    /// Inside the request's own callback it returns the callback's status at once;
    /// `InvalidArg` (logged) where `try_wait` refuses the wait.
    pub fn wait(&self, timeout: Option<Duration>) -> Status {
        self.try_wait(timeout).unwrap_or_else(|e| {
            log::error!("{e}");
            e.status
        })
    }

    /// As `wait`; a wait refused from inside a completion callback (on another request
    /// of the callback's engine, with a non-zero timeout) is an error saying why.
    pub fn try_wait(&self, timeout: Option<Duration>) -> crate::error::Result<Status> {
        if let Some(st) = self.delivered() {
            return Ok(st);
        }
        if let Some(e) = self.refusal(timeout) {
            return Err(e);
        }
        let start = Instant::now();
        let deadline = timeout.and_then(|t| start.checked_add(t));
        // A small transfer ends within microseconds: look for that before sleeping,
        // since a condition-variable wake-up costs about as much again.
        let spin = WAIT_SPIN.min(timeout.unwrap_or(WAIT_SPIN));
        while !self.finished.load(Ordering::Acquire) && start.elapsed() < spin {
            // Yield, not pause: the engine thread that completes the request may share
            // this core.
            std::thread::yield_now();
        }
        let mut st = self.final_status.lock().unwrap();
        loop {
            if let Some(s) = *st {
                return Ok(s);
            }
            match deadline {
                None => st = self.done.wait(st).unwrap(),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(Status::Timeout);
                    }
                    st = self.done.wait_timeout(st, d - now).unwrap().0;
                }
            }
        }
    }

    /// The failure message ("" unless it failed or was cancelled; "" while pending).
    pub fn error_message(&self) -> &std::ffi::CStr {
        self.message.get().map_or(c"", |m| m.as_c_str())
    }
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request").field("status", &self.poll()).finish()
    }
}
