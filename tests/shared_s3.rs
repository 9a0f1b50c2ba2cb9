//! The shared tier's S3 backend against a real S3 server (moto's, tests/common/s3.rs): its
//! calls, what opening refuses, and its bounds when the server is killed or stalls. Where
//! the server's venv is missing the tests are reported skipped.

mod common;
use common::cases::{case, run};
use common::fault_proxy::{FaultProxy, Mode};
use common::s3::{free_port, why_no_server, S3Server};
use common::shared_tier::{block, get_exact, get_outcomes, keys, put, put_outcomes, torture, torture_child, wait, NS};
use common::*;
use kvxfer::ffi::logger::kvx_set_logger;
use kvxfer::ffi::KVX_OK;
use kvxfer::shared::{object, Backend, Location, S3Backend, S3Location, SharedConfig, Sink, WriteMode};
use kvxfer::store::{Store, StoreConfig};
use kvxfer::{Engine, LayoutConfig, LayoutKind, Status, StorageKind};
use std::ffi::{c_char, c_void, CStr};
use std::sync::{Arc, Mutex};
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
    // SAFETY: `on_warning` uses no user data.
    assert_eq!(unsafe { kvx_set_logger(Some(on_warning), std::ptr::null_mut(), 2) }, KVX_OK);
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
        case("a_store_through_a_forwarding_proxy_puts_and_gets_bit_exact", a_store_through_a_forwarding_proxy_puts_and_gets_bit_exact),
        case("answers_503_are_retried_then_misses_in_time_and_service_resumes", || {
            server_errors_are_retried_then_misses_in_time_and_service_resumes(Mode::SlowDown, "503")
        }),
        case("answers_500_are_retried_then_misses_in_time_and_service_resumes", || {
            server_errors_are_retried_then_misses_in_time_and_service_resumes(Mode::InternalError, "500")
        }),
        case(
            "answers_403_are_misses_that_name_the_credentials_at_once_and_service_resumes",
            answers_403_are_misses_that_name_the_credentials_at_once_and_service_resumes,
        ),
        case("write_through_puts_made_together_are_published_together", write_through_puts_made_together_are_published_together),
        case(
            "write_through_puts_behind_a_hung_round_end_within_their_bound",
            write_through_puts_behind_a_hung_round_end_within_their_bound,
        ),
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

/// What kvxfer logged at warn or error, every case's; each line is also shown on stderr.
static WARNINGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn on_warning(_: *mut c_void, _level: u32, _target: *const c_char, msg: *const c_char) {
    // SAFETY: kvxfer passes a NUL-terminated message, valid during the call.
    let msg = unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned();
    eprintln!("[kvxfer] {msg}");
    WARNINGS.lock().unwrap().push(msg);
}

/// Whether a warning logged so far holds every one of `words`.
fn warned(words: &[&str]) -> bool {
    WARNINGS.lock().unwrap().iter().any(|w| words.iter().all(|x| w.contains(x)))
}

fn location(s: &S3Server, bucket: &str, prefix: &str) -> S3Location {
    location_at(s.endpoint(), bucket, prefix)
}

fn location_at(endpoint: String, bucket: &str, prefix: &str) -> S3Location {
    S3Location { endpoint, region: "us-east-1".into(), bucket: bucket.into(), prefix: prefix.into() }
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

/// Keeps the bytes a read hands it.
#[derive(Default)]
struct Keep(Vec<u8>);

impl Sink for Keep {
    fn header(&mut self, h: &[u8]) -> bool {
        self.0.extend_from_slice(h);
        true
    }
    fn payload(&mut self, piece: &[u8]) -> bool {
        self.0.extend_from_slice(piece);
        true
    }
}

/// Reads `name` as an object of the given sizes: its length and the bytes read.
fn read(b: &S3Backend, name: &str, header: usize, payload: usize) -> Option<(u64, Vec<u8>)> {
    try_read(b, name, header, payload).expect("read")
}

fn try_read(b: &S3Backend, name: &str, header: usize, payload: usize) -> kvxfer::Result<Option<(u64, Vec<u8>)>> {
    let mut k = Keep::default();
    Ok(b.read(name, header, payload, &mut k)?.map(|n| (n, k.0)))
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
    // Lengths shorter and longer than the object's: its true length, and no bytes.
    assert_eq!(read(&b, "ef/three", 512, 500), Some((1512, Vec::new())));
    assert_eq!(read(&b, "ef/three", 512, 2000), Some((1512, Vec::new())));
    assert_eq!(read(&b, "ef/three", 0, 0), Some((1512, Vec::new())));
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
    within_bound("read", || try_read(b, name, 512, 2 << 20)).expect_err("read");
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
    let e = within_bound("a read from a stopped server", || try_read(&b, "ij/five", 512, 2 << 20)).unwrap_err();
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
    store_at(e, s.endpoint(), bucket, ns, write)
}

/// As `store_over`, over the S3 endpoint `endpoint`.
fn store_at(e: &Arc<Engine>, endpoint: String, bucket: &str, ns: &[u8], write: WriteMode) -> Store {
    let shared = SharedConfig { write, timeout: TIMEOUT, ..SharedConfig::new(Location::S3(location_at(endpoint, bucket, "kv/"))) };
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

/// A server with bucket `bucket`, and a proxy in front of it, forwarding.
fn proxied(bucket: &str) -> (S3Server, FaultProxy) {
    let s = S3Server::start();
    s.create_bucket(bucket);
    let p = FaultProxy::start(([127, 0, 0, 1], s.port).into());
    (s, p)
}

fn a_store_through_a_forwarding_proxy_puts_and_gets_bit_exact() {
    let (_s, p) = proxied("kvx-proxied");
    let e = Arc::new(engine());
    let ks = keys(8);
    let a = store_at(&e, p.endpoint(), "kvx-proxied", NS, WriteMode::Through);
    assert_eq!(put(&e, &a, &ks), vec![Status::Ok; 8]);
    let b = store_at(&e, p.endpoint(), "kvx-proxied", NS, WriteMode::Through);
    assert_eq!(b.lookup(&ks, false).unwrap().1, 8);
    assert_eq!(get_exact(&e, &b, &ks), vec![Status::Ok; 8]);
    assert_eq!(b.stats().shared.hits, 8);
    assert!(p.seen(Mode::Forward) >= a.stats().shared.requests + b.stats().shared.requests, "the calls went through the proxy");
}

/// The calls `s`'s shared tier made since it had counted `before` requests: one request
/// a call, before any retry.
fn calls_since(s: &Store, before: u64) -> u64 {
    s.stats().shared.requests - before
}

/// Waits until `f` holds, failing past `SLACK` times the bound.
fn holds_within_bound(what: &str, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < TIMEOUT * SLACK, "{what}: not within {:?}", TIMEOUT * SLACK);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The proxy answers `mode`, a 5xx: each call is retried with backoff, then ends within
/// the bound with the server's answer; lookups and gets are misses, write-through puts
/// fail with the answer, write-behind puts are dropped and counted, and closing does not
/// wait past the bound. Forwarding again, gets hit and puts land.
fn server_errors_are_retried_then_misses_in_time_and_service_resumes(mode: Mode, answer: &str) {
    let bucket = format!("kvx-answers-{answer}");
    let (_s, p) = proxied(&bucket);
    let e = Arc::new(engine());
    let ks = keys(4);
    let a = store_at(&e, p.endpoint(), &bucket, NS, WriteMode::Through);
    assert_eq!(put(&e, &a, &ks), vec![Status::Ok; 4]);
    let b = store_at(&e, p.endpoint(), &bucket, NS, WriteMode::Behind);

    p.set(mode);
    let before = b.stats().shared;
    let (lookup, got) = within_bound("a lookup and a get answered 5xx", || (b.lookup(&ks, false).unwrap().1, get_outcomes(&e, &b, &ks)));
    assert_eq!(lookup, 0);
    assert!(warned(&[&bucket, "existence check", answer]), "a lookup's failed checks are not logged with the answer");
    for (st, why) in &got {
        assert!(*st != Status::Ok && *st != Status::Timeout, "{st:?}: {why}");
        assert!(why.contains(answer), "the miss does not name the server's answer {answer}: {why}");
    }
    let after = b.stats().shared;
    assert_eq!((after.timeouts, after.hits), (before.timeouts, before.hits), "{after:?}");
    assert_eq!(after.errors - before.errors, calls_since(&b, before.requests), "each call failed with the answer: {after:?}");
    let calls = calls_since(&b, before.requests);
    assert!(p.seen(mode) >= 2 * calls, "{} requests for {calls} calls: each was retried", p.seen(mode));

    let through = within_bound("a write-through put answered 5xx", || put_outcomes(&e, &a, &keys(6)[4..]));
    for (st, why) in &through {
        assert!(*st != Status::Ok && *st != Status::Timeout, "{st:?}: {why}");
        assert!(why.contains(answer), "the put does not name the server's answer {answer}: {why}");
    }
    let dropped = b.stats().shared.puts_dropped;
    assert_eq!(put(&e, &b, &keys(8)[6..]), vec![Status::Ok; 2], "a write-behind put ends once held locally");
    holds_within_bound("write-behind puts dropped and counted", || b.stats().shared.puts_dropped == dropped + 2);
    assert_eq!(put(&e, &b, &keys(10)[8..]), vec![Status::Ok; 2]);
    within_bound("closing a store with puts behind", || b.close());

    p.set(Mode::Forward);
    let c = store_at(&e, p.endpoint(), &bucket, NS, WriteMode::Through);
    assert_eq!(get_exact(&e, &c, &ks), vec![Status::Ok; 4], "service resumes with the server");
    assert_eq!(put(&e, &a, &keys(12)[10..]), vec![Status::Ok; 2]);
    assert_eq!(get_exact(&e, &c, &keys(12)[10..]), vec![Status::Ok; 2], "puts land again");
    assert_eq!(c.stats().shared.hits, 6);
}

/// The proxy answers 403: each call is one request, not retried, and ends at once as a
/// miss whose message says the bucket refuses the credentials. Forwarding again, gets hit
/// and puts land.
fn answers_403_are_misses_that_name_the_credentials_at_once_and_service_resumes() {
    let (_s, p) = proxied("kvx-answers-403");
    let e = Arc::new(engine());
    let ks = keys(4);
    let a = store_at(&e, p.endpoint(), "kvx-answers-403", NS, WriteMode::Through);
    assert_eq!(put(&e, &a, &ks), vec![Status::Ok; 4]);
    let b = store_at(&e, p.endpoint(), "kvx-answers-403", NS, WriteMode::Behind);

    p.set(Mode::AccessDenied);
    let before = b.stats().shared;
    let t0 = Instant::now();
    let (lookup, got) = (b.lookup(&ks, false).unwrap().1, get_outcomes(&e, &b, &ks));
    assert!(t0.elapsed() < TIMEOUT, "a 403 is answered at once, yet the calls took {:?}", t0.elapsed());
    assert_eq!(lookup, 0);
    assert!(
        warned(&["kvx-answers-403", "existence check", "refused the credentials"]),
        "a lookup the bucket refused is not logged with the reason"
    );
    for (st, why) in &got {
        assert_eq!(*st, Status::Io, "{why}");
        assert!(
            why.contains("403") && why.contains("refused the credentials") && why.contains("s3:GetObject"),
            "the miss does not say the credentials are refused: {why}"
        );
        assert!(!why.contains(SECRET), "the message shows the secret: {why}");
    }
    let calls = calls_since(&b, before.requests);
    assert_eq!(p.seen(Mode::AccessDenied), calls, "a 403 is not retried: one request a call");
    assert_eq!(b.stats().shared.errors - before.errors, calls);

    let through = within_bound("a write-through put answered 403", || put_outcomes(&e, &a, &keys(6)[4..]));
    for (st, why) in &through {
        assert_eq!(*st, Status::Io, "{why}");
        assert!(why.contains("refused the credentials") && why.contains("s3:PutObject"), "{why}");
    }
    let dropped = b.stats().shared.puts_dropped;
    assert_eq!(put(&e, &b, &keys(8)[6..]), vec![Status::Ok; 2]);
    holds_within_bound("write-behind puts dropped and counted", || b.stats().shared.puts_dropped == dropped + 2);
    within_bound("closing a store", || b.close());

    p.set(Mode::Forward);
    let c = store_at(&e, p.endpoint(), "kvx-answers-403", NS, WriteMode::Through);
    assert_eq!(get_exact(&e, &c, &ks), vec![Status::Ok; 4], "service resumes with the server");
    assert_eq!(put(&e, &a, &keys(10)[8..]), vec![Status::Ok; 2]);
    assert_eq!(get_exact(&e, &c, &keys(10)[8..]), vec![Status::Ok; 2], "puts land again");
}

/// Puts of one block each, made together, have their objects written together, not one
/// put's after another's, and the rounds they are published in overlap: with the server
/// stopped, 64 such write-through puts (four rounds of 16) all end `Timeout` within the
/// bound's slack, where one write at a time would take 64 bounds and one round at a time
/// four.
fn write_through_puts_made_together_are_published_together() {
    let s = S3Server::start();
    s.create_bucket("kvx-together");
    let e = Arc::new(engine());
    let a = store_over(&e, &s, "kvx-together", NS, WriteMode::Through);
    let ks = keys(64);
    let src = e.create_layout(&block(ks.len() as u64), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    s.pause(true);
    let got = within_bound("64 write-through puts to a stopped server", || {
        let reqs: Vec<_> = ks.iter().enumerate().map(|(i, k)| a.put(&src, &[i as u64], &[k], &Default::default()).unwrap()).collect();
        reqs.iter().flat_map(|r| wait(r)).collect::<Vec<_>>()
    });
    assert!(got.iter().all(|&st| st == Status::Timeout), "{got:?}");
    s.pause(false);
}

/// Each put's bound counts from the put, even when the puts before it hold all of staging
/// and every writer: with 4 MiB blocks (the smallest staging, 32 blocks) and the server
/// stopped, 160 one-block write-through puts (ten rounds) all end `Timeout` within the
/// bound's slack, where rounds timed from their own start would take about five bounds.
fn write_through_puts_behind_a_hung_round_end_within_their_bound() {
    let s = S3Server::start();
    s.create_bucket("kvx-hung-rounds");
    let e = Arc::new(engine());
    let big = cfg(0, 64, 2, 16, 1024, 2);
    let shared = SharedConfig {
        write: WriteMode::Through,
        timeout: TIMEOUT,
        ..SharedConfig::new(Location::S3(location_at(s.endpoint(), "kvx-hung-rounds", "kv/")))
    };
    let a = Store::open(&e, &temp_dir("s3-hung-rounds"), &StoreConfig { shared: Some(shared), ..StoreConfig::new(big, 160, NS) }).unwrap();
    let src = e.create_layout(&LayoutConfig { num_blocks: 16, ..big }, LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    let ks = keys(160);
    s.pause(true);
    let got = within_bound("160 write-through puts to a stopped server", || {
        let reqs: Vec<_> = ks.iter().enumerate().map(|(i, k)| a.put(&src, &[i as u64 % 16], &[k], &Default::default()).unwrap()).collect();
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
