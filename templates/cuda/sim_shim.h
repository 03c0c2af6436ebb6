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

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

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
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return std::exp(x); }
inline float __exp2f(float x) { return std::exp2(x); }
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
  if (a >= 0x7f800000u) return __half{(unsigned short)(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u))};
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
  std::vector<Fiber> fibers;
  std::vector<uint64_t> exch;  // [warp][2][32] shuffle slots
  dim3 block_dim{1, 1, 1}, grid_dim{1, 1, 1};
  uint3 block{0, 0, 0};
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  std::string error;
  ~Worker() {
    for (auto& f : fibers) std::free(f.stack);
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
  std::abort();  // a finished fiber is never resumed
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
  Fiber* end = w.fibers.data() + w.fibers.size();
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
  const unsigned n = (unsigned)w.fibers.size();
  for (auto& f : w.fibers) fiber_reset(f);
  const unsigned warps = (n + 31) / 32;
  for (;;) {
    for (auto& f : w.fibers) {
      if (f.state == READY) {  // runs this fiber and every ready one after it
        current = &f;
        kivi_sim_swap(&w.sched_sp, f.sp);
      }
    }
    current = nullptr;
    // Everyone is at a barrier or done. Release whole warps first.
    bool released = false;
    for (unsigned wp = 0; wp < warps; ++wp) {
      const unsigned lo = wp * 32, hi = lo + 32 < n ? lo + 32 : n;
      unsigned at = 0;
      for (unsigned i = lo; i < hi; ++i) at += w.fibers[i].state == AT_WARP;
      if (at == 0) continue;
      if (at != hi - lo) {
        w.error = "a warp shuffle or __syncwarp was reached by " + std::to_string(at) + " of the " +
                  std::to_string(hi - lo) + " lanes of warp " + std::to_string(wp) +
                  " (the others exited or wait at __syncthreads)";
        return false;
      }
      for (unsigned i = lo; i < hi; ++i) w.fibers[i].state = READY;
      released = true;
    }
    if (released) continue;
    unsigned at = 0, done = 0;
    for (auto& f : w.fibers) {
      at += f.state == AT_BLOCK;
      done += f.state == DONE;
    }
    if (done == n) {
      for (auto& f : w.fibers) {
        if (std::memcmp(f.stack, &CANARY, sizeof CANARY) != 0) {
          w.error = "a thread overflowed its 256 KiB simulated stack";
          return false;
        }
      }
      return true;
    }
    if (at == n) {
      for (auto& f : w.fibers) f.state = READY;
      continue;
    }
    w.error = "__syncthreads() was reached by " + std::to_string(at) + " of " + std::to_string(n) +
              " threads; the others exited";
    return false;
  }
}

template <class T> inline T shuffle(unsigned mask, T v, unsigned src, const char* what) {
  static_assert(sizeof(T) <= 8, "sim_shim: shuffles of more than 8 bytes are not implemented");
  if (mask != 0xffffffffu) {
    std::fprintf(stderr, "sim_shim: %s with mask %#x: only full-warp masks are implemented\n", what, mask);
    std::abort();
  }
  Fiber* f = current;
  uint64_t* slots = &worker->exch[(f->warp * 2 + f->phase) * 32];
  f->phase ^= 1;  // double buffering: one barrier per shuffle is enough
  std::memcpy(&slots[f->lane], &v, sizeof(T));
  yield_to_scheduler(AT_WARP);
  T r;
  std::memcpy(&r, &slots[src & 31], sizeof(T));
  return r;
}

// Calls the kernel with the arguments pointed to by `args` (cuLaunchKernel style).
template <class... A, size_t... I>
inline void call(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

template <class... A> struct Launch {
  void (*kernel)(A...);
  void** args;
  static void run(void* self) {
    auto* l = static_cast<Launch*>(self);
    call(l->kernel, l->args, std::index_sequence_for<A...>{});
  }
};

inline unsigned workers_wanted(unsigned long long blocks) {
  unsigned n = std::thread::hardware_concurrency();
  if (const char* e = std::getenv("KIVI_SIM_THREADS")) n = (unsigned)std::atoi(e);
  if (n == 0) n = 1;
  if (n > blocks) n = (unsigned)blocks;
  return n ? n : 1;
}

// dims = {grid x, y, z, block x, y, z}. Returns 0, or 1 with a message in err.
template <class... A>
inline int launch(void (*kernel)(A...), const unsigned* dims, void** args, char* err, int errlen) {
  Launch<A...> l{kernel, args};
  const dim3 grid{dims[0], dims[1], dims[2]}, block{dims[3], dims[4], dims[5]};
  const unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
  const unsigned long long blocks = (unsigned long long)grid.x * grid.y * grid.z;
  auto fail = [&](const std::string& m) {
    std::snprintf(err, (size_t)errlen, "%s", m.c_str());
    return 1;
  };
  if (threads == 0 || threads > 1024) return fail("a block of " + std::to_string(threads) + " threads; expected 1 to 1024");
  if (blocks == 0) return 0;
  std::atomic<unsigned long long> next{0};
  std::atomic<bool> stop{false};
  std::mutex m;
  std::string first_error;
  auto work = [&]() {
    Worker w;
    w.block_dim = block;
    w.grid_dim = grid;
    w.body = &Launch<A...>::run;
    w.ctx = &l;
    w.fibers.resize(threads);
    w.exch.assign(((threads + 31) / 32) * 64, 0);
    for (unsigned i = 0; i < threads; ++i) {
      Fiber& f = w.fibers[i];
      f.stack = static_cast<char*>(std::malloc(STACK));
      std::memcpy(f.stack, &CANARY, sizeof CANARY);
      f.tid = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
      f.warp = i / 32;
      f.lane = i % 32;
    }
    worker = &w;
    for (;;) {
      const unsigned long long bi = next.fetch_add(1);
      if (bi >= blocks || stop.load()) break;
      w.block = uint3{(unsigned)(bi % grid.x), (unsigned)((bi / grid.x) % grid.y), (unsigned)(bi / ((unsigned long long)grid.x * grid.y))};
      if (!run_block(w)) {
        std::lock_guard<std::mutex> g(m);
        if (first_error.empty())
          first_error = "block (" + std::to_string(w.block.x) + ", " + std::to_string(w.block.y) + ", " +
                        std::to_string(w.block.z) + "): " + w.error;
        stop = true;
        break;
      }
    }
    worker = nullptr;
  };
  const unsigned nw = workers_wanted(blocks);
  std::vector<std::thread> pool;
  for (unsigned i = 1; i < nw; ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (!first_error.empty()) return fail(first_error);
  return 0;
}

}  // namespace kivi_sim

inline void __syncthreads() { kivi_sim::yield_to_scheduler(kivi_sim::AT_BLOCK); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) {
    std::fprintf(stderr, "sim_shim: __syncwarp with a partial mask is not implemented\n");
    std::abort();
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
