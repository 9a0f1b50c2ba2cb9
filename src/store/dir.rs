//! A store's directory: the owner's lock and the `meta` file that fixes what the store is.
//!
//! ```text
//! <dir>/lock            flock(LOCK_EX) held by the owner for its lifetime; its pid inside
//! <dir>/meta            magic, version, geometry, capacity, shards, namespace digest (CRC'd)
//! <dir>/records         one 64-byte record per slot: the persistent index (record.rs)
//! <dir>/data-<k>        shard k: a checksummed disk layout (+ its .kvxsum sidecar)
//! ```
//! `meta` is written last when a store is made (to a temporary name, then renamed), so a
//! directory whose making was cut short has no `meta` and is made again.

use super::config::{namespace_digest, StoreConfig, StoreFlags};
use crate::error::{bail, Error, Result, Status};
use crate::fault::power_cut;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"KVXSTOR1";
/// The store format: 2 since records keep the key's own bytes (128-byte records).
const VERSION: u32 = 2;
const META_BYTES: usize = 96;

/// The owner's lock on a store directory: a POSIX record lock on `lock`, which the kernel
/// drops when the owner exits, however it exits, so a killed owner never blocks the next.
/// Record locks belong to the process and are not inherited across `fork` (a flock or an
/// open-file-description lock would be, and a forked child that never execs, a Python
/// worker say, would hold it past the owner's death). Within the process, where such a
/// lock never conflicts, `OWNED` refuses a second open of the same directory; the lock
/// file is opened only after that check, because closing any descriptor of it would drop
/// the lock.
#[derive(Debug)]
pub struct OwnerLock {
    _file: File,
    dir: (u64, u64),
}

/// (device, inode) of each store directory this process owns.
static OWNED: std::sync::Mutex<Vec<(u64, u64)>> = std::sync::Mutex::new(Vec::new());

fn busy(dir: &Path, pid: impl std::fmt::Display) -> Error {
    Error::new(
        Status::Busy,
        format!(
            "the store in {} is open for writing by process {pid}; one process owns a store: close it there, or use it from that process",
            dir.display()
        ),
    )
}

impl OwnerLock {
    /// Takes the lock of `dir`, or refuses with `Busy` naming the process that holds it.
    pub fn take(dir: &Path) -> Result<OwnerLock> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(dir).map_err(|e| Error::io(format_args!("stat {}", dir.display()), e))?;
        let id = (m.dev(), m.ino());
        let mut owned = OWNED.lock().unwrap_or_else(|p| p.into_inner());
        if owned.contains(&id) {
            return Err(busy(dir, std::process::id()));
        }
        let path = dir.join("lock");
        let shown = path.display();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io(format_args!("opening {shown}"), e))?;
        // SAFETY: a zeroed flock filled in: a write lock on the whole file.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = libc::F_WRLCK as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        // SAFETY: fcntl on a descriptor we own, with a flock we own.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLK, &fl) } != 0 {
            let err = std::io::Error::last_os_error();
            if !matches!(err.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) {
                return Err(Error::io(format_args!("locking {shown}"), err));
            }
            // SAFETY: as above; F_GETLK fills in the holder.
            let held = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETLK, &mut fl) } == 0 && fl.l_type != libc::F_UNLCK as libc::c_short;
            return Err(match held {
                true => busy(dir, fl.l_pid),
                false => busy(dir, "another process (it just closed it: open again)"),
            });
        }
        file.set_len(0).map_err(|e| Error::io(format_args!("writing {shown}"), e))?;
        file.write_all_at(format!("{}\n", std::process::id()).as_bytes(), 0).map_err(|e| Error::io(format_args!("writing {shown}"), e))?;
        owned.push(id);
        Ok(OwnerLock { _file: file, dir: id })
    }
}

impl Drop for OwnerLock {
    fn drop(&mut self) {
        OWNED.lock().unwrap_or_else(|p| p.into_inner()).retain(|d| *d != self.dir);
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
