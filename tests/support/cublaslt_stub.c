/* A stand-in for libcublasLt with the C signatures kernels/cublaslt.py binds: it records what it is given
 * (tests/kernels/test_cublaslt.py reads `seen` and the descriptor's attributes back) and answers as cuBLASLt
 * would for a few algorithms. It computes nothing. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { uint64_t data[8]; } algo_t;
typedef struct { algo_t algo; size_t workspace; int state; float waves; int reserved[4]; } heuristic_t;
enum { OK = 0, INVALID_VALUE = 7, NOT_SUPPORTED = 15 };

int64_t seen[32];       /* 0-1 desc types, 2-13 layouts A/B/C, 14 workspace limit, 16-25 the matmul's arguments */
int64_t desc_attr[64];  /* the descriptor's attributes, by number */
int desc_attr_size[64];

static int desc_size(int attr) {  /* cublasLt.h's widths for the attributes the binding sets */
    switch (attr) {
        case 3: case 4: case 31: case 32: return 4;  /* transa, transb, A/B scale modes */
        case 25: return 1;                          /* fast accumulation: int8 */
        case 17: case 18: return 8;                 /* scale pointers */
        default: return -1;
    }
}
/* configuration attributes 0-7 kept in the algorithm's 8 words (the inner shape a uint16); 8, the cluster shape,
 * is one this stand-in does not keep, as an older cuBLASLt would not */
static int config_size(int attr) { return attr == 7 ? 2 : 4; }

size_t cublasLtGetVersion(void) { return 130100; }
int cublasLtCreate(void **handle) { *handle = (void *)0x1234; return OK; }
int cublasLtMatmulDescCreate(void **desc, int compute, int scale) {
    seen[0] = compute; seen[1] = scale; *desc = malloc(8); return OK;
}
int cublasLtMatmulDescDestroy(void *desc) { free(desc); return OK; }
int cublasLtMatmulDescSetAttribute(void *desc, int attr, const void *buf, size_t size) {
    if (attr < 0 || attr >= 64 || (int)size != desc_size(attr)) return INVALID_VALUE;
    int64_t v = 0; memcpy(&v, buf, size); desc_attr[attr] = v; desc_attr_size[attr] = (int)size; return OK;
}
int cublasLtMatrixLayoutCreate(void **layout, int type, uint64_t rows, uint64_t cols, int64_t ld) {
    int64_t *l = malloc(4 * sizeof(int64_t)); l[0] = type; l[1] = (int64_t)rows; l[2] = (int64_t)cols; l[3] = ld;
    *layout = l; return OK;
}
int cublasLtMatrixLayoutDestroy(void *layout) { free(layout); return OK; }
int cublasLtMatmulPreferenceCreate(void **pref) { *pref = malloc(8); return OK; }
int cublasLtMatmulPreferenceDestroy(void *pref) { free(pref); return OK; }
int cublasLtMatmulPreferenceSetAttribute(void *pref, int attr, const void *buf, size_t size) {
    if (attr != 1 || size != 8) return INVALID_VALUE;
    memcpy(&seen[14], buf, 8); return OK;
}
int cublasLtMatmulAlgoGetHeuristic(void *handle, void *desc, int64_t *a, int64_t *b, int64_t *c, int64_t *d,
                                   void *pref, int requested, heuristic_t *results, int *returned) {
    if (handle != (void *)0x1234) return INVALID_VALUE;
    for (int i = 0; i < 4; i++) { seen[2 + i] = a[i]; seen[6 + i] = b[i]; seen[10 + i] = c[i]; }
    int n = requested < 3 ? requested : 3;
    for (int i = 0; i < n; i++) {
        memset(&results[i], 0, sizeof(heuristic_t));
        results[i].algo.data[0] = 66 + i;   /* id */
        results[i].algo.data[1] = 20 + i;   /* tile */
        results[i].algo.data[2] = 1;        /* split-K */
        results[i].algo.data[7] = 3;        /* inner shape */
        results[i].waves = 0.5f * (i + 1);
    }
    *returned = n; return OK;
}
int cublasLtMatmulAlgoCapGetAttribute(const algo_t *algo, int attr, void *buf, size_t size, size_t *written) {
    *written = 4;
    if (size == 0) return OK;
    if (size != 4) return INVALID_VALUE;
    uint32_t v = attr == 0 ? 1 : attr == 1 ? 0x6 : 0;  /* split-K supported; reduction in compute / output type */
    memcpy(buf, &v, 4); return OK;
}
int cublasLtMatmulAlgoConfigGetAttribute(const algo_t *algo, int attr, void *buf, size_t size, size_t *written) {
    if (attr < 0 || attr > 7) return INVALID_VALUE;
    *written = config_size(attr);
    if (size == 0) return OK;
    if ((int)size != config_size(attr)) return INVALID_VALUE;
    memcpy(buf, &algo->data[attr], size); return OK;
}
int cublasLtMatmulAlgoConfigSetAttribute(algo_t *algo, int attr, const void *buf, size_t size) {
    if (attr < 0 || attr > 7 || (int)size != config_size(attr)) return INVALID_VALUE;
    uint64_t v = 0; memcpy(&v, buf, size); algo->data[attr] = v; return OK;
}
int cublasLtMatmulAlgoInit(void *handle, int compute, int scale, int a, int b, int c, int d, int id, algo_t *algo) {
    if (id >= 1000) return INVALID_VALUE;
    memset(algo, 0, sizeof(*algo)); algo->data[0] = id; algo->data[2] = 1; seen[15] = a; return OK;
}
int cublasLtMatmulAlgoCheck(void *handle, void *desc, void *a, void *b, void *c, void *d, const algo_t *algo,
                            heuristic_t *result) {
    if (algo->data[2] == 3) return NOT_SUPPORTED;  /* three splits: refused */
    memset(result, 0, sizeof(*result)); result->workspace = algo->data[2] > 1 ? 4096 : 0; return OK;
}
int cublasLtMatmul(void *handle, void *desc, const float *alpha, const void *A, void *a_layout, const void *B,
                   void *b_layout, const float *beta, const void *C, void *c_layout, void *D, void *d_layout,
                   const algo_t *algo, void *workspace, size_t workspace_size, void *stream) {
    seen[16] = (int64_t)A; seen[17] = (int64_t)B; seen[18] = (int64_t)C; seen[19] = (int64_t)D;
    seen[20] = (int64_t)workspace; seen[21] = (int64_t)workspace_size; seen[22] = (int64_t)stream;
    seen[23] = (int64_t)algo->data[0]; seen[24] = (int64_t)(*alpha * 10); seen[25] = (int64_t)(*beta * 10);
    return OK;
}
