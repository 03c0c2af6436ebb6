// sim_shim.h — runs kivi's generated CUDA on the CPU (the `sim` backend).
//
// Compile a generated source as C++20 after this header (g++/clang++,
// -ffp-contract=off). What it maps:
//
//   __global__ __device__ __forceinline__ __launch_bounds__  -> plain C++
//   __shared__            -> `static thread_local`: one copy per worker thread;
//                            a worker runs one block at a time, so the block's
//                            threads share it, as on the GPU
//   threadIdx blockIdx blockDim gridDim -> the running fiber / block
//   __syncthreads()       -> a barrier of every thread of the block
//   __shfl_xor/down/_sync -> a per-warp exchange slot + a warp barrier
//   __syncwarp()          -> a warp barrier
//   __half conversions, bit casts, __fdiv_rn & co, exp2f, rintf, ...
//
// The threads of a block are fibers (user-mode threads with their own
// stacks) on one OS thread, switched only at barriers: deterministic, and
// a barrier costs a few hundred nanoseconds where an OS-thread barrier of
// 128 threads on two cores costs milliseconds. Blocks run one after another
// on a few worker threads. A barrier that not every thread of the block (or
// warp) reaches, a partial shuffle mask, a stack overflow or more than 1024
// threads stops the launch with a message instead of hanging.
//
// Anything else (atomics, dynamic shared memory, inline PTX, warp votes) is
// not implemented: it fails to compile (static_assert or an unknown name).

#pragma once
#define KIVI_SIM 1

// C headers only: a library holds dozens of variants and the C++ standard
// headers would cost more to parse than the kernels.
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// ---- qualifiers ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static thread_local
#define __align__(n) alignas(n)

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct int2 { int x, y; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };

// ---- bit casts and IEEE-rounded arithmetic ----
inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; memcpy(&x, &f, 4); return x; }
inline unsigned __float_as_uint(float f) { unsigned x; memcpy(&x, &f, 4); return x; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return expf(x); }
inline float __exp2f(float x) { return exp2f(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
// expf exp2f fmaxf fminf fmaf rintf fabsf sqrtf: <math.h>, same IEEE semantics.

// ---- f16 / bf16 (software, round to nearest even, exact) ----
struct __half { unsigned short x; };
struct __nv_bfloat16 { unsigned short x; };
inline __half __ushort_as_half(unsigned short b) { return __half{b}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline float __half2float(__half h) {
  const unsigned sign = (unsigned)(h.x & 0x8000u) << 16;
  const unsigned e = (h.x >> 10) & 0x1fu, m = h.x & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in f32
    const float v = (float)m * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  const unsigned bits = e == 31 ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
  return __uint_as_float(bits);
}
inline __half __float2half_rn(float f) {
  const unsigned x = __float_as_uint(f);
  const unsigned sign = (x >> 16) & 0x8000u;
  const unsigned a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return __half{(unsigned short)(sign | 0x7e00u | ((a >> 13) & 0x3ffu))};  // NaN, quiet
  if (a == 0x7f800000u) return __half{(unsigned short)(sign | 0x7c00u)};
  if (a >= 0x477ff000u) return __half{(unsigned short)(sign | 0x7c00u)};  // >= 65520 rounds to inf
  if (a < 0x38800000u) {  // below 2^-14: a subnormal f16 (units of 2^-24)
    const int e = (int)(a >> 23);
    const int shift = 126 - e;
    if (shift > 24) return __half{(unsigned short)sign};
    const unsigned m = (a & 0x7fffffu) | 0x800000u;
    unsigned r = m >> shift;
    const unsigned rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return __half{(unsigned short)(sign | r)};
  }
  const unsigned r = a - 0x38000000u;  // rebias 127 -> 15
  unsigned mant = r >> 13;
  const unsigned rem = r & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (mant & 1u))) ++mant;
  return __half{(unsigned short)(sign | mant)};
}
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float((unsigned)h.x << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(unsigned short)((x >> 16) | 0x40u)};
  return __nv_bfloat16{(unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16)};
}

// ---- what is not implemented fails loudly ----
template <class T> T atomicAdd(T*, T) { static_assert(sizeof(T) == 0, "sim_shim: atomicAdd is not implemented"); return T(); }
template <class T> T atomicMax(T*, T) { static_assert(sizeof(T) == 0, "sim_shim: atomicMax is not implemented"); return T(); }
template <class T> T atomicCAS(T*, T, T) { static_assert(sizeof(T) == 0, "sim_shim: atomicCAS is not implemented"); return T(); }
template <class T> unsigned __ballot_sync(unsigned, T) { static_assert(sizeof(T) == 0, "sim_shim: __ballot_sync is not implemented"); return 0; }

// ---- fibers ----
namespace kivi_sim {

enum State { READY, AT_BLOCK, AT_WARP, DONE };

struct Fiber {
  void* sp;             // saved stack pointer while switched out
  uint3 tid;
  unsigned warp, lane;
  unsigned phase;       // which of the two exchange buffers the next shuffle uses
  State state;
  char* stack;
};

constexpr size_t STACK = 256 * 1024;
constexpr uint64_t CANARY = 0x6b6976695f73696dull;

struct Worker {
  void* sched_sp = nullptr;
  Fiber* fibers = nullptr;
  unsigned nfibers = 0;
  uint64_t* exch = nullptr;  // [warp][2][32] shuffle slots
  dim3 block_dim{1, 1, 1}, grid_dim{1, 1, 1};
  uint3 block{0, 0, 0};
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  char error[256] = {0};
  ~Worker() {
    for (unsigned i = 0; i < nfibers; ++i) free(fibers[i].stack);
    free(fibers);
    free(exch);
  }
};

inline thread_local Worker* worker = nullptr;
inline thread_local Fiber* current = nullptr;

}  // namespace kivi_sim

#define threadIdx (::kivi_sim::current->tid)
#define blockIdx (::kivi_sim::worker->block)
#define blockDim (::kivi_sim::worker->block_dim)
#define gridDim (::kivi_sim::worker->grid_dim)
#define warpSize 32

#if defined(__x86_64__)
// Switch stacks: saves the callee-saved registers on the current stack and
// the stack pointer into *save, then resumes the stack `next`. (The SSE and
// x87 control words are left alone: nothing here changes them.)
extern "C" __attribute__((visibility("hidden"))) void kivi_sim_swap(void** save, void* next);
extern "C" __attribute__((visibility("hidden"))) void kivi_sim_boot();
// Defined once per library: the first translation unit of a library defines
// them, the others are compiled with KIVI_SIM_SWAP_ELSEWHERE.
#ifndef KIVI_SIM_SWAP_ELSEWHERE
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl kivi_sim_swap\n"
    ".hidden kivi_sim_swap\n"
    ".type kivi_sim_swap,@function\n"
    "kivi_sim_swap:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size kivi_sim_swap, .-kivi_sim_swap\n"
    ".p2align 4\n"
    ".globl kivi_sim_boot\n"
    ".hidden kivi_sim_boot\n"
    ".type kivi_sim_boot,@function\n"
    "kivi_sim_boot:\n"
    "  movq %r12, %rdi\n  callq *%r13\n  ud2\n"
    ".size kivi_sim_boot, .-kivi_sim_boot\n");
#endif
#else
#error "sim_shim: fibers are implemented for x86-64 only; port kivi_sim_swap to this architecture"
#endif

namespace kivi_sim {

inline void switch_from(Fiber* f);

inline void fiber_main(Fiber* f) {
  worker->body(worker->ctx);
  f->state = DONE;
  switch_from(f);
  abort();  // a finished fiber is never resumed
}

// A fresh frame that kivi_sim_swap "returns" into kivi_sim_boot, which
// calls fiber_main(f) (r12 = f, r13 = fiber_main) on a 16-byte-aligned stack.
inline void fiber_reset(Fiber& f) {
  char* top = f.stack + STACK;
  top -= reinterpret_cast<uintptr_t>(top) % 16;
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 72);
  sp[0] = 0;                                              // r15
  sp[1] = 0;                                              // r14
  sp[2] = reinterpret_cast<uint64_t>(&fiber_main);        // r13
  sp[3] = reinterpret_cast<uint64_t>(&f);                 // r12
  sp[4] = 0;                                              // rbx
  sp[5] = 0;                                              // rbp
  sp[6] = reinterpret_cast<uint64_t>(&kivi_sim_boot);     // return address
  f.sp = sp;
  f.state = READY;
  f.phase = 0;
}

// Leaves fiber `f` (its state already set): straight into the next ready
// fiber of this round, or back to the scheduler when there is none.
inline void switch_from(Fiber* f) {
  Worker& w = *worker;
  Fiber* end = w.fibers + w.nfibers;
  for (Fiber* g = f + 1; g < end; ++g) {
    if (g->state == READY) {
      current = g;
      kivi_sim_swap(&f->sp, g->sp);
      return;
    }
  }
  kivi_sim_swap(&f->sp, w.sched_sp);
}

inline void yield_to_scheduler(State s) {
  Fiber* f = current;
  f->state = s;
  switch_from(f);
}

// Runs one block to completion; false (and worker->error) if it cannot.
inline bool run_block(Worker& w) {
  const unsigned n = w.nfibers;
  Fiber* fs = w.fibers;
  for (unsigned i = 0; i < n; ++i) fiber_reset(fs[i]);
  const unsigned warps = (n + 31) / 32;
  for (;;) {
    for (unsigned i = 0; i < n; ++i) {
      if (fs[i].state == READY) {  // runs this fiber and every ready one after it
        current = &fs[i];
        kivi_sim_swap(&w.sched_sp, fs[i].sp);
      }
    }
    current = nullptr;
    // Everyone is at a barrier or done. Release whole warps first.
    bool released = false;
    for (unsigned wp = 0; wp < warps; ++wp) {
      const unsigned lo = wp * 32, hi = lo + 32 < n ? lo + 32 : n;
      unsigned at = 0;
      for (unsigned i = lo; i < hi; ++i) at += fs[i].state == AT_WARP;
      if (at == 0) continue;
      if (at != hi - lo) {
        snprintf(w.error, sizeof w.error,
                 "a warp shuffle or __syncwarp was reached by %u of the %u lanes of warp %u "
                 "(the others exited or wait at __syncthreads)",
                 at, hi - lo, wp);
        return false;
      }
      for (unsigned i = lo; i < hi; ++i) fs[i].state = READY;
      released = true;
    }
    if (released) continue;
    unsigned at = 0, done = 0;
    for (unsigned i = 0; i < n; ++i) {
      at += fs[i].state == AT_BLOCK;
      done += fs[i].state == DONE;
    }
    if (done == n) {
      for (unsigned i = 0; i < n; ++i) {
        if (memcmp(fs[i].stack, &CANARY, sizeof CANARY) != 0) {
          snprintf(w.error, sizeof w.error, "thread %u overflowed its 256 KiB simulated stack", i);
          return false;
        }
      }
      return true;
    }
    if (at == n) {
      for (unsigned i = 0; i < n; ++i) fs[i].state = READY;
      continue;
    }
    snprintf(w.error, sizeof w.error, "__syncthreads() was reached by %u of %u threads; the others exited", at, n);
    return false;
  }
}

template <class T> inline T shuffle(unsigned mask, T v, unsigned src, const char* what) {
  static_assert(sizeof(T) <= 8, "sim_shim: shuffles of more than 8 bytes are not implemented");
  if (mask != 0xffffffffu) {
    fprintf(stderr, "sim_shim: %s with mask %#x: only full-warp masks are implemented\n", what, mask);
    abort();
  }
  Fiber* f = current;
  uint64_t* slots = &worker->exch[(f->warp * 2 + f->phase) * 32];
  f->phase ^= 1;  // double buffering: one barrier per shuffle is enough
  memcpy(&slots[f->lane], &v, sizeof(T));
  yield_to_scheduler(AT_WARP);
  T r;
  memcpy(&r, &slots[src & 31], sizeof(T));
  return r;
}

template <size_t... I> struct Seq {};
template <size_t N, size_t... I> struct MakeSeq : MakeSeq<N - 1, N - 1, I...> {};
template <size_t... I> struct MakeSeq<0, I...> { typedef Seq<I...> type; };
template <class T> struct Bare { typedef T type; };
template <class T> struct Bare<const T> { typedef T type; };
template <class T> struct Bare<T&> { typedef T type; };

// Calls the kernel with the arguments pointed to by `args` (cuLaunchKernel style).
template <class... A, size_t... I>
inline void call(void (*k)(A...), void** args, Seq<I...>) {
  k(*static_cast<typename Bare<A>::type*>(args[I])...);
}

template <class... A> struct Launch {
  void (*kernel)(A...);
  void** args;
  static void run(void* self) {
    Launch* l = static_cast<Launch*>(self);
    call(l->kernel, l->args, typename MakeSeq<sizeof...(A)>::type{});
  }
};

inline unsigned workers_wanted(unsigned long long blocks) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  if (const char* e = getenv("KIVI_SIM_THREADS")) n = atol(e);
  if (n < 1) n = 1;
  if ((unsigned long long)n > blocks) n = (long)blocks;
  return n < 1 ? 1u : (unsigned)n;
}

// One launch: the blocks left to run and the first error.
struct Job {
  void (*body)(void*);
  void* ctx;
  dim3 grid, block;
  unsigned long long blocks;
  unsigned long long next;  // atomically incremented
  int stop;
  pthread_mutex_t lock;
  char error[320];
};

inline void* work(void* arg) {
  Job& job = *static_cast<Job*>(arg);
  const unsigned threads = job.block.x * job.block.y * job.block.z;
  Worker w;
  w.block_dim = job.block;
  w.grid_dim = job.grid;
  w.body = job.body;
  w.ctx = job.ctx;
  w.nfibers = threads;
  w.fibers = static_cast<Fiber*>(calloc(threads, sizeof(Fiber)));
  w.exch = static_cast<uint64_t*>(calloc(((threads + 31) / 32) * 64, sizeof(uint64_t)));
  for (unsigned i = 0; i < threads; ++i) {
    Fiber& f = w.fibers[i];
    f.stack = static_cast<char*>(malloc(STACK));
    memcpy(f.stack, &CANARY, sizeof CANARY);
    f.tid = uint3{i % job.block.x, (i / job.block.x) % job.block.y, i / (job.block.x * job.block.y)};
    f.warp = i / 32;
    f.lane = i % 32;
  }
  worker = &w;
  for (;;) {
    const unsigned long long bi = __atomic_fetch_add(&job.next, 1ull, __ATOMIC_RELAXED);
    if (bi >= job.blocks || __atomic_load_n(&job.stop, __ATOMIC_RELAXED)) break;
    w.block = uint3{(unsigned)(bi % job.grid.x), (unsigned)((bi / job.grid.x) % job.grid.y),
                    (unsigned)(bi / ((unsigned long long)job.grid.x * job.grid.y))};
    if (!run_block(w)) {
      pthread_mutex_lock(&job.lock);
      if (job.error[0] == 0)
        snprintf(job.error, sizeof job.error, "block (%u, %u, %u): %s", w.block.x, w.block.y, w.block.z, w.error);
      pthread_mutex_unlock(&job.lock);
      __atomic_store_n(&job.stop, 1, __ATOMIC_RELAXED);
      break;
    }
  }
  worker = nullptr;
  return nullptr;
}

// dims = {grid x, y, z, block x, y, z}. Returns 0, or 1 with a message in err.
template <class... A>
inline int launch(void (*kernel)(A...), const unsigned* dims, void** args, char* err, int errlen) {
  Launch<A...> l{kernel, args};
  Job job;
  job.body = &Launch<A...>::run;
  job.ctx = &l;
  job.grid = dim3{dims[0], dims[1], dims[2]};
  job.block = dim3{dims[3], dims[4], dims[5]};
  job.blocks = (unsigned long long)dims[0] * dims[1] * dims[2];
  job.next = 0;
  job.stop = 0;
  job.error[0] = 0;
  pthread_mutex_init(&job.lock, nullptr);
  const unsigned long long threads = (unsigned long long)dims[3] * dims[4] * dims[5];
  if (threads == 0 || threads > 1024) {
    snprintf(err, (size_t)errlen, "a block of %llu threads; expected 1 to 1024", threads);
    return 1;
  }
  if (job.blocks == 0) return 0;
  const unsigned nw = workers_wanted(job.blocks);
  pthread_t pool[64];
  unsigned started = 0;
  for (unsigned i = 1; i < nw && i < 64; ++i) {
    if (pthread_create(&pool[started], nullptr, &work, &job) == 0) ++started;
  }
  work(&job);
  for (unsigned i = 0; i < started; ++i) pthread_join(pool[i], nullptr);
  pthread_mutex_destroy(&job.lock);
  if (job.error[0] != 0) {
    snprintf(err, (size_t)errlen, "%s", job.error);
    return 1;
  }
  return 0;
}

}  // namespace kivi_sim

inline void __syncthreads() { kivi_sim::yield_to_scheduler(kivi_sim::AT_BLOCK); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) {
    fprintf(stderr, "sim_shim: __syncwarp with a partial mask is not implemented\n");
    abort();
  }
  kivi_sim::yield_to_scheduler(kivi_sim::AT_WARP);
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const unsigned lane = kivi_sim::current->lane;
  unsigned src = lane ^ (unsigned)lane_mask;
  if ((src & ~(unsigned)(width - 1)) != (lane & ~(unsigned)(width - 1))) src = lane;
  return kivi_sim::shuffle(mask, v, src, "__shfl_xor_sync");
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const unsigned lane = kivi_sim::current->lane;
  unsigned src = lane + delta;
  if ((src & ~(unsigned)(width - 1)) != (lane & ~(unsigned)(width - 1))) src = lane;
  return kivi_sim::shuffle(mask, v, src, "__shfl_down_sync");
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const unsigned lane = kivi_sim::current->lane;
  const unsigned seg = lane & ~(unsigned)(width - 1);
  const unsigned src = lane - seg >= delta ? lane - delta : lane;
  return kivi_sim::shuffle(mask, v, src, "__shfl_up_sync");
}
template <class T> inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  const unsigned lane = kivi_sim::current->lane;
  const unsigned src = (lane & ~(unsigned)(width - 1)) + ((unsigned)src_lane & (unsigned)(width - 1));
  return kivi_sim::shuffle(mask, v, src, "__shfl_sync");
}

// The entry point the sim backend calls for kernel `name` (defined after it):
//   extern "C" int <symbol>(const unsigned* dims, void** args, char* err, int errlen)
#define KIVI_SIM_EXPORT(symbol, name)                                                  \
  extern "C" __attribute__((visibility("default"))) int symbol(const unsigned* dims, void** args, char* err, \
                                                               int errlen) {           \
    return ::kivi_sim::launch(name, dims, args, err, errlen);                           \
  }
