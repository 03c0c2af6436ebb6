#!/usr/bin/env python3
"""The accuracy/bytes frontier of docs/accuracy.md: Δ perplexity and mean
KL against bytes per token per KV head, for every scheme of a `kivi eval
--json` report, with llama.cpp's KV cache types as reference points.

Usage: frontier.py REPORT.json OUT.png

llama.cpp's numbers are the ones issue 11 reports for the same protocol
(llama-cpp-python 0.3.36, llama.cpp 0c1e570, flash attention, its default
Hadamard rotation on, Gemma 3 270M with f32-dequantized weights): bits per
element -> bytes per token per head at head_dim 256 is bits x 2 x 256 / 8.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LLAMA_CPP = [  # name, bits/elem, Δppl %, mean KL
    ("q8_0", 8.5, -0.04, 0.0007),
    ("q5_1", 6.0, 1.5, 0.022),
    ("q5_0", 5.5, 3.0, 0.034),
    ("q4_1", 5.0, 10.3, 0.119),
    ("q4_0", 4.5, 11.3, 0.118),
    ("iq4_nl", 4.5, 10.8, 0.136),
]
KIVI_FAMILY = {"int8", "kivi4", "kivi2", "kivi2_r0", "swapped2", "tok4"}


def lower_envelope(points):
    """Points (x, y) on the frontier: no other point has both x <= and y <."""
    pts = sorted(points)
    out, best = [], float("inf")
    for x, y in pts:
        if y < best:
            out.append((x, y))
            best = y
    return out


def main():
    report = json.load(open(sys.argv[1]))
    head_dim = report["model"]["head_dim"]
    rows = report["schemes"]
    base = rows[0]["perplexity"]
    pts = []
    for r in rows:
        if r["name"] in ("f32", "f16"):
            continue
        kind = "kivi" if r["name"] in KIVI_FAMILY else "codec"
        pts.append((r["name"], kind, r["bytes_per_token_per_head"], 100 * (r["perplexity"] / base - 1), r["kl_mean"]))
    for name, bits, dppl, kl in LLAMA_CPP:
        pts.append((name, "llama.cpp", bits * 2 * head_dim / 8, dppl, kl))
    style = {
        "kivi": dict(color="#1f77b4", marker="o", label="kivi presets (uniform codes)"),
        "codec": dict(color="#d62728", marker="s", label="kivi codec pipeline (this issue)"),
        "llama.cpp": dict(color="#7f7f7f", marker="^", label="llama.cpp KV types (issue 11)"),
    }
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, col, ylabel, log in ((axes[0], 3, "Δ perplexity vs f32 (%)", "symlog"), (axes[1], 4, "mean KL (nats)", "log")):
        for kind, st in style.items():
            sel = [p for p in pts if p[1] == kind]
            ax.scatter([p[2] for p in sel], [p[col] for p in sel], s=36, zorder=3, **st)
            for i, p in enumerate(sel):
                # alternate sides so that neighbours do not print on each other
                dy = 3 if i % 2 == 0 else -9
                ax.annotate(p[0], (p[2], p[col]), fontsize=7, xytext=(4, dy), textcoords="offset points")
        for kinds, color, label in (({"kivi"}, "#1f77b4", "KIVI frontier"),
                                    ({"kivi", "codec"}, "#d62728", "kivi frontier with codecs")):
            env = lower_envelope([(p[2], p[col]) for p in pts if p[1] in kinds])
            xs, ys = [e[0] for e in env], [e[1] for e in env]
            ax.step(xs, ys, where="post", color=color, alpha=0.5, lw=1.2, label=label)
        ax.axvline(192, color="#999", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        if log == "symlog":
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_ylim(-1.0, 3000)
            ax.axhline(3, color="#2ca02c", ls="--", lw=0.8)  # goal at kivi2's bytes
            ax.axhline(10, color="#ff7f0e", ls="--", lw=0.8)  # goal at <= 2.0 bits
        else:
            ax.set_yscale("log")
            ax.axhline(0.02, color="#2ca02c", ls="--", lw=0.8)  # goal at kivi2's bytes
        ax.set_xlabel("bytes per quantized token per KV head (K + V, all-in; head_dim 256)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7, loc="upper right")
    for ax in axes:
        ax.text(192, 0.02, " kivi2's bytes", transform=ax.get_xaxis_transform(), fontsize=7, color="#666")
    fig.suptitle(f"Gemma 3 270M, {report['scored_tokens']} decoded tokens of {report['text'].split('/')[-1]}: accuracy against cache bytes")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
