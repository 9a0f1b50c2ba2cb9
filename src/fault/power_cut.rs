//! Power cuts for tests: what a machine that loses power keeps of the files under a
//! folder, as a file system that keeps only what was synced would (the model of
//! LevelDB's fault-injection environment). A `SIGKILL` keeps the page cache, so it never
//! shows a missing `fsync`; a power cut does.
//!
//! While a process `record`s, each call that changes a file under the folder first
//! appends what undoes it to a journal: a write's or a resize's pre-image (the bytes it
//! overwrites or cuts off, and the size before it), a creation, a rename (with the file
//! it replaced). A successful `fsync`/`fdatasync` of a file then appends a mark that
//! makes its pre-images before it void; one of a folder, one that makes its creations and
//! renames before it void. The journal is appended with plain writes, one per entry, so
//! it survives the process being killed at any instant. `cut`, run after the process is
//! gone, undoes every entry not made void, newest first: unsynced writes and sizes go
//! back to what was synced, files created since their folder's last sync vanish, renames
//! not yet synced by a folder sync are undone. A cut may also keep a random part of the
//! unsynced writes, as the kernel's writeback may have written them.
//!
//! Removals are not undone: a removed file stays removed. Every change the store makes to
//! its files passes through the hooks below (the `pwrite`s and syncs of `io::posix`, which
//! write the data files and their sidecars; the shards' creation and sizing; the records
//! file's and `meta`'s writes, sizes, creations, rename and syncs), except the files whose
//! bytes decide nothing a reopen serves: the owner's lock and pid files, and the eviction
//! order (a hint, checked against the records); io_uring's writes do not, so a test that
//! cuts runs on the POSIX backend.
//!
//! Without the `fault-injection` feature the hooks only make their call.

use std::os::fd::BorrowedFd;
use std::path::Path;

#[cfg(feature = "fault-injection")]
pub use journal::{cut, cut_after, record, stop, Cut};

/// Makes the write of `len` bytes at `off` that `f` does.
#[inline(always)]
pub(crate) fn write<R>(fd: BorrowedFd<'_>, off: u64, len: u64, f: impl FnOnce() -> R) -> R {
    #[cfg(feature = "fault-injection")]
    let _journaled = journal::changing(|j| j.write(fd, off, len));
    #[cfg(not(feature = "fault-injection"))]
    let _ = (fd, off, len);
    f()
}

/// Makes the resize to `len` bytes (a truncation, or a reservation that never shrinks)
/// that `f` does.
#[inline(always)]
pub(crate) fn resize<R>(fd: BorrowedFd<'_>, len: u64, f: impl FnOnce() -> R) -> R {
    #[cfg(feature = "fault-injection")]
    let _journaled = journal::changing(|j| j.resize(fd, len));
    #[cfg(not(feature = "fault-injection"))]
    let _ = (fd, len);
    f()
}

/// Makes the creation of `path` (if it is not there yet) that `f` does.
#[inline(always)]
pub(crate) fn create<R>(path: &Path, f: impl FnOnce() -> R) -> R {
    #[cfg(feature = "fault-injection")]
    let _journaled = journal::changing(|j| j.create(path));
    #[cfg(not(feature = "fault-injection"))]
    let _ = path;
    f()
}

/// Makes the rename of `from` to `to` (in one folder) that `f` does.
#[inline(always)]
pub(crate) fn rename<R>(from: &Path, to: &Path, f: impl FnOnce() -> R) -> R {
    #[cfg(feature = "fault-injection")]
    let _journaled = journal::changing(|j| j.rename(from, to));
    #[cfg(not(feature = "fault-injection"))]
    let _ = (from, to);
    f()
}

/// Makes the `fsync` or `fdatasync` of the file or folder `fd` that `f` does.
#[inline(always)]
pub(crate) fn sync<T>(fd: BorrowedFd<'_>, f: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    #[cfg(feature = "fault-injection")]
    return journal::synced(fd, f);
    #[cfg(not(feature = "fault-injection"))]
    {
        let _ = fd;
        f()
    }
}

#[cfg(feature = "fault-injection")]
mod journal {
    use std::collections::HashSet;
    use std::fs::{File, OpenOptions};
    use std::io::{Error, ErrorKind, Result, Write};
    use std::os::fd::{AsRawFd, BorrowedFd};
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{FileExt, MetadataExt};
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{RwLock, RwLockReadGuard};

    /// The journal of the recording process and the folder it covers. Calls that change
    /// files hold it shared from their entry to the end of their call; syncs hold it
    /// alone, so no change journaled before a sync's mark is still under way when the
    /// sync starts.
    static RECORDING: RwLock<Option<Journal>> = RwLock::new(None);
    static ON: AtomicBool = AtomicBool::new(false);

    pub(super) struct Journal {
        file: File,
        root: PathBuf,
    }

    /// What `cut` undid.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Cut {
        /// Entries the journal held.
        pub entries: usize,
        /// Writes and resizes reverted.
        pub writes: u64,
        /// Unsynced writes and resizes the writeback kept.
        pub kept: u64,
        /// Files removed, created since their folder's last sync.
        pub removed: u64,
        /// Renames undone.
        pub renames: u64,
    }

    /// From now on, journals every change this process makes to files under `root`,
    /// appending to `journal` (made afresh; best outside `root`), for `cut`.
    pub fn record(journal: &Path, root: &Path) -> Result<()> {
        File::create(journal)?;
        let file = OpenOptions::new().append(true).open(journal)?;
        *RECORDING.write().unwrap_or_else(|p| p.into_inner()) = Some(Journal { file, root: root.canonicalize()? });
        ON.store(true, Ordering::Release);
        Ok(())
    }

    /// Stops recording.
    pub fn stop() {
        ON.store(false, Ordering::Release);
        *RECORDING.write().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Journals a change (while recording) and holds the journal shared until the
    /// change is made. A change that cannot be journaled panics: a test that cuts would
    /// otherwise check less than it says.
    pub(super) fn changing(journal: impl FnOnce(&Journal) -> Result<()>) -> Option<RwLockReadGuard<'static, Option<Journal>>> {
        if !ON.load(Ordering::Relaxed) {
            return None;
        }
        let held = RECORDING.read().unwrap_or_else(|p| p.into_inner());
        if let Some(j) = held.as_ref() {
            journal(j).unwrap_or_else(|e| panic!("power-cut journal: {e}"));
        }
        Some(held)
    }

    pub(super) fn synced<T>(fd: BorrowedFd<'_>, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if !ON.load(Ordering::Relaxed) {
            return f();
        }
        let held = RECORDING.write().unwrap_or_else(|p| p.into_inner());
        let done = f()?;
        if let Some(j) = held.as_ref() {
            j.sync(fd).unwrap_or_else(|e| panic!("power-cut journal: {e}"));
        }
        Ok(done)
    }

    const UNDO: u8 = 1;
    const SYNC: u8 = 2;
    const CREATE: u8 = 3;
    const RENAME: u8 = 4;

    /// A file's identity: device and inode.
    type Id = (u64, u64);

    /// One journal entry, as it is read back.
    enum Entry {
        /// Write `bytes` at `off`, then size the file `id` at `path` to `size`.
        Undo { id: Id, path: PathBuf, off: u64, size: u64, bytes: Vec<u8> },
        /// The file or folder `id` was synced.
        Sync { id: Id },
        /// `path` was made in the folder `dir`.
        Create { dir: Id, path: PathBuf },
        /// The file `file` at `from` was renamed `to` in the folder `dir`, over a file of
        /// `replaced` bytes.
        Rename { dir: Id, from: PathBuf, to: PathBuf, file: Id, replaced: Option<Vec<u8>> },
    }

    fn id(m: &std::fs::Metadata) -> Id {
        (m.dev(), m.ino())
    }

    /// The entry framed: its length, the entry, a CRC of it, so a cut last one is dropped.
    fn frame(kind: u8, fields: &[&[u8]]) -> Vec<u8> {
        let mut body = vec![kind];
        for f in fields {
            body.extend_from_slice(&(f.len() as u64).to_le_bytes());
            body.extend_from_slice(f);
        }
        let mut out = (body.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&body);
        out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        out
    }

    fn num(v: u64) -> [u8; 8] {
        v.to_le_bytes()
    }

    impl Journal {
        fn append(&self, entry: Vec<u8>) -> Result<()> {
            // One write to a file opened to append: entries never interleave.
            (&self.file).write_all(&entry)
        }

        /// The path `fd` is open at, with its metadata, if it is under the root.
        fn tracked(&self, fd: BorrowedFd<'_>) -> Result<Option<(PathBuf, std::fs::Metadata)>> {
            let path = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
            if !path.starts_with(&self.root) {
                return Ok(None);
            }
            Ok(Some((path, std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))?)))
        }

        /// Journals the pre-image of `[off, end)` of `fd` and its size.
        fn pre_image(&self, fd: BorrowedFd<'_>, off: u64, end: u64) -> Result<()> {
            let Some((path, m)) = self.tracked(fd)? else { return Ok(()) };
            let mut bytes = vec![0u8; end.min(m.len()).saturating_sub(off) as usize];
            // A descriptor of our own (never O_DIRECT) on the same file.
            File::open(format!("/proc/self/fd/{}", fd.as_raw_fd()))?.read_exact_at(&mut bytes, off)?;
            let (dev, ino) = id(&m);
            self.append(frame(UNDO, &[&num(dev), &num(ino), path.as_os_str().as_bytes(), &num(off), &num(m.len()), &bytes]))
        }

        pub(super) fn write(&self, fd: BorrowedFd<'_>, off: u64, len: u64) -> Result<()> {
            self.pre_image(fd, off, off + len)
        }

        pub(super) fn resize(&self, fd: BorrowedFd<'_>, len: u64) -> Result<()> {
            self.pre_image(fd, len, u64::MAX)
        }

        fn folder(&self, path: &Path) -> Result<Option<(PathBuf, Id)>> {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d.canonicalize()?,
                _ => std::env::current_dir()?,
            };
            let name = path.file_name().ok_or_else(|| Error::new(ErrorKind::InvalidInput, "a path without a file name"))?;
            if !dir.starts_with(&self.root) {
                return Ok(None);
            }
            let m = std::fs::metadata(&dir)?;
            Ok(Some((dir.join(name), id(&m))))
        }

        pub(super) fn create(&self, path: &Path) -> Result<()> {
            let Some((path, (dev, ino))) = self.folder(path)? else { return Ok(()) };
            if std::fs::symlink_metadata(&path).is_ok() {
                return Ok(());
            }
            self.append(frame(CREATE, &[&num(dev), &num(ino), path.as_os_str().as_bytes()]))
        }

        pub(super) fn rename(&self, from: &Path, to: &Path) -> Result<()> {
            let Some((from, (dev, ino))) = self.folder(from)? else { return Ok(()) };
            let to = from.with_file_name(to.file_name().unwrap_or_default());
            let (f_dev, f_ino) = id(&std::fs::metadata(&from)?);
            let (had, replaced) = match std::fs::read(&to) {
                Ok(b) => (1u64, b),
                Err(e) if e.kind() == ErrorKind::NotFound => (0, Vec::new()),
                Err(e) => return Err(e),
            };
            let (from, to) = (from.as_os_str().as_bytes(), to.as_os_str().as_bytes());
            self.append(frame(RENAME, &[&num(dev), &num(ino), from, to, &num(f_dev), &num(f_ino), &num(had), &replaced]))
        }

        fn sync(&self, fd: BorrowedFd<'_>) -> Result<()> {
            let Some((_, m)) = self.tracked(fd)? else { return Ok(()) };
            let (dev, ino) = id(&m);
            self.append(frame(SYNC, &[&num(dev), &num(ino)]))
        }
    }

    /// The whole entries of a journal, in order (a last one cut short is dropped).
    fn entries(journal: &[u8]) -> Vec<Entry> {
        let mut out = Vec::new();
        let mut at = 0usize;
        let u64_at = |b: &[u8], o: usize| b.get(o..o + 8).map(|s| u64::from_le_bytes(s.try_into().unwrap()));
        while let Some(len) = u64_at(journal, at) {
            let Some(body) = journal.get(at + 8..at + 8 + len as usize) else { break };
            let Some(crc) = journal.get(at + 8 + len as usize..at + 12 + len as usize) else { break };
            if crc32fast::hash(body).to_le_bytes() != crc {
                break;
            }
            at += 12 + len as usize;
            let mut fields = Vec::new();
            let mut o = 1;
            while let Some(n) = u64_at(body, o) {
                fields.push(&body[o + 8..o + 8 + n as usize]);
                o += 8 + n as usize;
            }
            let n = |i: usize| u64::from_le_bytes(fields[i].try_into().unwrap());
            let path = |i: usize| PathBuf::from(std::ffi::OsStr::from_bytes(fields[i]));
            out.push(match body[0] {
                UNDO => Entry::Undo { id: (n(0), n(1)), path: path(2), off: n(3), size: n(4), bytes: fields[5].to_vec() },
                SYNC => Entry::Sync { id: (n(0), n(1)) },
                CREATE => Entry::Create { dir: (n(0), n(1)), path: path(2) },
                _ => Entry::Rename {
                    dir: (n(0), n(1)),
                    from: path(2),
                    to: path(3),
                    file: (n(4), n(5)),
                    replaced: (n(6) == 1).then(|| fields[7].to_vec()),
                },
            });
        }
        out
    }

    /// The power cut: undoes every change `journal` holds that no later sync made
    /// durable, newest first. With `writeback` (a seed), each unsynced write or resize is
    /// kept or undone at random instead, as the kernel's own writeback may have written
    /// some of them before the cut and not others. Run once the recording process is
    /// gone; a process that died before it recorded left no journal, and nothing to undo.
    pub fn cut(journal: &Path, writeback: Option<u64>) -> Result<Cut> {
        apply(journal, usize::MAX, writeback)
    }

    /// The power cut as if it had come once the process had made the changes and syncs
    /// of the first `made` entries of `journal` only: the later ones are undone too.
    pub fn cut_after(journal: &Path, made: usize) -> Result<Cut> {
        apply(journal, made, None)
    }

    fn apply(journal: &Path, made: usize, writeback: Option<u64>) -> Result<Cut> {
        // xorshift: kept (false) or undone, for each unsynced write.
        let mut x = writeback.map(|s| s | 1);
        let mut undo_this = move || {
            x.as_mut().is_none_or(|x| {
                *x ^= *x << 13;
                *x ^= *x >> 7;
                *x ^= *x << 17;
                *x & 1 == 0
            })
        };
        let mut cut = Cut::default();
        let mut synced: HashSet<Id> = HashSet::new();
        let journal = match std::fs::read(journal) {
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(cut),
            read => read?,
        };
        let entries = entries(&journal);
        cut.entries = entries.len();
        for (i, entry) in entries.into_iter().enumerate().rev() {
            let undone = |id: &Id| i >= made || !synced.contains(id);
            match entry {
                Entry::Sync { id } if i < made => {
                    synced.insert(id);
                }
                Entry::Undo { id: file, .. } if i < made && undone(&file) && !undo_this() => cut.kept += 1,
                Entry::Undo { id: file, path, off, size, bytes } if undone(&file) => {
                    // Only while the path still names that file (not one made there since
                    // it was removed).
                    let f = match OpenOptions::new().write(true).open(&path) {
                        Ok(f) if id(&f.metadata()?) == file => f,
                        Ok(_) => continue,
                        Err(e) if e.kind() == ErrorKind::NotFound => continue,
                        Err(e) => return Err(e),
                    };
                    f.write_all_at(&bytes, off)?;
                    f.set_len(size)?;
                    cut.writes += 1;
                }
                Entry::Create { dir, path } if undone(&dir) => match std::fs::remove_file(&path) {
                    Ok(()) => cut.removed += 1,
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                },
                // Only where the rename was made (the process may have died before it).
                Entry::Rename { dir, from, to, file, replaced } if undone(&dir) => match std::fs::metadata(&to) {
                    Ok(m) if id(&m) == file => {
                        std::fs::rename(&to, &from)?;
                        if let Some(bytes) = replaced {
                            std::fs::write(&to, bytes)?;
                        }
                        cut.renames += 1;
                    }
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                },
                _ => {}
            }
        }
        Ok(cut)
    }
}
