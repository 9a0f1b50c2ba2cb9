//! Per-request stage timestamps, to find where a request waits: off unless the
//! `KVX_STAGE_TIMES` environment variable is set (to anything but "0"; read once per
//! process). Then every request keeps, from its submit, when each stage first happened
//! (and when its last read or write and its last device copy ended), and logs them when it
//! completes: one record at debug level on this module's target, `kvxfer::engine::stages`:
//!
//! ```text
//! critical disk->device blocks=4 slot=1.2 io_queued=1.5 io_start=9.8 io_done=150.3 copy_issued=151.0 copy_done=170.2 last_io_done=300.1 last_copy_done=320.4 completed=321.0
//! ```
//!
//! The class (`critical` or `bulk`), the source and destination storage, the blocks, then
//! each stage's microseconds since the submit, `-` for one the request never reached (a
//! host-to-device transfer reads and writes no file). The stages: `slot`, a bounce slot
//! taken for its first chunk; `io_queued`, its first chunk handed to the I/O workers'
//! queue; `io_start` and `io_done`, an I/O worker's first disk read or write (or host copy)
//! begun and ended; `copy_issued` and `copy_done`, its first device copy issued and seen
//! done; `last_io_done` and `last_copy_done`, the last of those ended; `completed`, its
//! status set. Off, a request pays one branch per stage.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::Instant;

/// A point in a request's life (`StageTimes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Slot,
    IoQueued,
    IoStart,
    IoDone,
    CopyIssued,
    CopyDone,
    Completed,
}

/// The stages in the order the record lists them, then the two kept as the last.
const NAMES: [&str; 9] =
    ["slot", "io_queued", "io_start", "io_done", "copy_issued", "copy_done", "last_io_done", "last_copy_done", "completed"];
const LAST_IO: usize = 6;
const LAST_COPY: usize = 7;

impl Stage {
    fn index(self) -> usize {
        match self {
            Stage::Slot => 0,
            Stage::IoQueued => 1,
            Stage::IoStart => 2,
            Stage::IoDone => 3,
            Stage::CopyIssued => 4,
            Stage::CopyDone => 5,
            Stage::Completed => 8,
        }
    }
}

/// Whether requests keep stage times (`KVX_STAGE_TIMES`).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("KVX_STAGE_TIMES").is_some_and(|v| !v.is_empty() && v != "0"))
}

/// One request's stage times: nanoseconds since its submit, plus one (0: not yet).
pub struct StageTimes {
    start: Instant,
    at: [AtomicU64; NAMES.len()],
}

impl StageTimes {
    pub fn new() -> StageTimes {
        StageTimes { start: Instant::now(), at: Default::default() }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64 + 1
    }

    /// `stage` happened now: kept if it is the first time (and, for the end of an I/O
    /// stage or of a device copy, as the last time so far).
    pub fn mark(&self, stage: Stage) {
        let now = self.now();
        let _ = self.at[stage.index()].compare_exchange(0, now, Relaxed, Relaxed);
        match stage {
            Stage::IoDone => self.at[LAST_IO].fetch_max(now, Relaxed),
            Stage::CopyDone => self.at[LAST_COPY].fetch_max(now, Relaxed),
            _ => 0,
        };
    }

    /// Logs the record (on this module's target): `head` (class, storage, blocks), then
    /// the stages.
    pub fn log(&self, head: &str) {
        log::debug!("{head} {}", self.fields());
    }

    /// The record's stage fields: `name=µs` since the submit, or `name=-`.
    fn fields(&self) -> String {
        let mut out = String::new();
        for (name, at) in NAMES.iter().zip(&self.at) {
            if !out.is_empty() {
                out.push(' ');
            }
            match at.load(Relaxed) {
                0 => out.push_str(&format!("{name}=-")),
                t => out.push_str(&format!("{name}={:.1}", (t - 1) as f64 / 1e3)),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(fields: &str, name: &str) -> String {
        fields.split(' ').find_map(|f| f.strip_prefix(&format!("{name}="))).unwrap().to_string()
    }

    /// A stage keeps its first time; the ends of I/O stages and copies also keep their
    /// last; a stage never reached says so.
    #[test]
    fn a_stage_keeps_its_first_time_and_io_and_copies_their_last() {
        let t = StageTimes::new();
        t.mark(Stage::IoDone);
        t.mark(Stage::CopyDone);
        std::thread::sleep(std::time::Duration::from_millis(2));
        t.mark(Stage::IoDone);
        t.mark(Stage::CopyDone);
        t.mark(Stage::Completed);
        let f = t.fields();
        let us = |name| field(&f, name).parse::<f64>().unwrap();
        assert!(us("io_done") < 2000.0 && us("last_io_done") >= 2000.0, "{f}");
        assert!(us("copy_done") < 2000.0 && us("last_copy_done") >= 2000.0, "{f}");
        assert!(us("completed") >= us("last_copy_done"), "{f}");
        assert_eq!(field(&f, "slot"), "-");
        assert_eq!(f.split(' ').count(), NAMES.len());
    }
}
