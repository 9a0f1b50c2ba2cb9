//! Loading the CUDA driver at run time and turning its results into our errors.
//!
//! Every call below exists in the CUDA 12.0 driver and later, 13.x included; cudarc
//! resolves each symbol on first use, so we only call what we checked is there.

use crate::error::{Error, Result, Status};
pub use cudarc::driver::sys;
use sys::CUresult;

/// Whether libcuda can be loaded (never panics, unlike the first driver call without it).
pub fn present() -> bool {
    // SAFETY: only tries to dlopen the library candidates.
    unsafe { sys::is_culib_present() }
}

/// `Ok` for `CUDA_SUCCESS`, else a `KVX_ERR_CUDA` error naming the call.
pub fn check(r: CUresult, call: &str) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut s: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a static string pointer or leaves NULL.
    unsafe { sys::cuGetErrorString(r, &mut s) };
    let text = if s.is_null() { String::new() } else { unsafe { std::ffi::CStr::from_ptr(s) }.to_string_lossy().into_owned() };
    Err(Error::new(Status::Cuda, format!("{call} failed: {r:?} ({text})")))
}

/// "13.0" for the loaded driver, or `None` without one.
pub fn driver_version() -> Option<String> {
    if !present() {
        return None;
    }
    let mut v = 0i32;
    // SAFETY: plain query; the library is present.
    let r = unsafe { sys::cuDriverGetVersion(&mut v) };
    (r == CUresult::CUDA_SUCCESS).then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
}
