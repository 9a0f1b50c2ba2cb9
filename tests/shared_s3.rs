//! The shared tier's S3 backend against a real S3 server (moto's, tests/common/s3.rs): its
//! calls, what opening refuses, and its bounds when the server is killed or stalls. Where
//! the server's venv is missing the tests are reported skipped.

mod common;
use common::cases::{case, run};
use common::s3::{free_port, why_no_server, S3Server};
use common::shared_tier::{block, get_exact, keys, put, torture, torture_child, wait, NS};
use common::*;
use kvxfer::shared::{object, Backend, Location, S3Backend, S3Location, SharedConfig, WriteMode};
use kvxfer::store::{Store, StoreConfig};
use kvxfer::{Engine, LayoutKind, Status, StorageKind};
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
    // A child of the torture: it runs the child's loop, never the cases.
    if let Some(endpoint) = std::env::var_os(TORTURE_ENDPOINT) {
        torture_child(torture_shared(endpoint.to_str().unwrap()));
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
        case("write_through_puts_made_together_are_published_together", write_through_puts_made_together_are_published_together),
        case(
            "objects_damaged_cut_short_renamed_or_of_another_namespace_are_misses_over_s3",
            objects_damaged_cut_short_renamed_or_of_another_namespace_are_misses_over_s3,
        ),
        case(
            "processes_killed_at_random_never_serve_wrong_bytes_and_keep_acknowledged_puts_over_s3",
            processes_killed_at_random_never_serve_wrong_bytes_and_keep_acknowledged_puts_over_s3,
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

/// A store in a fresh local directory over the bucket, under namespace `ns`.
fn store_over(e: &Arc<Engine>, s: &S3Server, bucket: &str, ns: &[u8], write: WriteMode) -> Store {
    let shared = SharedConfig { write, timeout: TIMEOUT, ..SharedConfig::new(Location::S3(location(s, bucket, "kv/"))) };
    let cfg = StoreConfig { shared: Some(shared), ..StoreConfig::new(block(0), 64, ns) };
    Store::open(e, &temp_dir("s3-local"), &cfg).expect("opening a store over the bucket")
}

fn a_prefix_one_store_puts_another_loads_bit_exact_over_s3() {
    let s = S3Server::start();
    s.create_bucket("kvx-store");
    let e = Arc::new(engine());
    let ks = keys(12);
    let a = store_over(&e, &s, "kvx-store", NS, WriteMode::Behind);
    assert_eq!(put(&e, &a, &ks), vec![Status::Ok; 12]);
    // Closing publishes what is still behind.
    a.close();
    let b = store_over(&e, &s, "kvx-store", NS, WriteMode::Behind);
    let mut asked = ks.clone();
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
    let ks = keys(4);
    let a = store_over(&e, &s, "kvx-stall", NS, WriteMode::Through);
    assert_eq!(put(&e, &a, &ks), vec![Status::Ok; 4]);
    let b = store_over(&e, &s, "kvx-stall", NS, WriteMode::Through);
    s.pause(true);
    let (lookup, got) =
        within_bound("a lookup and a get of a stopped server", || (b.lookup(&ks, false).unwrap().1, get_exact(&e, &b, &ks)));
    assert_eq!(lookup, 0);
    assert!(got.iter().all(|&st| st == Status::Timeout), "{got:?}");
    let put = within_bound("a write-through put to a stopped server", || put(&e, &b, &keys(6)[4..]));
    assert!(put.iter().all(|&st| st == Status::Timeout), "{put:?}");
    s.pause(false);
    assert_eq!(get_exact(&e, &b, &ks), vec![Status::Ok; 4], "service resumes with the server");
}

/// Puts of one block each, made together, have their objects written together, not one
/// put's after another's: with the server stopped, eight such write-through puts all end
/// `Timeout` within the bound's slack, where one write at a time would take eight bounds.
fn write_through_puts_made_together_are_published_together() {
    let s = S3Server::start();
    s.create_bucket("kvx-together");
    let e = Arc::new(engine());
    let a = store_over(&e, &s, "kvx-together", NS, WriteMode::Through);
    let ks = keys(8);
    let src = e.create_layout(&block(ks.len() as u64), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    s.pause(true);
    let got = within_bound("eight write-through puts to a stopped server", || {
        let reqs: Vec<_> = ks.iter().enumerate().map(|(i, k)| a.put(&src, &[i as u64], &[k], &Default::default()).unwrap()).collect();
        reqs.iter().flat_map(|r| wait(r)).collect::<Vec<_>>()
    });
    assert!(got.iter().all(|&st| st == Status::Timeout), "{got:?}");
    s.pause(false);
}

/// Object `name`'s bytes, whole.
fn object_bytes(b: &S3Backend, name: &str) -> Vec<u8> {
    let (len, _) = read(b, name, 0, 0).expect("the object is there");
    read(b, name, object::HEADER_BYTES, len as usize - object::HEADER_BYTES).unwrap().1
}

fn objects_damaged_cut_short_renamed_or_of_another_namespace_are_misses_over_s3() {
    let s = S3Server::start();
    s.create_bucket("kvx-damage");
    let e = Arc::new(engine());
    let ks = keys(6);
    let a = store_over(&e, &s, "kvx-damage", NS, WriteMode::Through);
    assert_eq!(put(&e, &a, &ks), vec![Status::Ok; 6]);
    let other = store_over(&e, &s, "kvx-damage", b"model-b tp0", WriteMode::Through);
    assert_eq!(put(&e, &other, &ks[4..5]), vec![Status::Ok]);
    drop((a, other));
    // The stores' objects rewritten through a backend on their prefix. 0: a payload byte
    // flipped; 1: cut short; 2: key 3's object under key 2's name; 4: the other
    // namespace's object of key 4 under this namespace's name; 3 and 5: intact.
    let b = S3Backend::open(&location(&s, "kvx-damage", "kv/"), TIMEOUT).unwrap();
    let name = |ns: &[u8], i: usize| object::name(ns, &ks[i]);
    let h = object::HEADER_BYTES;
    let mut bytes = object_bytes(&b, &name(NS, 0));
    let at = bytes.len() - 7;
    bytes[at] ^= 0x10;
    b.write(&name(NS, 0), &bytes[..h], &bytes[h..]).unwrap();
    let bytes = object_bytes(&b, &name(NS, 1));
    b.write(&name(NS, 1), &bytes[..h], &bytes[h..bytes.len() - 1]).unwrap();
    let bytes = object_bytes(&b, &name(NS, 3));
    b.write(&name(NS, 2), &bytes[..h], &bytes[h..]).unwrap();
    let bytes = object_bytes(&b, &name(b"model-b tp0", 4));
    b.write(&name(NS, 4), &bytes[..h], &bytes[h..]).unwrap();

    let c = store_over(&e, &s, "kvx-damage", NS, WriteMode::Through);
    let st = get_exact(&e, &c, &ks);
    assert_eq!(st, [Status::Integrity, Status::Integrity, Status::Integrity, Status::Ok, Status::Integrity, Status::Ok]);
    assert_eq!(c.stats().shared.integrity_failures, 4);
}

/// Set in the torture's children: the endpoint of the server they share.
const TORTURE_ENDPOINT: &str = "KVX_TORTURE_S3_ENDPOINT";
const TORTURE_BUCKET: &str = "kvx-torture";

/// The torture's location, written through. Its bound is generous: 8 processes share one
/// moto, and a call that times out is a miss, not a failure, but an acknowledged put must
/// still read back at the end.
fn torture_shared(endpoint: &str) -> SharedConfig {
    let loc = S3Location { endpoint: endpoint.into(), region: "us-east-1".into(), bucket: TORTURE_BUCKET.into(), prefix: "kv/".into() };
    SharedConfig { write: WriteMode::Through, timeout: Duration::from_secs(10), ..SharedConfig::new(Location::S3(loc)) }
}

fn processes_killed_at_random_never_serve_wrong_bytes_and_keep_acknowledged_puts_over_s3() {
    let s = S3Server::start();
    s.create_bucket(TORTURE_BUCKET);
    // The children re-run this binary, whose main runs the child when TORTURE_ENDPOINT is set.
    let child = || {
        let mut c = std::process::Command::new(std::env::current_exe().unwrap());
        c.env(TORTURE_ENDPOINT, s.endpoint());
        c
    };
    torture(child, torture_shared(&s.endpoint()));
}
