//! The store: round trips from and into any layout, dedup, namespaces, reopening, the
//! owner's lock, leases, eviction under many threads, and damage of every kind found as
//! a miss with its reason, never as wrong bytes.

mod common;
use common::*;
use kvxfer::store::{Reservation, SlotHandle, Store, StoreConfig, StoreFlags, StoreRequest};
use kvxfer::{Engine, Layout, LayoutConfig, LayoutKind, Status, StorageKind};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const FC: LayoutKind = LayoutKind::FullyContiguous;
/// vLLM's per-layer layout: `[2, num_blocks, …]` per layer.
const VLLM: LayoutKind = LayoutKind::LayerSeparate { block_first: false };

/// One block: 2 layers × K/V × 4 tokens × 64 elements × 2 bytes (512-byte regions).
fn block(num_blocks: u64) -> LayoutConfig {
    cfg(num_blocks, 2, 2, 4, 64, 2)
}

fn store_cfg(capacity: u64, ns: &[u8]) -> StoreConfig {
    StoreConfig { shards: 2, ..StoreConfig::new(block(0), capacity, ns) }
}

fn store_dir() -> PathBuf {
    temp_dir("store")
}

fn engine_arc() -> Arc<Engine> {
    Arc::new(engine())
}

fn key(i: u64) -> Vec<u8> {
    format!("key-{i}").into_bytes()
}

fn wait(r: &StoreRequest) -> Status {
    r.wait(Some(Duration::from_secs(60)))
}

fn statuses(r: &StoreRequest) -> Vec<Status> {
    (0..r.len()).map(|i| r.key_status(i).unwrap()).collect()
}

/// Puts `keys` from blocks 0.. of a host layout filled with each key's bytes.
fn put_keys(e: &Engine, s: &Store, keys: &[Vec<u8>]) -> Vec<Status> {
    let src = e.create_layout(&block(keys.len() as u64), FC, StorageKind::Host).unwrap();
    for (i, k) in keys.iter().enumerate() {
        fill_block_for_key(&src, i as u64, k);
    }
    let ids: Vec<u64> = (0..keys.len() as u64).collect();
    let r = s.put(&src, &ids, keys, &Default::default()).unwrap();
    wait(&r);
    statuses(&r)
}

/// Gets `keys` into blocks 0.. of a fresh host layout: each key's status, and the layout.
fn get_keys(e: &Engine, s: &Store, keys: &[Vec<u8>]) -> (Vec<Status>, Arc<Layout>) {
    let dst = e.create_layout(&block(keys.len() as u64), FC, StorageKind::Host).unwrap();
    fill(&dst, 99);
    let ids: Vec<u64> = (0..keys.len() as u64).collect();
    let r = s.get(keys, &dst, &ids, &Default::default()).unwrap();
    wait(&r);
    (statuses(&r), dst)
}

/// Gets every key and checks that each hit holds exactly its key's bytes.
fn exact_hits(e: &Engine, s: &Store, keys: &[Vec<u8>]) -> Vec<Status> {
    let (st, dst) = get_keys(e, s, keys);
    for (i, k) in keys.iter().enumerate() {
        if st[i] == Status::Ok {
            assert!(holds_key(&dst, i as u64, k), "key {} loaded with bytes that are not its own", String::from_utf8_lossy(k));
        }
    }
    st
}

/// Bytes of one slot record in the records file.
const RECORD: u64 = 128;

/// The slot whose record names `key` (its bytes at 16.., its length at 96..100), read from
/// the records file.
fn slot_of(dir: &Path, key: &[u8]) -> u64 {
    let records = std::fs::read(dir.join("records")).unwrap();
    let named = |r: &[u8]| r[96..100] == (key.len() as u32).to_le_bytes() && &r[16..16 + key.len()] == key;
    records.chunks_exact(RECORD as usize).position(named).expect("a record of the key") as u64
}

/// Flips one byte of the file at `off`.
fn flip(path: &Path, off: u64) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, off).unwrap();
    f.write_all_at(&[b[0] ^ 0x5a], off).unwrap();
}

#[test]
fn blocks_put_from_host_and_device_layouts_in_vllms_per_layer_layout_come_back_exact() {
    let e = engine_arc();
    let dir = store_dir();
    let s = Store::open(&e, &dir, &store_cfg(16, b"model-a tp0")).unwrap();
    let keys: Vec<Vec<u8>> = (0..8).map(key).collect();
    let dev = e.create_layout(&block(6), VLLM, StorageKind::Device).unwrap();
    let host = e.create_layout(&block(6), VLLM, StorageKind::Host).unwrap();
    for i in 0..4 {
        fill_block_for_key(&dev, 5 - i as u64, &keys[i]);
        fill_block_for_key(&host, i as u64, &keys[4 + i]);
    }
    let r = s.put(&dev, &[5, 4, 3, 2], &keys[..4], &Default::default()).unwrap();
    assert_eq!(wait(&r), Status::Ok, "{}", r.key_message(0));
    let r = s.put(&host, &[0, 1, 2, 3], &keys[4..], &Default::default()).unwrap();
    assert_eq!(wait(&r), Status::Ok);
    assert_eq!(s.stats().entries, 8);
    // Into another device layout of vLLM's shape, at other block ids, and into a host one.
    let back = e.create_layout(&block(10), VLLM, StorageKind::Device).unwrap();
    fill(&back, 7);
    let ids: Vec<u64> = (0..8).map(|i| 9 - i).collect();
    let r = s.get(&keys, &back, &ids, &Default::default()).unwrap();
    assert_eq!(wait(&r), Status::Ok, "{}", r.key_message(0));
    for (i, k) in keys.iter().enumerate() {
        assert!(holds_key(&back, ids[i], k), "key {i} into the device layout");
    }
    assert!(exact_hits(&e, &s, &keys).iter().all(|&st| st == Status::Ok));
    // Dedup: a key held already succeeds without writing.
    let before = s.stats();
    assert_eq!(put_keys(&e, &s, &keys[2..6]), vec![Status::Ok; 4]);
    let after = s.stats();
    assert_eq!((after.puts, after.dedups, after.entries), (before.puts, before.dedups + 4, 8));
    // A batch with the same new key twice writes it once; both report Ok.
    assert_eq!(put_keys(&e, &s, &[key(50), key(50)]), vec![Status::Ok; 2]);
    assert_eq!(s.stats().puts, after.puts + 1);
    assert_eq!(s.stats().hits, 16);
}

/// Two 32-byte keys whose xxh3-128 digests are equal: XXH3 folds the product
/// `(a ^ s0) × (b ^ s1)` of a 32-byte input's first two words with its default secret's
/// first two (s0, s1), so `(s0, K − s0, c, d)` and `(K − s1, s1, c, d)` both make it 0
/// and add up to the same `a + b`.
fn colliding_keys() -> (Vec<u8>, Vec<u8>) {
    const S0: u64 = 0xbe4b_a423_396c_feb8;
    const S1: u64 = 0x1cad_21f7_2c81_017c;
    let (k, c, d) = (0x0123_4567_89ab_cdefu64, 0x1111u64, 0x2222u64);
    let bytes = |w: [u64; 4]| w.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    (bytes([S0, k.wrapping_sub(S0), c, d]), bytes([k.wrapping_sub(S1), S1, c, d]))
}

/// Keys are told apart by their own bytes: a key whose digest equals a held key's is
/// not held, its get never serves the other key's bytes, and both can be stored.
#[test]
fn a_key_whose_digest_equals_a_held_keys_is_a_key_of_its_own() {
    let (k1, k2) = colliding_keys();
    assert_ne!(k1, k2);
    assert_eq!(xxhash_rust::xxh3::xxh3_128(&k1), xxhash_rust::xxh3::xxh3_128(&k2), "the keys collide in xxh3-128");
    let e = engine_arc();
    let dir = store_dir();
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    assert_eq!(put_keys(&e, &s, std::slice::from_ref(&k1)), [Status::Ok]);
    assert_eq!(s.lookup(&[&k2], false).unwrap(), (vec![false], 0), "a key never put is not present");
    assert_eq!(exact_hits(&e, &s, std::slice::from_ref(&k2)), [Status::NotFound], "a key never put does not load");
    assert_eq!(put_keys(&e, &s, std::slice::from_ref(&k2)), [Status::Ok]);
    assert_eq!(s.stats().entries, 2, "two keys, two entries");
    assert_eq!(exact_hits(&e, &s, &[k1.clone(), k2.clone()]), [Status::Ok, Status::Ok]);
    // The records keep the keys themselves: after a reopen they are still two.
    drop(s);
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    assert_eq!(exact_hits(&e, &s, &[k2.clone(), k1.clone()]), [Status::Ok, Status::Ok]);
    assert_eq!(s.remove(&[&k1]).unwrap(), [Status::Ok]);
    assert_eq!(exact_hits(&e, &s, &[k1, k2]), [Status::NotFound, Status::Ok]);
    s.close();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A reopened store evicts what was used least before it closed: the keys read just
/// before the close survive puts into the full store, the never-read ones go.
#[test]
fn a_reopened_store_keeps_the_eviction_order_it_closed_with() {
    let e = engine_arc();
    let dir = store_dir();
    let cfg = StoreConfig { shards: 1, ..store_cfg(8, b"ns") };
    let s = Store::open(&e, &dir, &cfg).unwrap();
    let old: Vec<Vec<u8>> = (0..8).map(key).collect();
    assert!(put_keys(&e, &s, &old).iter().all(|&st| st == Status::Ok));
    // The first-written half is the one read last.
    assert_eq!(exact_hits(&e, &s, &old[..4]), [Status::Ok; 4]);
    s.close();
    let s = Store::open(&e, &dir, &cfg).unwrap();
    let new: Vec<Vec<u8>> = (100..104).map(key).collect();
    assert!(put_keys(&e, &s, &new).iter().all(|&st| st == Status::Ok));
    let (held, _) = s.lookup(&old, false).unwrap();
    assert_eq!(held, [true, true, true, true, false, false, false, false], "the keys read before the close stay");
    s.close();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_get_of_keys_not_held_is_a_miss_for_those_keys_alone() {
    let e = engine_arc();
    let dir = store_dir();
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    put_keys(&e, &s, &[key(1), key(3)]);
    let keys = vec![key(1), key(2), key(3)];
    let dst = e.create_layout(&block(3), FC, StorageKind::Host).unwrap();
    let r = s.get(&keys, &dst, &[0, 1, 2], &Default::default()).unwrap();
    assert_eq!(wait(&r), Status::NotFound, "the request says a key is missing");
    assert_eq!(statuses(&r), vec![Status::Ok, Status::NotFound, Status::Ok]);
    assert!(holds_key(&dst, 0, &keys[0]) && holds_key(&dst, 2, &keys[2]));
    let (present, leading) = s.lookup(&keys, false).unwrap();
    assert_eq!((present, leading), (vec![true, false, true], 1));
    let st = s.stats();
    assert_eq!((st.hits, st.misses), (2, 1));
}

#[test]
fn bad_calls_are_refused_with_the_reason() {
    let e = engine_arc();
    let s = Store::open(&e, &store_dir(), &store_cfg(8, b"ns")).unwrap();
    let src = e.create_layout(&block(2), FC, StorageKind::Host).unwrap();
    let err = s.put(&src, &[0], &[vec![7u8; 65]], &Default::default()).unwrap_err();
    assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
    let err = s.put(&src, &[0], &[b"".to_vec()], &Default::default()).unwrap_err();
    assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
    let err = s.put(&src, &[0, 1], &[key(1)], &Default::default()).unwrap_err();
    assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
    let err = s.put(&src, &[2], &[key(1)], &Default::default()).unwrap_err();
    assert_eq!(err.status, Status::OutOfRange, "{}", err.message);
    let opts = kvxfer::TransferOptions { layer_begin: 1, ..Default::default() };
    let err = s.put(&src, &[0], &[key(1)], &opts).unwrap_err();
    assert!(err.status == Status::InvalidArg && err.message.contains("whole blocks"), "{}", err.message);
    let other = e.create_layout(&cfg(2, 3, 2, 4, 64, 2), FC, StorageKind::Host).unwrap();
    assert_eq!(s.put(&other, &[0], &[key(1)], &Default::default()).unwrap_err().status, Status::Incompatible);
    let err = s.get(&[key(1), key(2)], &src, &[1, 1], &Default::default()).unwrap_err();
    assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
    let big_ns = vec![0u8; 257];
    let err = Store::open(&e, &store_dir(), &store_cfg(8, &big_ns)).err().unwrap();
    assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
    let err = Store::open(&e, &temp_path("no-store"), &StoreConfig { flags: StoreFlags::NONE, ..store_cfg(8, b"ns") }).err().unwrap();
    assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
}

#[test]
fn a_reopened_store_finds_its_entries_and_refuses_another_geometry_capacity_shard_count_or_namespace() {
    let e = engine_arc();
    let dir = store_dir();
    let keys: Vec<Vec<u8>> = (0..6).map(key).collect();
    {
        let s = Store::open(&e, &dir, &store_cfg(8, b"ns-a")).unwrap();
        assert_eq!(put_keys(&e, &s, &keys), vec![Status::Ok; 6]);
        assert_eq!(s.remove(&[key(2)]).unwrap(), vec![Status::Ok]);
    }
    let refused = |c: StoreConfig, what: &str| {
        let err = Store::open(&e, &dir, &c).err().unwrap_or_else(|| panic!("{what}: opened"));
        assert_eq!(err.status, Status::Incompatible, "{what}: {}", err.message);
        assert!(err.message.contains(what), "{what}: {}", err.message);
    };
    refused(StoreConfig { block: cfg(0, 2, 2, 8, 64, 2), ..store_cfg(8, b"ns-a") }, "geometry");
    refused(store_cfg(9, b"ns-a"), "blocks");
    refused(StoreConfig { shards: 4, ..store_cfg(8, b"ns-a") }, "shards");
    refused(store_cfg(8, b"ns-b"), "namespace");
    let s = Store::open(&e, &dir, &StoreConfig { flags: StoreFlags::NONE, ..store_cfg(8, b"ns-a") }).unwrap();
    assert_eq!(s.stats().entries, 5);
    let st = exact_hits(&e, &s, &keys);
    assert_eq!(st, vec![Status::Ok, Status::Ok, Status::NotFound, Status::Ok, Status::Ok, Status::Ok], "the removed key stays removed");
}

#[test]
fn stores_of_two_namespaces_with_equal_keys_never_see_each_others_bytes() {
    let e = engine_arc();
    let (da, db) = (store_dir(), store_dir());
    let a = Store::open(&e, &da, &store_cfg(8, b"model-a")).unwrap();
    let b = Store::open(&e, &db, &store_cfg(8, b"model-b")).unwrap();
    let keys: Vec<Vec<u8>> = (0..4).map(key).collect();
    // Equal keys, different bytes: b's blocks are those of other keys.
    put_keys(&e, &a, &keys);
    let src = e.create_layout(&block(4), FC, StorageKind::Host).unwrap();
    for i in 0..4 {
        fill_block_for_key(&src, i, &key(100 + i));
    }
    assert_eq!(wait(&b.put(&src, &[0, 1, 2, 3], &keys, &Default::default()).unwrap()), Status::Ok);
    let (st, dst) = get_keys(&e, &a, &keys);
    assert!(st.iter().all(|&s| s == Status::Ok));
    assert!((0..4).all(|i| holds_key(&dst, i, &keys[i as usize])));
    let (st, dst) = get_keys(&e, &b, &keys);
    assert!(st.iter().all(|&s| s == Status::Ok));
    assert!((0..4).all(|i| holds_key(&dst, i, &key(100 + i))));
    drop((a, b));
    // b's records copied into a's directory are of another namespace: not entries.
    std::fs::copy(db.join("records"), da.join("records")).unwrap();
    let a = Store::open(&e, &da, &store_cfg(8, b"model-a")).unwrap();
    assert_eq!(a.stats().entries, 0);
    assert_eq!(a.stats().integrity_failures, 4);
    assert!(exact_hits(&e, &a, &keys).iter().all(|&s| s == Status::NotFound));
}

/// The owner the lock tests kill: opens the store, says so, and waits. With
/// `KVX_STORE_OWNER_FORK` set it first forks a child that never execs and only sleeps,
/// and says that child's pid.
#[test]
#[ignore = "run by the owner's lock tests in a child process"]
fn store_owner() {
    let dir = PathBuf::from(std::env::var_os("KVX_STORE_OWNER_DIR").expect("run by the two-writer test"));
    let e = engine_arc();
    let _s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    let mut said = String::new();
    if std::env::var_os("KVX_STORE_OWNER_FORK").is_some() {
        // SAFETY: the child only sleeps and exits, both async-signal-safe.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe {
                libc::sleep(60);
                libc::_exit(0);
            }
        }
        assert!(pid > 0, "fork failed");
        said = pid.to_string();
    }
    std::fs::write(dir.join("owner-ready.tmp"), said).unwrap();
    std::fs::rename(dir.join("owner-ready.tmp"), dir.join("owner-ready")).unwrap();
    std::thread::sleep(Duration::from_secs(300));
}

/// Starts `store_owner` on `dir` in a child process and waits until it owns the store:
/// the child, and what it said (its forked child's pid, with `fork`).
fn spawn_owner(dir: &Path, fork: bool) -> (std::process::Child, String) {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--ignored", "--exact", "store_owner", "--test-threads", "1"]).env("KVX_STORE_OWNER_DIR", dir);
    if fork {
        cmd.env("KVX_STORE_OWNER_FORK", "1");
    }
    let mut child = cmd.stdout(std::process::Stdio::null()).spawn().unwrap();
    let started = std::time::Instant::now();
    while !dir.join("owner-ready").exists() {
        assert!(started.elapsed() < Duration::from_secs(60), "the owner never opened the store");
        assert!(child.try_wait().unwrap().is_none(), "the owner exited");
        std::thread::sleep(Duration::from_millis(5));
    }
    let said = std::fs::read_to_string(dir.join("owner-ready")).unwrap();
    (child, said)
}

/// Run by the lock tests in a child process: an open of the store in
/// `KVX_STORE_LOCKED_DIR` is refused with `Busy` naming process `KVX_STORE_LOCKED_BY`.
#[test]
#[ignore = "run by the owner's lock tests in a child process"]
fn store_refused_here() {
    let dir = PathBuf::from(std::env::var_os("KVX_STORE_LOCKED_DIR").expect("run by a lock test"));
    let owner = std::env::var("KVX_STORE_LOCKED_BY").expect("run by a lock test");
    let e = engine_arc();
    let err = Store::open(&e, &dir, &store_cfg(8, b"ns")).err().expect("another process opened the store its owner holds");
    assert_eq!(err.status, Status::Busy, "{}", err.message);
    assert!(err.message.contains(&format!("process {owner}")), "{}", err.message);
}

/// Asserts that another process is refused the store in `dir`, which this process owns.
fn assert_refused_elsewhere(dir: &Path) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "store_refused_here", "--test-threads", "1"])
        .env("KVX_STORE_LOCKED_DIR", dir)
        .env("KVX_STORE_LOCKED_BY", std::process::id().to_string())
        .output()
        .unwrap();
    assert!(out.status.success(), "another process was not refused the store:\n{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn a_second_writer_is_refused_with_the_owners_pid_until_the_owner_dies() {
    let e = engine_arc();
    let dir = store_dir();
    {
        let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
        let err = Store::open(&e, &dir, &store_cfg(8, b"ns")).err().unwrap();
        assert_eq!(err.status, Status::Busy, "{}", err.message);
        assert!(err.message.contains(&format!("process {}", std::process::id())), "{}", err.message);
        drop(s);
    }
    let (mut child, _) = spawn_owner(&dir, false);
    let err = Store::open(&e, &dir, &store_cfg(8, b"ns")).err().unwrap();
    assert_eq!(err.status, Status::Busy, "{}", err.message);
    assert!(err.message.contains(&format!("process {}", child.id())), "{}", err.message);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(Store::open(&e, &dir, &store_cfg(8, b"ns")).is_ok(), "a killed owner's lock is gone");
}

/// The owner may read or copy its store's files while it runs (to see who owns it, to
/// back it up): no open or close of any of them gives the store away to another process.
#[test]
fn an_owner_that_reads_and_copies_its_store_files_keeps_the_store() {
    let e = engine_arc();
    let dir = store_dir();
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    let backup = temp_dir("store-backup");
    for f in std::fs::read_dir(&dir).unwrap() {
        let path = f.unwrap().path();
        std::fs::copy(&path, backup.join(path.file_name().unwrap())).unwrap();
    }
    assert_refused_elsewhere(&dir);
    drop(s);
    assert!(Store::open(&e, &dir, &store_cfg(8, b"ns")).is_ok(), "a closed store opens again");
}

/// A forked child closes its copy of the owner's lock descriptor (at the fork, and at its
/// exit), and dropping its copy of the store returns at once (the store thread and the
/// transfers in flight are the parent's): the owner keeps its lock, and another process
/// is still refused.
#[test]
fn a_forked_child_that_exits_leaves_the_owner_its_lock() {
    let e = engine_arc();
    let dir = store_dir();
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    // SAFETY: the child only drops its copy of the store (as a Python child's exit does)
    // and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(s))).is_ok();
        unsafe { libc::_exit(if dropped { 0 } else { 3 }) };
    }
    assert!(pid > 0, "fork failed");
    let mut status = 0;
    let ended = (0..1000).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) == pid }
    });
    if !ended {
        unsafe { libc::kill(pid, libc::SIGKILL) };
        panic!("the child that dropped its copy of the store did not exit in 10 s");
    }
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child ended with status {status:#x}");
    assert_refused_elsewhere(&dir);
    drop(s);
}

/// An owner killed while a child it forked (one that never execs) lives leaves no lock
/// behind: the child got none of it.
#[test]
fn a_killed_owners_forked_child_does_not_hold_the_store() {
    let e = engine_arc();
    let dir = store_dir();
    let (mut owner, said) = spawn_owner(&dir, true);
    let forked: i32 = said.parse().expect("the forked child's pid");
    owner.kill().unwrap();
    owner.wait().unwrap();
    let reopened = Store::open(&e, &dir, &store_cfg(8, b"ns"));
    unsafe {
        libc::kill(forked, libc::SIGKILL);
    }
    assert!(reopened.is_ok(), "{:?}", reopened.err());
}

#[test]
fn a_leased_hit_stays_loadable_and_a_full_store_of_held_entries_fails_the_key_alone() {
    let e = engine_arc();
    let s = Store::open(&e, &store_dir(), &StoreConfig { shards: 1, ..store_cfg(2, b"ns") }).unwrap();
    put_keys(&e, &s, &[key(1), key(2)]);
    assert_eq!(s.lookup(&[key(1), key(9)], true).unwrap(), (vec![true, false], 1));
    // 1 is the least recently used, but leased: 2 goes.
    assert_eq!(put_keys(&e, &s, &[key(3)]), vec![Status::Ok]);
    assert_eq!(s.lookup(&[key(1), key(2), key(3)], false).unwrap().0, vec![true, false, true]);
    // Both held: the new key finds no room, alone.
    assert!(s.lookup(&[key(3)], true).unwrap().0[0]);
    let st = put_keys(&e, &s, &[key(4)]);
    assert_eq!(st, vec![Status::Busy]);
    // A get spends key 1's lease: it loads, and then 1 may go.
    assert_eq!(exact_hits(&e, &s, &[key(1)]), vec![Status::Ok]);
    assert_eq!(put_keys(&e, &s, &[key(4)]), vec![Status::Ok]);
    assert_eq!(s.lookup(&[key(1), key(3), key(4)], false).unwrap().0, vec![false, true, true]);
    s.release_leases(&[key(3)]).unwrap();
    assert_eq!(put_keys(&e, &s, &[key(5)]), vec![Status::Ok]);
    assert_eq!(s.stats().evictions, 3);
    // A removed leased key leaves the index at once; its slot comes back once released.
    assert!(s.lookup(&[key(5)], true).unwrap().0[0]);
    assert_eq!(s.remove(&[key(5), key(77)]).unwrap(), vec![Status::Ok, Status::NotFound]);
    assert_eq!(s.lookup(&[key(5)], false).unwrap().0, vec![false]);
    assert_eq!(put_keys(&e, &s, &[key(6), key(7)]), vec![Status::Ok, Status::Busy], "the removed key's slot is still leased");
    s.release_leases(&[key(5)]).unwrap();
    assert_eq!(put_keys(&e, &s, &[key(7)]), vec![Status::Ok]);
}

/// A lease taken by key, given back by key, frees the slot it was taken on, not the
/// newest slot of the key: a key removed and put again while leased has leases on two
/// slots, and giving back the older lease must leave the newer one's slot pinned.
#[test]
fn a_lease_given_back_by_key_frees_the_oldest_leased_slot_of_the_key() {
    let e = engine_arc();
    let s = Store::open(&e, &store_dir(), &StoreConfig { shards: 1, ..store_cfg(2, b"ns") }).unwrap();
    put_keys(&e, &s, &[key(1)]);
    // Caller 1 leases key 1 (#1); it is removed and put again (#2); caller 2 leases #2.
    assert!(s.lookup(&[key(1)], true).unwrap().0[0]);
    assert_eq!(s.remove(&[key(1)]).unwrap(), [Status::Ok]);
    assert_eq!(put_keys(&e, &s, &[key(1)]), [Status::Ok]);
    assert!(s.lookup(&[key(1)], true).unwrap().0[0]);
    // Caller 1 is done: #1's slot comes free, and a put takes it instead of evicting #2.
    s.release_leases(&[key(1)]).unwrap();
    assert_eq!(put_keys(&e, &s, &[key(2)]), [Status::Ok]);
    assert_eq!(s.stats().evictions, 0, "the put took the freed slot");
    assert_eq!(exact_hits(&e, &s, &[key(1), key(2)]), [Status::Ok, Status::Ok], "caller 2's hit is still loadable");
}

/// A lease from `lease` is its holder's: another caller's get of the key, or another
/// holder's lease and release, never gives it back, so the hit stays loadable for its
/// holder under any eviction pressure until the holder releases it.
#[test]
fn a_lease_token_keeps_its_holders_hit_until_that_holder_releases_it() {
    let e = engine_arc();
    let s = Store::open(&e, &store_dir(), &StoreConfig { shards: 1, ..store_cfg(2, b"ns") }).unwrap();
    put_keys(&e, &s, &[key(1), key(2)]);
    let (leases, leading) = s.lease(&[key(1), key(9)]).unwrap();
    assert_eq!((leases[1], leading), (None, 1));
    let mine = leases[0].unwrap();
    // Another caller leases, loads and gives back its own lease of key 1.
    let theirs = s.lease(&[key(1)]).unwrap().0[0].unwrap();
    assert_ne!(mine, theirs);
    assert_eq!(exact_hits(&e, &s, &[key(1)]), [Status::Ok]);
    s.release(&[theirs]).unwrap();
    s.release_leases(&[key(1)]).unwrap();
    // Puts into the full store evict everything else; key 1 stays.
    assert_eq!(put_keys(&e, &s, &[key(3)]), [Status::Ok]);
    assert_eq!(put_keys(&e, &s, &[key(4)]), [Status::Ok]);
    assert_eq!(s.stats().evictions, 2);
    assert_eq!(exact_hits(&e, &s, &[key(1)]), [Status::Ok], "the holder's hit still loads");
    // Given back once; a second time, or a lease listed twice, is refused whole.
    let err = s.release(&[mine, mine]).unwrap_err();
    assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
    s.release(&[mine]).unwrap();
    assert_eq!(s.release(&[mine]).unwrap_err().status, Status::InvalidArg);
    // Released, key 1 may go like any other.
    assert_eq!(put_keys(&e, &s, &[key(5), key(6)]), [Status::Ok, Status::Ok]);
    assert_eq!(s.lookup(&[key(1)], false).unwrap().0, [false]);
}

/// A lease token names a lease of the open that gave it and of no other: one kept past a
/// reopen, handed to another store, or forged, is refused and gives back nothing, and the
/// leases taken by key are not anyone's to give back by token.
#[test]
fn a_lease_token_of_another_open_or_store_is_refused() {
    let e = engine_arc();
    let dir = store_dir();
    let cfg = StoreConfig { shards: 1, ..store_cfg(4, b"ns") };
    let s = Store::open(&e, &dir, &cfg).unwrap();
    put_keys(&e, &s, &[key(1)]);
    let old = s.lease(&[key(1)]).unwrap().0[0].unwrap();
    s.release(&[old]).unwrap();
    s.close();
    let s = Store::open(&e, &dir, &cfg).unwrap();
    let other = Store::open(&e, &store_dir(), &cfg).unwrap();
    put_keys(&e, &other, &[key(1)]);
    let theirs = other.lease(&[key(1)]).unwrap().0[0].unwrap();
    // A lease by key, which only a get or `release_leases` gives back.
    assert!(s.lookup(&[key(1)], true).unwrap().0[0]);
    for lease in [old, theirs].into_iter().chain((0..64).map(kvxfer::store::Lease)) {
        assert_eq!(s.release(&[lease]).map_err(|e| e.status), Err(Status::InvalidArg), "{lease:?} given back");
    }
    s.release_leases(&[key(1)]).unwrap();
    assert_eq!(exact_hits(&e, &s, &[key(1)]), [Status::Ok]);
    other.release(&[theirs]).unwrap();
}

#[test]
fn sixteen_threads_of_mixed_operations_never_overfill_and_every_hit_is_exact() {
    let e = engine_arc();
    let capacity = 24;
    let s = Arc::new(Store::open(&e, &store_dir(), &store_cfg(capacity, b"ns")).unwrap());
    let threads: Vec<_> = (0..16u64)
        .map(|t| {
            let (e, s) = (e.clone(), s.clone());
            std::thread::spawn(move || {
                let mut x = t * 7919 + 1;
                let mut next = |n: u64| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x % n
                };
                let (mut hits, mut wrong) = (0, 0);
                for _ in 0..60 {
                    let keys: Vec<Vec<u8>> = (0..1 + next(4)).map(|_| key(next(64))).collect();
                    match next(10) {
                        0..=3 => {
                            for st in put_keys(&e, &s, &keys) {
                                assert!(st == Status::Ok || st == Status::Busy || st == Status::Cancelled, "put: {st:?}");
                            }
                        }
                        4..=7 => {
                            let lease = next(2) == 0;
                            let (present, _) = s.lookup(&keys, lease).unwrap();
                            let (st, dst) = get_keys(&e, &s, &keys);
                            for (i, k) in keys.iter().enumerate() {
                                match st[i] {
                                    Status::Ok if holds_key(&dst, i as u64, k) => hits += 1,
                                    Status::Ok => wrong += 1,
                                    Status::NotFound => {}
                                    other => panic!("get: {other:?}"),
                                }
                            }
                            if lease {
                                // Keys the get missed keep their lease: give them back.
                                let missed: Vec<Vec<u8>> =
                                    (0..keys.len()).filter(|&i| present[i] && st[i] != Status::Ok).map(|i| keys[i].clone()).collect();
                                if !missed.is_empty() {
                                    s.release_leases(&missed).unwrap();
                                }
                            }
                        }
                        _ => {
                            s.remove(&keys).unwrap();
                        }
                    }
                    assert!(s.stats().entries <= capacity, "more entries than capacity");
                }
                (hits, wrong)
            })
        })
        .collect();
    let (mut hits, mut wrong) = (0, 0);
    for t in threads {
        let (h, w) = t.join().unwrap();
        hits += h;
        wrong += w;
    }
    assert_eq!(wrong, 0, "hits with wrong bytes");
    let all: Vec<Vec<u8>> = (0..64).map(key).collect();
    let present = s.lookup(&all, false).unwrap().0.iter().filter(|&&p| p).count() as u64;
    let st = s.stats();
    assert!(st.entries <= capacity && present == st.entries, "{st:?}, {present} found");
    assert_eq!(st.integrity_failures, 0);
    let found = exact_hits(&e, &s, &all).iter().filter(|&&s| s == Status::Ok).count() as u64;
    assert_eq!(found, present);
    eprintln!("16 threads: {hits} exact hits, {st:?}");
}

/// A store of 4 keys in 2 shards, closed: its directory.
fn four_keys(e: &Arc<Engine>) -> PathBuf {
    let dir = store_dir();
    let s = Store::open(e, &dir, &store_cfg(8, b"ns")).unwrap();
    assert_eq!(put_keys(e, &s, &(0..4).map(key).collect::<Vec<_>>()), vec![Status::Ok; 4]);
    dir
}

/// Where slot `slot`'s block starts in its shard's file.
fn data_at(dir: &Path, slot: u64) -> (PathBuf, u64) {
    let path = dir.join(format!("data-{}", slot % 2));
    let stride = std::fs::metadata(&path).unwrap().len() / 4; // 8 slots over 2 shards
    (path, slot / 2 * stride)
}

#[test]
fn a_byte_flipped_in_a_data_slot_is_a_miss_for_its_key_alone() {
    let e = engine_arc();
    let dir = four_keys(&e);
    let keys: Vec<Vec<u8>> = (0..4).map(key).collect();
    let (path, off) = data_at(&dir, slot_of(&dir, &keys[2]));
    flip(&path, off + 700);
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    let st = exact_hits(&e, &s, &keys);
    assert_eq!(st, vec![Status::Ok, Status::Ok, Status::Integrity, Status::Ok]);
    let stats = s.stats();
    assert_eq!((stats.integrity_failures, stats.misses, stats.entries), (1, 1, 3), "counted, and the entry dropped");
    assert_eq!(exact_hits(&e, &s, &keys[2..3]), vec![Status::NotFound]);
    drop(s);
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    assert_eq!(s.stats().entries, 3, "the drop was recorded");
}

#[test]
fn a_byte_flipped_in_a_slot_record_is_a_miss_counted_on_open() {
    let e = engine_arc();
    let dir = four_keys(&e);
    let keys: Vec<Vec<u8>> = (0..4).map(key).collect();
    for (i, byte) in [(1, 20), (3, 45)] {
        flip(&dir.join("records"), slot_of(&dir, &keys[i]) * RECORD + byte);
    }
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    assert_eq!(s.stats().integrity_failures, 2);
    assert_eq!(exact_hits(&e, &s, &keys), vec![Status::Ok, Status::NotFound, Status::Ok, Status::NotFound]);
}

#[test]
fn a_records_file_cut_mid_record_loses_the_records_past_the_cut_only() {
    let e = engine_arc();
    let dir = four_keys(&e);
    let keys: Vec<Vec<u8>> = (0..4).map(key).collect();
    let slots: Vec<u64> = keys.iter().map(|k| slot_of(&dir, k)).collect();
    let cut = slots[1];
    std::fs::OpenOptions::new().write(true).open(dir.join("records")).unwrap().set_len(cut * RECORD + 30).unwrap();
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    assert_eq!(s.stats().integrity_failures, 1, "the cut record");
    let want: Vec<Status> = slots.iter().map(|&sl| if sl < cut { Status::Ok } else { Status::NotFound }).collect();
    assert_eq!(exact_hits(&e, &s, &keys), want);
    // The store goes on: new puts take the free slots.
    assert_eq!(put_keys(&e, &s, &keys), vec![Status::Ok; 4]);
    assert!(exact_hits(&e, &s, &keys).iter().all(|&st| st == Status::Ok));
}

#[test]
fn a_stale_entry_pointing_at_a_slot_reused_for_another_key_is_a_miss() {
    let e = engine_arc();
    let dir = store_dir();
    let one = StoreConfig { shards: 1, ..store_cfg(1, b"ns") };
    {
        let s = Store::open(&e, &dir, &one).unwrap();
        put_keys(&e, &s, &[key(1)]);
    }
    let old = std::fs::read(dir.join("records")).unwrap();
    {
        let s = Store::open(&e, &dir, &one).unwrap();
        s.remove(&[key(1)]).unwrap();
        assert_eq!(put_keys(&e, &s, &[key(2)]), vec![Status::Ok]);
    }
    // The old records: key 1 → slot 0, which now holds key 2's block.
    std::fs::write(dir.join("records"), &old).unwrap();
    let s = Store::open(&e, &dir, &one).unwrap();
    assert_eq!(s.lookup(&[key(1), key(2)], false).unwrap().0, vec![true, false]);
    let (st, _) = get_keys(&e, &s, &[key(1)]);
    assert_eq!(st, vec![Status::Integrity], "key 2's bytes are never served as key 1's");
    assert_eq!(s.stats().integrity_failures, 1);
    drop(s);
    // VERIFY_ON_OPEN finds it before any get.
    std::fs::write(dir.join("records"), &old).unwrap();
    let s = Store::open(&e, &dir, &StoreConfig { flags: StoreFlags::VERIFY_ON_OPEN, ..one }).unwrap();
    assert_eq!((s.stats().entries, s.stats().integrity_failures), (0, 1));
}

/// Cuts `file` of an open 1-shard store of 20 keys after block 9: a get of the ten keys
/// whose blocks are whole and one whose block or checksums were cut off, in one batch,
/// loads the ten; the one is an `Integrity` miss, its entry dropped, and put again it loads.
fn a_file_cut_while_open_fails_the_keys_past_the_cut_alone(file: &str) {
    let e = engine_arc();
    let dir = store_dir();
    let s = Store::open(&e, &dir, &StoreConfig { shards: 1, ..store_cfg(20, b"ns") }).unwrap();
    let keys: Vec<Vec<u8>> = (0..20).map(key).collect();
    assert_eq!(put_keys(&e, &s, &keys), vec![Status::Ok; 20]);
    let path = dir.join(file);
    let len = std::fs::metadata(&path).unwrap().len();
    // The sidecar: a 4096-byte header, then one entry per block; the data: blocks alone.
    let header = if file.ends_with(".kvxsum") { 4096 } else { 0 };
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(header + (len - header) / 20 * 10).unwrap();
    let (whole, cut): (Vec<Vec<u8>>, Vec<Vec<u8>>) = keys.iter().cloned().partition(|k| slot_of(&dir, k) < 10);
    let batch: Vec<Vec<u8>> = whole.iter().chain(&cut[..1]).cloned().collect();
    let dst = e.create_layout(&block(11), FC, StorageKind::Host).unwrap();
    let r = s.get(&batch, &dst, &(0..11).collect::<Vec<_>>(), &Default::default()).unwrap();
    wait(&r);
    let mut want = vec![Status::Ok; 10];
    want.push(Status::Integrity);
    assert_eq!(statuses(&r), want, "{file} cut: {}", r.key_message(10));
    assert!(r.key_message(10).contains("cut short"), "{}", r.key_message(10));
    assert!((0..10).all(|i| holds_key(&dst, i, &batch[i as usize])), "the whole keys load byte-exact");
    let st = s.stats();
    assert_eq!((st.entries, st.integrity_failures), (19, 1), "the cut key's entry dropped and counted: {st:?}");
    assert_eq!(exact_hits(&e, &s, &batch), [vec![Status::Ok; 10], vec![Status::NotFound]].concat(), "once dropped, a miss");
    assert_eq!(put_keys(&e, &s, &cut[..1]), vec![Status::Ok], "put again");
    assert_eq!(exact_hits(&e, &s, &batch), vec![Status::Ok; 11], "and loads");
}

#[test]
fn a_sidecar_cut_while_open_fails_the_keys_past_the_cut_alone() {
    a_file_cut_while_open_fails_the_keys_past_the_cut_alone("data-0.kvxsum");
}

#[test]
fn a_data_file_cut_while_open_fails_the_keys_past_the_cut_alone() {
    a_file_cut_while_open_fails_the_keys_past_the_cut_alone("data-0");
}

/// Damage to one shard of a closed store: `damage` changes the files of shard 1.
fn damaged_shard_costs_its_entries_alone(what: &str, damage: impl Fn(&Path)) {
    let e = engine_arc();
    let keys: Vec<Vec<u8>> = (0..4).map(key).collect();
    for verify in [false, true] {
        let dir = four_keys(&e);
        let in_shard_1: Vec<bool> = keys.iter().map(|k| slot_of(&dir, k) % 2 == 1).collect();
        let lost = in_shard_1.iter().filter(|&&b| b).count() as u64;
        assert!(lost > 0 && lost < 4, "keys in both shards: {in_shard_1:?}");
        damage(&dir);
        let data_only = Store::open(&e, &dir, &StoreConfig { flags: StoreFlags::DATA_ONLY, ..store_cfg(8, b"ns") });
        let err = data_only.err().unwrap_or_else(|| panic!("{what}: a data-only open of a damaged shard"));
        assert!(err.message.contains("owner") && !err.message.contains("KVX_DISK_CREATE"), "{what}: {}", err.message);
        let flags = if verify { StoreFlags::VERIFY_ON_OPEN } else { StoreFlags::NONE };
        let c = StoreConfig { flags, ..store_cfg(8, b"ns") };
        let s = Store::open(&e, &dir, &c).unwrap_or_else(|err| panic!("{what} (verify {verify}): {err}"));
        let st = s.stats();
        assert_eq!((st.entries, st.integrity_failures), (4 - lost, lost), "{what} (verify {verify}): {st:?}");
        let want: Vec<Status> = in_shard_1.iter().map(|&b| if b { Status::NotFound } else { Status::Ok }).collect();
        assert_eq!(exact_hits(&e, &s, &keys), want, "{what} (verify {verify})");
        drop(s);
        // The drop was recorded: reopened, the same entries and nothing counted again.
        let s = Store::open(&e, &dir, &c).unwrap();
        let st = s.stats();
        assert_eq!((st.entries, st.integrity_failures), (4 - lost, 0), "{what} (verify {verify}) reopened: {st:?}");
        assert_eq!(put_keys(&e, &s, &keys), vec![Status::Ok; 4]);
        assert_eq!(exact_hits(&e, &s, &keys), vec![Status::Ok; 4], "{what} (verify {verify}): put again");
        drop(s);
        let s = Store::open(&e, &dir, &c).unwrap();
        assert_eq!(exact_hits(&e, &s, &keys), vec![Status::Ok; 4], "{what} (verify {verify}): reopened after");
    }
}

fn set_len(path: &Path, len: u64) {
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(len).unwrap();
}

#[test]
fn a_data_file_cut_short_costs_its_shards_entries_alone() {
    damaged_shard_costs_its_entries_alone("data-1 cut", |dir| {
        let path = dir.join("data-1");
        set_len(&path, std::fs::metadata(&path).unwrap().len() * 3 / 4);
    });
    damaged_shard_costs_its_entries_alone("data-1 missing", |dir| std::fs::remove_file(dir.join("data-1")).unwrap());
}

#[test]
fn a_sidecar_cut_or_its_header_lost_costs_its_shards_entries_alone() {
    let sidecar = |dir: &Path| dir.join("data-1.kvxsum");
    damaged_shard_costs_its_entries_alone("sidecar cut after block 1", |dir| set_len(&sidecar(dir), 4096 + 40));
    damaged_shard_costs_its_entries_alone("sidecar header cut", |dir| set_len(&sidecar(dir), 20));
    damaged_shard_costs_its_entries_alone("sidecar missing", |dir| std::fs::remove_file(sidecar(dir)).unwrap());
    damaged_shard_costs_its_entries_alone("a byte of the sidecar's magic", |dir| flip(&sidecar(dir), 3));
    damaged_shard_costs_its_entries_alone("a byte of the sidecar's geometry", |dir| flip(&sidecar(dir), 16));
    // A power cut can keep the file's size and lose its first page.
    damaged_shard_costs_its_entries_alone("the sidecar's header zeroed", |dir| {
        std::fs::OpenOptions::new().write(true).open(sidecar(dir)).unwrap().write_all_at(&[0; 4096], 0).unwrap()
    });
}

/// Only `meta` damaged refuses the store (nothing else says what its files hold), and the
/// refusal says what to do with it.
#[test]
fn a_damaged_meta_refuses_the_store_saying_what_to_do() {
    let e = engine_arc();
    for (byte, status) in [(8, Status::Version), (30, Status::Integrity)] {
        let dir = four_keys(&e);
        flip(&dir.join("meta"), byte);
        let err = Store::open(&e, &dir, &store_cfg(8, b"ns")).err().expect("a damaged meta is refused");
        assert_eq!(err.status, status, "{}", err.message);
        assert!(err.message.contains("remove the directory"), "byte {byte}: {}", err.message);
    }
}

/// A records file removed by hand loses the entries, not the store: it opens empty.
#[test]
fn a_store_whose_records_file_is_missing_opens_empty() {
    let e = engine_arc();
    let dir = four_keys(&e);
    std::fs::remove_file(dir.join("records")).unwrap();
    let keys: Vec<Vec<u8>> = (0..4).map(key).collect();
    let s = Store::open(&e, &dir, &StoreConfig { flags: StoreFlags::VERIFY_ON_OPEN, ..store_cfg(8, b"ns") }).unwrap();
    assert_eq!(s.stats().entries, 0);
    assert_eq!(exact_hits(&e, &s, &keys), vec![Status::NotFound; 4]);
    assert_eq!(put_keys(&e, &s, &keys), vec![Status::Ok; 4]);
    drop(s);
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    assert_eq!(exact_hits(&e, &s, &keys), vec![Status::Ok; 4]);
}

#[test]
fn a_durable_store_round_trips_and_reopens() {
    let e = engine_arc();
    let dir = store_dir();
    let c = StoreConfig { flags: StoreFlags::CREATE | StoreFlags::DURABLE | StoreFlags::BUFFERED, ..store_cfg(4, b"ns") };
    let keys: Vec<Vec<u8>> = (0..6).map(key).collect();
    {
        let s = Store::open(&e, &dir, &c).unwrap();
        assert_eq!(put_keys(&e, &s, &keys[..4]), vec![Status::Ok; 4]);
        assert_eq!(put_keys(&e, &s, &keys[4..]), vec![Status::Ok; 2], "two evicted");
        assert_eq!(s.stats().evictions, 2);
    }
    let s = Store::open(&e, &dir, &c).unwrap();
    let st = exact_hits(&e, &s, &keys);
    assert_eq!(st.iter().filter(|&&s| s == Status::Ok).count(), 4);
    assert_eq!(&st[4..], &[Status::Ok, Status::Ok]);
}

/// A child forked without exec (a Python worker, say) gets none of the owner's lock: once
/// the owner closes the store, it opens again while that child lives.
#[test]
fn a_forked_child_does_not_keep_the_owners_lock() {
    let e = engine_arc();
    let dir = store_dir();
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    // SAFETY: the child only sleeps and exits, both async-signal-safe.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        unsafe {
            libc::sleep(30);
            libc::_exit(0);
        }
    }
    assert!(pid > 0, "fork failed");
    drop(s);
    let reopened = Store::open(&e, &dir, &store_cfg(8, b"ns"));
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
    assert!(reopened.is_ok(), "{:?}", reopened.err());
}

/// A child forked without exec shares the owner's open (its epoch and generations), so
/// handles it reserved would have the same write identities as the parent's: every owner
/// call there is refused, and the parent's store goes on.
#[test]
fn a_forked_child_cannot_use_its_parents_owner_store() {
    let e = engine_arc();
    let dir = store_dir();
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    // SAFETY: the child makes store calls that take the store's locks (free at the fork:
    // no other thread calls the store) and allocate (glibc's malloc is reset in a forked
    // child); an alarm ends it if it hangs anyway.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        unsafe { libc::alarm(30) };
        let refused = |st: Option<Status>| st == Some(Status::InvalidArg);
        let ok = refused(s.reserve_slots(&[b"k"]).err().map(|e| e.status)) && refused(s.lookup(&[b"k"], false).err().map(|e| e.status));
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    assert!(pid > 0, "fork failed");
    let mut status = 0;
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child used the owner's store (wait status {status})");
    assert!(matches!(s.reserve_slots(&[b"k"]).unwrap()[0], Reservation::Write(_)), "the parent's store goes on");
}

/// A store request waited on inside a completion callback of its engine is refused, as a
/// transfer's is: the callback holds a thread of the engine (here its only I/O worker)
/// that the get may need, so the wait could never end. Polling it there (timeout 0) is
/// not refused, and the get loads once the callback has returned.
#[test]
fn a_store_request_waited_on_in_a_completion_callback_is_refused() {
    let e = Arc::new(engine_with(|c| c.io_threads = 1));
    let s = Arc::new(Store::open(&e, &store_dir(), &store_cfg(8, b"ns")).unwrap());
    assert_eq!(put_keys(&e, &s, &[key(0)]), vec![Status::Ok]);
    let dst = e.create_layout(&block(1), FC, StorageKind::Host).unwrap();
    let seen = Arc::new(std::sync::Mutex::new(None));
    let (store, into, saw) = (s.clone(), dst.clone(), seen.clone());
    let look = move |_: &kvxfer::Request, _| {
        let r = store.get(&[key(0)], &into, &[0], &Default::default()).unwrap();
        // Bounded: a wait that is not refused fails the test instead of hanging it.
        let waited = r.wait(Some(Duration::from_secs(5)));
        let polled = r.wait(Some(Duration::ZERO));
        *saw.lock().unwrap() = Some((waited, polled, r));
    };
    let (a, b) = (e.create_layout(&block(1), FC, StorageKind::Host).unwrap(), e.create_layout(&block(1), FC, StorageKind::Host).unwrap());
    let opts = kvxfer::TransferOptions { on_complete: Some(Arc::new(look)), ..Default::default() };
    assert_eq!(e.submit(&a, &[0], &b, &[0], &opts).unwrap().wait(Some(Duration::from_secs(60))), Status::Ok);
    let (waited, polled, r) = seen.lock().unwrap().take().expect("the callback ran");
    assert_eq!(waited, Status::InvalidArg, "a wait inside the engine's callback");
    assert_ne!(polled, Status::InvalidArg, "a poll inside the engine's callback");
    assert_eq!(wait(&r), Status::Ok, "{}", r.key_message(0));
    assert!(holds_key(&dst, 0, &key(0)));
}

/// A batch's held keys are used, not evicted to make room for its new ones.
#[test]
fn a_put_never_evicts_a_key_of_its_own_batch() {
    let e = engine_arc();
    let s = Store::open(&e, &store_dir(), &StoreConfig { shards: 1, ..store_cfg(2, b"ns") }).unwrap();
    put_keys(&e, &s, &[key(1), key(2)]);
    let before = s.stats();
    // 1 is the least recently used; 3 comes before it in the batch.
    assert_eq!(put_keys(&e, &s, &[key(3), key(1)]), vec![Status::Ok, Status::Ok]);
    let after = s.stats();
    assert_eq!((after.puts - before.puts, after.dedups - before.dedups, after.evictions), (1, 1, 1), "{after:?}");
    assert_eq!(s.lookup(&[key(1), key(2), key(3)], false).unwrap().0, vec![true, false, true]);
}

fn handle_line(tag: &str, k: u64, h: &SlotHandle) -> String {
    format!("{tag} {k} {} {} {:x} {} {} {}\n", h.slot, h.generation, h.key_digest, h.key_len, h.seal, h.epoch)
}

fn parse_handles(text: &str, tag: &str) -> Vec<(u64, SlotHandle)> {
    text.lines()
        .filter(|l| l.starts_with(tag))
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let h = SlotHandle {
                slot: f[2].parse().unwrap(),
                generation: f[3].parse().unwrap(),
                key_digest: u128::from_str_radix(f[4], 16).unwrap(),
                key_len: f[5].parse().unwrap(),
                seal: f[6].parse().unwrap(),
                epoch: f[7].parse().unwrap(),
            };
            (f[1].parse().unwrap(), h)
        })
        .collect()
}

/// The data-moving half of the split test, in its own process: opens the store DATA_ONLY,
/// reads the leased slots it was handed and writes the reserved ones.
#[test]
#[ignore = "run by an_owner_and_a_data_only_process_move_blocks_through_slot_handles in a child process"]
fn store_data_mover() {
    let dir = PathBuf::from(std::env::var_os("KVX_STORE_SPLIT_DIR").expect("run by the split test"));
    let text = std::fs::read_to_string(dir.join("handles")).unwrap();
    let (reads, writes) = (parse_handles(&text, "R"), parse_handles(&text, "W"));
    let e = engine_arc();
    let err = Store::open(&e, &dir, &store_cfg(8, b"ns")).err().unwrap();
    assert_eq!(err.status, Status::Busy, "{}", err.message);
    let data = StoreConfig { flags: StoreFlags::DATA_ONLY, ..store_cfg(8, b"ns") };
    let s = Store::open(&e, &dir, &data).unwrap();
    assert_eq!(s.lookup(&[key(0)], false).unwrap_err().status, Status::InvalidArg, "the index is the owner's");
    // The handed-out slots load exactly, into a device layout of vLLM's shape.
    let dst = e.create_layout(&block(8), VLLM, StorageKind::Device).unwrap();
    let handles: Vec<SlotHandle> = reads.iter().map(|r| r.1).collect();
    let ids: Vec<u64> = (0..handles.len() as u64).collect();
    let r = s.read_slots(&handles, &dst, &ids, &Default::default()).unwrap();
    assert_eq!(wait(&r), Status::Ok, "{}", r.key_message(0));
    for (i, (k, _)) in reads.iter().enumerate() {
        assert!(holds_key(&dst, i as u64, &key(*k)), "slot of key {k}");
    }
    // A handle that no longer names the slot's entry is a miss, not another key's bytes,
    // and its status says the handle is stale (not that the store is damaged).
    let stale = SlotHandle { generation: handles[0].generation + 100, ..handles[0] };
    let r = s.read_slots(&[stale], &dst, &[7], &Default::default()).unwrap();
    assert_eq!(wait(&r), Status::InvalidArg, "{}", r.key_message(0));
    assert!(r.key_message(0).contains("stale"), "{}", r.key_message(0));
    let wrong_key = SlotHandle { key_digest: handles[1].key_digest ^ 1, ..handles[0] };
    let r = s.read_slots(&[wrong_key], &dst, &[7], &Default::default()).unwrap();
    assert_eq!(wait(&r), Status::InvalidArg, "{}", r.key_message(0));
    // A write handle, or a zeroed one, names no entry to read: the call is refused whole.
    for h in [SlotHandle { seal: 0, ..handles[0] }, SlotHandle { slot: 0, generation: 0, key_digest: 0, key_len: 0, seal: 0, epoch: 0 }] {
        let err = s.read_slots(&[h], &dst, &[7], &Default::default()).map(|_| ()).unwrap_err();
        assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
    }
    assert_eq!(s.stats().integrity_failures, 0, "a stale handle is not damage");
    // The reserved slots are written from a device layout.
    let src = e.create_layout(&block(8), VLLM, StorageKind::Device).unwrap();
    for (i, (k, _)) in writes.iter().enumerate() {
        fill_block_for_key(&src, i as u64, &key(*k));
    }
    let handles: Vec<SlotHandle> = writes.iter().map(|w| w.1).collect();
    let ids: Vec<u64> = (0..handles.len() as u64).collect();
    let r = s.write_slots(&src, &ids, &handles, &Default::default()).unwrap();
    assert_eq!(wait(&r), Status::Ok, "{}", r.key_message(0));
}

#[test]
fn an_owner_and_a_data_only_process_move_blocks_through_slot_handles() {
    let e = engine_arc();
    let dir = store_dir();
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    let held: Vec<Vec<u8>> = (0..4).map(key).collect();
    assert_eq!(put_keys(&e, &s, &held), vec![Status::Ok; 4]);
    let mut text = String::new();
    for (k, h) in s.lease_slots(&held).unwrap().into_iter().enumerate() {
        text += &handle_line("R", k as u64, &h.expect("held keys have handles"));
    }
    let new: Vec<Vec<u8>> = (10..13).map(key).collect();
    let mut writes = Vec::new();
    let reserved = s.reserve_slots(&[new.clone(), vec![key(0)]].concat()).unwrap();
    assert_eq!(reserved[3], Reservation::Held);
    for (i, r) in reserved[..3].iter().enumerate() {
        let Reservation::Write(h) = r else { panic!("key {}: {r:?}", 10 + i) };
        text += &handle_line("W", 10 + i as u64, h);
        writes.push(*h);
    }
    assert!(s.lookup(&new, false).unwrap().0.iter().all(|&p| !p), "not entries before the commit");
    std::fs::write(dir.join("handles"), text).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "store_data_mover", "--test-threads", "1"])
        .env("KVX_STORE_SPLIT_DIR", &dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "the data process failed:\n{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(s.commit_slots(&writes).unwrap(), vec![Status::Ok; 3]);
    assert_eq!(s.commit_slots(&writes[..1]).unwrap(), vec![Status::InvalidArg], "committed once");
    assert!(exact_hits(&e, &s, &new).iter().all(|&st| st == Status::Ok));
    s.release_leases(&held).unwrap();
    // An aborted reservation leaves no entry and gives its slot back.
    let Reservation::Write(h) = s.reserve_slots(&[key(20)]).unwrap()[0] else { panic!("a slot for key 20") };
    s.abort_slots(&[h]).unwrap();
    assert_eq!(s.lookup(&[key(20)], false).unwrap().0, vec![false]);
    let r = s.reserve_slots(&[key(21)]).unwrap();
    assert!(matches!(r[0], Reservation::Write(w) if w.slot == h.slot), "{r:?}");
    s.abort_slots(&[r.iter().find_map(|r| if let Reservation::Write(w) = r { Some(*w) } else { None }).unwrap()]).unwrap();
    // A reservation committed unwritten is a miss, not an entry over the slot's old bytes.
    let old = s.lease_slots(&[key(1)]).unwrap()[0].unwrap();
    s.release_leases(&[key(1)]).unwrap();
    assert_eq!(s.remove(&[key(1)]).unwrap(), vec![Status::Ok]);
    let Reservation::Write(w) = s.reserve_slots(&[key(22)]).unwrap()[0] else { panic!("a slot for key 22") };
    assert_eq!(w.slot, old.slot, "the removed key's slot, which holds its sealed block");
    assert_eq!(s.commit_slots(&[w]).unwrap(), vec![Status::Integrity]);
    assert_eq!(s.lookup(&[key(22)], false).unwrap().0, vec![false]);
}

/// A directory without `meta` (its making was cut short) is made afresh: nothing found in
/// it comes back as an entry over the new, empty data files.
#[test]
fn a_store_made_again_where_meta_is_missing_starts_empty() {
    let e = engine_arc();
    let dir = four_keys(&e);
    std::fs::remove_file(dir.join("meta")).unwrap();
    let s = Store::open(&e, &dir, &store_cfg(8, b"ns")).unwrap();
    let st = s.stats();
    assert_eq!((st.entries, st.integrity_failures), (0, 0), "{st:?}");
    assert!(exact_hits(&e, &s, &(0..4).map(key).collect::<Vec<_>>()).iter().all(|&st| st == Status::NotFound));
}

/// A handle listed twice, or committed and aborted by two threads, settles once: the
/// second claim is refused, and the store goes on (a second settling of one slot would
/// panic under the index's lock, poisoning it, and leave close waiting forever).
#[test]
fn a_handle_listed_twice_is_committed_or_aborted_once() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let e = engine_arc();
        let s = Store::open(&e, &store_dir(), &store_cfg(8, b"ns")).unwrap();
        let Reservation::Write(h) = s.reserve_slots(&[key(30)]).unwrap()[0] else { panic!("a slot for key 30") };
        let committed = s.commit_slots(&[h, h]).unwrap();
        let Reservation::Write(h) = s.reserve_slots(&[key(31)]).unwrap()[0] else { panic!("a slot for key 31") };
        // The first is aborted; the second names a reservation no longer there.
        let aborted = s.abort_slots(&[h, h]).map_err(|e| e.status);
        assert_eq!(aborted, Err(Status::InvalidArg), "the same handle again");
        assert_eq!(s.lookup(&[key(31)], false).unwrap().0, [false]);
        let put = put_keys(&e, &s, &[key(32)]);
        drop(s);
        tx.send((committed, put)).unwrap();
    });
    let (committed, put) = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the store panicked or hung");
    assert_eq!(committed, vec![Status::Integrity, Status::InvalidArg], "an unwritten slot, then the same handle again");
    assert_eq!(put, vec![Status::Ok]);
}
