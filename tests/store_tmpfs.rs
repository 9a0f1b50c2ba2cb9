//! The store on a real full file system: a small tmpfs, mounted by the test, holding a
//! store whose data files are sparse and larger than it. Mounting needs root (or
//! CAP_SYS_ADMIN); where it is not permitted the test is reported skipped.

mod common;
use common::cases::{case, run};
use common::*;
use kvxfer::store::{Store, StoreConfig, StoreFlags, StoreRequest};
use kvxfer::{Engine, LayoutConfig, LayoutKind, Status, StorageKind};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

fn main() {
    let why_not = Tmpfs::mount(64 << 10).err().map(|e| format!("mounting a tmpfs is not permitted here ({e})"));
    run(vec![case(
        "a_full_tmpfs_fails_the_puts_that_find_no_room_alone_and_the_store_goes_on",
        a_full_tmpfs_fails_the_puts_that_find_no_room_alone_and_the_store_goes_on,
    )
    .unless(why_not)])
}

/// A tmpfs of a given size on a fresh directory, unmounted and removed when dropped
/// (also when the test fails).
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    fn mount(bytes: u64) -> std::io::Result<Tmpfs> {
        let dir = temp_path("tmpfs");
        std::fs::create_dir_all(&dir)?;
        let target = CString::new(dir.as_os_str().as_bytes()).unwrap();
        let data = CString::new(format!("size={bytes},mode=0700")).unwrap();
        // SAFETY: NUL-terminated strings that outlive the call.
        let r = unsafe {
            libc::mount(c"tmpfs".as_ptr(), target.as_ptr(), c"tmpfs".as_ptr(), libc::MS_NOSUID | libc::MS_NODEV, data.as_ptr() as *const _)
        };
        if r != 0 {
            let err = std::io::Error::last_os_error();
            let _ = std::fs::remove_dir(&dir);
            return Err(err);
        }
        Ok(Tmpfs { dir })
    }

    /// Bytes a write may still allocate.
    fn free_bytes(&self) -> u64 {
        let path = CString::new(self.dir.as_os_str().as_bytes()).unwrap();
        // SAFETY: a zeroed statvfs filled by the call.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut s) }, 0, "statvfs");
        s.f_bavail * s.f_frsize
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let target = CString::new(self.dir.as_os_str().as_bytes()).unwrap();
        // Detached: files a failed test still holds open do not keep it mounted.
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Copies `from` to `to` writing only the 4 KiB pages that hold a nonzero byte, so what
/// is zero stays a hole (a tmpfs allocates a page for every byte written, zeros too);
/// `dense` copies every page.
fn copy(from: &Path, to: &Path, dense: bool) {
    let data = std::fs::read(from).unwrap();
    let out = std::fs::File::create(to).unwrap();
    for (i, page) in data.chunks(4096).enumerate() {
        if dense || page.iter().any(|&b| b != 0) {
            out.write_all_at(page, i as u64 * 4096).unwrap();
        }
    }
    out.set_len(data.len() as u64).unwrap();
}

fn key(i: u64) -> Vec<u8> {
    format!("key-{i}").into_bytes()
}

/// One block: 2 layers × K/V × 16 tokens × 128 elements × 2 bytes: four 4 KiB pages.
fn block(num_blocks: u64) -> LayoutConfig {
    cfg(num_blocks, 2, 2, 16, 128, 2)
}

const BLOCK_BYTES: u64 = 16 << 10;

fn wait(r: &StoreRequest) -> Status {
    r.wait(Some(Duration::from_secs(60)))
}

fn statuses(r: &StoreRequest) -> Vec<Status> {
    (0..r.len()).map(|i| r.key_status(i).unwrap()).collect()
}

/// Puts `keys` from a host layout holding each key's bytes: each key's status and message.
fn put(e: &Engine, s: &Store, keys: &[Vec<u8>]) -> Vec<(Status, String)> {
    let src = e.create_layout(&block(keys.len() as u64), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    for (i, k) in keys.iter().enumerate() {
        fill_block_for_key(&src, i as u64, k);
    }
    let ids: Vec<u64> = (0..keys.len() as u64).collect();
    let r = s.put(&src, &ids, keys, &Default::default()).unwrap();
    wait(&r);
    (0..keys.len()).map(|i| (r.key_status(i).unwrap(), r.key_message(i))).collect()
}

/// Gets `keys`: each key's status, and whether each hit holds exactly its key's bytes.
fn get_exact(e: &Engine, s: &Store, keys: &[Vec<u8>]) -> Vec<Status> {
    let dst = e.create_layout(&block(keys.len() as u64), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    fill(&dst, 99);
    let ids: Vec<u64> = (0..keys.len() as u64).collect();
    let r = s.get(keys, &dst, &ids, &Default::default()).unwrap();
    wait(&r);
    let st = statuses(&r);
    for (i, k) in keys.iter().enumerate() {
        if st[i] == Status::Ok {
            assert!(holds_key(&dst, i as u64, k), "key {} loaded with bytes that are not its own", String::from_utf8_lossy(k));
        }
    }
    st
}

/// The store is made in an ordinary directory (its data files reserved there), then
/// copied into a tmpfs with its data files sparse, so they are 1 MiB of holes on a file
/// system with room for a few blocks: writes into them meet a real ENOSPC. The puts that
/// find no room fail alone with `Io` naming it; the batch's other keys and the earlier
/// entries load byte-exact; once space is freed the failed keys are put again, also over
/// removed entries' slots, and everything survives a reopen.
fn a_full_tmpfs_fails_the_puts_that_find_no_room_alone_and_the_store_goes_on() {
    let e = Arc::new(engine());
    let made = temp_dir("store-made");
    let c = StoreConfig { shards: 2, flags: StoreFlags::CREATE | StoreFlags::BUFFERED, ..StoreConfig::new(block(0), 64, b"ns") };
    drop(Store::open(&e, &made, &c).unwrap());
    let fs = Tmpfs::mount(2 << 20).unwrap();
    let dir = fs.dir.join("store");
    std::fs::create_dir(&dir).unwrap();
    let mut data_bytes = 0;
    for f in std::fs::read_dir(&made).unwrap() {
        let f = f.unwrap();
        let name = f.file_name();
        let is_data = name.to_string_lossy().starts_with("data-") && !name.to_string_lossy().ends_with(".kvxsum");
        if is_data {
            data_bytes += f.metadata().unwrap().len();
        }
        // The records file stays fully allocated, as the store makes it: record writes
        // never meet a full disk.
        copy(&f.path(), &dir.join(&name), name == "records");
    }
    std::fs::remove_dir_all(&made).unwrap();
    assert_eq!(data_bytes, 64 * BLOCK_BYTES);
    // Leave room for eight blocks (and a few pages of checksums); a ballast file takes the rest.
    let room = 8 * BLOCK_BYTES;
    let free = fs.free_bytes();
    assert!(free > room, "the copied store left {free} bytes free");
    let ballast = fs.dir.join("ballast");
    std::fs::write(&ballast, vec![1u8; (free - room) as usize]).unwrap();
    assert!(fs.free_bytes() <= room && fs.free_bytes() < data_bytes, "the data files outgrow the tmpfs");

    let s = Store::open(&e, &dir, &StoreConfig { flags: StoreFlags::BUFFERED, ..c.clone() }).unwrap();
    let earlier: Vec<Vec<u8>> = (0..2).map(key).collect();
    assert_eq!(put(&e, &s, &earlier).into_iter().map(|p| p.0).collect::<Vec<_>>(), vec![Status::Ok; 2], "two blocks fit");
    // Sixteen blocks into the room left for about five.
    let batch: Vec<Vec<u8>> = (10..26).map(key).collect();
    let outcome = put(&e, &s, &batch);
    let mut failed = Vec::new();
    for (k, (st, msg)) in batch.iter().zip(&outcome) {
        match st {
            Status::Ok => {}
            Status::Io => {
                assert!(msg.contains("No space left"), "{}: {msg}", String::from_utf8_lossy(k));
                failed.push(k.clone());
            }
            other => panic!("{}: {other:?} {msg}", String::from_utf8_lossy(k)),
        }
    }
    let stored: Vec<Vec<u8>> = batch.iter().filter(|k| !failed.contains(k)).cloned().collect();
    eprintln!("{} of 16 keys stored, {} failed with ENOSPC", stored.len(), failed.len());
    assert!(!failed.is_empty(), "sixteen blocks found room for about five");
    assert!(!stored.is_empty(), "the keys whose blocks found room are stored: {outcome:?}");
    assert_eq!(s.stats().entries, 2 + stored.len() as u64);
    // The failed keys are misses; every other key loads byte-exact.
    assert!(s.lookup(&failed, false).unwrap().0.iter().all(|&p| !p), "a failed put left an entry");
    assert_eq!(get_exact(&e, &s, &earlier), vec![Status::Ok; 2], "the earlier entries");
    assert_eq!(get_exact(&e, &s, &stored), vec![Status::Ok; stored.len()], "the batch's stored keys");
    assert_eq!(get_exact(&e, &s, &failed), vec![Status::NotFound; failed.len()]);
    assert_eq!(s.stats().integrity_failures, 0);

    // Space freed: the failed keys are put again, also into removed entries' slots.
    std::fs::remove_file(&ballast).unwrap();
    assert_eq!(s.remove(&earlier).unwrap(), vec![Status::Ok; 2]);
    assert_eq!(put(&e, &s, &failed).into_iter().map(|p| p.0).collect::<Vec<_>>(), vec![Status::Ok; failed.len()]);
    assert_eq!(put(&e, &s, &earlier).into_iter().map(|p| p.0).collect::<Vec<_>>(), vec![Status::Ok; 2]);
    let all: Vec<Vec<u8>> = [earlier, batch].concat();
    assert_eq!(get_exact(&e, &s, &all), vec![Status::Ok; all.len()]);
    drop(s);
    let s = Store::open(&e, &dir, &StoreConfig { flags: StoreFlags::BUFFERED, ..c }).unwrap();
    assert_eq!(s.stats().entries, all.len() as u64);
    assert_eq!(get_exact(&e, &s, &all), vec![Status::Ok; all.len()], "after a reopen");
    drop(s);
    drop(fs);
}
