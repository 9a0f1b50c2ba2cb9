#!/usr/bin/env python3
"""Runtime-shaped traffic in one run, each line against the raw limits of that run.

Runs ./cpp_examples/bench once per line (each with --json) on a GPU machine, the file on
tmpfs (hot), and writes into --out:
  runtime.jsonl  every result object, with the command that produced it
  runtime.md     one table: each workload, kvxfer's figure, the limit measured in the same
                 process, their ratio and the target kvxfer aims for
  runtime.png    the table's ratios and the latency percentiles (needs matplotlib; without
                 it, copy runtime.jsonl to a machine that has it and run --from there)

  python3 cpp_examples/runtime_figures.py --out results          # run everything
  python3 cpp_examples/runtime_figures.py --from results/runtime.jsonl --out results
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# vLLM's per-layer layout: [2, blocks, 16, 8, 128] bf16 per layer, 32 layers, 32 KiB regions.
VLLM = ["--layout", "layer-block-first", "--num-layers", "32", "--outer-dim", "2", "--page-size", "16", "--inner-dim", "1024"]
LAT = ["--num-layers", "1", "--page-size", "16", "--inner-dim", "4096", "--num-blocks", "64", "--blocks-per-batch", "1"]


def suite(trace, blocks):
    """(name, bench arguments) per line; every line's limit is measured by the bench itself."""
    nb = str(blocks)
    sc = VLLM + ["--num-blocks", nb, "--random-blocks", "--iterations", "3"]
    sub = VLLM + ["--num-blocks", nb, "--blocks-per-batch", "2", "--submitters", "8", "--iterations", "1"]
    return [
        ("latency 256 KiB", LAT + ["--latency", "--iterations", "3"]),
        ("one block buffered", ["--num-blocks", "1", "--blocks-per-batch", "1", "--iterations", "50", "--direction", "disk-to-device"]),
        ("one block mapped", ["--num-blocks", "1", "--blocks-per-batch", "1", "--iterations", "50", "--direction", "disk-to-device", "--mapped"]),
        ("layerwise file", VLLM + ["--num-blocks", "64", "--blocks-per-batch", "16", "--layerwise", "--iterations", "20",
                                   "--direction", "disk-to-device"]),
        ("layerwise host", VLLM + ["--num-blocks", "64", "--blocks-per-batch", "16", "--layerwise", "--iterations", "20",
                                   "--direction", "host-to-device"]),
        *[(f"scattered mapped {n}", sc + ["--blocks-per-batch", str(n), "--direction", "disk-to-device", "--mapped"]) for n in (8, 32, 64)],
        ("scattered buffered 32", sc + ["--blocks-per-batch", "32", "--direction", "disk-to-device"]),
        *[("scattered pinned", sc + ["--blocks-per-batch", "32", "--direction", d]) for d in ("host-to-device", "device-to-host")],
        ("submitters contiguous", sub),
        ("submitters random", sub + ["--random-blocks"]),
        ("trace", VLLM + ["--num-blocks", nb, "--trace", trace]),
    ]


def run_all(a):
    trace = os.path.join(tempfile.mkdtemp(), "trace.txt")
    with open(trace, "w") as f:
        subprocess.run([sys.executable, os.path.join(HERE, "make_trace.py"), "--submitters", "4", "--steps", "200"], stdout=f, check=True)
    rows = []
    for name, args in suite(trace, a.num_blocks):
        cmd = [a.bench, "--device", a.device, "--dir", a.dir, "--buffered", "--no-verify", "--json", *args]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(f"{name}: not measured: over {a.timeout} s", flush=True)
            continue
        if run.returncode != 0:
            print(f"{name}: not measured: bench exited {run.returncode}: {run.stderr.strip()[-400:]}", flush=True)
            continue
        for line in run.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                r.update(line_name=name, command=" ".join(cmd))
                rows.append(r)
        print(f"{name}: {sum(1 for r in rows if r['line_name'] == name)} result(s)", flush=True)
    return rows


def table(rows):
    """(workload, kvxfer, limit in the same run, ratio, target, met) for each result."""
    out = []
    for r in rows:
        n, mode = r["line_name"], r.get("mode")
        if mode == "latency":
            d50, d99 = r["p50_us"] - r["raw_p50_us"], r["p99_us"] - r["raw_p99_us"]
            out.append((f"{n}, {r['direction']}, {r['completion']}: p50 / p99 / p99.9 us",
                        f"{r['p50_us']:.1f} / {r['p99_us']:.1f} / {r['p999_us']:.1f}",
                        f"raw copy {r['raw_p50_us']:.1f} / {r['raw_p99_us']:.1f} / {r['raw_p999_us']:.1f}",
                        f"+{d50:.1f} / +{d99:.1f} us", "p50 ≤ raw + 20, p99 ≤ raw + 60", d50 <= 20 and d99 <= 60))
        elif mode == "layerwise":
            out.append((f"{n}: last layer / one request of all layers", f"{r['last_us']:.1f} us", f"{r['whole_us']:.1f} us",
                        f"{r['last_us'] / r['whole_us']:.2f}", "≤ 1.2", r["last_us"] <= 1.2 * r["whole_us"]))
            out.append((f"{n}: first layer / all layers", f"{r['first_us']:.1f} us",
                        f"{r['whole_us']:.1f} us (one layer's raw floor {r['raw_floor_us']:.1f}, its readers awake; "
                        f"waking them {r.get('raw_wake_us', float('nan')):.1f})",
                        f"{r['first_us'] / r['whole_us']:.3f} (floor {r['raw_floor_us'] / r['whole_us']:.3f})",
                        f"≈ 1/{r['layers']} = {1 / r['layers']:.3f} (met: ≤ 1.5x the larger of that and the floor)", r["first_us"] <= 1.5 * max(r["whole_us"] / r["layers"], r["raw_floor_us"])))
            if "submit_p50_us" in r:  # the caller's thread per layer (absent from older benches' data)
                out.append((f"{n}: each per-layer submit, p50 / p99 us", f"{r['submit_p50_us']:.1f} / {r['submit_p99_us']:.1f}",
                            "-", "-", "reported", None))
        elif mode == "submitters":
            ratio = r["aggregate_gbps"] / r["reference_gbps"]
            out.append((f"{n}: {r['threads']} threads x {r['blocks_per_request']} blocks, aggregate GB/s (p99 spread)",
                        f"{r['aggregate_gbps']:.2f} ({r['p99_spread']:.2f}x)", f"one submitter, two big requests {r['reference_gbps']:.2f}"
                        + (f"; the same blocks in random order {r['shape_reference_gbps']:.2f} "
                           f"({r['aggregate_gbps'] / r['shape_reference_gbps']:.2f} of it)" if r.get("shape_reference_gbps") else ""),
                        f"{ratio:.2f}", "≥ 0.9, spread ≤ 2x", ratio >= 0.9 and r["p99_spread"] <= 2))
        elif mode == "trace":
            alone = "alone_onboard_p99_us" in r  # absent from older benches' data
            out.append((f"{n}: GB/s; onboard p50 / p99 / p99.9 us", f"{r['gbps']:.2f}; {r['onboard_p50_us']:.0f} / "
                        f"{r['onboard_p99_us']:.0f} / {r['onboard_p999_us']:.0f}",
                        f"onboards alone (offloads dropped) {r['alone_onboard_p50_us']:.0f} / {r['alone_onboard_p99_us']:.0f} / "
                        f"{r['alone_onboard_p999_us']:.0f}" if alone else "-",
                        f"p99 {r['onboard_p99_vs_alone']:.2f}x alone" if alone else "-", "reported", None))
        elif n.startswith("one block"):
            slow = max(r["raw_io_pass_ms"], r["raw_copy_pass_ms"]) if not r["mapped"] else r["raw_copy_pass_ms"]
            out.append((f"{n}, {r['block_bytes'] / 1e6:.1f} MB: ms per block", f"{r['pass_ms']:.3f}",
                        f"max(raw read {r['raw_io_pass_ms']:.3f}, raw copy {r['raw_copy_pass_ms']:.3f})" if not r["mapped"]
                        else f"raw copy {r['raw_copy_pass_ms']:.3f}", f"{r['pass_ms'] / slow:.2f}x", "≤ 1.15x", r["pass_ms"] <= 1.15 * slow))
        else:
            ratio = r["gbps"] / r["limit_gbps"]
            out.append((f"{n}, {r['direction']}: GB/s", f"{r['gbps']:.2f}", f"{r['limit_gbps']:.2f}", f"{ratio:.2f}", "≥ 0.9", ratio >= 0.9))
    return out


def write_md(a, rows):
    md = ["# Runtime-shaped traffic against the limits of the same run", "",
          f"`python3 cpp_examples/runtime_figures.py --out {a.out}`; every line's command is in runtime.jsonl.", "",
          "| workload | kvxfer | limit, same run | ratio | target | met |", "|---|---|---|---|---|---|"]
    for w, k, lim, ratio, target, met in table(rows):
        md.append(f"| {w} | {k} | {lim} | {ratio} | {target} | {'-' if met is None else 'yes' if met else 'no'} |")
    with open(os.path.join(a.out, "runtime.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


def plot(a, rows):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no runtime.png (run --from runtime.jsonl where it is)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    lat = [r for r in rows if r.get("mode") == "latency"]
    labels, xs = [], 0
    for d in ("host-to-device", "device-to-host"):
        mine = [r for r in lat if r["direction"] == d]
        if not mine:
            continue
        for name, key in [("raw copy", "raw_"), *[(r["completion"], "") for r in mine]]:
            r = mine[0] if key else next(r for r in mine if r["completion"] == name)
            vals = [r[f"{key}{p}_us"] for p in ("p50", "p99", "p999")]
            for i, v in enumerate(vals):
                ax1.bar(xs + 0.27 * (i - 1), v, 0.27, color=f"C{i}", label=["p50", "p99", "p99.9"][i] if xs == 0 else None)
            labels.append(f"{'H2D' if d == 'host-to-device' else 'D2H'} {name}")
            xs += 1
    ax1.set_xticks(range(len(labels)), labels, rotation=35, ha="right")
    ax1.set_ylabel("submit -> completion seen, us")
    ax1.set_title("256 KiB requests, one at a time")
    ax1.legend()
    ax1.grid(True, axis="y", alpha=0.3)
    names, ratios, targets = [], [], []
    for r in rows:
        m, n = r.get("mode"), r["line_name"]
        if m == "batch" and n.startswith("scattered"):
            names.append(f"{n} {r['direction'][:14]}"), ratios.append(r["gbps"] / r["limit_gbps"]), targets.append(0.9)
        elif m == "submitters":
            names.append(n), ratios.append(r["aggregate_gbps"] / r["reference_gbps"]), targets.append(0.9)
        elif m == "layerwise":
            names.append(f"{n}: whole / last layer"), ratios.append(r["whole_us"] / r["last_us"]), targets.append(1 / 1.2)
        elif m == "batch" and n.startswith("one block"):
            slow = r["raw_copy_pass_ms"] if r["mapped"] else max(r["raw_io_pass_ms"], r["raw_copy_pass_ms"])
            names.append(f"{n}: limit / kvxfer time"), ratios.append(slow / r["pass_ms"]), targets.append(1 / 1.15)
    y = range(len(names))
    ax2.barh(y, ratios, color=["C2" if v >= t else "C3" for v, t in zip(ratios, targets)])
    ax2.scatter(targets, y, marker="|", s=300, color="k", label="target")
    ax2.set_yticks(y, names)
    ax2.invert_yaxis()
    ax2.set_xlabel("kvxfer against the limit of the same run (1 = the limit)")
    ax2.set_title("throughput lines (green: target met)")
    ax2.legend(loc="lower right")
    ax2.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "runtime.png"), dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", default=os.path.join(HERE, "bench"))
    p.add_argument("--dir", default="/dev/shm", help="where the files live (tmpfs: hot)")
    p.add_argument("--device", default="0")
    p.add_argument("--out", default=".")
    p.add_argument("--num-blocks", type=int, default=1024, help="vLLM-layout blocks (4 MiB each) for the scattered, submitter and trace lines")
    p.add_argument("--timeout", type=int, default=180, help="seconds per bench process")
    p.add_argument("--from", dest="src", help="rebuild runtime.md and runtime.png from this runtime.jsonl")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.src:
        with open(a.src) as f:
            rows = [json.loads(l) for l in f if l.strip()]
    else:
        rows = run_all(a)
        with open(os.path.join(a.out, "runtime.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    write_md(a, rows)
    plot(a, rows)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
