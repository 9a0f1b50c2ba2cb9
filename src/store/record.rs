//! Slot records: the persistent index. The file `records` holds one 128-byte record per
//! slot, at `slot × 128`:
//!
//! ```text
//!   0..16   namespace digest (xxh3-128)     96..100  key length (1..=64)
//!  16..80   the key's bytes, zero-padded   100..124  zero
//!  80..88   generation                     124..128  CRC-32 of bytes 0..124
//!  88..96   seal of the block (its sidecar's)
//! ```
//! The record keeps the key itself, not a digest of it: what a get serves is decided by
//! the key's bytes.
//! A slot whose record is all zeros is free (never used, or its entry was removed: that
//! zeroing is the *tombstone*). Any other record whose CRC fails is damaged and counted.
//! A record is written only after its block's data and seal are complete, and a slot is
//! reused only after its tombstone is written, so the record of a slot names either no key
//! or the key whose bytes the slot holds; the seal ties the two together for a reader.

use super::config::{Digest, Key};
use crate::error::{Error, Result};
use crate::fault::{self, power_cut};
use std::fs::{File, OpenOptions};
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub const RECORD_BYTES: u64 = 128;
const CRC_AT: usize = RECORD_BYTES as usize - 4;
const TOMBSTONE: [u8; RECORD_BYTES as usize] = [0; RECORD_BYTES as usize];

/// One slot's record: an entry (key → this slot's bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    pub namespace: Digest,
    pub key: Key,
    pub generation: u64,
    pub seal: u64,
}

/// What a slot's record says when read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    Free,
    Entry(Record),
    /// Not a tombstone and its CRC fails: a damaged or torn record.
    Damaged,
}

impl Record {
    pub fn encode(&self) -> [u8; RECORD_BYTES as usize] {
        let mut r = [0u8; RECORD_BYTES as usize];
        let key = self.key.as_bytes();
        r[..16].copy_from_slice(&self.namespace.to_le_bytes());
        r[16..16 + key.len()].copy_from_slice(key);
        r[80..88].copy_from_slice(&self.generation.to_le_bytes());
        r[88..96].copy_from_slice(&self.seal.to_le_bytes());
        r[96..100].copy_from_slice(&self.key.len().to_le_bytes());
        let crc = crc32fast::hash(&r[..CRC_AT]);
        r[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        r
    }

    pub fn decode(r: &[u8]) -> Read {
        if r.len() != RECORD_BYTES as usize {
            return Read::Damaged;
        }
        if r == TOMBSTONE {
            return Read::Free;
        }
        if u32::from_le_bytes(r[CRC_AT..].try_into().unwrap()) != crc32fast::hash(&r[..CRC_AT]) {
            return Read::Damaged;
        }
        let key_len = u32::from_le_bytes(r[96..100].try_into().unwrap()) as usize;
        let seal = u64::from_le_bytes(r[88..96].try_into().unwrap());
        let Some(Ok(key)) = r[16..80].get(..key_len).map(Key::new) else { return Read::Damaged };
        // Past the key and in the reserved bytes, a record written here holds zeros.
        if r[16 + key_len..80].iter().chain(&r[100..CRC_AT]).any(|&b| b != 0) {
            return Read::Damaged;
        }
        if seal == 0 {
            return Read::Damaged;
        }
        Read::Entry(Record {
            namespace: u128::from_le_bytes(r[..16].try_into().unwrap()),
            key,
            generation: u64::from_le_bytes(r[80..88].try_into().unwrap()),
            seal,
        })
    }
}

/// Sizes `file` to `bytes` with its blocks allocated where the file system can (so a
/// record write never fails for want of space: a full disk fails a put's data write, and
/// its key, instead of a record after its data), else sparse.
fn reserve(file: &File, bytes: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let set_len = || power_cut::resize(file.as_fd(), bytes, || file.set_len(bytes));
    if file.metadata()?.len() > bytes {
        set_len()?;
    }
    // SAFETY: fallocate on a descriptor we own.
    if power_cut::resize(file.as_fd(), bytes, || unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, bytes as libc::off_t) }) == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => set_len(),
        _ => Err(err),
    }
}

/// The records file.
#[derive(Debug)]
pub struct Records {
    file: File,
    path: PathBuf,
    durable: bool,
}

impl Records {
    pub fn path(dir: &Path) -> PathBuf {
        dir.join("records")
    }

    /// Opens (or makes, all tombstones, whatever was there) the records file of `slots`
    /// slots. A file cut short
    /// (a crash while it grew, or damage) reads as tombstones past its end and is sized
    /// back to its full length.
    pub fn open(dir: &Path, slots: u64, create: bool, durable: bool) -> Result<Records> {
        Self::open_as(dir, slots, create, durable, false)
    }

    /// Opens the records file to read single records (a data-only open); never resized.
    pub fn open_read_only(dir: &Path, slots: u64) -> Result<Records> {
        Self::open_as(dir, slots, false, false, true)
    }

    fn open_as(dir: &Path, slots: u64, create: bool, durable: bool, read_only: bool) -> Result<Records> {
        let path = Self::path(dir);
        let shown = path.display();
        let file = power_cut::create(&path, || OpenOptions::new().read(true).write(!read_only).create(create).truncate(false).open(&path))
            .map_err(|e| Error::io(format_args!("opening {shown}"), e))?;
        if create {
            // Made afresh: records a cut-short making left must not name the new files' blocks.
            power_cut::resize(file.as_fd(), 0, || file.set_len(0)).map_err(|e| Error::io(format_args!("emptying {shown}"), e))?;
        }
        let want = slots * RECORD_BYTES;
        let len = file.metadata().map_err(|e| Error::io(format_args!("stat {shown}"), e))?.len();
        if len != want && !read_only {
            if !create {
                log::warn!("{shown} is {len} bytes, not {want}: records past {len} are lost and their slots free");
            }
            reserve(&file, want).map_err(|e| Error::io(format_args!("sizing {shown}"), e))?;
        }
        Ok(Records { file, path, durable })
    }

    /// Every slot's record, in slot order: one sequential read of the whole file.
    pub fn read_all(&self, slots: u64) -> Result<Vec<Read>> {
        const CHUNK: u64 = 1 << 20;
        let mut out = Vec::with_capacity(slots as usize);
        let mut buf = vec![0u8; (CHUNK * RECORD_BYTES).min(slots * RECORD_BYTES) as usize];
        let mut slot = 0;
        while slot < slots {
            let n = CHUNK.min(slots - slot);
            let bytes = &mut buf[..(n * RECORD_BYTES) as usize];
            self.file.read_exact_at(bytes, slot * RECORD_BYTES).map_err(|e| self.err("reading", e))?;
            out.extend(bytes.chunks_exact(RECORD_BYTES as usize).map(Record::decode));
            slot += n;
        }
        Ok(out)
    }

    /// `slot`'s record as it is on disk now (past a cut file's end: free).
    pub fn read(&self, slot: u32) -> Result<Read> {
        let mut r = [0u8; RECORD_BYTES as usize];
        match self.file.read_exact_at(&mut r, slot as u64 * RECORD_BYTES) {
            Ok(()) => Ok(Record::decode(&r)),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(Read::Free),
            Err(e) => Err(self.err("reading", e)),
        }
    }

    pub fn write(&self, slot: u32, rec: &Record) -> Result<()> {
        self.write_at(&rec.encode(), slot)
    }

    /// Marks `slot` free on disk.
    pub fn tombstone(&self, slot: u32) -> Result<()> {
        self.write_at(&TOMBSTONE, slot)
    }

    fn write_at(&self, r: &[u8; RECORD_BYTES as usize], slot: u32) -> Result<()> {
        let off = slot as u64 * RECORD_BYTES;
        power_cut::write(self.file.as_fd(), off, RECORD_BYTES, || self.file.write_all_at(r, off)).map_err(|e| self.err("writing", e))
    }

    /// In durable mode, makes every record written so far durable.
    pub fn sync(&self) -> Result<()> {
        if !self.durable {
            return Ok(());
        }
        // At the fault plan's `DiskSync` site, as every other sync of the store's files.
        if let Some(fault::Fault::Errno(e)) = fault::check(fault::Site::DiskSync) {
            return Err(self.err("syncing", std::io::Error::from_raw_os_error(e)));
        }
        power_cut::sync(self.file.as_fd(), || self.file.sync_data()).map_err(|e| self.err("syncing", e))
    }

    /// Makes the file durable as made (its size), whatever the mode.
    pub fn sync_all(&self) -> Result<()> {
        power_cut::sync(self.file.as_fd(), || self.file.sync_all()).map_err(|e| self.err("syncing", e))
    }

    fn err(&self, what: &str, e: std::io::Error) -> Error {
        Error::io(format_args!("{what} {}", self.path.display()), e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> Record {
        Record { namespace: 1 << 100 | 5, key: Key::new(b"seventeen bytes!!").unwrap(), generation: 42, seal: 0xfeed }
    }

    /// A key of every length round-trips whole: its bytes, not a digest, come back.
    #[test]
    fn a_record_keeps_the_keys_own_bytes() {
        for len in [1, 17, 63, 64] {
            let key = Key::new(&(0..len as u8).map(|b| b ^ 0x5a).collect::<Vec<u8>>()).unwrap();
            assert_eq!(Record::decode(&Record { key, ..rec() }.encode()), Read::Entry(Record { key, ..rec() }), "{len}");
        }
    }

    #[test]
    fn a_record_round_trips_and_zeros_are_a_tombstone() {
        assert_eq!(Record::decode(&rec().encode()), Read::Entry(rec()));
        assert_eq!(Record::decode(&TOMBSTONE), Read::Free);
    }

    #[test]
    fn any_flipped_byte_or_a_cut_record_is_damaged() {
        let bytes = rec().encode();
        for i in 0..bytes.len() {
            let mut b = bytes;
            b[i] ^= 0x10;
            assert_eq!(Record::decode(&b), Read::Damaged, "byte {i}");
        }
        assert_eq!(Record::decode(&bytes[..40]), Read::Damaged);
    }

    #[test]
    fn a_record_without_a_seal_or_with_a_bad_key_length_is_damaged() {
        assert_eq!(Record::decode(&Record { seal: 0, ..rec() }.encode()), Read::Damaged);
        // A length of no key, or past the key's field, or shorter than the key written (its
        // tail then lies in the padding), with the CRC right: damage, not a key.
        for len in [0u32, 16, 65, u32::MAX] {
            let mut r = rec().encode();
            r[96..100].copy_from_slice(&len.to_le_bytes());
            let crc = crc32fast::hash(&r[..CRC_AT]);
            r[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
            assert_eq!(Record::decode(&r), Read::Damaged, "{len}");
        }
    }
}
