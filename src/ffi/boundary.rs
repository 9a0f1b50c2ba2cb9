//! What every exported function goes through: one `catch_unwind` per body, the calling
//! thread's last error (libgit2 style), NULL checks and versioned struct reads.

use super::types::*;
use crate::error::{Error, Result, Status};
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// Depth of kvx calls on this thread, so our panic hook knows a panic is ours.
    static IN_KVX: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Records `msg` as this thread's last error.
pub fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// This thread's last error; valid until this thread's next failing kvx call.
pub fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Panics inside kvx calls are reported through `log` and the status code instead of the
/// default hook's stderr print; other panics keep the host's hook.
fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if IN_KVX.with(|d| d.get()) > 0 {
                log::error!("internal error: {info}");
            } else {
                previous(info);
            }
        }));
    });
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Runs `f` behind the panic boundary; a result or panic becomes a status code.
pub fn guard<T>(f: impl FnOnce() -> Result<T>, on_ok: impl FnOnce(T)) -> kvx_status {
    install_panic_hook();
    IN_KVX.with(|d| d.set(d.get() + 1));
    // Writing the outputs is part of the call, inside the boundary like the body.
    let r = catch_unwind(AssertUnwindSafe(|| f().map(on_ok)));
    IN_KVX.with(|d| d.set(d.get() - 1));
    match r {
        Ok(Ok(())) => KVX_OK,
        Ok(Err(e)) => fail(&e),
        Err(p) => {
            fail(&Error::new(Status::Internal, format!("internal error: {}; this is a kvxfer bug, please report it", panic_message(&*p))))
        }
    }
}

/// `guard` for functions that only report a status.
pub fn status(f: impl FnOnce() -> Result<()>) -> kvx_status {
    guard(f, |()| {})
}

/// Runs a function that cannot report failure (destroy, getters), swallowing a panic
/// (logged by the hook) and returning `fallback` then.
pub fn infallible<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    install_panic_hook();
    IN_KVX.with(|d| d.set(d.get() + 1));
    let r = catch_unwind(AssertUnwindSafe(f));
    IN_KVX.with(|d| d.set(d.get() - 1));
    r.unwrap_or(fallback)
}

pub fn fail(e: &Error) -> kvx_status {
    set_last_error(&e.message);
    e.status.code()
}

pub fn null(name: &str) -> Error {
    Error::new(Status::InvalidArg, format!("{name} is NULL"))
}

/// A reference from a pointer that must not be NULL.
///
/// # Safety
/// A non-NULL `p` must point to a live `T`.
pub unsafe fn non_null<'a, T>(p: *const T, name: &str) -> Result<&'a T> {
    p.as_ref().ok_or_else(|| null(name))
}

/// A slice from a C array; `len` 0 gives an empty slice even for NULL. A `len` whose
/// array would span more than `isize::MAX` bytes cannot describe real memory (Rust may
/// not even form such a slice), so it is refused before anything is read.
///
/// # Safety
/// A non-NULL `p` must point to `len` readable `T`s.
pub unsafe fn slice<'a, T>(p: *const T, len: usize, name: &str) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(null(name));
    }
    if len > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        crate::error::bail!(InvalidArg, "{name}: a count of {len} is larger than any array can be; pass the array's length");
    }
    Ok(std::slice::from_raw_parts(p, len))
}

/// Writes `values[i]` to `out[i]`: the caller gave room for as many.
///
/// # Safety
/// `out` is non-NULL and holds `values.len()` elements.
pub unsafe fn write_all<T>(out: *mut T, values: impl IntoIterator<Item = T>) {
    for (i, v) in values.into_iter().enumerate() {
        out.add(i).write(v);
    }
}

/// A versioned struct whose first field is `struct_size`.
pub trait Versioned: Copy {
    /// Name in messages.
    const NAME: &'static str;
    /// `sizeof` in the ABI minor that added the struct: callers may pass this or more,
    /// never less.
    const V1_SIZE: usize;
    /// The `_init` defaults; fields the caller's older struct lacks keep these values.
    fn defaults() -> Self;
}

/// The caller's `struct_size`, read through the raw pointer: no `&T` is ever formed
/// over a caller's struct, which may be smaller than `T` (an older caller's).
///
/// # Safety
/// A non-NULL `p` must point to at least 4 readable bytes.
unsafe fn struct_size<T: Versioned>(p: *const T) -> Result<usize> {
    if p.is_null() {
        return Err(null(T::NAME));
    }
    let size = std::ptr::read_unaligned(p as *const u32) as usize;
    if size < T::V1_SIZE {
        crate::error::bail!(
            InvalidArg,
            "{}.struct_size is {size}, smaller than the {} bytes of its first ABI version; call {}_init first",
            T::NAME,
            T::V1_SIZE,
            T::NAME
        );
    }
    Ok(size)
}

/// Reads a caller's struct of any size ≥ `V1_SIZE`: the bytes it has, defaults for the rest.
///
/// # Safety
/// A non-NULL `p` must point to at least `struct_size` readable bytes.
pub unsafe fn read_versioned<T: Versioned>(p: *const T) -> Result<T> {
    let n = struct_size(p)?.min(std::mem::size_of::<T>());
    let mut out = T::defaults();
    std::ptr::copy_nonoverlapping(p as *const u8, &mut out as *mut T as *mut u8, n);
    Ok(out)
}

/// Writes our struct into a caller's of size `struct_size` (read from `dst`): only the
/// bytes both know; `struct_size` becomes the number of bytes written.
///
/// # Safety
/// A non-NULL `dst` must point to at least its `struct_size` writable bytes.
pub unsafe fn write_versioned<T: Versioned>(dst: *mut T, mut value: T) -> Result<()> {
    let n = struct_size(dst as *const T)?.min(std::mem::size_of::<T>());
    *(&mut value as *mut T as *mut u32) = n as u32;
    std::ptr::copy_nonoverlapping(&value as *const T as *const u8, dst as *mut u8, n);
    Ok(())
}

/// Writes `*out = v` for an output pointer checked non-NULL up front.
pub struct Out<T>(*mut T);

impl<T> Out<T> {
    /// # Safety
    /// A non-NULL `p` must be valid for a write of `T`.
    pub unsafe fn new(p: *mut T, name: &str) -> Result<Out<T>> {
        if p.is_null() {
            return Err(null(name));
        }
        Ok(Out(p))
    }

    pub fn write(self, v: T) {
        // SAFETY: checked non-NULL in `new`; the caller vouched for validity.
        unsafe { self.0.write(v) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An ABI 1.0 caller's struct is smaller than ours. Reading and writing it may touch
    /// only its own bytes and must never form a reference to a whole `T` over them
    /// (undefined behaviour even when no byte past them is read): `make miri` runs this
    /// test under Miri, which reports both.
    #[test]
    fn a_smaller_struct_is_read_and_written_within_its_own_bytes() {
        let v1 = kvx_transfer_options::V1_SIZE;
        assert!(v1 < std::mem::size_of::<kvx_transfer_options>());
        let mut mem = vec![0u64; v1 / 8]; // exactly the caller's bytes, 8-aligned
        let p = mem.as_mut_ptr() as *mut u32;
        // SAFETY: both writes lie inside `mem`: struct_size, then layer_begin.
        unsafe {
            p.write(v1 as u32);
            p.add(1).write(3);
        }
        let got = unsafe { read_versioned(p as *const kvx_transfer_options) }.unwrap();
        assert_eq!(got.layer_begin, 3);
        assert!(got.wait_event.is_null(), "fields past the caller's struct keep their defaults");

        let v1 = kvx_stats::V1_SIZE;
        let mut mem = vec![0u64; v1 / 8];
        mem[0] = v1 as u64; // struct_size (little-endian low half), padding zero
        let stats = kvx_stats { requests_completed: 5, disk_read_ns: 9, ..kvx_stats::defaults() };
        unsafe { write_versioned(mem.as_mut_ptr() as *mut kvx_stats, stats) }.unwrap();
        // SAFETY: struct_size, initialised; the padding after it is not, so not read.
        let size = unsafe { (mem.as_ptr() as *const u32).read() };
        assert_eq!(size as usize, v1, "struct_size says how much was written");
        assert_eq!(mem[1], 5);
    }

    /// A count from C larger than any array is refused without forming the slice (whose
    /// very existence would be undefined behaviour: `make miri` runs this under Miri).
    #[test]
    fn a_count_no_array_can_have_is_refused_before_the_array_is_read() {
        let ids = [1u64, 2];
        for len in [usize::MAX, usize::MAX / 4, isize::MAX as usize / 8 + 1] {
            let err = unsafe { slice(ids.as_ptr(), len, "src_blocks") }.unwrap_err();
            assert_eq!(err.status, Status::InvalidArg, "{len}");
            assert!(err.message.contains("src_blocks"), "{}", err.message);
        }
        assert_eq!(unsafe { slice(ids.as_ptr(), 2, "src_blocks") }.unwrap(), &ids);
    }

    /// Writing a call's outputs is part of the call: a panic there is a status too, never
    /// an unwind out of an `extern "C"` function (which aborts the host).
    #[test]
    fn a_panic_while_writing_outputs_is_an_internal_error() {
        let s = guard(|| Ok(7), |_| panic!("the output could not be written"));
        assert_eq!(s, KVX_ERR_INTERNAL);
        let msg = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) }.to_string_lossy().into_owned();
        assert!(msg.contains("the output could not be written"), "{msg}");
    }
}
