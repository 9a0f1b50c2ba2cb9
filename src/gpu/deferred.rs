//! The deferred emulated device's stream (tests only, `fault-injection`): copies run
//! later, in issue order, on a thread of their own, and a fence completes when the
//! stream reaches it, as on a GPU. So a slot whose copies were queued is still being
//! written after `Gpu::copy` returned, and the tests can hold the streams
//! (`fault::hold_device_streams`, or only bulk copies' with `hold_bulk_device_stream`)
//! to keep it that way.

use super::{CopyOp, PendingCopy};
use crate::error::Result;
use crate::fault;
use std::sync::{Arc, Condvar, Mutex};

enum Job {
    Copy(CopyOp),
    /// Everything queued before it has run.
    Signal(Arc<Signal>),
    Stop,
}

#[derive(Default)]
struct Signal {
    fired: Mutex<bool>,
    cv: Condvar,
}

/// One stream: a queue and the thread that runs it.
pub struct Stream {
    tx: Mutex<std::sync::mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Stream {
    /// `critical`: latency-critical copies' stream, which `fault::hold_bulk_device_stream`
    /// leaves running.
    pub fn new(critical: bool) -> Stream {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("kvx-emu-stream".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    if matches!(job, Job::Stop) {
                        return;
                    }
                    fault::device_job_starts(critical);
                    match job {
                        // SAFETY: the planner's ops lie in validated layouts and the chunk's
                        // slot, which stays the chunk's until its fence fired.
                        Job::Copy(op) => unsafe { std::ptr::copy_nonoverlapping(op.src as *const u8, op.dst as *mut u8, op.len as usize) },
                        Job::Signal(s) => {
                            *s.fired.lock().unwrap() = true;
                            s.cv.notify_all();
                        }
                        Job::Stop => unreachable!(),
                    }
                }
            })
            .expect("spawn the emulated device's stream");
        Stream { tx: Mutex::new(tx), thread: Some(thread) }
    }

    fn send(&self, job: Job) {
        self.tx.lock().unwrap().send(job).expect("the emulated stream runs until its device is dropped");
    }

    /// Queues one copy.
    pub fn copy(&self, op: CopyOp) {
        self.send(Job::Copy(op));
    }

    /// Queues a fence: it completes once everything queued before it has run.
    pub fn fence(&self) -> Box<dyn PendingCopy> {
        let s = Arc::new(Signal::default());
        self.send(Job::Signal(s.clone()));
        Box::new(Fenced(s))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.tx.lock().unwrap().send(Job::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Fenced(Arc<Signal>);

impl PendingCopy for Fenced {
    fn wait(self: Box<Self>, _spin: bool) -> Result<()> {
        fault::fence_waiting(true);
        let fired = self.0.fired.lock().unwrap();
        drop(self.0.cv.wait_while(fired, |f| !*f).unwrap());
        fault::fence_waiting(false);
        Ok(())
    }
}
