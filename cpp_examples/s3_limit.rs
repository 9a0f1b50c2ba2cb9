//! The limit that `bench --store --shared-s3` is read against: the S3 client the shared
//! tier uses (`object_store`, the very client `S3Backend::open` builds, with its settings),
//! driven directly without kvxfer's request path. It PUTs then GETs `--objects` objects of
//! the shared tier's object size (a block's payload plus the object header) against the
//! same server and bucket, at each of `--concurrency` requests in flight, and reports each
//! point and the best: GB/s, per-request latency p50/p99/p99.9 and CPU s/GB (getrusage of
//! this process). The requests run on a tokio runtime with a worker per core, the client's
//! best here; the objects are removed at the end.
//!
//!   cargo run --release --example s3_limit -- --endpoint http://127.0.0.1:9000 --bucket b --block-bytes N
//!
//! Flags: --endpoint URL, --bucket B, --prefix P (kvx-s3-limit), --block-bytes N (a block's
//! payload), --objects N (64), --concurrency N,N,.. (1,4,8,16,32,64), --iterations N (3)
//! and --warmup N (1) passes at each point, --timeout-ms N (5000: the tier's default), --json.
//! Credentials: the standard AWS variables and files, as the tier reads them.
use kvxfer::shared::object::HEADER_BYTES;
use kvxfer::shared::{S3Backend, S3Location};
use object_store::aws::AmazonS3;
use object_store::path::Path;
use object_store::{ObjectStore, PutPayload};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Opts {
    loc: S3Location,
    block_bytes: usize,
    objects: usize,
    concurrency: Vec<usize>,
    iterations: usize,
    warmup: usize,
    timeout: Duration,
    json: bool,
}

fn fail(why: &str) -> ! {
    eprintln!("s3_limit: {why}");
    std::process::exit(2)
}

fn parse(args: &[String]) -> Opts {
    let mut o = Opts {
        loc: S3Location { prefix: "kvx-s3-limit".into(), ..S3Location::default() },
        block_bytes: 0,
        objects: 64,
        concurrency: vec![1, 4, 8, 16, 32, 64],
        iterations: 3,
        warmup: 1,
        timeout: Duration::from_secs(5),
        json: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--json" {
            o.json = true;
            continue;
        }
        let v = it.next().unwrap_or_else(|| fail(&format!("{a} needs a value")));
        let n =
            |s: &str| s.parse::<usize>().ok().filter(|&n| n > 0).unwrap_or_else(|| fail(&format!("{a} {v}: expected a positive number")));
        match a.as_str() {
            "--endpoint" => o.loc.endpoint = v.clone(),
            "--bucket" => o.loc.bucket = v.clone(),
            "--prefix" => o.loc.prefix = v.clone(),
            "--block-bytes" => o.block_bytes = n(v),
            "--objects" => o.objects = n(v),
            "--concurrency" => o.concurrency = v.split(',').map(n).collect(),
            "--iterations" => o.iterations = n(v),
            "--warmup" => o.warmup = v.parse().unwrap_or_else(|_| fail(&format!("--warmup {v}: expected a number"))),
            "--timeout-ms" => o.timeout = Duration::from_millis(n(v) as u64),
            _ => fail(&format!("unknown option {a}")),
        }
    }
    if o.loc.bucket.is_empty() || o.block_bytes == 0 {
        fail("--bucket and --block-bytes are required");
    }
    o
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + 1e-6 * t.tv_usec as f64;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// The value below which a share `p` of `v` lies (the nearest rank), as the bench's.
fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((p * (v.len() - 1) as f64 + 0.5) as usize).min(v.len() - 1)]
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    Put,
    Get,
}

/// What the timed passes at one point measured, summed over them.
#[derive(Default)]
struct Point {
    seconds: f64,
    cpu_s: f64,
    bytes: u64,
    req_ms: Vec<f64>,
}

/// One point of the sweep: its GB/s, per-request latency (ms) and CPU s/GB.
struct Summary {
    op: Op,
    inflight: usize,
    gbps: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    cpu: f64,
}

impl Summary {
    fn name(&self) -> &'static str {
        if self.op == Op::Put {
            "put"
        } else {
            "get"
        }
    }

    fn json(&self, object_bytes: usize, objects: usize, best: bool) -> String {
        format!(
            "{{\"system\": \"object_store\", \"mode\": \"s3-limit\", \"op\": \"{}\", \"inflight\": {}, \"object_bytes\": \
             {object_bytes}, \"objects\": {objects}, \"gbps\": {:.4}, \"req_p50_ms\": {:.3}, \"req_p99_ms\": {:.3}, \
             \"req_p999_ms\": {:.3}, \"cpu_s_per_gb\": {:.4}, \"best\": {best}}}",
            self.name(),
            self.inflight,
            self.gbps,
            self.p50,
            self.p99,
            self.p999,
            self.cpu
        )
    }
}

/// One pass: every object PUT (or GET, its length checked), `inflight` requests at a time.
async fn pass(s3: &AmazonS3, names: &Arc<Vec<Path>>, body: &PutPayload, op: Op, inflight: usize) -> Point {
    let next = Arc::new(AtomicUsize::new(0));
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let workers: Vec<_> = (0..inflight.min(names.len()))
        .map(|_| {
            let (s3, names, body, next) = (s3.clone(), names.clone(), body.clone(), next.clone());
            tokio::spawn(async move {
                let mut ms = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(path) = names.get(i) else { return ms };
                    let r0 = Instant::now();
                    match op {
                        Op::Put => {
                            if let Err(e) = s3.put(path, body.clone()).await {
                                fail(&format!("PUT {path}: {e}"));
                            }
                        }
                        Op::Get => {
                            let got = match s3.get(path).await {
                                Ok(r) => r.bytes().await,
                                Err(e) => Err(e),
                            };
                            match got {
                                Ok(b) if b.len() == body.content_length() => {}
                                Ok(b) => fail(&format!("GET {path}: {} bytes, {} put", b.len(), body.content_length())),
                                Err(e) => fail(&format!("GET {path}: {e}")),
                            }
                        }
                    }
                    ms.push(r0.elapsed().as_secs_f64() * 1e3);
                }
            })
        })
        .collect();
    let mut req_ms = Vec::new();
    for w in workers {
        req_ms.extend(w.await.unwrap_or_else(|e| fail(&format!("a request task failed: {e}"))));
    }
    Point { seconds: t0.elapsed().as_secs_f64(), cpu_s: cpu_seconds() - cpu0, bytes: (names.len() * body.content_length()) as u64, req_ms }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = parse(&args);
    let backend = S3Backend::open(&o.loc, o.timeout).unwrap_or_else(|e| fail(&e.to_string()));
    let s3 = backend.client();
    let object_bytes = HEADER_BYTES + o.block_bytes;
    let prefix = o.loc.prefix.trim_matches('/');
    let names: Arc<Vec<Path>> = Arc::new((0..o.objects).map(|i| Path::from(format!("{prefix}/{i:08}"))).collect());
    // Bytes with no runs a server could compress, as a block's.
    let body = PutPayload::from(
        (0..object_bytes).map(|i| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17) as u8).collect::<Vec<u8>>(),
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .enable_all()
        .build()
        .unwrap_or_else(|e| fail(&format!("starting the runtime: {e}")));

    println!(
        "object_store driven directly (the limit of bench --store --shared-s3): {} at {}, {} objects x {:.3} MB \
         ({} B header + {} B block), {} iterations at each concurrency, {cores} runtime threads",
        o.loc.bucket,
        o.loc.endpoint,
        o.objects,
        object_bytes as f64 / 1e6,
        HEADER_BYTES,
        o.block_bytes,
        o.iterations
    );
    println!("{:<4} {:>8} {:>9} {:>9} {:>9} {:>10} {:>9}", "op", "inflight", "GB/s", "p50 ms", "p99 ms", "p99.9 ms", "CPU s/GB");
    let mut best: [Option<Summary>; 2] = [None, None];
    for &c in &o.concurrency {
        for (k, op) in [Op::Put, Op::Get].into_iter().enumerate() {
            let mut total = Point::default();
            for i in 0..o.warmup + o.iterations {
                let p = runtime.block_on(pass(&s3, &names, &body, op, c));
                if i >= o.warmup {
                    total.seconds += p.seconds;
                    total.cpu_s += p.cpu_s;
                    total.bytes += p.bytes;
                    total.req_ms.extend(p.req_ms);
                }
            }
            let s = Summary {
                op,
                inflight: c,
                gbps: total.bytes as f64 / total.seconds / 1e9,
                cpu: total.cpu_s / (total.bytes as f64 / 1e9),
                p50: percentile(&mut total.req_ms, 0.5),
                p99: percentile(&mut total.req_ms, 0.99),
                p999: percentile(&mut total.req_ms, 0.999),
            };
            println!("{:<4} {c:>8} {:>9.3} {:>9.2} {:>9.2} {:>10.2} {:>9.3}", s.name(), s.gbps, s.p50, s.p99, s.p999, s.cpu);
            if o.json {
                println!("{}", s.json(object_bytes, o.objects, false));
            }
            if best[k].as_ref().is_none_or(|b| s.gbps > b.gbps) {
                best[k] = Some(s);
            }
        }
    }
    for s in best.iter().flatten() {
        println!(
            "best {}: {:.3} GB/s at {} in flight (p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms), CPU {:.3} s/GB",
            s.name(),
            s.gbps,
            s.inflight,
            s.p50,
            s.p99,
            s.p999,
            s.cpu
        );
        if o.json {
            println!("{}", s.json(object_bytes, o.objects, true));
        }
    }
    for path in names.iter() {
        let _ = runtime.block_on(s3.delete(path));
    }
}
