"""The context-bound ops (DESIGN.md §5, issue 16): algorithms call ctx.local_steps & co, which count
client-steps and trust the index tensors the context drew; the plain ops refuse to run inside a
round; evaluation computes derived personalized models once, and the training loss on a sample."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import pflcore
from conftest import make_data
from pflcore import algorithms as A
from pflcore import backend, data, models, ops
from pflcore.algorithms.base import Algorithm, Context


def _fed(m=6, seed=0):
    return data.synthetic(0.5, 0.5, num_clients=m, dim=5, num_classes=3, seed=seed, size_scale=1, max_size=60)


@dataclass
class _State:
    w: torch.Tensor


class PlainOps(Algorithm):
    """An algorithm written against the plain ops: wrong when the clients are sharded."""

    name = "PlainOps"

    def init(self, ctx):
        return _State(ctx.initial_global())

    def round(self, state, ctx, t):
        theta = state.w.repeat(ctx.m, 1)
        ops.local_steps(ctx.model, theta, ctx.train, steps=1, lr=0.1)
        state.w = theta.mean(0)
        return state

    def global_model(self, state):
        return state.w


def test_plain_ops_inside_a_round_are_refused_with_the_context_form_named():
    fed = _fed()
    with pytest.raises(RuntimeError, match=r"^ops\.local_steps called inside PlainOps: an algorithm calls "
                                           r"ctx\.local_steps"):
        pflcore.run(PlainOps(), fed, models.Softmax(5, 3), rounds=1, progress=False)
    # outside a run, the same call is an ordinary op call
    theta = models.Softmax(5, 3).zeros(6)
    ops.local_steps(models.Softmax(5, 3), theta, fed.train, steps=1, lr=0.1)
    assert theta.abs().sum() > 0


def test_every_plain_op_is_guarded():
    from pflcore.ops._args import inside

    model, d = models.Softmax(3, 2), make_data(models.Softmax(3, 2), [3, 4], torch.float32)
    th = model.zeros(2)
    calls = {"local_steps": lambda: ops.local_steps(model, th, d, steps=1, lr=0.1),
             "gradients": lambda: ops.gradients(model, th, d), "evaluate": lambda: ops.evaluate(model, th, d),
             "hvp": lambda: ops.hvp(model, th, th, d, batches=torch.zeros(2, 1, dtype=torch.int32)),
             "sample_batches": lambda: ops.sample_batches(d, steps=1, batch_size=1, seed=0, counter=0),
             "average": lambda: ops.average(th, torch.ones(2)), "kmeans": lambda: ops.kmeans(th, 1),
             "kmeans_assign": lambda: ops.kmeans_assign(th, th)}
    with inside("Test"):
        for name, call in calls.items():
            with pytest.raises(RuntimeError, match=rf"^ops\.{name} called inside Test"):
                call()


def test_context_ops_count_one_client_step_per_gradient():
    fed = _fed()
    model = models.Softmax(5, 3)
    ctx = Context(fed, model, torch.device("cpu"), clients_per_round=3)
    S = ctx.sample_clients(1)
    theta = model.zeros(S.numel())
    ctx.local_steps(theta, steps=4, lr=0.1, rows=S, batches=ctx.batches(1, 0, S, 4, 5))
    assert ctx.client_steps == 3 * 4
    ctx.gradients(theta, rows=S)
    assert ctx.client_steps == 3 * 4 + 3
    ctx.hvp(theta, theta, rows=S, batches=ctx.batches(1, 1, S, 1, 5)[:, 0].contiguous())
    assert ctx.client_steps == 3 * 4 + 3 + 3
    ctx.evaluate(theta, rows=S, data=ctx.test)  # evaluation is not training
    assert ctx.client_steps == 18
    # and a whole run reports them: FedAvg, 3 clients x 4 steps per round
    res = pflcore.run(A.FedAvg(lr=0.1, local_steps=4, batch_size=5), fed, model, rounds=2, clients_per_round=3,
                      progress=False)
    assert res.history[-1]["client_steps_per_s"] == pytest.approx(12 / res.history[-1]["seconds"], rel=1e-9)


def test_drawn_index_tensors_are_trusted_until_changed(monkeypatch):
    fed = _fed()
    model = models.Softmax(5, 3)
    ctx = Context(fed, model, torch.device("cpu"), clients_per_round=3)
    S = ctx.sample_clients(2)
    b = ctx.batches(2, 0, S, 2, 4)
    assert ctx._trusted(S, b) and ctx._trusted(None, b)
    assert not ctx._trusted(S.clone(), b)          # another tensor: not drawn here
    seen = []
    native = backend.ADAPTERS["native"]
    real = type(native).local_steps
    monkeypatch.setattr(type(native), "local_steps", lambda self, *a: seen.append(a[-1]) or real(self, *a))
    ctx.local_steps(model.zeros(3), steps=2, lr=0.1, rows=S, batches=b)
    b[0, 0, 0] = b[0, 0, 0]                        # an in-place write: the version moves on
    assert not ctx._trusted(b)
    ctx.local_steps(model.zeros(3), steps=2, lr=0.1, rows=S, batches=b)
    assert seen == [True, False]
    # an untrusted batch is checked: a row of another client is named
    bad = b.clone()
    bad[1, 0, 0] = int(fed.train.offsets[int(S[0])])  # row 0 of client S[0], in the batch of S[1]
    with pytest.raises(ValueError, match=r"^batches: index \d+ at \[1, 0, 0\] is outside the rows"):
        ctx.local_steps(model.zeros(3), steps=2, lr=0.1, rows=S, batches=bad)


def test_repeated_batches_reuse_each_draw():
    ctx = Context(_fed(), models.Softmax(5, 3), torch.device("cpu"))
    S = torch.arange(4)
    once = ctx.batches(3, 1, S, 2, 5)
    rep = ctx.batches(3, 1, S, 2, 5, repeat=3)
    assert rep.shape == (4, 6, 5)
    assert torch.equal(rep, once.repeat_interleave(3, dim=1)) and ctx._trusted(rep)


def test_per_fedavg_personalizes_at_evaluation_not_every_round(monkeypatch):
    """Per-FedAvg's personalized model of client i is w − α∇f_i(w): one gradients call per
    evaluation, none in the rounds that are not evaluated."""
    fed, model = _fed(8, seed=1), models.Softmax(5, 3, l2=0.01)
    alg = A.PerFedAvg(alpha=0.05, beta=0.05, local_steps=2, batch_size=4)
    calls = []
    real = Context.gradients

    def spy(self, theta, **kw):
        calls.append(kw.get("rows") is None)  # the personalization: every client, no rows
        return real(self, theta, **kw)
    monkeypatch.setattr(Context, "gradients", spy)
    res = pflcore.run(alg, fed, model, rounds=6, eval_every=3, progress=False)
    assert sum(calls) == 3  # rounds 0, 3 and 6: three evaluations, three personalizations
    w = res.global_model
    want = w[None] - 0.05 * ops.gradients(model, w, fed.train)
    torch.testing.assert_close(res.personalized, want, rtol=0, atol=0)


def test_training_loss_on_a_fixed_sample_full_or_none():
    fed, model = _fed(), models.Softmax(5, 3)
    alg = lambda: A.FedAvg(lr=0.1, local_steps=2)  # noqa: E731
    full = pflcore.run(alg(), fed, model, rounds=3, progress=False, train_loss="full")
    sample = pflcore.run(alg(), fed, model, rounds=3, progress=False)
    none = pflcore.run(alg(), fed, model, rounds=3, progress=False, train_loss="none")
    assert "train_loss" not in none.history[-1]
    # the full loss is the weighted mean over every training row
    w = full.global_model
    loss, _, count = ops.evaluate(model, w, fed.train)
    assert full.history[-1]["train_loss"] == pytest.approx(float(loss.sum() / count.sum()), rel=1e-6)
    # the sample estimates it; the accuracies do not depend on how the loss is computed
    assert sample.history[-1]["train_loss"] == pytest.approx(full.history[-1]["train_loss"], rel=0.2)
    for key in ("global_acc", "global_loss"):
        assert sample.history[-1][key] == full.history[-1][key] == none.history[-1][key]
    with pytest.raises(ValueError, match=r"^train_loss: expected 'sample', 'full' or 'none', got 'all'"):
        pflcore.run(alg(), fed, model, rounds=1, progress=False, train_loss="all")


@pytest.mark.parametrize("name", ["native", "reference"])
def test_one_shared_model_and_sampled_rows_equal_their_copies(name):
    """theta [d] (one model at every row) and batches [R, B] in evaluate/gradients give what an
    explicit [R, d] copy and a ClientData of the sampled rows give."""
    model = models.Softmax(4, 3, l2=0.1)
    d = make_data(model, [5, 1, 70, 9], torch.float64, seed=2)
    w = 0.1 * torch.randn(model.d, dtype=torch.float64)
    W = w.expand(4, -1).contiguous()
    b = ops.sample_batches(d, steps=1, batch_size=6, seed=3, counter=0)[:, 0].contiguous()
    with backend.use(name):
        for a, e in zip(ops.evaluate(model, w, d), ops.evaluate(model, W, d)):
            assert torch.equal(a, e)
        assert torch.equal(ops.gradients(model, w, d), ops.gradients(model, W, d))
        loss, correct, count = ops.evaluate(model, W, d, batches=b)
        assert count.tolist() == [6] * 4
        for r in range(4):
            rows = b[r].long()
            one = pflcore.ClientData(d.x[rows], d.y[rows], torch.tensor([0, 6]))
            l1, c1, n1 = ops.evaluate(model, W[r:r + 1], one)
            torch.testing.assert_close(loss[r:r + 1], l1)
            assert torch.equal(correct[r:r + 1], c1)
