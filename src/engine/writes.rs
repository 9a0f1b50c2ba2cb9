//! Page-cache writes to one file, one at a time.
//!
//! The kernel runs a buffered write to a file under the file's lock (`inode_lock`, on
//! tmpfs as on ext4 and XFS): the writes to one file copy their bytes one after another
//! however many threads issue them, and each of those threads sleeps in its system call
//! meanwhile. Left to the I/O workers, a file under a stream of bulk writes (offloads to
//! one buffered file) would hold every worker asleep on its lock, and a critical read
//! queued behind them could start only as each worker's turn at the lock came round:
//! served first by the queue, it still waited for a worker. So a worker that takes a
//! write to a file another worker is writing parks the chunk here and goes on with the
//! queue; the writer runs the parked writes of its file when its own is done (critical
//! ones first, each class in the order they came). The file moves what it moved, and
//! every other worker stays free for reads and other files.
//!
//! Writes to a file opened for direct I/O are not parked: they run side by side.

use super::chunk::Chunk;
use super::class::Class;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// The files being written through the page cache, each with the writes parked behind
/// its writer. A file is here exactly while one worker is its writer.
#[derive(Default)]
pub struct WriteGates {
    files: Mutex<HashMap<usize, Parked>>,
}

#[derive(Default)]
struct Parked {
    critical: VecDeque<Chunk>,
    bulk: VecDeque<Chunk>,
}

impl WriteGates {
    /// `chunk`, whose next stage writes file `key`, back to run now (its worker is the
    /// file's writer), or `None`: parked behind the file's writer, which runs it.
    pub fn enter(&self, key: usize, chunk: Chunk) -> Option<Chunk> {
        match self.files.lock().unwrap().entry(key) {
            Entry::Vacant(v) => {
                v.insert(Parked::default());
                Some(chunk)
            }
            Entry::Occupied(mut o) => {
                let parked = o.get_mut();
                match chunk.req.class() {
                    Class::Critical => parked.critical.push_back(chunk),
                    Class::Bulk => parked.bulk.push_back(chunk),
                }
                None
            }
        }
    }

    /// The writer of file `key` is done with its write: the next parked write, which its
    /// worker runs as the file's writer now, or `None` (the file has no writer any more).
    pub fn leave(&self, key: usize) -> Option<Chunk> {
        let mut files = self.files.lock().unwrap();
        let Entry::Occupied(mut o) = files.entry(key) else { unreachable!("a file's writer left a gate it never entered") };
        let parked = o.get_mut();
        let next = parked.critical.pop_front().or_else(|| parked.bulk.pop_front());
        if next.is_none() {
            o.remove();
        }
        next
    }
}
