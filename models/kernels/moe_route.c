/* A mixture of experts' routing for the whole-step kernel (decode_step.c includes this file): per row, the router's
 * logits, their softmax, the top k by torch.topk's rule, the weights renormalized or not; then the rows grouped by
 * expert.
 *
 * Why torch's rule: HF routes with torch.topk, and where router weights tie exactly (two equal rows, as in
 * tests/test_families.py) the experts a token gets depend on how topk breaks the tie. On the CPU torch.topk
 * (ATen's TopKImpl.h) fills (value, index) pairs and runs std::partial_sort when k * 64 <= n, else std::nth_element
 * at k - 1 and std::sort of the first k - 1, comparing values only (NaN first). The functions below are those
 * libstdc++ algorithms written out for one array of pairs, step for step, so a tie falls the same way.
 * tests/test_moe_route.py checks them against torch.topk on rows full of ties.
 */
#include <math.h>
#include <string.h>

typedef struct {
    float v;
    int i;
} Pick;

/* topk's comparator (largest, NaN first): a goes before b. */
static int before(Pick a, Pick b) { return (isnan(a.v) && !isnan(b.v)) || a.v > b.v; }

static void swap_pick(Pick *a, Pick *b) {
    Pick t = *a;
    *a = *b;
    *b = t;
}

static int floor_log2(long n) {
    int k = 0;
    while (n > 1) n >>= 1, k++;
    return k;
}

/* libstdc++ __move_median_to_first, __unguarded_partition, __unguarded_partition_pivot */
static void move_median_to_first(Pick *result, Pick *a, Pick *b, Pick *c) {
    if (before(*a, *b)) {
        if (before(*b, *c)) swap_pick(result, b);
        else if (before(*a, *c)) swap_pick(result, c);
        else swap_pick(result, a);
    } else if (before(*a, *c)) swap_pick(result, a);
    else if (before(*b, *c)) swap_pick(result, c);
    else swap_pick(result, b);
}

static Pick *unguarded_partition(Pick *first, Pick *last, const Pick *pivot) {
    for (;;) {
        while (before(*first, *pivot)) ++first;
        --last;
        while (before(*pivot, *last)) --last;
        if (!(first < last)) return first;
        swap_pick(first, last);
        ++first;
    }
}

static Pick *unguarded_partition_pivot(Pick *first, Pick *last) {
    Pick *mid = first + (last - first) / 2;
    move_median_to_first(first, first + 1, mid, last - 1);
    return unguarded_partition(first + 1, last, first);
}

/* libstdc++ __unguarded_linear_insert, __insertion_sort, __unguarded_insertion_sort */
static void unguarded_linear_insert(Pick *last) {
    Pick val = *last, *next = last - 1;
    while (before(val, *next)) {
        *last = *next;
        last = next;
        --next;
    }
    *last = val;
}

static void insertion_sort(Pick *first, Pick *last) {
    if (first == last) return;
    for (Pick *i = first + 1; i != last; ++i) {
        if (before(*i, *first)) {
            Pick val = *i;
            memmove(first + 1, first, sizeof(Pick) * (size_t)(i - first));
            *first = val;
        } else {
            unguarded_linear_insert(i);
        }
    }
}

static void unguarded_insertion_sort(Pick *first, Pick *last) {
    for (Pick *i = first; i != last; ++i) unguarded_linear_insert(i);
}

/* libstdc++ __push_heap, __adjust_heap, __make_heap, __pop_heap, __heap_select, __sort_heap, __partial_sort */
static void push_heap(Pick *first, long hole, long top, Pick value) {
    long parent = (hole - 1) / 2;
    while (hole > top && before(first[parent], value)) {
        first[hole] = first[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    first[hole] = value;
}

static void adjust_heap(Pick *first, long hole, long len, Pick value) {
    const long top = hole;
    long child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (before(first[child], first[child - 1])) child--;
        first[hole] = first[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        first[hole] = first[child - 1];
        hole = child - 1;
    }
    push_heap(first, hole, top, value);
}

static void make_heap(Pick *first, Pick *last) {
    const long len = last - first;
    if (len < 2) return;
    for (long parent = (len - 2) / 2;; parent--) {
        adjust_heap(first, parent, len, first[parent]);
        if (parent == 0) return;
    }
}

static void pop_heap(Pick *first, Pick *last, Pick *result) {
    Pick value = *result;
    *result = *first;
    adjust_heap(first, 0, last - first, value);
}

static void heap_select(Pick *first, Pick *middle, Pick *last) {
    make_heap(first, middle);
    for (Pick *i = middle; i < last; ++i)
        if (before(*i, *first)) pop_heap(first, middle, i);
}

static void sort_heap(Pick *first, Pick *last) {
    while (last - first > 1) {
        --last;
        pop_heap(first, last, last);
    }
}

static void partial_sort(Pick *first, Pick *middle, Pick *last) {
    heap_select(first, middle, last);
    sort_heap(first, middle);
}

/* std::nth_element (__introselect) and std::sort (__introsort_loop, __final_insertion_sort) */
static void introselect(Pick *first, Pick *nth, Pick *last, int depth) {
    while (last - first > 3) {
        if (depth == 0) {
            heap_select(first, nth + 1, last);
            swap_pick(first, nth);
            return;
        }
        --depth;
        Pick *cut = unguarded_partition_pivot(first, last);
        if (cut <= nth) first = cut;
        else last = cut;
    }
    insertion_sort(first, last);
}

static void nth_element(Pick *first, Pick *nth, Pick *last) {
    if (first == last || nth == last) return;
    introselect(first, nth, last, floor_log2(last - first) * 2);
}

static void introsort_loop(Pick *first, Pick *last, int depth) {
    while (last - first > 16) {
        if (depth == 0) {
            partial_sort(first, last, last);
            return;
        }
        --depth;
        Pick *cut = unguarded_partition_pivot(first, last);
        introsort_loop(cut, last, depth);
        last = cut;
    }
}

static void sort_picks(Pick *first, Pick *last) {
    if (first == last) return;
    introsort_loop(first, last, floor_log2(last - first) * 2);
    if (last - first > 16) {
        insertion_sort(first, first + 16);
        unguarded_insertion_sort(first + 16, last);
    } else {
        insertion_sort(first, last);
    }
}

/* torch.topk(values[:n], k) on the CPU, sorted, largest: -> picks[0 .. k) (picks has room for n). */
static void topk_like_torch(const float *values, int n, int k, Pick *picks) {
    for (int j = 0; j < n; j++) picks[j] = (Pick){values[j], j};
    if ((long)k * 64 <= n) {
        partial_sort(picks, picks + k, picks + n);
    } else {
        nth_element(picks, picks + k - 1, picks + n);
        sort_picks(picks, picks + k - 1);
    }
}

/* One row's routing: probs = softmax(router h) over E experts (fp32), its top k -> experts [k], weights [k]
 * (renormalized to sum 1 when norm_topk). scratch: E floats + E Picks (2 E floats). */
static void route_row(const float *router, const float *h, int C, int E, int k, int norm_topk, int *experts,
                      float *weights, float *scratch) {
    float *probs = scratch, mx = -INFINITY, sum = 0.0f;
    for (int e = 0; e < E; e++) {
        const float *w = router + (long)e * C;
        float acc = 0.0f;
        for (int c = 0; c < C; c++) acc += h[c] * w[c];
        probs[e] = acc;
        mx = acc > mx ? acc : mx;
    }
    for (int e = 0; e < E; e++) sum += probs[e] = expf(probs[e] - mx);
    for (int e = 0; e < E; e++) probs[e] /= sum;
    Pick *picks = (Pick *)(scratch + E);
    topk_like_torch(probs, E, k, picks);
    float total = 0.0f;
    for (int j = 0; j < k; j++) total += picks[j].v;
    for (int j = 0; j < k; j++) {
        experts[j] = picks[j].i;
        weights[j] = norm_topk ? picks[j].v / total : picks[j].v;
    }
}

/* Rows grouped by expert: order [B k] the rows that chose expert e at [starts[e], starts[e + 1]), in row order, and
 * order_w the weight each gave it. experts, weights [B, k]. */
static void group_by_expert(const int *experts, const float *weights, int B, int k, int E, int *order,
                            float *order_w, int *starts) {
    for (int e = 0; e <= E; e++) starts[e] = 0;
    for (long i = 0; i < (long)B * k; i++) starts[experts[i] + 1]++;
    for (int e = 0; e < E; e++) starts[e + 1] += starts[e];
    int *fill = starts + E + 1; /* scratch: the next free place of each expert, after starts */
    for (int e = 0; e < E; e++) fill[e] = starts[e];
    for (int b = 0; b < B; b++)
        for (int j = 0; j < k; j++) {
            const int e = experts[(long)b * k + j], at = fill[e]++;
            order[at] = b;
            order_w[at] = weights[(long)b * k + j];
        }
}

/* torch.topk(values, k) over each of `rows` rows of n values -> indices, picked [rows, k] (scratch: n Picks). The
 * kernel's rule exported for tests/test_families.py, which checks it against torch.topk on rows full of ties. */
void topk_rows(const float *values, int rows, int n, int k, long *indices, float *picked, void *scratch) {
    Pick *picks = (Pick *)scratch;
    for (int r = 0; r < rows; r++) {
        topk_like_torch(values + (long)r * n, n, k, picks);
        for (int j = 0; j < k; j++) {
            indices[(long)r * k + j] = picks[j].i;
            picked[(long)r * k + j] = picks[j].v;
        }
    }
}
