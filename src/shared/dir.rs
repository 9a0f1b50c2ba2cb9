//! A shared directory as a shared tier's backend: a local disk that many processes use,
//! or a shared file system (NFS, Lustre, CephFS) that many hosts mount.
//!
//! Objects are files `objects/<ab>/<name>`. A write goes to a temporary in `tmp/` (same
//! file system), is synced, then renamed over its name, so a reader opens either no file
//! or a whole one; a writer killed mid-write leaves a temporary only, which maintenance
//! removes once it is older than any write takes. A reader that has opened a file keeps
//! reading it whole even while another process evicts (unlinks) or replaces it.
//!
//! Capacity: when the files exceed `capacity_bytes`, any process's maintenance removes the
//! least recently used ones (by modification time, which a read refreshes at most once a
//! minute) until they fit in 90 % of it. Processes decide alone, so the bound is
//! approximate: a directory may exceed it by what is written between two maintenances.

use super::backend::Backend;
use crate::error::{bail, Error, Result};
use std::ffi::CString;
use std::fs;
use std::io::ErrorKind;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// A temporary older than this was left by a writer that died: no write takes so long.
const STALE_TEMPORARY: Duration = Duration::from_secs(3600);
/// A read refreshes an object's recency only when it is older than this, so hot objects
/// cost a metadata write (an RPC, on NFS) at most once a minute.
const TOUCH_AFTER: Duration = Duration::from_secs(60);

pub struct DirBackend {
    root: PathBuf,
    objects: PathBuf,
    tmp: PathBuf,
    /// 0: unbounded.
    capacity_bytes: u64,
    /// Bytes this process wrote since its last maintenance; maintenance scans the
    /// directory only once they reach a sixteenth of the capacity.
    written: AtomicU64,
    unique: AtomicU64,
}

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("object paths hold no NUL")
}

impl DirBackend {
    /// Opens (making them where missing) `root/objects` and `root/tmp`. A directory that
    /// cannot be made or written is refused here, with the reason, not at the first put.
    pub fn open(root: &Path, capacity_bytes: u64) -> Result<DirBackend> {
        let (objects, tmp) = (root.join("objects"), root.join("tmp"));
        for d in [&objects, &tmp] {
            fs::create_dir_all(d).map_err(|e| Error::io(format_args!("making the shared directory {}", d.display()), e))?;
        }
        let probe = tmp.join(format!("probe.{}", std::process::id()));
        fs::write(&probe, b"kvxfer").and_then(|_| fs::remove_file(&probe)).map_err(|e| {
            Error::io(format_args!("writing in the shared directory {} (give this process write access)", tmp.display()), e)
        })?;
        Ok(DirBackend { root: root.to_path_buf(), objects, tmp, capacity_bytes, written: AtomicU64::new(0), unique: AtomicU64::new(0) })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.objects.join(name)
    }

    /// Removes the least recently used objects past the capacity, and stale temporaries.
    fn evict(&self) -> Result<()> {
        let mut files = Vec::new();
        let mut total = 0u64;
        let now = SystemTime::now();
        for sub in read_dir(&self.objects)? {
            for f in read_dir(&sub)? {
                if let Ok(m) = f.metadata() {
                    total += m.len();
                    files.push((m.mtime(), m.mtime_nsec(), m.len(), f));
                }
            }
        }
        for t in read_dir(&self.tmp)? {
            let old = t.metadata().and_then(|m| m.modified()).is_ok_and(|m| now.duration_since(m).unwrap_or_default() > STALE_TEMPORARY);
            if old {
                let _ = fs::remove_file(&t);
            }
        }
        if total <= self.capacity_bytes {
            return Ok(());
        }
        files.sort_unstable();
        let target = self.capacity_bytes / 10 * 9;
        let mut removed = 0u64;
        for (_, _, len, f) in files {
            if total <= target {
                break;
            }
            match fs::remove_file(&f) {
                Ok(()) => {
                    total -= len;
                    removed += 1;
                }
                Err(e) if e.kind() == ErrorKind::NotFound => total -= len,
                Err(e) => return Err(Error::io(format_args!("evicting {}", f.display()), e)),
            }
        }
        log::debug!("shared directory {}: evicted {removed} objects to fit {} bytes", self.root.display(), self.capacity_bytes);
        Ok(())
    }
}

fn read_dir(d: &Path) -> Result<Vec<PathBuf>> {
    match fs::read_dir(d) {
        Ok(it) => Ok(it.filter_map(|e| e.ok().map(|e| e.path())).collect()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::io(format_args!("listing {}", d.display()), e)),
    }
}

/// Fills `bufs` from `fd` at offset 0, in as few calls as the kernel allows.
fn read_full(fd: i32, bufs: &mut [&mut [u8]], path: &Path) -> Result<()> {
    let mut done = 0usize;
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    while done < total {
        let mut skip = done;
        let iov: Vec<libc::iovec> = bufs
            .iter_mut()
            .filter_map(|b| {
                if skip >= b.len() {
                    skip -= b.len();
                    return None;
                }
                let v = libc::iovec { iov_base: b[skip..].as_mut_ptr() as *mut libc::c_void, iov_len: b.len() - skip };
                skip = 0;
                Some(v)
            })
            .collect();
        // SAFETY: each iovec covers the unread tail of a buffer we hold mutably.
        let n = unsafe { libc::preadv(fd, iov.as_ptr(), iov.len() as i32, done as i64) };
        match n {
            n if n > 0 => done += n as usize,
            0 => bail!(Io, "{} ended after {done} of {total} bytes while being read", path.display()),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != ErrorKind::Interrupted {
                    return Err(Error::io(format_args!("reading {}", path.display()), e));
                }
            }
        }
    }
    Ok(())
}

impl Backend for DirBackend {
    fn describe(&self) -> String {
        format!("shared directory {}", self.root.display())
    }

    fn exists(&self, name: &str) -> Result<bool> {
        match fs::metadata(self.path(name)) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io(format_args!("looking up {}", self.path(name).display()), e)),
        }
    }

    fn read(&self, name: &str, header: &mut [u8], payload: &mut [u8]) -> Result<Option<u64>> {
        let path = self.path(name);
        let file = match fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(format_args!("opening {}", path.display()), e)),
        };
        let meta = file.metadata().map_err(|e| Error::io(format_args!("reading the size of {}", path.display()), e))?;
        let len = meta.len();
        if len != (header.len() + payload.len()) as u64 {
            return Ok(Some(len));
        }
        use std::os::fd::AsRawFd;
        read_full(file.as_raw_fd(), &mut [header, payload], &path)?;
        let stale = meta.modified().ok().and_then(|m| SystemTime::now().duration_since(m).ok()).is_some_and(|age| age > TOUCH_AFTER);
        if stale {
            // Recency for eviction; a failure only makes the object look older.
            let _ = file.set_modified(SystemTime::now());
        }
        Ok(Some(len))
    }

    fn write(&self, name: &str, header: &[u8], payload: &[u8]) -> Result<()> {
        use std::io::Write;
        let path = self.path(name);
        let leaf = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        let tmp = self.tmp.join(format!("{leaf}.{}.{}", std::process::id(), self.unique.fetch_add(1, Ordering::Relaxed)));
        let written = (|| -> std::io::Result<()> {
            let mut f = fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            f.write_all(header)?;
            f.write_all(payload)?;
            f.sync_data()?;
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent)?;
            }
            // rename(2) replaces the name atomically: readers see the old file or this one.
            let r = unsafe { libc::rename(cstr(&tmp).as_ptr(), cstr(&path).as_ptr()) };
            if r != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(Error::io(format_args!("writing {} into {}", leaf, self.root.display()), e));
        }
        self.written.fetch_add((header.len() + payload.len()) as u64, Ordering::Relaxed);
        Ok(())
    }

    fn remove(&self, name: &str) -> Result<()> {
        match fs::remove_file(self.path(name)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(format_args!("removing {}", self.path(name).display()), e)),
        }
    }

    fn maintain(&self) -> Result<()> {
        if self.capacity_bytes == 0 {
            return Ok(());
        }
        if self.written.load(Ordering::Relaxed) < (self.capacity_bytes / 16).max(1) {
            return Ok(());
        }
        self.written.store(0, Ordering::Relaxed);
        self.evict()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvx-shared-dir-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn an_object_reads_back_whole_and_a_missing_one_is_none() {
        let d = dir("rw");
        let b = DirBackend::open(&d, 0).unwrap();
        b.write("ab/abcdef", b"head", b"payload!").unwrap();
        assert!(b.exists("ab/abcdef").unwrap());
        let (mut h, mut p) = ([0u8; 4], [0u8; 8]);
        assert_eq!(b.read("ab/abcdef", &mut h, &mut p).unwrap(), Some(12));
        assert_eq!((&h, &p), (b"head", b"payload!"));
        let (mut h2, mut p2) = ([0u8; 4], [0u8; 9]);
        assert_eq!(b.read("ab/abcdef", &mut h2, &mut p2).unwrap(), Some(12), "a size mismatch reports the size");
        assert_eq!(b.read("cd/cdef", &mut h, &mut p).unwrap(), None);
        b.remove("ab/abcdef").unwrap();
        b.remove("ab/abcdef").unwrap();
        assert!(!b.exists("ab/abcdef").unwrap());
        assert!(read_dir(&d.join("tmp")).unwrap().is_empty(), "no temporary is left behind");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn past_its_capacity_the_least_recently_used_objects_go() {
        let d = dir("evict");
        let b = DirBackend::open(&d, 4000).unwrap();
        for i in 0..10 {
            b.write(&format!("0{i}/obj{i}"), &[0u8; 100], &[i as u8; 900]).unwrap();
            let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + i);
            fs::File::options().write(true).open(b.path(&format!("0{i}/obj{i}"))).unwrap().set_modified(t).unwrap();
        }
        b.maintain().unwrap();
        let held: Vec<bool> = (0..10).map(|i| b.exists(&format!("0{i}/obj{i}")).unwrap()).collect();
        assert_eq!(held, [false, false, false, false, false, false, false, true, true, true], "the newest 3 fit in 90 %");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_directory_that_cannot_be_written_is_refused_at_open() {
        let e = DirBackend::open(Path::new("/proc/kvxfer-shared"), 0).err().expect("refused");
        assert!(e.message.contains("/proc/kvxfer-shared"), "{}", e.message);
    }
}
