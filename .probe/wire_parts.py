import os, sys, time
sys.path.insert(0, "/work/main/bench")
import wire_start as w
import argparse, jax
args = argparse.Namespace(latency_ms=25.0, tokens_mib=183.0, step_ms=10.0)
from asyncflat.testing import SyntheticCounts
for rep in range(4):
    c = SyntheticCounts()
    t0 = time.perf_counter(); L = w._loader("default", args, c); t1 = time.perf_counter()
    req1 = c.requests
    step = L.plan.first_step(1) + w.RBPSB * w.SPB // w.BATCH // 2
    jax.block_until_ready(L.load(step)); t2 = time.perf_counter()
    print(f"construct {1e3*(t1-t0):.1f} ms ({req1} requests), first load {1e3*(t2-t1):.1f} ms ({c.requests-req1} requests)")
    L.close()
from asyncflat.testing.synthetic import SyntheticFileSystem
orig = SyntheticFileSystem._cat_file
T0 = [0.0]; LOG = []
async def traced(self, path, start=None, end=None, **kw):
    a = time.perf_counter()
    r = await orig(self, path, start=start, end=end, **kw)
    LOG.append((a - T0[0], time.perf_counter() - T0[0], path.split("/", 3)[-1], start, end, len(r)))
    return r
SyntheticFileSystem._cat_file = traced
c = SyntheticCounts()
T0[0] = time.perf_counter(); L = w._loader("default", args, c); t1 = time.perf_counter()
step = L.plan.first_step(1) + w.RBPSB * w.SPB // w.BATCH // 2
n = len(LOG)
jax.block_until_ready(L.load(step)); t2 = time.perf_counter()
print(f"construct {1e3*(t1-T0[0]):.1f} first load ends {1e3*(t2-T0[0]):.1f}")
for e in LOG[:n+30]:
    print(f"{1e3*e[0]:7.1f} {1e3*e[1]:7.1f} {e[2]} {e[3]} {e[4]} {e[5]}")
L.close()
