//! Where caller events are captured (`Gpu::capture_event`): a few streams, each capture
//! on one whose earlier captures have all completed where one has, so a captured event
//! waits for its own caller event, not for every one captured before it. Only while
//! every stream waits for a caller's event do two captures share one.

use super::driver::{check, sys};
use crate::error::Result;
use std::sync::Mutex;

/// How many streams capture. With the four copy streams and the two for gated chunks,
/// eight in all: the driver's default number of hardware work queues per context
/// (`CUDA_DEVICE_MAX_CONNECTIONS`), so no two of them share one, where a wait at the
/// head of the queue would hold up the other stream.
const STREAMS: usize = 2;

/// Null handles until `create`; `free` frees whatever was created.
pub struct Captures {
    lanes: Mutex<Lanes>,
}

struct Lanes {
    /// Each stream, with an event of ours recorded after its latest capture.
    streams: [(sys::CUstream, sys::CUevent); STREAMS],
    /// Where a capture goes when every stream is busy.
    next: usize,
}

impl Default for Captures {
    fn default() -> Captures {
        Captures { lanes: Mutex::new(Lanes { streams: [(std::ptr::null_mut(), std::ptr::null_mut()); STREAMS], next: 0 }) }
    }
}

impl Captures {
    /// # Safety
    /// The device's context is current.
    pub unsafe fn create(&mut self) -> Result<()> {
        let lanes = self.lanes.get_mut().unwrap();
        for (stream, done) in lanes.streams.iter_mut() {
            check(sys::cuStreamCreate(stream, sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32), "cuStreamCreate")?;
            check(sys::cuEventCreate(done, sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32), "cuEventCreate")?;
        }
        Ok(())
    }

    /// Makes `ours` fire once the work `caller` was last recorded after has completed.
    ///
    /// # Safety
    /// The device's context is current; `ours` is an event of it.
    pub unsafe fn capture(&self, caller: sys::CUevent, ours: sys::CUevent) -> Result<()> {
        let mut lanes = self.lanes.lock().unwrap();
        // An event never recorded counts as completed.
        let idle = (0..STREAMS).find(|&i| sys::cuEventQuery(lanes.streams[i].1) == sys::CUresult::CUDA_SUCCESS);
        let i = idle.unwrap_or(lanes.next);
        lanes.next = (i + 1) % STREAMS;
        let (stream, done) = lanes.streams[i];
        check(sys::cuStreamWaitEvent(stream, caller, 0), "cuStreamWaitEvent (wait_event)")?;
        check(sys::cuEventRecord(ours, stream), "cuEventRecord")?;
        check(sys::cuEventRecord(done, stream), "cuEventRecord")
    }

    /// # Safety
    /// The device's context is current; no capture is still to be made.
    pub unsafe fn free(&mut self) {
        for (stream, done) in self.lanes.get_mut().unwrap().streams {
            if !done.is_null() {
                sys::cuEventDestroy_v2(done);
            }
            if !stream.is_null() {
                sys::cuStreamDestroy_v2(stream);
            }
        }
    }
}
