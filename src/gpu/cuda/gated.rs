//! The gated lanes: streams for the copies of requests that wait for a caller's event
//! (`wait_event`). A request takes a lane when its event is captured
//! (`Gpu::capture_event`): the capture waits for the caller's event on the lane's stream,
//! and the request's copies, both ways, queue behind it there. A request takes a lane
//! that no running request has and whose captures have all completed (a request that
//! ended before its event fired, cancelled say, leaves its wait queued), where there is
//! one, so its wait holds up nothing but its own copies; only with more gated requests
//! running than there are lanes do two share one (the least used), and then one may also
//! wait for the other's event.
//!
//! `GATED_LANES` streams, with the four copy streams eight in all: the driver's default
//! number of hardware work queues per context (`CUDA_DEVICE_MAX_CONNECTIONS`). A ninth
//! stream would share a queue with one of ours, where a wait at the head of the queue
//! holds up the other stream's work too, an ungated copy stream's among them. So the
//! lanes are not per direction (that would take eight), and captures take no streams of
//! their own.

use super::driver::{check, sys};
use crate::error::Result;
use crate::gpu::GATED_LANES;
use std::sync::Mutex;

/// Null handles until `create`; `free` frees whatever was created.
pub struct GatedLanes {
    /// Each lane's stream, with an event of ours recorded after its latest capture.
    streams: [(sys::CUstream, sys::CUevent); GATED_LANES],
    /// How many running requests have each lane.
    users: Mutex<[usize; GATED_LANES]>,
}

impl Default for GatedLanes {
    fn default() -> GatedLanes {
        GatedLanes { streams: [(std::ptr::null_mut(), std::ptr::null_mut()); GATED_LANES], users: Mutex::new([0; GATED_LANES]) }
    }
}

impl GatedLanes {
    /// # Safety
    /// The device's context is current.
    pub unsafe fn create(&mut self) -> Result<()> {
        for (stream, captured) in self.streams.iter_mut() {
            check(sys::cuStreamCreate(stream, sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32), "cuStreamCreate")?;
            check(sys::cuEventCreate(captured, sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32), "cuEventCreate")?;
        }
        Ok(())
    }

    /// Takes a lane for a request and makes `ours` fire, on the lane's stream, once the
    /// work `caller` was last recorded after has completed. `release` gives the lane back.
    ///
    /// # Safety
    /// The device's context is current; `ours` is an event of it.
    pub unsafe fn capture(&self, caller: sys::CUevent, ours: sys::CUevent) -> Result<usize> {
        let mut users = self.users.lock().unwrap();
        // An event never recorded counts as completed.
        let waiting = self.streams.map(|(_, captured)| sys::cuEventQuery(captured) == sys::CUresult::CUDA_ERROR_NOT_READY);
        let lane = least_used(&users, &waiting);
        let (stream, captured) = self.streams[lane];
        check(sys::cuStreamWaitEvent(stream, caller, 0), "cuStreamWaitEvent (wait_event)")?;
        check(sys::cuEventRecord(ours, stream), "cuEventRecord")?;
        check(sys::cuEventRecord(captured, stream), "cuEventRecord")?;
        users[lane] += 1;
        Ok(lane)
    }

    /// Gives back a lane from `capture`, once no copy of its request is still to be issued.
    pub fn release(&self, lane: usize) {
        self.users.lock().unwrap()[lane] -= 1;
    }

    /// The stream of a lane's copies.
    pub fn stream(&self, lane: usize) -> sys::CUstream {
        self.streams[lane].0
    }

    /// # Safety
    /// The device's context is current; no copy or capture is still to be queued.
    pub unsafe fn free(&mut self) {
        for (stream, captured) in self.streams {
            if !captured.is_null() {
                sys::cuEventDestroy_v2(captured);
            }
            if !stream.is_null() {
                sys::cuStreamDestroy_v2(stream);
            }
        }
    }
}

/// The first lane that no running request has and where no capture still waits (of a
/// request that ended before its event fired); where there is none, the least used, a
/// capture still waiting counting as a user.
fn least_used(users: &[usize; GATED_LANES], waiting: &[bool; GATED_LANES]) -> usize {
    (0..GATED_LANES).min_by_key(|&i| users[i] + waiting[i] as usize).expect("at least one gated lane")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_takes_a_lane_no_running_request_has_while_one_is_free() {
        let mut users = [0; GATED_LANES];
        let none_waiting = [false; GATED_LANES];
        for expected in 0..GATED_LANES {
            let lane = least_used(&users, &none_waiting);
            assert_eq!(users[lane], 0, "request {expected} given lane {lane}, which a running request has, while a lane was free");
            users[lane] += 1;
        }
        let last = GATED_LANES - 1;
        users[last] -= 1;
        assert_eq!(least_used(&users, &none_waiting), last, "a lane given back is free again");
        users = [2; GATED_LANES];
        users[last] = 1;
        assert_eq!(least_used(&users, &none_waiting), last, "past the pool, the least used lane");
    }

    #[test]
    fn a_lane_where_an_ended_requests_capture_still_waits_is_taken_last_of_the_free() {
        let mut waiting = [false; GATED_LANES];
        waiting[0] = true;
        assert_ne!(least_used(&[0; GATED_LANES], &waiting), 0);
        let mut users = [1; GATED_LANES];
        users[0] = 0;
        assert_eq!(least_used(&users, &waiting), 0, "as busy as a lane one running request has");
    }
}
