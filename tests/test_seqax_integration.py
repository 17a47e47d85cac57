"""The seqax drop-in (examples/seqax/input_loader.py over asyncflat.integrations.seqax).

seqax itself is not a test dependency: a minimal stand-in for seqax's ``shardlib.shardtypes``
(written here, with the same public surface the drop-in uses: ``u32``/``bool_`` shape types,
``pytree_dataclass`` and ``make_shardings`` over the active mesh) is put on ``sys.path``. The real
client check, seqax's own train.py on the shipped file, is the seqax_client harness (docs/migrating.md).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import jax
import numpy as np
import pytest
from conftest import random_sequences
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from reference_impl import ReferenceLoader, load_split_arrays

import asyncflat
from asyncflat import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DROP_IN = ROOT / "examples" / "seqax" / "input_loader.py"

STAND_IN = '''
"""A stand-in for seqax's shardlib.shardtypes: the names examples/seqax/input_loader.py uses."""
import dataclasses
from types import GenericAlias

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH = Mesh(np.empty((), dtype=object), ())  # the active mesh (seqax reads jax's); tests set it


class number:
    def __class_getitem__(cls, spec):
        return GenericAlias(cls, spec.encode() if isinstance(spec, str) else spec)


class u32(number):
    pass


class bool_(number):
    pass


def pytree_dataclass(cls):
    cls = dataclasses.dataclass(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    jax.tree_util.register_pytree_node(
        cls, lambda v: ([getattr(v, n) for n in names], None), lambda _, kids: cls(*kids)
    )
    return cls


def _spec(annotation):
    dims = annotation.__args__[0].decode().split()
    return PartitionSpec(*[d.split("/")[1] if "/" in d else None for d in dims])


def make_shardings(cls):
    return cls(*[NamedSharding(MESH, _spec(f.type)) for f in dataclasses.fields(cls)])
'''

SEQ_LEN, BATCH = 32, 16
FIELDS = dict(streams=2, read_blocks_per_shuffle_buffer=2, sequences_per_read_block=8, seed=1)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("seqax")
    (root / "shardlib").mkdir()
    (root / "shardlib" / "__init__.py").write_text("")
    (root / "shardlib" / "shardtypes.py").write_text(STAND_IN)
    return root


@pytest.fixture()
def drop_in(stand_in: Path, monkeypatch: pytest.MonkeyPatch):
    """The shipped file imported as seqax imports it, with the stand-in shardlib; removed after."""
    monkeypatch.syspath_prepend(str(stand_in))
    names = ["shardlib", "shardlib.shardtypes", "asyncflat.integrations.seqax", "input_loader"]
    yield _import(DROP_IN)
    for name in names:
        sys.modules.pop(name, None)
    if hasattr(asyncflat.integrations, "seqax"):  # not monkeypatch: its undo would restore it
        del asyncflat.integrations.seqax


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("input_loader", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["input_loader"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("seqax-data") / "data.zarr")
    asyncflat.write_flat_tokens(path, {"train": random_sequences(3, 500, max_len=80)})
    return path


def test_the_drop_in_exports_what_seqax_train_imports(drop_in: ModuleType) -> None:
    for name in ("FlatTokensParams", "HuggingFaceDataParams", "TokenBatchParams", "get_loader"):
        assert name in drop_in.__all__ and hasattr(drop_in, name)
    assert drop_in.FlatTokensParams is asyncflat.FlatTokensParams
    shardtypes = sys.modules["shardlib.shardtypes"]
    hints = {f.name: f.type for f in __import__("dataclasses").fields(drop_in.TokenBatch)}
    assert hints == {
        "targets": shardtypes.u32["batch/d len"],  # seqax's own declaration, equal as types
        "is_seq_start": shardtypes.bool_["batch/d len"],
    }


def test_batches_are_seqax_token_batches_sharded_as_seqax_shards_them(
    drop_in: ModuleType, dataset: str
) -> None:
    shardtypes = sys.modules["shardlib.shardtypes"]
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("d", "t"))
    shardtypes.MESH = mesh
    tokens, starts = load_split_arrays(dataset, "train")
    oracle = ReferenceLoader(
        tokens, starts, seq_len=SEQ_LEN, batch=BATCH, sequence_packing=True, **FIELDS
    )
    params = drop_in.FlatTokensParams(filespec=dataset, sequence_packing=True, **FIELDS)
    batch_params = drop_in.TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    loader = drop_in.get_loader("train", params, batch_params)  # seqax: inside `with mesh:`
    with loader:
        assert loader.step_count == oracle.step_count
        expected = NamedSharding(mesh, PartitionSpec("d", None))
        for step in (5, 0, loader.step_count - 1):
            batch = loader.load(step)
            assert type(batch) is drop_in.TokenBatch
            targets, is_start = oracle.batch(step)
            np.testing.assert_array_equal(np.asarray(batch.targets), targets)
            np.testing.assert_array_equal(np.asarray(batch.is_seq_start), is_start)
            for leaf in jax.tree_util.tree_leaves(batch):
                assert leaf.sharding == expected
    shardtypes.MESH = Mesh(np.empty((), dtype=object), ())


def test_a_mixture_goes_through_the_drop_in(drop_in: ModuleType, dataset: str) -> None:
    shardtypes = sys.modules["shardlib.shardtypes"]
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("d", "t"))
    shardtypes.MESH = mesh
    tokens, starts = load_split_arrays(dataset, "train")
    oracle = ReferenceLoader(
        tokens, starts, seq_len=SEQ_LEN, batch=BATCH, sequence_packing=True, **FIELDS
    )
    params = drop_in.FlatTokensParams(filespec=dataset, sequence_packing=True, **FIELDS)
    mixture = drop_in.MixtureParams((drop_in.MixtureSource(params, 1.0),), seed=4, block_rows=7)
    with drop_in.get_loader(
        "train", mixture, drop_in.TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    ) as loader:
        assert loader.step_count == oracle.step_count
        for step in (3, 0, loader.step_count - 1):
            batch = loader.load(step)
            assert type(batch) is drop_in.TokenBatch
            targets, is_start = oracle.batch(step)
            np.testing.assert_array_equal(np.asarray(batch.targets), targets)
            np.testing.assert_array_equal(np.asarray(batch.is_seq_start), is_start)
            assert batch.targets.sharding == NamedSharding(mesh, PartitionSpec("d", None))
    shardtypes.MESH = Mesh(np.empty((), dtype=object), ())


def test_without_a_mesh_the_error_says_to_open_one(drop_in: ModuleType, dataset: str) -> None:
    params = drop_in.FlatTokensParams(dataset, sequence_packing=True, **FIELDS)
    with pytest.raises(ConfigError, match=r"inside `with Mesh\(\.\.\.\)`"):
        drop_in.get_loader("train", params, drop_in.TokenBatchParams(len=SEQ_LEN, batch=BATCH))


def test_the_hugging_face_path_goes_through_the_drop_in(
    drop_in: ModuleType, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    docs = ["one two three", "four five", "six", "seven eight nine ten"] * 4
    (data / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    shardtypes = sys.modules["shardlib.shardtypes"]
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("d", "t"))
    shardtypes.MESH = mesh
    params = drop_in.HuggingFaceDataParams(
        path=str(data), tokenizer="bytes", num_workers=0, sequences_packed_per_batch=4
    )
    loader = drop_in.get_loader("train", params, drop_in.TokenBatchParams(len=16, batch=8))
    with loader:
        batch = loader.load(0)
        assert type(batch) is drop_in.TokenBatch
        assert batch.targets.sharding == NamedSharding(mesh, PartitionSpec("d", None))
        first = [b + 1 for b in docs[0].encode()]  # the bytes tokenizer: id = byte + 1
        np.testing.assert_array_equal(np.asarray(batch.targets)[0, : len(first)], first)
        assert bool(np.asarray(batch.is_seq_start)[0, 0])
    shardtypes.MESH = Mesh(np.empty((), dtype=object), ())


def test_the_flat_tokens_path_imports_no_hugging_face_stack(stand_in: Path, dataset: str) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(stand_in)!r}, {str(DROP_IN.parent)!r}]
        import numpy as np, jax
        from jax.sharding import Mesh
        import shardlib.shardtypes as shardtypes
        import input_loader
        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("d", "t"))
        shardtypes.MESH = mesh
        params = input_loader.FlatTokensParams({dataset!r}, 2, 2, 8, 1, True)
        loader = input_loader.get_loader(
            "train", params, input_loader.TokenBatchParams(len=32, batch=16)
        )
        loader.load(0)
        loader.close()
        heavy = ["transformers", "torch", "datasets", "tokenizers", "asyncflat.integrations.hf"]
        print([m for m in heavy if m in sys.modules])
        """
    )
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**__import__("os").environ, **env},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
