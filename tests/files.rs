//! A disk layout's file: removed with its last user but never by a name that has moved
//! on to another file, its block stride fixed by the file whatever opens it, nothing
//! made or changed by a call that is refused, a created KVX_DISK_SYNC file durable as a
//! name, and a durable store's blocks durable before the records that commit them.

mod common;
use common::cases::{case, run};
use common::*;
use kvxfer::fault;
use kvxfer::file::checksum::Sidecar;
use kvxfer::store::{Reservation, Store, StoreConfig, StoreFlags};
use kvxfer::{DiskFlags, LayoutKind, Status, StorageKind};
use std::path::PathBuf;
use std::sync::Mutex;

/// Tests that make the file system report another alignment (process-wide) run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn main() {
    if let Some(path) = std::env::var_os(SYNC_CHILD) {
        return create_synced(&PathBuf::from(path));
    }
    if let Some(dir) = std::env::var_os(COMMIT_CHILD) {
        return commit_durably(&PathBuf::from(dir));
    }
    let no_strace = strace_missing();
    // Faults are injected at the reads of the POSIX and io_uring backends only.
    let no_injected_reads = matches!(test_io_backend(), kvxfer::IoBackend::Nixl | kvxfer::IoBackend::Gds)
        .then(|| "reads are held at the POSIX and io_uring backends only (KVX_TEST_IO_BACKEND=posix or uring)".to_string());
    run(vec![
        case("a_synced_files_folder_is_synced_after_it_is_created", a_synced_files_folder_is_synced_after_it_is_created)
            .unless(no_strace.clone()),
        case("a_durable_commit_makes_the_data_process_writes_durable_first", a_durable_commit_makes_the_data_process_writes_durable_first)
            .unless(no_strace),
        case("a_synced_file_is_created_in_a_folder_that_cannot_be_listed", a_synced_file_is_created_in_a_folder_that_cannot_be_listed),
        case(
            "a_removed_layouts_file_goes_only_while_its_path_still_names_it",
            a_removed_layouts_file_goes_only_while_its_path_still_names_it,
        )
        .unless(no_injected_reads),
        case("a_refused_geometry_creates_and_truncates_nothing", a_refused_geometry_creates_and_truncates_nothing),
        case("create_through_a_symbolic_link_truncates_its_target_in_place", create_through_a_symbolic_link_truncates_its_target_in_place),
        case("create_over_a_file_puts_a_new_file_with_its_mode_there", create_over_a_file_puts_a_new_file_with_its_mode_there),
        case("a_sidecar_that_does_not_record_the_padding_opens_as_before", a_sidecar_that_does_not_record_the_padding_opens_as_before),
        case(
            "a_file_padded_to_4k_without_a_record_of_it_reads_back_where_64k_is_reported",
            a_file_padded_to_4k_without_a_record_of_it_reads_back_where_64k_is_reported,
        ),
        case(
            "a_file_written_at_a_64k_alignment_reads_back_buffered_and_under_another_alignment",
            a_file_written_at_a_64k_alignment_reads_back_buffered_and_under_another_alignment,
        ),
    ])
}

/// Removes a data file and its sidecar when dropped.
struct Remove(PathBuf);
impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_file(Sidecar::path_for(&self.0));
    }
}

/// The file system's reported alignment set for as long as this lives.
struct Reported;
impl Reported {
    fn set(align: u64) -> Reported {
        fault::report_dio_align(Some(align));
        Reported
    }
}
impl Drop for Reported {
    fn drop(&mut self) {
        fault::report_dio_align(None);
    }
}

const K64: u64 = 64 << 10;

/// Reads every block of the file at `path`, opened with `flags`, into host memory and
/// checks it holds `seed`'s pattern.
fn reads_back(
    e: &kvxfer::Engine,
    c: &kvxfer::LayoutConfig,
    path: &std::path::Path,
    flags: DiskFlags,
    seed: u64,
    what: &str,
) -> kvxfer::Layout {
    let disk = e.create_disk_layout(c, path, flags).unwrap_or_else(|err| panic!("{what}: {}", err.message));
    let host = make_layout(e, c, LayoutKind::FullyContiguous, StorageKind::Host);
    fill(&host, 99);
    let ids: Vec<u64> = (0..c.num_blocks).collect();
    assert_eq!(transfer(e, &disk, &ids, &host, &ids, &Default::default()), Status::Ok, "{what}");
    let pairs: Vec<(u64, u64)> = ids.iter().map(|&b| (b, b)).collect();
    check(&host, 99, seed, &pairs, 0..c.num_layers, what);
    std::sync::Arc::try_unwrap(disk).expect("no request holds the layout")
}

/// Blocks of 8 KiB are padded to 64 KiB where the file system asks for that alignment.
/// The same file opened with KVX_DISK_BUFFERED there, or (checksummed: the sidecar
/// records the padding) where the file system reports another alignment, reads back
/// exactly; a file padded to 4 KiB opened where 64 KiB is reported does too.
fn a_file_written_at_a_64k_alignment_reads_back_buffered_and_under_another_alignment() {
    let _serial = serial();
    let e = engine_with(|c| c.slot_bytes = 4 * K64);
    let c = cfg(4, 2, 2, 16, 64, 2); // 2 KiB regions, 8 KiB blocks
    let ids: Vec<u64> = (0..4).collect();
    let host = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Host);
    let (wide, narrow) = (temp_path("wide"), temp_path("narrow"));
    let _rm = (Remove(wide.clone()), Remove(narrow.clone()));
    {
        let _at = Reported::set(K64);
        let disk = e.create_disk_layout(&c, &wide, DiskFlags::CREATE | DiskFlags::KEEP | DiskFlags::CHECKSUM).unwrap();
        assert_eq!(disk.placement.block_stride, K64, "blocks padded to the reported alignment");
        fill(&host, 1);
        assert_eq!(transfer(&e, &host, &ids, &disk, &ids, &Default::default()), Status::Ok);
        drop(disk);
        reads_back(&e, &c, &wide, DiskFlags::BUFFERED, 1, "64 KiB file, buffered");
        reads_back(&e, &c, &wide, DiskFlags::BUFFERED | DiskFlags::CHECKSUM, 1, "64 KiB file, buffered, checksummed");
    }
    {
        let _at = Reported::set(4096);
        for flags in [DiskFlags::CHECKSUM, DiskFlags::CHECKSUM | DiskFlags::BUFFERED] {
            let disk = reads_back(&e, &c, &wide, flags, 1, "64 KiB file where 4 KiB is reported");
            assert_eq!(disk.placement.block_stride, K64, "the file's padding, not the file system's");
        }
        let disk = e.create_disk_layout(&c, &narrow, DiskFlags::CREATE | DiskFlags::KEEP | DiskFlags::CHECKSUM).unwrap();
        fill(&host, 2);
        assert_eq!(transfer(&e, &host, &ids, &disk, &ids, &Default::default()), Status::Ok);
    }
    let _at = Reported::set(K64);
    let disk = reads_back(&e, &c, &narrow, DiskFlags::CHECKSUM, 2, "4 KiB file where 64 KiB is reported");
    assert_eq!(disk.placement.block_stride, 8192, "the file's padding, not the file system's");
    assert!(!disk.disk().unwrap().is_direct(), "blocks padded to 4 KiB cannot move by O_DIRECT that needs 64 KiB");
}

/// Sidecars written before the padding was recorded hold 0 there: their file is read
/// with the padding this file system asks for, as it always was.
fn a_sidecar_that_does_not_record_the_padding_opens_as_before() {
    let _serial = serial();
    let e = engine();
    let c = cfg(4, 2, 2, 16, 64, 2);
    let path = temp_path("unrecorded");
    let _rm = Remove(path.clone());
    let disk = e.create_disk_layout(&c, &path, DiskFlags::CREATE | DiskFlags::KEEP | DiskFlags::CHECKSUM).unwrap();
    let host = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Host);
    fill(&host, 3);
    let ids: Vec<u64> = (0..4).collect();
    assert_eq!(transfer(&e, &host, &ids, &disk, &ids, &Default::default()), Status::Ok);
    let stride = disk.placement.block_stride;
    drop(disk);
    let sidecar = std::fs::OpenOptions::new().write(true).open(Sidecar::path_for(&path)).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&sidecar, &[0; 8], 40).unwrap();
    let disk = reads_back(&e, &c, &path, DiskFlags::CHECKSUM, 3, "a sidecar without the padding");
    assert_eq!(disk.placement.block_stride, stride);
}

/// Files whose blocks are padded to 4 KiB with nothing recording it (written by kvxfer
/// 1.3 or older with KVX_DISK_BUFFERED, or where O_DIRECT was refused, on a file system
/// that asks for more; or unchecksummed, written where 4 KiB is reported) are opened
/// where 64 KiB is reported. The file tells its padding by its size: a checksummed one
/// with the block count its sidecar records, whatever number of blocks the layout opens;
/// an unchecksummed one when opened with the blocks it was created with.
fn a_file_padded_to_4k_without_a_record_of_it_reads_back_where_64k_is_reported() {
    let _serial = serial();
    let e = engine_with(|c| c.slot_bytes = 4 * K64);
    let (c, few) = (cfg(16, 2, 2, 16, 64, 2), cfg(2, 2, 2, 16, 64, 2)); // 8 KiB blocks
    let ids: Vec<u64> = (0..c.num_blocks).collect();
    let host = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Host);
    let (summed, plain) = (temp_path("old-summed"), temp_path("old-plain"));
    let _rm = (Remove(summed.clone()), Remove(plain.clone()));
    {
        let _at = Reported::set(4096);
        for (path, flags, seed) in [(&summed, DiskFlags::CHECKSUM, 4), (&plain, DiskFlags::NONE, 5)] {
            let disk = e.create_disk_layout(&c, path, DiskFlags::CREATE | DiskFlags::KEEP | flags).unwrap();
            assert_eq!(disk.placement.block_stride, 8192);
            fill(&host, seed);
            assert_eq!(transfer(&e, &host, &ids, &disk, &ids, &Default::default()), Status::Ok);
        }
    }
    // What a sidecar written before the padding was recorded holds there.
    let sidecar = std::fs::OpenOptions::new().write(true).open(Sidecar::path_for(&summed)).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&sidecar, &[0; 8], 40).unwrap();
    let _at = Reported::set(K64);
    for (cfg, what) in [(&few, "two of its blocks"), (&c, "all of its blocks")] {
        let disk = reads_back(&e, cfg, &summed, DiskFlags::CHECKSUM, 4, &format!("checksummed, unrecorded 4 KiB padding, {what}"));
        assert_eq!(disk.placement.block_stride, 8192, "the file's padding, told by its size");
    }
    let disk = reads_back(&e, &c, &plain, DiskFlags::NONE, 5, "unchecksummed 4 KiB padding, all of its blocks");
    assert_eq!(disk.placement.block_stride, 8192, "the file's padding, told by its size");
}

/// KVX_DISK_CREATE at a path that is a symbolic link (a tier file on another disk, say)
/// truncates the link's target in place, with its mode, as kvxfer always did: the link
/// stays, and the file stays where the link puts it. A file truncated in place is the
/// caller's: kept when the layout goes, with KVX_DISK_KEEP or without.
fn create_through_a_symbolic_link_truncates_its_target_in_place() {
    use std::os::unix::fs::PermissionsExt;
    let e = engine();
    let c = cfg(4, 2, 2, 16, 64, 2);
    let ids: Vec<u64> = (0..c.num_blocks).collect();
    let (target, link) = (temp_path("link-target"), temp_path("link"));
    let _rm = (Remove(target.clone()), Remove(link.clone()));
    std::fs::write(&target, vec![7u8; 1 << 20]).unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let host = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Host);
    for (flags, seed, what) in [(DiskFlags::CREATE | DiskFlags::KEEP, 10, "kept"), (DiskFlags::CREATE, 11, "not kept")] {
        let disk = e.create_disk_layout(&c, &link, flags).unwrap();
        let bytes = disk.placement.base_bytes();
        fill(&host, seed);
        assert_eq!(transfer(&e, &host, &ids, &disk, &ids, &Default::default()), Status::Ok);
        drop(disk);
        let named = std::fs::symlink_metadata(&link).unwrap_or_else(|err| panic!("{what}: the link is gone: {err}"));
        assert!(named.file_type().is_symlink(), "{what}: the link was replaced by a {:?}", named.file_type());
        assert_eq!(std::fs::read_link(&link).unwrap(), target, "{what}: the link points elsewhere");
        let file = std::fs::metadata(&target).unwrap_or_else(|err| panic!("{what}: the link's target is gone: {err}"));
        assert_eq!(file.len(), bytes, "{what}: the target was truncated and sized for the layout");
        assert_eq!(file.permissions().mode() & 0o7777, 0o640, "{what}: the target's mode");
        reads_back(&e, &c, &target, DiskFlags::NONE, seed, what);
    }
}

/// KVX_DISK_CREATE over a regular file puts a new file at the path (whoever still reads
/// the old one keeps it intact), with the old one's mode.
fn create_over_a_file_puts_a_new_file_with_its_mode_there() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let e = engine();
    let c = cfg(4, 2, 2, 16, 64, 2);
    let path = temp_path("moded");
    let _rm = Remove(path.clone());
    std::fs::write(&path, b"the old file").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let old = std::fs::File::open(&path).unwrap();
    drop(e.create_disk_layout(&c, &path, DiskFlags::CREATE | DiskFlags::KEEP).unwrap());
    let new = std::fs::metadata(&path).unwrap();
    assert_ne!(new.ino(), old.metadata().unwrap().ino(), "a new file at the path");
    assert_eq!(std::io::read_to_string(&old).unwrap(), "the old file", "the old file, still open, is intact");
    assert_eq!(new.permissions().mode() & 0o7777, 0o600, "the new file has the old one's mode");
}

/// A geometry the engine's slots cannot carry is refused before any file is made or
/// truncated, with KVX_DISK_CREATE | KVX_DISK_KEEP too: regions too large to hash in a
/// slot, and slots too small for the alignment the file system asks for.
fn a_refused_geometry_creates_and_truncates_nothing() {
    let _serial = serial();
    let e = engine(); // 64 KiB slots
    let flags = DiskFlags::CREATE | DiskFlags::KEEP | DiskFlags::CHECKSUM;
    let refused = |c: &kvxfer::LayoutConfig, path: &std::path::Path, what: &str| {
        let err = e.create_disk_layout(c, path, flags).expect_err(what);
        assert_eq!(err.status, Status::Unsupported, "{what}: {}", err.message);
        assert!(err.message.contains("slot_bytes"), "{what}: {}", err.message);
        assert!(!Sidecar::path_for(path).exists(), "{what}: a refused call left a sidecar");
    };
    let big_regions = cfg(2, 1, 1, 64, 1024, 2); // 128 KiB regions
    let path = temp_path("refused");
    let _rm = Remove(path.clone());
    refused(&big_regions, &path, "regions larger than a slot");
    assert!(!path.exists(), "a refused call left a file");
    std::fs::write(&path, b"the caller's bytes").unwrap();
    refused(&big_regions, &path, "regions larger than a slot, over a file");
    assert_eq!(std::fs::read(&path).unwrap(), b"the caller's bytes", "a refused call changed the file");
    std::fs::remove_file(&path).unwrap();
    // Known only once the file is open: what its file system asks for.
    let _at = Reported::set(K64);
    refused(&cfg(4, 2, 2, 16, 64, 2), &path, "slots smaller than two alignments");
    assert!(!path.exists(), "a refused call left a file");
}

/// A layout created with KVX_DISK_CREATE is destroyed while a request still reads it, and
/// a new layout is created at the same path (a rotated tier file) and written. The old
/// request reads its own file to the end; when it ends, that file goes, and the new one,
/// now at the path, stays with its bytes.
fn a_removed_layouts_file_goes_only_while_its_path_still_names_it() {
    let _serial = serial();
    let e = engine();
    let c = cfg(4, 2, 2, 16, 64, 2);
    let ids: Vec<u64> = (0..4).collect();
    let path = temp_path("rotated");
    let _rm = Remove(path.clone());
    drop(e.create_disk_layout(&c, &path, DiskFlags::CREATE | DiskFlags::CHECKSUM).unwrap());
    assert!(!path.exists() && !Sidecar::path_for(&path).exists(), "a created file goes with its layout");
    let old = e.create_disk_layout(&c, &path, DiskFlags::CREATE | DiskFlags::CHECKSUM).unwrap();
    let dev = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Device);
    fill(&dev, 6);
    assert_eq!(transfer(&e, &dev, &ids, &old, &ids, &Default::default()), Status::Ok);
    fill(&dev, 8);
    // The request's first read waits until released: it is in flight, holding `old`.
    let _injected = Injected;
    fault::inject(fault::Site::DiskRead, 0, fault::Fault::Hold);
    let reading = e.submit(&old, &ids, &dev, &ids, &Default::default()).unwrap();
    let started = std::time::Instant::now();
    while !fault::holding() && started.elapsed() < std::time::Duration::from_secs(60) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(fault::holding(), "the request never reached its first read");
    drop(old);
    let new = e.create_disk_layout(&c, &path, DiskFlags::CREATE | DiskFlags::KEEP | DiskFlags::CHECKSUM).unwrap();
    let host = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Host);
    fill(&host, 7);
    assert_eq!(transfer(&e, &host, &ids, &new, &ids, &Default::default()), Status::Ok);
    fault::clear();
    assert_eq!(reading.wait(Some(std::time::Duration::from_secs(60))), Status::Ok, "{}", reading.error_message().to_string_lossy());
    drop(reading);
    let pairs: Vec<(u64, u64)> = ids.iter().map(|&b| (b, b)).collect();
    check(&dev, 8, 6, &pairs, 0..c.num_layers, "the old layout's request read its own file");
    assert!(path.exists(), "the old layout's last request removed the new layout's file");
    assert!(Sidecar::path_for(&path).exists(), "the old layout's last request removed the new layout's sidecar");
    drop(new);
    reads_back(&e, &c, &path, DiskFlags::CHECKSUM, 7, "the new layout's file");
}

/// Injection stays on no longer than the test that turned it on, even when it fails.
struct Injected;
impl Drop for Injected {
    fn drop(&mut self) {
        fault::clear();
    }
}

/// Set in the child that `a_synced_files_folder_is_synced…` traces: the path to create.
const SYNC_CHILD: &str = "KVX_FILES_SYNC_CHILD";

/// The child's work: a checksummed KVX_DISK_SYNC layout created (and kept) at `path`.
fn create_synced(path: &std::path::Path) {
    let e = engine();
    drop(
        e.create_disk_layout(&cfg(4, 2, 2, 16, 64, 2), path, DiskFlags::CREATE | DiskFlags::KEEP | DiskFlags::SYNC | DiskFlags::CHECKSUM)
            .unwrap(),
    );
}

/// Set in the child that `a_durable_commit_makes_…` traces: the store's directory.
const COMMIT_CHILD: &str = "KVX_FILES_COMMIT_CHILD";

/// The child's work: a durable owner commits a block that a data-only open made without
/// DURABLE wrote (such an open never syncs what it writes); the opening of two marker
/// files brackets the commit in the trace.
fn commit_durably(dir: &std::path::Path) {
    let e = std::sync::Arc::new(engine());
    let owner = StoreConfig { flags: StoreFlags::CREATE | StoreFlags::DURABLE, ..StoreConfig::new(cfg(0, 2, 2, 4, 64, 2), 8, b"ns") };
    let s = Store::open(&e, dir, &owner).unwrap();
    let data = Store::open(&e, dir, &StoreConfig { flags: StoreFlags::DATA_ONLY, ..owner.clone() }).unwrap();
    let Reservation::Write(h) = s.reserve_slots(&[b"key"]).unwrap()[0] else { panic!("a slot for the key") };
    let src = make_layout(&e, &cfg(1, 2, 2, 4, 64, 2), LayoutKind::FullyContiguous, StorageKind::Host);
    fill_block_for_key(&src, 0, b"key");
    let r = data.write_slots(&src, &[0], &[h], &Default::default()).unwrap();
    assert_eq!(r.wait(Some(std::time::Duration::from_secs(60))), Status::Ok, "{}", r.key_message(0));
    std::fs::write(dir.join("commit-starts"), b"").unwrap();
    assert_eq!(s.commit_slots(&[h]).unwrap(), vec![Status::Ok]);
    std::fs::write(dir.join("commit-ended"), b"").unwrap();
}

/// A durable owner's commit acknowledges a block for good, so the block must be on the
/// disk before its record is: the commit syncs the shard the data process wrote (data
/// and checksums) before it writes and syncs the record. No power is cut: the owner
/// process's system calls are traced (strace, descriptors with their paths).
fn a_durable_commit_makes_the_data_process_writes_durable_first() {
    let dir = temp_dir("durable-commit");
    let trace = dir.join("strace");
    let status = std::process::Command::new("strace")
        .args(["-f", "-qq", "-y", "-e", "trace=openat,pwrite64,fsync,fdatasync", "-o"])
        .arg(&trace)
        .arg(std::env::current_exe().unwrap())
        .env(COMMIT_CHILD, &dir)
        .status()
        .unwrap();
    let log = std::fs::read_to_string(&trace).unwrap_or_default();
    let dir = std::fs::canonicalize(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "the traced owner failed ({status})");
    let lines: Vec<&str> = log.lines().collect();
    let path = |name: &str| format!("<{}>", dir.join(name).display());
    let opened = |name: &str| {
        lines.iter().position(|l| l.contains("openat(") && l.contains(&path(name))).unwrap_or_else(|| panic!("{name} never opened:\n{log}"))
    };
    let commit = &lines[opened("commit-starts")..opened("commit-ended")];
    let at = |what: &str, hit: &dyn Fn(&str) -> bool| {
        commit.iter().position(|l| hit(l)).unwrap_or_else(|| panic!("no {what} during the commit:\n{}", commit.join("\n")))
    };
    let synced = |l: &str, p: &str| l.contains("fdatasync(") && l.contains(p);
    let (data, sidecar) = (path("data-0"), format!("<{}>", Sidecar::path_for(&dir.join("data-0")).display()));
    let record = at("record write", &|l: &str| l.contains("pwrite64(") && l.contains(&path("records")));
    assert!(at("sync of the data file", &|l: &str| synced(l, &data)) < record, "the record was written before the data was synced:\n{log}");
    assert!(
        at("sync of the checksums", &|l: &str| synced(l, &sidecar)) < record,
        "the record was written before the checksums were synced:\n{log}"
    );
}

/// Why strace cannot trace a child here, if it cannot.
fn strace_missing() -> Option<String> {
    let ok = std::process::Command::new("strace").args(["-o", "/dev/null", "true"]).status().is_ok_and(|s| s.success());
    (!ok).then(|| "strace is missing or cannot trace here (apt-get install strace)".to_string())
}

/// A file created with KVX_DISK_SYNC survives a power cut only once its folder's entry
/// is durable too. No power is cut here: the system calls of a child creating such a
/// layout on its own thread are traced (strace, descriptors shown with their paths; the
/// engine's threads, which take no part in creating it, are not), and the folder must
/// be fsynced after the data file and the sidecar were created and their own sizes and
/// headers synced.
fn a_synced_files_folder_is_synced_after_it_is_created() {
    let path = temp_path("synced");
    let _rm = Remove(path.clone());
    let trace = temp_path("strace");
    let _rm_trace = Remove(trace.clone());
    let status = std::process::Command::new("strace")
        .args(["-qq", "-y", "-e", "trace=openat,fsync,fdatasync", "-o"])
        .arg(&trace)
        .arg(std::env::current_exe().unwrap())
        .env(SYNC_CHILD, &path)
        .status()
        .unwrap();
    assert!(status.success(), "the traced child failed ({status})");
    let log = std::fs::read_to_string(&trace).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    let dir = std::fs::canonicalize(path.parent().unwrap()).unwrap();
    let (data, sidecar) = (dir.join(path.file_name().unwrap()), dir.join(Sidecar::path_for(&path).file_name().unwrap()));
    let (data, sidecar, dir) = (data.display().to_string(), sidecar.display().to_string(), dir.display().to_string());
    let last = |what: &str, hit: &dyn Fn(&str) -> bool| {
        lines.iter().rposition(|l| hit(l)).unwrap_or_else(|| panic!("no {what} in the trace:\n{log}"))
    };
    let created = |p: &str| {
        last(&format!("creation of {p}"), &|l: &str| l.contains("openat(") && l.contains("O_CREAT") && l.contains(&format!("<{p}>")))
    };
    let synced = |p: &str| {
        last(&format!("sync of {p}"), &|l: &str| (l.contains("fsync(") || l.contains("fdatasync(")) && l.contains(&format!("<{p}>")))
    };
    let dir_synced = last(&format!("fsync of the folder {dir}"), &|l: &str| l.contains("fsync(") && l.contains(&format!("<{dir}>")));
    for p in [&data, &sidecar] {
        assert!(created(p) < dir_synced, "{p} was created after the folder's last fsync:\n{log}");
        assert!(synced(p) < dir_synced, "{p} was synced after the folder's last fsync:\n{log}");
    }
}

/// A KVX_DISK_SYNC layout is created in a folder its process may write but not list
/// (mode 0300), where the folder cannot be opened to be synced: the call still succeeds
/// and the file is there. Root ignores the mode, so as root the creating child runs as
/// an unprivileged user (`nobody`, uid 65534) that owns the folder.
fn a_synced_file_is_created_in_a_folder_that_cannot_be_listed() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let dir = temp_path("write-only");
    std::fs::create_dir(&dir).unwrap();
    struct RemoveDir(PathBuf);
    impl Drop for RemoveDir {
        fn drop(&mut self) {
            let _ = std::fs::set_permissions(&self.0, std::fs::Permissions::from_mode(0o700));
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _rm = RemoveDir(dir.clone());
    let path = dir.join("synced");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap());
    child.env(SYNC_CHILD, &path);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        const NOBODY: u32 = 65534;
        std::os::unix::fs::chown(&dir, Some(NOBODY), Some(NOBODY)).unwrap();
        child.uid(NOBODY).gid(NOBODY);
    }
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o300)).unwrap();
    let out = child.output().unwrap();
    assert!(out.status.success(), "the child's KVX_DISK_SYNC create failed ({}):\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    assert!(path.is_file() && Sidecar::path_for(&path).is_file(), "the created file and its sidecar are in the folder");
}
