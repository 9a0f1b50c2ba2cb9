//! Where a shared tier's objects live: an existing system (a shared directory, an
//! S3-compatible bucket) reached through this one small interface. A backend moves whole
//! objects by name and knows nothing of keys or checks (`object` does those), so a new
//! system needs only these calls.

use crate::error::Result;

/// A store of named objects that many processes and hosts use at once, with no owner and
/// no lock. Each call may block (a network round trip, a slow disk); the tier bounds how
/// long a caller waits for it and runs it on threads of its own.
pub trait Backend: Send + Sync {
    /// What it is, for messages and logs: a path or an endpoint and bucket, never a secret.
    fn describe(&self) -> String;

    /// Whether object `name` is there.
    fn exists(&self, name: &str) -> Result<bool>;

    /// Reads object `name`: `None` when it is not there, else its length in bytes. When that
    /// length is `header_len + payload_len`, its first `header_len` bytes go to
    /// `sink.header`, then the rest to `sink.payload` in order, a piece at a time, until the
    /// object ends or the sink wants no more (the rest is then not read); otherwise the sink
    /// is not called.
    fn read(&self, name: &str, header_len: usize, payload_len: usize, sink: &mut dyn Sink) -> Result<Option<u64>>;

    /// Publishes object `name` as `header` then `payload`, whole or not at all: no reader
    /// ever sees a part of it, and a writer killed mid-write leaves nothing readers see. A
    /// second write of a name replaces the first (keys name content, so with the same bytes).
    fn write(&self, name: &str, header: &[u8], payload: &[u8]) -> Result<()>;

    /// Removes object `name`; one that is not there is no error.
    fn remove(&self, name: &str) -> Result<()>;

    /// Work that keeps the backend within its bounds (evicting past its capacity, cleaning
    /// what killed writers left), run now and then on a thread of the tier's after writes.
    fn maintain(&self) -> Result<()> {
        Ok(())
    }
}

/// Where a read's bytes go as they arrive: each piece is checked and placed while it is in
/// the cache, so an object crosses memory once.
pub trait Sink {
    /// The object's header; `false` to read no further.
    fn header(&mut self, header: &[u8]) -> bool;
    /// The payload's next piece; `false` to read no further.
    fn payload(&mut self, piece: &[u8]) -> bool;

    /// Memory the whole payload may be read into at once, where the sink has it (memory of
    /// its own, which nothing reads before the read ends): a backend that can fill it
    /// directly does, then calls `filled` instead of `payload`.
    fn whole(&mut self) -> Option<&mut [u8]> {
        None
    }

    /// The payload is in `whole`'s memory; `false` if it is not wanted.
    fn filled(&mut self) -> bool {
        true
    }
}
