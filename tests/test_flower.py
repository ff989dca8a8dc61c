"""pflcore.flower: the strategies' aggregation called with Flower's own Messages and records, checked
against pflcore's own ops and algorithms on the same inputs; whole federations through Flower's
strategy loop on the in-process LoopbackGrid; the simulation engine (Ray) end to end as an
optional slow test."""
from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("flwr", reason="the Flower strategies need flwr (pip install '.[flower]')")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM  # noqa: E402

import pflcore  # noqa: E402
from pflcore import algorithms, data, models, ops  # noqa: E402
from pflcore.flower import (AndersonStrategy, ClusteredStrategy, LoopbackGrid, PERMStrategy, array_view,  # noqa: E402
                            federation_client_app, flatten, flatten_as, layout_of, stack, to_array, to_ndarrays,
                            to_record)
from pflcore.algorithms.cgpfl import generalization_term  # noqa: E402
from pflcore.run import global_optimum  # noqa: E402

logging.getLogger("flwr").setLevel(logging.ERROR)
ROOT = Path(__file__).resolve().parents[1]


def _nodes(n):
    """n node ids as a SuperLink would draw them (large, unordered)."""
    return [int(i) for i in np.random.default_rng(5).choice(2**62, n, replace=False) + 2]


def _grid(n, node_ids=None):
    """A grid for the strategies' node sampling (its ClientApp is never called here)."""
    return LoopbackGrid(lambda msg, ctx: None, n, node_ids=node_ids)


def _replies(instructions, models_by_node, weights_by_node, key="arrays"):
    """Flower reply Messages to ``instructions``: each node answers its model and its weight."""
    out = []
    for msg in instructions:
        node = msg.metadata.dst_node_id
        content = RecordDict({key: ArrayRecord([np.asarray(models_by_node[node])]),
                              "metrics": MetricRecord({"num-examples": weights_by_node[node]})})
        out.append(Message(content, reply_to=msg))
    return out


def _all_nodes(n, **kw):
    return dict(min_available_nodes=n, min_train_nodes=n, fraction_evaluate=0.0, **kw)


# ---- parameters: ArrayRecord <-> flat vectors --------------------------------------------------

def _mixed_record():
    g = np.random.default_rng(0)
    return ArrayRecord([g.normal(size=(3, 4)).astype(np.float32), np.asfortranarray(g.normal(size=(2, 5))
                                                                                    ).astype(np.float32),
                        np.arange(3), np.zeros((0, 2), np.float32), np.array(2.5, np.float32)])


def test_array_view_reads_the_message_bytes_without_a_copy():
    rec = _mixed_record()
    for k, a in rec.items():
        v = array_view(a)
        np.testing.assert_array_equal(v, a.numpy())
        assert v.dtype == a.numpy().dtype and v.shape == a.numpy().shape
        if v.size:
            assert np.shares_memory(v, np.frombuffer(a.data, np.uint8)) and not v.flags.writeable


def test_flatten_one_array_is_a_view_several_are_one_copy():
    one = ArrayRecord([np.linspace(0, 1, 7)])
    v, layout = flatten(one)
    assert np.shares_memory(v, np.frombuffer(one["0"].data, np.uint8)) and layout.size == 7
    rec = _mixed_record()
    v, layout = flatten(rec)
    assert v.dtype == np.float32 and layout.size == 12 + 10 + 0 + 1 and layout.float_keys == ("0", "1", "3", "4")
    expected = np.concatenate([rec[k].numpy().ravel() for k in ("0", "1", "3", "4")])
    np.testing.assert_array_equal(v, expected)
    # lists of numpy arrays (Flower's older API) lay out the same way
    v2, layout2 = flatten([rec[k].numpy() for k in rec])
    np.testing.assert_array_equal(v2, v)
    views = to_ndarrays(v2, layout2)
    assert [a.shape for a in views] == [(3, 4), (2, 5), (0, 2), ()]
    assert np.shares_memory(views[0], v2)


def test_to_record_writes_the_bytes_flower_writes():
    for a in [np.arange(12, dtype=np.float64).reshape(3, 4), np.float32(1.5) * np.ones((2, 1, 3), np.float32),
              np.array(3.0), np.zeros((0, 4)), np.arange(5, dtype=np.int32)]:
        assert to_array(a).data == Array(a).data, a.shape
    rec = _mixed_record()
    v, layout = flatten(rec)
    back = to_record(v, layout, like=rec)
    assert list(back) == list(rec)
    for k in rec:
        np.testing.assert_array_equal(back[k].numpy(), rec[k].numpy())
    with pytest.raises(ValueError, match="like"):  # the int array must come from somewhere
        to_record(v, layout)
    with pytest.raises(ValueError, match=r"vector: expected shape \[23\]"):
        to_record(v[:-1], layout, like=rec)


def test_float16_is_widened_and_rounded_back():
    rec = ArrayRecord([np.array([0.5, 1.25, -2.0], np.float16)])
    v, layout = flatten(rec)
    assert v.dtype == np.float32
    assert to_record(v, layout)["0"].data == rec["0"].data


def test_stack_names_the_record_that_does_not_fit():
    a = ArrayRecord([np.ones((2, 3), np.float32), np.ones(3, np.float32)])
    b = ArrayRecord([np.ones((2, 3), np.float32), np.ones(4, np.float32)])
    M, layout = stack([a, a])
    assert M.shape == (2, 9) and layout == layout_of(a)
    with pytest.raises(ValueError, match=r"node 42: expected the arrays \{0: float32\[2, 3\], 1: float32\[3\]\}"):
        stack([a, b], names=["node 41", "node 42"])


def test_bad_arrays_are_value_errors():
    good = Array(np.ones(3))
    with pytest.raises(ValueError, match="stype"):
        array_view(Array(dtype="float64", shape=(3,), stype="torch.raw", data=good.data))
    with pytest.raises(ValueError, match="payload bytes"):
        array_view(Array(dtype="float64", shape=(3,), stype=good.stype, data=good.data[:-8]))
    with pytest.raises(ValueError, match="magic"):
        array_view(Array(dtype="float64", shape=(3,), stype=good.stype, data=b"not numpy at all"))
    with pytest.raises(ValueError, match="at least one floating-point array"):
        flatten(ArrayRecord([np.arange(4)]))
    with pytest.raises(ValueError, match="ArrayRecord or a list of numpy arrays"):
        flatten({"w": np.ones(2)})


# ---- Anderson ----------------------------------------------------------------------------------

def test_anderson_wrapper_equals_ops_anderson_on_the_same_sequence():
    """The server sends u_k; the clients' results aggregate (FedAvg) to T(u_k) = A u_k + b; the
    wrapper's next parameters must be ops.Anderson's step on the same pairs, bitwise."""
    n, d = 4, 6
    nodes = _nodes(n)
    g = np.random.default_rng(1)
    A = np.eye(d) * 0.9 + 0.02 * g.normal(size=(d, d))
    offsets = {nd: g.normal(size=d) for nd in nodes}  # clients' results differ; their mean is T(u)
    weights = {nd: int(w) for nd, w in zip(nodes, g.integers(1, 50, n))}
    strategy = AndersonStrategy(FedAvg(**_all_nodes(n)), memory=3)
    plain = FedAvg(**_all_nodes(n))  # the wrapped strategy's T(u) on the same replies, for ops.Anderson
    reference = ops.Anderson(3)
    grid = _grid(n, nodes)
    arrays = ArrayRecord([np.zeros(d)])
    for rnd in range(1, 9):
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord(), grid))
        u = flatten(arrays)[0]
        results = {nd: A @ u + offsets[nd] for nd in nodes}
        replies = _replies(msgs, results, weights)
        tu = flatten(plain.aggregate_train(rnd, replies)[0])[0]
        arrays, metrics = strategy.aggregate_train(rnd, replies)
        expected = reference.step(u, tu)
        np.testing.assert_array_equal(flatten(arrays)[0], expected)
        assert metrics["anderson-residual"] == pytest.approx(np.linalg.norm(tu - u), rel=1e-12)
        assert metrics["anderson-pairs"] == min(rnd, 4)
    assert [h["round"] for h in strategy.history] == list(range(1, 9))
    # a new run (round 1 again) starts a new history
    strategy.configure_train(1, ArrayRecord([np.zeros(d)]), ConfigRecord(), grid)
    assert strategy.history == [] and strategy.anderson.weights is None


def test_anderson_wraps_a_stateful_strategy_and_keeps_its_settings():
    n = 3
    nodes = _nodes(n)
    inner = FedAvgM(server_momentum=0.5, **_all_nodes(n))
    with pytest.warns(RuntimeWarning, match="FedAvgM keeps optimizer state"):
        strategy = AndersonStrategy(inner, memory=2)
    assert strategy.server_momentum == 0.5 and strategy.min_train_nodes == n  # delegated settings
    grid = _grid(n, nodes)
    arrays = ArrayRecord([np.ones(4, np.float32)])
    for rnd in range(1, 4):
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord(), grid))
        assert {m.metadata.dst_node_id for m in msgs} == set(nodes)
        u = flatten(arrays)[0]
        replies = _replies(msgs, {nd: 0.5 * u for nd in nodes}, dict.fromkeys(nodes, 1))
        arrays, _ = strategy.aggregate_train(rnd, replies)
        assert arrays["0"].numpy().dtype == np.float32  # the model's dtype is kept


def test_anderson_follows_a_strategy_that_changes_the_dtype():
    """FedAdam returns float64 for float32 parameters: u is cast to T(u)'s layout (flatten_as) and
    the mixture has T(u)'s dtype."""
    n = 3
    nodes = _nodes(n)
    with pytest.warns(RuntimeWarning, match="FedAdam keeps optimizer state"):
        strategy = AndersonStrategy(FedAdam(**_all_nodes(n)), memory=1)
    plain, reference = FedAdam(**_all_nodes(n)), ops.Anderson(1)
    grid = _grid(n, nodes)
    arrays = ArrayRecord([np.ones(4, np.float32)])
    for rnd in (1, 2):
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord(), grid))
        plain.configure_train(rnd, arrays, ConfigRecord(), grid)
        u = flatten(arrays)[0]
        replies = _replies(msgs, {nd: (0.5 * u + i).astype(np.float32) for i, nd in enumerate(nodes)},
                           dict.fromkeys(nodes, 1))
        tu, layout = flatten(plain.aggregate_train(rnd, replies)[0])
        arrays, _ = strategy.aggregate_train(rnd, replies)
        assert layout.dtypes == (np.float64,) and arrays["0"].numpy().dtype == np.float64
        np.testing.assert_array_equal(flatten(arrays)[0], reference.step(flatten_as(ArrayRecord([u]), layout), tu))
    with pytest.raises(ValueError, match=r"\{0: float64\[4\]\} \(any dtypes\), got \{0: float32\[5\]\}"):
        flatten_as(ArrayRecord([np.ones(5, np.float32)]), layout)


def test_anderson_keeps_u_when_every_client_failed():
    n = 2
    nodes = _nodes(n)
    strategy = AndersonStrategy(FedAvg(**_all_nodes(n)))
    msgs = list(strategy.configure_train(1, ArrayRecord([np.ones(3)]), ConfigRecord(), _grid(n, nodes)))
    from flwr.app import Error
    failed = [Message(Error(code=2, reason="boom"), reply_to=m) for m in msgs]
    assert strategy.aggregate_train(1, failed) == (None, None)
    assert strategy.history == []


def test_anderson_arguments_are_checked():
    with pytest.raises(ValueError, match="strategy: expected a flwr.serverapp.strategy.Strategy"):
        AndersonStrategy(object())
    with pytest.raises(ValueError, match="memory"):
        AndersonStrategy(FedAvg(), memory=-1)


def _least_squares(m=8, n=120, d=12):
    fed = data.least_squares(m, n, d, 0.25, shift=1.0, seed=3, dtype=torch.float64)
    return fed, models.LeastSquares(d, fit_intercept=False)


def test_flower_fedavg_plus_anderson_is_pflcore_accelerated_fedavg():
    """Through Flower's own strategy loop (Strategy.start on the loopback grid), FedAvg wrapped in
    AndersonStrategy gives the global model of pflcore's Accelerated(FedAvg) on the same
    federation, round after round."""
    fed, model = _least_squares()
    R, m = 12, fed.num_clients
    app = federation_client_app(fed, model, lr=0.1, local_steps=2)
    seen = []
    strategy = AndersonStrategy(FedAvg(**_all_nodes(m)), memory=2)
    strategy.start(grid=LoopbackGrid(app, m), initial_arrays=ArrayRecord([np.zeros(model.d)]), num_rounds=R,
                   evaluate_fn=lambda rnd, arrays: seen.append(np.array(flatten(arrays)[0])))
    ours = []
    pflcore.run(algorithms.Accelerated(algorithms.FedAvg(lr=0.1, local_steps=2), memory=2), fed, model, rounds=R,
                progress=False, callbacks=[lambda t, row, state: ours.append(state.inner.w.clone().numpy())])
    assert len(seen) == R + 1 and len(ours) == R
    np.testing.assert_allclose(np.stack(seen[1:]), np.stack(ours), rtol=1e-9, atol=1e-12)


def test_anderson_saves_rounds_on_least_squares():
    """The example's measurement on a small federation: rounds to reach plain FedAvg's final gap."""
    fed, model = _least_squares()
    f_star = global_optimum(fed, model)[0]
    m, R = fed.num_clients, 40
    app = federation_client_app(fed, model, lr=0.1, local_steps=1)

    def gaps(strategy):
        out = []

        def gap(rnd, arrays):
            w = torch.from_numpy(np.array(flatten(arrays)[0])).expand(m, model.d).contiguous()
            loss, _, count = ops.evaluate(model, w, fed.train)
            out.append(float((fed.weights * loss / count).sum()) - f_star)

        strategy.start(grid=LoopbackGrid(app, m), initial_arrays=ArrayRecord([np.zeros(model.d)]), num_rounds=R,
                       evaluate_fn=gap)
        return out

    plain = gaps(FedAvg(**_all_nodes(m)))
    accel = gaps(AndersonStrategy(FedAvg(**_all_nodes(m)), memory=2))
    target = plain[-1]
    assert all(a >= b for a, b in zip(plain, plain[1:]))  # plain FedAvg: first reaches it at round R
    rounds = next(r for r, g in enumerate(accel) if g <= target)
    assert 3 * rounds <= R, (rounds, target)


# ---- clustered strategy ------------------------------------------------------------------------

def _planted(n_per=5, K=4, d=8, seed=0):
    g = np.random.default_rng(seed)
    centres = 5.0 * g.normal(size=(K, d))
    truth = np.repeat(np.arange(K), n_per)
    g.shuffle(truth)
    points = centres[truth] + 0.3 * g.normal(size=(len(truth), d))
    return points, truth


def test_clustered_contexts_equal_ops_kmeans_on_the_same_flattened_arrays():
    points, truth = _planted()
    n = len(points)
    nodes = _nodes(n)
    weights = {nd: int(w) for nd, w in zip(nodes, np.random.default_rng(2).integers(5, 60, n))}
    strategy = ClusteredStrategy(4, restarts=3, seed=7, **_all_nodes(n))
    grid = _grid(n, nodes)
    start = np.zeros(points.shape[1])
    msgs = list(strategy.configure_train(1, ArrayRecord([start]), ConfigRecord(), grid))
    order = [m.metadata.dst_node_id for m in msgs]  # the sampling order of the replies
    by_node = dict(zip(nodes, points))
    glob, metrics = strategy.aggregate_train(1, _replies(msgs, by_node, weights))
    P = np.stack([by_node[nd] for nd in order])
    w = np.array([weights[nd] for nd in order], dtype=np.float64)
    best = None
    for j in range(3):  # the strategy's restarts: the lowest-inertia k-means++ run
        km = ops.kmeans(P, 4, init="k-means++", weights=w, seed=((7 + 1) * 1_000_003 + 7919 * j) & 0x7FFFFFFF)
        best = km if best is None or km.inertia < best.inertia else best
    means = np.stack([ops.average(P, w, rows=np.nonzero(best.labels == k)[0]) for k in range(4)])
    np.testing.assert_array_equal(strategy.contexts, means)  # alpha = 1: the cluster means
    assert [strategy.context_of(nd) for nd in order] == best.labels.tolist()
    assert metrics["num-contexts"] == 4 and metrics["kmeans-inertia"] == pytest.approx(best.inertia)
    sizes = np.array([w[best.labels == k].sum() for k in range(4)])
    np.testing.assert_allclose(flatten(glob)[0], (sizes[:, None] * means).sum(0) / sizes.sum(), rtol=1e-12)

    # round 2: each node is sent its context's model; the clustering is warm-started from Ω
    msgs = list(strategy.configure_train(2, glob, ConfigRecord({"lr": 0.1}), grid))
    for m in msgs:
        k = strategy.context_of(m.metadata.dst_node_id)
        assert m.content.config_records["config"]["context"] == k and m.content["config"]["lr"] == 0.1
        np.testing.assert_array_equal(flatten(m.content["arrays"])[0], strategy.contexts[k])
    moved = {nd: p + 0.1 for nd, p in by_node.items()}
    previous = strategy.contexts.copy()
    strategy.aggregate_train(2, _replies(msgs, moved, weights))
    order = [m.metadata.dst_node_id for m in msgs]
    P2 = np.stack([moved[nd] for nd in order])
    w2 = np.array([weights[nd] for nd in order], dtype=np.float64)
    km2 = ops.kmeans(P2, init=previous, weights=w2)
    means2 = np.stack([ops.average(P2, w2, rows=np.nonzero(km2.labels == k)[0]) for k in range(4)])
    np.testing.assert_array_equal(strategy.contexts, means2)
    assert [strategy.context_of(nd) for nd in order] == km2.labels.tolist()


def test_clustered_alpha_moves_contexts_part_of_the_way():
    points, _ = _planted(n_per=3, K=2)
    n = len(points)
    nodes = _nodes(n)
    strategy = ClusteredStrategy(2, alpha=0.25, restarts=1, **_all_nodes(n))
    start = np.full(points.shape[1], 1.0)
    msgs = list(strategy.configure_train(1, ArrayRecord([start]), ConfigRecord(), _grid(n, nodes)))
    strategy.aggregate_train(1, _replies(msgs, dict(zip(nodes, points)), dict.fromkeys(nodes, 1)))
    labels = np.array([strategy.context_of(nd) for nd in nodes])
    for k in range(2):
        mean = points[labels == k].mean(0)
        np.testing.assert_allclose(strategy.contexts[k], start + 0.25 * (mean - start), rtol=1e-12)


def test_heur_e_values_follow_the_formula():
    points, _ = _planted(n_per=4, K=3, d=6)
    n = len(points)
    nodes = _nodes(n)
    weights = dict.fromkeys(nodes, 30)
    strategy = ClusteredStrategy("auto", mu=0.5, max_contexts=5, restarts=2, seed=1, **_all_nodes(n))
    msgs = list(strategy.configure_train(1, ArrayRecord([np.zeros(6)]), ConfigRecord(), _grid(n, nodes)))
    strategy.aggregate_train(1, _replies(msgs, dict(zip(nodes, points)), weights))
    order = [m.metadata.dst_node_id for m in msgs]
    P = np.stack([dict(zip(nodes, points))[nd] for nd in order])
    w = np.full(n, 30.0)
    expected = []
    for K in range(1, 6):
        inertia = min(ops.kmeans(P, K, weights=w, seed=((1 + 31 * K) * 1_000_003 + 7919 * j) & 0x7FFFFFFF).inertia
                      for j in range(2))
        expected.append(generalization_term(6, K, 30.0 * n) + 0.5 * inertia / w.sum())
    np.testing.assert_allclose(strategy.e_values, expected, rtol=1e-12)
    assert strategy.contexts.shape[0] == 1 + int(np.argmin(expected)) == 3
    heur = algorithms.CGPFLHeur(mu=0.5, max_contexts=5, lam=1.0)
    assert generalization_term(6, 3, 360.0) == heur.generalization_term(6, 3, 360)


@pytest.mark.parametrize("num_contexts", [4, "auto"])
def test_clustered_strategy_recovers_planted_contexts(num_contexts):
    """A 4-context synthetic federation through Flower's loop: adjusted Rand index 1.0."""
    from sklearn.metrics import adjusted_rand_score

    fed = data.contexts(num_clients=24, num_contexts=4, dim=20, num_classes=5, sizes=(50, 150), seed=0)
    model = models.Softmax(20, 5)
    app = federation_client_app(fed, model, lr=0.5, local_steps=20)
    grid = LoopbackGrid(app, fed.num_clients)
    strategy = ClusteredStrategy(num_contexts, mu=1.0, max_contexts=8, **_all_nodes(fed.num_clients))
    strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(model.d, np.float32)]), num_rounds=3)
    labels = [strategy.context_of(nd) for nd in grid.node_ids]  # node_ids[i] serves client i
    assert strategy.contexts.shape[0] == 4
    assert adjusted_rand_score(np.asarray(fed.meta["contexts"]), labels) == 1.0


def test_clustered_arguments_and_too_few_replies():
    with pytest.raises(ValueError, match="give mu"):
        ClusteredStrategy("auto")
    with pytest.raises(ValueError, match="num_contexts: expected an integer >= 1 or 'auto'"):
        ClusteredStrategy("four")
    with pytest.raises(ValueError, match="num_contexts: expected an integer >= 1"):
        ClusteredStrategy(0)
    with pytest.raises(ValueError, match=r"alpha: expected a number in \(0, 1\]"):
        ClusteredStrategy(2, alpha=0.0)
    nodes = _nodes(2)
    strategy = ClusteredStrategy(3, **_all_nodes(2))
    msgs = list(strategy.configure_train(1, ArrayRecord([np.zeros(2)]), ConfigRecord(), _grid(2, nodes)))
    with pytest.raises(ValueError, match="3 contexts need at least 3 replies"):
        strategy.aggregate_train(1, _replies(msgs, {nd: np.ones(2) for nd in nodes}, dict.fromkeys(nodes, 1)))
    with pytest.raises(ValueError, match="no clustering"):
        strategy.context_arrays(0)


def test_a_reply_with_other_arrays_is_named():
    nodes = _nodes(2)
    strategy = ClusteredStrategy(1, **_all_nodes(2))
    msgs = list(strategy.configure_train(1, ArrayRecord([np.zeros(3)]), ConfigRecord(), _grid(2, nodes)))
    bad = {nodes[0]: np.zeros(3), nodes[1]: np.zeros(4)}
    with pytest.raises(ValueError, match=f"reply of node {nodes[1]}: expected the arrays"):
        strategy.aggregate_train(1, _replies(msgs, bad, dict.fromkeys(nodes, 1)))


# ---- PERM --------------------------------------------------------------------------------------

def test_perm_strategy_is_pflcore_perm():
    """Warm-up FedAvg, the gradient query, then model shuffling through Flower's loop: the mixing
    weights equal pflcore's PERM exactly and the personalized models to rounding."""
    fed = data.two_groups(num_clients=8, samples_per_client=40, dim=10, seed=0, dtype=torch.float64)
    model = models.Logistic(10)
    W, R, m = 3, 9, fed.num_clients
    ours = pflcore.run(algorithms.PERM(warmup_rounds=W, lam_alpha=0.5, lr=0.3, local_steps=2), fed, model,
                       rounds=W + R, progress=False, seed=0)
    app = federation_client_app(fed, model, lr=0.3, local_steps=2)
    grid = LoopbackGrid(app, m, node_ids=list(range(10, 10 + m)))  # increasing ids: node i serves client i
    strategy = PERMStrategy(W, 0.5, seed=0, **_all_nodes(m))
    kinds = []
    configure = strategy.configure_train

    def spy(rnd, arrays, config, grid):  # the message types each training round sends
        messages = list(configure(rnd, arrays, config, grid))
        kinds.append({msg.metadata.message_type for msg in messages})
        return messages

    strategy.configure_train = spy
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(model.d)]), num_rounds=W + 1 + R)
    assert kinds[:W + 1] == [{"train"}] * W + [{"query.gradient"}] and len(kinds) == W + 1 + R
    assert all(k <= {"train"} for k in kinds[W + 1:])  # empty when every visit has α = 0 (two groups)
    assert strategy.phase == "shuffle" and strategy.shuffle_rounds == R
    np.testing.assert_array_equal(strategy.alpha, ours.state.alpha.numpy())
    np.testing.assert_array_equal(strategy.sigma, ours.state.sigma.numpy())
    theta = np.stack([flatten(strategy.personalized_arrays(nd))[0] for nd in grid.node_ids])
    np.testing.assert_allclose(theta, ours.personalized.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(flatten(result.arrays)[0], ours.state.w.numpy(), rtol=1e-12, atol=1e-15)
    # evaluation messages carry each node's own personalized model
    strategy.fraction_evaluate, strategy.min_evaluate_nodes = 1.0, m
    msgs = list(strategy.configure_evaluate(W + R + 2, result.arrays, ConfigRecord(), grid))
    assert len(msgs) == m
    for msg in msgs:
        np.testing.assert_array_equal(flatten(msg.content["arrays"])[0],
                                      flatten(strategy.personalized_arrays(msg.metadata.dst_node_id))[0])


def test_perm_arguments():
    with pytest.raises(ValueError, match="warmup_rounds"):
        PERMStrategy(-1, 0.5)
    with pytest.raises(ValueError, match="lam_alpha"):
        PERMStrategy(2, 0.0)
    with pytest.raises(ValueError, match="personalized_arrays: no personalized models yet"):
        PERMStrategy(2, 0.5).personalized_arrays(3)


# ---- the loopback grid -------------------------------------------------------------------------

def test_loopback_grid_gives_partitions_and_error_replies():
    def app(msg, ctx):
        if ctx.node_config["partition-id"] == 1:
            raise RuntimeError("client 1 fails")
        return Message(RecordDict({"metrics": MetricRecord({"p": ctx.node_config["partition-id"]})}), reply_to=msg)

    grid = LoopbackGrid(app, 3, raise_errors=False)
    msgs = [Message(RecordDict(), dst_node_id=nd, message_type=MessageType.EVALUATE) for nd in grid.node_ids]
    replies = list(grid.send_and_receive(msgs))
    assert [r.has_error() for r in replies] == [False, True, False]
    assert "client 1 fails" in replies[1].error.reason
    assert [r.content["metrics"]["p"] for r in (replies[0], replies[2])] == [0, 2]
    assert [r.metadata.src_node_id for r in replies] == grid.node_ids
    with pytest.raises(RuntimeError, match="client 1 fails"):
        LoopbackGrid(app, 3).send_and_receive(msgs[1:2])
    with pytest.raises(ValueError, match="num_nodes"):
        LoopbackGrid(app, 0)


# ---- the simulation engine (Ray), end to end ---------------------------------------------------

@pytest.mark.slow
def test_example_on_flowers_simulation_engine(tmp_path):
    """examples/flower_anderson.py on Flower's simulation engine (Ray), small: a subprocess (Ray
    starts its own processes and must not share this one's state)."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray (pip install '.[flower]' installs "
                                      "flwr[simulation])")
    out = tmp_path / "curves.json"
    cmd = [sys.executable, str(ROOT / "examples" / "flower_anderson.py"), "--clients", "6", "--samples", "200",
           "--dim", "10", "--rounds", "15", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json
    summary = json.loads(out.read_text())["summary"]
    assert summary["rounds_plain"] == 15 and summary["rounds_saved_factor"] >= 3, summary
