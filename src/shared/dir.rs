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

use super::backend::{Backend, Sink};
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

/// Bytes a read asks the kernel for at once: a piece stays in the cache while the tier
/// checks and places it.
const PIECE: usize = 256 << 10;

thread_local! {
    /// Each tier thread's piece buffer.
    static PIECE_BUF: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; PIECE]);
}

/// Fills `buf` from `fd` at offset `at`.
fn read_exact_at(fd: i32, at: u64, buf: &mut [u8], path: &Path) -> Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: the range is a buffer we hold mutably.
        let n = unsafe { libc::pread(fd, rest.as_mut_ptr() as *mut libc::c_void, rest.len(), (at + done as u64) as i64) };
        match n {
            n if n > 0 => done += n as usize,
            0 => bail!(Io, "{} ended at byte {} while being read", path.display(), at + done as u64),
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

/// Hands the file's `header_len` bytes, then its `payload_len` bytes, to `sink`: into its
/// own memory at once where it has some, else piece by piece until it wants no more.
fn stream(fd: i32, header_len: usize, payload_len: usize, sink: &mut dyn Sink, path: &Path) -> Result<()> {
    PIECE_BUF.with_borrow_mut(|buf| {
        read_exact_at(fd, 0, &mut buf[..header_len], path)?;
        if !sink.header(&buf[..header_len]) {
            return Ok(());
        }
        if let Some(whole) = sink.whole() {
            read_exact_at(fd, header_len as u64, whole, path)?;
            sink.filled();
            return Ok(());
        }
        let mut at = 0;
        while at < payload_len {
            let n = PIECE.min(payload_len - at);
            read_exact_at(fd, (header_len + at) as u64, &mut buf[..n], path)?;
            if !sink.payload(&buf[..n]) {
                break;
            }
            at += n;
        }
        Ok(())
    })
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

    fn read(&self, name: &str, header_len: usize, payload_len: usize, sink: &mut dyn Sink) -> Result<Option<u64>> {
        assert!(header_len <= PIECE, "a header fits one piece");
        let path = self.path(name);
        let file = match fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(format_args!("opening {}", path.display()), e)),
        };
        let meta = file.metadata().map_err(|e| Error::io(format_args!("reading the size of {}", path.display()), e))?;
        let len = meta.len();
        if len != (header_len + payload_len) as u64 {
            return Ok(Some(len));
        }
        use std::os::fd::AsRawFd;
        stream(file.as_raw_fd(), header_len, payload_len, sink, &path)?;
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

    /// A sink that keeps what it is given, and wants at most `limit` payload pieces.
    #[derive(Default)]
    struct Collect {
        header: Vec<u8>,
        payload: Vec<u8>,
        pieces: usize,
        limit: Option<usize>,
    }

    impl Sink for Collect {
        fn header(&mut self, h: &[u8]) -> bool {
            self.header.extend_from_slice(h);
            true
        }
        fn payload(&mut self, piece: &[u8]) -> bool {
            self.payload.extend_from_slice(piece);
            self.pieces += 1;
            self.limit.is_none_or(|l| self.pieces < l)
        }
    }

    #[test]
    fn a_large_object_comes_in_pieces_until_the_sink_wants_no_more() {
        let d = dir("pieces");
        let b = DirBackend::open(&d, 0).unwrap();
        let payload: Vec<u8> = (0..PIECE * 2 + 100).map(|i| (i % 251) as u8).collect();
        b.write("ab/big", &[7u8; 512], &payload).unwrap();
        let mut all = Collect::default();
        assert_eq!(b.read("ab/big", 512, payload.len(), &mut all).unwrap(), Some(512 + payload.len() as u64));
        assert_eq!((all.header, all.pieces), (vec![7u8; 512], 3));
        assert!(all.payload == payload);
        let mut first = Collect { limit: Some(1), ..Default::default() };
        b.read("ab/big", 512, payload.len(), &mut first).unwrap();
        assert_eq!((first.pieces, first.payload.len()), (1, PIECE), "nothing is read past a sink that stopped");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_object_reads_back_whole_and_a_missing_one_is_none() {
        let d = dir("rw");
        let b = DirBackend::open(&d, 0).unwrap();
        b.write("ab/abcdef", b"head", b"payload!").unwrap();
        assert!(b.exists("ab/abcdef").unwrap());
        let mut got = Collect::default();
        assert_eq!(b.read("ab/abcdef", 4, 8, &mut got).unwrap(), Some(12));
        assert_eq!((&got.header[..], &got.payload[..]), (&b"head"[..], &b"payload!"[..]));
        let mut other = Collect::default();
        assert_eq!(b.read("ab/abcdef", 4, 9, &mut other).unwrap(), Some(12), "a size mismatch reports the size");
        assert!(other.header.is_empty() && other.payload.is_empty(), "and reads nothing");
        assert_eq!(b.read("cd/cdef", 4, 8, &mut got).unwrap(), None);
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
