//! The shared tier's S3 backend against a real S3 server (moto's, tests/common/s3.rs): its
//! calls, what opening refuses, and its bounds when the server is killed or stalls. Where
//! the server's venv is missing the tests are reported skipped.

mod common;
use common::cases::{case, run};
use common::s3::{free_port, why_no_server, S3Server};
use common::*;
use kvxfer::shared::{Backend, Location, S3Backend, S3Location, SharedConfig, WriteMode};
use kvxfer::store::{Store, StoreConfig, StoreRequest};
use kvxfer::{Engine, LayoutConfig, LayoutKind, Status, StorageKind};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Each call's bound in these tests; a call is checked to return within `SLACK` times it.
const TIMEOUT: Duration = Duration::from_secs(2);
const SLACK: u32 = 3;
const SECRET: &str = "kvx-test-secret-never-shown";

fn main() {
    // Before any thread: the credentials every backend here reads, and nothing of the
    // environment's own AWS settings.
    std::env::set_var("AWS_ACCESS_KEY_ID", "kvx-test");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", SECRET);
    for v in ["AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION"] {
        std::env::remove_var(v);
    }
    let why_not = why_no_server();
    let cases = vec![
        case("objects_round_trip_and_are_removed", objects_round_trip_and_are_removed),
        case("an_object_one_backend_writes_another_reads", an_object_one_backend_writes_another_reads),
        case("a_wrong_length_object_reports_its_length", a_wrong_length_object_reports_its_length),
        case("open_refuses_a_missing_bucket", open_refuses_a_missing_bucket),
        case("open_refuses_credentials_the_server_rejects", open_refuses_credentials_the_server_rejects),
        case("open_refuses_an_endpoint_that_is_down", open_refuses_an_endpoint_that_is_down),
        case(
            "a_killed_server_fails_calls_in_time_and_a_restarted_one_serves",
            a_killed_server_fails_calls_in_time_and_a_restarted_one_serves,
        ),
        case("a_stopped_server_times_calls_out_and_serves_once_resumed", a_stopped_server_times_calls_out_and_serves_once_resumed),
        case("a_prefix_one_store_puts_another_loads_bit_exact_over_s3", a_prefix_one_store_puts_another_loads_bit_exact_over_s3),
        case(
            "a_stopped_server_makes_a_stores_loads_misses_in_time_then_serves",
            a_stopped_server_makes_a_stores_loads_misses_in_time_then_serves,
        ),
    ];
    run(cases.into_iter().map(|c| c.unless(why_not.clone())).collect())
}

fn location(s: &S3Server, bucket: &str, prefix: &str) -> S3Location {
    S3Location { endpoint: s.endpoint(), region: "us-east-1".into(), bucket: bucket.into(), prefix: prefix.into() }
}

/// A server with bucket `bucket`, and a backend on it.
fn server_with(bucket: &str, prefix: &str) -> (S3Server, S3Backend) {
    let s = S3Server::start();
    s.create_bucket(bucket);
    let b = S3Backend::open(&location(&s, bucket, prefix), TIMEOUT).expect("opening the bucket");
    (s, b)
}

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Reads `name` into buffers of the given sizes: its length and the bytes read.
fn read(b: &S3Backend, name: &str, header: usize, payload: usize) -> Option<(u64, Vec<u8>)> {
    let (mut h, mut p) = (vec![0u8; header], vec![0u8; payload]);
    b.read(name, &mut h, &mut p).expect("read").map(|n| (n, [h, p].concat()))
}

/// `f`'s result, checked to have come within the bound.
fn within_bound<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let t0 = Instant::now();
    let r = f();
    assert!(t0.elapsed() < TIMEOUT * SLACK, "{what} took {:?}, past {:?}", t0.elapsed(), TIMEOUT * SLACK);
    r
}

fn objects_round_trip_and_are_removed() {
    let (_s, b) = server_with("kvx-round-trip", "tier/a/");
    let (h, p) = (bytes(512, 1), bytes(300_000, 2));
    assert!(!b.exists("ab/one").unwrap());
    assert_eq!(read(&b, "ab/one", 512, 300_000), None);
    b.write("ab/one", &h, &p).unwrap();
    assert!(b.exists("ab/one").unwrap());
    assert_eq!(read(&b, "ab/one", 512, 300_000), Some((300_512, [h.clone(), p.clone()].concat())));
    // A second write replaces the first.
    let p2 = bytes(300_000, 3);
    b.write("ab/one", &h, &p2).unwrap();
    assert_eq!(read(&b, "ab/one", 512, 300_000), Some((300_512, [h, p2].concat())));
    b.remove("ab/one").unwrap();
    assert!(!b.exists("ab/one").unwrap());
    assert_eq!(read(&b, "ab/one", 512, 300_000), None);
    b.remove("ab/one").expect("removing what is not there is no error");
    assert!(b.describe().contains("kvx-round-trip") && b.describe().contains(&_s.endpoint()), "{}", b.describe());
}

fn an_object_one_backend_writes_another_reads() {
    let (s, writer) = server_with("kvx-two-backends", "shared");
    let reader = S3Backend::open(&location(&s, "kvx-two-backends", "/shared/"), TIMEOUT).unwrap();
    let other_prefix = S3Backend::open(&location(&s, "kvx-two-backends", "elsewhere"), TIMEOUT).unwrap();
    let (h, p) = (bytes(512, 4), bytes(4096, 5));
    writer.write("cd/two", &h, &p).unwrap();
    assert_eq!(read(&reader, "cd/two", 512, 4096), Some((4608, [h, p].concat())));
    assert!(!other_prefix.exists("cd/two").unwrap(), "a prefix holds its own objects only");
    reader.remove("cd/two").unwrap();
    assert!(!writer.exists("cd/two").unwrap());
}

fn a_wrong_length_object_reports_its_length() {
    let (_s, b) = server_with("kvx-wrong-length", "");
    b.write("ef/three", &bytes(512, 6), &bytes(1000, 7)).unwrap();
    // Buffers shorter and longer than the object: its true length, nothing written past them.
    let (mut h, mut p) = (vec![0u8; 512], vec![0u8; 500]);
    assert_eq!(b.read("ef/three", &mut h, &mut p).unwrap(), Some(1512));
    assert_eq!(read(&b, "ef/three", 512, 2000).map(|(n, _)| n), Some(1512));
    assert_eq!(read(&b, "ef/three", 0, 0).map(|(n, _)| n), Some(1512));
    assert_eq!(read(&b, "ef/three", 512, 1000), Some((1512, [bytes(512, 6), bytes(1000, 7)].concat())));
}

fn open_refuses_a_missing_bucket() {
    let s = S3Server::start();
    s.create_bucket("kvx-some-bucket");
    let e = S3Backend::open(&location(&s, "kvx-no-such-bucket", ""), TIMEOUT).err().expect("a missing bucket is refused");
    assert_eq!(e.status, Status::InvalidArg, "{e}");
    assert!(e.to_string().contains("kvx-no-such-bucket does not exist"), "{e}");
}

fn open_refuses_credentials_the_server_rejects() {
    let s = S3Server::start_checking_credentials();
    let e = S3Backend::open(&location(&s, "kvx-any-bucket", ""), TIMEOUT).err().expect("rejected credentials are refused");
    assert_eq!(e.status, Status::InvalidArg, "{e}");
    let m = e.to_string();
    assert!(m.contains("refused the credentials") && m.contains("AWS_ACCESS_KEY_ID") && m.contains("AWS_SECRET_ACCESS_KEY"), "{m}");
    assert!(!m.contains(SECRET), "the message shows the secret: {m}");
}

fn open_refuses_an_endpoint_that_is_down() {
    let loc = S3Location { endpoint: format!("http://127.0.0.1:{}", free_port()), bucket: "kvx-bucket".into(), ..Default::default() };
    let e = within_bound("opening a down endpoint", || S3Backend::open(&loc, TIMEOUT)).err().expect("a down endpoint is refused");
    assert_eq!(e.status, Status::Io, "{e}");
    assert!(e.to_string().contains(&loc.endpoint) && e.to_string().contains("cannot be reached"), "{e}");
    assert!(e.to_string().contains("credentials from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"), "{e}");
}

/// Every call fails, each within the bound.
fn all_calls_fail_in_time(b: &S3Backend, name: &str) {
    let (h, p) = (bytes(512, 8), bytes(2 << 20, 9));
    within_bound("exists", || b.exists(name)).expect_err("exists");
    within_bound("read", || b.read(name, &mut vec![0; 512], &mut vec![0; 2 << 20])).expect_err("read");
    within_bound("write", || b.write(name, &h, &p)).expect_err("write");
    within_bound("remove", || b.remove(name)).expect_err("remove");
}

fn a_killed_server_fails_calls_in_time_and_a_restarted_one_serves() {
    let (mut s, b) = server_with("kvx-killed", "k");
    let (h, p) = (bytes(512, 10), bytes(2 << 20, 11));
    b.write("gh/four", &h, &p).unwrap();
    s.kill();
    all_calls_fail_in_time(&b, "gh/four");
    // A restarted moto is empty: the bucket again, then the same backend serves.
    s.restart();
    s.create_bucket("kvx-killed");
    b.write("gh/four", &h, &p).unwrap();
    assert_eq!(read(&b, "gh/four", 512, 2 << 20), Some(((2 << 20) + 512, [h, p].concat())));
}

fn a_stopped_server_times_calls_out_and_serves_once_resumed() {
    let (s, b) = server_with("kvx-stopped", "");
    let (h, p) = (bytes(512, 12), bytes(2 << 20, 13));
    b.write("ij/five", &h, &p).unwrap();
    s.pause(true);
    let e = within_bound("a read from a stopped server", || b.read("ij/five", &mut vec![0; 512], &mut vec![0; 2 << 20])).unwrap_err();
    assert_eq!(e.status, Status::Timeout, "{e}");
    // Another name: the server may still carry out, once resumed, what it was sent.
    all_calls_fail_in_time(&b, "ij/other");
    s.pause(false);
    assert_eq!(read(&b, "ij/five", 512, 2 << 20), Some(((2 << 20) + 512, [h, p].concat())));
    b.remove("ij/five").unwrap();
    assert!(!b.exists("ij/five").unwrap());
}

/// One block: 2 layers × K/V × 4 tokens × 64 elements × 2 bytes.
fn block(num_blocks: u64) -> LayoutConfig {
    cfg(num_blocks, 2, 2, 4, 64, 2)
}

/// A store in a fresh local directory over the bucket.
fn store_over(e: &Arc<Engine>, s: &S3Server, bucket: &str, write: WriteMode) -> Store {
    let shared = SharedConfig { write, timeout: TIMEOUT, ..SharedConfig::new(Location::S3(location(s, bucket, "kv/"))) };
    let cfg = StoreConfig { shared: Some(shared), ..StoreConfig::new(block(0), 64, b"model-a tp0") };
    Store::open(e, &temp_dir("s3-local"), &cfg).expect("opening a store over the bucket")
}

fn statuses(r: &StoreRequest) -> Vec<Status> {
    r.wait(Some(Duration::from_secs(60)));
    assert_ne!(r.poll(), Status::Pending, "a store request did not end");
    (0..r.len()).map(|i| r.key_status(i).unwrap()).collect()
}

fn prefix_keys(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("prefix-block-{i}").into_bytes()).collect()
}

fn put_keys(e: &Engine, st: &Store, keys: &[Vec<u8>]) -> Vec<Status> {
    let src = e.create_layout(&block(keys.len() as u64), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    for (i, k) in keys.iter().enumerate() {
        fill_block_for_key(&src, i as u64, k);
    }
    let ids: Vec<u64> = (0..keys.len() as u64).collect();
    statuses(&st.put(&src, &ids, keys, &Default::default()).unwrap())
}

/// Gets `keys` into a vLLM-shaped layout; each key's status, every hit checked exact.
fn get_exact(e: &Engine, st: &Store, keys: &[Vec<u8>]) -> Vec<Status> {
    let dst = e.create_layout(&block(keys.len() as u64), LayoutKind::LayerSeparate { block_first: false }, StorageKind::Host).unwrap();
    fill(&dst, 99);
    let ids: Vec<u64> = (0..keys.len() as u64).rev().collect();
    let out = statuses(&st.get(keys, &dst, &ids, &Default::default()).unwrap());
    for (i, k) in keys.iter().enumerate() {
        if out[i] == Status::Ok {
            assert!(holds_key(&dst, ids[i], k), "key {i} loaded with bytes that are not its own");
        }
    }
    out
}

fn a_prefix_one_store_puts_another_loads_bit_exact_over_s3() {
    let s = S3Server::start();
    s.create_bucket("kvx-store");
    let e = Arc::new(engine());
    let keys = prefix_keys(12);
    let a = store_over(&e, &s, "kvx-store", WriteMode::Behind);
    assert_eq!(put_keys(&e, &a, &keys), vec![Status::Ok; 12]);
    // Closing publishes what is still behind.
    a.close();
    let b = store_over(&e, &s, "kvx-store", WriteMode::Behind);
    let mut asked = keys.clone();
    asked.push(b"never-put".to_vec());
    assert_eq!(b.lookup(&asked, false).unwrap().1, 12);
    let got = get_exact(&e, &b, &asked);
    assert_eq!(&got[..12], &[Status::Ok; 12]);
    assert_eq!(got[12], Status::NotFound);
    assert_eq!(b.stats().shared.hits, 12);
}

fn a_stopped_server_makes_a_stores_loads_misses_in_time_then_serves() {
    let s = S3Server::start();
    s.create_bucket("kvx-stall");
    let e = Arc::new(engine());
    let keys = prefix_keys(4);
    let a = store_over(&e, &s, "kvx-stall", WriteMode::Through);
    assert_eq!(put_keys(&e, &a, &keys), vec![Status::Ok; 4]);
    let b = store_over(&e, &s, "kvx-stall", WriteMode::Through);
    s.pause(true);
    let (lookup, got) =
        within_bound("a lookup and a get of a stopped server", || (b.lookup(&keys, false).unwrap().1, get_exact(&e, &b, &keys)));
    assert_eq!(lookup, 0);
    assert!(got.iter().all(|&st| st == Status::Timeout), "{got:?}");
    let put = within_bound("a write-through put to a stopped server", || put_keys(&e, &b, &prefix_keys(6)[4..]));
    assert!(put.iter().all(|&st| st == Status::Timeout), "{put:?}");
    s.pause(false);
    assert_eq!(get_exact(&e, &b, &keys), vec![Status::Ok; 4], "service resumes with the server");
}
