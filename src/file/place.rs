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

    /// Removes `name` from the folder if it still names `file` itself (a symbolic link
    /// to it is another file); `shown` is its path for the log.
    pub(super) fn remove(&self, name: &CStr, file: &File, shown: &Path) {
        match self.unlink_if_names(name, file) {
            Ok(true) => {}
            Ok(false) => log::info!("{} now names another file; left in place", shown.display()),
            Err(e) => log::warn!("could not remove {}: {e}", shown.display()),
        }
    }

    /// Unlinks `name` if it names `file` itself; whether it did.
    pub(super) fn unlink_if_names(&self, name: &CStr, file: &File) -> std::io::Result<bool> {
        let m = file.metadata()?;
        // SAFETY: fstatat into a zeroed struct we own, on a NUL-terminated name.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatat(self.dir.as_raw_fd(), name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if (st.st_dev as u64, st.st_ino as u64) != (m.dev(), m.ino()) {
            return Ok(false);
        }
        // The name could be replaced between the check and here only by a rename racing
        // with this call; the check keeps every file created before it.
        if unsafe { libc::unlinkat(self.dir.as_raw_fd(), name.as_ptr(), 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(true)
    }
}

/// What `KVX_DISK_CREATE` does with a file it finds at a path.
pub(super) enum Found {
    /// A new file is put at the path, taking the old one's mode and owner (`take_over`):
    /// whatever still has the old one open reads it intact.
    Replace(std::fs::Metadata),
    /// The file is truncated in place, as the path leads to something a new file there
    /// would not stand for; it stays the caller's, kept when the layout goes.
    InPlace,
}

/// What to do with the file found at `path`, open as `file`: replaced where the path
/// names it directly, as its only name, and a new file can have its owner; otherwise
/// (a symbolic link, whose target would keep its bytes while the link turned into a file
/// beside it; a device or other special file; a file with other names, which would keep
/// the old bytes; a file of another user) truncated in place, and the log says why.
pub(super) fn found(path: &Path, file: &File) -> std::io::Result<Found> {
    let named = std::fs::symlink_metadata(path)?;
    let open = file.metadata()?;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let why = if named.file_type().is_symlink() {
        "a symbolic link"
    } else if !named.file_type().is_file() {
        "not a regular file"
    } else if (named.dev(), named.ino()) != (open.dev(), open.ino()) {
        "replaced while it was opened"
    } else if named.nlink() > 1 {
        "a file with other names (hard links)"
    } else if euid != 0 && named.uid() != euid {
        "a file of another user"
    } else {
        return Ok(Found::Replace(open));
    };
    log::info!("{}: {why}; truncated in place", path.display());
    Ok(Found::InPlace)
}

/// Whether an unlink failed for want of permission in the folder (not writable, or
/// sticky and the file another's): the file is then truncated in place instead.
pub(super) fn refused(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EACCES) | Some(libc::EPERM))
}

/// Gives `new`, put at a path in place of the file `old` describes, that file's owner
/// and mode; `shown` is the path for the log. An owner or group this process cannot
/// give is logged and left as created.
pub(super) fn take_over(new: &File, old: &std::fs::Metadata, shown: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let m = new.metadata().map_err(|e| Error::io(format_args!("stat {}", shown.display()), e))?;
    if (m.uid(), m.gid()) != (old.uid(), old.gid()) {
        // SAFETY: fchown on a descriptor we own.
        if unsafe { libc::fchown(new.as_raw_fd(), old.uid(), old.gid()) } != 0 {
            let e = std::io::Error::last_os_error();
            log::warn!("{}: could not give the new file the old one's owner {}:{} ({e})", shown.display(), old.uid(), old.gid());
        }
    }
    // After fchown, which clears set-user-ID and set-group-ID bits.
    new.set_permissions(std::fs::Permissions::from_mode(old.permissions().mode() & 0o7777))
        .map_err(|e| Error::io(format_args!("giving {} the old file's mode", shown.display()), e))
}
