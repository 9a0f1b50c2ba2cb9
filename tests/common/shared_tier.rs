//! Stores over the shared tier, for the suites over a shared directory and over S3: keyed
//! blocks put and got back with every hit checked exact, and the torture of processes
//! killed at random, run over whichever location the suite gives it.

use super::{engine, fill, fill_block_for_key, holds_key, temp_dir};
use kvxfer::shared::SharedConfig;
use kvxfer::store::{Store, StoreConfig, StoreRequest};
use kvxfer::{Engine, LayoutConfig, LayoutKind, Status, StorageKind};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The namespace the suites' stores use.
pub const NS: &[u8] = b"model-a tp0";

/// One block: 2 layers × K/V × 4 tokens × 64 elements × 2 bytes.
pub fn block(num_blocks: u64) -> LayoutConfig {
    super::cfg(num_blocks, 2, 2, 4, 64, 2)
}

pub fn keys(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("prefix-block-{i}").into_bytes()).collect()
}

/// Each key's status once the request ends.
pub fn wait(r: &StoreRequest) -> Vec<Status> {
    outcomes(r).into_iter().map(|(st, _)| st).collect()
}

/// Each key's status and message once the request ends.
pub fn outcomes(r: &StoreRequest) -> Vec<(Status, String)> {
    r.wait(Some(Duration::from_secs(60)));
    assert_ne!(r.poll(), Status::Pending, "a store request did not end");
    (0..r.len()).map(|i| (r.key_status(i).unwrap(), r.key_message(i))).collect()
}

/// Puts each key's own bytes (`fill_block_for_key`) under it.
pub fn put(e: &Engine, s: &Store, keys: &[Vec<u8>]) -> Vec<Status> {
    put_outcomes(e, s, keys).into_iter().map(|(st, _)| st).collect()
}

/// As `put`: each key's status and message.
pub fn put_outcomes(e: &Engine, s: &Store, keys: &[Vec<u8>]) -> Vec<(Status, String)> {
    let src = e.create_layout(&block(keys.len() as u64), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    for (i, k) in keys.iter().enumerate() {
        fill_block_for_key(&src, i as u64, k);
    }
    let ids: Vec<u64> = (0..keys.len() as u64).collect();
    outcomes(&s.put(&src, &ids, keys, &Default::default()).unwrap())
}

/// Gets `keys` into a vLLM-shaped host layout (`[2, num_blocks, …]` per layer); each key's
/// status, after checking that every hit holds exactly its key's bytes.
pub fn get_exact(e: &Engine, s: &Store, keys: &[Vec<u8>]) -> Vec<Status> {
    get_outcomes(e, s, keys).into_iter().map(|(st, _)| st).collect()
}

/// `get_exact` into memory of kind `storage`.
pub fn get_exact_in(e: &Engine, s: &Store, keys: &[Vec<u8>], storage: StorageKind) -> Vec<Status> {
    get_outcomes_in(e, s, keys, storage).into_iter().map(|(st, _)| st).collect()
}

/// As `get_exact`: each key's status and message.
pub fn get_outcomes(e: &Engine, s: &Store, keys: &[Vec<u8>]) -> Vec<(Status, String)> {
    get_outcomes_in(e, s, keys, StorageKind::Host)
}

/// As `get_exact_in`: each key's status and message.
pub fn get_outcomes_in(e: &Engine, s: &Store, keys: &[Vec<u8>], storage: StorageKind) -> Vec<(Status, String)> {
    let dst = e.create_layout(&block(keys.len() as u64), LayoutKind::LayerSeparate { block_first: false }, storage).unwrap();
    fill(&dst, 99);
    let ids: Vec<u64> = (0..keys.len() as u64).rev().collect();
    let st = outcomes(&s.get(keys, &dst, &ids, &Default::default()).unwrap());
    for (i, k) in keys.iter().enumerate() {
        if st[i].0 == Status::Ok {
            assert!(holds_key(&dst, ids[i], k), "key {} loaded with bytes that are not its own", String::from_utf8_lossy(k));
        }
    }
    st
}

/// Keys the torture's processes share.
const TORTURE_KEYS: u64 = 120;
/// What the torture tells each child: its own local store, its log, its random seed.
const LOCAL: &str = "KVX_TORTURE_LOCAL";
const LOG: &str = "KVX_TORTURE_LOG";
const SEED: &str = "KVX_TORTURE_SEED";

fn torture_key(i: u64) -> Vec<u8> {
    format!("torture-{i}").into_bytes()
}

/// A child of the torture, over `shared` (written through): puts and gets random batches
/// of the shared keys over a small local store, so most gets read the shared tier, until it
/// is killed. It logs each acknowledged put (`acked <i>`) and stops at the first wrong byte
/// (a panic) or failed check (exit status 3).
pub fn torture_child(shared: SharedConfig) -> ! {
    let (Some(local), Some(log), Some(seed)) = (std::env::var_os(LOCAL), std::env::var_os(LOG), std::env::var(SEED).ok()) else {
        panic!("a torture child runs with {LOCAL}, {LOG} and {SEED} set by its parent");
    };
    use std::io::Write;
    let mut log = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    let e = Arc::new(engine());
    let s = Store::open(&e, local.as_ref(), &StoreConfig { shared: Some(shared), ..StoreConfig::new(block(0), 8, NS) }).unwrap();
    let mut x = seed.parse::<u64>().unwrap() | 1;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    loop {
        let mut ids: Vec<u64> = (0..1 + next(6)).map(|_| next(TORTURE_KEYS)).collect();
        ids.sort_unstable();
        ids.dedup();
        let ks: Vec<Vec<u8>> = ids.iter().map(|&i| torture_key(i)).collect();
        if next(2) == 0 {
            for (i, st) in ids.iter().zip(put(&e, &s, &ks)) {
                if st == Status::Ok {
                    writeln!(log, "acked {i}").unwrap();
                }
            }
        } else {
            get_exact(&e, &s, &ks);
            let failures = s.stats().shared.integrity_failures;
            if failures > 0 {
                writeln!(log, "integrity failures {failures}").unwrap();
                std::process::exit(3);
            }
        }
    }
}

/// 8 processes, each started by `child` (a command that ends in `torture_child` over the
/// same location as `shared`), put and get overlapping keys while one is SIGKILLed and
/// restarted every few hundred milliseconds: for `KVX_SHARED_TORTURE_SECS` (20 by default)
/// and at least 50 kills. No child may stop by itself (a wrong byte or a failed check);
/// then a store over `shared` reads every acknowledged put bit-exact, with no failed check.
pub fn torture(child: impl Fn() -> Command, shared: SharedConfig) {
    let secs: u64 = std::env::var("KVX_SHARED_TORTURE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let work = temp_dir("shared-torture");
    let children = 8;
    let log = |k: usize| work.join(format!("log-{k}"));
    let spawn = |k: usize, round: u64| -> Child {
        child()
            .env(LOCAL, work.join(format!("local-{k}")))
            .env(LOG, log(k))
            .env(SEED, (round * 1000 + k as u64 + 1).to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut procs: Vec<Child> = (0..children).map(|k| spawn(k, 0)).collect();
    let (start, mut kills, mut round) = (Instant::now(), 0u64, 1u64);
    while start.elapsed() < Duration::from_secs(secs) || kills < 50 {
        std::thread::sleep(Duration::from_millis(40 + (round * 37) % 200));
        let k = (round as usize * 5) % children;
        if let Some(status) = procs[k].try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut procs[k].stderr.take().unwrap(), &mut err).unwrap();
            panic!("torture child {k} stopped by itself ({status}):\n{err}");
        }
        procs[k].kill().unwrap();
        procs[k].wait().unwrap();
        kills += 1;
        procs[k] = spawn(k, round);
        round += 1;
    }
    for p in &mut procs {
        if let Some(status) = p.try_wait().unwrap() {
            panic!("a torture child stopped by itself ({status})");
        }
        p.kill().unwrap();
        p.wait().unwrap();
    }
    let mut acked = std::collections::BTreeSet::new();
    for k in 0..children {
        let log = std::fs::read_to_string(log(k)).unwrap_or_default();
        acked.extend(log.lines().filter_map(|l| l.strip_prefix("acked ")).filter_map(|i| i.parse::<u64>().ok()));
    }
    let e = Arc::new(engine());
    let cfg = StoreConfig { shards: 2, shared: Some(shared), ..StoreConfig::new(block(0), 64, NS) };
    let s = Store::open(&e, &work.join("local-check"), &cfg).unwrap();
    let ks: Vec<Vec<u8>> = (0..TORTURE_KEYS).map(torture_key).collect();
    let st = get_exact(&e, &s, &ks);
    for &i in &acked {
        assert_eq!(st[i as usize], Status::Ok, "key {i}'s put was acknowledged, yet it is not readable");
    }
    assert_eq!(s.stats().shared.integrity_failures, 0, "a reader saw a partial or damaged object");
    assert!(acked.len() > 10, "the children acknowledged only {} keys", acked.len());
    eprintln!("shared torture: {kills} kills in {:?}, {} keys acknowledged", start.elapsed(), acked.len());
    drop(s);
    let _ = std::fs::remove_dir_all(work);
}
