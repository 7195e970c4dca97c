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
 * XLA stream, and launch Warp's kernel once per vmap batch element with per-argument pointer offsets.
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

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

#define WARPNN_EXPORT __attribute__((visibility("default")))

/* Bumped whenever the registration interface below changes; Python refuses a library with another value. */
#define WARPNN_ABI_VERSION 3
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
                        (XLA aliases them: in-out arrays, carried adjoints) and is never zeroed */
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
} KernelDesc;

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
    int32_t grad_from;                 /* >= 0: copy that array slot's data pointer into this one's grad */
} ArraySlot;

static const char* const kDirection[2] = {"forward", "adjoint"};

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
    const char* platform = cuda ? "CUDA" : "CPU";

    /* ---- attributes: kernel_id, launch_dims; scalars are read per parameter below */
    int64_t kernel_id = -1;
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
    size_t args_bytes = ((size_t)d->args_size + 15u) & ~(size_t)15u;
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
    if (total == 0) goto done;

    /* ---- one launch per batch element */
    int64_t index[kMaxBatchRank];
    memset(index, 0, sizeof(index));
    error_string_fn take_block_error = cuda ? NULL : atomic_load(&g_take_cpu_block_error);
    int cpu_blocks = !cuda && entry->block_dim > 1 && take_block_error;
    cuda_launch_fn launch = cuda ? atomic_load(&g_cuda_launch) : NULL;
    if (cuda && !launch)
        FAIL(XLA_FFI_Error_Code_FAILED_PRECONDITION, "warpnn: kernel '%s': Warp's CUDA launcher is not set", kname);
    if (!cuda) pthread_mutex_lock(&g_cpu_launch_lock);
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
        for (int64_t j = batch_rank - 1; j >= 0; --j) { /* next batch index, last dim fastest */
            if (++index[j] < batch[j]) break;
            index[j] = 0;
        }
    }
    if (!cuda) pthread_mutex_unlock(&g_cpu_launch_lock);

done:
#undef FAIL
    if (scratch != stack_scratch) free(scratch);
    return error;
}

WARPNN_EXPORT XLA_FFI_Error* warpnn_cpu_forward(XLA_FFI_CallFrame* frame) { return handle(frame, 0, 0); }
WARPNN_EXPORT XLA_FFI_Error* warpnn_cpu_adjoint(XLA_FFI_CallFrame* frame) { return handle(frame, 0, 1); }
WARPNN_EXPORT XLA_FFI_Error* warpnn_cuda_forward(XLA_FFI_CallFrame* frame) { return handle(frame, 1, 0); }
WARPNN_EXPORT XLA_FFI_Error* warpnn_cuda_adjoint(XLA_FFI_CallFrame* frame) { return handle(frame, 1, 1); }
