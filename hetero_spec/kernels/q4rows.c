/* hetero_spec's block kernel for 4-bit weights: an ONNX Runtime custom operator, hetero_spec.Q4Rows.
 *
 *   Y[M, N] = X[M, K] @ dequant(W)^T, W: 4-bit weights in blocks of B along K, a float scale per (column, block),
 *   zero point 8 (ONNX Runtime's MatMulNBits without zero_points; hetero_spec/kernels/__init__.py repacks them).
 *
 * MatMulNBits' int8-compute kernel takes the rows two at a time, each pair sweeping all the weights, so a block of
 * M tokens unpacks them M / 2 times. Here each 64-byte chunk of weights is unpacked once and multiplied into up to 8
 * rows: 16 output columns per AVX-512 lane group, the activations quantized to int8 per (row, block) and broadcast
 * 4 bytes at a time into VPDPBUSD. A pass of 8 rows costs little more than one row's weight read.
 *
 * Weights W [N/16, K/B, B/8, 64] uint8: byte 4i+t of chunk j of a block holds column i's k = 8j+t in its low nibble
 * and k = 8j+4+t in its high nibble. Scales S [N/16, K/B, 16] float.
 *
 * The ONNX Runtime C API is used through the few entries below, declared here by their index in its OrtApi table
 * (the table only ever grows at its end; onnxruntime_c_api.h); hetero_spec/kernels builds this file
 * with the system C compiler on first use. Needs AVX-512 F/BW/DQ/VL and VNNI. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtTensorTypeAndShapeInfo OrtShapeInfo;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef void* const* OrtApiTable;
typedef struct { OrtApiTable (*GetApi)(uint32_t version); const char* (*GetVersionString)(void); } OrtApiBase;

enum {  /* OrtApi entries (index in the table) */
  API_CreateStatus = 0, API_CreateCustomOpDomain = 26, API_CustomOpDomain_Add = 27, API_AddCustomOpDomain = 28,
  API_GetTensorMutableData = 51, API_GetDimensionsCount = 61, API_GetDimensions = 62, API_GetTensorTypeAndShape = 65,
  API_KernelInfoGetAttribute_int64 = 86, API_KernelContext_GetInput = 90, API_KernelContext_GetOutput = 91,
  API_ReleaseTensorTypeAndShapeInfo = 99, API_KernelContext_ParallelFor = 274,
};
#define API_VERSION 17 /* ONNX Runtime 1.17: the first with KernelContext_ParallelFor */
enum { ORT_INVALID_ARGUMENT = 2, ORT_FAIL = 1 };
enum { TYPE_FLOAT = 1, TYPE_UINT8 = 2 };

static OrtApiTable api;
#define CALL(name, type) ((type)api[API_##name])

typedef struct {  /* OrtCustomOp, onnxruntime_c_api.h, as far as version 16 */
  uint32_t version;
  void* (*CreateKernel)(const void* op, const void* api, const OrtKernelInfo* info);
  const char* (*GetName)(const void* op);
  const char* (*GetExecutionProviderType)(const void* op);
  int (*GetInputType)(const void* op, size_t index);
  size_t (*GetInputTypeCount)(const void* op);
  int (*GetOutputType)(const void* op, size_t index);
  size_t (*GetOutputTypeCount)(const void* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const void* op, size_t index);
  int (*GetOutputCharacteristic)(const void* op, size_t index);
  int (*GetInputMemoryType)(const void* op, size_t index);
  int (*GetVariadicInputMinArity)(const void* op);
  int (*GetVariadicInputHomogeneity)(const void* op);
  int (*GetVariadicOutputMinArity)(const void* op);
  int (*GetVariadicOutputHomogeneity)(const void* op);
  OrtStatus* (*CreateKernelV2)(const void* op, const void* api, const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
} CustomOp;

/* ---- the kernel ---- */

#define MR 8            /* rows per weight sweep */
#define TASK_GROUPS 8   /* 16-column groups per parallel task */
#define PREFETCH 4096   /* bytes of weights ahead */

/* x [M, K] -> q int8 (per (row, block): scale max|x| / 127), the scales sa and the sums of q (zero point 8) */
static void quantize_rows(const float* x, int M, int K, int blk, int8_t* q, float* sa, int32_t* asum) {
  int nb = K / blk;
  for (int m = 0; m < M; m++) for (int b = 0; b < nb; b++) {
    const float* xs = x + (size_t)m * K + (size_t)b * blk;
    __m512 mx = _mm512_setzero_ps();
    for (int i = 0; i < blk; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xs + i)));
    float amax = _mm512_reduce_max_ps(mx);
    __m512 inv = _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f);
    int8_t* qd = q + (size_t)m * K + (size_t)b * blk;
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < blk; i += 16) {
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs + i), inv));
      sum = _mm512_add_epi32(sum, v);
      _mm_storeu_si128((__m128i*)(qd + i), _mm512_cvtsepi32_epi8(v));
    }
    sa[(size_t)m * nb + b] = amax / 127.f;
    asum[(size_t)m * nb + b] = _mm512_reduce_add_epi32(sum);
  }
}

/* rows [0, R) of one 16-column group g */
static inline __attribute__((always_inline)) void group(const int8_t* q, const float* sa, const int32_t* asum,
    const int R, int K, int blk, const uint8_t* W, const float* S, float* y, int N, int g) {
  int nb = K / blk, chunks = blk / 8;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 f[MR];
  for (int m = 0; m < R; m++) f[m] = _mm512_setzero_ps();
  const uint8_t* w = W + (size_t)g * nb * chunks * 64;
  for (int b = 0; b < nb; b++) {
    __m512 sw = _mm512_loadu_ps(S + ((size_t)g * nb + b) * 16);
    __m512i acc[MR];
    for (int m = 0; m < R; m++) acc[m] = _mm512_set1_epi32(-8 * asum[(size_t)m * nb + b]);
    const int32_t* qa = (const int32_t*)(q + (size_t)b * blk);
    for (int j = 0; j < chunks; j++, w += 64) {
      __m512i p = _mm512_loadu_si512(w);
      _mm_prefetch((const char*)w + PREFETCH, _MM_HINT_T0);
      __m512i lo = _mm512_and_si512(p, mask), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), mask);
      for (int m = 0; m < R; m++) {
        const int32_t* qm = qa + (size_t)m * (K / 4) + 2 * j;
        acc[m] = _mm512_dpbusd_epi32(acc[m], lo, _mm512_set1_epi32(qm[0]));
        acc[m] = _mm512_dpbusd_epi32(acc[m], hi, _mm512_set1_epi32(qm[1]));
      }
    }
    for (int m = 0; m < R; m++)
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_mul_ps(sw, _mm512_set1_ps(sa[(size_t)m * nb + b])), f[m]);
  }
  for (int m = 0; m < R; m++) _mm512_storeu_ps(y + (size_t)m * N + (size_t)g * 16, f[m]);
}

typedef struct { const int8_t* q; const float* sa; const int32_t* asum; int M, K, N, blk, groups;
                 const uint8_t* W; const float* S; float* y; } Job;

static void run_task(void* data, size_t task) {
  const Job* j = (const Job*)data;
  int g0 = (int)task * TASK_GROUPS, g1 = g0 + TASK_GROUPS < j->groups ? g0 + TASK_GROUPS : j->groups;
  int nb = j->K / j->blk;
  for (int m0 = 0; m0 < j->M; m0 += MR) {
    int rows = j->M - m0 < MR ? j->M - m0 : MR;
    const int8_t* q = j->q + (size_t)m0 * j->K;
    const float* sa = j->sa + (size_t)m0 * nb;
    const int32_t* asum = j->asum + (size_t)m0 * nb;
    float* y = j->y + (size_t)m0 * j->N;
    for (int g = g0; g < g1; g++) switch (rows) {
#define ROWS(R) case R: group(q, sa, asum, R, j->K, j->blk, j->W, j->S, y, j->N, g); break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
    }
  }
}

/* the plain-C entry for tests and benchmarks (ctypes): one thread */
int q4rows_matmul(const float* x, int M, int K, int N, int blk, const uint8_t* W, const float* S, float* y) {
  if (M <= 0 || K % blk || blk % 16 || N % 16) return -1;
  int nb = K / blk;
  int8_t* q = aligned_alloc(64, ((size_t)M * K + 63) / 64 * 64);
  float* sa = malloc(sizeof(float) * M * nb);
  int32_t* asum = malloc(sizeof(int32_t) * M * nb);
  if (!q || !sa || !asum) { free(q); free(sa); free(asum); return -2; }
  quantize_rows(x, M, K, blk, q, sa, asum);
  Job job = {q, sa, asum, M, K, N, blk, N / 16, W, S, y};
  for (size_t t = 0; t < (size_t)(N / 16 + TASK_GROUPS - 1) / TASK_GROUPS; t++) run_task(&job, t);
  free(q); free(sa); free(asum);
  return 0;
}

/* ---- the custom operator ---- */

typedef struct { int64_t K, N, blk; } Kernel;

static OrtStatus* fail(const char* msg) { return CALL(CreateStatus, OrtStatus* (*)(int, const char*))(ORT_INVALID_ARGUMENT, msg); }

static OrtStatus* create_kernel(const void* op, const void* unused, const OrtKernelInfo* info, void** out) {
  (void)op; (void)unused;
  Kernel* k = calloc(1, sizeof(Kernel));
  if (!k) return fail("hetero_spec.Q4Rows: out of memory");
  OrtStatus* (*attr)(const OrtKernelInfo*, const char*, int64_t*) = CALL(KernelInfoGetAttribute_int64,
      OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*));
  OrtStatus* st;
  if ((st = attr(info, "K", &k->K)) || (st = attr(info, "N", &k->N)) || (st = attr(info, "block_size", &k->blk))) {
    free(k); return st;
  }
  if (k->blk <= 0 || k->blk % 16 || k->K % k->blk || k->N % 16 || k->N <= 0) {
    free(k); return fail("hetero_spec.Q4Rows: needs block_size a multiple of 16 dividing K, and N a multiple of 16");
  }
  *out = k;
  return NULL;
}

static OrtStatus* shape_of(const OrtValue* v, int64_t* dims, size_t* rank) {
  OrtShapeInfo* info; OrtStatus* st;
  if ((st = CALL(GetTensorTypeAndShape, OrtStatus* (*)(const OrtValue*, OrtShapeInfo**))(v, &info))) return st;
  st = CALL(GetDimensionsCount, OrtStatus* (*)(const OrtShapeInfo*, size_t*))(info, rank);
  if (!st && *rank > 8) st = fail("hetero_spec.Q4Rows: input of rank over 8");
  if (!st) st = CALL(GetDimensions, OrtStatus* (*)(const OrtShapeInfo*, int64_t*, size_t))(info, dims, *rank);
  CALL(ReleaseTensorTypeAndShapeInfo, void (*)(OrtShapeInfo*))(info);
  return st;
}

static OrtStatus* compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  OrtStatus* (*input)(const OrtKernelContext*, size_t, const OrtValue**) = CALL(KernelContext_GetInput,
      OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**));
  OrtStatus* (*data)(OrtValue*, void**) = CALL(GetTensorMutableData, OrtStatus* (*)(OrtValue*, void**));
  const OrtValue *X, *W, *S; OrtStatus* st;
  if ((st = input(ctx, 0, &X)) || (st = input(ctx, 1, &W)) || (st = input(ctx, 2, &S))) return st;
  int64_t dims[8]; size_t rank;
  if ((st = shape_of(X, dims, &rank))) return st;
  if (rank < 1 || dims[rank - 1] != k->K) return fail("hetero_spec.Q4Rows: the input's last dimension is not K");
  int64_t M = 1;
  for (size_t i = 0; i + 1 < rank; i++) M *= dims[i];
  dims[rank - 1] = k->N;
  OrtValue* Y;
  if ((st = CALL(KernelContext_GetOutput, OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**))(
          ctx, 0, dims, rank, &Y))) return st;
  float *x, *s, *y; uint8_t* w;
  if ((st = data((OrtValue*)X, (void**)&x)) || (st = data((OrtValue*)W, (void**)&w)) ||
      (st = data((OrtValue*)S, (void**)&s)) || (st = data(Y, (void**)&y))) return st;
  if (M == 0) return NULL;
  int nb = (int)(k->K / k->blk);
  int8_t* q = aligned_alloc(64, ((size_t)M * k->K + 63) / 64 * 64);
  float* sa = malloc(sizeof(float) * M * nb);
  int32_t* asum = malloc(sizeof(int32_t) * M * nb);
  if (!q || !sa || !asum) { free(q); free(sa); free(asum); return fail("hetero_spec.Q4Rows: out of memory"); }
  quantize_rows(x, (int)M, (int)k->K, (int)k->blk, q, sa, asum);
  Job job = {q, sa, asum, (int)M, (int)k->K, (int)k->N, (int)k->blk, (int)(k->N / 16), w, s, y};
  size_t tasks = (size_t)(job.groups + TASK_GROUPS - 1) / TASK_GROUPS;
  st = CALL(KernelContext_ParallelFor, OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t,
                                                      void*))(ctx, run_task, tasks, 0, &job);
  free(q); free(sa); free(asum);
  return st;
}

static void destroy(void* kernel) { free(kernel); }
static const char* op_name(const void* op) { (void)op; return "Q4Rows"; }
static const char* op_provider(const void* op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const void* op, size_t i) { (void)op; return i == 1 ? TYPE_UINT8 : TYPE_FLOAT; }
static size_t input_count(const void* op) { (void)op; return 3; }
static int output_type(const void* op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static size_t output_count(const void* op) { (void)op; return 1; }
static int required(const void* op, size_t i) { (void)op; (void)i; return 0; }
static int memory_default(const void* op, size_t i) { (void)op; (void)i; return 0; }
static int one(const void* op) { (void)op; return 1; }

static CustomOp q4rows_op = {
  16, NULL, op_name, op_provider, input_type, input_count, output_type, output_count, NULL, destroy,
  required, required, memory_default, one, one, one, one, create_kernel, compute,
};

/* ONNX Runtime calls this on SessionOptions.register_custom_ops_library */
OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  api = base->GetApi(API_VERSION);
  if (!api) return NULL;  /* an ONNX Runtime older than 1.17: the graph then fails to load, naming the operator */
  OrtCustomOpDomain* domain; OrtStatus* st;
  if ((st = CALL(CreateCustomOpDomain, OrtStatus* (*)(const char*, OrtCustomOpDomain**))("hetero_spec", &domain))) return st;
  if ((st = CALL(CustomOpDomain_Add, OrtStatus* (*)(OrtCustomOpDomain*, const void*))(domain, &q4rows_op))) return st;
  return CALL(AddCustomOpDomain, OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*))(options, domain);
}
