//! KVX_DISK_MAPPED: a file on tmpfs moved as pinned memory. It must hold exactly the
//! bytes, in exactly the places, that the same file opened without the flag holds, be
//! refused (with the reason) where it cannot be honoured, and on hugetlbfs give its huge
//! pages back when it goes.

mod common;
use common::cases::{case, run};
use common::*;
use kvxfer::{DiskFlags, LayoutKind, Status, StorageKind};
use std::path::PathBuf;

const TMPFS_MAGIC: i64 = 0x0102_1994;

fn is_tmpfs(dir: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == TMPFS_MAGIC }
}

/// The tmpfs folder: `KVX_TEST_DIR` when it is tmpfs, else /dev/shm when that is.
fn tmpfs_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("KVX_TEST_DIR").map(PathBuf::from).filter(|d| is_tmpfs(d)).unwrap_or_else(|| "/dev/shm".into());
    is_tmpfs(&dir).then_some(dir)
}

fn tmpfs_path(tag: &str) -> PathBuf {
    tmpfs_dir().expect("listed only with tmpfs").join(format!("kvx-test-{}-{tag}", std::process::id()))
}

/// A hugetlbfs mount with free huge pages of its size: (folder, page size in KiB).
fn hugetlbfs() -> Option<(PathBuf, u64)> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts.lines().filter_map(|l| l.split_whitespace().nth(1).filter(|_| l.split_whitespace().nth(2) == Some("hugetlbfs"))).find_map(
        |dir| {
            let dir = PathBuf::from(dir);
            let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
            let mut st: libc::statfs = unsafe { std::mem::zeroed() };
            let writable = unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && libc::access(c.as_ptr(), libc::W_OK) == 0 };
            let kib = st.f_bsize as u64 >> 10;
            (writable && free_huge_pages(kib)? > 0).then_some((dir, kib))
        },
    )
}

/// Free huge pages of `kib` KiB.
fn free_huge_pages(kib: u64) -> Option<u64> {
    std::fs::read_to_string(format!("/sys/kernel/mm/hugepages/hugepages-{kib}kB/free_hugepages")).ok()?.trim().parse().ok()
}

fn main() {
    let no_hugetlbfs = hugetlbfs().is_none().then(|| {
        "no writable hugetlbfs mount with free huge pages (mount -t hugetlbfs none DIR; echo N > /proc/sys/vm/nr_hugepages)".to_string()
    });
    let no_tmpfs = tmpfs_dir().is_none().then(|| "no tmpfs here (set KVX_TEST_DIR to a tmpfs folder)".to_string());
    let test_dir_is_tmpfs = is_tmpfs(temp_path("probe").parent().unwrap())
        .then(|| "the test folder is tmpfs (set KVX_TEST_DIR to another file system)".to_string());
    run(vec![
        case("a_mapped_file_holds_what_the_same_file_opened_for_io_holds", a_mapped_file_holds_what_the_same_file_opened_for_io_holds)
            .unless(no_tmpfs.clone()),
        case("mapped_is_refused_with_checksums", mapped_is_refused_with_checksums).unless(no_tmpfs),
        case("mapped_is_refused_off_tmpfs", mapped_is_refused_off_tmpfs).unless(test_dir_is_tmpfs),
        case("mapped_layouts_on_hugetlbfs_give_their_huge_pages_back", mapped_layouts_on_hugetlbfs_give_their_huge_pages_back)
            .unless(no_hugetlbfs),
    ])
}

struct Remove(PathBuf);
impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn a_mapped_file_holds_what_the_same_file_opened_for_io_holds() {
    let path = tmpfs_path("mapped");
    let _rm = Remove(path.clone());
    let e = engine();
    // Odd regions (3 x 7 x 2 B) so blocks are padded in the file; one geometry with large
    // regions so device copies are large too.
    for c in [cfg(7, 3, 2, 3, 7, 2), cfg(5, 2, 2, 16, 4096, 2)] {
        let mapped = e.create_disk_layout(&c, &path, DiskFlags::CREATE | DiskFlags::KEEP | DiskFlags::MAPPED).unwrap();
        assert_eq!(mapped.kind(), StorageKind::Pinned, "a mapped file moves as pinned memory");
        let plain = e.create_disk_layout(&c, &path, DiskFlags::BUFFERED).unwrap();
        let dev = make_layout(&e, &c, LayoutKind::LayerSeparate { block_first: true }, StorageKind::Device);
        let host = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Host);
        let n = c.num_blocks;

        // Device -> mapped file, blocks reversed; the plain layout reads the file itself.
        fill(&dev, 1);
        fill(&plain, 2);
        let src: Vec<u64> = (0..n).collect();
        let dst: Vec<u64> = (0..n).rev().collect();
        assert_eq!(transfer(&e, &dev, &src, &mapped, &dst, &Default::default()), Status::Ok);
        let pairs: Vec<(u64, u64)> = src.iter().copied().zip(dst.iter().copied()).collect();
        check(&plain, 2, 1, &pairs, 0..c.num_layers, "device -> mapped, read through the file");

        // Written through I/O, read back through the mapping, one layer range only.
        fill(&host, 3);
        assert_eq!(transfer(&e, &host, &src, &plain, &src, &Default::default()), Status::Ok);
        fill(&dev, 4);
        let opts = kvxfer::TransferOptions { layer_begin: 1, layer_end: 2, ..Default::default() };
        let ids = [0, n - 1];
        assert_eq!(transfer(&e, &mapped, &ids, &dev, &ids, &opts), Status::Ok);
        let same: Vec<(u64, u64)> = ids.iter().map(|&b| (b, b)).collect();
        check(&dev, 4, 3, &same, 1..2, "file -> mapped -> device, layer 1");

        // Mapped -> another file through the bounce slots, and back to host memory.
        let other = e.create_disk_layout(&c, &temp_path("copy"), DiskFlags::CREATE).unwrap();
        assert_eq!(transfer(&e, &mapped, &src, &other, &src, &Default::default()), Status::Ok);
        fill(&host, 5);
        assert_eq!(transfer(&e, &other, &src, &host, &src, &Default::default()), Status::Ok);
        let all: Vec<(u64, u64)> = src.iter().map(|&b| (b, b)).collect();
        check(&host, 5, 3, &all, 0..c.num_layers, "mapped -> disk -> host");
    }
}

fn mapped_is_refused_with_checksums() {
    let e = engine();
    let path = tmpfs_path("refused");
    let _rm = Remove(path.clone());
    let err =
        e.create_disk_layout(&cfg(4, 2, 2, 16, 128, 2), &path, DiskFlags::CREATE | DiskFlags::MAPPED | DiskFlags::CHECKSUM).unwrap_err();
    assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
    assert!(err.message.contains("KVX_DISK_CHECKSUM"), "{}", err.message);
}

fn mapped_is_refused_off_tmpfs() {
    let e = engine();
    let path = temp_path("mapped-off-tmpfs");
    let err = e.create_disk_layout(&cfg(4, 2, 2, 16, 128, 2), &path, DiskFlags::CREATE | DiskFlags::MAPPED).unwrap_err();
    assert_eq!(err.status, Status::Unsupported, "{}", err.message);
    assert!(err.message.contains("tmpfs") && err.message.contains("drop KVX_DISK_MAPPED"), "{}", err.message);
    assert!(!path.exists(), "a refused layout leaves no file behind");
}

/// A mapped layout of 36 KiB (3 blocks of 12 KiB) takes one huge page of hugetlbfs;
/// created and destroyed 100 times, it gives each back: the mapping is unmapped whole,
/// though the layout is no multiple of the huge page.
fn mapped_layouts_on_hugetlbfs_give_their_huge_pages_back() {
    let (dir, kib) = hugetlbfs().expect("listed only with hugetlbfs");
    let e = engine();
    let path = dir.join(format!("kvx-test-{}-huge", std::process::id()));
    let _rm = Remove(path.clone());
    let c = cfg(3, 3, 1, 1, 4096, 1);
    let free = || free_huge_pages(kib).unwrap();
    let before = free();
    for i in 0..100 {
        let l = e
            .create_disk_layout(&c, &path, DiskFlags::CREATE | DiskFlags::MAPPED)
            .unwrap_or_else(|err| panic!("layout {i}: {} ({} of {before} huge pages free)", err.message, free()));
        assert_eq!(l.placement.base_bytes(), 36 << 10);
        drop(l);
    }
    assert_eq!(free(), before, "huge pages free after 100 mapped layouts came and went");
}
