// The A* search's inner loop (search/astar.py holds the algorithm's description and builds
// every table this file reads: options priced by program.node_times, moves priced by
// program.move_price, the heuristic, the sync bookkeeping's constants). This file only walks
// states: it expands them, tests dominance and keeps the queue, exactly as astar.py documents.
// Nothing here prices anything: every number comes from Python.
//
// Properties are ints, tensor id * 64 + placement code (R=0, D=1, P=2, S(d)=3+d).

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <memory_resource>
#include <tuple>
#include <queue>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int CODE_BITS = 64;
constexpr int R_CODE = 0;
constexpr uint64_t ALL_CODES = ~0ULL;  // what R reaches: every placement (a superset is harmless in reach())
constexpr double INF = std::numeric_limits<double>::infinity();

using Prop = int32_t;
// A search's states allocate from one arena, released when the next search starts: states
// are never freed one by one (the search keeps them all for the path back).
template <class T>
using Vec = std::pmr::vector<T>;
using Shared = std::array<int, 3>;  // (parameter id, placement code, segment)

struct Option {  // a strategy of a node, as the search sees it (whatever the ratios)
    std::vector<std::pair<int, int>> reqs;  // (tensor id, placement code) needed
    std::vector<Prop> outs;                 // properties produced (sorted)
    double sync_bytes = 0.0, inner = 0.0;
    std::vector<Shared> keeps, uses;
};

struct MoveKind {  // a move from placement code `src` (its price comes with each search)
    int src;
    bool communicates, has_fwd;
};

struct Price {
    std::vector<double> fwd, bwd;
};

// Everything the searches of one graph share: options, move lists, stage and bucket
// boundaries, when tensors die, gradient-sync constants (astar.Frame builds it).
struct Frame {
    int m, n;
    std::vector<std::vector<Option>> opts;
    std::vector<int> alike;  // per node: its price class (nodes alike in op, work and tensors)
    std::vector<int> segment_of;
    std::vector<bool> seg_start, cut_after, bucket_end;
    std::vector<std::vector<int>> dead_at, shared_done;
    std::unordered_map<long, int> move_class;  // (tensor, code, segment) -> move class
    std::vector<std::vector<MoveKind>> move_kinds;  // per move class
    double sync_slope, sync_alpha;
    std::vector<double> sync_rest;
    py::function grad_sync;
    // the pending-move bound: per activation tensor, the nodes that need it (ascending), its
    // placement codes and the segments of those nodes
    std::vector<std::vector<int>> consumers, consumer_segs;
    std::vector<int> ncodes;
};

struct Sync {
    double done = 0, opening = 0, anchor = 0, bucket = 0, synced = 0, excess = -INF;
    double bucket_seconds = 0;  // grad_sync(bucket) while bucket != 0
};

struct Choice {  // one move of a step: tensor, destination code, index in its move list
    int t, code, index;
};

struct State {
    explicit State(std::pmr::memory_resource* r)
        : props(r), comm(r), shared(r), fwd(r), bwd(r), combo(r), reach(r), bound(r), key(r) {}
    int k = 0, parent = -1;
    Vec<Prop> props;   // sorted, unique
    Vec<int> comm;     // tensors communicated forward (sorted)
    Vec<Shared> shared;
    double closed = 0.0;
    Vec<double> fwd, bwd;
    bool has_sync = false;
    Sync sync;
    int option = -1;
    Vec<Choice> combo;
    bool pre = false;  // rebalanced the sharded properties first (a segment start)
    // caches
    bool has_reach = false, has_bound = false, has_key = false;
    Vec<uint64_t> reach;  // per live tensor (in id order, as in the key): the codes held or a free move away
    Vec<int> bound;
    Vec<int> key;

    double exposed() const { return has_sync && sync.excess > 0 ? sync.excess : 0.0; }
};

template <class V, class T>
bool contains(const V& sorted, const T& x) {
    return std::binary_search(sorted.begin(), sorted.end(), x);
}

template <class A, class B>
bool subset(const A& a, const B& b) {  // a <= b, both sorted
    return std::includes(b.begin(), b.end(), a.begin(), a.end());
}

template <class V>
void sort_unique(V& v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
}

template <class V>
inline double vmax(const V& v) { return *std::max_element(v.begin(), v.end()); }

inline long move_key(int t, int code, int seg) { return (static_cast<long>(t) * CODE_BITS + code) * 4096 + seg; }

struct KeyHash {
    size_t operator()(const Vec<int>& v) const {
        size_t h = 1469598103934665603ULL;
        for (int x : v) h = (h ^ static_cast<size_t>(x)) * 1099511628211ULL;
        return h;
    }
};

struct Result {
    int status;  // 0 found, 1 none found, 2 expansion limit
    double cost;
    int at_node;
    py::list path;
    // The least score of the programs the width cap dropped (INF: none): with an admissible
    // score, no program through them costs less, so min(cost, dropped) bounds the optimum.
    double dropped = INF;
};

class Space {
   public:
    // One search's space: the frame under one set of ratios. prices[a][i]: option i of the
    // nodes of price class a; allowed[k]: the options of node k a restriction leaves;
    // move_prices[c][i]: (forward s, backward s, allowed) of move i of move class c.
    Space(std::shared_ptr<Frame> frame, std::vector<std::vector<Price>> prices, std::vector<std::vector<int>> allowed,
          std::vector<std::vector<std::tuple<double, double, bool>>> move_prices)
        : fr_(std::move(frame)), prices_(std::move(prices)), allowed_(std::move(allowed)), move_prices_(std::move(move_prices)) {
        m_ = fr_->m;
        n_ = fr_->n;
        zero_.assign(m_, 0.0);
        suffix_f_.assign(n_ + 1, zero_);
        suffix_b_.assign(n_ + 1, zero_);
        wsuffix_f_.assign(n_ + 1, 0.0);
        wsuffix_b_.assign(n_ + 1, 0.0);
        expanded_at.assign(n_ + 1, 0);
        dist_of_.assign(fr_->ncodes.size(), -1);
    }

    void set_rebalance(int t, int code, int k, double f, double b) { rebalance_[rebalance_key(t, code, k)] = {f, b}; }

    // Turns on the pending-move bound (astar.py's score) for this space's searches.
    void use_pending() { pending_ = !fr_->consumers.empty(); }
    // The bound for a state at node k holding `props` (for tests).
    double pending_at(int k, std::vector<Prop> props) {
        for (Prop p : props)
            if (p < 0 || p / CODE_BITS >= static_cast<int>(fr_->ncodes.size()) || p % CODE_BITS >= fr_->ncodes[p / CODE_BITS])
                throw std::invalid_argument("pending_at: a property names no tensor or placement of it");
        sort_unique(props);
        State s(&arena_);
        s.k = k;
        s.props.assign(props.begin(), props.end());
        return pending_ ? pending(s, n_) : 0.0;
    }

    // The weights of the computation bound's second form (astar.py): any weights summing to 1
    // make a weighted mean of the devices' times a lower bound of their maximum.
    void set_weights(std::vector<double> weights) {
        if (static_cast<int>(weights.size()) != m_) throw std::invalid_argument("set_weights: one weight per device");
        weights_ = std::move(weights);
    }

    // Per device, the cheapest computation left in each node's chunk (the heuristic's suffix):
    // at a cut the rest is empty. With weights, also the cheapest weighted mean left, node by node.
    void compute_suffix() {
        wsuffix_f_.assign(n_ + 1, 0.0);
        wsuffix_b_.assign(n_ + 1, 0.0);
        for (int k = n_ - 1; k >= 0; --k) {
            std::vector<double> lf(m_, INF), lb(m_, INF);
            double wf = INF, wb = INF;
            for (int i : allowed_[k]) {
                const Price& p = price(k, i);
                for (int j = 0; j < m_; ++j) {
                    lf[j] = std::min(lf[j], p.fwd[j]);
                    lb[j] = std::min(lb[j], p.bwd[j]);
                }
                if (!weights_.empty()) {
                    wf = std::min(wf, weighted(p.fwd));
                    wb = std::min(wb, weighted(p.bwd));
                }
            }
            const bool cut = fr_->cut_after[k];
            for (int j = 0; j < m_; ++j) {
                suffix_f_[k][j] = (cut ? 0.0 : suffix_f_[k + 1][j]) + lf[j];
                suffix_b_[k][j] = (cut ? 0.0 : suffix_b_[k + 1][j]) + lb[j];
            }
            if (!weights_.empty()) {
                wsuffix_f_[k] = (cut ? 0.0 : wsuffix_f_[k + 1]) + wf;
                wsuffix_b_[k] = (cut ? 0.0 : wsuffix_b_[k + 1]) + wb;
            }
        }
    }
    double suffix_max(int k) const {
        return std::max(vmax(suffix_f_[k]), wsuffix_f_[k]) + std::max(vmax(suffix_b_[k]), wsuffix_b_[k]);
    }
    void clear_suffix(int k) {
        suffix_f_[k] = zero_;
        suffix_b_[k] = zero_;
        wsuffix_f_[k] = wsuffix_b_[k] = 0.0;
    }
    // The bound of the chunks ahead of each node, for programs whose shared parameters were
    // first loaded as `constraints` say (none: any way, or whole); and what the chunks ahead
    // in the node's gradient bucket add at least to the bucket's sync (astar.py's score).
    // beyond[k]: the most, over gradient buckets after node k's, of the forward cost ahead up to
    // that bucket with its sync, plus the whole cost from it on, sync priced at the least slope
    // up to and in that bucket (-inf: no later bucket).
    void set_future(std::vector<Shared> constraints, std::vector<double> future, std::vector<double> bucket_ahead,
                    std::vector<double> beyond) {
        sort_unique(constraints);
        futures_[Vec<Shared>(constraints.begin(), constraints.end())] =
            Future{std::move(future), std::move(bucket_ahead), std::move(beyond)};
    }

    // The score: cost so far plus a lower bound of what any completion adds (astar.py).
    double score(State& s, bool with_future, int goal) {
        double a, b;
        if (s.k == goal) {  // complete: its open stage is all that is left
            a = vmax(s.fwd);
            b = vmax(s.bwd);
        } else {
            const auto& sf = suffix_f_[s.k];
            const auto& sb = suffix_b_[s.k];
            a = b = -INF;
            for (int j = 0; j < m_; ++j) {
                a = std::max(a, s.fwd[j] + sf[j]);
                b = std::max(b, s.bwd[j] + sb[j]);
            }
            if (!weights_.empty()) {
                a = std::max(a, weighted(s.fwd) + wsuffix_f_[s.k]);
                b = std::max(b, weighted(s.bwd) + wsuffix_b_[s.k]);
            }
        }
        if (forward_only_) b = 0.0;
        const Future* f = with_future ? future(s) : nullptr;
        double stages = s.closed + a + b + (f ? f->chunks[s.k] : 0.0);
        if (pending_ && !forward_only_ && s.k < goal) stages += pending(s, goal);
        if (!s.has_sync) return stages;
        double result = stages + exposed_bound(s, f);
        if (f && f->beyond[s.k] > -INF) {
            // A later bucket's sync ends after all the backward before that bucket's start, so
            // the iteration costs at least the forward so far and ahead up to that bucket, all
            // sync so far and up to it, and everything from it on (astar.py).
            double forward = s.closed - s.sync.done - s.sync.opening + a;
            double synced = s.sync.synced + (s.sync.bucket != 0.0 ? s.sync.bucket_seconds : 0.0);
            result = std::max(result, forward + synced + f->beyond[s.k]);
        }
        return result;
    }

    // See astar.py: best-first on cost + heuristic, dominance pruning, width cap.
    // shared: constraints on the shared parameters' later loads to start with (a chunk's bound).
    // sync_price: without sync, seconds per byte of gradient a node makes the runtime sync,
    // added to the stages (a chunk's bound with its sync priced at the least slope).
    // forward_only: without sync, stages cost their forward part only (a chunk's forward bound).
    // upper: the cost of a program known already (INF: none); only cheaper ones are returned.
    Result search(int start_k, std::vector<Prop> start_props, std::vector<Shared> shared, bool with_sync, int goal,
                  bool with_future, long max_expansions, int width, long width_after, double sync_price,
                  bool forward_only, double upper) {
        sync_price_ = with_sync ? 0.0 : sync_price;
        forward_only_ = !with_sync && forward_only;
        states_.clear();
        table_.clear();
        arena_.release();
        sort_unique(start_props);
        State start(&arena_);
        start.k = start_k;
        start.props.assign(start_props.begin(), start_props.end());
        sort_unique(shared);
        start.shared.assign(shared.begin(), shared.end());
        start.fwd.assign(zero_.begin(), zero_.end());
        start.bwd.assign(zero_.begin(), zero_.end());
        start.has_sync = with_sync;
        states_.reserve(std::min<long>(max_expansions * 4, 1 << 15));
        states_.push_back(std::move(start));

        std::vector<long> per_node(n_ + 1, 0);
        long counter = 0;
        using Entry = std::tuple<double, int, long, int>;  // score, -k, order, state
        std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
        int best = -1;
        double best_cost = upper;  // a program known to cost `upper`: only cheaper ones are looked for
        long limit = expanded + max_expansions;
        long width_from = expanded + width_after;
        double dropped = INF;

        {
            queue.emplace(score(states_[0], with_future, goal), -states_[0].k, counter++, 0);
        }
        std::vector<int> children;
        while (!queue.empty()) {
            auto [popped, negk, order, idx] = queue.top();
            queue.pop();
            if (popped >= best_cost) break;
            if (states_[idx].k == goal) {
                const State& s = states_[idx];
                double final_cost = s.closed + vmax(s.fwd) + (forward_only_ ? 0.0 : vmax(s.bwd)) + s.exposed();
                if (final_cost < best_cost) {
                    best = idx;
                    best_cost = final_cost;
                }
                continue;
            }
            if (dominated(idx)) continue;
            if (width >= 0) {
                int k = states_[idx].k;
                if (per_node[k] >= width && expanded >= width_from) {
                    exhaustive = false;
                    dropped = std::min(dropped, popped);
                    continue;
                }
                per_node[k] += 1;
            }
            insert(idx);
            if (expanded >= limit) return Result{2, INF, states_[idx].k, py::list()};
            children.clear();
            expand(idx, children);
            for (int c : children) {
                double sc = score(states_[c], with_future, goal);
                if (sc < best_cost && !dominated(c)) queue.emplace(sc, -states_[c].k, counter++, c);
            }
        }
        if (best < 0) return Result{1, INF, -1, py::list(), dropped};
        py::list path;
        std::vector<int> chain;
        for (int i = best; i > 0; i = states_[i].parent) chain.push_back(i);
        std::reverse(chain.begin(), chain.end());
        for (int i : chain) {
            const State& s = states_[i];
            py::list combo;
            for (const Choice& c : s.combo) combo.append(py::make_tuple(c.t, c.code, c.index));
            py::list pre;
            if (s.pre)
                for (Prop p : states_[s.parent].props)
                    if (p % CODE_BITS >= 3) pre.append(p);
            path.append(py::make_tuple(s.k - 1, s.option, combo, pre));
        }
        return Result{0, best_cost, -1, path, dropped};
    }

    long expanded = 0, generated = 0;
    bool exhaustive = true;
    std::vector<long> expanded_at;  // expansions per node index, over all searches of this space

   private:
    long rebalance_key(int t, int code, int k) const { return (static_cast<long>(t) * CODE_BITS + code) * (n_ + 1) + k; }

    const Price& price(int k, int option) const { return prices_[fr_->alike[k]][option]; }

    double grad_sync(double nbytes) {
        auto it = grad_sync_cache_.find(nbytes);
        if (it != grad_sync_cache_.end()) return it->second;
        double v = fr_->grad_sync(nbytes).cast<double>();
        grad_sync_cache_.emplace(nbytes, v);
        return v;
    }

    struct Future {
        std::vector<double> chunks, bucket_ahead, beyond;
    };

    const Future* future(const State& s) const {
        auto it = futures_.find(s.shared);
        if (it == futures_.end()) it = futures_.find(Vec<Shared>());
        return it == futures_.end() ? nullptr : &it->second;
    }

    // A lower bound of the exposed sync of any completion (astar.py's score): the excess so
    // far, and the open bucket's as if it gained no more than the chunks ahead in it must add.
    double exposed_bound(const State& s, const Future* f) {
        double bound = s.sync.excess;
        double ahead = f ? f->bucket_ahead[s.k] : 0.0;
        if (s.sync.bucket != 0.0)
            bound = std::max(bound, s.sync.synced + s.sync.bucket_seconds + s.sync.anchor + ahead);
        else if (ahead > 0.0)
            bound = std::max(bound, s.sync.synced + s.sync.anchor + ahead);
        return bound > 0 ? bound : 0.0;
    }

    // Communication no completion avoids: for nodes ahead whose inputs include live tensors,
    // the cheapest moves their cheapest strategy needs for those inputs from the placements held
    // (0 when a placement held, or R, serves). Summed over nodes that share no live input, so
    // no move is counted twice (astar.py's score).
    double pending(const State& s, int goal) {
        auto& held = held_;
        held.clear();  // (tensor, code mask) per live tensor
        for (Prop p : s.props) {
            int t = p / CODE_BITS, code = p % CODE_BITS;
            if (held.empty() || held.back().first != t) held.emplace_back(t, 0);
            held.back().second |= 1ULL << code;
        }
        auto& nodes = pend_nodes_;
        nodes.clear();
        for (const auto& [t, mask] : held) {
            const auto& cs = fr_->consumers[t];
            for (auto it = std::lower_bound(cs.begin(), cs.end(), s.k); it != cs.end() && *it < goal; ++it) nodes.push_back(*it);
        }
        sort_unique(nodes);
        auto& used = pend_used_;
        used.clear();
        double total = 0.0;
        for (int k : nodes) {
            double best = INF;
            for (int oi : allowed_[k]) {
                // per input tensor, its dearest placement: a tensor needed in two placements may
                // reach both through one shared move, so only the dearer chain counts
                auto& worst = pend_worst_;
                worst.clear();
                for (const auto& [t, code] : fr_->opts[k][oi].reqs) {
                    auto h = std::lower_bound(held.begin(), held.end(), std::make_pair(t, uint64_t(0)),
                                              [](const auto& x, const auto& y) { return x.first < y.first; });
                    if (h == held.end() || h->first != t) continue;  // not produced yet
                    uint64_t mask = h->second;
                    if (mask & (1ULL << code) || mask & 1ULL) continue;  // held, or R: a free move away
                    const int nc = fr_->ncodes[t];
                    const double* row = distances(t).data();
                    double d = INF;
                    for (int src = 0; src < nc; ++src)
                        if (mask >> src & 1ULL) d = std::min(d, row[src * nc + code]);
                    auto w = std::find_if(worst.begin(), worst.end(), [t = t](const auto& e) { return e.first == t; });
                    if (w == worst.end())
                        worst.emplace_back(t, d);
                    else
                        w->second = std::max(w->second, d);
                }
                double need = 0.0;
                for (const auto& e : worst) need += e.second;
                best = std::min(best, need);
                if (best == 0.0) break;
            }
            if (best == 0.0 || best == INF) continue;
            bool clash = false;
            for (const auto& [t, code] : fr_->opts[k][allowed_[k][0]].reqs)
                if (std::find(used.begin(), used.end(), t) != used.end()) clash = true;
            if (clash) continue;
            for (const auto& [t, code] : fr_->opts[k][allowed_[k][0]].reqs) used.push_back(t);
            total += best;
        }
        return total;
    }

    // Per placement pair (src * codes + dst) of tensor t, the least seconds (forward plus
    // backward) of a chain of allowed moves from src to dst for t's consumers, each hop priced
    // at its least over their segments (a chain may hop in several). Hops into a code no
    // consumer needs (so unpriced) count as free: a lower bound still, as the last hop into a
    // needed code is priced. Tensors alike in move classes share a table.
    const std::vector<double>& distances(int t) {
        auto& cached = dist_of_[t];
        if (cached >= 0) return dists_[cached];
        const int nc = fr_->ncodes[t];
        std::vector<int> key;
        for (int seg : fr_->consumer_segs[t])
            for (int code = 0; code < nc; ++code) {
                auto it = fr_->move_class.find(move_key(t, code, seg));
                key.push_back(it == fr_->move_class.end() ? -1 : it->second);
            }
        auto [it, fresh] = dist_index_.try_emplace(key, static_cast<int>(dists_.size()));
        if (fresh) {
            std::vector<double> d(nc * nc, INF);  // hops first, each at its least over the segments
            size_t at = 0;
            for (size_t si = 0; si < fr_->consumer_segs[t].size(); ++si) {
                for (int c = 0; c < nc; ++c) {
                    d[c * nc + c] = 0.0;
                    int cls = key[at++];
                    if (cls < 0) {
                        for (int src = 0; src < nc; ++src) d[src * nc + c] = 0.0;
                        continue;
                    }
                    const auto& kinds = fr_->move_kinds[cls];
                    const auto& mp = move_prices_[cls];
                    for (size_t i = 0; i < kinds.size(); ++i)
                        if (std::get<2>(mp[i])) {
                            double& e = d[kinds[i].src * nc + c];
                            e = std::min(e, std::get<0>(mp[i]) + std::get<1>(mp[i]));
                        }
                }
            }
            for (int via = 0; via < nc; ++via)
                for (int a = 0; a < nc; ++a)
                    for (int b = 0; b < nc; ++b)
                        d[a * nc + b] = std::min(d[a * nc + b], d[a * nc + via] + d[via * nc + b]);
            dists_.push_back(std::move(d));
        }
        cached = it->second;
        return dists_[cached];
    }

    // Closes the open stage: its slowest forward and backward, plus the collectives that open the next.
    void close(double& closed, Vec<double>& fwd, Vec<double>& bwd, double& done, double& opening,
               double comm_f, double comm_b) const {
        double slowest = vmax(bwd);
        closed += forward_only_ ? vmax(fwd) + comm_f : vmax(fwd) + slowest + comm_f + comm_b;
        done = done + slowest + opening;
        opening = comm_b;
        std::fill(fwd.begin(), fwd.end(), 0.0);
        std::fill(bwd.begin(), bwd.end(), 0.0);
    }

    // Every child of a state: a strategy for node k with the moves its inputs need; stages and
    // gradient buckets assembled exactly as program.walk does.
    void expand(int idx, std::vector<int>& out) {
        expanded += 1;
        expanded_at[states_[idx].k] += 1;
        // copies: states_ may reallocate while children are appended
        const int k = states_[idx].k;
        const int seg = fr_->segment_of[k];
        const std::vector<Prop> props(states_[idx].props.begin(), states_[idx].props.end());
        const std::vector<int> comm0(states_[idx].comm.begin(), states_[idx].comm.end());
        const std::vector<Shared> shared0(states_[idx].shared.begin(), states_[idx].shared.end());
        double closed = states_[idx].closed;
        Vec<double> fwd(states_[idx].fwd, &arena_), bwd(states_[idx].bwd, &arena_);
        const bool has_sync = states_[idx].has_sync;
        const Sync sync = states_[idx].sync;
        double done = has_sync ? sync.done : 0.0, opening = has_sync ? sync.opening : 0.0;
        bool pre = false;
        if (fr_->seg_start[k]) {  // re-split every sharded live tensor to the new segment's ratios
            for (Prop p : props) {
                if (p % CODE_BITS >= 3) {
                    auto it = rebalance_.find(rebalance_key(p / CODE_BITS, p % CODE_BITS, k));
                    if (it == rebalance_.end()) throw std::runtime_error("search core: a rebalance was not priced");
                    close(closed, fwd, bwd, done, opening, it->second.first, it->second.second);
                    pre = true;
                }
            }
        }
        const auto& dead = fr_->dead_at[k];
        const bool cut = fr_->cut_after[k];
        const bool bucket_end = fr_->bucket_end[k];
        std::vector<int> classes;
        auto& cands = cands_;  // per missing requirement: the usable moves (buffers kept between expansions)
        std::vector<std::pair<int, int>> missing;
        for (int oi : allowed_[k]) {
            const Option& opt = fr_->opts[k][oi];
            const Price& pr = price(k, oi);
            std::vector<Shared> shared = shared0;
            if ((has_sync || !shared0.empty()) && (!opt.uses.empty() || !opt.keeps.empty())) {
                if (!shared_ok(shared, opt.uses)) continue;
                if (has_sync && !opt.keeps.empty()) {
                    shared.insert(shared.end(), opt.keeps.begin(), opt.keeps.end());
                    sort_unique(shared);
                }
                const auto& done_ids = fr_->shared_done[k];
                if (!done_ids.empty())
                    shared.erase(std::remove_if(shared.begin(), shared.end(),
                                                [&](const Shared& e) {
                                                    return std::find(done_ids.begin(), done_ids.end(), e[0]) != done_ids.end();
                                                }),
                                 shared.end());
            }
            missing.clear();
            size_t nc = 0;  // missing requirements so far
            classes.clear();
            bool feasible = true;
            for (const auto& [t, code] : opt.reqs) {
                if (contains(props, t * CODE_BITS + code)) continue;
                auto it = fr_->move_class.find(move_key(t, code, seg));
                if (it == fr_->move_class.end()) throw std::runtime_error("search core: a move list is missing");
                const auto& kinds = fr_->move_kinds[it->second];
                const auto& mp = move_prices_[it->second];
                if (nc == cands.size()) cands.emplace_back();
                auto& usable = cands[nc];
                usable.clear();
                bool communicated = contains(comm0, t);
                for (int i = 0; i < static_cast<int>(kinds.size()); ++i) {
                    if (std::get<2>(mp[i]) && contains(props, t * CODE_BITS + kinds[i].src) && !(kinds[i].has_fwd && communicated))
                        usable.push_back(i);
                }
                if (usable.empty()) {
                    feasible = false;
                    break;
                }
                missing.emplace_back(t, code);
                ++nc;
                classes.push_back(it->second);
            }
            if (!feasible) continue;
            // every combination of one move per missing requirement (itertools.product order)
            auto& pick = pick_;
            pick.assign(nc, 0);
            while (true) {
                State child(&arena_);
                child.k = k + 1;
                child.parent = idx;
                child.option = oi;
                child.pre = pre;
                child.shared.assign(shared.begin(), shared.end());
                double c_closed = closed, c_done = done, c_opening = opening;
                Vec<double> c_fwd(fwd, &arena_), c_bwd(bwd, &arena_);
                child.comm.reserve(comm0.size() + nc);
                child.comm.assign(comm0.begin(), comm0.end());
                child.props.reserve(props.size() + nc + opt.outs.size());
                child.props.assign(props.begin(), props.end());
                for (size_t r = 0; r < nc; ++r) {
                    int i = cands[r][pick[r]];
                    const MoveKind& mv = fr_->move_kinds[classes[r]][i];
                    const auto& mp = move_prices_[classes[r]][i];
                    int t = missing[r].first;
                    if (mv.communicates) close(c_closed, c_fwd, c_bwd, c_done, c_opening, std::get<0>(mp), std::get<1>(mp));
                    if (mv.has_fwd) child.comm.push_back(t);
                    child.props.push_back(t * CODE_BITS + missing[r].second);
                    child.combo.push_back(Choice{t, missing[r].second, i});
                }
                child.props.insert(child.props.end(), opt.outs.begin(), opt.outs.end());
                sort_unique(child.props);
                sort_unique(child.comm);
                if (opt.inner != 0.0) close(c_closed, c_fwd, c_bwd, c_done, c_opening, 0.0, opt.inner);  // the node syncs devices itself
                for (int j = 0; j < m_; ++j) {
                    c_fwd[j] += pr.fwd[j];
                    c_bwd[j] += pr.bwd[j];
                }
                if (!dead.empty()) {
                    auto is_dead = [&](int t) { return std::find(dead.begin(), dead.end(), t) != dead.end(); };
                    child.props.erase(std::remove_if(child.props.begin(), child.props.end(),
                                                     [&](Prop p) { return is_dead(p / CODE_BITS); }),
                                      child.props.end());
                    child.comm.erase(std::remove_if(child.comm.begin(), child.comm.end(), is_dead), child.comm.end());
                }
                if (cut) close(c_closed, c_fwd, c_bwd, c_done, c_opening, 0.0, 0.0);  // the stage ends at the layer boundary
                child.has_sync = has_sync;
                child.sync = sync;
                if (has_sync) {
                    child.sync.done = c_done;
                    child.sync.opening = c_opening;
                    child.sync.bucket = sync.bucket + opt.sync_bytes;
                    if (opt.sync_bytes != 0.0) child.sync.bucket_seconds = grad_sync(child.sync.bucket);
                    if (bucket_end) {  // the bucket is complete; the next one begins
                        if (child.sync.bucket != 0.0) {
                            child.sync.synced += child.sync.bucket_seconds;
                            child.sync.excess = std::max(child.sync.excess, child.sync.synced + child.sync.anchor);
                            child.sync.bucket = 0.0;
                        }
                        child.sync.anchor = -(c_done + c_opening);
                    }
                }
                child.closed = c_closed + sync_price_ * opt.sync_bytes;
                child.fwd = std::move(c_fwd);
                child.bwd = std::move(c_bwd);
                generated += 1;
                states_.push_back(std::move(child));
                out.push_back(static_cast<int>(states_.size()) - 1);
                int r = static_cast<int>(nc) - 1;  // the next combination
                while (r >= 0 && ++pick[r] == cands[r].size()) pick[r--] = 0;
                if (r < 0) break;
            }
        }
    }

    // Later uses of a shared parameter load it as first loaded (unless that was whole).
    template <class A>
    static bool shared_ok(const A& shared, const std::vector<Shared>& uses) {
        for (const Shared& u : uses)
            for (const Shared& e : shared)
                if (e[0] == u[0] && (u[1] != e[1] || u[2] != e[2])) return false;
        return true;
    }

    // The properties plus those one free move away (R slices, duplicates and zero-pads for free),
    // as a code mask per live tensor: states compared share their live tensors (the key).
    const Vec<uint64_t>& reach(int idx) {
        State& s = states_[idx];
        if (!s.has_reach) {
            s.reach.reserve(s.props.size());
            int last = -1;
            for (Prop p : s.props) {
                int t = p / CODE_BITS, code = p % CODE_BITS;
                if (t != last) {
                    s.reach.push_back(0);
                    last = t;
                }
                s.reach.back() |= code == R_CODE ? ALL_CODES : (1ULL << code);
            }
            s.has_reach = true;
        }
        return s.reach;
    }

    static bool within(const Vec<uint64_t>& a, const Vec<uint64_t>& b) {  // a <= b, tensor by tensor
        for (size_t i = 0; i < a.size(); ++i)
            if (a[i] & ~b[i]) return false;
        return true;
    }

    // The communicated tensors a state may not communicate again and cannot do without.
    const Vec<int>& bound(int idx) {
        State& s = states_[idx];
        if (!s.has_bound) {
            for (int t : s.comm)
                if (!contains(s.props, t * CODE_BITS + R_CODE)) s.bound.push_back(t);
            s.has_bound = true;
        }
        return s.bound;
    }

    // Only programs holding the same live tensors (any placements) are compared.
    const Vec<int>& key(int idx) {
        State& s = states_[idx];
        if (!s.has_key) {
            s.key.reserve(2 + 3 * s.shared.size() + s.props.size());
            s.key.push_back(s.k);
            s.key.push_back(static_cast<int>(s.shared.size()));
            for (const Shared& e : s.shared) s.key.insert(s.key.end(), e.begin(), e.end());
            int last = -1;
            for (Prop p : s.props)
                if (p / CODE_BITS != last) s.key.push_back(last = p / CODE_BITS);
            s.has_key = true;
        }
        return s.key;
    }

    bool dominated(int idx) {
        auto it = table_.find(key(idx));
        if (it == table_.end()) return false;
        const auto& r = reach(idx);
        for (int e : it->second)
            if (within(r, reach(e)) && subset(bound(e), states_[idx].comm) && no_dearer(e, idx)) return true;
        return false;
    }

    // Adds an expanded state, dropping the entries it dominates.
    void insert(int idx) {
        auto& entries = table_[key(idx)];
        const auto& r = reach(idx);
        const auto& b = bound(idx);
        std::vector<int> kept;
        for (int e : entries)
            if (!(within(reach(e), r) && subset(b, states_[e].comm) && no_dearer(idx, e))) kept.push_back(e);
        kept.push_back(idx);
        entries = std::move(kept);
    }

    // a costs no more than b after any common continuation (the proof: astar.py's docstring).
    bool no_dearer(int ai, int bi) const {
        const State& a = states_[ai];
        const State& b = states_[bi];
        double extra = a.closed - b.closed;
        double df = -INF, db = -INF, db_min = INF;
        for (int j = 0; j < m_; ++j) {
            df = std::max(df, a.fwd[j] - b.fwd[j]);
            double d = a.bwd[j] - b.bwd[j];
            db = std::max(db, d);
            db_min = std::min(db_min, d);
        }
        if (df > 0) extra += df;
        if (db > 0 && !forward_only_) extra += db;
        if (!a.has_sync) return extra <= 0;
        const Sync& sa = a.sync;
        const Sync& sb = b.sync;
        if (sa.bucket != 0.0 && sb.bucket == 0.0) return false;
        double gap = a.exposed() - b.exposed();
        double queued_a = sa.synced + fr_->sync_slope * sa.bucket;
        if (queued_a + fr_->sync_alpha + fr_->sync_rest[a.k] + sa.anchor > 0) {
            double queued_b = sb.synced + fr_->sync_slope * sb.bucket;
            double open_bucket = queued_a + sa.anchor - queued_b - sb.anchor;
            double later = queued_a - sa.done - sa.opening - queued_b + sb.done + sb.opening + std::max(0.0, -db_min);
            gap = std::max(gap, std::max(open_bucket, later));
        }
        return extra + gap <= 0;
    }

    std::shared_ptr<Frame> fr_;
    std::vector<std::vector<Price>> prices_;
    std::vector<std::vector<int>> allowed_;
    std::vector<std::vector<std::tuple<double, double, bool>>> move_prices_;
    int m_, n_;
    std::unordered_map<double, double> grad_sync_cache_;
    std::unordered_map<long, std::pair<double, double>> rebalance_;
    std::vector<double> zero_;
    std::vector<std::vector<double>> suffix_f_, suffix_b_;
    std::vector<double> weights_, wsuffix_f_, wsuffix_b_;  // empty weights: no weighted bound
    template <class V>
    double weighted(const V& times) const {
        double sum = 0.0;
        for (int j = 0; j < m_; ++j) sum += weights_[j] * times[j];
        return sum;
    }
    std::map<Vec<Shared>, Future> futures_;
    double sync_price_ = 0.0;
    bool forward_only_ = false;
    std::vector<std::vector<int>> cands_;
    std::vector<size_t> pick_;
    bool pending_ = false;
    std::vector<int> dist_of_;  // per tensor: its table in dists_ (-1: not made yet)
    std::vector<std::vector<double>> dists_;
    std::map<std::vector<int>, int> dist_index_;
    std::vector<std::pair<int, uint64_t>> held_;
    std::vector<int> pend_nodes_, pend_used_;
    std::vector<std::pair<int, double>> pend_worst_;
    std::pmr::monotonic_buffer_resource arena_;  // before the states and keys that use it
    std::vector<State> states_;
    std::unordered_map<Vec<int>, std::vector<int>, KeyHash> table_;
};

}  // namespace

PYBIND11_MODULE(_core, mod) {
    mod.doc() = "The A* search's state walk (see hap/search/astar.py).";
    py::class_<Option>(mod, "Option")
        .def(py::init([](std::vector<std::pair<int, int>> reqs, std::vector<Prop> outs, double sync_bytes, double inner,
                         std::vector<Shared> keeps, std::vector<Shared> uses) {
            Option o;
            o.reqs = std::move(reqs);
            o.outs = std::move(outs);
            sort_unique(o.outs);
            o.sync_bytes = sync_bytes;
            o.inner = inner;
            o.keeps = std::move(keeps);
            o.uses = std::move(uses);
            return o;
        }));
    py::class_<Price>(mod, "Price")
        .def(py::init([](std::vector<double> fwd, std::vector<double> bwd) { return Price{std::move(fwd), std::move(bwd)}; }))
        .def_readonly("fwd", &Price::fwd)
        .def_readonly("bwd", &Price::bwd);
    py::class_<Frame, std::shared_ptr<Frame>>(mod, "Frame")
        .def(py::init([](int m, std::vector<std::vector<Option>> opts, std::vector<int> alike, std::vector<int> segment_of,
                         std::vector<bool> seg_start, std::vector<bool> cut_after, std::vector<bool> bucket_end,
                         std::vector<std::vector<int>> dead_at, std::vector<std::vector<int>> shared_done,
                         std::vector<std::tuple<int, int, int, int>> move_class,
                         std::vector<std::vector<std::tuple<int, bool, bool>>> move_kinds, double sync_slope,
                         double sync_alpha, std::vector<double> sync_rest, py::function grad_sync) {
            auto f = std::make_shared<Frame>();
            f->m = m;
            f->n = static_cast<int>(opts.size());
            f->opts = std::move(opts);
            f->alike = std::move(alike);
            f->segment_of = std::move(segment_of);
            f->seg_start = std::move(seg_start);
            f->cut_after = std::move(cut_after);
            f->bucket_end = std::move(bucket_end);
            f->dead_at = std::move(dead_at);
            f->shared_done = std::move(shared_done);
            for (const auto& [t, code, seg, c] : move_class) f->move_class[move_key(t, code, seg)] = c;
            for (const auto& kinds : move_kinds) {
                std::vector<MoveKind> out;
                for (const auto& [src, communicates, has_fwd] : kinds) out.push_back(MoveKind{src, communicates, has_fwd});
                f->move_kinds.push_back(std::move(out));
            }
            f->sync_slope = sync_slope;
            f->sync_alpha = sync_alpha;
            f->sync_rest = std::move(sync_rest);
            f->grad_sync = std::move(grad_sync);
            return f;
        }))
        .def("set_consumers", [](Frame& f, std::vector<std::vector<int>> consumers, std::vector<std::vector<int>> segs,
                                 std::vector<int> ncodes) {
            f.consumers = std::move(consumers);
            f.consumer_segs = std::move(segs);
            f.ncodes = std::move(ncodes);
        });
    py::class_<Result>(mod, "Result")
        .def_readonly("status", &Result::status)
        .def_readonly("cost", &Result::cost)
        .def_readonly("at_node", &Result::at_node)
        .def_readonly("path", &Result::path)
        .def_readonly("dropped", &Result::dropped);
    py::class_<Space>(mod, "Space")
        .def(py::init<std::shared_ptr<Frame>, std::vector<std::vector<Price>>, std::vector<std::vector<int>>,
                      std::vector<std::vector<std::tuple<double, double, bool>>>>())
        .def("set_rebalance", &Space::set_rebalance)
        .def("use_pending", &Space::use_pending)
        .def("pending_at", &Space::pending_at)
        .def("set_weights", &Space::set_weights)
        .def("compute_suffix", &Space::compute_suffix)
        .def("suffix_max", &Space::suffix_max)
        .def("clear_suffix", &Space::clear_suffix)
        .def("set_future", &Space::set_future)
        .def("search", &Space::search)
        .def_readonly("expanded", &Space::expanded)
        .def_readonly("generated", &Space::generated)
        .def_readonly("exhaustive", &Space::exhaustive)
        .def_readonly("expanded_at", &Space::expanded_at);
}
