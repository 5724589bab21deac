"""View results that had to be computed on a redistributed copy of their base (a slice of a sharded dim,
``diagonal`` of a sharded matrix, the fallback's ``as_strided``/``unfold``): writing into them, or reading them
after their base changed in place, would silently differ from plain torch, so both raise; real views (the
view runs on local shards) keep working as on plain tensors."""

import warnings

import pytest
import torch

from lightning_shard import init_device_mesh
from lightning_shard.tensor import Replicate, Shard, distribute_tensor
from tests.harness import distributed


def _base():
    return torch.arange(16.0).view(4, 4)


def _sharded(mesh, placement=None):
    return distribute_tensor(_base(), mesh, [placement or Shard(0)])


@distributed(world_size=2)
def test_write_through_view_copy_raises():
    mesh = init_device_mesh("cpu", (2,))
    writes = {
        "slice setitem": lambda x: x.__setitem__(slice(0, 2), 100.0),
        "diagonal zero_": lambda x: x.diagonal().zero_(),
        "unfold add_": lambda x: x.unfold(0, 2, 1).add_(1),
        "as_strided fill_": lambda x: x.as_strided((2, 2), (4, 1)).fill_(7.0),
        "view of a copy": lambda x: x[1:3].view(-1).mul_(2),
        "copy_ into a copy": lambda x: x.diagonal().copy_(distribute_tensor(torch.ones(4), mesh, [Replicate()])),
    }
    for name, write in [*writes.items()] * 2:  # twice: the second time the view op's decision comes from the cache
        x = _sharded(mesh)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(RuntimeError, match="returned as a copy, not a view"):
                write(x)
        torch.testing.assert_close(x.full_tensor(), _base(), msg=name)  # the base is untouched


@distributed(world_size=2)
def test_reading_a_view_copy_after_its_base_changed_raises():
    mesh = init_device_mesh("cpu", (2,))
    x = _sharded(mesh)
    d = x.diagonal()
    torch.testing.assert_close(d.full_tensor(), _base().diagonal())  # fresh: exact
    x.add_(1)
    with pytest.raises(RuntimeError, match="changed in place by aten.add_.Tensor"):
        d.sum()
    # A write into another alias of the base's local storage counts too.
    y = _sharded(mesh)
    s = y[0:3]  # a copy: the slice is on the sharded dim
    y.view(2, 8).mul_(2)  # a real view of y
    with pytest.raises(RuntimeError, match="changed in place by aten.mul_.Tensor"):
        s + 1


@distributed(world_size=2)
def test_real_views_keep_plain_semantics():
    mesh = init_device_mesh("cpu", (2,))
    # Views that run on local shards alias the base: writes go through, reads follow the base.
    x = _sharded(mesh, Shard(1))
    ref = _base()
    x[0:2].fill_(-1.0)  # rows of a column-sharded matrix: a real view
    ref[0:2].fill_(-1.0)
    x.transpose(0, 1)[:, 1].mul_(3)  # Shard(0) after transpose; row 1 of every column
    ref.transpose(0, 1)[:, 1].mul_(3)
    torch.testing.assert_close(x.full_tensor(), ref)
    v = x.view(4, 2, 2)  # keeps Shard(1): a real view
    x.add_(1)
    ref.add_(1)
    torch.testing.assert_close(v.full_tensor(), ref.view(4, 2, 2))
    # A copy that is never written and whose base does not change is fine, and so is dropping it.
    y = _sharded(mesh)
    torch.testing.assert_close(y.diagonal().sum().full_tensor(), _base().diagonal().sum())
    y.add_(1)
    torch.testing.assert_close(y.full_tensor(), _base() + 1)
