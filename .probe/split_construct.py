import asyncio, os, sys, time
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
    t0 = time.perf_counter()
    src = await ZarrTokenSource.open(os.fspath(params.filespec), "train", storage_options=params.storage_options)
    t1 = time.perf_counter()
    eng = op._engine("w", params, batch, rows, EngineOptions(), src, 0, True)
    t2 = time.perf_counter()
    eng.open(fill=False, write_pages=False)
    t3 = time.perf_counter()
    print(f"index {index}: source {1e3*(t1-t0):.1f} ms, plan+engine {1e3*(t2-t1):.2f} ms, open {1e3*(t3-t2):.2f} ms")
    await eng.aclose()
import gc; gc.collect()
for _ in range(2):
    asyncio.run(run())
