//! The shared tier under the store, over a shared directory: blocks one process puts,
//! another process finds and loads bit-exact; objects damaged, cut short, renamed or of
//! another namespace are misses; a backend that never answers costs a bounded wait.

mod common;
use common::shared_tier::{block, get_exact, get_exact_in, keys, put, torture, torture_child, NS};
use common::*;
use kvxfer::shared::{object, Location, SharedConfig, WriteMode};
use kvxfer::store::{Store, StoreConfig};
use kvxfer::{Engine, Status, StorageKind};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn shared(dir: &Path, write: WriteMode) -> SharedConfig {
    SharedConfig { write, ..SharedConfig::new(Location::Dir { path: dir.to_path_buf(), capacity_bytes: 0 }) }
}

fn open(e: &Arc<Engine>, local: &Path, ns: &[u8], sh: SharedConfig) -> Store {
    Store::open(e, local, &StoreConfig { shards: 2, shared: Some(sh), ..StoreConfig::new(block(0), 64, ns) }).unwrap()
}

fn object_path(dir: &Path, ns: &[u8], key: &[u8]) -> PathBuf {
    dir.join("objects").join(object::name(ns, key))
}

/// The child of `a_prefix_one_process_puts_is_loaded_bit_exact_by_another_started_after_it_exits`:
/// puts the prefix into its own store over the shared directory, written behind, and exits.
#[test]
#[ignore = "run by its parent test"]
fn shared_child_puts() {
    let (Some(sh), Some(local)) = (std::env::var_os("KVX_SHARED_DIR"), std::env::var_os("KVX_SHARED_LOCAL")) else { return };
    let e = Arc::new(engine());
    let s = open(&e, Path::new(&local), NS, shared(Path::new(&sh), WriteMode::Behind));
    assert_eq!(put(&e, &s, &keys(20)), vec![Status::Ok; 20]);
    // Closing publishes what is still behind.
    s.close();
}

#[test]
fn a_prefix_one_process_puts_is_loaded_bit_exact_by_another_started_after_it_exits() {
    let (sh, local_a, local_b) = (temp_dir("shared"), temp_dir("local-a"), temp_dir("local-b"));
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "shared_child_puts", "--test-threads", "1", "--nocapture"])
        .env("KVX_SHARED_DIR", &sh)
        .env("KVX_SHARED_LOCAL", &local_a)
        .output()
        .unwrap();
    assert!(out.status.success(), "the child failed:\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"), "the child ran no test");

    let e = Arc::new(engine());
    let s = open(&e, &local_b, NS, shared(&sh, WriteMode::Behind));
    let mut ks = keys(20);
    ks.extend(keys(25).split_off(20).into_iter().map(|mut k| {
        k.push(b'!');
        k
    }));
    let (present, leading) = s.lookup(&ks, false).unwrap();
    assert_eq!(leading, 20, "{present:?}");
    let requests = s.stats().shared.requests;
    assert!(requests <= 12, "{requests} existence checks for 25 keys: the search is logarithmic");

    let st = get_exact(&e, &s, &ks);
    assert_eq!(&st[..20], &[Status::Ok; 20]);
    assert_eq!(&st[20..], &[Status::NotFound; 5]);
    let stats = s.stats();
    assert_eq!((stats.shared.hits, stats.shared.misses, stats.hits, stats.misses), (20, 5, 20, 5));

    // Admitted into B's own store (after the get reports): the next get is local.
    let admitted = Instant::now();
    while s.stats().entries < 20 && admitted.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(get_exact(&e, &s, &ks[..20]), vec![Status::Ok; 20]);
    assert_eq!(s.stats().shared.hits, 20, "the second get read nothing from the shared tier");
    assert_eq!(s.stats().entries, 20);
    drop(s);
    for d in [sh, local_a, local_b] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Reads land in host memory straight from the object, under each key's claim; in device
/// memory through staging and the engine; admitted locally from staging either way.
#[test]
fn shared_blocks_load_bit_exact_into_host_and_device_memory_admitted_or_not() {
    let sh = temp_dir("shared");
    let e = Arc::new(engine());
    let a = open(&e, &temp_dir("local-a"), NS, shared(&sh, WriteMode::Through));
    let ks = keys(40);
    assert_eq!(put(&e, &a, &ks), vec![Status::Ok; 40]);
    for admit in [false, true] {
        for storage in [StorageKind::Host, StorageKind::Pinned, StorageKind::Device] {
            let b = open(&e, &temp_dir("local-b"), NS, SharedConfig { admit, ..shared(&sh, WriteMode::Through) });
            assert_eq!(get_exact_in(&e, &b, &ks, storage), vec![Status::Ok; 40], "{storage:?}, admit {admit}");
            assert_eq!(b.stats().shared.hits, 40);
            // Admitted (after the get reports), blocks load from the local store, bit-exact,
            // with no shared read.
            let admitted = Instant::now();
            while admit && b.stats().entries < 40 && admitted.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(10));
            }
            assert_eq!(b.stats().entries, if admit { 40 } else { 0 }, "{storage:?}, admit {admit}");
            assert_eq!(get_exact_in(&e, &b, &ks, storage), vec![Status::Ok; 40]);
            assert_eq!(b.stats().shared.hits, if admit { 40 } else { 80 }, "{storage:?}, admit {admit}");
        }
    }
    let _ = std::fs::remove_dir_all(sh);
}

#[test]
fn a_write_through_put_is_readable_by_another_store_when_it_reports() {
    let (sh, local_a, local_b) = (temp_dir("shared"), temp_dir("local-a"), temp_dir("local-b"));
    let e = Arc::new(engine());
    let a = open(&e, &local_a, NS, shared(&sh, WriteMode::Through));
    let b = open(&e, &local_b, NS, shared(&sh, WriteMode::Through));
    let ks = keys(6);
    assert_eq!(put(&e, &a, &ks), vec![Status::Ok; 6]);
    assert_eq!(a.stats().shared.puts, 6);
    assert_eq!(get_exact(&e, &b, &ks), vec![Status::Ok; 6]);
    // Another namespace over the same directory sees none of them.
    let c = open(&e, &temp_dir("local-c"), b"model-b tp0", shared(&sh, WriteMode::Through));
    assert_eq!(c.lookup(&ks, false).unwrap().1, 0);
    assert_eq!(get_exact(&e, &c, &ks), vec![Status::NotFound; 6]);
    let _ = std::fs::remove_dir_all(sh);
}

#[test]
fn objects_damaged_cut_short_renamed_or_of_another_namespace_are_misses_never_wrong_bytes() {
    let (sh, local_a) = (temp_dir("shared"), temp_dir("local-a"));
    let e = Arc::new(engine());
    let a = open(&e, &local_a, NS, shared(&sh, WriteMode::Through));
    let ks = keys(6);
    assert_eq!(put(&e, &a, &ks), vec![Status::Ok; 6]);
    drop(a);
    let path = |i: usize| object_path(&sh, NS, &ks[i]);
    // 0: a payload byte flipped; 1: cut short; 2: key 3's object under key 2's name;
    // 4: key 4's object rewritten by a store of another namespace (same name there is
    // another file: copy it over); 5: intact.
    let mut bytes = std::fs::read(path(0)).unwrap();
    let at = bytes.len() - 7;
    bytes[at] ^= 0x10;
    std::fs::write(path(0), &bytes).unwrap();
    let bytes = std::fs::read(path(1)).unwrap();
    std::fs::write(path(1), &bytes[..bytes.len() - 1]).unwrap();
    std::fs::copy(path(3), path(2)).unwrap();
    let other = open(&e, &temp_dir("local-o"), b"model-b tp0", shared(&sh, WriteMode::Through));
    assert_eq!(put(&e, &other, &ks[4..5]), vec![Status::Ok]);
    drop(other);
    std::fs::copy(object_path(&sh, b"model-b tp0", &ks[4]), path(4)).unwrap();

    let b = open(&e, &temp_dir("local-b"), NS, shared(&sh, WriteMode::Through));
    let st = get_exact(&e, &b, &ks);
    assert_eq!(st, [Status::Integrity, Status::Integrity, Status::Integrity, Status::Ok, Status::Integrity, Status::Ok]);
    assert_eq!(b.stats().shared.integrity_failures, 4);
    let _ = std::fs::remove_dir_all(sh);
}

#[test]
fn a_backend_that_never_answers_makes_a_get_a_timeout_miss_within_the_bound() {
    let (sh, local) = (temp_dir("shared"), temp_dir("local"));
    let e = Arc::new(engine());
    let cfg = SharedConfig { timeout: Duration::from_millis(300), ..shared(&sh, WriteMode::Through) };
    let s = open(&e, &local, NS, cfg);
    let ks = keys(3);
    // Key 0's object is a FIFO with no writer: opening it to read blocks forever, as a
    // hung network file system does.
    let p = object_path(&sh, NS, &ks[0]);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    assert_eq!(put(&e, &s, &ks[1..]), vec![Status::Ok; 2]);
    assert_eq!(s.remove(&ks[1..]).unwrap(), vec![Status::Ok; 2], "gone locally: the gets read the shared tier");

    let started = Instant::now();
    let st = get_exact(&e, &s, &ks);
    assert_eq!(st, [Status::Timeout, Status::Ok, Status::Ok]);
    assert!(started.elapsed() < Duration::from_secs(20), "the get waited {:?}, far past its bound", started.elapsed());
    assert_eq!(s.stats().shared.timeouts, 1);
    let started = Instant::now();
    drop(s);
    assert!(started.elapsed() < Duration::from_secs(20), "closing waited for the hung read");
    let _ = std::fs::remove_dir_all(sh);
}

#[test]
fn an_unwritable_shared_directory_is_refused_at_open() {
    let e = Arc::new(engine());
    let local = temp_dir("local");
    let bad = SharedConfig::new(Location::Dir { path: "/proc/kvxfer-shared".into(), capacity_bytes: 0 });
    let cfg = StoreConfig { shared: Some(bad), ..StoreConfig::new(block(0), 8, NS) };
    let err = Store::open(&e, &local, &cfg).err().expect("refused");
    assert!(err.message.contains("/proc/kvxfer-shared"), "{}", err.message);
}

/// A child of the torture (tests/common/shared_tier.rs) over the shared directory.
#[test]
#[ignore = "run by its parent test"]
fn shared_torture_child() {
    let Some(sh) = std::env::var_os("KVX_SHARED_DIR") else { return };
    torture_child(shared(Path::new(&sh), WriteMode::Through));
}

#[test]
fn processes_killed_at_random_never_serve_wrong_bytes_and_keep_acknowledged_puts() {
    let sh = temp_dir("shared-torture");
    let child = || {
        let mut c = std::process::Command::new(std::env::current_exe().unwrap());
        c.args(["--ignored", "--exact", "shared_torture_child", "--test-threads", "1"]).env("KVX_SHARED_DIR", &sh);
        c
    };
    torture(child, shared(&sh, WriteMode::Through));
    let _ = std::fs::remove_dir_all(sh);
}
