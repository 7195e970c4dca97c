/* warpnn's native XLA FFI handlers: launch Warp's compiled forward and adjoint kernels with no Python.
 *
 * Written against the XLA FFI C API header that jaxlib ships (jax.ffi.include_dir()/xla/ffi/api/c_api.h),
 * which is ABI-stable across jaxlib releases, and against nothing else: no CUDA headers, no Python headers,
 * no C++ runtime. Warp's entry points (wp_cuda_launch_kernel, wp_memset_device, ...) are handed in as function
 * pointers by Python (warpnn/_native_launch.py), so one build serves CPU-only and CUDA processes and loads into
 * any Python version.
 *
 * Division of work. Python runs only at trace time: it parses the kernel signature, lays out Warp's argument
 * struct with ctypes exactly as warp's `invoke` does, loads the Warp module on each device, and registers
 *   - one kernel descriptor per kernel signature (warpnn_register_kernel -> kernel id), and
 *   - per device, the entry points Warp loaded (warpnn_set_cpu_entry / warpnn_set_cuda_entry).
 * Every FFI call carries the kernel id as an attribute; the four handlers below (CPU/CUDA x forward/adjoint)
 * serve every kernel. Per call they: decode attributes (launch dims, static scalars), zero the results on the
 * XLA stream, and launch Warp's kernel once per vmap batch element with per-argument pointer offsets; or, when the
 * bridge asks (attribute twin_launch), the kernel's generated twin once for the whole batch (warpnn/_batched.py);
 * on the CPU big launches are spread over a thread pool (see "Multi-threaded CPU launches").
 * On CUDA, zeroing and launches go straight to the driver (cuMemsetD32Async, cuLaunchKernel: addresses handed
 * in the same way, warpnn_set_driver) when the thread's current context is the kernel's; otherwise, or with
 * WARPNN_DRIVER_LAUNCH=0, through Warp's own wp_memset_device / wp_cuda_launch_kernel.
 *
 * Buffer order (fixed by warpnn/_bridge.py):
 *   forward: args = array inputs in signature order;                    rets = outputs
 *   adjoint: args = array inputs, primal outputs, cotangents of float outputs; rets = adjoints of float array inputs
 * The descriptor maps every kernel parameter to its buffer in each mode, so this file knows nothing about that
 * order beyond what Python tells it.
 *
 * Errors (unknown kernel, missing device entry, malformed call, failed launch) are returned through
 * XLA_FFI_Error_Create with a message naming the kernel; nothing here aborts the process.
 */

#define _POSIX_C_SOURCE 200809L /* clock_gettime(CLOCK_MONOTONIC) under -std=c11 */

#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "xla/ffi/api/c_api.h"

#define WARPNN_EXPORT __attribute__((visibility("default")))

/* Bumped whenever the registration interface below changes; Python refuses a library with another value. */
#define WARPNN_ABI_VERSION 4
#ifndef WARPNN_SOURCE_HASH
#define WARPNN_SOURCE_HASH "unknown"
#endif

enum {
    kMaxDims = 4,           /* Warp's ARRAY_MAX_DIMS and LAUNCH_MAX_DIMS */
    kMaxBatchRank = 8,      /* nested vmaps */
    kMaxCudaDevices = 256,
    kChunkBits = 10,
    kChunkSize = 1 << kChunkBits,
    kMaxChunks = 4096,      /* up to 4M kernel signatures per process */
    kStackScratch = 8192,   /* per-call scratch kept on the stack below this size */
    kMaxGradAliases = 1024, /* parameters that may carry their adjoint in their primal array's grad */
};

/* Mirror of Warp's array_t (warp/native/array.h; warp._src.types.array_t). Python checks the ctypes layout
 * against these offsets before using this library. */
typedef struct {
    uint64_t data;
    uint64_t grad;
    int32_t shape[kMaxDims];
    int32_t strides[kMaxDims];
    uint16_t ndim;
    uint16_t flags;
} wp_array_t;
_Static_assert(sizeof(wp_array_t) == 56, "array_t layout");

/* Columns of the per-parameter table Python passes to warpnn_register_kernel (one row per kernel parameter,
 * signature order: inputs then outputs). Sources: 0 = none, k+1 = args[k], -(k+1) = rets[k]. */
enum {
    P_IS_ARRAY,      /* 1 array, 0 scalar */
    P_OFFSET,        /* byte offset of the field in Warp's argument struct */
    P_WARP_NDIM,     /* arrays: Warp rank (what wp.tid() indexes) */
    P_JAX_NDIM,      /* arrays: Warp rank + vector/matrix inner dims */
    P_SCALAR_BYTES,  /* arrays: bytes of one JAX scalar element */
    P_INNER_COUNT,   /* arrays: scalars per Warp element (vec3: 3) */
    P_FWD_SRC,       /* buffer of the primal value in a forward call */
    P_ADJ_SRC,       /* buffer of the primal value in an adjoint call */
    P_GRAD_SRC,      /* buffer of the adjoint (gradient) in an adjoint call; 0: null array_t / zero scalar */
    P_SCALAR_KIND,   /* scalars: 0 signed int, 1 unsigned int, 2 float, 3 float16, 4 bool, 5 bfloat16 */
    P_FIELD_SIZE,    /* scalars: size of the field in the struct */
    P_FULLY_WRITTEN, /* outputs: every thread stores its own wp.tid() element, so a launch over the output's
                        own Warp shape writes it all and needs no zeroing first */
    P_PRESET,        /* bit m: in mode m (0 forward, 1 adjoint) this parameter's result starts as an operand
                        (XLA aliases them: in-out arrays, carried adjoints) and is never zeroed; bit 4: the
                        adjoint never touches the primal values of this output, addressed as its grad */
    P_GRAD_ALIAS,    /* adjoint: the primal array's `grad` is its adjoint buffer, so Warp's adjoint of a store
                        zeroes the overwritten element's adjoint, as under wp.Tape */
    P_PARAM_START,   /* 1: the row's field starts a kernel parameter (0: a later field of the same wp.struct).
                        A CUDA launch passes one pointer per kernel parameter, not per row */
    P_NCOLS
};

enum { K_INT = 0, K_UINT = 1, K_FLOAT = 2, K_HALF = 3, K_BOOL = 4, K_BF16 = 5 };

typedef void (*cpu_forward_fn)(void* bounds, void* args);
typedef void (*cpu_backward_fn)(void* bounds, void* args, void* adj_args);
typedef size_t (*cuda_launch_fn)(void* context, void* kernel, size_t dim, int max_blocks, int block_dim,
                                 int grid_stride, int cluster_dim, int shared_memory_bytes, void** args,
                                 void* stream, const void* apic_info);
typedef _Bool (*memset_device_fn)(void* context, void* dest, int value, size_t n, void* stream);
typedef const char* (*error_string_fn)(void);
/* CUDA driver entry points (CUresult is an int; CUcontext, CUfunction, CUstream and CUdeviceptr are
 * pointer-sized), resolved from libcuda by the Python side. */
typedef int (*cu_ctx_get_current_fn)(void** context);
typedef int (*cu_launch_kernel_fn)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                   unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                                   void* stream, void** params, void** extra);
typedef int (*cu_memset_d32_async_fn)(uintptr_t dest, unsigned value, size_t count, void* stream);
typedef int (*cu_memset_d8_async_fn)(uintptr_t dest, unsigned char value, size_t count, void* stream);
typedef int (*cu_get_error_string_fn)(int result, const char** message);
typedef int (*resolver_fn)(int64_t kernel_id, int32_t platform, int32_t ordinal);

/* Entry points of one kernel on one device, immutable once published. Replaced (never freed: a handler on
 * another thread may still hold the old one) when Warp reloads the module. */
typedef struct {
    void* context;          /* CUDA context; unused on CPU */
    void* forward;          /* CPU: function pointer; CUDA: CUfunction */
    void* backward;
    int32_t forward_smem;
    int32_t backward_smem;
    int32_t block_dim;
    int32_t grid_stride;
    int32_t cluster_dim;
} DeviceEntry;

typedef struct {
    int32_t param;     /* row in the parameter table */
    int32_t adjoint;   /* 1: goes into the adjoint struct */
    int64_t source;    /* buffer (see above) */
} Slot;

typedef struct {
    char* name;
    int64_t id;
    int32_t kernel_dim;
    int64_t tid_limit;  /* largest extent of each wp.tid() dim; <0: no limit */
    int32_t num_params;
    int64_t* params;    /* num_params * P_NCOLS */
    char** attr_names;  /* "arg_<name>" for scalars, NULL for arrays */
    size_t* attr_name_lens;
    int32_t args_size, bounds_size, bounds_size_offset, bounds_coord_mult_offset;
    int32_t num_args[2], num_rets[2];  /* [forward, adjoint] */
    int32_t num_slots[2];
    Slot* slots[2];
    int32_t* ret_param[2];             /* parameter row of each result buffer */
    _Atomic(DeviceEntry*) cpu;
    _Atomic(DeviceEntry*) cuda[kMaxCudaDevices];
    /* The kernel's batched twin (warpnn/_batched.py), if Python registered one: the same parameters with one more
     * leading dim on every array, a leading batch coordinate, and two trailing int offsets. */
    _Atomic(const struct TwinLayout*) twin[2]; /* [0]: the row twin (same rank, offset first coordinate); [1]: batched */
    _Atomic(DeviceEntry*) twin_cpu[2];
    _Atomic(DeviceEntry*) twin_cuda[2][kMaxCudaDevices];
    _Atomic(void*) partials; /* const PartialKinds*: how the twin's CPU slices may write each result */
    _Atomic int cpu_serial;  /* 1: never run two CPU launches of this kernel at once (warpnn_set_cpu_serial) */
} KernelDesc;

/* Immutable once published (never freed, like DeviceEntry). */
typedef struct TwinLayout {
    int32_t batched;    /* 1: the batched twin (a leading batch coordinate, arrays with a leading batch dim) */
    int32_t kernel_dim; /* the twin's wp.tid() rank: the original's + batched */
    int64_t tid_limit;
    int32_t bounds_size, bounds_size_offset, bounds_coord_mult_offset;
    int32_t args_size;                            /* the original struct + the twin's int32 fields */
    int32_t first_batch_offset, first_row_offset; /* int32 fields: batch / first-coordinate offsets */
    int32_t inner_offset; /* >= 0: the row-loop twin, which loops over the last launch dim itself; its extent goes in
                           * this int32 field, and the launch covers the other dims (-1: none) */
} TwinLayout;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(_Atomic(KernelDesc*)*) g_chunks[kMaxChunks];
static int64_t g_num_kernels; /* guarded by g_lock */

static _Atomic(cuda_launch_fn) g_cuda_launch;
static _Atomic(memset_device_fn) g_memset_device;
static _Atomic(error_string_fn) g_error_string;
static _Atomic(error_string_fn) g_take_cpu_block_error;
static _Atomic(resolver_fn) g_resolver;
/* The driver path (warpnn_set_driver): launches and zeroing straight through libcuda, skipping Warp's
 * wrappers, whose context guard, timing and capture hooks cost host time on every call; taken only when the
 * calling thread's current context is the one Warp loaded the kernel in (XLA makes its context current
 * before running a thunk) and the launch needs nothing Warp's launcher adds (no thread-block clusters). */
typedef struct {
    cu_ctx_get_current_fn ctx_get_current;
    cu_launch_kernel_fn launch_kernel;
    cu_memset_d32_async_fn memset_d32_async;
    cu_memset_d8_async_fn memset_d8_async;
    cu_get_error_string_fn get_error_string;
} DriverApi;
static _Atomic(const DriverApi*) g_driver;
static _Atomic int64_t g_driver_launches; /* launches that took the driver path (tests check it is taken) */
static _Atomic int64_t g_entries[2]; /* executions (not metadata queries) of forward / adjoint handlers */
/* Warp's CPU kernels are not reentrant: on x86-64 each module keeps its tile-storage pointer (and, without
 * stack tiles, the tile memory itself) in static variables, and the cooperative-block error is a global. XLA:CPU
 * may run independent custom calls on several threads, so CPU launches are serialized, as PythonLauncher's
 * lock did. Uncontended, this costs tens of nanoseconds. */
static pthread_mutex_t g_cpu_launch_lock = PTHREAD_MUTEX_INITIALIZER;

/* ------------------------------------------------------------------------------------------------------------
 * Registration (called from Python through ctypes, at trace time)
 */

WARPNN_EXPORT int32_t warpnn_abi_version(void) { return WARPNN_ABI_VERSION; }
WARPNN_EXPORT const char* warpnn_source_hash(void) { return WARPNN_SOURCE_HASH; }
/* The XLA FFI API version of the headers this was compiled against: XLA refuses to register a handler newer than
 * itself, and then no JAX CPU backend comes up at all, so Python loads only a build no newer than its jaxlib. */
WARPNN_EXPORT int32_t warpnn_ffi_api_version(void) { return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR; }
WARPNN_EXPORT int32_t warpnn_array_t_size(void) { return (int32_t)sizeof(wp_array_t); }

/* Why the resolver (Python) could not load a module, for the handler's error message; per thread, since the
 * resolver runs on the handler's thread. */
static _Thread_local char t_resolve_error[512];

WARPNN_EXPORT void warpnn_set_resolve_error(const char* message) {
    snprintf(t_resolve_error, sizeof(t_resolve_error), "%s", message ? message : "");
}

WARPNN_EXPORT void warpnn_init(void* cuda_launch_kernel, void* memset_device, void* get_error_string,
                               void* take_cpu_block_error, void* resolver) {
    atomic_store(&g_cuda_launch, (cuda_launch_fn)cuda_launch_kernel);
    atomic_store(&g_memset_device, (memset_device_fn)memset_device);
    atomic_store(&g_error_string, (error_string_fn)get_error_string);
    atomic_store(&g_take_cpu_block_error, (error_string_fn)take_cpu_block_error);
    atomic_store(&g_resolver, (resolver_fn)resolver);
}

/* Enable (all non-NULL) or disable (any NULL) the driver path. The table is never freed: a handler on another
 * thread may hold it. */
WARPNN_EXPORT void warpnn_set_driver(void* ctx_get_current, void* launch_kernel, void* memset_d32_async,
                                     void* memset_d8_async, void* get_error_string) {
    DriverApi* api = NULL;
    if (ctx_get_current && launch_kernel && memset_d32_async && memset_d8_async && get_error_string) {
        api = (DriverApi*)malloc(sizeof(DriverApi));
        if (!api) return;
        api->ctx_get_current = (cu_ctx_get_current_fn)ctx_get_current;
        api->launch_kernel = (cu_launch_kernel_fn)launch_kernel;
        api->memset_d32_async = (cu_memset_d32_async_fn)memset_d32_async;
        api->memset_d8_async = (cu_memset_d8_async_fn)memset_d8_async;
        api->get_error_string = (cu_get_error_string_fn)get_error_string;
    }
    atomic_store(&g_driver, api);
}

static const char* driver_error(const DriverApi* api, int result) {
    const char* message = NULL;
    if (api->get_error_string(result, &message) != 0 || !message) message = "unknown CUDA driver error";
    return message;
}

WARPNN_EXPORT int64_t warpnn_driver_launches(void) {
    return atomic_load_explicit(&g_driver_launches, memory_order_relaxed);
}

WARPNN_EXPORT int64_t warpnn_handler_entries(int32_t adjoint) {
    return atomic_load_explicit(&g_entries[adjoint ? 1 : 0], memory_order_relaxed);
}

static KernelDesc* lookup(int64_t id) {
    if (id < 0 || id >= (int64_t)kMaxChunks * kChunkSize) return NULL;
    _Atomic(KernelDesc*)* chunk = atomic_load_explicit(&g_chunks[id >> kChunkBits], memory_order_acquire);
    if (!chunk) return NULL;
    return atomic_load_explicit(&chunk[id & (kChunkSize - 1)], memory_order_acquire);
}

static char* dup_string(const char* s) {
    size_t n = strlen(s);
    char* out = (char*)malloc(n + 1);
    if (out) memcpy(out, s, n + 1);
    return out;
}

static void free_desc(KernelDesc* d) {
    if (!d) return;
    if (d->attr_names)
        for (int32_t i = 0; i < d->num_params; ++i) free(d->attr_names[i]);
    free(d->attr_names);
    free(d->attr_name_lens);
    free(d->params);
    for (int m = 0; m < 2; ++m) {
        free(d->slots[m]);
        free(d->ret_param[m]);
    }
    free(d->name);
    free(d);
}

/* Returns the new kernel id, or -1 (malformed table, out of memory, registry full). */
WARPNN_EXPORT int64_t warpnn_register_kernel(const char* name, int32_t kernel_dim, int64_t tid_limit,
                                             int32_t num_params, const int64_t* params,
                                             const char* const* scalar_attr_names, int32_t args_size,
                                             int32_t bounds_size, int32_t bounds_size_offset,
                                             int32_t bounds_coord_mult_offset, int32_t num_fwd_args,
                                             int32_t num_fwd_rets, int32_t num_adj_args, int32_t num_adj_rets) {
    if (kernel_dim < 1 || kernel_dim > kMaxDims || num_params < 0 || args_size < 0 || bounds_size <= 0 ||
        bounds_size > 64)
        return -1;
    KernelDesc* d = (KernelDesc*)calloc(1, sizeof(KernelDesc));
    if (!d) return -1;
    d->name = dup_string(name ? name : "?");
    d->kernel_dim = kernel_dim;
    d->tid_limit = tid_limit;
    d->num_params = num_params;
    d->params = (int64_t*)malloc(sizeof(int64_t) * P_NCOLS * (size_t)(num_params ? num_params : 1));
    d->attr_names = (char**)calloc((size_t)(num_params ? num_params : 1), sizeof(char*));
    d->attr_name_lens = (size_t*)calloc((size_t)(num_params ? num_params : 1), sizeof(size_t));
    d->args_size = args_size;
    d->bounds_size = bounds_size;
    d->bounds_size_offset = bounds_size_offset;
    d->bounds_coord_mult_offset = bounds_coord_mult_offset;
    d->num_args[0] = num_fwd_args;
    d->num_rets[0] = num_fwd_rets;
    d->num_args[1] = num_adj_args;
    d->num_rets[1] = num_adj_rets;
    if (!d->name || !d->params || !d->attr_names || !d->attr_name_lens) goto fail;
    memcpy(d->params, params, sizeof(int64_t) * P_NCOLS * (size_t)num_params);

    for (int32_t i = 0; i < num_params; ++i) {
        const int64_t* p = d->params + (size_t)i * P_NCOLS;
        if (p[P_OFFSET] < 0) goto fail;
        if (p[P_IS_ARRAY]) {
            if (p[P_OFFSET] + (int64_t)sizeof(wp_array_t) > args_size || p[P_WARP_NDIM] < 1 ||
                p[P_WARP_NDIM] > kMaxDims || p[P_JAX_NDIM] < p[P_WARP_NDIM] || p[P_SCALAR_BYTES] <= 0 ||
                p[P_INNER_COUNT] <= 0)
                goto fail;
        } else {
            if (!scalar_attr_names || !scalar_attr_names[i] || p[P_OFFSET] + p[P_FIELD_SIZE] > args_size)
                goto fail;
            d->attr_names[i] = dup_string(scalar_attr_names[i]);
            if (!d->attr_names[i]) goto fail;
            d->attr_name_lens[i] = strlen(scalar_attr_names[i]);
        }
        /* every buffer source must name a buffer that exists in its mode */
        int64_t srcs[3] = {p[P_FWD_SRC], p[P_ADJ_SRC], p[P_GRAD_SRC]};
        int modes[3] = {0, 1, 1};
        for (int k = 0; k < 3; ++k) {
            int64_t s = srcs[k];
            if (s > d->num_args[modes[k]] || -s > d->num_rets[modes[k]]) goto fail;
        }
    }

    /* Slots: forward = primal parameters; adjoint = primal parameters, then one adjoint per parameter, which is
     * the order of Warp's backward entry point (bounds, *args, *adj_args). */
    for (int m = 0; m < 2; ++m) {
        d->num_slots[m] = num_params * (m + 1);
        d->slots[m] = (Slot*)calloc((size_t)(d->num_slots[m] ? d->num_slots[m] : 1), sizeof(Slot));
        d->ret_param[m] = (int32_t*)malloc(sizeof(int32_t) * (size_t)(d->num_rets[m] ? d->num_rets[m] : 1));
        if (!d->slots[m] || !d->ret_param[m]) goto fail;
        for (int32_t r = 0; r < d->num_rets[m]; ++r) d->ret_param[m][r] = -1;
        for (int32_t s = 0; s < d->num_slots[m]; ++s) {
            int32_t i = s % (num_params ? num_params : 1);
            int adj = s >= num_params;
            const int64_t* p = d->params + (size_t)i * P_NCOLS;
            Slot* slot = &d->slots[m][s];
            slot->param = i;
            slot->adjoint = adj;
            slot->source = m == 0 ? p[P_FWD_SRC] : (adj ? p[P_GRAD_SRC] : p[P_ADJ_SRC]);
            if (slot->source < 0) d->ret_param[m][-slot->source - 1] = i;
        }
        for (int32_t r = 0; r < d->num_rets[m]; ++r)
            if (d->ret_param[m][r] < 0) goto fail; /* every result must be some parameter's buffer */
    }

    pthread_mutex_lock(&g_lock);
    int64_t id = g_num_kernels;
    if (id >= (int64_t)kMaxChunks * kChunkSize) {
        pthread_mutex_unlock(&g_lock);
        goto fail;
    }
    _Atomic(KernelDesc*)* chunk = atomic_load_explicit(&g_chunks[id >> kChunkBits], memory_order_relaxed);
    if (!chunk) {
        chunk = (_Atomic(KernelDesc*)*)calloc(kChunkSize, sizeof(*chunk));
        if (!chunk) {
            pthread_mutex_unlock(&g_lock);
            goto fail;
        }
        atomic_store_explicit(&g_chunks[id >> kChunkBits], chunk, memory_order_release);
    }
    d->id = id;
    atomic_store_explicit(&chunk[id & (kChunkSize - 1)], d, memory_order_release);
    g_num_kernels = id + 1;
    pthread_mutex_unlock(&g_lock);
    return id;

fail:
    free_desc(d);
    return -1;
}

static DeviceEntry* new_entry(void* context, void* forward, void* backward, int32_t forward_smem,
                              int32_t backward_smem, int32_t block_dim, int32_t grid_stride, int32_t cluster_dim) {
    DeviceEntry* e = (DeviceEntry*)calloc(1, sizeof(DeviceEntry));
    if (!e) return NULL;
    e->context = context;
    e->forward = forward;
    e->backward = backward;
    e->forward_smem = forward_smem;
    e->backward_smem = backward_smem;
    e->block_dim = block_dim;
    e->grid_stride = grid_stride;
    e->cluster_dim = cluster_dim;
    return e;
}

/* Returns 0 on success. The replaced entry is leaked on purpose (see DeviceEntry). */
WARPNN_EXPORT int32_t warpnn_set_cpu_entry(int64_t kernel_id, void* forward, void* backward, int32_t block_dim) {
    KernelDesc* d = lookup(kernel_id);
    if (!d) return 1;
    DeviceEntry* e = new_entry(NULL, forward, backward, 0, 0, block_dim, 0, 1);
    if (!e) return 2;
    atomic_store_explicit(&d->cpu, e, memory_order_release);
    return 0;
}

WARPNN_EXPORT int32_t warpnn_set_cuda_entry(int64_t kernel_id, int32_t ordinal, void* context, void* forward,
                                            void* backward, int32_t forward_smem, int32_t backward_smem,
                                            int32_t block_dim, int32_t grid_stride, int32_t cluster_dim) {
    KernelDesc* d = lookup(kernel_id);
    if (!d) return 1;
    if (ordinal < 0 || ordinal >= kMaxCudaDevices) return 3;
    DeviceEntry* e =
        new_entry(context, forward, backward, forward_smem, backward_smem, block_dim, grid_stride, cluster_dim);
    if (!e) return 2;
    atomic_store_explicit(&d->cuda[ordinal], e, memory_order_release);
    return 0;
}

/* The layout of the kernel's batched twin (see TwinLayout). Returns 0 on success. */
WARPNN_EXPORT int32_t warpnn_set_twin(int64_t kernel_id, int32_t batched, int32_t kernel_dim, int64_t tid_limit,
                                      int32_t bounds_size, int32_t bounds_size_offset,
                                      int32_t bounds_coord_mult_offset, int32_t args_size, int32_t first_batch_offset,
                                      int32_t first_row_offset, int32_t inner_offset) {
    KernelDesc* d = lookup(kernel_id);
    if (!d) return 1;
    batched = batched ? 1 : 0;
    const int inner = inner_offset >= 0;
    if (kernel_dim != d->kernel_dim + batched - inner || kernel_dim > kMaxDims || bounds_size <= 0 ||
        bounds_size > 64 || args_size < d->args_size || first_batch_offset < d->args_size ||
        first_row_offset < d->args_size || first_batch_offset + 4 > args_size || first_row_offset + 4 > args_size ||
        (inner && (batched || d->kernel_dim < 2 || inner_offset < d->args_size || inner_offset + 4 > args_size)))
        return 4;
    TwinLayout* t = (TwinLayout*)calloc(1, sizeof(TwinLayout));
    if (!t) return 2;
    t->batched = batched;
    t->kernel_dim = kernel_dim;
    t->tid_limit = tid_limit;
    t->bounds_size = bounds_size;
    t->bounds_size_offset = bounds_size_offset;
    t->bounds_coord_mult_offset = bounds_coord_mult_offset;
    t->args_size = args_size;
    t->first_batch_offset = first_batch_offset;
    t->first_row_offset = first_row_offset;
    t->inner_offset = inner ? inner_offset : -1;
    atomic_store_explicit(&d->twin[batched], t, memory_order_release);
    return 0;
}

/* Entry points of the batched twin on one device (cuda 0: the CPU). Returns 0 on success. */
WARPNN_EXPORT int32_t warpnn_set_twin_entry(int64_t kernel_id, int32_t batched, int32_t cuda, int32_t ordinal,
                                            void* context,
                                            void* forward, void* backward, int32_t forward_smem,
                                            int32_t backward_smem, int32_t block_dim, int32_t grid_stride,
                                            int32_t cluster_dim) {
    KernelDesc* d = lookup(kernel_id);
    if (!d) return 1;
    if (cuda && (ordinal < 0 || ordinal >= kMaxCudaDevices)) return 3;
    DeviceEntry* e =
        new_entry(context, forward, backward, forward_smem, backward_smem, block_dim, grid_stride, cluster_dim);
    if (!e) return 2;
    batched = batched ? 1 : 0;
    atomic_store_explicit(cuda ? &d->twin_cuda[batched][ordinal] : &d->twin_cpu[batched], e, memory_order_release);
    return 0;
}

/* Kernel launches issued by the handlers (forward / adjoint): one per call for a batched launch, one per batch
 * element otherwise. Tests and benchmarks read it. */
static _Atomic int64_t g_launches[2];
WARPNN_EXPORT int64_t warpnn_kernel_launches(int32_t adjoint) {
    return atomic_load_explicit(&g_launches[adjoint ? 1 : 0], memory_order_relaxed);
}

/* ------------------------------------------------------------------------------------------------------------
 * Helpers for the handlers
 */

static XLA_FFI_Error* make_error(const XLA_FFI_Api* api, XLA_FFI_Error_Code code, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));

static XLA_FFI_Error* make_error(const XLA_FFI_Api* api, XLA_FFI_Error_Code code, const char* fmt, ...) {
    char message[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof(message), fmt, ap);
    va_end(ap);
    XLA_FFI_Error_Create_Args args;
    memset(&args, 0, sizeof(args));
    args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
    args.message = message; /* XLA copies the message */
    args.errc = code;
    return api->XLA_FFI_Error_Create(&args);
}

static int span_equals(const XLA_FFI_ByteSpan* span, const char* s, size_t n) {
    return span && span->len == n && memcmp(span->ptr, s, n) == 0;
}

/* Reads an integer or floating scalar attribute of any width. Returns 0 if the dtype is not numeric. */
static int read_scalar(const XLA_FFI_Scalar* s, int64_t* iv, double* fv, int* is_float) {
    *is_float = 0;
    switch (s->dtype) {
        case XLA_FFI_DataType_PRED: *iv = *(const uint8_t*)s->value != 0; return 1;
        case XLA_FFI_DataType_S8: *iv = *(const int8_t*)s->value; return 1;
        case XLA_FFI_DataType_S16: *iv = *(const int16_t*)s->value; return 1;
        case XLA_FFI_DataType_S32: *iv = *(const int32_t*)s->value; return 1;
        case XLA_FFI_DataType_S64: *iv = *(const int64_t*)s->value; return 1;
        case XLA_FFI_DataType_U8: *iv = *(const uint8_t*)s->value; return 1;
        case XLA_FFI_DataType_U16: *iv = *(const uint16_t*)s->value; return 1;
        case XLA_FFI_DataType_U32: *iv = *(const uint32_t*)s->value; return 1;
        case XLA_FFI_DataType_U64: *iv = (int64_t) * (const uint64_t*)s->value; return 1;
        case XLA_FFI_DataType_F32: *fv = *(const float*)s->value; *is_float = 1; return 1;
        case XLA_FFI_DataType_F64: *fv = *(const double*)s->value; *is_float = 1; return 1;
        default: return 0;
    }
}

/* IEEE binary32 -> binary16 bits, round to nearest even (Warp stores float16 scalars as their bits). */
static uint16_t float_to_half_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof(x));
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t mant = x & 0x7fffffu;
    int32_t exp = (int32_t)((x >> 23) & 0xffu);
    if (exp == 255) return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u : 0u));
    int32_t e = exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) { /* subnormal half or zero */
        if (e < -10) return (uint16_t)sign;
        mant |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)e << 10) | (mant >> 13), rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h; /* a carry into the exponent is the right result */
    return (uint16_t)(sign | h);
}

/* IEEE binary32 -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN). */
static uint16_t float_to_bfloat16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof(x));
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* Stores a scalar attribute into a struct field the way ctypes' `ctype(value)` would. */
static int store_scalar(uint8_t* dst, int64_t kind, int64_t size, int is_float, int64_t iv, double fv) {
    switch (kind) {
        case K_INT:
        case K_UINT: {
            int64_t v = is_float ? (int64_t)fv : iv;
            if (size == 1) { int8_t t = (int8_t)v; memcpy(dst, &t, 1); }
            else if (size == 2) { int16_t t = (int16_t)v; memcpy(dst, &t, 2); }
            else if (size == 4) { int32_t t = (int32_t)v; memcpy(dst, &t, 4); }
            else if (size == 8) { memcpy(dst, &v, 8); }
            else return 0;
            return 1;
        }
        case K_FLOAT: {
            double v = is_float ? fv : (double)iv;
            if (size == 4) { float t = (float)v; memcpy(dst, &t, 4); }
            else if (size == 8) { memcpy(dst, &v, 8); }
            else return 0;
            return 1;
        }
        case K_HALF: {
            if (size != 2) return 0;
            uint16_t t = float_to_half_bits((float)(is_float ? fv : (double)iv));
            memcpy(dst, &t, 2);
            return 1;
        }
        case K_BF16: {
            if (size != 2) return 0;
            uint16_t t = float_to_bfloat16_bits((float)(is_float ? fv : (double)iv));
            memcpy(dst, &t, 2);
            return 1;
        }
        case K_BOOL: {
            if (size != 1) return 0;
            uint8_t t = (uint8_t)(is_float ? fv != 0.0 : iv != 0);
            memcpy(dst, &t, 1);
            return 1;
        }
        default: return 0;
    }
}

typedef struct {
    uint8_t* base;                     /* buffer data, NULL for a null array_t */
    int64_t batch_stride[kMaxBatchRank]; /* bytes per step of each batch dim (0: broadcast) */
    uint8_t* field;                    /* the array_t in the args or adjoint struct */
    int64_t source;                    /* the buffer (see Slot); <0: result -source-1 */
    int64_t flat_stride;               /* bytes per flat batch index (0: broadcast); -1: batch dims not flat */
    int32_t grad_from;                 /* >= 0: copy that array slot's data pointer into this one's grad */
} ArraySlot;

/* ------------------------------------------------------------------------------------------------------------
 * Multi-threaded CPU launches
 *
 * A CPU launch of a batched twin can be cut into slices that threads run at once: along the batch (each batch
 * element writes only its own results: always race-free), or along the first wp.tid() coordinate, where Python's
 * analysis says which results a slice may write outside its own rows (KernelSignature.thread_private_arrays):
 * those get per-worker partial buffers, zeroed, which are added into the result after the launch (integer and
 * float32/64 results; anything else keeps the launch on one thread). A pool of threads (warpnn_set_cpu_threads,
 * sized by Python from $WARPNN_CPU_THREADS or the CPU affinity) serves one launch at a time: CPU launches are
 * serialized anyway (g_cpu_launch_lock), and the calling XLA thread works as worker 0, so a launch never uses more
 * threads than the pool size.
 */

enum { kMaxWorkers = 256, kPartialPrivate = -2, kPartialNone = -1 };

typedef void (*pool_fn)(void* ctx, int worker, int num_workers);

static pthread_mutex_t g_pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_pool_start = PTHREAD_COND_INITIALIZER;
static pthread_cond_t g_pool_done = PTHREAD_COND_INITIALIZER;
static int g_pool_started;        /* worker threads created (guarded by g_pool_mu) */
static _Atomic int g_cpu_threads = 1; /* the pool size Python asked for, caller included */
static _Atomic int64_t g_min_per_worker = 4096; /* launch threads per worker below which a launch is not split (Python sets it) */
/* An adjoint thread replays the forward and then scatters into the input adjoints: about 3.5x a forward thread's work
 * (the heat stencil: 10.5 against 3.0 ns per element, benchmarks.cpu_codegen --adjoint), so an adjoint launch splits
 * at a quarter of the forward's elements per worker. On 16 cores that took a 50-step scan of the 256^2 stencil's
 * adjoint from 17.6 to 13.3 ms (docs/benchmarks-speed-cpu.md). */
enum { kAdjointWorkFactor = 4 };

static int64_t min_work_per_worker(int mode) {
    int64_t min_work = atomic_load(&g_min_per_worker) / (mode ? kAdjointWorkFactor : 1);
    return min_work > 0 ? min_work : 1;
}
static _Atomic int64_t g_partial_budget = 64; /* partial-buffer bytes per launch thread a split may zero and sum */
static _Atomic int g_slices_per_worker = 1;     /* slices a split launch gives each of its workers (slices_for) */
static _Atomic uint64_t g_pool_generation; /* written under g_pool_mu; read without it while spinning */
static _Atomic int g_pool_pending;          /* slices of the current job not finished yet */
/* The next slice of the current job to claim, in the low 32 bits, under the job's generation in the high ones: any
 * thread runs any slice (a slice's partial buffer and scratch belong to the slice, not the thread, so results do not
 * depend on who ran what), and the caller runs those a worker has not claimed yet. A worker descheduled by another
 * process (the norm with pytest -n on a 2-core machine) then delays nothing; with slices fixed per worker, a launch
 * waited for every worker's time slice: 18x slower than one thread under a compiler on the other core. A worker
 * late for its job claims nothing: its generation no longer matches. */
static _Atomic uint64_t g_pool_claim;
/* The current job: written before its generation is published, read by a thread only once it has claimed one of
 * the job's slices (the job cannot end before that slice does) or, for the thread count, under g_pool_mu. */
static _Atomic(pool_fn) g_job_fn;
static _Atomic(void*) g_job_ctx;
static _Atomic int g_job_slices;
static int g_job_threads; /* caller included: workers with a higher index sit the job out (under g_pool_mu) */
/* Run slices on XLA's own intra-op thread pool (XLA_FFI_ThreadPool_Schedule) instead of warpnn's threads
 * (WARPNN_CPU_POOL=xla): no second set of threads competing with XLA's for the cores. The API and execution context
 * of the CPU call being handled, set under g_cpu_launch_lock for its launches. */
static _Atomic int g_use_xla_pool;
static _Atomic int64_t g_xla_pool_tasks; /* runners XLA's pool accepted (tests check the path is taken) */
static const XLA_FFI_Api* g_xla_api;
static XLA_FFI_ExecutionContext* g_xla_ctx;
static _Atomic int64_t g_threaded_launches;
static _Atomic int64_t g_partial_rows; /* rows of partial buffers zeroed (and summed) by threaded launches */
/* Where CPU handler time goes (WARPNN_CPU_PROFILE=1 at load; off, each phase costs a branch): calls, ns in the
 * handler, zeroing results, a twin's launches (split ones with the caller's wait), their partial sums; the
 * launches' slices (an unsplit launch is one) and the ns their kernels ran (summed over threads: ns / launch ns =
 * threads busy on average). A per-element loop under vmap counts in the handler only. */
enum { kProfCalls, kProfHandler, kProfZero, kProfLaunch, kProfReduce, kProfSlices, kProfSliceNs, kProfCount };
static _Atomic int64_t g_profile[kProfCount];
static int g_profile_on = -1;

/* How long a worker (and the caller, for the others to finish) polls before it sleeps on a condition variable:
 * waking a sleeping thread costs tens of microseconds on a VM (an inter-processor interrupt to a halted vCPU),
 * as much as a whole small launch, and the launches of a lax.scan come back to back. $WARPNN_CPU_SPIN_US, read
 * once; 0 sleeps at once. */
static int64_t g_spin_ns = -1;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int profiling(void) {
    if (g_profile_on < 0) {
        const char* v = getenv("WARPNN_CPU_PROFILE");
        g_profile_on = v && *v && strcmp(v, "0") != 0;
    }
    return g_profile_on;
}

static int64_t profile_start(void) { return profiling() ? now_ns() : 0; }

static void profile_add(int phase, int64_t since) {
    if (since) atomic_fetch_add_explicit(&g_profile[phase], now_ns() - since, memory_order_relaxed);
}

/* One slice's kernel run since `since` (0: not profiling). */
static void profile_slice(int64_t since) {
    if (!since) return;
    atomic_fetch_add_explicit(&g_profile[kProfSlices], 1, memory_order_relaxed);
    profile_add(kProfSliceNs, since);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Polls until *generation differs from `from` or, given pending instead, *pending is 0, for at most the spin time;
 * returns whether it came. */
static int spin_until(_Atomic uint64_t* generation, uint64_t from, _Atomic int* pending) {
    if (g_spin_ns <= 0) return 0;
    int64_t end = now_ns() + g_spin_ns;
    for (int k = 0;; ++k) {
        if (generation ? atomic_load_explicit(generation, memory_order_acquire) != from
                       : atomic_load_explicit(pending, memory_order_acquire) == 0)
            return 1;
        cpu_relax();
        if ((k & 63) == 63) {
            if (now_ns() > end) return 0;
            sched_yield(); /* with more threads than cores (other processes, WARPNN_CPU_THREADS > CPUs) let them run */
        }
    }
}

/* Claims and runs slices of job `generation` until none is left; a thread arriving after the job has ended (its
 * generation no longer in the claim word) touches nothing of it. */
static void run_slices(uint64_t generation) {
    const uint64_t tag = (generation & 0xffffffffu) << 32;
    for (;;) {
        uint64_t claim = atomic_load_explicit(&g_pool_claim, memory_order_acquire);
        int n;
        do {
            if ((claim & ~(uint64_t)0xffffffffu) != tag) return;
            n = atomic_load_explicit(&g_job_slices, memory_order_relaxed);
            if ((claim & 0xffffffffu) >= (uint64_t)n) return;
        } while (!atomic_compare_exchange_weak_explicit(&g_pool_claim, &claim, claim + 1, memory_order_acq_rel,
                                                        memory_order_acquire));
        pool_fn fn = atomic_load_explicit(&g_job_fn, memory_order_relaxed);
        fn(atomic_load_explicit(&g_job_ctx, memory_order_relaxed), (int)(claim & 0xffffffffu), n);
        if (atomic_fetch_sub_explicit(&g_pool_pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&g_pool_mu); /* the caller may be asleep: it checks pending under this lock */
            pthread_cond_signal(&g_pool_done);
            pthread_mutex_unlock(&g_pool_mu);
        }
    }
}

/* A task on XLA's pool: the generation travels in the pointer, so a task XLA runs late reads no freed memory. */
static void xla_pool_task(void* data) { run_slices((uint64_t)(uintptr_t)data); }

/* CPU launches one at a time (the pool, its job and the scratch are shared), with the call's XLA at hand. */
static void cpu_launch_lock(XLA_FFI_CallFrame* frame) {
    pthread_mutex_lock(&g_cpu_launch_lock);
    g_xla_api = frame->api;
    g_xla_ctx = frame->ctx;
}

static void cpu_launch_unlock(void) {
    g_xla_api = NULL;
    g_xla_ctx = NULL;
    pthread_mutex_unlock(&g_cpu_launch_lock);
}

/* Whether this call's XLA offers its thread pool (a newer API than the oldest jaxlib this builds against may not). */
static int xla_pool_usable(void) {
    const XLA_FFI_Api* api = g_xla_api;
    return atomic_load(&g_use_xla_pool) && api && g_xla_ctx &&
           api->struct_size >= offsetof(XLA_FFI_Api, XLA_FFI_ThreadPool_Schedule) + sizeof(void*) &&
           api->XLA_FFI_ThreadPool_Schedule;
}

/* Hands up to `tasks` runners of job `generation` to XLA's pool; stops at the first refusal (the caller runs what
 * nobody claims). */
static void schedule_on_xla_pool(uint64_t generation, int tasks) {
    for (int k = 0; k < tasks; ++k) {
        XLA_FFI_ThreadPool_Schedule_Args args;
        memset(&args, 0, sizeof(args));
        args.struct_size = XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE;
        args.ctx = g_xla_ctx;
        args.task = xla_pool_task;
        args.data = (void*)(uintptr_t)generation;
        XLA_FFI_Error* error = g_xla_api->XLA_FFI_ThreadPool_Schedule(&args);
        if (error) {
            XLA_FFI_Error_Destroy_Args destroy;
            memset(&destroy, 0, sizeof(destroy));
            destroy.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
            destroy.error = error;
            g_xla_api->XLA_FFI_Error_Destroy(&destroy);
            return;
        }
        atomic_fetch_add_explicit(&g_xla_pool_tasks, 1, memory_order_relaxed);
    }
}

static void* pool_main(void* arg) {
    int index = (int)(intptr_t)arg;
    uint64_t seen = 0;
    for (;;) {
        spin_until(&g_pool_generation, seen, NULL);
        pthread_mutex_lock(&g_pool_mu);
        while (atomic_load(&g_pool_generation) == seen) pthread_cond_wait(&g_pool_start, &g_pool_mu);
        seen = atomic_load(&g_pool_generation);
        int threads = g_job_threads;
        pthread_mutex_unlock(&g_pool_mu);
        if (index >= threads) continue;
        run_slices(seen);
    }
    return NULL;
}

/* Under g_pool_mu: how long the caller (and warpnn's workers) poll before sleeping, from WARPNN_CPU_SPIN_US once. */
static void read_spin_setting(void) {
    if (g_spin_ns < 0) {
        const char* us = getenv("WARPNN_CPU_SPIN_US");
        g_spin_ns = (us && *us ? strtoll(us, NULL, 10) : 100) * 1000;
    }
}

/* Under g_pool_mu: makes fn(ctx, w, n) the current job, for the caller and warpnn's workers with an index below
 * `threads` (caller included), and publishes it; returns its generation. */
static uint64_t publish_job(pool_fn fn, void* ctx, int n, int threads) {
    atomic_store(&g_job_fn, fn);
    atomic_store(&g_job_ctx, ctx);
    atomic_store(&g_job_slices, n);
    g_job_threads = threads;
    uint64_t generation = atomic_load(&g_pool_generation) + 1;
    atomic_store(&g_pool_pending, n);
    atomic_store(&g_pool_claim, (generation & 0xffffffffu) << 32);
    atomic_store(&g_pool_generation, generation);
    return generation;
}

/* Runs fn(ctx, w, n) for the slices w = 0..n-1 on the calling thread and up to threads - 1 of the pool's workers,
 * whichever claims each first. Every slice runs (the caller runs those nobody else claimed, so fewer workers than
 * asked, when thread creation fails, still cover the job). */
static void pool_run(pool_fn fn, void* ctx, int n, int threads) {
    if (threads > n) threads = n;
    if (threads > 1 && xla_pool_usable()) {
        pthread_mutex_lock(&g_pool_mu);
        read_spin_setting(); /* the caller's wait for XLA's runners polls too */
        uint64_t generation = publish_job(fn, ctx, n, 1); /* warpnn's own workers, if any were started, sit it out */
        pthread_mutex_unlock(&g_pool_mu);
        schedule_on_xla_pool(generation, threads - 1);
        run_slices(generation);
    } else if (threads > 1) {
        pthread_mutex_lock(&g_pool_mu);
        read_spin_setting();
        while (g_pool_started < threads - 1 && g_pool_started < kMaxWorkers - 1) {
            pthread_t t;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            int rc = pthread_create(&t, &attr, pool_main, (void*)(intptr_t)(g_pool_started + 1));
            pthread_attr_destroy(&attr);
            if (rc != 0) break;
            ++g_pool_started;
        }
        if (threads - 1 > g_pool_started) threads = g_pool_started + 1;
        if (threads > 1) {
            uint64_t generation = publish_job(fn, ctx, n, threads);
            pthread_cond_broadcast(&g_pool_start);
            pthread_mutex_unlock(&g_pool_mu);
            run_slices(generation);
        } else {
            pthread_mutex_unlock(&g_pool_mu);
        }
    }
    if (threads <= 1) {
        for (int w = 0; w < n; ++w) fn(ctx, w, n);
        return;
    }
    if (!spin_until(NULL, 0, &g_pool_pending)) {
        pthread_mutex_lock(&g_pool_mu);
        while (atomic_load(&g_pool_pending) > 0) pthread_cond_wait(&g_pool_done, &g_pool_mu);
        pthread_mutex_unlock(&g_pool_mu);
    }
}

/* Pool size (caller included; 1 = every launch on the calling thread) and the smallest slice worth a thread. */
WARPNN_EXPORT void warpnn_set_cpu_threads(int32_t threads, int64_t min_per_worker) {
    atomic_store(&g_cpu_threads, threads < 1 ? 1 : threads > kMaxWorkers ? kMaxWorkers : threads);
    if (min_per_worker > 0) atomic_store(&g_min_per_worker, min_per_worker);
}

/* 1: split launches run on XLA's intra-op thread pool where the call's XLA offers it; 0: on warpnn's own threads. */
WARPNN_EXPORT void warpnn_set_cpu_pool_xla(int32_t on) { atomic_store(&g_use_xla_pool, on != 0); }

WARPNN_EXPORT int64_t warpnn_xla_pool_tasks(void) { return atomic_load_explicit(&g_xla_pool_tasks, memory_order_relaxed); }

/* Slices per worker of a split launch (1 to 64). */
WARPNN_EXPORT void warpnn_set_cpu_slices_per_worker(int32_t slices) {
    atomic_store(&g_slices_per_worker, slices < 1 ? 1 : slices > 64 ? 64 : slices);
}

/* The partial-buffer bytes (all workers together) a split launch may zero and sum per launch thread. */
WARPNN_EXPORT void warpnn_set_cpu_partial_budget(int64_t bytes_per_thread) {
    if (bytes_per_thread > 0) atomic_store(&g_partial_budget, bytes_per_thread);
}

/* The CPU profile's counters (kProfCount of them, see g_profile), then zeroed. */
WARPNN_EXPORT void warpnn_cpu_profile(int64_t* out) {
    for (int k = 0; k < kProfCount; ++k) out[k] = atomic_exchange(&g_profile[k], 0);
}

WARPNN_EXPORT int64_t warpnn_threaded_launches(void) {
    return atomic_load_explicit(&g_threaded_launches, memory_order_relaxed);
}

/* Warp's CPU tiles keep their shared memory behind one static pointer per module (warp/native/tile.h: "Ideally
 * this would be thread_local"), so two threads in a tile kernel at once corrupt each other's tiles. Python marks
 * such kernels (and any whose source it cannot read); their batches launch one element after another. */
WARPNN_EXPORT int32_t warpnn_set_cpu_serial(int64_t kernel_id) {
    KernelDesc* d = lookup(kernel_id);
    if (!d) return 1;
    atomic_store(&d->cpu_serial, 1);
    return 0;
}

WARPNN_EXPORT int64_t warpnn_partial_rows(void) {
    return atomic_load_explicit(&g_partial_rows, memory_order_relaxed);
}

/* How each result of a mode may be written by a slice of the first coordinate (kPartialPrivate: only in its own
 * rows; a K_* kind: anywhere, reduced through partial buffers of that kind; kPartialNone: anywhere, no reduction
 * known: such a launch is not split by rows).
 *
 * A reduced result may also have window sources (KernelSignature.thread_row_windows): integer index arrays whose
 * values, read at the thread's own rows, are the only rows of the result the thread touches. A slice's partial
 * buffer is then zeroed and summed only between the smallest and the largest of those values in its rows. */
enum { kMaxWindowSources = 4 };
typedef struct {
    int32_t field;      /* args-struct offset of the index array's array_t; < 0: no (more) sources */
    int32_t int_bytes;  /* 4 or 8: its integers */
    int32_t elem_bytes; /* bytes of one Warp element (vec2i: 8), to check the array is dense */
} WindowSource;

typedef struct {
    int32_t num[2];
    int32_t* kind[2];
    WindowSource* window[2]; /* num[m] * kMaxWindowSources */
} PartialKinds;

WARPNN_EXPORT int32_t warpnn_set_twin_partials(int64_t kernel_id, int32_t num_fwd, const int32_t* fwd,
                                               const int32_t* fwd_windows, int32_t num_adj, const int32_t* adj,
                                               const int32_t* adj_windows) {
    KernelDesc* d = lookup(kernel_id);
    if (!d) return 1;
    if (num_fwd != d->num_rets[0] || num_adj != d->num_rets[1] || num_fwd > 64 || num_adj > 64) return 4;
    PartialKinds* pk = (PartialKinds*)calloc(1, sizeof(PartialKinds));
    if (!pk) return 2;
    pk->num[0] = num_fwd;
    pk->num[1] = num_adj;
    for (int m = 0; m < 2; ++m) {
        size_t n = (size_t)(pk->num[m] ? pk->num[m] : 1);
        pk->kind[m] = (int32_t*)calloc(n, sizeof(int32_t));
        pk->window[m] = (WindowSource*)calloc(n * kMaxWindowSources, sizeof(WindowSource));
        if (!pk->kind[m] || !pk->window[m]) return 2;
        memcpy(pk->kind[m], m ? adj : fwd, sizeof(int32_t) * (size_t)pk->num[m]);
        const int32_t* w = m ? adj_windows : fwd_windows; /* per result and source: field, int bytes, elem bytes */
        for (size_t k = 0; k < (size_t)pk->num[m] * kMaxWindowSources; ++k) {
            WindowSource* ws = &pk->window[m][k];
            ws->field = w[3 * k];
            ws->int_bytes = w[3 * k + 1];
            ws->elem_bytes = w[3 * k + 2];
            if (ws->field >= 0 && ((ws->int_bytes != 4 && ws->int_bytes != 8) || ws->elem_bytes < ws->int_bytes ||
                                   ws->field + (int64_t)sizeof(wp_array_t) > d->args_size))
                return 4;
        }
    }
    atomic_store_explicit(&d->partials, (void*)pk, memory_order_release);
    return 0;
}

typedef struct {
    void* fn;
    int mode;
    const TwinLayout* twin;
    const uint8_t* bounds;        /* the whole launch's twin bounds */
    int split_dim;                /* index in the bounds of the dim the slices cut */
    int32_t split_field;          /* args-struct offset of the int receiving a slice's first index */
    int32_t other_field;          /* the other offset, 0 */
    int64_t extent;               /* of the split dim */
    int64_t threads_per_index;    /* launch threads per index of the split dim */
    const uint8_t* args;          /* templates */
    const uint8_t* adj;
    size_t args_bytes;
    const ArraySlot* arrays;
    int32_t num_arrays;
    uint8_t* scratch_args;        /* num_workers * 2 * args_bytes */
    /* partial results: per result, kind (kPartialPrivate: none), bytes, data; per worker >= 1 a buffer */
    int32_t num_rets;
    const int32_t* kinds;
    const size_t* ret_bytes;
    uint8_t* const* ret_data;
    uint8_t* partials;            /* (num_workers - 1) * sum of partial result bytes */
    const size_t* partial_offset; /* per result, offset in one worker's partial area */
    size_t partial_stride;        /* bytes of one worker's partial area */
    int32_t scalar_bytes_of[64];
    int64_t ret_rows[64];             /* rows (first dim) of each result */
    const WindowSource* windows;      /* per result, kMaxWindowSources; NULL: every partial covers all rows */
    const int64_t* reach;             /* attribute row_reach (see find_reach), or NULL */
    int64_t* window_rows;             /* per worker >= 1 and result: the [first, end) rows its partial covers */
} CpuSplit;

/* Attribute row_reach of an adjoint launch (warpnn/_reach.py): for results whose rows the kernel reaches through
 * indices computed from the thread's row alone (a stencil's neighbours, wrapped), the rows each block of launch rows
 * reaches, found by a probe of the kernel's index arithmetic. int64 [block, blocks, results, then per result: known
 * (1) or not (0), `blocks` minima, `blocks` maxima]. A row is given as the launch row plus its nearest offset to the
 * row reached, so it may lie outside [0, rows): the window is circular (a periodic stencil's last rows reach row 0).
 * NULL unless it fits this launch exactly. */
static const int64_t* find_reach(const XLA_FFI_CallFrame* frame, int64_t extent, int32_t num_rets) {
    const XLA_FFI_Attrs* attrs = &frame->attrs;
    for (int64_t i = 0; i < attrs->size; ++i) {
        if (!span_equals(attrs->names[i], "row_reach", 9) || attrs->types[i] != XLA_FFI_AttrType_ARRAY) continue;
        const XLA_FFI_Array* a = (const XLA_FFI_Array*)attrs->attrs[i];
        if (a->dtype != XLA_FFI_DataType_S64 || a->size < 3) return NULL;
        const int64_t* v = (const int64_t*)a->data;
        if (v[0] < 1 || v[1] != (extent + v[0] - 1) / v[0] || v[2] != num_rets ||
            a->size != 3 + (size_t)num_rets * (1 + 2 * (size_t)v[1]))
            return NULL;
        return v;
    }
    return NULL;
}

/* Result r's entry of row_reach: known, then its minima and maxima. */
static const int64_t* reach_entry(const int64_t* reach, int32_t r) {
    return reach + 3 + (size_t)r * (1 + 2 * (size_t)reach[1]);
}

static int reach_known(const int64_t* reach, int32_t r) {
    return reach && reach_entry(reach, r)[0] == 1;
}

/* The rows of result r that the launch rows [lo, hi) reach according to row_reach, as [first, end) with first in
 * [0, rows) and end possibly past rows (the window then goes on from row 0); all rows if unknown. */
static void reach_window(const CpuSplit* c, int32_t r, int64_t lo, int64_t hi, int64_t* first, int64_t* end) {
    int64_t rows = c->ret_rows[r];
    if (!reach_known(c->reach, r) || hi <= lo || rows < 1) return;
    int64_t block = c->reach[0], blocks = c->reach[1], smallest = INT64_MAX, largest = INT64_MIN;
    const int64_t* mins = reach_entry(c->reach, r) + 1;
    const int64_t* maxs = mins + blocks;
    for (int64_t b = lo / block; b <= (hi - 1) / block; ++b) {
        if (b >= blocks || maxs[b] < mins[b]) return;
        smallest = mins[b] < smallest ? mins[b] : smallest;
        largest = maxs[b] > largest ? maxs[b] : largest;
    }
    if (largest - smallest + 1 >= rows) return;
    *first = ((smallest % rows) + rows) % rows;
    *end = *first + (largest - smallest + 1);
}

/* The two row ranges of a window [first, end) of a result of `rows` rows (end > rows: it wraps to row 0). */
static void window_ranges(const int64_t* window, int64_t rows, int64_t ranges[2][2]) {
    ranges[0][0] = window[0];
    ranges[0][1] = window[1] < rows ? window[1] : rows;
    ranges[1][0] = 0;
    ranges[1][1] = window[1] > rows ? window[1] - rows : 0;
}

/* The rows of result r that the launch rows [lo, hi) may touch: between the smallest and the largest integer in
 * those rows of the result's index arrays (see PartialKinds). All rows where an index array is not a dense
 * array of its rows, or an index falls outside the result (the launch writes there as it would on one thread). */
static void row_window(const CpuSplit* c, int32_t r, int64_t lo, int64_t hi, int64_t* first, int64_t* end) {
    int64_t rows = c->ret_rows[r], smallest = INT64_MAX, largest = INT64_MIN;
    *first = 0;
    *end = rows;
    const WindowSource* src = c->windows ? c->windows + (size_t)r * kMaxWindowSources : NULL;
    if (!src || src[0].field < 0) {
        reach_window(c, r, lo, hi, first, end);
        return;
    }
    for (int k = 0; k < kMaxWindowSources && src[k].field >= 0; ++k) {
        wp_array_t a;
        memcpy(&a, c->args + src[k].field, sizeof(a));
        if (!a.data || a.ndim < 1 || a.ndim > kMaxDims || hi > a.shape[0]) return;
        int64_t dense = src[k].elem_bytes;
        for (int dim = a.ndim - 1; dim >= 0; --dim) {
            if (a.shape[dim] < 0 || a.strides[dim] != dense) return;
            dense *= a.shape[dim];
        }
        const uint8_t* from = (const uint8_t*)(uintptr_t)a.data + lo * (int64_t)a.strides[0];
        size_t count = (size_t)(hi - lo) * ((size_t)a.strides[0] / (size_t)src[k].int_bytes);
#define WARPNN_MINMAX(T)                                                   \
    for (size_t i = 0; i < count; ++i) {                                   \
        int64_t v = (int64_t)((const T*)from)[i];                          \
        smallest = v < smallest ? v : smallest;                            \
        largest = v > largest ? v : largest;                               \
    }
        if (src[k].int_bytes == 4) { WARPNN_MINMAX(int32_t) }
        else { WARPNN_MINMAX(int64_t) }
#undef WARPNN_MINMAX
    }
    if (smallest > largest) {
        *end = 0; /* no index at all: the slice touches no row */
    } else if (smallest >= 0 && largest < rows) {
        *first = smallest;
        *end = largest + 1;
    }
}

static void cpu_split_launch(void* ctx_, int w, int n) {
    CpuSplit* c = (CpuSplit*)ctx_;
    int64_t lo = c->extent * w / n, hi = c->extent * (w + 1) / n;
    uint8_t* args = c->scratch_args + (size_t)w * 2 * c->args_bytes;
    uint8_t* adj = args + c->args_bytes;
    memcpy(args, c->args, c->args_bytes);
    memcpy(adj, c->adj, c->args_bytes);
    int32_t first = (int32_t)lo, zero = 0;
    memcpy(args + c->other_field, &zero, 4);
    memcpy(args + c->split_field, &first, 4);
    if (w > 0 && c->partials) {
        uint8_t* mine = c->partials + (size_t)(w - 1) * c->partial_stride;
        for (int32_t r = 0; r < c->num_rets; ++r) {
            if (c->kinds[r] == kPartialPrivate) continue;
            int64_t* window = c->window_rows + ((size_t)(w - 1) * (size_t)c->num_rets + (size_t)r) * 2;
            row_window(c, r, lo, hi, &window[0], &window[1]);
            size_t row_bytes = c->ret_bytes[r] / (size_t)(c->ret_rows[r] > 0 ? c->ret_rows[r] : 1);
            atomic_fetch_add_explicit(&g_partial_rows, window[1] - window[0], memory_order_relaxed);
            int64_t ranges[2][2];
            window_ranges(window, c->ret_rows[r], ranges);
            for (int k = 0; k < 2; ++k)
                if (ranges[k][1] > ranges[k][0])
                    memset(mine + c->partial_offset[r] + (size_t)ranges[k][0] * row_bytes, 0,
                           (size_t)(ranges[k][1] - ranges[k][0]) * row_bytes);
        }
        for (int32_t k = 0; k < c->num_arrays; ++k) {
            const ArraySlot* as = &c->arrays[k];
            if (as->source >= 0 || c->kinds[-as->source - 1] == kPartialPrivate) continue;
            uint8_t* field = args + (as->field - c->args); /* adj follows args in both the template and here */
            uint64_t data = (uint64_t)(uintptr_t)(mine + c->partial_offset[-as->source - 1]);
            memcpy(field + offsetof(wp_array_t, data), &data, sizeof(data));
        }
    }
    uint8_t bounds[64];
    memcpy(bounds, c->bounds, sizeof(bounds));
    uint32_t e32 = (uint32_t)(hi - lo);
    memcpy(bounds + 4 * c->split_dim, &e32, 4);
    size_t size_field = (size_t)((hi - lo) * c->threads_per_index);
    memcpy(bounds + c->twin->bounds_size_offset, &size_field, sizeof(size_t));
    if (hi > lo) {
        int64_t t = profile_start();
        if (c->mode)
            ((cpu_backward_fn)c->fn)(bounds, args, adj);
        else
            ((cpu_forward_fn)c->fn)(bounds, args);
        profile_slice(t);
    }
}

/* After the launch: result[slice] += partial_1[slice] + ... + partial_{n-1}[slice], slices by worker, each partial
 * within the rows its worker zeroed. */
typedef struct {
    CpuSplit* split;
    int launch_workers;
} CpuReduce;

static void cpu_split_reduce(void* ctx_, int w, int n) {
    CpuReduce* red = (CpuReduce*)ctx_;
    CpuSplit* c = red->split;
    for (int32_t r = 0; r < c->num_rets; ++r) {
        int32_t kind = c->kinds[r];
        if (kind == kPartialPrivate) continue;
        size_t item = (size_t)c->scalar_bytes_of[r];
        size_t count = c->ret_bytes[r] / item, lo = count * (size_t)w / (size_t)n, hi = count * (size_t)(w + 1) / (size_t)n;
        size_t per_row = count / (size_t)(c->ret_rows[r] > 0 ? c->ret_rows[r] : 1);
        for (int p = 1; p < red->launch_workers; ++p) {
            const uint8_t* src = c->partials + (size_t)(p - 1) * c->partial_stride + c->partial_offset[r];
            uint8_t* dst = c->ret_data[r];
            const int64_t* window = c->window_rows + ((size_t)(p - 1) * (size_t)c->num_rets + (size_t)r) * 2;
            int64_t ranges[2][2];
            window_ranges(window, c->ret_rows[r], ranges);
            for (int k = 0; k < 2; ++k) {
                size_t from = (size_t)ranges[k][0] * per_row, to = (size_t)ranges[k][1] * per_row;
                from = from > lo ? from : lo;
                to = to < hi ? to : hi;
#define WARPNN_ADD(T)                                                                            \
    for (size_t i = from; i < to; ++i) ((T*)dst)[i] = (T)(((T*)dst)[i] + ((const T*)src)[i]);
                if (kind == K_FLOAT && item == 4) { WARPNN_ADD(float) }
                else if (kind == K_FLOAT && item == 8) { WARPNN_ADD(double) }
                else if (item == 1) { WARPNN_ADD(uint8_t) }
                else if (item == 2) { WARPNN_ADD(uint16_t) }
                else if (item == 4) { WARPNN_ADD(uint32_t) }
                else if (item == 8) { WARPNN_ADD(uint64_t) }
#undef WARPNN_ADD
            }
        }
    }
}

/* A CPU batch's per-element launches of the kernel itself, batch elements split across workers: each element
 * writes only its own results, so this is race-free and bitwise the one-thread loop. */
typedef struct {
    void* fn;
    int mode;
    const uint8_t* bounds;
    const uint8_t* args; /* templates; adj follows args */
    size_t args_bytes;
    const ArraySlot* arrays;
    int32_t num_arrays;
    const int64_t* batch;
    int64_t batch_rank, num_batch;
    uint8_t* scratch; /* num_workers * 2 * args_bytes */
} CpuLoop;

static void cpu_loop_slice(void* ctx_, int w, int n) {
    CpuLoop* c = (CpuLoop*)ctx_;
    int64_t lo = c->num_batch * w / n, hi = c->num_batch * (w + 1) / n;
    uint8_t* args = c->scratch + (size_t)w * 2 * c->args_bytes;
    uint8_t* adj = args + c->args_bytes;
    memcpy(args, c->args, 2 * c->args_bytes);
    for (int64_t b = lo; b < hi; ++b) {
        int64_t index[kMaxBatchRank], rest = b;
        for (int64_t j = c->batch_rank - 1; j >= 0; --j) {
            index[j] = rest % c->batch[j];
            rest /= c->batch[j];
        }
        for (int32_t k = 0; k < c->num_arrays; ++k) {
            const ArraySlot* as = &c->arrays[k];
            int64_t offset = 0;
            for (int64_t j = 0; j < c->batch_rank; ++j) offset += index[j] * as->batch_stride[j];
            uint64_t data = (uint64_t)(uintptr_t)(as->base + offset);
            memcpy(args + (as->field - c->args) + offsetof(wp_array_t, data), &data, sizeof(data));
        }
        for (int32_t k = 0; k < c->num_arrays; ++k)
            if (c->arrays[k].grad_from >= 0)
                memcpy(args + (c->arrays[k].field - c->args) + offsetof(wp_array_t, grad),
                       args + (c->arrays[c->arrays[k].grad_from].field - c->args) + offsetof(wp_array_t, data),
                       sizeof(uint64_t));
        if (c->mode)
            ((cpu_backward_fn)c->fn)((void*)c->bounds, args, adj);
        else
            ((cpu_forward_fn)c->fn)((void*)c->bounds, args);
    }
}

/* Scratch reused across CPU launches (guarded by g_cpu_launch_lock). */
static uint8_t* g_cpu_scratch;
static size_t g_cpu_scratch_size;

static uint8_t* cpu_scratch(size_t n) {
    if (n > g_cpu_scratch_size) {
        uint8_t* p = (uint8_t*)realloc(g_cpu_scratch, n);
        if (!p) return NULL;
        g_cpu_scratch = p;
        g_cpu_scratch_size = n;
    }
    return g_cpu_scratch;
}

/* A split launch's slices per worker: threads claim slices as they come, so with more slices than threads one
 * slowed down (another process on its core, a late wake-up) takes fewer of them instead of holding up the launch. */
static const size_t kMaxPartialScratch = (size_t)64 << 20;

static int slices_for(int workers, int64_t extent, size_t partial_stride, int all_windowed) {
    int per_worker = atomic_load(&g_slices_per_worker);
    /* a whole partial buffer per slice would multiply the zeroing and summing: windowed ones cost about their
     * slice's rows each, so only those (and launches without partials) are cut finer */
    if (per_worker <= 1 || (partial_stride && !all_windowed)) return workers;
    int64_t slices = (int64_t)workers * per_worker;
    if (slices > extent) slices = extent;
    if (partial_stride && (size_t)(slices - 1) * partial_stride > kMaxPartialScratch)
        slices = 1 + (int64_t)(kMaxPartialScratch / partial_stride);
    return slices > workers ? (int)slices : workers;
}

static const char* const kDirection[2] = {"forward", "adjoint"};

/* One launch of the batched twin over (batch, launch dims...): every array gets the leading batch dim (stride 0 where
 * the buffer is broadcast), the offsets are 0; on the CPU the launch may be cut into slices for several threads. The
 * results have been zeroed already. */
static XLA_FFI_Error* launch_twin(const XLA_FFI_Api* api, const KernelDesc* d, const TwinLayout* twin,
                                  const DeviceEntry* te, void* fn, int mode, int cuda, int32_t ordinal, void* stream,
                                  const DriverApi* driver, const XLA_FFI_Array* dims_attr, int64_t num_batch,
                                  XLA_FFI_CallFrame* frame, uint8_t* args_struct, uint8_t* adj_struct,
                                  size_t args_bytes, ArraySlot* arrays, int32_t num_arrays) {
    const char* kname = d->name;
    const int batched = twin->batched;
    /* arrays: one more leading dim (batched twin), null arrays too */
    for (int32_t s = 0; batched && s < d->num_slots[mode]; ++s) {
        const Slot* slot = &d->slots[mode][s];
        const int64_t* p = d->params + (size_t)slot->param * P_NCOLS;
        if (!p[P_IS_ARRAY]) continue;
        uint8_t* field = (slot->adjoint ? adj_struct : args_struct) + p[P_OFFSET];
        wp_array_t a;
        memcpy(&a, field, sizeof(a));
        int64_t flat = 0;
        for (int32_t k = 0; k < num_arrays; ++k)
            if (arrays[k].field == field) {
                flat = arrays[k].flat_stride;
                uint64_t data = (uint64_t)(uintptr_t)arrays[k].base;
                memcpy(&a.data, &data, sizeof(data));
            }
        for (int k = kMaxDims - 1; k > 0; --k) {
            a.shape[k] = a.shape[k - 1];
            a.strides[k] = a.strides[k - 1];
        }
        a.shape[0] = a.data ? (int32_t)num_batch : 0;
        a.strides[0] = (int32_t)flat;
        a.ndim = (uint16_t)(p[P_WARP_NDIM] + 1);
        memcpy(field, &a, sizeof(a));
    }
    for (int32_t k = 0; !batched && k < num_arrays; ++k) { /* the row twin: the arrays as they are (batch of 1) */
        uint64_t data = (uint64_t)(uintptr_t)arrays[k].base;
        memcpy(arrays[k].field + offsetof(wp_array_t, data), &data, sizeof(data));
    }
    /* carried adjoints (P_GRAD_ALIAS): the primal's grad is its whole adjoint buffer, which has the primal's batch
     * stride (checked by the caller), so Warp's views x_b[b] find each element's adjoint at the primal's offset */
    for (int32_t k = 0; k < num_arrays; ++k)
        if (arrays[k].grad_from >= 0) {
            uint64_t grad = (uint64_t)(uintptr_t)arrays[arrays[k].grad_from].base;
            memcpy(arrays[k].field + offsetof(wp_array_t, grad), &grad, sizeof(grad));
        }
    int32_t zero = 0;
    memcpy(args_struct + twin->first_batch_offset, &zero, 4);
    memcpy(args_struct + twin->first_row_offset, &zero, 4);

    /* bounds: ([batch,] launch dims padded with 1 to the kernel's rank); the row-loop twin's last dim is its loop */
    const int64_t* dims = (const int64_t*)dims_attr->data;
    uint8_t bounds[64];
    memset(bounds, 0, sizeof(bounds));
    uint64_t per_batch = 1, inner = 1;
    uint32_t e32 = (uint32_t)num_batch;
    if (batched) memcpy(bounds, &e32, 4);
    const int32_t launch_rank = d->kernel_dim - (twin->inner_offset >= 0);
    if (twin->inner_offset >= 0) {
        int64_t extent = launch_rank < (int32_t)dims_attr->size ? dims[launch_rank] : 1;
        int32_t e = (int32_t)extent; /* the handler checked every extent against Warp's 32-bit tid limit */
        memcpy(args_struct + twin->inner_offset, &e, 4);
        inner = (uint64_t)extent;
    }
    for (int32_t i = 0; i < launch_rank; ++i) {
        int64_t extent = i < (int32_t)dims_attr->size ? dims[i] : 1;
        per_batch *= (uint64_t)extent;
        e32 = (uint32_t)extent;
        memcpy(bounds + 4 * (i + batched), &e32, 4);
    }
    uint64_t total = per_batch * (uint64_t)num_batch;
    size_t size_field = (size_t)total, mult_field = 1;
    memcpy(bounds + twin->bounds_size_offset, &size_field, sizeof(size_t));
    memcpy(bounds + twin->bounds_coord_mult_offset, &mult_field, sizeof(size_t));
    atomic_fetch_add_explicit(&g_launches[mode], 1, memory_order_relaxed);

    if (cuda) {
        void* params[1 + 2 * 512];
        int32_t num_slots = d->num_slots[mode];
        if (num_slots + 3 > (int32_t)(sizeof(params) / sizeof(params[0])))
            return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "warpnn: kernel '%s': too many parameters",
                              kname);
        /* Warp's CUDA entry takes (bounds, each primal param, [each adjoint param]): the twin has two more int
         * params after the original's, in both structs */
        int32_t n = 0, num_params = d->num_params;
        params[n++] = bounds;
        for (int32_t s = 0; s < num_params; ++s)
            params[n++] = args_struct + d->params[(size_t)s * P_NCOLS + P_OFFSET];
        params[n++] = args_struct + twin->first_batch_offset;
        params[n++] = args_struct + twin->first_row_offset;
        if (mode) {
            for (int32_t s = 0; s < num_params; ++s)
                params[n++] = adj_struct + d->params[(size_t)s * P_NCOLS + P_OFFSET];
            params[n++] = adj_struct + twin->first_batch_offset;
            params[n++] = adj_struct + twin->first_row_offset;
        }
        uint64_t grid = te->block_dim > 0 ? (total + (uint64_t)te->block_dim - 1) / (uint64_t)te->block_dim : 0;
        if (driver && te->cluster_dim <= 1 && te->block_dim > 0 && grid <= (uint64_t)INT32_MAX) {
            int rc = driver->launch_kernel(fn, (unsigned)grid, 1, 1, (unsigned)te->block_dim, 1, 1,
                                           (unsigned)(mode ? te->backward_smem : te->forward_smem), stream, params,
                                           NULL);
            if (rc != 0)
                return make_error(api, XLA_FFI_Error_Code_INTERNAL,
                                  "warpnn: CUDA launch of batched %s kernel '%s' on device %d failed: %s",
                                  kDirection[mode], kname, (int)ordinal, driver_error(driver, rc));
            atomic_fetch_add_explicit(&g_driver_launches, 1, memory_order_relaxed);
            return NULL;
        }
        cuda_launch_fn launch = atomic_load(&g_cuda_launch);
        if (!launch)
            return make_error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION,
                              "warpnn: kernel '%s': Warp's CUDA launcher is not set", kname);
        size_t failed = launch(te->context, fn, (size_t)total, 0, te->block_dim, te->grid_stride, te->cluster_dim,
                               mode ? te->backward_smem : te->forward_smem, params, stream, NULL);
        if (failed) {
            error_string_fn es = atomic_load(&g_error_string);
            return make_error(api, XLA_FFI_Error_Code_INTERNAL,
                              "warpnn: CUDA launch of batched %s kernel '%s' on device %d failed: %s",
                              kDirection[mode], kname, (int)ordinal, es ? es() : "?");
        }
        return NULL;
    }

    /* CPU: how many workers, along which dim */
    CpuSplit c;
    memset(&c, 0, sizeof(c));
    c.fn = fn;
    c.mode = mode;
    c.twin = twin;
    c.bounds = bounds;
    c.args = args_struct;
    c.adj = adj_struct;
    c.args_bytes = args_bytes;
    c.arrays = arrays;
    c.num_arrays = num_arrays;
    int threads = atomic_load(&g_cpu_threads);
    int64_t by_work = (int64_t)(total * inner / (uint64_t)min_work_per_worker(mode)); /* elements, not rows */
    int workers = threads < by_work ? threads : (int)(by_work < 1 ? 1 : by_work);
    const PartialKinds* pk = (const PartialKinds*)atomic_load_explicit(&((KernelDesc*)d)->partials, memory_order_acquire);
    size_t partial_stride = 0, partial_cost = 0;
    int all_windowed = 1;
    size_t ret_bytes[64], partial_offset[64];
    uint8_t* ret_data[64];
    int32_t kinds[64];
    if (workers > 1 && batched && num_batch >= workers) {
        c.split_dim = 0;
        c.split_field = twin->first_batch_offset;
        c.other_field = twin->first_row_offset;
        c.extent = num_batch;
        c.threads_per_index = (int64_t)per_batch;
    } else if (workers > 1 && num_batch == 1 && d->kernel_dim >= 1 && pk && d->num_rets[mode] <= 64 &&
               pk->num[mode] == d->num_rets[mode]) {
        c.split_dim = batched;
        c.split_field = twin->first_row_offset;
        c.other_field = twin->first_batch_offset;
        c.extent = (int64_t)(dims_attr->size >= 1 ? dims[0] : 1);
        c.threads_per_index = (int64_t)(per_batch / (uint64_t)(c.extent > 0 ? c.extent : 1));
        if (workers > c.extent) workers = (int)c.extent;
        c.reach = batched ? NULL : find_reach(frame, c.extent, d->num_rets[mode]);
        for (int32_t r = 0; r < d->num_rets[mode]; ++r) {
            const XLA_FFI_Buffer* buf = (const XLA_FFI_Buffer*)frame->rets.rets[r];
            const int64_t* p = d->params + (size_t)d->ret_param[mode][r] * P_NCOLS;
            size_t nbytes = (size_t)p[P_SCALAR_BYTES];
            for (int64_t k = 0; k < buf->rank; ++k) nbytes *= (size_t)buf->dims[k];
            kinds[r] = pk->kind[mode][r];
            ret_bytes[r] = nbytes;
            ret_data[r] = (uint8_t*)buf->data;
            c.ret_rows[r] = buf->rank >= 1 ? buf->dims[0] : 1;
            c.scalar_bytes_of[r] = (int32_t)p[P_SCALAR_BYTES];
            if (kinds[r] == kPartialNone) workers = 1;
            if (kinds[r] != kPartialPrivate && kinds[r] != kPartialNone) {
                partial_offset[r] = partial_stride;
                partial_stride += (nbytes + 63u) & ~(size_t)63u;
                /* a windowed partial: each slice zeroes and sums the rows its indices reach, about its share
                 * where connectivity is ordered (a cloth's springs row by row) */
                int windowed = !batched && (pk->window[mode][(size_t)r * kMaxWindowSources].field >= 0 ||
                                            reach_known(c.reach, r));
                partial_cost += windowed ? nbytes / (size_t)(threads > 1 ? threads : 1) : nbytes;
                all_windowed &= windowed;
            }
        }
        if (!batched) c.windows = pk->window[mode];
        /* partial buffers cost their zeroing and reduction: all workers' together within g_partial_budget bytes per
         * launch thread (a small scatter into a big result stays on fewer workers, or one) */
        if (partial_cost && workers > 1) {
            int64_t affordable = 1 + (int64_t)((uint64_t)atomic_load(&g_partial_budget) * total * inner / partial_cost);
            if (workers > affordable) workers = (int)affordable;
        }
    } else {
        workers = 1;
    }
    if (workers < 2) {
        int64_t t = profile_start();
        if (mode)
            ((cpu_backward_fn)fn)(bounds, args_struct, adj_struct);
        else
            ((cpu_forward_fn)fn)(bounds, args_struct);
        profile_slice(t); /* one slice, the whole launch */
        profile_add(kProfLaunch, t);
        return NULL;
    }
    int slices = slices_for(workers, c.extent, partial_stride, all_windowed);
    c.num_rets = d->num_rets[mode];
    c.kinds = kinds;
    c.ret_bytes = ret_bytes;
    c.ret_data = ret_data;
    c.partial_offset = partial_offset;
    c.partial_stride = partial_stride;
    size_t structs = ((size_t)slices * 2 * args_bytes + 63u) & ~(size_t)63u;
    size_t windows = ((size_t)slices * (size_t)c.num_rets * 2 * sizeof(int64_t) + 63u) & ~(size_t)63u;
    uint8_t* scratch = cpu_scratch(structs + windows + (size_t)(slices - 1) * partial_stride);
    if (!scratch)
        return make_error(api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "warpnn: kernel '%s': out of host memory",
                          kname);
    c.scratch_args = scratch;
    int by_rows = c.split_field == twin->first_row_offset;
    c.window_rows = (int64_t*)(void*)(scratch + structs);
    c.partials = by_rows && partial_stride ? scratch + structs + windows : NULL;
    if (!by_rows) c.num_rets = 0;
    int64_t t = profile_start();
    pool_run(cpu_split_launch, &c, slices, workers);
    profile_add(kProfLaunch, t);
    if (c.partials) {
        t = profile_start();
        CpuReduce red = {&c, slices};
        pool_run(cpu_split_reduce, &red, workers, workers);
        profile_add(kProfReduce, t);
    }
    atomic_fetch_add_explicit(&g_threaded_launches, 1, memory_order_relaxed);
    return NULL;
}

/* ------------------------------------------------------------------------------------------------------------
 * The handler: one body, specialised for (CPU|CUDA) x (forward|adjoint)
 */

static XLA_FFI_Error* handle(XLA_FFI_CallFrame* frame, int cuda, int mode) {
    /* XLA's first call asks for the API version and traits through the metadata extension; nothing else in
     * the frame is meaningful then. */
    /* by the type of the field: the struct was renamed (XLA_FFI_Extension_Base -> XLA_FFI_Extension) in newer jaxlib */
    __typeof__(frame->extension_start) ext = frame->extension_start;
    if (ext && ext->type == XLA_FFI_Extension_Metadata) {
        XLA_FFI_Metadata* md = ((XLA_FFI_Metadata_Extension*)ext)->metadata;
        md->api_version.major_version = XLA_FFI_API_MAJOR;
        md->api_version.minor_version = XLA_FFI_API_MINOR;
        /* Zeroing and launches are plain stream work that depends only on attributes and shapes, so XLA may
         * record them into CUDA graphs (command buffers). */
        md->traits = cuda ? XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE : 0;
        return NULL;
    }
    const XLA_FFI_Api* api = frame->api;
    atomic_fetch_add_explicit(&g_entries[mode], 1, memory_order_relaxed);
    int64_t handler_start = cuda ? 0 : profile_start();
    const char* platform = cuda ? "CUDA" : "CPU";

    /* ---- attributes: kernel_id, launch_dims; scalars are read per parameter below */
    int64_t kernel_id = -1;
    int twin_launch = 0; /* 1: the bridge asks for one launch of the batched twin (see _batched.py) */
    const XLA_FFI_Array* dims_attr = NULL;
    const XLA_FFI_Attrs* attrs = &frame->attrs;
    for (int64_t i = 0; i < attrs->size; ++i) {
        const XLA_FFI_ByteSpan* name = attrs->names[i];
        if (span_equals(name, "kernel_id", 9)) {
            int64_t iv = -1;
            double fv;
            int is_float;
            if (attrs->types[i] != XLA_FFI_AttrType_SCALAR ||
                !read_scalar((const XLA_FFI_Scalar*)attrs->attrs[i], &iv, &fv, &is_float) || is_float)
                return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                                  "warpnn native %s handler: attribute 'kernel_id' must be an integer scalar",
                                  kDirection[mode]);
            kernel_id = iv;
        } else if (span_equals(name, "twin_launch", 11)) {
            int64_t iv = 0;
            double fv;
            int is_float;
            if (attrs->types[i] == XLA_FFI_AttrType_SCALAR &&
                read_scalar((const XLA_FFI_Scalar*)attrs->attrs[i], &iv, &fv, &is_float) && !is_float)
                twin_launch = iv != 0;
        } else if (span_equals(name, "launch_dims", 11)) {
            if (attrs->types[i] != XLA_FFI_AttrType_ARRAY)
                return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                                  "warpnn native %s handler: attribute 'launch_dims' must be an int64 array",
                                  kDirection[mode]);
            dims_attr = (const XLA_FFI_Array*)attrs->attrs[i];
        }
    }
    KernelDesc* d = lookup(kernel_id);
    if (!d)
        return make_error(api, XLA_FFI_Error_Code_NOT_FOUND,
                          "warpnn native %s handler: unknown kernel id %lld (no warpnn kernel was registered "
                          "under this id in this process; the call needs a 'kernel_id' attribute from "
                          "warpnn's native launcher)",
                          kDirection[mode], (long long)kernel_id);
    const char* kname = d->name;

    if (!dims_attr || dims_attr->dtype != XLA_FFI_DataType_S64 || dims_attr->size < 1 || dims_attr->size > kMaxDims)
        return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                          "warpnn: kernel '%s' (%s): attribute 'launch_dims' must be an int64 array of 1 to %d "
                          "entries",
                          kname, kDirection[mode], kMaxDims);

    /* ---- device entry: select by platform and, on CUDA, by the device ordinal of this call */
    void* stream = NULL;
    int32_t ordinal = 0;
    if (cuda) {
        if (api->struct_size <= offsetof(XLA_FFI_Api, XLA_FFI_DeviceOrdinal_Get))
            return make_error(api, XLA_FFI_Error_Code_UNIMPLEMENTED,
                              "warpnn: kernel '%s': this XLA does not report device ordinals to FFI handlers",
                              kname);
        XLA_FFI_DeviceOrdinal_Get_Args oa;
        memset(&oa, 0, sizeof(oa));
        oa.struct_size = XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE;
        oa.ctx = frame->ctx;
        XLA_FFI_Error* err = api->XLA_FFI_DeviceOrdinal_Get(&oa);
        if (err) return err;
        ordinal = oa.device_ordinal;
        XLA_FFI_Stream_Get_Args sa;
        memset(&sa, 0, sizeof(sa));
        sa.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
        sa.ctx = frame->ctx;
        err = api->XLA_FFI_Stream_Get(&sa);
        if (err) return err;
        stream = sa.stream;
        if (ordinal < 0 || ordinal >= kMaxCudaDevices)
            return make_error(api, XLA_FFI_Error_Code_OUT_OF_RANGE,
                              "warpnn: kernel '%s' (%s): CUDA device ordinal %d is out of range", kname,
                              kDirection[mode], (int)ordinal);
    }
    _Atomic(DeviceEntry*)* slot_ptr = cuda ? &d->cuda[ordinal] : &d->cpu;
    DeviceEntry* entry = atomic_load_explicit(slot_ptr, memory_order_acquire);
    if (!entry) {
        /* Not loaded for this device at trace time (e.g. a jit placed on a device of another backend): ask
         * Python once to load the Warp module here and register it. */
        resolver_fn resolve = atomic_load(&g_resolver);
        t_resolve_error[0] = 0;
        if (resolve && resolve(d->id, cuda, ordinal) == 0) entry = atomic_load_explicit(slot_ptr, memory_order_acquire);
        if (!entry)
            return make_error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION,
                              "warpnn: kernel '%s' (%s) has no entry point for %s device %d: the Warp module "
                              "could not be loaded there: %s",
                              kname, kDirection[mode], platform, (int)ordinal,
                              t_resolve_error[0] ? t_resolve_error : "(see the Python traceback above, if any)");
    }
    void* fn = mode ? entry->backward : entry->forward;
    if (!fn)
        return make_error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION,
                          "warpnn: kernel '%s' has no compiled %s entry point on %s device %d", kname,
                          mode ? "backward" : "forward", platform, (int)ordinal);

    /* ---- buffers */
    if (frame->args.size != d->num_args[mode] || frame->rets.size != d->num_rets[mode])
        return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                          "warpnn: kernel '%s' (%s) expects %d operands and %d results, got %lld and %lld", kname,
                          kDirection[mode], d->num_args[mode], d->num_rets[mode], (long long)frame->args.size,
                          (long long)frame->rets.size);
    for (int64_t i = 0; i < frame->args.size; ++i)
        if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER)
            return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                              "warpnn: kernel '%s' (%s): operand %lld is not a buffer", kname, kDirection[mode],
                              (long long)i);
    for (int64_t i = 0; i < frame->rets.size; ++i)
        if (frame->rets.types[i] != XLA_FFI_RetType_BUFFER)
            return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                              "warpnn: kernel '%s' (%s): result %lld is not a buffer", kname, kDirection[mode],
                              (long long)i);
    if (d->num_rets[mode] == 0) return NULL; /* nothing to compute */

    /* Every result carries the full vmap batch (expand_dims batching), so result 0 defines the batch shape. */
    const XLA_FFI_Buffer* ret0 = (const XLA_FFI_Buffer*)frame->rets.rets[0];
    const int64_t* ret0_param = d->params + (size_t)d->ret_param[mode][0] * P_NCOLS;
    int64_t batch_rank = ret0->rank - ret0_param[P_JAX_NDIM];
    if (batch_rank < 0 || batch_rank > kMaxBatchRank)
        return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                          "warpnn: kernel '%s' (%s): result 0 has rank %lld, expected %lld plus at most %d batch "
                          "dims",
                          kname, kDirection[mode], (long long)ret0->rank, (long long)ret0_param[P_JAX_NDIM],
                          kMaxBatchRank);
    const int64_t* batch = ret0->dims;
    int64_t num_batch = 1;
    for (int64_t b = 0; b < batch_rank; ++b) num_batch *= batch[b];

    /* ---- launch bounds, as warp's _build_kernel_launch_bounds: dims padded with 1 to the kernel's wp.tid()
     * rank; extra trailing dims fold into coord_mult (threads sharing one coordinate tuple). */
    const int64_t* dims = (const int64_t*)dims_attr->data;
    uint8_t bounds[64];
    memset(bounds, 0, sizeof(bounds));
    uint64_t total = 1, coord_mult = 1;
    for (size_t i = 0; i < dims_attr->size; ++i) {
        if (dims[i] < 0)
            return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                              "warpnn: kernel '%s': launch dims must be non-negative", kname);
        total *= (uint64_t)dims[i];
        if ((int32_t)i >= d->kernel_dim) coord_mult *= (uint64_t)dims[i];
    }
    for (int32_t i = 0; i < d->kernel_dim; ++i) {
        int64_t extent = i < (int32_t)dims_attr->size ? dims[i] : 1;
        if ((d->tid_limit >= 0 && extent > d->tid_limit) || extent > (int64_t)UINT32_MAX)
            return make_error(api, XLA_FFI_Error_Code_OUT_OF_RANGE,
                              "warpnn: kernel '%s': Warp cannot launch a kernel using wp.tid() with extent %lld in "
                              "dimension %d (wp.tid() returns signed 32-bit coordinates)",
                              kname, (long long)extent, (int)i);
        uint32_t e32 = (uint32_t)extent;
        memcpy(bounds + 4 * i, &e32, 4);
    }
    size_t size_field = (size_t)total, mult_field = (size_t)coord_mult;
    memcpy(bounds + d->bounds_size_offset, &size_field, sizeof(size_t));
    memcpy(bounds + d->bounds_coord_mult_offset, &mult_field, sizeof(size_t));

    /* ---- scratch: args struct, adjoint struct, array slots, CUDA parameter pointers */
    int32_t num_slots = d->num_slots[mode];
    /* the row twin for a CPU call without batch, the batched twin otherwise (see _launch_plan.prepare_call) */
    const int want_batched = cuda || num_batch > 1;
    const TwinLayout* twin = twin_launch ? atomic_load_explicit(&d->twin[want_batched], memory_order_acquire) : NULL;
    size_t args_bytes = ((size_t)(twin && twin->args_size > d->args_size ? twin->args_size : d->args_size) + 15u) &
                        ~(size_t)15u;
    size_t need = 2 * args_bytes + sizeof(ArraySlot) * (size_t)num_slots + sizeof(void*) * (size_t)(num_slots + 1);
    uint8_t stack_scratch[kStackScratch] __attribute__((aligned(16)));
    uint8_t* scratch = need <= sizeof(stack_scratch) ? stack_scratch : (uint8_t*)malloc(need);
    if (!scratch)
        return make_error(api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "warpnn: kernel '%s': out of host memory",
                          kname);
    memset(scratch, 0, need); /* zero scalars in adjoint slots and null array_t's come from this */
    uint8_t* args_struct = scratch;
    uint8_t* adj_struct = scratch + args_bytes;
    ArraySlot* arrays = (ArraySlot*)(scratch + 2 * args_bytes);
    void** kernel_params = (void**)(arrays + num_slots);
    int32_t num_arrays = 0, num_kernel_params = 0;
    XLA_FFI_Error* error = NULL;
    /* array slot of each parameter's primal value and adjoint, for P_GRAD_ALIAS (-1: none) */
    int32_t primal_array[kMaxGradAliases], adjoint_array[kMaxGradAliases];
    for (int32_t i = 0; i < kMaxGradAliases; ++i) primal_array[i] = adjoint_array[i] = -1;

#define FAIL(code, ...)                                  \
    do {                                                 \
        error = make_error(api, code, __VA_ARGS__);      \
        goto done;                                       \
    } while (0)

    for (int32_t s = 0; s < num_slots; ++s) {
        const Slot* slot = &d->slots[mode][s];
        const int64_t* p = d->params + (size_t)slot->param * P_NCOLS;
        uint8_t* field = (slot->adjoint ? adj_struct : args_struct) + p[P_OFFSET];
        if (p[P_PARAM_START]) kernel_params[1 + num_kernel_params++] = field;
        if (!p[P_IS_ARRAY]) {
            if (slot->adjoint) continue; /* adjoint of a static scalar: zero */
            const char* aname = d->attr_names[slot->param];
            size_t alen = d->attr_name_lens[slot->param];
            const XLA_FFI_Scalar* value = NULL;
            for (int64_t i = 0; i < attrs->size; ++i)
                if (span_equals(attrs->names[i], aname, alen) && attrs->types[i] == XLA_FFI_AttrType_SCALAR)
                    value = (const XLA_FFI_Scalar*)attrs->attrs[i];
            int64_t iv = 0;
            double fv = 0.0;
            int is_float = 0;
            if (!value || !read_scalar(value, &iv, &fv, &is_float))
                FAIL(XLA_FFI_Error_Code_INVALID_ARGUMENT,
                     "warpnn: kernel '%s' (%s): missing or non-numeric scalar attribute '%s'", kname,
                     kDirection[mode], aname);
            if (!store_scalar(field, p[P_SCALAR_KIND], p[P_FIELD_SIZE], is_float, iv, fv))
                FAIL(XLA_FFI_Error_Code_INTERNAL, "warpnn: kernel '%s': unsupported scalar field for '%s'", kname,
                     aname);
            continue;
        }
        if (slot->source == 0) continue; /* no adjoint for this array (integer dtype): null array_t */
        const XLA_FFI_Buffer* buf = (const XLA_FFI_Buffer*)(slot->source > 0 ? frame->args.args[slot->source - 1]
                                                                              : frame->rets.rets[-slot->source - 1]);
        int64_t jax_ndim = p[P_JAX_NDIM], warp_ndim = p[P_WARP_NDIM];
        int64_t lead = buf->rank - jax_ndim;
        if (lead < 0 || lead > batch_rank)
            FAIL(XLA_FFI_Error_Code_INVALID_ARGUMENT,
                 "warpnn: kernel '%s' (%s): buffer of parameter %d has rank %lld, expected %lld plus at most %lld "
                 "batch dims",
                 kname, kDirection[mode], (int)slot->param, (long long)buf->rank, (long long)jax_ndim,
                 (long long)batch_rank);
        int64_t inner = 1;
        for (int64_t k = lead + warp_ndim; k < buf->rank; ++k) inner *= buf->dims[k];
        if (inner != p[P_INNER_COUNT])
            FAIL(XLA_FFI_Error_Code_INVALID_ARGUMENT,
                 "warpnn: kernel '%s' (%s): buffer of parameter %d has %lld scalars per element, expected %lld",
                 kname, kDirection[mode], (int)slot->param, (long long)inner, (long long)p[P_INNER_COUNT]);
        wp_array_t a;
        memset(&a, 0, sizeof(a));
        a.ndim = (uint16_t)warp_ndim;
        int64_t stride = p[P_SCALAR_BYTES] * p[P_INNER_COUNT];
        for (int64_t k = warp_ndim - 1; k >= 0; --k) {
            int64_t extent = buf->dims[lead + k];
            if (extent > INT32_MAX || stride > INT32_MAX)
                FAIL(XLA_FFI_Error_Code_OUT_OF_RANGE,
                     "warpnn: kernel '%s': parameter %d is too large for a Warp array (shape and byte strides "
                     "are 32-bit)",
                     kname, (int)slot->param);
            a.shape[k] = (int32_t)extent;
            a.strides[k] = (int32_t)stride;
            stride *= extent;
        }
        /* stride now = bytes of one batch element; walk this buffer's batch dims, aligned to the right of the
         * batch shape: a size-1 dim (unbatched, broadcast operand) gets stride 0. */
        if (slot->param < kMaxGradAliases) (slot->adjoint ? adjoint_array : primal_array)[slot->param] = num_arrays;
        ArraySlot* as = &arrays[num_arrays++];
        /* A zero-size array is Warp's null array (wp.zeros(0) has no allocation), so `if arr:` in a kernel is
         * false for it, as for None: XLA may give zero-size buffers a non-null address. */
        as->base = stride ? (uint8_t*)buf->data : NULL;
        as->field = field;
        as->source = slot->source;
        int64_t element_bytes = stride;
        as->grad_from = -1;
        for (int64_t k = batch_rank - 1, own = lead - 1; k >= 0; --k, --own) {
            if (own < 0) {
                as->batch_stride[k] = 0;
                continue;
            }
            int64_t extent = buf->dims[own];
            if (extent == batch[k]) {
                as->batch_stride[k] = extent == 1 ? 0 : stride;
            } else if (extent == 1) {
                as->batch_stride[k] = 0;
            } else {
                FAIL(XLA_FFI_Error_Code_INVALID_ARGUMENT,
                     "warpnn: kernel '%s' (%s): batch dim %lld of parameter %d is %lld, result batch is %lld",
                     kname, kDirection[mode], (long long)k, (int)slot->param, (long long)extent,
                     (long long)batch[k]);
            }
            stride *= extent;
        }
        /* The batch dims flatten to one stride when the buffer is broadcast along all of them, or batched along
         * all of them (strides element_bytes * the batch dims to the right); a mix needs one launch per element. */
        int all_broadcast = 1, all_batched = 1;
        for (int64_t k = batch_rank - 1, right = 1; k >= 0; right *= batch[k], --k) {
            if (batch[k] == 1) continue;
            if (as->batch_stride[k] != 0) all_broadcast = 0;
            if (as->batch_stride[k] != element_bytes * right) all_batched = 0;
        }
        as->flat_stride = all_broadcast ? 0 : all_batched ? element_bytes : -1;
        memcpy(field, &a, sizeof(a));
    }
    kernel_params[0] = bounds;
    if (mode == 1)
        for (int32_t i = 0; i < d->num_params; ++i) {
            const int64_t* p = d->params + (size_t)i * P_NCOLS;
            if (!p[P_IS_ARRAY] || !p[P_GRAD_ALIAS]) continue;
            if (i >= kMaxGradAliases || primal_array[i] < 0 || adjoint_array[i] < 0)
                FAIL(XLA_FFI_Error_Code_INTERNAL, "warpnn: kernel '%s': no buffers for the carried adjoint of "
                     "parameter %d", kname, (int)i);
            arrays[primal_array[i]].grad_from = adjoint_array[i];
            if (p[P_PRESET] & 4) {
                /* An output whose primal values the adjoint never touches (its slot holds some other buffer of its
                 * shape): address it as its grad buffer, so that both are batched alike (a broadcast buffer in
                 * the slot would otherwise keep the twin from addressing the grad through the primal's strides). */
                ArraySlot* primal = &arrays[primal_array[i]];
                const ArraySlot* grad = &arrays[adjoint_array[i]];
                primal->base = grad->base;
                memcpy(primal->batch_stride, grad->batch_stride, sizeof(primal->batch_stride));
                primal->flat_stride = grad->flat_stride;
            }
        }

    /* ---- the driver path, when this thread's context is the kernel's and the launch fits one grid */
    const DriverApi* driver = NULL;
    uint64_t grid = entry->block_dim > 0 ? (total + (uint64_t)entry->block_dim - 1) / (uint64_t)entry->block_dim : 0;
    if (cuda && entry->cluster_dim <= 1 && entry->block_dim > 0 && grid <= (uint64_t)INT32_MAX) {
        driver = atomic_load(&g_driver);
        void* current = NULL;
        if (driver && (driver->ctx_get_current(&current) != 0 || current != entry->context)) driver = NULL;
    }

    /* ---- zero the results on the stream: outputs accumulate (wp.atomic_add), and so do input adjoints */
    int64_t zero_start = cuda ? 0 : profile_start();
    for (int32_t r = 0; r < d->num_rets[mode]; ++r) {
        const XLA_FFI_Buffer* buf = (const XLA_FFI_Buffer*)frame->rets.rets[r];
        const int64_t* p = d->params + (size_t)d->ret_param[mode][r] * P_NCOLS;
        size_t nbytes = (size_t)p[P_SCALAR_BYTES];
        for (int64_t k = 0; k < buf->rank; ++k) nbytes *= (size_t)buf->dims[k];
        if (!nbytes || !buf->data) continue;
        if (p[P_PRESET] & (1 << mode)) continue; /* starts as an operand's values */
        if (mode == 0 && p[P_FULLY_WRITTEN] && p[P_WARP_NDIM] == (int64_t)dims_attr->size) {
            const int64_t* launch = (const int64_t*)dims_attr->data;
            int64_t lead = buf->rank - p[P_JAX_NDIM], same = 1;
            for (int64_t k = 0; k < p[P_WARP_NDIM]; ++k) same &= buf->dims[lead + k] == launch[k];
            if (same) continue;
        }
        if (driver) {
            uintptr_t dest = (uintptr_t)buf->data;
            int rc = (dest % 4 == 0 && nbytes % 4 == 0) ? driver->memset_d32_async(dest, 0, nbytes / 4, stream)
                                                        : driver->memset_d8_async(dest, 0, nbytes, stream);
            if (rc != 0)
                FAIL(XLA_FFI_Error_Code_INTERNAL, "warpnn: kernel '%s' (%s): zeroing result %d on CUDA device %d "
                     "failed: %s", kname, kDirection[mode], (int)r, (int)ordinal, driver_error(driver, rc));
        } else if (cuda) {
            memset_device_fn memset_device = atomic_load(&g_memset_device);
            if (!memset_device || !memset_device(entry->context, buf->data, 0, nbytes, stream)) {
                error_string_fn es = atomic_load(&g_error_string);
                FAIL(XLA_FFI_Error_Code_INTERNAL, "warpnn: kernel '%s' (%s): zeroing result %d on CUDA device %d "
                     "failed: %s", kname, kDirection[mode], (int)r, (int)ordinal, es ? es() : "?");
            }
        } else {
            memset(buf->data, 0, nbytes);
        }
    }
    profile_add(kProfZero, zero_start);
    if (total == 0) goto done;

    /* ---- one launch of the batched twin for the whole batch; on the CPU, maybe cut into slices on several threads */
    if (twin_launch && twin && (int32_t)dims_attr->size <= d->kernel_dim && num_batch <= INT32_MAX &&
        (twin->tid_limit < 0 || num_batch <= twin->tid_limit)) {
        DeviceEntry* te = atomic_load_explicit(cuda ? &d->twin_cuda[want_batched][ordinal] : &d->twin_cpu[want_batched],
                                               memory_order_acquire);
        void* tfn = te ? (mode ? te->backward : te->forward) : NULL;
        int flat = tfn != NULL && (!cuda || te->context == entry->context);
        for (int32_t k = 0; flat && k < num_arrays; ++k)
            flat = arrays[k].flat_stride >= 0 && (uint64_t)arrays[k].flat_stride * (uint64_t)num_batch <= INT32_MAX &&
                   /* a grad alias is addressed with its primal's strides: the same batch stride, or the loop */
                   (arrays[k].grad_from < 0 || arrays[arrays[k].grad_from].flat_stride == arrays[k].flat_stride);
        if (flat) {
            if (!cuda) cpu_launch_lock(frame); /* also guards the thread pool and its scratch */
            error = launch_twin(api, d, twin, te, tfn, mode, cuda, ordinal, stream, driver, dims_attr, num_batch,
                                frame, args_struct, adj_struct, args_bytes, arrays, num_arrays);
            if (!cuda) cpu_launch_unlock();
            goto done;
        }
    }

    /* ---- one launch per batch element */
    int64_t index[kMaxBatchRank];
    memset(index, 0, sizeof(index));
    error_string_fn take_block_error = cuda ? NULL : atomic_load(&g_take_cpu_block_error);
    int cpu_blocks = !cuda && entry->block_dim > 1 && take_block_error;
    cuda_launch_fn launch = cuda ? atomic_load(&g_cuda_launch) : NULL;
    if (cuda && !launch)
        FAIL(XLA_FFI_Error_Code_FAILED_PRECONDITION, "warpnn: kernel '%s': Warp's CUDA launcher is not set", kname);
    if (!cuda) cpu_launch_lock(frame);
    if (!cuda && !cpu_blocks && num_batch > 1 && !atomic_load(&d->cpu_serial)) { /* the batch's elements on the CPU threads */
        int threads = atomic_load(&g_cpu_threads);
        uint64_t by_work = total * (uint64_t)num_batch / (uint64_t)min_work_per_worker(mode);
        int workers = threads;
        if ((uint64_t)workers > by_work) workers = (int)(by_work < 1 ? 1 : by_work);
        if (workers > num_batch) workers = (int)num_batch;
        uint8_t* scratch = workers > 1 ? cpu_scratch((size_t)workers * 2 * args_bytes) : NULL;
        if (scratch) {
            CpuLoop loop = {fn, mode, bounds, args_struct, args_bytes, arrays, num_arrays, batch, batch_rank,
                            num_batch, scratch};
            pool_run(cpu_loop_slice, &loop, workers, workers);
            atomic_fetch_add_explicit(&g_launches[mode], num_batch, memory_order_relaxed);
            atomic_fetch_add_explicit(&g_threaded_launches, 1, memory_order_relaxed);
            num_batch = 0; /* done: skip the loop below */
        }
    }
    for (int64_t b = 0; b < num_batch; ++b) {
        for (int32_t k = 0; k < num_arrays; ++k) {
            ArraySlot* as = &arrays[k];
            int64_t offset = 0;
            for (int64_t j = 0; j < batch_rank; ++j) offset += index[j] * as->batch_stride[j];
            uint64_t data = as->base ? (uint64_t)(uintptr_t)(as->base + offset) : 0;
            memcpy(as->field + offsetof(wp_array_t, data), &data, sizeof(data));
        }
        for (int32_t k = 0; k < num_arrays; ++k) /* after every data pointer of this batch element is set */
            if (arrays[k].grad_from >= 0)
                memcpy(arrays[k].field + offsetof(wp_array_t, grad),
                       arrays[arrays[k].grad_from].field + offsetof(wp_array_t, data), sizeof(uint64_t));
        if (driver) {
            /* Warp's launcher with max_blocks = 0 does the same: ceil(total / block_dim) blocks of block_dim
             * threads (a grid-stride kernel then runs its loop once) */
            int rc = driver->launch_kernel(fn, (unsigned)grid, 1, 1, (unsigned)entry->block_dim, 1, 1,
                                           (unsigned)(mode ? entry->backward_smem : entry->forward_smem), stream,
                                           kernel_params, NULL);
            if (rc != 0)
                FAIL(XLA_FFI_Error_Code_INTERNAL, "warpnn: CUDA launch of %s kernel '%s' on device %d failed: %s",
                     kDirection[mode], kname, (int)ordinal, driver_error(driver, rc));
            atomic_fetch_add_explicit(&g_driver_launches, 1, memory_order_relaxed);
        } else if (cuda) {
            size_t failed = launch(entry->context, fn, (size_t)total, 0, entry->block_dim, entry->grid_stride,
                                   entry->cluster_dim, mode ? entry->backward_smem : entry->forward_smem,
                                   kernel_params, stream, NULL);
            if (failed) {
                error_string_fn es = atomic_load(&g_error_string);
                FAIL(XLA_FFI_Error_Code_INTERNAL, "warpnn: CUDA launch of %s kernel '%s' on device %d failed: %s",
                     kDirection[mode], kname, (int)ordinal, es ? es() : "?");
            }
        } else {
            if (cpu_blocks) take_block_error(); /* clear a stale error */
            if (mode)
                ((cpu_backward_fn)fn)(bounds, args_struct, adj_struct);
            else
                ((cpu_forward_fn)fn)(bounds, args_struct);
            if (cpu_blocks) {
                const char* message = take_block_error();
                if (message) {
                    error = make_error(api, XLA_FFI_Error_Code_INTERNAL,
                                       "warpnn: error launching kernel '%s' on device 'cpu': %s", kname, message);
                    break;
                }
            }
        }
        atomic_fetch_add_explicit(&g_launches[mode], 1, memory_order_relaxed);
        for (int64_t j = batch_rank - 1; j >= 0; --j) { /* next batch index, last dim fastest */
            if (++index[j] < batch[j]) break;
            index[j] = 0;
        }
    }
    if (!cuda) cpu_launch_unlock();

done:
#undef FAIL
    if (scratch != stack_scratch) free(scratch);
    if (handler_start) {
        atomic_fetch_add_explicit(&g_profile[kProfCalls], 1, memory_order_relaxed);
        profile_add(kProfHandler, handler_start);
    }
    return error;
}

WARPNN_EXPORT XLA_FFI_Error* warpnn_cpu_forward(XLA_FFI_CallFrame* frame) { return handle(frame, 0, 0); }
WARPNN_EXPORT XLA_FFI_Error* warpnn_cpu_adjoint(XLA_FFI_CallFrame* frame) { return handle(frame, 0, 1); }
WARPNN_EXPORT XLA_FFI_Error* warpnn_cuda_forward(XLA_FFI_CallFrame* frame) { return handle(frame, 1, 0); }
WARPNN_EXPORT XLA_FFI_Error* warpnn_cuda_adjoint(XLA_FFI_CallFrame* frame) { return handle(frame, 1, 1); }
