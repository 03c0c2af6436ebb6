// sim_shim.h — runs kivi's generated CUDA on the CPU (the `sim` backend),
// strictly enough that the kernel bugs a GPU would expose show up here.
//
// Compiled as C++17 (NVRTC's dialect) after this header; the flags are in
// kivi-runtime/src/sim/compile.rs. What it maps:
//
//   __global__ __device__ __forceinline__ __launch_bounds__  -> plain C++
//   KIVI_SHARED(T, name, dims) -> a block's shared array, poisoned (below)
//   threadIdx blockIdx blockDim gridDim -> the running fiber / block
//   __syncthreads()       -> a barrier of every thread of the block
//   __shfl_xor/down/up/_sync, __syncwarp -> a per-warp exchange + barrier
//   KIVI_LOAD_VECTOR(uint4, p) -> an alignment-checked vector load
//   __half conversions, bit casts, __fdiv_rn & co, exp2f, rintf, ...
//
// Execution. The threads of a block are fibers (user-mode threads with their
// own stacks) on one OS thread, switched only at barriers and warp
// collectives: deterministic, and a barrier costs a few hundred nanoseconds
// where an OS-thread barrier of 128 threads on two cores costs milliseconds.
// Blocks run one after another on a few worker threads.
//
// Strictness (each check stops the launch with a message naming the block,
// the thread and the source line; nothing aborts or hangs):
//
// * Schedules. A fiber runs until it blocks; the next to run is the first
//   ready fiber of a priority order that is drawn afresh at every block-wide
//   barrier: thread order, reverse thread order, or (seeded) a random order
//   of whole warps or a random order of all threads, from (seed, block,
//   barrier phase). A warp whose last lane arrives at a collective is
//   released at once, so the first warp of the order runs as far ahead as
//   the barriers let it. A missing __syncthreads therefore lets one thread
//   read what another has not written yet (or overwrite what another has
//   not read yet) under at least one of the orders, and the answer changes.
//   The same (schedule, seed) gives the same run whatever the worker count.
//
// * Shared memory is poisoned at every block start (a byte chosen by the
//   host: 0xff makes every float NaN, 0x7f a huge finite value that a max()
//   does not ignore), so a read before a write shows. Design: `__shared__`
//   is a storage class CUDA puts before the type, and the shim cannot attach
//   work to a bare declaration, so the templates declare shared arrays with
//   KIVI_SHARED(type, name, dims) — `__shared__ type name dims` under NVRTC,
//   here a `static thread_local` array (a worker runs one block at a time,
//   so the block's fibers share it, as on the GPU) plus a per-object note of
//   the last block that touched it: the first thread of a block to pass the
//   declaration poisons the array and adds its size to the block's shared
//   total. That is sound because no thread can name the array before passing
//   its declaration. A bare `__shared__` is a compile error here (a
//   static_assert that says to use KIVI_SHARED), so no array escapes the
//   poisoning. The block's total is checked against the architecture's
//   static limit (48 KiB) and against the generator's EntryLaunch::shared_bytes.
//
// * Warp collectives: every lane of the warp must arrive at the same call
//   (same kind, same source line, same mask) before any is released;
//   otherwise the launch fails listing which lanes wait where. Only
//   full-warp masks on full warps are implemented; anything else is an
//   error, not a guess. __syncthreads() must be reached by every thread of
//   the block at the same call site; lanes or threads that exited while
//   others wait are reported the same way (a deadlock on a GPU).
//
// * Vector loads (KIVI_LOAD_VECTOR) check that the address is a multiple of
//   the vector's size, as the GPU's ld.v2/ld.v4 require.
//
// * Arithmetic: compiled like NVRTC's --fmad=true (the host compiler may
//   contract a*b+c into an FMA), except the __f*_rn intrinsics, which CUDA
//   never fuses: an empty asm keeps their operands and results opaque, so
//   the prefill/append quantization stays bit-exact with the host.
//
// Launch shapes (threads per block, block and grid dimensions, launch
// bounds) are checked against the architecture before the call, on the
// Rust side (SimLibrary::launch_raw). Anything else (atomics, dynamic shared
// memory, inline PTX, warp votes) is not implemented: it fails to compile.

#pragma once
#define KIVI_SIM 1

// C headers only: a library holds dozens of variants and the C++ standard
// headers would cost more to parse than the kernels.
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
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
// Bare __shared__ would escape the poisoning: refuse it (see above).
#define __shared__                                                                                  \
  static_assert(false, "sim_shim: declare shared memory with KIVI_SHARED(type, name, dims), not __shared__"); \
  static thread_local
#define __align__(n) alignas(n)
// Program constants (the Lloyd–Max tables): ordinary read-only data here.
#define __constant__

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
// Vector types as aligned as CUDA's (the vector loads rely on it).
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };

// ---- bit casts and IEEE-rounded arithmetic ----
inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; memcpy(&x, &f, 4); return x; }
inline unsigned __float_as_uint(float f) { unsigned x; memcpy(&x, &f, 4); return x; }
// CUDA never contracts the _rn intrinsics into FMAs; the library is built
// with contraction on (like --fmad=true), so an empty asm hides their
// operands and results from the optimizer: nothing fuses across them.
#define KIVI_SIM_OPAQUE(x) __asm__("" : "+x"(x))
inline float __fdiv_rn(float a, float b) { KIVI_SIM_OPAQUE(a); KIVI_SIM_OPAQUE(b); float r = a / b; KIVI_SIM_OPAQUE(r); return r; }
inline float __fsub_rn(float a, float b) { KIVI_SIM_OPAQUE(a); KIVI_SIM_OPAQUE(b); float r = a - b; KIVI_SIM_OPAQUE(r); return r; }
inline float __fadd_rn(float a, float b) { KIVI_SIM_OPAQUE(a); KIVI_SIM_OPAQUE(b); float r = a + b; KIVI_SIM_OPAQUE(r); return r; }
inline float __fmul_rn(float a, float b) { KIVI_SIM_OPAQUE(a); KIVI_SIM_OPAQUE(b); float r = a * b; KIVI_SIM_OPAQUE(r); return r; }
inline float __frcp_rn(float x) { KIVI_SIM_OPAQUE(x); float r = 1.0f / x; KIVI_SIM_OPAQUE(r); return r; }
// f64 arithmetic of the codec pipeline's writes (Hadamard butterflies,
// norms, means), kept unfused for the same reason.
inline double __dadd_rn(double a, double b) { KIVI_SIM_OPAQUE(a); KIVI_SIM_OPAQUE(b); double r = a + b; KIVI_SIM_OPAQUE(r); return r; }
inline double __dsub_rn(double a, double b) { KIVI_SIM_OPAQUE(a); KIVI_SIM_OPAQUE(b); double r = a - b; KIVI_SIM_OPAQUE(r); return r; }
inline double __dmul_rn(double a, double b) { KIVI_SIM_OPAQUE(a); KIVI_SIM_OPAQUE(b); double r = a * b; KIVI_SIM_OPAQUE(r); return r; }
inline double __ddiv_rn(double a, double b) { KIVI_SIM_OPAQUE(a); KIVI_SIM_OPAQUE(b); double r = a / b; KIVI_SIM_OPAQUE(r); return r; }
inline double __dsqrt_rn(double a) { KIVI_SIM_OPAQUE(a); double r = sqrt(a); KIVI_SIM_OPAQUE(r); return r; }
inline float __double2float_rn(double a) { KIVI_SIM_OPAQUE(a); float r = (float)a; KIVI_SIM_OPAQUE(r); return r; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return expf(x); }
inline float __exp2f(float x) { return exp2f(x); }
// __dp4a(a, b, c): c plus the four products of a's and b's signed bytes.
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
  return c;
}
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

enum State : unsigned { READY, AT_BLOCK, AT_WARP, DONE, FAILED };
enum Kind : unsigned { SYNCTHREADS, SYNCWARP, SHFL_XOR, SHFL_DOWN, SHFL_UP, SHFL_IDX };

inline const char* kind_name(unsigned k) {
  switch (k) {
    case SYNCTHREADS: return "__syncthreads";
    case SYNCWARP: return "__syncwarp";
    case SHFL_XOR: return "__shfl_xor_sync";
    case SHFL_DOWN: return "__shfl_down_sync";
    case SHFL_UP: return "__shfl_up_sync";
    default: return "__shfl_sync";
  }
}

// The call a fiber waits at.
struct Site {
  const char* file;
  unsigned line;
  unsigned kind;
  unsigned mask;
};

inline bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && a.kind == b.kind && a.mask == b.mask &&
         (a.file == b.file || strcmp(a.file, b.file) == 0);
}

// What the host passes to a launch; mirrored by `RawOptions` in
// kivi-runtime/src/sim/compile.rs (#[repr(C)]), checked by `size`.
struct Options {
  unsigned size;             // sizeof(Options) as the caller knows it
  unsigned schedule;         // 0 thread order, 1 reverse, 2 seeded
  unsigned long long seed;   // for schedule 2
  unsigned poison;           // byte written over shared memory at block start
  unsigned max_shared;       // static shared memory a block may use (the arch's limit)
  unsigned declared_shared;  // EntryLaunch::shared_bytes; 0xffffffff: unknown
  unsigned workers;          // worker threads; 0: $KIVI_SIM_THREADS or the CPU count
};

enum { SCHED_IN_ORDER = 0, SCHED_REVERSE = 1, SCHED_SEEDED = 2 };

struct Fiber {
  void* sp;        // saved stack pointer while switched out
  uint3 tid;
  unsigned index, warp, lane;
  unsigned phase;  // which of the two exchange buffers the next shuffle uses
  unsigned pos;    // place in this phase's priority order
  State state;
  Site site;       // where it waits (AT_BLOCK / AT_WARP)
  char* stack;
};

constexpr size_t STACK = 256 * 1024;
constexpr uint64_t CANARY = 0x6b6976695f73696dull;

struct Worker {
  void* sched_sp = nullptr;
  Fiber* fibers = nullptr;
  unsigned nfibers = 0, nwarps = 0;
  unsigned* order = nullptr;         // order[pos] = fiber index
  unsigned* warp_arrived = nullptr;  // lanes waiting at a collective, per warp
  unsigned block_arrived = 0;        // threads waiting at __syncthreads
  unsigned cursor = 0;               // no ready fiber sits before this position
  unsigned round = 0;                // block-wide barriers passed in this block
  uint64_t* exch = nullptr;          // [warp][2][32] shuffle slots
  dim3 block_dim{1, 1, 1}, grid_dim{1, 1, 1};
  uint3 block{0, 0, 0};
  unsigned long long block_linear = 0;
  unsigned long long epoch = 0;        // unique per block run, for the shared-memory poisoning
  unsigned long long shared_used = 0;  // bytes of shared memory this block has touched
  const Options* opts = nullptr;
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  bool failed = false;
  char error[1024] = {0};
  ~Worker() {
    if (fibers != nullptr)
      for (unsigned i = 0; i < nfibers; ++i) free(fibers[i].stack);
    free(fibers);
    free(order);
    free(warp_arrived);
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

// ---- messages ----

// Appends printf-style text to `buf` (of `cap` bytes), truncating.
inline void append(char* buf, size_t cap, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
inline void append(char* buf, size_t cap, const char* fmt, ...) {
  const size_t used = strlen(buf);
  if (used + 1 >= cap) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + used, cap - used, fmt, ap);
  va_end(ap);
}

inline void append_site(char* buf, size_t cap, const Site& s) {
  append(buf, cap, "%s (%s:%u", kind_name(s.kind), s.file, s.line);
  if (s.kind != SYNCTHREADS && s.mask != 0xffffffffu) append(buf, cap, ", mask %#x", s.mask);
  append(buf, cap, ")");
}

// Lists where the fibers [lo, hi) are, runs of equal state and site merged:
// "threads 0-6 wait at __syncthreads (f.cu:12); threads 7-63 exited".
inline void append_where(char* buf, size_t cap, const Worker& w, unsigned lo, unsigned hi) {
  unsigned i = lo;
  bool first = true;
  while (i < hi) {
    const Fiber& a = w.fibers[i];
    unsigned j = i + 1;
    while (j < hi && w.fibers[j].state == a.state &&
           (a.state != AT_BLOCK && a.state != AT_WARP ? true : same_site(w.fibers[j].site, a.site)))
      ++j;
    append(buf, cap, "%s", first ? "" : "; ");
    first = false;
    if (j - i == 1) append(buf, cap, "thread %u ", i);
    else append(buf, cap, "threads %u-%u ", i, j - 1);
    switch (a.state) {
      case AT_BLOCK:
      case AT_WARP:
        append(buf, cap, "wait at ");
        append_site(buf, cap, a.site);
        break;
      case DONE: append(buf, cap, "exited"); break;
      case FAILED: append(buf, cap, "failed"); break;
      default: append(buf, cap, "are runnable"); break;
    }
    i = j;
  }
}

// ---- scheduling ----

inline uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The priority order of this barrier phase (see the header comment).
inline void draw_order(Worker& w) {
  const unsigned n = w.nfibers;
  unsigned* o = w.order;
  switch (w.opts->schedule) {
    case SCHED_IN_ORDER:
      for (unsigned p = 0; p < n; ++p) o[p] = p;
      break;
    case SCHED_REVERSE:
      for (unsigned p = 0; p < n; ++p) o[p] = n - 1 - p;
      break;
    default: {
      uint64_t s = w.opts->seed;
      s = splitmix(s) ^ (w.block_linear * 0xd1b54a32d192ed03ull);
      s = splitmix(s) ^ ((uint64_t)w.round * 0x8cb92ba72f3d8dd7ull);
      splitmix(s);
      if (splitmix(s) & 1) {  // every thread for itself
        for (unsigned p = 0; p < n; ++p) o[p] = p;
        for (unsigned p = n; p > 1; --p) {
          const unsigned q = (unsigned)(splitmix(s) % p);
          const unsigned t = o[p - 1];
          o[p - 1] = o[q];
          o[q] = t;
        }
      } else {  // whole warps in a random order, lanes up, down or shuffled
        unsigned warps[32];
        const unsigned nw = w.nwarps;
        for (unsigned k = 0; k < nw; ++k) warps[k] = k;
        for (unsigned k = nw; k > 1; --k) {
          const unsigned q = (unsigned)(splitmix(s) % k);
          const unsigned t = warps[k - 1];
          warps[k - 1] = warps[q];
          warps[q] = t;
        }
        unsigned p = 0;
        for (unsigned k = 0; k < nw; ++k) {
          const unsigned lo = warps[k] * 32, hi = lo + 32 < n ? lo + 32 : n;
          const unsigned p0 = p;
          const unsigned how = (unsigned)(splitmix(s) % 3);
          for (unsigned i = lo; i < hi; ++i) o[p++] = how == 1 ? hi - 1 - (i - lo) : i;
          if (how == 2) {
            for (unsigned m = hi - lo; m > 1; --m) {
              const unsigned q = p0 + (unsigned)(splitmix(s) % m);
              const unsigned t = o[p0 + m - 1];
              o[p0 + m - 1] = o[q];
              o[q] = t;
            }
          }
        }
      }
    }
  }
  for (unsigned p = 0; p < n; ++p) w.fibers[o[p]].pos = p;
  w.cursor = 0;
}

inline Fiber* next_ready(Worker& w) {
  for (unsigned p = w.cursor; p < w.nfibers; ++p) {
    Fiber* g = &w.fibers[w.order[p]];
    if (g->state == READY) {
      w.cursor = p;
      return g;
    }
  }
  w.cursor = w.nfibers;
  return nullptr;
}

inline void make_ready(Worker& w, Fiber& g) {
  g.state = READY;
  if (g.pos < w.cursor) w.cursor = g.pos;
}

// Leaves fiber `f` (its state already set) for the first ready fiber of the
// order — `f` itself when a barrier it completed made it the first — or for
// the scheduler when none is ready.
inline void switch_from(Fiber* f) {
  Worker& w = *worker;
  Fiber* g = next_ready(w);
  if (g == f) return;
  if (g != nullptr) {
    current = g;
    kivi_sim_swap(&f->sp, g->sp);
  } else {
    kivi_sim_swap(&f->sp, w.sched_sp);
  }
}

// Stops the block: the message is already in worker->error.
[[noreturn]] inline void stop() {
  Worker& w = *worker;
  Fiber* f = current;
  w.failed = true;
  f->state = FAILED;
  kivi_sim_swap(&f->sp, w.sched_sp);
  __builtin_unreachable();  // a failed fiber is never resumed
}

// Stops the block with a message about the running thread.
[[noreturn]] inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] inline void fail(const char* fmt, ...) {
  Worker& w = *worker;
  const Fiber* f = current;
  w.error[0] = 0;
  append(w.error, sizeof w.error, "thread (%u, %u, %u) (warp %u, lane %u): ", f->tid.x, f->tid.y, f->tid.z, f->warp,
         f->lane);
  const size_t used = strlen(w.error);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(w.error + used, sizeof w.error - used, fmt, ap);
  va_end(ap);
  stop();
}

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

inline unsigned warp_lanes(const Worker& w, unsigned warp) {
  const unsigned lo = warp * 32;
  return w.nfibers - lo < 32 ? w.nfibers - lo : 32;
}

// The running fiber waits at __syncthreads; the last to arrive checks that
// everyone called the same one and releases the block into a new phase.
inline void arrive_block(const char* file, unsigned line) {
  Worker& w = *worker;
  Fiber* f = current;
  f->state = AT_BLOCK;
  f->site = Site{file, line, SYNCTHREADS, 0xffffffffu};
  if (++w.block_arrived == w.nfibers) {
    for (unsigned i = 0; i < w.nfibers; ++i) {
      if (!same_site(w.fibers[i].site, f->site)) {
        snprintf(w.error, sizeof w.error, "divergent __syncthreads(): the threads of the block wait at different calls: ");
        append_where(w.error, sizeof w.error, w, 0, w.nfibers);
        stop();
      }
    }
    w.block_arrived = 0;
    ++w.round;
    draw_order(w);
    for (unsigned i = 0; i < w.nfibers; ++i) w.fibers[i].state = READY;
  }
  switch_from(f);
}

// The running fiber waits at a warp collective; the last lane of the warp
// to arrive checks that all called the same one and releases the warp.
inline void arrive_warp(unsigned kind, unsigned mask, const char* file, unsigned line) {
  Worker& w = *worker;
  Fiber* f = current;
  if (mask != 0xffffffffu) {
    fail("%s (%s:%u) with mask %#x: only full-warp masks are implemented", kind_name(kind), file, line, mask);
  }
  const unsigned lanes = warp_lanes(w, f->warp);
  if (lanes != 32) {
    fail("%s (%s:%u) with mask %#x names lanes %u-31 of warp %u, which do not exist (the block has %u threads)",
         kind_name(kind), file, line, mask, lanes, f->warp, w.nfibers);
  }
  f->state = AT_WARP;
  f->site = Site{file, line, kind, mask};
  if (++w.warp_arrived[f->warp] == lanes) {
    const unsigned lo = f->warp * 32;
    for (unsigned i = lo; i < lo + lanes; ++i) {
      if (!same_site(w.fibers[i].site, f->site)) {
        snprintf(w.error, sizeof w.error, "the lanes of warp %u wait at different warp collectives: ", f->warp);
        append_where(w.error, sizeof w.error, w, lo, lo + lanes);
        stop();
      }
    }
    w.warp_arrived[f->warp] = 0;
    for (unsigned i = lo; i < lo + lanes; ++i) make_ready(w, w.fibers[i]);
  }
  switch_from(f);
}

// Why no fiber can run although some have not finished.
inline void describe_deadlock(Worker& w) {
  const unsigned n = w.nfibers;
  w.error[0] = 0;
  for (unsigned wp = 0; wp < w.nwarps; ++wp) {
    const unsigned lo = wp * 32, hi = lo + warp_lanes(w, wp);
    unsigned at = 0;
    for (unsigned i = lo; i < hi; ++i) at += w.fibers[i].state == AT_WARP;
    if (at != 0) {
      append(w.error, sizeof w.error,
             "a warp shuffle or __syncwarp was reached by %u of the %u lanes of warp %u "
             "(the others exited or wait elsewhere): ",
             at, hi - lo, wp);
      append_where(w.error, sizeof w.error, w, lo, hi);
      return;
    }
  }
  unsigned at = 0;
  for (unsigned i = 0; i < n; ++i) at += w.fibers[i].state == AT_BLOCK;
  append(w.error, sizeof w.error, "__syncthreads() was reached by %u of %u threads; the others exited: ", at, n);
  append_where(w.error, sizeof w.error, w, 0, n);
}

inline unsigned long long next_epoch() {
  static unsigned long long counter = 0;
  return __atomic_add_fetch(&counter, 1ull, __ATOMIC_RELAXED);
}

// Runs one block to completion; false (and worker->error) if it cannot.
inline bool run_block(Worker& w) {
  const unsigned n = w.nfibers;
  for (unsigned i = 0; i < n; ++i) fiber_reset(w.fibers[i]);
  for (unsigned k = 0; k < w.nwarps; ++k) w.warp_arrived[k] = 0;
  w.block_arrived = 0;
  w.round = 0;
  w.failed = false;
  w.error[0] = 0;
  w.epoch = next_epoch();
  w.shared_used = 0;
  draw_order(w);
  Fiber* g = next_ready(w);
  current = g;
  kivi_sim_swap(&w.sched_sp, g->sp);
  // Back here when no fiber is ready: all done, one failed, or a deadlock.
  current = nullptr;
  if (w.failed) return false;
  unsigned done = 0;
  for (unsigned i = 0; i < n; ++i) done += w.fibers[i].state == DONE;
  if (done != n) {
    describe_deadlock(w);
    return false;
  }
  for (unsigned i = 0; i < n; ++i) {
    if (memcmp(w.fibers[i].stack, &CANARY, sizeof CANARY) != 0) {
      snprintf(w.error, sizeof w.error, "thread %u overflowed its 256 KiB simulated stack", i);
      return false;
    }
  }
  return true;
}

// ---- shared memory and loads ----

// The first thread of a block to pass a KIVI_SHARED declaration poisons the
// array and counts it against the block's shared memory.
inline void shared_reached(void* p, size_t bytes, unsigned long long& seen, const char* name, const char* file,
                           unsigned line) {
  Worker& w = *worker;
  if (seen == w.epoch) return;
  seen = w.epoch;
  memset(p, (int)(w.opts->poison & 0xffu), bytes);
  w.shared_used += bytes;
  if (w.shared_used > w.opts->max_shared) {
    fail("static shared memory: `%s` (%zu bytes, %s:%u) brings this block to %llu bytes, over the %u-byte limit "
         "of the architecture",
         name, bytes, file, line, w.shared_used, w.opts->max_shared);
  }
  if (w.opts->declared_shared != 0xffffffffu && w.shared_used > w.opts->declared_shared) {
    fail("static shared memory: `%s` (%zu bytes, %s:%u) brings this block to %llu bytes, more than the %u bytes "
         "the kernel's EntryLaunch::shared_bytes declares",
         name, bytes, file, line, w.shared_used, w.opts->declared_shared);
  }
}

template <class V> inline V vector_load(const void* p, const char* file, unsigned line) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a % sizeof(V) != 0) {
    fail("misaligned %zu-byte vector load at %s:%u: address %p is %zu bytes past a multiple of %zu", sizeof(V), file,
         line, p, (size_t)(a % sizeof(V)), sizeof(V));
  }
  V v;
  memcpy(&v, p, sizeof(V));
  return v;
}

// ---- collectives ----

template <class T>
inline T shuffle(unsigned kind, unsigned mask, T v, unsigned src, const char* file, unsigned line) {
  static_assert(sizeof(T) <= 8, "sim_shim: shuffles of more than 8 bytes are not implemented");
  Fiber* f = current;
  uint64_t* slots = &worker->exch[(f->warp * 2 + f->phase) * 32];
  f->phase ^= 1;  // double buffering: one barrier per shuffle is enough
  memcpy(&slots[f->lane], &v, sizeof(T));
  arrive_warp(kind, mask, file, line);
  T r;
  memcpy(&r, &slots[src & 31], sizeof(T));
  return r;
}

// ---- launches ----

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

inline unsigned workers_wanted(unsigned long long blocks, unsigned asked) {
  long n = asked != 0 ? (long)asked : sysconf(_SC_NPROCESSORS_ONLN);
  if (asked == 0) {
    if (const char* e = getenv("KIVI_SIM_THREADS")) n = atol(e);
  }
  if (n < 1) n = 1;
  if ((unsigned long long)n > blocks) n = (long)blocks;
  return n < 1 ? 1u : (unsigned)n;
}

// One launch: the blocks left to run and the first error.
struct Job {
  void (*body)(void*);
  void* ctx;
  const Options* opts;
  dim3 grid, block;
  unsigned long long blocks;
  unsigned long long next;         // atomically incremented
  unsigned long long error_block;  // the block that reported job.error
  int stop;
  pthread_mutex_t lock;
  char error[1200];
};

inline void* work(void* arg) {
  Job& job = *static_cast<Job*>(arg);
  const unsigned threads = job.block.x * job.block.y * job.block.z;
  Worker w;
  w.block_dim = job.block;
  w.grid_dim = job.grid;
  w.body = job.body;
  w.ctx = job.ctx;
  w.opts = job.opts;
  w.nfibers = threads;
  w.nwarps = (threads + 31) / 32;
  w.fibers = static_cast<Fiber*>(calloc(threads, sizeof(Fiber)));
  w.order = static_cast<unsigned*>(calloc(threads, sizeof(unsigned)));
  w.warp_arrived = static_cast<unsigned*>(calloc(w.nwarps, sizeof(unsigned)));
  w.exch = static_cast<uint64_t*>(calloc((size_t)w.nwarps * 64, sizeof(uint64_t)));
  for (unsigned i = 0; i < threads; ++i) {
    Fiber& f = w.fibers[i];
    f.stack = static_cast<char*>(malloc(STACK));
    memcpy(f.stack, &CANARY, sizeof CANARY);
    f.tid = uint3{i % job.block.x, (i / job.block.x) % job.block.y, i / (job.block.x * job.block.y)};
    f.index = i;
    f.warp = i / 32;
    f.lane = i % 32;
  }
  worker = &w;
  for (;;) {
    const unsigned long long bi = __atomic_fetch_add(&job.next, 1ull, __ATOMIC_RELAXED);
    if (bi >= job.blocks || __atomic_load_n(&job.stop, __ATOMIC_RELAXED)) break;
    w.block = uint3{(unsigned)(bi % job.grid.x), (unsigned)((bi / job.grid.x) % job.grid.y),
                    (unsigned)(bi / ((unsigned long long)job.grid.x * job.grid.y))};
    w.block_linear = bi;
    if (!run_block(w)) {
      pthread_mutex_lock(&job.lock);
      // The lowest failing block reports, so the message does not depend on the worker count.
      if (job.error[0] == 0 || bi < job.error_block) {
        job.error_block = bi;
        snprintf(job.error, sizeof job.error, "block (%u, %u, %u): %s", w.block.x, w.block.y, w.block.z, w.error);
      }
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
inline int launch(void (*kernel)(A...), const unsigned* dims, void** args, const Options* opts, char* err,
                  int errlen) {
  if (opts == nullptr || opts->size != sizeof(Options)) {
    snprintf(err, (size_t)errlen, "launch options of %u bytes; this library expects %zu (a stale library?)",
             opts == nullptr ? 0u : opts->size, sizeof(Options));
    return 1;
  }
  Launch<A...> l{kernel, args};
  Job job;
  job.body = &Launch<A...>::run;
  job.ctx = &l;
  job.opts = opts;
  job.grid = dim3{dims[0], dims[1], dims[2]};
  job.block = dim3{dims[3], dims[4], dims[5]};
  job.blocks = (unsigned long long)dims[0] * dims[1] * dims[2];
  job.next = 0;
  job.error_block = 0;
  job.stop = 0;
  job.error[0] = 0;
  const unsigned long long threads = (unsigned long long)dims[3] * dims[4] * dims[5];
  if (threads == 0 || threads > 1024) {
    snprintf(err, (size_t)errlen, "a block of %llu threads; expected 1 to 1024", threads);
    return 1;
  }
  if (job.blocks == 0) return 0;
  pthread_mutex_init(&job.lock, nullptr);
  const unsigned nw = workers_wanted(job.blocks, opts->workers);
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

// ---- the CUDA names ----

#define KIVI_SHARED(T, name, dims)                         \
  static thread_local T name dims;                         \
  static thread_local unsigned long long kivi_seen_##name; \
  ::kivi_sim::shared_reached(&name, sizeof(name), kivi_seen_##name, #name, __FILE__, __LINE__)

#define KIVI_LOAD_VECTOR(V, p) (::kivi_sim::vector_load<V>((p), __FILE__, __LINE__))

inline void __syncthreads(const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
  kivi_sim::arrive_block(file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       unsigned line = __builtin_LINE()) {
  kivi_sim::arrive_warp(kivi_sim::SYNCWARP, mask, file, line);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, const char* file = __builtin_FILE(),
                         unsigned line = __builtin_LINE()) {
  const unsigned lane = kivi_sim::current->lane;
  unsigned src = lane ^ (unsigned)lane_mask;
  if ((src & ~(unsigned)(width - 1)) != (lane & ~(unsigned)(width - 1))) src = lane;
  return kivi_sim::shuffle(kivi_sim::SHFL_XOR, mask, v, src, file, line);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32, const char* file = __builtin_FILE(),
                          unsigned line = __builtin_LINE()) {
  const unsigned lane = kivi_sim::current->lane;
  unsigned src = lane + delta;
  if ((src & ~(unsigned)(width - 1)) != (lane & ~(unsigned)(width - 1))) src = lane;
  return kivi_sim::shuffle(kivi_sim::SHFL_DOWN, mask, v, src, file, line);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32, const char* file = __builtin_FILE(),
                        unsigned line = __builtin_LINE()) {
  const unsigned lane = kivi_sim::current->lane;
  const unsigned seg = lane & ~(unsigned)(width - 1);
  const unsigned src = lane - seg >= delta ? lane - delta : lane;
  return kivi_sim::shuffle(kivi_sim::SHFL_UP, mask, v, src, file, line);
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32, const char* file = __builtin_FILE(),
                     unsigned line = __builtin_LINE()) {
  const unsigned lane = kivi_sim::current->lane;
  const unsigned src = (lane & ~(unsigned)(width - 1)) + ((unsigned)src_lane & (unsigned)(width - 1));
  return kivi_sim::shuffle(kivi_sim::SHFL_IDX, mask, v, src, file, line);
}

// The entry point the sim backend calls for kernel `name` (defined after it):
//   extern "C" int <symbol>(const unsigned* dims, void** args,
//                           const kivi_sim::Options* opts, char* err, int errlen)
#define KIVI_SIM_EXPORT(symbol, name)                                                                   \
  extern "C" __attribute__((visibility("default"))) int symbol(const unsigned* dims, void** args,        \
                                                               const ::kivi_sim::Options* opts, char* err, \
                                                               int errlen) {                             \
    return ::kivi_sim::launch(name, dims, args, opts, err, errlen);                                      \
  }
