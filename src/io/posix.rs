//! Blocking positional I/O with the retries every caller needs: `EINTR` is retried and a
//! short transfer continues where it stopped, so callers see all bytes or an error.

use crate::error::{Error, Result};
use crate::fault::{self, power_cut, Fault, Site};
use std::os::fd::{AsRawFd, BorrowedFd};

/// One `pread`/`pwrite` system call, or the fault a test injected in its place: an
/// errno (returned as a failed call, so `EINTR` takes the same retry path as a real one)
/// or a short transfer.
unsafe fn syscall(site: Site, fd: BorrowedFd<'_>, buf: *mut u8, len: u64, offset: u64) -> isize {
    let len = match fault::check(site) {
        Some(Fault::Errno(e)) => {
            *libc::__errno_location() = e;
            return -1;
        }
        // Half, kept 4096-aligned as real short O_DIRECT transfers are.
        Some(Fault::Short) if len >= 8192 => (len / 2) & !4095,
        _ => len,
    } as usize;
    let (raw, off) = (fd.as_raw_fd(), offset as libc::off_t);
    match site {
        Site::DiskWrite => power_cut::write(fd, offset, len as u64, || libc::pwrite(raw, buf as *const libc::c_void, len, off)),
        _ => libc::pread(raw, buf as *mut libc::c_void, len, off),
    }
}

/// The alignment direct I/O on the file needs, as its file system reports it (statx
/// `STATX_DIOALIGN`: the larger of the file offset and memory alignments), the same on
/// any descriptor of the file, `O_DIRECT` or not; `None` where it reports none.
pub fn dio_align(fd: BorrowedFd<'_>) -> Option<u64> {
    if let Some(reported) = fault::reported_dio_align() {
        return Some(reported);
    }
    // SAFETY: statx writes into the zeroed struct we own.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statx(fd.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx) };
    (rc == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0).then(|| (stx.stx_dio_offset_align as u64).max(stx.stx_dio_mem_align as u64))
}

/// Reads exactly `len` bytes at `offset` into `buf`.
///
/// # Safety
/// `buf` must be valid for `len` bytes of writes.
pub unsafe fn read_exact_at(fd: BorrowedFd<'_>, buf: *mut u8, len: u64, offset: u64) -> Result<()> {
    let mut done = 0u64;
    while done < len {
        let n = syscall(Site::DiskRead, fd, buf.add(done as usize), len - done, offset + done);
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(Error::io(format_args!("pread of {} bytes at offset {}", len - done, offset + done), err));
        }
        if n == 0 {
            return Err(Error::new(
                crate::error::Status::Io,
                format!(
                    "pread at offset {}: unexpected end of file ({} of {len} bytes read); was the file truncated?",
                    offset + done,
                    done
                ),
            ));
        }
        done += n as u64;
    }
    Ok(())
}

/// Writes exactly `len` bytes from `buf` at `offset`.
///
/// # Safety
/// `buf` must be valid for `len` bytes of reads.
pub unsafe fn write_all_at(fd: BorrowedFd<'_>, buf: *const u8, len: u64, offset: u64) -> Result<()> {
    let mut done = 0u64;
    while done < len {
        let n = syscall(Site::DiskWrite, fd, buf.add(done as usize) as *mut u8, len - done, offset + done);
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(Error::io(format_args!("pwrite of {} bytes at offset {}", len - done, offset + done), err));
        }
        if n == 0 {
            return Err(Error::new(crate::error::Status::Io, format!("pwrite at offset {} wrote nothing", offset + done)));
        }
        done += n as u64;
    }
    Ok(())
}

/// Makes written data durable.
pub fn sync_data(fd: BorrowedFd<'_>) -> Result<()> {
    sync_with(fd, libc::fdatasync, "fdatasync")
}

/// Makes a file durable with all its metadata; for a folder, its entries.
pub fn sync_all(fd: BorrowedFd<'_>) -> Result<()> {
    sync_with(fd, libc::fsync, "fsync")
}

fn sync_with(fd: BorrowedFd<'_>, call: unsafe extern "C" fn(libc::c_int) -> libc::c_int, name: &str) -> Result<()> {
    if let Some(Fault::Errno(e)) = fault::check(Site::DiskSync) {
        return Err(Error::io(name, std::io::Error::from_raw_os_error(e)));
    }
    loop {
        // SAFETY: plain syscall on a borrowed, open descriptor.
        let synced = power_cut::sync(fd, || match unsafe { call(fd.as_raw_fd()) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        });
        match synced {
            Ok(()) => return Ok(()),
            Err(err) if err.raw_os_error() == Some(libc::EINTR) => {}
            Err(err) => return Err(Error::io(name, err)),
        }
    }
}
