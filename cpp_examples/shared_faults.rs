//! What an S3 shared tier's faults add to a runtime's lookups and gets: moto's S3 server
//! (the test suites' venv, `make s3-server-venv`) behind the suites' fault proxy, a store
//! over it that holds one block in the bucket and none locally (`admit` off, so every get
//! reads the bucket), and for each of the proxy's modes (forwarding; answering 503
//! SlowDown; answering 403 AccessDenied; stalled, never answering) `--calls` lookups and
//! as many gets of that block, each timed alone, from `--callers` threads at once: p50,
//! p99 and p99.9 of each, beside the tier's timeout, and what the calls ended with.
//!
//!   cargo run --release --example shared_faults -- [--calls 1000] [--callers 8]
//!       [--timeout-ms 500] [--json]
//!
//! A stalled call ends at the timeout, so that mode takes about 2 × calls × timeout /
//! callers.
use kvxfer::shared::{Location, S3Location, SharedConfig, WriteMode};
use kvxfer::store::{Store, StoreConfig};
use kvxfer::{Engine, LayoutKind, Status, StorageKind};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "../tests/common/mod.rs"]
mod common;
use common::fault_proxy::{FaultProxy, Mode};
use common::s3::{why_no_server, S3Server};
use common::shared_tier::{block, keys, put, NS};

const BUCKET: &str = "kvx-faults";

struct Opts {
    calls: usize,
    callers: usize,
    timeout: Duration,
    json: bool,
}

fn fail(why: &str) -> ! {
    eprintln!("shared_faults: {why}");
    std::process::exit(2)
}

fn parse() -> Opts {
    let mut o = Opts { calls: 1000, callers: 8, timeout: Duration::from_millis(500), json: false };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut num = || -> u64 { it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| fail(&format!("{a} takes a positive number"))) };
        match a.as_str() {
            "--calls" => o.calls = num() as usize,
            "--callers" => o.callers = num() as usize,
            "--timeout-ms" => o.timeout = Duration::from_millis(num()),
            "--json" => o.json = true,
            _ => fail(&format!("unknown flag {a}; flags: --calls N --callers N --timeout-ms T --json")),
        }
    }
    if o.calls == 0 || o.callers == 0 || o.timeout.is_zero() {
        fail("--calls, --callers and --timeout-ms take a positive number");
    }
    o
}

fn store_at(e: &Arc<Engine>, endpoint: String, timeout: Duration, admit: bool) -> Store {
    let loc = S3Location { endpoint, region: "us-east-1".into(), bucket: BUCKET.into(), prefix: "kv/".into() };
    let shared = SharedConfig { write: WriteMode::Through, timeout, admit, ..SharedConfig::new(Location::S3(loc)) };
    let cfg = StoreConfig { shared: Some(shared), ..StoreConfig::new(block(0), 64, NS) };
    Store::open(e, &common::temp_dir("shared-faults"), &cfg).unwrap_or_else(|e| fail(&format!("opening a store: {e}")))
}

/// One call's latency and what it ended with.
type Timed = (Duration, String);

/// `calls` calls of `f`, shared among `callers` threads.
fn timed(calls: usize, callers: usize, f: &(dyn Fn() -> String + Sync)) -> Vec<Timed> {
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..callers)
            .map(|c| {
                let n = calls / callers + usize::from(c < calls % callers);
                s.spawn(move || {
                    (0..n)
                        .map(|_| {
                            let t0 = Instant::now();
                            let what = f();
                            (t0.elapsed(), what)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads.into_iter().flat_map(|t| t.join().unwrap()).collect()
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `q` quantile of sorted `v`.
fn quantile(v: &[Duration], q: f64) -> Duration {
    v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

fn main() {
    let o = parse();
    if let Some(why) = why_no_server() {
        fail(&why);
    }
    // Before any thread: credentials moto takes, and nothing of the environment's own.
    std::env::set_var("AWS_ACCESS_KEY_ID", "kvx-bench");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "kvx-bench");
    for v in ["AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION"] {
        std::env::remove_var(v);
    }
    let server = S3Server::start();
    server.create_bucket(BUCKET);
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.port).into());
    let e = Arc::new(common::engine());
    let key = keys(1);
    let writer = store_at(&e, proxy.endpoint(), o.timeout, true);
    if put(&e, &writer, &key) != [Status::Ok] {
        fail("the block could not be put");
    }
    let reader = store_at(&e, proxy.endpoint(), o.timeout, false);
    let dsts: Vec<_> =
        (0..o.callers).map(|_| e.create_layout(&block(1), LayoutKind::FullyContiguous, StorageKind::Host).unwrap()).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);

    let lookup = || match reader.lookup(&key, false) {
        Ok((_, 1)) => "held".to_string(),
        Ok(_) => "not held".to_string(),
        Err(e) => format!("{:?}", e.status),
    };
    let get = || {
        let dst = &dsts[next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % dsts.len()];
        match reader.get(&key, dst, &[0], &Default::default()) {
            Ok(r) => {
                r.wait(None);
                format!("{:?}", r.key_status(0).unwrap_or(Status::Internal))
            }
            Err(e) => format!("{:?}", e.status),
        }
    };

    let modes =
        [(Mode::Forward, "healthy"), (Mode::SlowDown, "503 SlowDown"), (Mode::AccessDenied, "403 AccessDenied"), (Mode::Stall, "stalled")];
    if !o.json {
        println!(
            "shared tier over S3 (moto behind a fault proxy, loopback), timeout {} ms, one block of {} B; {} calls each from {} callers",
            o.timeout.as_millis(),
            block(1).validate().unwrap().block_bytes,
            o.calls,
            o.callers
        );
        println!("{:<18} {:<7} {:>9} {:>9} {:>9} {:>9} {:>9}  ended", "mode", "call", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "requests");
    }
    for (mode, name) in modes {
        proxy.set(mode);
        for (call, f) in [("lookup", &lookup as &(dyn Fn() -> String + Sync)), ("get", &get)] {
            let before = proxy.seen(mode);
            let t = timed(o.calls, o.callers, f);
            let requests = proxy.seen(mode) - before;
            let mut lat: Vec<Duration> = t.iter().map(|x| x.0).collect();
            lat.sort_unstable();
            let mut ended: BTreeMap<&str, usize> = BTreeMap::new();
            t.iter().for_each(|x| *ended.entry(x.1.as_str()).or_default() += 1);
            let (p50, p99, p999, max) = (quantile(&lat, 0.5), quantile(&lat, 0.99), quantile(&lat, 0.999), lat[lat.len() - 1]);
            if o.json {
                let ended: Vec<String> = ended.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
                println!(
                    "{{\"mode\": \"{name}\", \"call\": \"{call}\", \"calls\": {}, \"callers\": {}, \"timeout_ms\": {}, \"p50_ms\": {:.3}, \"p99_ms\": {:.3}, \"p999_ms\": {:.3}, \"max_ms\": {:.3}, \"requests\": {requests}, \"ended\": {{{}}}}}",
                    o.calls,
                    o.callers,
                    o.timeout.as_millis(),
                    ms(p50),
                    ms(p99),
                    ms(p999),
                    ms(max),
                    ended.join(", ")
                );
            } else {
                let ended: Vec<String> = ended.iter().map(|(k, v)| format!("{v} {k}")).collect();
                println!(
                    "{name:<18} {call:<7} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {requests:>9}  {}",
                    ms(p50),
                    ms(p99),
                    ms(p999),
                    ms(max),
                    ended.join(", ")
                );
            }
        }
    }
    proxy.set(Mode::Forward);
}
