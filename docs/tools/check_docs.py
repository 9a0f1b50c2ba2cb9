#!/usr/bin/env python3
"""Keeps the docs true to the tree: `make docs-test` runs this without arguments.

- Example blocks: a fenced block between `<!-- example: PATH -->` and `<!-- /example -->`
  must hold PATH's text, byte for byte, so every program the docs show is a file that
  `make examples-test` builds and runs.
- Included tables: between `<!-- include: PATH -->` and `<!-- /include -->`, the generated
  table PATH (a file of docs/results/) without its title line.
- The headline table: between `<!-- generated: headline -->` and `<!-- /generated -->`,
  rendered from the data files in docs/results/ (HEADLINE below says which figure of
  which run each row shows; runs.json names each run's card, host and commit).
- Relative links of every checked page resolve to a file, and `#anchors` into Markdown
  pages to one of their headings.

  python3 docs/tools/check_docs.py           # fails, saying what is stale or broken
  python3 docs/tools/check_docs.py --write   # refreshes the blocks and the table
"""
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "docs", "results")
PAGES = ["README.md", "CHANGELOG.md", "CONTRIBUTING.md", "python/README.md", "examples/README.md",
         "cpp_examples/probes/README.md"]
README_LINES = 150
LANG = {".c": "c", ".cpp": "cpp", ".h": "c", ".hpp": "cpp", ".py": "python", ".rs": "rust", ".sh": "sh"}
BLOCK = re.compile(r"(<!-- (example|include|generated): (\S+) -->\n)(.*?)(<!-- /\2 -->)", re.S)


def load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def runs():
    with open(os.path.join(RESULTS, "runs.json")) as f:
        return json.load(f)


def pick(rows, **want):
    found = [r for r in rows if all(r.get(k) == v for k, v in want.items())]
    if len(found) != 1:
        raise SystemExit(f"check_docs: {len(found)} rows match {want}; the headline needs exactly one")
    return found[0]


def best_kvikio(rows, bpb):
    peers = [r for r in rows if r["system"] == "KvikIO" and r["blocks_per_batch"] == bpb]
    return max(peers, key=lambda r: r["gbps"])


def batch_row(file, what, system="kvxfer", bpb=16):
    """A compare.py run: kvxfer's GB/s at `bpb` blocks per request against the limit the
    bench measured in the same process, and the best KvikIO thread count beside it."""
    rows = load(file)
    k = pick(rows, system=system, blocks_per_batch=bpb)
    p = best_kvikio(rows, bpb)
    return (what, f"{k['gbps']:.1f} GB/s", f"{k['limit_gbps']:.1f} GB/s", f"{k['gbps'] / k['limit_gbps']:.2f}",
            f"KvikIO {p['gbps']:.1f} GB/s ({p['threads']} threads)", file)


def scattered_row(file, what, line, direction):
    """A runtime_figures.py line: kvxfer's GB/s against the limit of the same process."""
    r = pick(load(file), line_name=line, direction=direction)
    return (what, f"{r['gbps']:.1f} GB/s", f"{r['limit_gbps']:.1f} GB/s", f"{r['gbps'] / r['limit_gbps']:.2f}", "—", file)


def latency_row(file, what, direction):
    """A runtime_figures.py latency line: p50 of `wait` against one raw copy's."""
    r = pick(load(file), mode="latency", direction=direction, completion="wait")
    return (what, f"{r['p50_us']:.1f} µs p50", f"{r['raw_p50_us']:.1f} µs (one raw copy)",
            f"+{r['p50_us'] - r['raw_p50_us']:.1f} µs", "—", file)


# The front page's five rows: each a workload users ask about, the run that measured it.
HEADLINE = [
    lambda: batch_row("h200-compare-contiguous.jsonl", "Hot file → GPU, 12.6 MB blocks, 16 per request"),
    lambda: batch_row("h200-compare-cpu.jsonl", "Mapped tmpfs file → GPU (`KVX_DISK_MAPPED`), 64 per request",
                      system="kvxfer, KVX_DISK_MAPPED", bpb=64),
    lambda: scattered_row("h100c-runtime.jsonl", "vLLM layout, 32 random blocks per request, hot file → GPU",
                          "scattered buffered 32", "disk-to-device"),
    lambda: scattered_row("h100c-runtime.jsonl", "vLLM layout, 32 random blocks per request, pinned host → GPU",
                          "scattered pinned", "host-to-device"),
    lambda: latency_row("h100c-runtime.jsonl", "One 256 KiB request, pinned host → GPU", "host-to-device"),
]


def headline():
    meta = runs()["runs"]
    out = ["| workload | kvxfer | limit, same run | share of the limit | best peer, same run | GPU |",
           "| --- | --- | --- | --- | --- | --- |"]
    for row in HEADLINE:
        *cells, file = row()
        out.append("| " + " | ".join(cells) + f" | {meta[file]['card']} |")
    return "\n".join(out) + "\n"


def included(path):
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().splitlines(keepends=True)
    while lines and (lines[0].startswith("# ") or not lines[0].strip()):
        lines.pop(0)
    return "".join(lines)


def refresh(page, text, problems):
    """The page's text with every block as it should be; each stale block is a problem."""
    def fix(m):
        kind, arg, body = m.group(2), m.group(3), m.group(4)
        if kind == "generated":
            if arg != "headline":
                problems.append(f"{page}: unknown generated block {arg!r}")
                return m.group(0)
            want = headline()
        else:
            if not os.path.isfile(os.path.join(ROOT, arg)):
                problems.append(f"{page}: {arg} does not exist; the page shows it ({kind})")
                return m.group(0)
            if kind == "include":
                want = included(arg)
            else:
                with open(os.path.join(ROOT, arg)) as f:
                    code = f.read()
                want = f"```{LANG.get(os.path.splitext(arg)[1], '')}\n{code}{'' if code.endswith(chr(10)) else chr(10)}```\n"
        if body != want:
            problems.append(f"{page}: the {kind} block of {arg} is out of date (run: python3 docs/tools/check_docs.py --write)")
        return m.group(1) + want + m.group(5)
    return BLOCK.sub(fix, text)


def slug(heading):
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return s.replace(" ", "-")


def anchors(path):
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def links(page, text, problems):
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    here = os.path.join(ROOT, page)
    # A symlinked page is read from both folders; its links must resolve from each.
    bases = {os.path.dirname(here), os.path.dirname(os.path.realpath(here))}
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        for base in bases:
            full = os.path.normpath(os.path.join(base, path)) if path else here
            if not os.path.exists(full):
                problems.append(f"{page}: link {target} does not resolve (from {os.path.relpath(base, ROOT) or '.'})")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                problems.append(f"{page}: link {target}: no heading #{anchor} in {os.path.relpath(full, ROOT)}")


def main():
    write = "--write" in sys.argv[1:]
    docs = sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    problems = []
    for page in PAGES + docs:
        path = os.path.join(ROOT, page)
        if not os.path.exists(path):
            if page in ("README.md", "python/README.md"):
                problems.append(f"{page} is missing")
            continue
        with open(path) as f:
            text = f.read()
        stale = []
        new = refresh(page, text, stale)
        if write and new != text and not os.path.islink(path):
            with open(path, "w") as f:
                f.write(new)
            print(f"check_docs: wrote {page}")
            stale = [p for p in stale if "out of date" not in p]
        problems += stale
        links(page, new, problems)
    with open(os.path.join(ROOT, "README.md")) as f:
        n = sum(1 for _ in f)
    if n > README_LINES:
        problems.append(f"README.md is {n} lines, over the front page's {README_LINES}: move detail to docs/")
    for p in dict.fromkeys(problems):
        print(f"check_docs: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
