"""Peer implementations of decode attention, timed the same way as `kivi bench`.

Run by `kivi bench` from its own venv (.cache/bench-py); it can also be run
by hand:  python benches/peers.py --spec spec.json  (spec: see `main`).
Prints one JSON object on stdout.

Peers:
- numpy: float32 throughout (batched matmul), dtype asserted at every step:
  numpy 2 promotes to float64 as soon as a float64 scalar is involved.
- torch: torch.nn.functional.scaled_dot_product_attention on CPU over f16
  and f32 KV, where torch imports.
- jax: jax.nn.dot_product_attention (XLA CPU) over f16 and f32 KV, where jax
  imports.
Every peer sees the same shapes as the Rust benchmark: one query token per
sequence, `batch` sequences of `context` tokens, GQA `q_heads:kv_heads`.
"""

import json
import sys
import time


def stats(times_ms):
    t = sorted(times_ms)
    n = len(t)

    def q(p):
        return t[min(n - 1, int(round(p * (n - 1))))]

    return {"median_ms": q(0.5), "p20_ms": q(0.2), "p80_ms": q(0.8), "min_ms": t[0], "reps": n}


def timed(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return stats(out)


def numpy_peer(np, shape, reps, threads):
    b, hq, hkv, d, t = shape["batch"], shape["q_heads"], shape["kv_heads"], shape["head_dim"], shape["context"]
    g = hq // hkv
    rng = np.random.default_rng(0)
    k = rng.standard_normal((b, hkv, t, d), dtype=np.float32)
    v = rng.standard_normal((b, hkv, t, d), dtype=np.float32)
    q = rng.standard_normal((b, hkv, g, d), dtype=np.float32)
    # [.., d, g]: K @ q^T is a tall-skinny GEMM on the big operand as stored,
    # which OpenBLAS runs faster than q @ K^T (measured on these machines).
    qt = np.ascontiguousarray(q.transpose(0, 1, 3, 2))
    scale = np.float32(1.0 / np.sqrt(d))
    assert k.dtype == v.dtype == qt.dtype == scale.dtype == np.float32

    def run():
        s = np.matmul(k, qt)  # [b, hkv, t, g]
        s *= scale
        s -= s.max(axis=-2, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-2, keepdims=True)
        o = np.matmul(s.transpose(0, 1, 3, 2), v)  # [b, hkv, g, d]
        assert s.dtype == np.float32 and o.dtype == np.float32, (s.dtype, o.dtype)
        return o

    # BLAS threads that spin lose badly on a busy machine: time 1 thread and
    # `threads`, and keep the faster (the peer's best showing).
    best, note = None, "BLAS threads: default"
    try:
        from threadpoolctl import threadpool_limits

        for n in sorted({1, threads}):
            with threadpool_limits(limits=n, user_api="blas"):
                r = timed(run, reps, warmup=1)
            if best is None or r["median_ms"] < best["median_ms"]:
                best, note = r, "BLAS threads: %d (best of 1 and %d)" % (n, threads)
    except ImportError:
        best = timed(run, reps, warmup=1)
    best["kv_bytes"] = int(k.nbytes + v.nbytes)
    best["note"] = note
    return best


def torch_peer(torch, shape, reps, dtype):
    b, hq, hkv, d, t = shape["batch"], shape["q_heads"], shape["kv_heads"], shape["head_dim"], shape["context"]
    g = hq // hkv
    dt = {"f16": torch.float16, "f32": torch.float32}[dtype]
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(b, hkv, t, d, generator=gen).to(dt)
    v = torch.randn(b, hkv, t, d, generator=gen).to(dt)
    q = torch.randn(b, hkv, g, d, generator=gen).to(dt)  # GQA: the group as the query length
    f = torch.nn.functional.scaled_dot_product_attention

    def run():
        with torch.no_grad():
            o = f(q, k, v)
        assert o.dtype == dt
        return o

    r = timed(run, reps, warmup=1)
    r["kv_bytes"] = int(k.numel() * k.element_size() * 2)
    return r


def jax_peer(jax, jnp, shape, reps, dtype):
    b, hq, hkv, d, t = shape["batch"], shape["q_heads"], shape["kv_heads"], shape["head_dim"], shape["context"]
    dt = {"f16": jnp.float16, "f32": jnp.float32}[dtype]
    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    # [batch, tokens, heads, head_dim]; fewer KV heads than query heads is GQA.
    k = jax.random.normal(k1, (b, t, hkv, d), dtype=jnp.float32).astype(dt)
    v = jax.random.normal(k2, (b, t, hkv, d), dtype=jnp.float32).astype(dt)
    q = jax.random.normal(k3, (b, 1, hq, d), dtype=jnp.float32).astype(dt)
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))
    f(q, k, v).block_until_ready()

    def run():
        o = f(q, k, v).block_until_ready()
        assert o.dtype == dt
        return o

    r = timed(run, reps, warmup=1)
    r["kv_bytes"] = int(k.size * k.dtype.itemsize * 2)
    return r


def main():
    spec_path = sys.argv[sys.argv.index("--spec") + 1]
    with open(spec_path) as f:
        spec = json.load(f)
    reps = int(spec.get("reps", 7))
    want = set(spec.get("peers", ["numpy", "torch", "jax"]))
    out = {"available": {}, "results": []}
    libs = {}
    try:
        import numpy as np

        libs["numpy"] = np
        out["available"]["numpy"] = "numpy " + np.__version__
    except Exception as e:  # noqa: BLE001 - report any import failure
        out["available"]["numpy"] = "unavailable: " + str(e).splitlines()[0]
    if "torch" in want:
        try:
            import torch

            torch.set_num_threads(int(spec.get("threads", 2)))
            libs["torch"] = torch
            out["available"]["torch"] = "torch " + torch.__version__
        except Exception as e:  # noqa: BLE001
            out["available"]["torch"] = "unavailable: " + (str(e).splitlines() or ["import failed"])[0][:200]
    if "jax" in want:
        try:
            import jax
            import jax.numpy as jnp

            jax.config.update("jax_platforms", "cpu")
            libs["jax"] = (jax, jnp)
            out["available"]["jax"] = "jax " + jax.__version__
        except Exception as e:  # noqa: BLE001
            out["available"]["jax"] = "unavailable: " + (str(e).splitlines() or ["import failed"])[0][:200]
    for shape in spec["shapes"]:
        runs = []
        if "numpy" in libs and "numpy" in want:
            runs.append(("numpy", "f32", lambda s=shape: numpy_peer(libs["numpy"], s, reps, int(spec.get("threads", 2)))))
        if "torch" in libs:
            for dt in ("f16", "f32"):
                runs.append(("torch_sdpa", dt, lambda s=shape, dt=dt: torch_peer(libs["torch"], s, reps, dt)))
        if "jax" in libs:
            for dt in ("f16", "f32"):
                runs.append(("jax_dpa", dt, lambda s=shape, dt=dt: jax_peer(*libs["jax"], s, reps, dt)))
        for name, dt, fn in runs:
            row = dict(shape)
            row.update({"peer": name, "dtype": dt})
            try:
                row.update(fn())
            except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal
                row["error"] = (str(e).splitlines() or ["failed"])[0][:200]
            out["results"].append(row)
            took = "error: " + row["error"] if "error" in row else "%.3f ms" % row["median_ms"]
            print("kivi bench: peer %s %s %s context %d batch %d: %s" % (name, dt, shape["layout"], shape["context"], shape["batch"], took), file=sys.stderr, flush=True)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
