/* The CPU kernels of pflcore._core as a table of plain C functions (ABI version 1).
 *
 * For native code outside pflcore that wants the kernels without Python in the call: the JAX
 * FFI shim (pflcore/jax/ffi.cpp) is the first user. Get the table from Python with
 * `pflcore._core.kernel_table()`, a PyCapsule named "pflcore_kernel_table" whose pointer is a
 * `const pflcore_kernel_table*`; it lives as long as the process (extension modules are never
 * unloaded). Check `abi_version` before use; later versions only append fields, and `size`
 * says how many bytes the table has.
 *
 * Every function is thread-safe, takes raw addresses of C-contiguous CPU buffers and does not
 * touch Python. The caller has checked that the buffers have the sizes given (the functions
 * cannot); what the kernels find wrong in the VALUES (indices, labels, NaN/inf; see
 * csrc/include/pflcore/checks.h) is returned as a status and a one-line message naming the
 * argument, written into `err` (err_size bytes, NUL-terminated; may be NULL). A row that hits
 * a bad value is left as it was, the other rows are computed.
 *
 * Integer arrays are int64 unless said otherwise; float buffers are all float64 when the
 * call's f64 is 1, else all float32.
 */
#ifndef PFLCORE_KERNELS_H_
#define PFLCORE_KERNELS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PFLCORE_KERNELS_ABI 1
#define PFLCORE_KERNEL_TABLE_CAPSULE "pflcore_kernel_table"

enum pflcore_status {
  PFLCORE_OK = 0,
  PFLCORE_BAD_VALUE = 1,  /* a value in an argument (index, label): Python's ValueError */
  PFLCORE_NON_FINITE = 2, /* NaN or inf in an argument: pflcore.errors.NonFiniteError */
  PFLCORE_BAD_CALL = 3    /* the call itself (a null buffer, a negative size): a caller's bug */
};

/* A GLM on a federation's data (DESIGN.md §2, §3): what local_steps, gradients and evaluate share. */
typedef struct pflcore_glm {
  int32_t f64;            /* 1: float64 buffers, 0: float32 */
  int32_t family;         /* 0 least squares, 1 logistic, 2 softmax */
  int64_t p;              /* features */
  int64_t C;              /* outputs (1 unless softmax) */
  int32_t intercept;      /* 1: parameter row p multiplies an implicit 1; d = (p + intercept)·C */
  int32_t check_batches;  /* 0: the batch indices were drawn by a trusted caller, skip their range checks */
  double l2;              /* l2/2·‖θ‖² in every client objective */
  const void* x;          /* [N, p] */
  int64_t N;
  const void* y;          /* [N]: float targets (least squares), int64 labels otherwise */
  const int64_t* offsets; /* [m + 1]: client i owns rows offsets[i]..offsets[i+1]-1 */
  int64_t m;              /* clients, >= 1 */
  const int64_t* rows;    /* [R] client of each model row, or NULL: row r is client r (R = m) */
  int64_t R;              /* model rows */
} pflcore_glm;

/* theta [R, d] <- `steps` fused gradient steps per model row, in place (pflcore.ops.local_steps).
 * batches: int32 [R, steps, B] absolute row indices or NULL (full batch); anchor: [R, d], [d]
 * (anchor_shared = 1) or NULL; grad_scale: [R] or NULL. */
typedef int (*pflcore_local_steps_fn)(const pflcore_glm* glm, void* theta, const int32_t* batches, int64_t B,
                                      const void* anchor, int32_t anchor_shared, const void* grad_scale,
                                      int64_t steps, double lr, double prox, char* err, size_t err_size);

/* out [R, d] <- the gradient of each row's client objective at theta [R, d], or at theta [d]
 * for every row (theta_shared = 1) (pflcore.ops.gradients). batches: int32 [R, B] or NULL. */
typedef int (*pflcore_gradients_fn)(const pflcore_glm* glm, const void* theta, int32_t theta_shared,
                                    const int32_t* batches, int64_t B, void* out, char* err, size_t err_size);

/* loss_sum [R] (float), correct [R], count [R] of each model row on its client's rows, or on
 * batches [R, B] (pflcore.ops.evaluate). */
typedef int (*pflcore_evaluate_fn)(const pflcore_glm* glm, const void* theta, int32_t theta_shared,
                                   const int32_t* batches, int64_t B, void* loss_sum, int64_t* correct,
                                   int64_t* count, char* err, size_t err_size);

/* labels [N], sqdist [N] <- the nearest of centroids [K, d] to each of points [N, d]
 * (pflcore.ops.kmeans_assign). */
typedef int (*pflcore_kmeans_assign_fn)(int32_t f64, const void* points, int64_t N, int64_t d,
                                        const void* centroids, int64_t K, int64_t* labels, void* sqdist,
                                        char* err, size_t err_size);

typedef struct pflcore_kernel_table {
  uint32_t abi_version; /* PFLCORE_KERNELS_ABI of the module that made the table */
  uint32_t size;        /* sizeof(pflcore_kernel_table) there */
  const char* version;  /* pflcore's version */
  pflcore_local_steps_fn local_steps;
  pflcore_gradients_fn gradients;
  pflcore_evaluate_fn evaluate;
  pflcore_kmeans_assign_fn kmeans_assign;
} pflcore_kernel_table;

#ifdef __cplusplus
}
#endif

#endif /* PFLCORE_KERNELS_H_ */
