"""Plots a `kivi bench --out FILE` report (JSON) into a PNG.

    .cache/bench-py/bin/python benches/plot.py bench.json docs/performance.png
    .cache/bench-py/bin/python benches/plot.py --markdown bench.json   # tables

Left: decode time against context length (GQA 32:8, d128; batch 1 and 8),
ours per scheme and the peers, log-log. Right: at the longest context,
speed-up over our f16 path, over the numpy f32 peer and, when the run had
`--peers llama.cpp`, over ggml's flash attention on f16 and q4_0 KV, per
scheme and batch, with the byte-floor speed-up (f16 bytes / scheme bytes)
as a mark.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def peer_time(r, peer, dtype, d):
    """The peer's median at decode row d's point, or None."""
    for p in r["peers"]["results"]:
        if (p["peer"], p["dtype"], p["layout"], p["context"], p["batch"]) == (peer, dtype, d["layout"], d["context"], d["batch"]) and not p.get("error"):
            return p["median_ms"]
    return None


def markdown(r):
    """The decode rows as a markdown table (for docs/performance.md)."""
    out = [
        "| layout | context | batch | scheme | median ms | p20–p80 ms | KV MB | GB/s | GFLOP/s | vs f16 | vs numpy f32 | CPU ms | CPU vs f16 | byte floor ms | compute floor ms | path |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d in r["decode"]:
        f = lambda x: "–" if x is None else "%.2fx" % x  # noqa: E731
        out.append(
            "| %s | %d | %d | %s | %.3f | %.3f–%.3f | %.2f | %.1f | %.1f | %s | %s | %.2f | %s | %.2f | %s | %s |"
            % (d["layout"], d["context"], d["batch"], d["scheme"], d["median_ms"], d["p20_ms"], d["p80_ms"],
               d["kv_bytes"] / 1e6, d["gb_per_s"], d["gflop_per_s"], f(d.get("speedup_vs_f16")), f(d.get("speedup_vs_numpy")),
               d.get("cpu_ms", 0.0), f(d.get("cpu_speedup_vs_f16")), d["byte_floor_ms"],
               "–" if d.get("compute_floor_ms") is None else "%.2f" % d["compute_floor_ms"], d.get("path", "–"))
        )
    out.append("")
    out.append("| peer | dtype | layout | context | batch | median ms | p20–p80 ms |")
    out.append("|---|---|---|---:|---:|---:|---:|")
    for p in r["peers"]["results"]:
        if p.get("error"):
            out.append("| %s | %s | %s | %d | %d | error: %s | |" % (p["peer"], p["dtype"], p["layout"], p["context"], p["batch"], p["error"]))
        else:
            out.append("| %s | %s | %s | %d | %d | %.3f | %.3f–%.3f |" % (p["peer"], p["dtype"], p["layout"], p["context"], p["batch"], p["median_ms"], p["p20_ms"], p["p80_ms"]))
    ggml = [p for p in r["peers"]["results"] if p["peer"] == "llama.cpp" and not p.get("error")]
    if ggml:
        out.append("")
        out.append("| layout | context | batch | scheme | ms | vs llama.cpp f16 | vs llama.cpp q8_0 | vs llama.cpp q4_0 |")
        out.append("|---|---:|---:|---|---:|---:|---:|---:|")
        for d in r["decode"]:
            cells = []
            for dt in ("f16", "q8_0", "q4_0"):
                p = peer_time(r, "llama.cpp", dt, d)
                cells.append("–" if p is None else "%.2fx" % (p / d["median_ms"]))
            out.append("| %s | %d | %d | %s | %.3f | %s |" % (d["layout"], d["context"], d["batch"], d["scheme"], d["median_ms"], " | ".join(cells)))
    if r.get("prefill"):
        out.append("")
        out.append("| layout | scheme | tokens | extend tok/s | append tok/s | memory MB | vs f16 |")
        out.append("|---|---|---:|---:|---:|---:|---:|")
        for p in r["prefill"]:
            out.append("| %s | %s | %d | %.0f | %.0f | %.2f | %s |" % (p["layout"], p["scheme"], p["tokens"], p["extend_tokens_per_s"], p["append_tokens_per_s"], p["memory_bytes"] / 1e6, "–" if p.get("memory_vs_f16") is None else "%.3f" % p["memory_vs_f16"]))
    return "\n".join(out)


def main():
    if sys.argv[1] == "--markdown":
        with open(sys.argv[2]) as f:
            sys.stdout.write(markdown(json.load(f)) + "\n")
        return
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        r = json.load(f)
    dec = r["decode"]
    layout = "gqa32:8/d128" if any(d["layout"] == "gqa32:8/d128" for d in dec) else dec[0]["layout"]
    rows = [d for d in dec if d["layout"] == layout]
    batches = sorted({d["batch"] for d in rows})
    schemes = []
    for d in rows:
        if d["scheme"] not in schemes:
            schemes.append(d["scheme"])
    colors = {"f16": "#444444", "int8": "#1f77b4", "kivi4": "#2ca02c", "kivi2": "#d62728"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    ax = axes[0]
    for b in batches:
        style = "-" if b == batches[0] else "--"
        for s in schemes:
            pts = sorted((d["context"], d["median_ms"]) for d in rows if d["scheme"] == s and d["batch"] == b)
            if pts:
                ax.plot(*zip(*pts), style, marker="o", ms=4, color=colors.get(s), label=f"{s} B={b}")
        peers = {}
        for p in r["peers"]["results"]:
            if p["layout"] == layout and p["batch"] == b and not p.get("error"):
                peers.setdefault(f'{p["peer"]} {p["dtype"]}', []).append((p["context"], p["median_ms"]))
        for i, (name, pts) in enumerate(sorted(peers.items())):
            ax.plot(*zip(*sorted(pts)), style, marker="x", ms=5, color=["#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"][i % 6], label=f"{name} B={b}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode attention, ms (median)")
    ax.set_title(f"{layout}: one decode step, all query heads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)

    ax = axes[1]
    ctx = max(d["context"] for d in rows)
    # Ratios against llama.cpp (ggml flash attention) are computed here from
    # the peer rows, when the run had them.
    for d in rows:
        for dt in ("f16", "q4_0"):
            p = peer_time(r, "llama.cpp", dt, d)
            d["speedup_vs_ggml_" + dt] = None if p is None else p / d["median_ms"]
    keys = ["speedup_vs_f16", "cpu_speedup_vs_f16", "speedup_vs_numpy"]
    names = {"speedup_vs_f16": "vs our f16 (wall)", "cpu_speedup_vs_f16": "vs our f16 (CPU time)", "speedup_vs_numpy": "vs numpy f32 (wall)",
             "speedup_vs_ggml_f16": "vs llama.cpp f16 KV (wall)", "speedup_vs_ggml_q4_0": "vs llama.cpp q4_0 KV (wall)"}
    keys += [k for k in ("speedup_vs_ggml_f16", "speedup_vs_ggml_q4_0") if any(d.get(k) for d in rows)]
    width = 0.8 / (len(keys) * len(batches))
    f16_bytes = {d["batch"]: d["kv_bytes"] for d in rows if d["scheme"] == "f16" and d["context"] == ctx}
    for j, b in enumerate(batches):
        for k, key in enumerate(keys):
            xs, ys = [], []
            for i, s in enumerate(schemes):
                d = next((d for d in rows if d["scheme"] == s and d["batch"] == b and d["context"] == ctx), None)
                if d and d.get(key):
                    xs.append(i + (len(keys) * j + k - (len(keys) * len(batches) - 1) / 2) * width)
                    ys.append(d[key])
            ax.bar(xs, ys, width, label=f"{names[key]}, B={b}", alpha=0.85)
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=6)
        for i, s in enumerate(schemes):
            d = next((d for d in rows if d["scheme"] == s and d["batch"] == b and d["context"] == ctx), None)
            if d and b in f16_bytes:
                ax.plot([i - 0.4, i + 0.4], [f16_bytes[b] / d["kv_bytes"]] * 2, "k:", lw=1)
    ax.set_xticks(range(len(schemes)))
    ax.set_xticklabels(schemes)
    ax.set_ylabel("speed-up (x), higher is better")
    ax.set_title(f"{layout}, context {ctx}: speed-up (log)\ndotted: byte ratio f16 / scheme (the bandwidth-bound ceiling vs f16)", fontsize=9)
    ax.set_yscale("log")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    m = r["machine"]
    fig.suptitle(
        f'kivi CPU decode attention | {m["cpu"]}, {m["threads"]} threads, {m["isa"]}, stream read {m["read_gb_per_s"]:.1f} GB/s | '
        f'KV {"cold" if r.get("cold") else "warm"} | load avg {m.get("load_start", "?")} -> {m.get("load_end", "?")}',
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
