//! Page-cache reads that the device reads next: `pread` into a small buffer of the
//! thread's own, which stays in its cache, then non-temporal stores into the slot.
//!
//! A plain `pread` of a hot file leaves the slot's lines modified in the reading core's
//! cache, and the device's DMA then reads them at about half its rate
//! (`cpp_examples/probes/dirty_dma.cu` measures it). Streaming stores put the lines in
//! memory instead. The extra copy runs out of the core's cache, so the read costs about
//! what the plain one did. In the engine it pays only while the copy follows the read at
//! once (`Router::stream_read`); streaming every read slows big batches, whose slots wait
//! for their copy in the last-level cache
//! (`docs/decisions.md#streaming-every-page-cache-read`).

use super::posix;
use crate::error::Result;
use std::os::fd::BorrowedFd;

/// The staging buffer: small enough to stay in a core's L2 between the `pread` that
/// fills it and the stores that empty it.
const STAGE: usize = 64 << 10;

#[repr(C, align(64))]
struct Stage([u8; STAGE]);

thread_local! {
    static BUF: std::cell::RefCell<Box<Stage>> = std::cell::RefCell::new(Box::new(Stage([0; STAGE])));
}

/// Reads exactly `len` bytes at `offset` into `buf` (slot memory), leaving none of its
/// lines modified in this core's cache (on x86-64; elsewhere a plain `pread`).
///
/// # Safety
/// `buf` must be valid for `len` bytes of writes.
pub unsafe fn read_exact_at(fd: BorrowedFd<'_>, buf: *mut u8, len: u64, offset: u64) -> Result<()> {
    if !cfg!(target_arch = "x86_64") {
        return posix::read_exact_at(fd, buf, len, offset);
    }
    BUF.with_borrow_mut(|stage| {
        let mut done = 0u64;
        let result = loop {
            if done == len {
                break Ok(());
            }
            let n = (len - done).min(STAGE as u64);
            if let Err(e) = posix::read_exact_at(fd, stage.0.as_mut_ptr(), n, offset + done) {
                break Err(e);
            }
            stream_copy(buf.add(done as usize), stage.0.as_ptr(), n as usize);
            done += n;
        };
        // Streaming stores are weakly ordered: make them visible before the slot is
        // handed on (to the copy thread, then the device).
        fence();
        result
    })
}

/// Copies `len` bytes, the 16-byte-aligned middle of `dst` by streaming stores.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let head = dst.align_offset(16).min(len);
    std::ptr::copy_nonoverlapping(src, dst, head);
    let mut at = head;
    while at + 64 <= len {
        // SSE2 is part of x86-64, so no feature check; 16-byte stores fill whole lines.
        for k in (0..64).step_by(16) {
            let v = _mm_loadu_si128(src.add(at + k) as *const __m128i);
            _mm_stream_si128(dst.add(at + k) as *mut __m128i, v);
        }
        at += 64;
    }
    std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at);
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, len: usize) {
    std::ptr::copy_nonoverlapping(src, dst, len);
}

fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    #[test]
    fn every_byte_lands_at_any_alignment_and_length() {
        let data: Vec<u8> = (0..3 * STAGE + 12_345).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut f = tempfile_in_tmp();
        f.write_all(&data).unwrap();
        let mut out = vec![0u8; data.len() + 64];
        for (off, at, len) in [(0, 0, data.len()), (1, 3, 100), (4096, 5, 2 * STAGE + 17), (77, 16, STAGE), (9, 1, 63), (0, 0, 0)] {
            out.fill(0xee);
            // SAFETY: `out` holds `at + len` bytes.
            unsafe { read_exact_at(f.as_fd(), out.as_mut_ptr().add(at), len as u64, off as u64) }.unwrap();
            assert_eq!(&out[at..at + len], &data[off..off + len], "offset {off}, at {at}, len {len}");
            assert!(out[..at].iter().chain(&out[at + len..]).all(|&b| b == 0xee), "wrote outside: offset {off}, at {at}, len {len}");
        }
    }

    #[test]
    fn a_read_past_the_end_fails_and_says_so() {
        let mut f = tempfile_in_tmp();
        f.write_all(&[1u8; 1000]).unwrap();
        let mut out = vec![0u8; 4096];
        // SAFETY: `out` holds 4096 bytes.
        let e = unsafe { read_exact_at(f.as_fd(), out.as_mut_ptr(), 4096, 0) }.unwrap_err();
        assert!(e.message.contains("end of file"), "{}", e.message);
    }

    fn tempfile_in_tmp() -> std::fs::File {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "kvx-streamed-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        f
    }
}
