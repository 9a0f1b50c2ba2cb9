//! `KVX_DISK_MAPPED`: a disk file on tmpfs or hugetlbfs mapped into the process and
//! page-locked for the device, so its blocks move by DMA straight between the file's
//! pages and device memory: one pass over host memory instead of three (page cache to
//! bounce slot, slot to device), which is what caps a hot file through the slots.
//!
//! Only memory-backed file systems qualify: a device writes into pinned pages behind the
//! page tables' back, so a file system that tracks dirty pages for writeback (ext4, XFS)
//! would not know to write them (recent kernels refuse writable long-term pins of such
//! pages for that reason).

use super::disk::DiskFile;
use crate::error::{bail, Error, Result, Status};
use crate::gpu::Gpu;
use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const TMPFS_MAGIC: i64 = 0x0102_1994;
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// The whole file mapped shared and registered with the device while the layout lives.
pub struct Mapping {
    gpu: Arc<dyn Gpu>,
    addr: u64,
    /// Bytes mapped: the layout's, rounded up to the file system's block (a huge page
    /// on hugetlbfs), as hugetlbfs unmaps only whole huge pages.
    len: u64,
    path: PathBuf,
}

/// The file system's block size for the file open as `fd` (`statfs` `f_bsize`).
fn block_size(fd: libc::c_int) -> std::io::Result<u64> {
    // SAFETY: fstatfs into a zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstatfs(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bsize as u64)
}

/// Unmaps `len` bytes at `addr`; a failure (which leaves the mapping and its pages in
/// place) is logged.
///
/// # Safety
/// Nothing may use the mapping any more.
unsafe fn unmap(addr: u64, len: u64, path: &Path) {
    if libc::munmap(addr as *mut libc::c_void, len as usize) != 0 {
        log::error!(
            "unmapping {len} bytes of {}: {}; its pages stay until the process exits",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
}

impl Mapping {
    /// Refuses a `path` whose folder is not on tmpfs or hugetlbfs, before any file is
    /// created there.
    pub fn check_file_system(path: &Path) -> Result<()> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let c = CString::new(dir.as_os_str().as_bytes()).map_err(|_| Error::new(Status::InvalidArg, "disk path contains a NUL byte"))?;
        // SAFETY: a NUL-terminated path and a zeroed out-struct.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
            return Err(Error::io(format_args!("statfs {}", dir.display()), std::io::Error::last_os_error()));
        }
        if !matches!(st.f_type as i64, TMPFS_MAGIC | HUGETLBFS_MAGIC) {
            bail!(
                Unsupported,
                "KVX_DISK_MAPPED needs {} on tmpfs or hugetlbfs (e.g. /dev/shm): on this file system the device's writes to pinned pages would not be written back; drop KVX_DISK_MAPPED to move it through the bounce slots",
                path.display()
            );
        }
        Ok(())
    }

    /// Maps the first `bytes` of `file` (already sized) and page-locks them.
    pub fn new(gpu: &Arc<dyn Gpu>, file: &DiskFile, bytes: u64) -> Result<Mapping> {
        let shown = file.path().display();
        let fd = file.buffered_fd().as_raw_fd();
        let block = block_size(fd).map_err(|e| Error::io(format_args!("statfs {shown}"), e))?;
        let len = bytes.div_ceil(block.max(1)) * block.max(1);
        // SAFETY: a new shared mapping of `len` bytes of an open file; checked below.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::io(format_args!("mapping {len} bytes of {shown}"), std::io::Error::last_os_error()));
        }
        let addr = p as u64;
        if let Err(e) = gpu.register_host(addr, bytes) {
            // SAFETY: the mapping made above, not yet shared with anyone.
            unsafe { unmap(addr, len, file.path()) };
            return Err(Error::new(e.status, format!("{shown}: {}", e.message)));
        }
        Ok(Mapping { gpu: gpu.clone(), addr, len, path: file.path().to_path_buf() })
    }

    /// The mapping as a layout's one base.
    pub fn bases(&self) -> &[u64] {
        std::slice::from_ref(&self.addr)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the layout (and so every request using it) is gone: no copy uses it.
        unsafe {
            self.gpu.unregister_host(self.addr);
            unmap(self.addr, self.len, &self.path);
        }
    }
}
