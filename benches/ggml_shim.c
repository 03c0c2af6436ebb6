// kivi's shim over ggml's CPU flash attention (the llama.cpp backend), for
// the `llama.cpp` peer of `kivi bench` (kivi-cli/src/bench/ggml.rs).
//
// scripts/build-ggml.sh compiles it with ggml-base and ggml-cpu into one
// shared library, libkivi_ggml.so, that kivi loads with dlopen at run time:
// the kivi binary has no build-time dependency on ggml.
//
// One handle holds one decode point: a ggml context with Q, K and V at
// kivi's shapes, K and V stored in ggml's own types (f16, or q8_0/q4_0 made
// by ggml's own quantize functions), one `ggml_flash_attn_ext` node and a
// thread pool. `kivi_ggml_run` computes the graph once; the caller times it.
//
// Layouts (kivi's, row-major):
//   q   [batch, q_heads, head_dim]              f32
//   k,v [batch][tokens, kv_heads, head_dim]     f32; sequence b starts at
//        b * seq_stride floats (seq_stride 0: every sequence shares one K/V)
//   out [batch, q_heads, head_dim]              f32
// ggml's (ne0 fastest): q [d, 1, q_heads, batch], k/v [d, tokens, kv_heads,
// batch], result [d, q_heads, 1, batch], which is kivi's out as stored.

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cpu.h"
#include "ggml.h"

typedef struct kivi_ggml {
    struct ggml_context *ctx;
    struct ggml_cgraph *graph;
    struct ggml_tensor *out;
    struct ggml_threadpool *pool;
    struct ggml_cplan plan;
    uint8_t *work;
    int64_t out_floats;
} kivi_ggml;

// The ggml types this shim offers, by kivi's name.
static int type_of(const char *name, enum ggml_type *t) {
    if (strcmp(name, "f16") == 0) { *t = GGML_TYPE_F16; return 0; }
    if (strcmp(name, "q8_0") == 0) { *t = GGML_TYPE_Q8_0; return 0; }
    if (strcmp(name, "q4_0") == 0) { *t = GGML_TYPE_Q4_0; return 0; }
    return -1;
}

static void set_err(char *err, int errlen, const char *msg) {
    if (err && errlen > 0) snprintf(err, (size_t)errlen, "%s", msg);
}

// Copies kivi's [tokens, kv_heads, d] rows of each sequence into ggml's
// [d, tokens, kv_heads, batch] tensor of type t, converting row by row.
static void fill_kv(struct ggml_tensor *dst, enum ggml_type t, const float *src, int64_t seq_stride,
                    int batch, int kv_heads, int tokens, int d) {
    for (int b = 0; b < batch; b++) {
        const float *seq = src + (int64_t)b * seq_stride;
        for (int h = 0; h < kv_heads; h++) {
            for (int tok = 0; tok < tokens; tok++) {
                const float *x = seq + ((int64_t)tok * kv_heads + h) * d;
                char *y = (char *)dst->data + (size_t)b * dst->nb[3] + (size_t)h * dst->nb[2] + (size_t)tok * dst->nb[1];
                if (t == GGML_TYPE_F16) {
                    ggml_fp32_to_fp16_row(x, (ggml_fp16_t *)y, d);
                } else {
                    ggml_quantize_chunk(t, x, y, 0, 1, d, NULL);
                }
            }
        }
    }
}

// Builds one decode point. Returns NULL and writes a message into err on
// failure (unknown type, head_dim not a multiple of the block, no memory).
kivi_ggml *kivi_ggml_new(const char *type_name, int batch, int q_heads, int kv_heads, int head_dim, int tokens,
                         int threads, const float *q, const float *k, const float *v, int64_t seq_stride,
                         char *err, int errlen) {
    enum ggml_type t;
    // Sets up ggml-cpu's conversion tables; idempotent.
    ggml_cpu_init();
    if (type_of(type_name, &t) != 0) {
        set_err(err, errlen, "unknown ggml type (expected f16, q8_0 or q4_0)");
        return NULL;
    }
    if (batch < 1 || q_heads < 1 || kv_heads < 1 || head_dim < 1 || tokens < 1 || threads < 1 ||
        q_heads % kv_heads != 0) {
        set_err(err, errlen, "bad shape");
        return NULL;
    }
    if (head_dim % ggml_blck_size(t) != 0) {
        set_err(err, errlen, "head_dim is not a multiple of the type's block size");
        return NULL;
    }
    size_t kv_bytes = ggml_row_size(t, head_dim) * (size_t)tokens * (size_t)kv_heads * (size_t)batch;
    size_t q_bytes = sizeof(float) * (size_t)head_dim * (size_t)q_heads * (size_t)batch;
    size_t mem = 2 * kv_bytes + 2 * q_bytes + 16 * ggml_tensor_overhead() + ggml_graph_overhead() + (1 << 20);
    struct ggml_init_params ip = {mem, NULL, false};
    struct ggml_context *ctx = ggml_init(ip);
    if (!ctx) {
        set_err(err, errlen, "ggml_init failed (out of memory?)");
        return NULL;
    }
    struct ggml_tensor *tq = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, head_dim, 1, q_heads, batch);
    struct ggml_tensor *tk = ggml_new_tensor_4d(ctx, t, head_dim, tokens, kv_heads, batch);
    struct ggml_tensor *tv = ggml_new_tensor_4d(ctx, t, head_dim, tokens, kv_heads, batch);
    memcpy(tq->data, q, q_bytes);
    fill_kv(tk, t, k, seq_stride, batch, kv_heads, tokens, head_dim);
    fill_kv(tv, t, v, seq_stride, batch, kv_heads, tokens, head_dim);
    // No mask: every token of every sequence is attended (one decode query
    // per sequence, the sequences in ne3), as kivi's decode does.
    float scale = 1.0f / sqrtf((float)head_dim);
    struct ggml_tensor *o = ggml_flash_attn_ext(ctx, tq, tk, tv, NULL, scale, 0.0f, 0.0f);
    struct ggml_cgraph *g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, o);

    // llama.cpp's own settings: its default polling level (50: workers spin
    // for new work a while before they sleep). Polling 0 was measured slower
    // on a loaded 2-core VM (a sleeping worker waits a scheduler tick).
    struct ggml_threadpool_params tp = ggml_threadpool_params_default(threads);
    tp.poll = 50;
    struct ggml_threadpool *pool = ggml_threadpool_new(&tp);
    if (!pool) {
        ggml_free(ctx);
        set_err(err, errlen, "ggml_threadpool_new failed");
        return NULL;
    }
    kivi_ggml *h = calloc(1, sizeof(kivi_ggml));
    if (!h) {
        ggml_threadpool_free(pool);
        ggml_free(ctx);
        set_err(err, errlen, "out of memory");
        return NULL;
    }
    h->ctx = ctx;
    h->graph = g;
    h->out = o;
    h->pool = pool;
    h->plan = ggml_graph_plan(g, threads, pool);
    if (h->plan.work_size > 0) {
        h->work = malloc(h->plan.work_size);
        if (!h->work) {
            ggml_threadpool_free(pool);
            ggml_free(ctx);
            free(h);
            set_err(err, errlen, "out of memory for the work buffer");
            return NULL;
        }
        h->plan.work_data = h->work;
    }
    h->out_floats = (int64_t)head_dim * q_heads * batch;
    return h;
}

// Bytes of K and V as ggml stores them.
int64_t kivi_ggml_kv_bytes(const kivi_ggml *h) {
    struct ggml_tensor *o = h->out;
    return (int64_t)(ggml_nbytes(o->src[1]) + ggml_nbytes(o->src[2]));
}

// Computes the attention once. out (may be NULL) receives
// [batch, q_heads, head_dim] f32. Returns 0, or ggml's status.
int kivi_ggml_run(kivi_ggml *h, float *out) {
    enum ggml_status s = ggml_graph_compute(h->graph, &h->plan);
    if (s != GGML_STATUS_SUCCESS) return (int)s;
    if (out) memcpy(out, h->out->data, sizeof(float) * (size_t)h->out_floats);
    return 0;
}

void kivi_ggml_free(kivi_ggml *h) {
    if (!h) return;
    ggml_threadpool_free(h->pool);
    ggml_free(h->ctx);
    free(h->work);
    free(h);
}
