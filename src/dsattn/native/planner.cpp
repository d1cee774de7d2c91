// The metadata planner (spec 50 §2-§3) in C++: the golden of dsattn/planner/ref.py (row records,
// the greedy AssignByBatch / AssignByRow / AssignByBlock / ForceAssign loop, RecordFDInfo, the FD
// split), writing the 1024-int32 table directly and byte-identical to the golden's.  It differs
// from the golden in one respect: rows are not costed one by one but in runs of rows the greedy
// cannot tell apart (``Run``, ``run_end``), so a prefill chunk of thousands of m-blocks costs a
// few dozen evaluations.  It also resolves the per-batch lengths from the CPU int32 mirrors with
// the checks of dsattn/planner/params.py (same messages; std::invalid_argument reaches Python as
// ValueError), so a serving step's plan costs one call and no Python loop.
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <tuple>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using i64 = int64_t;
constexpr i64 S2_BASE = 512;
constexpr i64 INF = INT64_MAX;
constexpr int FA_CORES = 36;
constexpr int FD_CORES = 72;
constexpr int FD_BASE = 8 * FA_CORES;
constexpr int TABLE_SIZE = 1024;

[[noreturn]] void fail(const std::string& arg, const std::string& msg) {
  throw std::invalid_argument(arg + ": " + msg);
}

inline i64 cdiv(i64 a, i64 b) { return (a + b - 1) / b; }  // (only non-negative operands occur)

__attribute__((always_inline)) inline i64 cost(i64 M, i64 N) { return 6 * cdiv(M, 16) + 10 * cdiv(N, 64); }

struct Params {
  i64 B, N1, N2;
  std::vector<i64> S1, S2;
  bool has_cmp;
  i64 cmp_topk, cmp_ratio, ori_mask_mode, ori_win_left, aic, aiv;
  bool support_fd;

  // derived once (finish()): the row loops must not divide by runtime values
  i64 g_, m_base_, k_ = 0, tail_q_ = 0, ratio_shift_ = -1;
  bool divides_ = false;

  void finish() {
    g_ = N1 / N2;
    m_base_ = is_scfa() ? g_ : 256;
    divides_ = m_base_ % g_ == 0;
    if (divides_) { k_ = m_base_ / g_; tail_q_ = (m_base_ - 1) / g_; }
    if (cmp_ratio > 0 && (cmp_ratio & (cmp_ratio - 1)) == 0) ratio_shift_ = __builtin_ctzll((unsigned long long)cmp_ratio);
  }
  i64 G() const { return g_; }
  bool is_scfa() const { return has_cmp && cmp_topk > 0; }
  i64 m_base() const { return m_base_; }
  bool no_mask() const { return ori_mask_mode == 0; }
  i64 pre() const { return (ori_mask_mode == 4 && ori_win_left > -1) ? ori_win_left : INF; }
  bool high_perf_gate() const { return is_scfa() && N1 == 128 && cmp_topk == 1024 && !support_fd; }
  i64 S1v(i64 b) const { return std::min(S1[b], S2[b]); }
};

struct Row {
  i64 cost, blocks, last_block_cost, s2_start, s2_end, win_end, cmp_start, cmp_end, win_tail, cmp_tail;
  bool tail_row;
  i64 s1g_tail;
};

__attribute__((always_inline)) inline i64 type_cost(const Params& pp, i64 s1g_tail, bool row_t, bool col_t, i64 tail) {
  const i64 m = pp.m_base();
  if (!row_t && !col_t) return cost(m, S2_BASE);
  if (row_t && !col_t) return s1g_tail ? cost(s1g_tail, S2_BASE) : 0;
  if (!row_t && col_t) return tail ? cost(m, tail) : 0;
  return (s1g_tail && tail) ? cost(s1g_tail, tail) : 0;
}

inline i64 block_cost(const Params& pp, const Row& r, i64 k) {
  if (k < r.win_end) return type_cost(pp, r.s1g_tail, r.tail_row, k == r.win_end - 1 && r.win_tail != 0, r.win_tail);
  return type_cost(pp, r.s1g_tail, r.tail_row, k == r.cmp_end - 1 && r.cmp_tail != 0, r.cmp_tail);
}

bool high_perf(const Params& pp, i64 b) {
  const i64 s1v = pp.S1v(b), s2 = pp.S2[b];
  return pp.high_perf_gate() && (s1v >= s2 || s2 - s1v + 1 < pp.cmp_topk * pp.cmp_ratio);
}

// Per-batch constants of the row records (§2.2).
struct Batch {
  i64 S1, S2, S1v, n_m, s1g_tail;
  // pre_lu is at most INF (the window unbounded on the left): S1v <= S2 makes S1v - S2 + INF fit, and
  // the window start fq - pre_lu >= -INF, so 64 bits hold what Python's ints hold here
  i64 pre_lu, next_lu;
  i64 c_norm, c_tail_row;    // cost of a full s2-block in a full / the tail m-block (type NN, TN)
  bool hp;
};

Batch batch_of(const Params& pp, i64 b) {
  Batch g;
  const i64 G = pp.G(), m_base = pp.m_base();
  g.S1 = pp.S1[b];
  g.S2 = pp.S2[b];
  g.S1v = std::min(g.S1, g.S2);
  g.n_m = cdiv(g.S1v * G, m_base);
  g.s1g_tail = (g.S1v * G) % m_base;
  if (pp.ori_mask_mode == 4) {
    g.pre_lu = g.S1v - g.S2 + pp.pre();
    g.next_lu = g.S2 - g.S1v;
  } else {
    g.pre_lu = pp.pre();
    g.next_lu = g.S2 - g.S1v;
  }
  g.c_norm = type_cost(pp, g.s1g_tail, false, false, 0);
  g.c_tail_row = type_cost(pp, g.s1g_tail, true, false, 0);
  g.hp = high_perf(pp, b);
  return g;
}

// Row record ``idx`` of a batch (ref.batch_rows' loop body).  Rows are computed on demand, so no
// per-row divisions by runtime values remain on the common path: heads per KV head divide the
// m-block (G | m_base) and the compression ratio is a power of two.
// The part of a row record that depends on its position: window blocks and tail, compressed
// entries, the tail-row flag, and the last key (for the high-performance cost).  Equal shapes give
// equal records, so the aggregation pass costs a row only when its shape changes.
struct Shape {
  i64 win_end, win_tail, act, lst;
  bool row_t;
  // The cost model sees key counts in 64-key steps (cost() rounds N up to 64; 512-key blocks
  // hold whole steps), so rows whose window and compressed counts fall in the same steps have
  // the same cost, block count and last-block cost: the greedy assignment's view of a row.
  i64 window_steps() const { return win_end == 0 ? 0 : cdiv((win_end - 1) * S2_BASE + (win_tail ? win_tail : S2_BASE), 64); }
  bool same_cost(const Shape& o) const {
    return window_steps() == o.window_steps() && cdiv(act, 64) == cdiv(o.act, 64) && lst == o.lst && row_t == o.row_t;
  }
};

// The key range [first, last] of row ``idx`` before clipping to [0, S2); ``false`` for a batch
// without queries or keys.  Both ends are non-decreasing in ``idx`` over the full rows.
__attribute__((always_inline)) inline bool bounds_at(const Params& pp, const Batch& g, i64 idx, i64& first, i64& last) {
  const i64 G = pp.G(), m_base = pp.m_base();
  if (g.S1 == 0 || g.S2 == 0) return false;
  if (pp.no_mask()) {
    first = 0;
    last = g.S2 - 1;
    return true;
  }
  const i64 f = idx * m_base;
  const i64 l = std::min(f + m_base, g.S1v * G) - 1;
  i64 fq, lq;
  if (pp.divides_) {
    fq = idx * pp.k_;
    lq = f + m_base <= g.S1v * G ? idx * pp.k_ + pp.tail_q_ : g.S1v - 1;
  } else {
    fq = f / G;
    lq = l / G;
  }
  first = fq - g.pre_lu;
  last = lq + g.next_lu;
  return true;
}

// Row ``idx``'s key range clipped to [0, S2) in ``fst`` / ``lst``; false (both 0) when it sees no key.
__attribute__((always_inline)) inline bool clipped_range(const Params& pp, const Batch& g, i64 idx, i64& fst, i64& lst) {
  i64 first = 0, last = 0;
  fst = lst = 0;
  if (!bounds_at(pp, g, idx, first, last) || first >= g.S2 || last < 0 || last < first) return false;
  fst = std::max<i64>(first, 0);
  lst = std::min<i64>(last, g.S2 - 1);
  return true;
}

__attribute__((always_inline)) inline Shape shape_at(const Params& pp, const Batch& g, i64 idx) {
  i64 fst, lst, win_end = 0, win_tail = 0;
  if (clipped_range(pp, g, idx, fst, lst)) {
    win_end = (lst - fst) / S2_BASE + 1;
    win_tail = (lst - fst + 1) % S2_BASE;
  }
  i64 cmp_tok = 0;
  if (pp.has_cmp) {
    cmp_tok = pp.ratio_shift_ >= 0 ? (lst + 1) >> pp.ratio_shift_ : (lst + 1) / pp.cmp_ratio;
  }
  const i64 act = pp.is_scfa() ? std::min(cmp_tok, pp.cmp_topk) : cmp_tok;
  // (the last key matters to the cost only through the high-performance formula)
  return Shape{win_end, win_tail, act, g.hp ? lst : 0, idx == g.n_m - 1 && g.s1g_tail != 0};
}

// Which clipping applies to a row's key range.  Each bit is a threshold on first or last, so
// along the full rows of a batch each flips at most once.
__attribute__((always_inline)) inline int clip_state(const Params& pp, const Batch& g, i64 idx) {
  i64 first = 0, last = 0;
  if (!bounds_at(pp, g, idx, first, last)) return -1;
  return (first >= 0) | (last >= g.S2 - 1) << 1 | (last >= 0) << 2 | (first >= g.S2) << 3 | (last >= first) << 4;
}

// Over the full rows of a batch (all but its last, which may be a partial m-block) with m-blocks
// of whole queries (G | m_base), a row's key range ends first = idx k - pre and last = idx k + c
// are affine and non-decreasing.  So while the clipping stays the same (``clip_state``: each of
// its bits flips at most once along a batch) the window width and the last key move one way
// only, and so do the 64-key step counts of ``Shape::same_cost``: "costs the same as row idx"
// holds on a prefix of the rows after idx, up to the next clipping change.  Runs are then found
// by galloping and bisection, a few evaluations per run instead of one per row.  Other
// geometries (floors of idx m_base / G, the high-performance cost that depends on every last
// key) are scanned row by row.
bool bisectable(const Params& pp, const Batch& g) { return pp.divides_ && !g.hp; }

// The first row after ``idx`` whose clipping differs from row idx's (at most ``end``).
i64 next_clip_change(const Params& pp, const Batch& g, i64 idx, i64 end) {
  const int clip = clip_state(pp, g, idx);
  i64 good = idx, bad = end;
  while (bad - good > 1) {
    const i64 mid = good + (bad - good) / 2;
    if (clip_state(pp, g, mid) == clip) good = mid;
    else bad = mid;
  }
  return bad;
}

// One past the last row of the run of rows costing what row ``idx`` (shape ``sh``) costs, which ends at
// ``limit`` at the latest: the next clipping change for bisectable batches, else the last full row.
i64 run_end(const Params& pp, const Batch& g, i64 idx, const Shape& sh, i64 limit) {
  if (idx + 1 >= limit) return idx + 1;
  if (!bisectable(pp, g)) {
    i64 j = idx + 1;
    while (j < limit && shape_at(pp, g, j).same_cost(sh)) ++j;
    return j;
  }
  i64 good = idx, bad = limit, step = 1;   // rows (idx, good] are in the run
  while (good + step < limit) {
    if (!shape_at(pp, g, good + step).same_cost(sh)) { bad = good + step; break; }
    good += step;
    step *= 2;
  }
  while (bad - good > 1) {
    const i64 mid = good + (bad - good) / 2;
    if (shape_at(pp, g, mid).same_cost(sh)) good = mid;
    else bad = mid;
  }
  return good + 1;
}

__attribute__((always_inline)) inline Row row_of(const Params& pp, const Batch& g, const Shape& sh) {
  const i64 m_base = pp.m_base();
  const i64 win_end = sh.win_end, win_tail = sh.win_tail, act = sh.act, lst = sh.lst;
  const bool row_t = sh.row_t;
  const i64 cmp_start = win_end;
  const i64 cmp_end = act == 0 ? cmp_start : cmp_start + (act - 1) / S2_BASE + 1;
  const i64 cmp_tail = act % S2_BASE;
  // (blocks, cost, cost of its last block) of a branch's block range
  auto part = [&](i64 start, i64 end, i64 tail, i64& n_blk, i64& c, i64& last_c_out) {
    n_blk = end - start;
    const i64 n_tail = tail ? 1 : 0, n_norm = n_blk - n_tail;
    const i64 normal = row_t ? g.c_tail_row : g.c_norm;
    const i64 last_c = type_cost(pp, g.s1g_tail, row_t, true, tail);
    c = normal * n_norm + last_c * n_tail;
    last_c_out = n_tail ? last_c : normal;
  };
  i64 wb, wc, wl, cb, cc, cl;
  part(0, win_end, win_tail, wb, wc, wl);
  part(cmp_start, cmp_end, cmp_tail, cb, cc, cl);
  Row r{wc + cc, wb + cb, cb > 0 ? cl : wl, wb > 0 ? 0 : cmp_start, cb > 0 ? cmp_end : win_end,
        win_end, cmp_start, cmp_end, win_tail, cmp_tail, row_t, g.s1g_tail};
  if (g.hp) {
    const i64 K = pp.cmp_topk * pp.cmp_ratio;
    const i64 L = std::min(K, lst + 1);
    i64 c = 15 * cdiv(m_base, 16) + 5 * cdiv(L, 64);
    if (L == K) c -= c / 21;
    if (L < 2048) c -= c / 18;
    if (2048 < L && L < 3392) c += c / 7;
    r.cost = c;
  }
  return r;
}

Row row_at(const Params& pp, const Batch& g, i64 idx) { return row_of(pp, g, shape_at(pp, g, idx)); }

struct FdTask { i64 bn2, m, ws, split, m_size; };

void write_entry(int32_t* t, int at, std::initializer_list<i64> v) {
  int k = at;
  for (i64 x : v) t[k++] = (int32_t)x;
}

// Consecutive rows of a batch that the greedy assignment cannot tell apart: equal cost, block
// count and last-block cost (``Shape::same_cost``).  A prefill batch of thousands of rows has a
// few dozen (the window grows to its width and the compressed count to top-k in 64-key steps,
// then nothing changes), so the assignment takes a run's rows by one division instead of
// walking them.  Every row record starts at s2-block 0 (ref: s2_start is the window's 0, or
// cmp_start = win_end = 0 without a window), so ``blocks`` is also its s2 end; a row entered
// part-way is recomputed in full (``row_at``).
struct Run {
  i64 end;   // one past its last row (its first row is the previous run's end, or 0)
  i64 cost, blocks, last_block_cost;
};

// How many of ``n`` equal rows of cost ``c`` AssignByRow takes from ``core_cost`` on: the rows
// are taken while the core's test holds, and the test only tightens as ``core_cost`` grows.
i64 rows_that_fit(bool hp, i64 limit, i64 core_cost, i64 c, i64 lbc, i64 n) {
  if (c <= 0) return (hp ? 5 * (limit - core_cost) > 4 * c : limit + lbc / 2 >= core_cost + c) ? n : 0;
  i64 k;
  if (hp) {  // take row i while 5 (limit - core_cost - i c) > 4 c
    const i64 x = 5 * (limit - core_cost) - 4 * c;
    k = x <= 0 ? 0 : (x + 5 * c - 1) / (5 * c);
  } else {   // take row i while limit + lbc / 2 >= core_cost + (i + 1) c
    const i64 x = limit + lbc / 2 - core_cost - c;
    k = x < 0 ? 0 : x / c + 1;
  }
  return std::min(k, n);
}

void plan_into(const Params& pp, int32_t* table) {
  const i64 B = pp.B, N2 = pp.N2;
  // (reused across calls, so a serving step's three plans allocate nothing once warm; callers
  // hold the GIL: pybind11 does not release it for these functions)
  static std::vector<Run> runs;
  static std::vector<i64> run_off;        // batch b's runs: [run_off[b], run_off[b + 1])
  std::vector<Batch> batches(B);
  for (i64 b = 0; b < B; ++b) batches[b] = batch_of(pp, b);
  std::fill(table, table + TABLE_SIZE, 0);
  std::vector<i64> batch_cost(B, 0), batch_blocks(B, 0), batch_lbc(B, 0);
  runs.clear();
  run_off.assign(B + 1, 0);
  i64 max_row_cost = 0, total = 0;
  bool all_empty = true;
  for (i64 b = 0; b < B; ++b) {
    const Batch& g = batches[b];
    const bool empty_b = g.S1v == 0 || g.S2 == 0;
    if (g.n_m > 0 && cdiv(g.S2, S2_BASE) != 0) all_empty = false;
    i64 bc = 0, bk = 0, lbc = 0;
    const i64 full_end = g.n_m - 1;   // (the last row is a run of its own)
    i64 region_end = 0;
    for (i64 idx = 0; idx < g.n_m;) {
      if (idx >= region_end) region_end = bisectable(pp, g) && idx < full_end ? next_clip_change(pp, g, idx, full_end) : full_end;
      const Shape sh = shape_at(pp, g, idx);
      const i64 end = run_end(pp, g, idx, sh, region_end), n = end - idx;
      const Row r = row_of(pp, g, sh);
      runs.push_back({end, r.cost, r.blocks, r.last_block_cost});
      bc += r.cost * n;
      bk += r.blocks * n;
      if (r.blocks > 0) lbc = r.last_block_cost;
      max_row_cost = std::max(max_row_cost, r.cost);
      idx = end;
    }
    run_off[b + 1] = (i64)runs.size();
    batch_cost[b] = empty_b ? 0 : bc;
    batch_blocks[b] = empty_b ? 0 : bk;
    batch_lbc[b] = lbc;
    total += batch_cost[b];
  }
  if (all_empty) {
    write_entry(table, 0, {1, 0, 0, 0, B * N2, 0, 0, 0});
    return;
  }
  total *= N2;

  // the cursor (§2.3): batch-head ``bn2``, row ``row`` (inside run ``run``), s2-block ``s2``
  i64 bn2 = 0, row = 0, run = 0, s2 = 0, bn2_cost = batch_cost[0], bn2_blocks = batch_blocks[0];
  bool finished = false;
  auto bb = [&]() { return N2 == 1 ? bn2 : bn2 / N2; };
  auto n_rows = [&](i64 b) { return batches[b].n_m; };
  auto next_bn2 = [&]() {
    ++bn2;
    row = s2 = 0;
    if (bn2 == B * N2) finished = true;
    else { bn2_cost = batch_cost[bb()]; bn2_blocks = batch_blocks[bb()]; run = run_off[bb()]; }
  };
  // to row ``to`` of the batch, skipping rows without blocks (ref's next_row from row ``to - 1``)
  auto next_row_from = [&](i64 to) {
    const i64 last_run = run_off[bb() + 1];
    row = to;
    while (run < last_run && (runs[run].end <= row || runs[run].blocks == 0)) {
      if (runs[run].end > row) row = runs[run].end;
      ++run;
    }
    if (run >= last_run) next_bn2();
    else s2 = 0;
  };
  auto next_row = [&]() { next_row_from(row + 1); };
  auto skip_empty = [&]() { while (!finished && batch_blocks[bb()] == 0) next_bn2(); };
  auto full_row = [&]() { return row_at(pp, batches[bb()], row); };
  auto remaining_row_cost = [&]() {
    if (s2 == 0) return runs[run].cost;
    const Row r = full_row();
    i64 c = 0;
    for (i64 k = s2; k < r.s2_end; ++k) c += block_cost(pp, r, k);
    return c;
  };
  auto take_block = [&]() {
    const Row r = full_row();
    const i64 c = block_cost(pp, r, s2);
    ++s2;
    bn2_cost = std::max<i64>(0, bn2_cost - c);
    --bn2_blocks;
    if (s2 == r.s2_end) next_row();
    return c;
  };

  i64 unassigned = total, pre_fd = 0, cur_split = 1, split_bn2 = -1, split_m = -1;
  int used = 0;
  std::vector<FdTask> tasks;
  for (i64 i = 0; i < pp.aic; ++i) {
    if (finished || unassigned <= 0) break;
    int32_t* e = table + 8 * used;
    e[0] = 1; e[1] = (int32_t)bn2; e[2] = (int32_t)row; e[3] = (int32_t)s2;
    e[7] = (int32_t)(pre_fd + cur_split - 1);
    const i64 avg = unassigned / (pp.aic - i);
    const i64 limit = pp.support_fd ? avg : std::max(avg, max_row_cost);
    i64 core_cost = 0, core_blocks = 0;
    while (!finished) {                                                 // 1. AssignByBatch
      const i64 b = bb(), c = bn2_cost;
      const bool ok = batches[b].hp ? (c == 0 || 5 * (limit - core_cost) > 4 * c)
                                    : (c == 0 || limit + batch_lbc[b] / 2 >= core_cost + c);
      if (!ok) break;
      core_cost += c;
      core_blocks += bn2_blocks;
      next_bn2();
    }
    while (!finished) {                                                 // 2. AssignByRow
      const i64 b = bb(), before = bn2;
      const Run& r = runs[run];
      const bool hp = batches[b].hp;
      if (s2 == 0 && r.blocks > 0) {
        // whole rows of this run: as many as the test lets through, in one step
        const i64 k = rows_that_fit(hp, limit, core_cost, r.cost, r.last_block_cost, runs[run].end - row);
        if (k == 0) break;
        core_cost += k * r.cost;
        core_blocks += k * r.blocks;
        bn2_cost = std::max<i64>(0, bn2_cost - k * r.cost);
        bn2_blocks -= k * r.blocks;
        next_row_from(row + k);
      } else {
        const i64 rc = remaining_row_cost();
        const bool ok = hp ? 5 * (limit - core_cost) > 4 * rc : limit + r.last_block_cost / 2 >= core_cost + rc;
        if (!ok) break;
        core_cost += rc;
        core_blocks += r.blocks - s2;
        bn2_cost = std::max<i64>(0, bn2_cost - rc);
        bn2_blocks -= r.blocks - s2;
        next_row();
      }
      if (finished || bn2 != before) break;
    }
    if (pp.support_fd) {
      while (true) {                                                    // 3. AssignByBlock
        skip_empty();
        if (finished) break;
        const i64 c = block_cost(pp, full_row(), s2);
        if (!(limit + c / 2 >= core_cost + c)) break;
        core_cost += take_block();
        ++core_blocks;
      }
      skip_empty();                                                     // 4. ForceAssign
      if (core_blocks == 0 && !finished) {
        core_cost += take_block();
        ++core_blocks;
      }
    }
    e[4] = (int32_t)bn2; e[5] = (int32_t)row; e[6] = (int32_t)s2;
    ++used;
    unassigned -= core_cost;
    if (i > 0 && cur_split > 1 && (bn2 != split_bn2 || row != split_m)) {   // 5. RecordFDInfo
      const i64 fb = split_bn2 / N2;
      const i64 m_size = split_m == n_rows(fb) - 1 ? pp.S1v(fb) * pp.G() - split_m * pp.m_base() : pp.m_base();
      tasks.push_back({split_bn2, split_m, pre_fd, cur_split, m_size});
      pre_fd += cur_split;
      cur_split = 1;
    }
    if (!finished && row < n_rows(bb()) && s2 > 0) {
      ++cur_split;
      split_bn2 = bn2;
      split_m = row;
    }
  }
  if (!finished && used > 0) {
    int32_t* e = table + 8 * (used - 1);
    e[4] = (int32_t)(B * N2); e[5] = 0; e[6] = 0;
  }
  // §2.5: the FD tasks over the vector cores
  if (tasks.empty()) return;
  i64 total_work = 0;
  for (const auto& t : tasks) total_work += t.split * t.m_size;
  const i64 avg = cdiv(total_work, pp.aiv);
  i64 v = 0;
  const i64 n_tasks = (i64)tasks.size();
  for (i64 t = 0; t < n_tasks; ++t) {
    const FdTask& k = tasks[t];
    i64 n = std::max<i64>(1, k.split * k.m_size / avg);
    n = std::min(n, pp.aiv - v - (n_tasks - t - 1));
    const i64 per = cdiv(k.m_size, n);
    n = cdiv(k.m_size, per);
    for (i64 j = 0; j < n; ++j) {
      if (v >= FD_CORES) fail("aiv_core_num", "the FD split exceeds the table's 72 vector entries");
      write_entry(table, FD_BASE + 8 * (int)v, {1, k.bn2, k.m, k.ws, k.split, j * per, std::min(per, k.m_size - j * per), 0});
      ++v;
    }
  }
}

// ---- lengths (params.py's plan_params, length part) ------------------------------------------

std::vector<i64> values(const torch::Tensor& t) {
  const auto c = t.contiguous();
  const int32_t* p = c.data_ptr<int32_t>();
  return std::vector<i64>(p, p + c.numel());
}

std::vector<i64> diffs(const std::string& arg, const std::vector<i64>& cu) {
  if (cu.empty()) fail(arg, "expected shape [B+1] with B >= 0, got an empty tensor");
  std::vector<i64> out;
  out.reserve(cu.size() - 1);
  for (size_t b = 0; b + 1 < cu.size(); ++b) {
    if (cu[b + 1] < cu[b])
      fail(arg, "must be non-decreasing, got " + std::to_string(cu[b]) + " then " + std::to_string(cu[b + 1]) +
                    " at batch " + std::to_string(b));
    out.push_back(cu[b + 1] - cu[b]);
  }
  if (cu[0] < 0) fail(arg, "must not be negative, got " + std::to_string(cu[0]));
  return out;
}

// ---- reading a plan (dsattn/planner/table.py: decode, coverage, check_coverage) ---------------
//
// The executor of sparse_attn_sharedkv reads the plan of every call on the host: the row records'
// geometry (Rows(costs=False) of dsattn/planner/fast.py), the cores' ranges as whole rows and
// partial pieces (coverage) and, with content checks, the plan invariants (check_coverage).  The
// same, here, in one call: the NumPy version costs about half a millisecond per decode call, most
// of it per-call overhead.  Messages equal the Python checkers' (the tests compare them).

struct Bound { i64 b, m, s; };

std::string str(const Bound& t) {
  return "(" + std::to_string(t.b) + ", " + std::to_string(t.m) + ", " + std::to_string(t.s) + ")";
}

struct PlanError {
  std::string what;
};

struct Reader {
  const Params& pp;
  std::vector<i64> off, S1v, first, win_end, s2_start, s2_end, blocks;
  i64 R = 0;

  explicit Reader(const Params& p) : pp(p) {
    const i64 B = pp.B, G = pp.G(), mb = pp.m_base();
    off.assign(B + 1, 0);
    S1v.resize(B);
    for (i64 b = 0; b < B; ++b) {
      S1v[b] = pp.S1v(b);
      off[b + 1] = off[b] + cdiv(S1v[b] * G, mb);
    }
    R = off[B];
    first.resize(R); win_end.resize(R); s2_start.resize(R); s2_end.resize(R); blocks.resize(R);
    for (i64 b = 0; b < B; ++b) {
      const Batch g = batch_of(pp, b);
      for (i64 idx = 0; idx < off[b + 1] - off[b]; ++idx) {
        i64 fst, lst;
        clipped_range(pp, g, idx, fst, lst);          // (the window's first key; 0 for a row without keys)
        const Row r = row_at(pp, g, idx);
        const i64 at = off[b] + idx;
        first[at] = fst;
        win_end[at] = r.win_end;
        blocks[at] = r.blocks;
        s2_start[at] = r.s2_start;
        s2_end[at] = r.s2_end;
      }
    }
  }

  // Global (row, s2) of a core range bound as walk() moves (table.py's _position).
  std::pair<i64, i64> position(const Bound& t) const {
    if (std::min({t.b, t.m, t.s}) < 0) throw PlanError{"0: negative entry in the core range bound " + str(t)};
    if (t.b >= pp.B) return {off[pp.B], 0};
    if (t.m >= off[t.b + 1] - off[t.b]) return {off[t.b + 1], 0};
    return {off[t.b] + t.m, t.s};
  }

  i64 m_size(i64 b, i64 m) const { return std::min(pp.m_base(), S1v[b] * pp.G() - m * pp.m_base()); }
};

struct Piece { i64 core, bn2, m, lo, hi, slot; };

std::string pieces_repr(const std::vector<Piece>* ps) {
  if (ps == nullptr) return "None";
  std::string s = "[";
  for (size_t i = 0; i < ps->size(); ++i) {
    const Piece& p = (*ps)[i];
    s += (i ? ", " : "") + std::string("Segment(core=") + std::to_string(p.core) + ", bn2=" + std::to_string(p.bn2) +
         ", m=" + std::to_string(p.m) + ", s2_lo=" + std::to_string(p.lo) + ", s2_hi=" + std::to_string(p.hi) +
         ", partial=True, slot=" + std::to_string(p.slot) + ")";
  }
  return s + "]";
}

std::string pair_repr(i64 a, i64 b) { return "(" + std::to_string(a) + ", " + std::to_string(b) + ")"; }

#define PLAN_ASSERT(cond, msg) \
  do {                         \
    if (!(cond)) throw PlanError{msg}; \
  } while (0)

}  // namespace

// The plan table (CPU int32 [1024]) for already validated scalar arguments; the length tensors
// (CPU int32, 1-D, or undefined) are resolved and checked here.
torch::Tensor plan_table(int64_t num_heads_q, c10::optional<torch::Tensor> seqused_q,
                         c10::optional<torch::Tensor> cu_seqlens_q, c10::optional<torch::Tensor> seqused_kv,
                         c10::optional<torch::Tensor> cu_seqlens_ori_kv, int64_t batch_size, int64_t max_seqlen_q,
                         int64_t max_seqlen_kv, bool q_tnd, bool kv_tnd, bool has_cmp, int64_t cmp_topk,
                         int64_t cmp_ratio, int64_t ori_mask_mode, int64_t ori_win_left, int64_t aic, int64_t aiv,
                         bool support_fd) {
  Params pp;
  const bool has_sq = seqused_q.has_value(), has_cq = cu_seqlens_q.has_value();
  const bool has_skv = seqused_kv.has_value(), has_ckv = cu_seqlens_ori_kv.has_value();
  std::vector<i64> sq = has_sq ? values(*seqused_q) : std::vector<i64>{};
  std::vector<i64> cq = has_cq ? values(*cu_seqlens_q) : std::vector<i64>{};
  std::vector<i64> skv = has_skv ? values(*seqused_kv) : std::vector<i64>{};
  std::vector<i64> ckv = has_ckv ? values(*cu_seqlens_ori_kv) : std::vector<i64>{};
  i64 B;
  if (has_sq) B = (i64)sq.size();
  else if (q_tnd && has_cq) B = (i64)cq.size() - 1;
  else B = batch_size;
  if (B < 0) fail("cu_seqlens_q", "expected shape [B+1] with B >= 0");
  if (has_sq) pp.S1 = sq;
  else if (q_tnd && has_cq) pp.S1 = diffs("cu_seqlens_q", cq);
  else pp.S1.assign(B, max_seqlen_q);
  if (has_skv) {
    pp.S2 = skv;
    if ((i64)pp.S2.size() != B)
      fail("seqused_kv", "has " + std::to_string(pp.S2.size()) + " entries but the batch size is " + std::to_string(B));
  } else if (kv_tnd && has_ckv) {
    pp.S2 = diffs("cu_seqlens_ori_kv", ckv);
    if ((i64)pp.S2.size() != B)
      fail("cu_seqlens_ori_kv", "has " + std::to_string(ckv.size()) + " entries but the batch size is " +
                                    std::to_string(B) + " (expected " + std::to_string(B + 1) + ")");
  } else {
    pp.S2.assign(B, max_seqlen_kv);
  }
  if (has_sq)
    for (i64 b = 0; b < B; ++b)
      if (pp.S1[b] < 0) fail("seqused_q", "value " + std::to_string(pp.S1[b]) + " at batch " + std::to_string(b) + " is negative");
  if (has_skv)
    for (i64 b = 0; b < B; ++b)
      if (pp.S2[b] < 0) fail("seqused_kv", "value " + std::to_string(pp.S2[b]) + " at batch " + std::to_string(b) + " is negative");
  if (batch_size && batch_size != B && (has_sq || has_cq))
    fail("batch_size", "value " + std::to_string(batch_size) + " does not match the " + std::to_string(B) +
                           " batches of the length tensors");
  pp.B = B;
  pp.N1 = num_heads_q;
  pp.N2 = 1;
  pp.has_cmp = has_cmp;
  pp.cmp_topk = has_cmp ? cmp_topk : 0;
  pp.cmp_ratio = cmp_ratio;
  pp.ori_mask_mode = ori_mask_mode;
  pp.ori_win_left = ori_win_left;
  pp.aic = aic;
  pp.aiv = aiv;
  pp.support_fd = support_fd;
  pp.finish();
  auto table = torch::empty({TABLE_SIZE}, torch::dtype(torch::kInt32));
  plan_into(pp, table.data_ptr<int32_t>());
  return table;
}

// The plan of explicit per-batch lengths (the 1000-workload parity test and the planner report).
torch::Tensor plan_lengths(int64_t num_heads_q, std::vector<int64_t> S1, std::vector<int64_t> S2, bool has_cmp,
                           int64_t cmp_topk, int64_t cmp_ratio, int64_t ori_mask_mode, int64_t ori_win_left,
                           int64_t aic, int64_t aiv, bool support_fd) {
  Params pp{(i64)S1.size(), num_heads_q, 1, S1, S2, has_cmp, has_cmp ? cmp_topk : 0, cmp_ratio, ori_mask_mode,
            ori_win_left, aic, aiv, support_fd};
  pp.finish();
  auto table = torch::empty({TABLE_SIZE}, torch::dtype(torch::kInt32));
  plan_into(pp, table.data_ptr<int32_t>());
  return table;
}

// A plan table read for the call whose lengths and attributes are given (as plan_lengths takes
// them): [off [B+1], S1v [B], rows [5, R] (first, win_end, s2_start, s2_end, blocks), whole [W],
// partial [P, 6] (core, bn2, m, s2_lo, s2_hi, slot), fd [F, 6]] and the first violated invariant
// ("" when none, or when ``check`` is off and the ranges could be read).
std::tuple<std::vector<torch::Tensor>, std::string> plan_coverage(
    const torch::Tensor& table, int64_t num_heads_q, std::vector<int64_t> S1, std::vector<int64_t> S2, bool has_cmp,
    int64_t cmp_topk, int64_t cmp_ratio, int64_t ori_mask_mode, int64_t ori_win_left, bool check) {
  TORCH_CHECK(table.numel() == TABLE_SIZE, "metadata: expected ", TABLE_SIZE, " entries, got ", table.numel());
  const auto tc = table.to(torch::kCPU, torch::kInt32).contiguous();
  const int32_t* v = tc.data_ptr<int32_t>();
  Params pp{(i64)S1.size(), num_heads_q, 1, S1, S2, has_cmp, has_cmp ? cmp_topk : 0, cmp_ratio, ori_mask_mode,
            ori_win_left, FA_CORES, FD_CORES, false};
  pp.finish();
  const Reader rd(pp);
  // decode: the enabled entries
  std::vector<Bound> starts, ends;
  std::vector<i64> first_fd;
  for (int c = 0; c < FA_CORES; ++c) {
    const int32_t* e = v + 8 * c;
    if (e[0] != 1) continue;
    starts.push_back({e[1], e[2], e[3]});
    ends.push_back({e[4], e[5], e[6]});
    first_fd.push_back(e[7]);
  }
  std::vector<std::array<i64, 6>> fd;
  for (int c = 0; c < FD_CORES; ++c) {
    const int32_t* e = v + FD_BASE + 8 * c;
    if (e[0] == 1) fd.push_back({e[1], e[2], e[3], e[4], e[5], e[6]});
  }
  const i64 R = rd.R, n = (i64)starts.size();
  std::vector<i64> held(R + 1, 0), whole;
  std::vector<Piece> partial;
  std::string error;
  try {
    // coverage: per core, the rows between its edge rows whole, the edge rows whole or in part
    for (i64 core = 0; core < n; ++core) {
      const auto [gs, ss] = rd.position(starts[core]);
      const auto [ge, se] = rd.position(ends[core]);
      if (std::make_pair(gs, ss) >= std::make_pair(ge, se)) continue;
      i64 k = 0;
      std::array<std::array<i64, 3>, 2> edges;
      int n_edges = 0;
      if (gs < R) edges[n_edges++] = {gs, ss, ge == gs ? se : rd.blocks[gs]};
      if (ge > gs) {
        ++held[gs + 1];
        --held[ge];
        if (ge < R && se > 0) edges[n_edges++] = {ge, 0, se};
      }
      for (int i = 0; i < n_edges; ++i) {
        const auto [g, lo, hi] = edges[i];
        if (hi <= lo) continue;
        if (lo > 0 || hi < rd.blocks[g]) {
          const i64 b = (i64)(std::upper_bound(rd.off.begin(), rd.off.end(), g) - rd.off.begin()) - 1;
          partial.push_back({core, b, g - rd.off[b], lo, hi, first_fd[core] + k});
          ++k;
        } else {
          whole.push_back(g);   // an edge row held whole: added to the counts after the prefix sum
        }
      }
    }
    if (check) {
      const bool support_fd = !fd.empty() || std::any_of(starts.begin(), starts.end(), [](const Bound& t) { return t.s != 0; }) ||
                              std::any_of(ends.begin(), ends.end(), [](const Bound& t) { return t.s != 0; });
      // invariants 1-3: the chain of ranges
      PLAN_ASSERT(1 <= n && n <= FA_CORES, "1: usedCoreNum " + std::to_string(n) + " not in [1, " + std::to_string(FA_CORES) + "]");
      PLAN_ASSERT(starts[0].b == 0 && starts[0].m == 0 && starts[0].s == 0, "2: start[0] = " + str(starts[0]));
      for (i64 i = 1; i < n; ++i) {
        const Bound &s = starts[i], &e = ends[i - 1];
        PLAN_ASSERT(s.b == e.b && s.m == e.m && s.s == e.s, "2: start[" + std::to_string(i) + "] = " + str(s) + " != end[" +
                                                                std::to_string(i - 1) + "] = " + str(e));
      }
      const Bound& last = ends[n - 1];
      PLAN_ASSERT(last.b == pp.B && last.m == 0 && last.s == 0, "3: end[last] = " + str(last));
      // invariant 4 on block coordinates
      std::vector<i64> cum(R + 1, 0);
      for (i64 g = 0; g < R; ++g) cum[g + 1] = cum[g] + rd.blocks[g];
      auto block_of = [&](const Bound& t) {
        const auto [g, s] = rd.position(t);
        if (s) PLAN_ASSERT(s <= rd.blocks[g], "4: row " + pair_repr(t.b, t.m) + " has blocks up to " +
                                                  std::to_string(rd.blocks[g]) + " but a core range bound is " + str(t));
        return cum[g] + s;
      };
      for (i64 core = 0; core < n; ++core) {
        const i64 a = block_of(starts[core]), b = block_of(ends[core]);
        PLAN_ASSERT(a <= b, "4: core " + std::to_string(core) + " range " + str(starts[core]) + " -> " + str(ends[core]) +
                                " runs backwards");
      }
      // invariants 5-6: FD data
      if (!support_fd) {
        PLAN_ASSERT(std::all_of(first_fd.begin(), first_fd.end(), [](i64 f) { return f == 0; }) && fd.empty(),
                    "5: FD data without support_fd");
      } else {
        std::map<std::pair<i64, i64>, std::vector<Piece>> parts;
        for (const Piece& p : partial) parts[{p.bn2, p.m}].push_back(p);
        // tasks in first-appearance order, keyed (bn2, m, ws, split)
        std::vector<std::array<i64, 4>> keys;
        std::vector<std::vector<std::pair<i64, i64>>> ranges;
        for (const auto& e : fd) {
          const std::array<i64, 4> key{e[0], e[1], e[2], e[3]};
          auto it = std::find(keys.begin(), keys.end(), key);
          if (it == keys.end()) {
            keys.push_back(key);
            ranges.emplace_back();
            it = keys.end() - 1;
          }
          ranges[it - keys.begin()].push_back({e[4], e[5]});
        }
        PLAN_ASSERT(keys.size() == parts.size(), "6: " + std::to_string(keys.size()) + " FD tasks for " +
                                                     std::to_string(parts.size()) + " split rows");
        PLAN_ASSERT((i64)fd.size() <= FD_CORES, "6: " + std::to_string(fd.size()) + " FD entries > aiv_core_num " +
                                                    std::to_string(FD_CORES));
        std::vector<size_t> order(keys.size());
        for (size_t i = 0; i < order.size(); ++i) order[i] = i;
        std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return keys[a][2] < keys[b][2]; });
        i64 next_slot = 0;
        for (size_t i : order) {
          const auto [bn2, m, ws, split] = keys[i];
          const auto it = parts.find({bn2, m});
          const std::vector<Piece>* row_parts = it == parts.end() ? nullptr : &it->second;
          PLAN_ASSERT(row_parts && (i64)row_parts->size() == split, "6: FD task " + pair_repr(bn2, m) + " split " +
                                                                        std::to_string(split) + " vs " + pieces_repr(row_parts));
          PLAN_ASSERT(ws == next_slot, "6: workspace slots not consecutive at task " + pair_repr(bn2, m));
          std::vector<i64> slots;
          for (const Piece& p : *row_parts) slots.push_back(p.slot);
          std::sort(slots.begin(), slots.end());
          bool consecutive = true;
          for (i64 j = 0; j < split; ++j) consecutive = consecutive && slots[j] == ws + j;
          PLAN_ASSERT(consecutive, "6: partial rows vs slots");
          next_slot += split;
          auto rs = ranges[i];
          std::sort(rs.begin(), rs.end());
          i64 pos = 0;
          for (const auto& [m_start, m_num] : rs) {
            PLAN_ASSERT(m_start == pos && m_num > 0, "6: FD M ranges of " + pair_repr(bn2, m) + " do not partition");
            pos += m_num;
          }
          const i64 ms = rd.m_size(bn2, m);
          PLAN_ASSERT(pos == ms, "6: FD M ranges of " + pair_repr(bn2, m) + " cover " + std::to_string(pos) +
                                     " rows, the m-block has " + std::to_string(ms));
        }
      }
    }
  } catch (const PlanError& e) {
    error = e.what;
  }
  // whole rows: the interiors' counts plus the edge rows held whole, none for rows without blocks
  std::vector<i64> count(R, 0);
  i64 run = 0;
  for (i64 g = 0; g < R; ++g) count[g] = (run += held[g]);
  for (i64 g : whole) ++count[g];
  std::vector<i64> whole_rows;
  for (i64 g = 0; g < R; ++g)
    if (rd.blocks[g] != 0)
      for (i64 c = 0; c < count[g]; ++c) whole_rows.push_back(g);
  auto i64_tensor = [](const std::vector<i64>& x, std::vector<int64_t> shape) {
    auto t = torch::empty(shape, torch::dtype(torch::kInt64));
    std::copy(x.begin(), x.end(), t.data_ptr<int64_t>());
    return t;
  };
  std::vector<i64> rows;
  rows.reserve(5 * R);
  for (const auto* a : {&rd.first, &rd.win_end, &rd.s2_start, &rd.s2_end, &rd.blocks}) rows.insert(rows.end(), a->begin(), a->end());
  std::vector<i64> part_flat, fd_flat;
  for (const Piece& p : partial) part_flat.insert(part_flat.end(), {p.core, p.bn2, p.m, p.lo, p.hi, p.slot});
  for (const auto& e : fd) fd_flat.insert(fd_flat.end(), e.begin(), e.end());
  return {{i64_tensor(rd.off, {pp.B + 1}), i64_tensor(rd.S1v, {pp.B}), i64_tensor(rows, {5, R}),
           i64_tensor(whole_rows, {(int64_t)whole_rows.size()}), i64_tensor(part_flat, {(int64_t)partial.size(), 6}),
           i64_tensor(fd_flat, {(int64_t)fd.size(), 6})},
          error};
}
