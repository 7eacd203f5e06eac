"""Ray Data in and out: chunk datasets as ray.data.Datasets and back, as offline data and preprocess sources."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rayrb.io.chunks import ChunkDataset, write_dataset

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]


@pytest.fixture(scope="module", autouse=True)
def quiet_ordered_ray_data(ray_session):
    import ray.data

    ctx = ray.data.DataContext.get_current()
    saved = (ctx.enable_progress_bars, ctx.print_on_execution_start, ctx.execution_options.preserve_order)
    ctx.enable_progress_bars, ctx.print_on_execution_start = False, False
    ctx.execution_options.preserve_order = True  # so that rows can be compared in order
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    yield
    ctx.enable_progress_bars, ctx.print_on_execution_start, ctx.execution_options.preserve_order = saved


def nested_rows(n=11):
    g = torch.Generator().manual_seed(0)
    return TensorDict({
        "observation": torch.randn(n, 3, generator=g),
        "action": torch.randint(0, 4, (n,), generator=g),
        "next": {"done": torch.rand(n, 1, generator=g) > 0.5, "reward": torch.randn(n, 1, generator=g).double()},
        "pixels": torch.randint(0, 255, (n, 2, 2), generator=g, dtype=torch.uint8),
        "flag": torch.arange(n) % 3 == 0,
    }, [n])


def all_rows(rd) -> dict[str, np.ndarray]:
    batches = list(rd.iter_batches(batch_format="numpy", batch_size=None))
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def assert_same_rows(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, (k, got[k].dtype, want[k].dtype)
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_chunk_dataset_reads_as_ray_dataset_and_writes_back(tmp_path):
    from rayrb.io.raydata import to_ray_dataset, write_ray_dataset

    src = write_dataset(nested_rows(11), tmp_path / "src", chunk_rows=4)
    rd = to_ray_dataset(src, override_num_blocks=6)
    assert sorted(rd.columns()) == ["action", "flag", "next/done", "next/reward", "observation", "pixels"]
    assert rd.count() == 11
    assert_same_rows(all_rows(rd), src.read())  # same rows, shapes and dtypes, in order
    back = write_ray_dataset(to_ray_dataset(tmp_path / "src"), tmp_path / "back")
    assert back.spec == src.spec and len(back) == 11
    assert_same_rows(back.read(), src.read())
    back.verify()
    td = back.to_tensordict()
    assert td["next", "done"].dtype == torch.bool and td["next", "reward"].shape == (11, 1)  # nested again
    assert all(c.node for c in back.chunks)  # each chunk records the node that wrote it
    fixed = write_ray_dataset(to_ray_dataset(src), tmp_path / "fixed", chunk_rows=5)
    assert max(c.rows for c in fixed.chunks) == 5 and len(fixed) == 11  # Ray Data batches within each task
    assert_same_rows(fixed.read(), src.read())


def test_items_with_lists_and_structs_become_shaped_and_nested_keys(tmp_path):
    import ray.data

    from rayrb.io.raydata import write_ray_dataset

    items = [{"x": [float(i), -float(i)], "y": i, "s": {"a": i / 2}} for i in range(7)]
    ds = write_ray_dataset(ray.data.from_items(items), tmp_path / "ds")
    assert repr(ds.spec) == "RowSpec(s/a: float64[], x: float64[2], y: int64[])"
    rows = ds.read()
    np.testing.assert_array_equal(rows["x"][:, 1], -np.arange(7.0))
    np.testing.assert_array_equal(rows["s/a"], np.arange(7) / 2)


def test_buffer_and_preprocess_take_a_ray_dataset(tmp_path):
    import ray.data

    from rayrb import OfflineToOnlineReplayBuffer, preprocess

    rb = OfflineToOnlineReplayBuffer(ray.data.range(100, override_num_blocks=3), online_capacity=10,
                                     batch_size=32, seed=0, dataset_root=tmp_path / "offline")
    try:
        assert len(rb) == 100
        ids = rb.sample()["id"]
        assert ids.dtype == torch.int64 and ids.min() >= 0 and ids.max() < 100
    finally:
        rb.shutdown()

    def double(td):
        td["x"] = td["x"] * 2
        return td

    source = ray.data.from_numpy(np.arange(20, dtype=np.float32).reshape(10, 2)).rename_columns({"data": "x"})
    out = preprocess(source, double, tmp_path / "out", batched=True, pbar=False)
    np.testing.assert_array_equal(out.read()["x"], np.arange(20, dtype=np.float32).reshape(10, 2) * 2)


def test_unsupported_columns_and_destinations_are_refused(tmp_path):
    import ray.data

    from rayrb.io.raydata import write_ray_dataset

    with pytest.raises(TypeError, match="column 'name': expected a fixed-width numeric column"):
        write_ray_dataset(ray.data.from_items([{"name": "a", "v": 1}]), tmp_path / "strings")
    assert not (tmp_path / "strings").exists()  # nothing left that looks like a dataset
    with pytest.raises(TypeError, match="column 'v': expected lists of one length per row, got lengths from 1 to 2"):
        write_ray_dataset(ray.data.from_items([{"v": [1.0]}, {"v": [1.0, 2.0]}], override_num_blocks=1),
                          tmp_path / "ragged")
    with pytest.raises(ValueError, match="got an empty ray.data.Dataset"):
        write_ray_dataset(ray.data.range(10).limit(0), tmp_path / "empty")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match="non-empty"):
        write_ray_dataset(ray.data.range(3), tmp_path / "full")
    with pytest.raises(TypeError, match="expected a ray.data.Dataset, got dict"):
        write_ray_dataset({"x": np.zeros(3)}, tmp_path / "dict")
    assert isinstance(ChunkDataset.open(write_ray_dataset(ray.data.range(3), tmp_path / "ok").root), ChunkDataset)
