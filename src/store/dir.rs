//! A store's directory: the owner's lock and the `meta` file that fixes what the store is.
//!
//! ```text
//! <dir>/lock            an open-file-description lock held by the owner for its lifetime
//! <dir>/owner           the owner's pid, for the message that refuses another open
//! <dir>/meta            magic, version, geometry, capacity, shards, namespace digest (CRC'd)
//! <dir>/records         one 128-byte record per slot: the persistent index (record.rs)
//! <dir>/data-<k>        shard k: a checksummed disk layout (+ its .kvxsum sidecar)
//! ```
//! `meta` is written last when a store is made (to a temporary name, then renamed), so a
//! directory whose making was cut short has no `meta` and is made again.

use super::config::{namespace_digest, StoreConfig, StoreFlags};
use crate::error::{bail, Error, Result, Status};
use crate::fault::power_cut;
use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

const MAGIC: &[u8; 8] = b"KVXSTOR1";
/// The store format: 2 since records keep the key's own bytes (128-byte records).
const VERSION: u32 = 2;
const META_BYTES: usize = 96;

/// The owner's lock on a store directory: an open-file-description lock (`F_OFD_SETLK`)
/// on `lock`. It belongs to the owner's own open of the file, so no other open or close of
/// the file touches it (a POSIX record lock belongs to the process, which loses it when it
/// closes any descriptor of the file: reading `lock`, or copying the directory), and it
/// conflicts with every other open, in this process too, so it also refuses a second open
/// of the store here. The kernel drops it when the last descriptor of that open is closed,
/// so a killed owner never blocks the next. A child inherits the descriptor on fork: it is
/// close-on-exec, and a child forked without exec (a Python worker, say) closes its copy
/// at the fork (`close_in_child`), so no child keeps the lock past its owner's death; a
/// close unlocks it explicitly, so neither does a child between its fork and its exec.
#[derive(Debug)]
pub struct OwnerLock {
    file: ManuallyDrop<File>,
    /// The process that took the lock (a forked child's copy of the descriptor is closed).
    pid: u32,
}

/// The descriptors of every owner's lock of this process, which a forked child closes.
static LOCKS: Mutex<Vec<RawFd>> = Mutex::new(Vec::new());

thread_local! {
    /// `LOCKS`, held by the forking thread across a fork: the child closes every lock
    /// descriptor of the parent, none being taken or closed meanwhile.
    static FORKING: RefCell<Option<MutexGuard<'static, Vec<RawFd>>>> = const { RefCell::new(None) };
}

fn locks() -> MutexGuard<'static, Vec<RawFd>> {
    LOCKS.lock().unwrap_or_else(|p| p.into_inner())
}

extern "C" fn hold_locks() {
    let held = locks();
    FORKING.with(|f| *f.borrow_mut() = Some(held));
}

extern "C" fn release_locks() {
    FORKING.with(|f| drop(f.borrow_mut().take()));
}

extern "C" fn close_in_child() {
    FORKING.with(|f| {
        if let Some(mut held) = f.borrow_mut().take() {
            for &fd in held.iter() {
                // SAFETY: the child's copy of a lock descriptor, which nothing in the child
                // uses: its `OwnerLock` never touches it (see `Drop`).
                unsafe { libc::close(fd) };
            }
            // The numbers are free for the child's own files from here on.
            held.clear();
        }
    });
}

/// Sets (`F_WRLCK`) or gives up (`F_UNLCK`) the open-file-description lock of `fd`.
fn ofd_lock(fd: RawFd, kind: libc::c_int) -> std::io::Result<()> {
    // SAFETY: a zeroed flock filled in: the whole file, l_pid 0 as OFD locks require.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: fcntl on a descriptor we own, with a flock we own.
    match unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &fl) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

fn owner_path(dir: &Path) -> PathBuf {
    dir.join("owner")
}

fn busy(dir: &Path) -> Error {
    let owner = match std::fs::read_to_string(owner_path(dir)).ok().and_then(|s| s.trim().parse::<u32>().ok()) {
        Some(pid) => format!("process {pid}"),
        None => "another process".into(),
    };
    Error::new(
        Status::Busy,
        format!(
            "the store in {} is open for writing by {owner}; one process owns a store: close it there, or use it from that process",
            dir.display()
        ),
    )
}

impl OwnerLock {
    /// Takes the lock of `dir`, or refuses with `Busy` naming the process that holds it.
    pub fn take(dir: &Path) -> Result<OwnerLock> {
        static AT_FORK: std::sync::Once = std::sync::Once::new();
        AT_FORK.call_once(|| {
            // SAFETY: handlers that take and give back `LOCKS` and close descriptors.
            let rc = unsafe { libc::pthread_atfork(Some(hold_locks), Some(release_locks), Some(close_in_child)) };
            if rc != 0 {
                log::warn!(
                    "registering a fork handler failed (error {rc}): a child forked without exec holds a store's lock after its owner died, until the child exits"
                );
            }
        });
        let path = dir.join("lock");
        let shown = path.display();
        // Close-on-exec, as every file std opens.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io(format_args!("opening {shown}"), e))?;
        {
            // Locked and listed at once: a child forked in between would keep the lock.
            let mut held = locks();
            if let Err(err) = ofd_lock(file.as_raw_fd(), libc::F_WRLCK) {
                return Err(match err.raw_os_error() {
                    Some(libc::EAGAIN) | Some(libc::EACCES) => busy(dir),
                    _ => Error::io(format_args!("locking {shown}"), err),
                });
            }
            held.push(file.as_raw_fd());
        }
        let lock = OwnerLock { file: ManuallyDrop::new(file), pid: std::process::id() };
        let (tmp, owner) = (dir.join("owner.tmp"), owner_path(dir));
        std::fs::write(&tmp, format!("{}\n", lock.pid))
            .and_then(|_| std::fs::rename(&tmp, &owner))
            .map_err(|e| Error::io(format_args!("writing {}", owner.display()), e))?;
        Ok(lock)
    }
}

impl Drop for OwnerLock {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child's: its descriptor was closed at the fork, and the number may
            // be another file's by now.
            return;
        }
        let fd = self.file.as_raw_fd();
        // Unlocked before the descriptor leaves `LOCKS`: a child forked meanwhile that
        // keeps its copy holds no lock with it.
        if let Err(e) = ofd_lock(fd, libc::F_UNLCK) {
            log::warn!("unlocking a store's lock file: {e}; the lock goes when the file is closed");
        }
        locks().retain(|&f| f != fd);
        // SAFETY: dropped once, here.
        unsafe { ManuallyDrop::drop(&mut self.file) };
    }
}

/// What `meta` records: everything a reopen must match.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meta {
    /// num_layers, outer_dim, page_size, inner_dim, dtype_bytes.
    pub block: [u64; 5],
    pub capacity: u64,
    pub shards: u32,
    pub namespace: u128,
    pub namespace_len: u32,
}

impl Meta {
    pub fn of(cfg: &StoreConfig) -> Meta {
        let b = &cfg.block;
        Meta {
            block: [b.num_layers, b.outer_dim, b.page_size, b.inner_dim, b.dtype_bytes],
            capacity: cfg.capacity_blocks,
            shards: cfg.shards,
            namespace: namespace_digest(&cfg.namespace),
            namespace_len: cfg.namespace.len() as u32,
        }
    }

    fn encode(&self) -> [u8; META_BYTES] {
        let mut m = [0u8; META_BYTES];
        m[..8].copy_from_slice(MAGIC);
        m[8..12].copy_from_slice(&VERSION.to_le_bytes());
        m[12..16].copy_from_slice(&self.shards.to_le_bytes());
        m[16..24].copy_from_slice(&self.capacity.to_le_bytes());
        for (i, v) in self.block.iter().enumerate() {
            m[24 + i * 8..32 + i * 8].copy_from_slice(&v.to_le_bytes());
        }
        m[64..80].copy_from_slice(&self.namespace.to_le_bytes());
        m[80..84].copy_from_slice(&self.namespace_len.to_le_bytes());
        let crc = crc32fast::hash(&m[..META_BYTES - 4]);
        m[META_BYTES - 4..].copy_from_slice(&crc.to_le_bytes());
        m
    }

    fn decode(m: &[u8], shown: &dyn std::fmt::Display) -> Result<Meta> {
        if m.len() != META_BYTES || &m[..8] != MAGIC {
            bail!(Integrity, "{shown} is not a kvxfer store's meta file; open another directory, or remove this one");
        }
        let u32_at = |o: usize| u32::from_le_bytes(m[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(m[o..o + 8].try_into().unwrap());
        if u32_at(8) != VERSION {
            bail!(
                Version,
                "{shown} is of store format {}; this kvxfer reads format {VERSION}: remove the directory to start the store afresh in this format (its blocks are lost), or open it with the kvxfer that made it",
                u32_at(8)
            );
        }
        if u32_at(META_BYTES - 4) != crc32fast::hash(&m[..META_BYTES - 4]) {
            bail!(Integrity, "{shown} is damaged (its checksum does not match); remove the directory to start the store afresh");
        }
        Ok(Meta {
            block: std::array::from_fn(|i| u64_at(24 + i * 8)),
            capacity: u64_at(16),
            shards: u32_at(12),
            namespace: u128::from_le_bytes(m[64..80].try_into().unwrap()),
            namespace_len: u32_at(80),
        })
    }

    /// Why a store made as `self` cannot be opened as `want`, if it cannot.
    pub fn refuse(&self, want: &Meta, dir: &Path) -> Result<()> {
        let shown = dir.display();
        if self.block != want.block {
            let [l, o, p, i, d] = self.block;
            bail!(
                Incompatible,
                "the store in {shown} holds blocks of another geometry (layers {l}, outer {o}, page {p}, inner {i}, dtype {d}); open it with that geometry, or use another directory"
            );
        }
        if self.capacity != want.capacity {
            bail!(
                Incompatible,
                "the store in {shown} was made for {} blocks, not {}; open it with that capacity",
                self.capacity,
                want.capacity
            );
        }
        if self.shards != want.shards {
            bail!(Incompatible, "the store in {shown} was made with {} shards, not {}; open it with that count", self.shards, want.shards);
        }
        if (self.namespace, self.namespace_len) != (want.namespace, want.namespace_len) {
            bail!(
                Incompatible,
                "the store in {shown} holds another namespace (another model, dtype, layout or rank); open a directory of its own for this one"
            );
        }
        Ok(())
    }
}

pub fn meta_path(dir: &Path) -> PathBuf {
    dir.join("meta")
}

/// The store's `meta`, or `None` where none was made yet.
pub fn read_meta(dir: &Path) -> Result<Option<Meta>> {
    let path = meta_path(dir);
    match std::fs::read(&path) {
        Ok(m) => Meta::decode(&m, &path.display()).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(format_args!("reading {}", path.display()), e)),
    }
}

/// Writes `meta` whole under a temporary name and renames it in place, synced with the
/// directory: the store exists from this point on, with everything made before it.
pub fn write_meta(dir: &Path, meta: &Meta) -> Result<()> {
    let (tmp, path) = (dir.join("meta.tmp"), meta_path(dir));
    let io = |what: &str, e| Error::io(format_args!("{what} {}", tmp.display()), e);
    let f = power_cut::create(&tmp, || File::create(&tmp)).map_err(|e| io("creating", e))?;
    let bytes = meta.encode();
    power_cut::write(f.as_fd(), 0, META_BYTES as u64, || (&f).write_all(&bytes)).map_err(|e| io("writing", e))?;
    power_cut::sync(f.as_fd(), || f.sync_all()).map_err(|e| io("syncing", e))?;
    power_cut::rename(&tmp, &path, || std::fs::rename(&tmp, &path))
        .map_err(|e| Error::io(format_args!("renaming {} to {}", tmp.display(), path.display()), e))?;
    sync_dir(dir)
}

pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| power_cut::sync(d.as_fd(), || d.sync_all()))
        .map_err(|e| Error::io(format_args!("syncing the directory {}", dir.display()), e))
}

/// The directory, made where `CREATE` asks for it.
pub fn prepare_dir(dir: &Path, flags: StoreFlags) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if !flags.contains(StoreFlags::CREATE) {
        return Err(Error::new(Status::InvalidArg, format!("{} is not a directory; pass CREATE to make a store there", dir.display())));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format_args!("creating {}", dir.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_round_trips_and_a_changed_byte_is_caught() {
        let m = Meta { block: [2, 2, 4, 64, 2], capacity: 10, shards: 3, namespace: 77 << 70, namespace_len: 5 };
        let bytes = m.encode();
        assert_eq!(Meta::decode(&bytes, &"meta").unwrap(), m);
        let mut bad = bytes;
        bad[30] ^= 1;
        assert_eq!(Meta::decode(&bad, &"meta").unwrap_err().status, Status::Integrity);
    }
}
