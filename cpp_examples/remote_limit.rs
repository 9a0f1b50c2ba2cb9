//! The limit that `bench --remote` is read against: NIXL's UCX backend driven directly,
//! without kvxfer's request path, moving the same blocks with the same descriptors.
//! Memory comes from kvxfer (device and pinned host layouts of the bench's geometry);
//! the descriptors are `kvxfer::layout::segments` of the same block ids the bench
//! moves (consecutive ids coalesced), one NIXL transfer per request, every list built
//! before the clock starts. It spawns itself as the serving peer, as the bench forks.
//!
//!   LD_LIBRARY_PATH=<NIXL libs> cargo run --release --example remote_limit -- [bench flags]
//!
//! Flags (the bench's, same defaults): --num-layers --inner-dim --page-size --outer-dim
//! --dtype-bytes --num-blocks --blocks-per-batch --iterations --warmup --layout
//! --host-layout --device auto|emulated|N --direction --requests --random-blocks --json.
use kvxfer::io::nixl::{new_agent, Span};
use kvxfer::layout::{segments, Placement};
use kvxfer::{Device, Engine, EngineConfig, Layout, LayoutConfig, LayoutKind, StorageKind};
use nixl_sys::{Agent, AgentConfig, MemType, OptArgs, XferDescList, XferOp, XferRequest, XferStatus};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone)]
struct Opts {
    cfg: LayoutConfig,
    layout: (String, LayoutKind),
    host_layout: (String, LayoutKind),
    per_request: u64,
    iterations: usize,
    warmup: usize,
    random: bool,
    json: bool,
    device: Device,
    direction: String,
    requests: usize,
}

fn kind(s: &str) -> LayoutKind {
    match s {
        "contiguous" => LayoutKind::FullyContiguous,
        "layer-block-first" => LayoutKind::LayerSeparate { block_first: true },
        "layer-outer-first" => LayoutKind::LayerSeparate { block_first: false },
        _ => fail(&format!("unknown layout {s}")),
    }
}

fn fail(why: &str) -> ! {
    eprintln!("remote_limit: {why}");
    std::process::exit(2)
}

fn parse(args: &[String]) -> Opts {
    let mut o = Opts {
        cfg: LayoutConfig { num_blocks: 16, num_layers: 24, outer_dim: 2, page_size: 32, inner_dim: 4096, dtype_bytes: 2 },
        layout: ("contiguous".into(), LayoutKind::FullyContiguous),
        host_layout: (String::new(), LayoutKind::FullyContiguous),
        per_request: 4,
        iterations: 5,
        warmup: 1,
        random: false,
        json: false,
        device: Device::Auto,
        direction: "all".into(),
        requests: 0,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--random-blocks" => o.random = true,
            "--json" => o.json = true,
            flag => {
                let v = it.next().unwrap_or_else(|| fail(&format!("{flag} needs a value")));
                let n = || v.parse::<u64>().unwrap_or_else(|_| fail(&format!("{flag} {v}: expected a number")));
                match flag {
                    "--num-layers" => o.cfg.num_layers = n(),
                    "--inner-dim" => o.cfg.inner_dim = n(),
                    "--page-size" => o.cfg.page_size = n(),
                    "--outer-dim" => o.cfg.outer_dim = n(),
                    "--dtype-bytes" => o.cfg.dtype_bytes = n(),
                    "--num-blocks" => o.cfg.num_blocks = n(),
                    "--blocks-per-batch" => o.per_request = n(),
                    "--iterations" => o.iterations = n() as usize,
                    "--warmup" => o.warmup = n() as usize,
                    "--layout" => o.layout = (v.clone(), kind(v)),
                    "--host-layout" => o.host_layout = (v.clone(), kind(v)),
                    "--direction" => o.direction = v.clone(),
                    "--requests" => o.requests = n() as usize,
                    "--device" => {
                        o.device = match v.as_str() {
                            "auto" => Device::Auto,
                            "emulated" => Device::Emulated,
                            _ => Device::Cuda(n() as u32),
                        }
                    }
                    _ => fail(&format!("unknown option {flag}")),
                }
            }
        }
    }
    if o.host_layout.0.is_empty() {
        o.host_layout = o.layout.clone();
    }
    if o.per_request == 0 || o.cfg.num_blocks == 0 || o.iterations == 0 {
        fail("--num-blocks, --blocks-per-batch and --iterations must be positive");
    }
    o
}

/// The memory of one process: a kvxfer engine (for its allocations only), a device and
/// a pinned host layout, and a NIXL agent with UCX and both registered.
struct Side {
    agent: Agent,
    opts: OptArgs,
    _regs: Vec<nixl_sys::RegistrationHandle>,
    layouts: [Arc<Layout>; 2],
    mems: [(MemType, u64); 2],
    _engine: Engine,
}

fn side(o: &Opts, name: &str) -> Side {
    let engine = Engine::new(&EngineConfig { device: o.device, ..Default::default() }).unwrap_or_else(|e| fail(&e.to_string()));
    let dev = engine.create_layout(&o.cfg, o.layout.1, StorageKind::Device).unwrap_or_else(|e| fail(&e.to_string()));
    let host = engine.create_layout(&o.cfg, o.host_layout.1, StorageKind::Pinned).unwrap_or_else(|e| fail(&e.to_string()));
    let dev_mem = match engine.device() {
        Device::Cuda(n) => (MemType::Vram, n as u64),
        _ => (MemType::Dram, 0), // the emulated device is host memory
    };
    let agent = new_agent(name, &AgentConfig::default()).unwrap_or_else(|e| fail(&format!("NIXL agent: {e}")));
    let (_, params) = agent.get_plugin_params("UCX").unwrap_or_else(|e| fail(&format!("NIXL's UCX plugin: {e}")));
    let backend = agent.create_backend("UCX", &params).unwrap_or_else(|e| fail(&format!("UCX backend: {e}")));
    let mut opts = OptArgs::new().unwrap();
    opts.add_backend(&backend).unwrap();
    let mut regs = Vec::new();
    for (l, mem) in [(&dev, dev_mem), (&host, (MemType::Dram, 0))] {
        for &b in l.bases().unwrap() {
            let span = Span { addr: b, len: l.placement.base_bytes(), mem: mem.0, dev: mem.1 };
            regs.push(agent.register_memory(&span, Some(&opts)).unwrap_or_else(|e| fail(&format!("registering memory: {e}"))));
        }
    }
    Side { agent, opts, _regs: regs, layouts: [dev, host], mems: [dev_mem, (MemType::Dram, 0)], _engine: engine }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// The serving peer: prints its agent's metadata and both layouts' bases, serves until
/// stdin closes.
fn serve(o: &Opts) {
    let s = side(o, &format!("remote-limit-peer-{}", std::process::id()));
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", hex(&s.agent.get_local_md().unwrap())).unwrap();
    for l in &s.layouts {
        writeln!(out, "{}", l.bases().unwrap().iter().map(|b| b.to_string()).collect::<Vec<_>>().join(" ")).unwrap();
    }
    out.flush().unwrap();
    let _ = std::io::stdin().read_line(&mut String::new());
}

/// The bench's batches of one pass (run_pass): all blocks, in order or shuffled with
/// its fixed seed, cut into requests of `per`.
fn pass_ids(n: u64, per: u64, random: bool) -> Vec<Vec<u64>> {
    let mut order: Vec<u64> = (0..n).collect();
    if random {
        let mut x: u64 = 0x9E3779B97F4A7C15;
        for i in (1..n as usize).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            order.swap(i, (x % (i as u64 + 1)) as usize);
        }
    }
    order.chunks(per as usize).map(|c| c.to_vec()).collect()
}

/// The bench's one-at-a-time requests (request_ids).
fn request_ids(n: u64, per: u64, count: usize, random: bool) -> Vec<Vec<u64>> {
    let (mut x, mut next): (u64, u64) = (0x2545F4914F6CDD1D, 0);
    (0..count)
        .map(|_| {
            let mut v = Vec::new();
            while (v.len() as u64) < per {
                let b = if random {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x % n
                } else {
                    next += 1;
                    (next - 1) % n
                };
                if !v.contains(&b) {
                    v.push(b);
                }
            }
            v
        })
        .collect()
}

/// One direction: local layout, the peer's layout of the same kind, and which way.
struct Dir<'a> {
    name: &'a str,
    local: &'a Arc<Layout>,
    local_mem: (MemType, u64),
    remote_bases: &'a [u64],
    remote_placement: &'a Placement,
    remote_mem: (MemType, u64),
    write: bool,
}

impl Dir<'_> {
    /// The descriptor lists of one request: kvxfer's segments for these ids, local side first.
    fn lists(&self, ids: &[u64]) -> (XferDescList<'static>, XferDescList<'static>) {
        let pairs: Vec<(u64, u64)> = ids.iter().map(|&b| (b, b)).collect();
        let (lp, lb) = (&self.local.placement, self.local.bases().unwrap());
        let (src, dst) = if self.write { (lp, self.remote_placement) } else { (self.remote_placement, lp) };
        let mut l = XferDescList::new(self.local_mem.0).unwrap();
        let mut r = XferDescList::new(self.remote_mem.0).unwrap();
        for s in segments(src, dst, &pairs, 0..lp.geom.cfg.num_layers) {
            let (local, remote) = if self.write { (s.src, s.dst) } else { (s.dst, s.src) };
            l.add_desc((lb[local.base as usize] + local.offset) as usize, s.len as usize, self.local_mem.1);
            r.add_desc((self.remote_bases[remote.base as usize] + remote.offset) as usize, s.len as usize, self.remote_mem.1);
        }
        (l, r)
    }
}

fn post(s: &Side, peer: &str, write: bool, lists: &(XferDescList, XferDescList)) -> XferRequest {
    let op = if write { XferOp::Write } else { XferOp::Read };
    let req =
        s.agent.create_xfer_req(op, &lists.0, &lists.1, peer, Some(&s.opts)).unwrap_or_else(|e| fail(&format!("create_xfer_req: {e}")));
    s.agent.post_xfer_req(&req, Some(&s.opts)).unwrap_or_else(|e| fail(&format!("post_xfer_req: {e}")));
    req
}

fn done(s: &Side, req: &XferRequest) -> bool {
    match s.agent.get_xfer_status(req) {
        Ok(XferStatus::Success) => true,
        Ok(XferStatus::InProgress) => false,
        Err(e) => fail(&format!("transfer failed: {e}")),
    }
}

fn cpu_seconds() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + 1e-6 * v.tv_usec as f64;
    t(u.ru_utime) + t(u.ru_stime)
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v.get(((p * (v.len() - 1) as f64) + 0.5) as usize).copied().unwrap_or(0.0)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = parse(&args);
    if std::env::var_os("KVX_LIMIT_PEER").is_some() {
        return serve(&o);
    }
    if let Some(why) = kvxfer::io::nixl::missing() {
        fail(&why);
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(&args)
        .env("KVX_LIMIT_PEER", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| fail(&format!("spawning the peer: {e}")));
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut line = || lines.next().unwrap_or_else(|| fail("the peer exited early (its message is above)")).unwrap();
    let md = unhex(&line());
    let bases: Vec<Vec<u64>> = (0..2).map(|_| line().split(' ').map(|b| b.parse().unwrap()).collect()).collect();

    let s = side(&o, &format!("remote-limit-{}", std::process::id()));
    let peer = s.agent.load_remote_md(&md).unwrap_or_else(|e| fail(&format!("loading the peer's metadata: {e}")));
    // The peer's memory types are ours: same device, same kinds.
    let dev = &s.layouts[0];
    // (name, local layout, the peer's layout, write): 0 device, 1 pinned host.
    let dirs = [
        ("remote-device-to-device", 0, 0, false),
        ("device-to-remote-device", 0, 0, true),
        ("remote-host-to-device", 0, 1, false),
        ("device-to-remote-host", 0, 1, true),
        ("remote-host-to-host", 1, 1, false),
        ("host-to-remote-host", 1, 1, true),
    ];
    let block_bytes = dev.placement.geom.block_bytes;
    let total = block_bytes * o.cfg.num_blocks;
    let nreq = if o.requests > 0 { o.requests } else { o.iterations * 100 };
    println!("NIXL's UCX backend driven directly (the limit of bench --remote): peer process {}, layout {} (host {}), {} blocks x {:.2} MB, {} blocks/batch, {} iterations",
        child.id(), o.layout.0, o.host_layout.0, o.cfg.num_blocks, block_bytes as f64 / 1e6, o.per_request, o.iterations);
    println!(
        "{:<24} {:>9} {:>9} {:>9} {:>11} {:>11} {:>11} {:>9}",
        "direction", "GB/s", "p50 ms", "p99 ms", "req p50 us", "req p99 us", "req p99.9 us", "CPU s/GB"
    );
    let mut any = false;
    for (name, l, r, write) in dirs {
        if o.direction != "all" && o.direction != name {
            continue;
        }
        any = true;
        let d = Dir {
            name,
            local: &s.layouts[l],
            local_mem: s.mems[l],
            remote_bases: &bases[r],
            remote_placement: &s.layouts[r].placement,
            remote_mem: s.mems[r],
            write,
        };
        let batches: Vec<_> = pass_ids(o.cfg.num_blocks, o.per_request, o.random).iter().map(|v| d.lists(v)).collect();
        // One pass: every request posted at once, then each seen done.
        let pass = |batch_ms: &mut Vec<f64>| {
            let t0 = Instant::now();
            let mut running: Vec<(XferRequest, Instant)> = batches.iter().map(|l| (post(&s, &peer, write, l), Instant::now())).collect();
            while !running.is_empty() {
                running.retain(|(req, ts)| {
                    let fin = done(&s, req);
                    if fin {
                        batch_ms.push(ts.elapsed().as_secs_f64() * 1e3);
                    }
                    !fin
                });
            }
            t0.elapsed().as_secs_f64()
        };
        for _ in 0..o.warmup {
            pass(&mut Vec::new());
        }
        let mut batch_ms = Vec::new();
        let cpu0 = cpu_seconds();
        let secs: f64 = (0..o.iterations).map(|_| pass(&mut batch_ms)).sum();
        let cpu = cpu_seconds() - cpu0;
        let singles: Vec<_> = request_ids(o.cfg.num_blocks, o.per_request, nreq, o.random).iter().map(|v| d.lists(v)).collect();
        let mut us: Vec<f64> = singles
            .iter()
            .map(|l| {
                let t0 = Instant::now();
                let req = post(&s, &peer, write, l);
                while !done(&s, &req) {}
                t0.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        let bytes = (total * o.iterations as u64) as f64;
        let gbps = bytes / secs / 1e9;
        let (p50, p99) = (percentile(&mut batch_ms, 0.5), percentile(&mut batch_ms, 0.99));
        let (r50, r99, r999) = (percentile(&mut us, 0.5), percentile(&mut us, 0.99), percentile(&mut us, 0.999));
        let cpu_gb = cpu / (bytes / 1e9);
        println!("{:<24} {gbps:>9.2} {p50:>9.2} {p99:>9.2} {r50:>11.1} {r99:>11.1} {r999:>11.1} {cpu_gb:>9.3}", d.name);
        if o.json {
            println!("{{\"system\": \"nixl\", \"mode\": \"remote\", \"direction\": \"{}\", \"layout\": \"{}\", \"blocks_per_batch\": {}, \"num_blocks\": {}, \"block_bytes\": {block_bytes}, \"gbps\": {gbps:.3}, \"p50_ms\": {p50:.3}, \"p99_ms\": {p99:.3}, \"req_p50_us\": {r50:.1}, \"req_p99_us\": {r99:.1}, \"req_p999_us\": {r999:.1}, \"cpu_s_per_gb\": {cpu_gb:.4}}}",
                d.name, o.layout.0, o.per_request, o.cfg.num_blocks);
        }
    }
    drop(child.stdin.take());
    let _ = child.wait();
    if !any {
        fail(&format!("unknown --direction {}", o.direction));
    }
}
