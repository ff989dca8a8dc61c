"""``sample_batches``: minibatch row indices drawn with replacement by a counter-based hash
(DESIGN.md §4), native vs the torch reference; 1 step of B = 20 per client. Agreement: the
indices are identical (the hash is fixed). Bytes: the int32 indices written."""
from __future__ import annotations

import pytest
import torch

from pflcore import backend, ops

from _suite import BATCH, clients, device_of, expected, group_name, impls, measure, on_device

pytestmark = pytest.mark.op("sample_batches")


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("size", ["small", "1k", "10k"])
def test_sample_batches(benchmark, size, impl):
    data = clients(size)
    kw = dict(steps=1, batch_size=BATCH, seed=3, counter=7)
    want = expected(("sample_batches", size), lambda: ops.sample_batches_ref(data, **kw))
    ddata = on_device(data, device_of(impl))

    def run():
        with backend.use(impl):
            return ops.sample_batches(ddata, **kw)

    def check(out):
        assert torch.equal(torch.as_tensor(out).cpu(), want), f"{impl}: indices differ from sample_batches_ref"

    measure(benchmark, op="sample_batches", size=size, group=group_name("sample_batches", size, f"1 step, B={BATCH}"),
            impl=impl, run=run, check=check, bytes_moved=want.numel() * 4, baseline=impl == "native")
