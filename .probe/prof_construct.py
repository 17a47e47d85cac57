import asyncio, os, sys, time, cProfile, pstats
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, "/work/main/bench"); sys.path.insert(1, "/work/main")
import numpy as np, jax
jax.devices()
import scale
from asyncflat import EngineOptions, TokenBatchParams
from asyncflat.testing import SyntheticCounts
scale.COUNTS = SyntheticCounts()
import asyncflat.loader.shared.open as op
from asyncflat.source.zarr_source import ZarrTokenSource
tokens = int(float(sys.argv[1])); index = int(sys.argv[2])
batch = TokenBatchParams(len=2048, batch=1024)
rows = np.arange(1024, dtype=np.int64)
if index >= 0: rows = rows[index:index+1]
params = scale._params(tokens, 1024)
async def run():
    src = await ZarrTokenSource.open(os.fspath(params.filespec), "train", storage_options=params.storage_options)
    pr = cProfile.Profile(); pr.enable()
    eng = op._engine("w", params, batch, rows, EngineOptions(), src, 0, True)
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
    await eng.aclose()
asyncio.run(run())
