//! Where a file kvxfer created lives: its folder, held open, and its name there. The
//! file is removed there, and only while that name still names it: a layout's file goes
//! with the last request using the layout, by which time the caller may have created
//! another file at the same path.

use crate::error::{Error, Result, Status};
use crate::io::posix;
use std::ffi::{CStr, CString};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

#[derive(Debug)]
pub(super) struct Place {
    dir: File,
    /// Whether `dir` is open for reading, as an `fsync` of it needs; else it is open only
    /// as a path (`O_PATH`: a folder this process may write but not list).
    readable: bool,
    name: CString,
}

/// `open(2)` of `name` in `dir` (the working folder when `None`), close-on-exec.
pub(super) fn open_at(dir: Option<&File>, name: &CStr, flags: libc::c_int) -> std::io::Result<File> {
    let at = dir.map_or(libc::AT_FDCWD, |d| d.as_raw_fd());
    // SAFETY: `name` is NUL-terminated; the returned descriptor is owned by the File.
    let fd = unsafe { libc::openat(at, name.as_ptr(), flags | libc::O_CLOEXEC, 0o644 as libc::c_uint) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(unsafe { File::from_raw_fd(fd) })
}

impl Place {
    /// The folder of `path` (opened now) and the file's name in it.
    pub(super) fn of(path: &Path) -> Result<Place> {
        let nul = |_| Error::new(Status::InvalidArg, "disk path contains a NUL byte");
        let Some(name) = path.file_name() else {
            return Err(Error::new(Status::InvalidArg, format!("{} names no file; give the path of a file", path.display())));
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let cdir = CString::new(dir.as_os_str().as_bytes()).map_err(nul)?;
        // Read access, for the fsync of KVX_DISK_SYNC; without it (a folder that may be
        // written but not listed) files are still created and removed there.
        let (dir, readable) = match open_at(None, &cdir, libc::O_RDONLY | libc::O_DIRECTORY) {
            Ok(d) => (Ok(d), true),
            Err(_) => (open_at(None, &cdir, libc::O_PATH | libc::O_DIRECTORY), false),
        };
        let dir = dir.map_err(|e| Error::io(format_args!("opening the folder of {}", path.display()), e))?;
        Ok(Place { dir, readable, name: CString::new(name.as_bytes()).map_err(nul)? })
    }

    /// Makes the folder's entries durable: an `fsync` of the folder. A folder open only
    /// as a path cannot be synced (`fsync` refuses such a descriptor): that is logged,
    /// and its entries are then as durable as its file system makes them on its own;
    /// `shown` is the file's path for the message.
    pub(super) fn sync(&self, shown: &Path) -> Result<()> {
        if !self.readable {
            log::warn!(
                "the folder of {} cannot be read, so it is not synced: the new file's name may not survive a power loss (give the folder read permission)",
                shown.display()
            );
            return Ok(());
        }
        posix::sync_all(self.dir.as_fd()).map_err(|e| Error::new(e.status, format!("the folder of {}: {}", shown.display(), e.message)))
    }

    pub(super) fn dir(&self) -> &File {
        &self.dir
    }

    pub(super) fn name(&self) -> &CStr {
        &self.name
    }

    /// The name of the sidecar `suffix` beside the file.
    pub(super) fn beside(&self, suffix: &str) -> CString {
        let mut n = self.name.as_bytes().to_vec();
        n.extend_from_slice(suffix.as_bytes());
        CString::new(n).expect("no NUL in either part")
    }

    /// Removes `name` from the folder if it still names `file`; `shown` is its path for
    /// the log.
    pub(super) fn remove(&self, name: &CStr, file: &File, shown: &Path) {
        let ours = match file.metadata() {
            Ok(m) => (m.dev(), m.ino()),
            Err(e) => return log::warn!("could not remove {}: stat: {e}", shown.display()),
        };
        // SAFETY: fstatat into a zeroed struct we own, on a NUL-terminated name.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatat(self.dir.as_raw_fd(), name.as_ptr(), &mut st, 0) } != 0 {
            return log::warn!("could not remove {}: {}", shown.display(), std::io::Error::last_os_error());
        }
        if (st.st_dev as u64, st.st_ino as u64) != ours {
            return log::info!("{} now names another file; left in place", shown.display());
        }
        // The name could be replaced between the check and here only by a rename racing
        // with this drop; the check keeps every file created before the layout went.
        if unsafe { libc::unlinkat(self.dir.as_raw_fd(), name.as_ptr(), 0) } != 0 {
            log::warn!("could not remove {}: {}", shown.display(), std::io::Error::last_os_error());
        }
    }
}
