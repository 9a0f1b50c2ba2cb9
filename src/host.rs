//! Page-aligned anonymous host memory (mmap): engine-owned host layouts, the emulated
//! device's memory and, without a CUDA driver, bounce slots. Page alignment is what
//! `O_DIRECT` needs, and the kernel zero-fills it, so no stale bytes ever leak.

use crate::error::{bail, Error, Result};

pub fn map_anonymous(bytes: u64) -> Result<*mut u8> {
    if bytes == 0 {
        bail!(InvalidArg, "cannot allocate 0 bytes");
    }
    let len = usize::try_from(bytes).map_err(|_| Error::new(crate::error::Status::NoMemory, "allocation too large"))?;
    // SAFETY: an anonymous private mapping has no preconditions.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if p == libc::MAP_FAILED {
        return Err(Error::io(format_args!("allocating {bytes} bytes of host memory"), std::io::Error::last_os_error()));
    }
    Ok(p as *mut u8)
}

/// # Safety
/// `ptr`/`bytes` must be exactly a live mapping from `map_anonymous`.
pub unsafe fn unmap(ptr: *mut u8, bytes: u64) {
    let rc = libc::munmap(ptr as *mut libc::c_void, bytes as usize);
    debug_assert_eq!(rc, 0, "munmap failed");
}

/// Writes one byte per page so later timed copies do not pay first-touch faults.
///
/// # Safety
/// `[ptr, ptr + bytes)` must be writable memory not used by anyone else.
pub unsafe fn prefault(ptr: *mut u8, bytes: u64) {
    let mut off = 0u64;
    while off < bytes {
        std::ptr::write_volatile(ptr.add(off as usize), 0);
        off += 4096;
    }
}
