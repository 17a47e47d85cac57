"""The seeded permutation that orders read blocks and shuffle-buffer rows.

``permutation(seed, n)`` returns exactly what the reference loader's ``_random_permutation``
returns, bit for bit, for every ``(seed, n)``::

    r = np.random.Philox(seed).random_raw(n) % (np.arange(n, dtype=np.uint64) + 1)
    result = np.arange(n, dtype=np.uint32)
    for i in reversed(range(n)):
        result[i], result[r[i]] = result[r[i]], result[i]

That algorithm is frozen forever: a training run that resumes (on another machine, with another
numpy) must see the same data order as before. It was chosen to make that possible:

* numpy's compatibility policy keeps a bit generator's raw stream (``random_raw``) fixed for a
  given seed across versions and platforms, Philox's included; the algorithms behind
  ``Generator.permutation``/``shuffle`` carry no such promise and may change.
* ``raw % (i + 1)`` instead of rejection sampling needs exactly one raw draw per position. Because
  ``i + 1 <= n < 2**32``, the modulo bias of each draw is at most ``2**-32``, which is acceptable.

Evaluated literally it takes about 0.4 s per million elements, so large ``n`` runs a numba kernel
instead (compiled on first use; it runs with the GIL released, so a background thread can
shuffle while the trainer runs Python). The kernel re-implements Philox4x64-10 on the key of
``np.random.Philox(seed)`` (Philox is counter based, so draw ``i`` is lane ``i % 4`` of block
``i // 4 + 1``); the tests check it against numpy's own ``random_raw``, the literal algorithm, and
checked-in golden vectors. Small ``n`` takes a plain Python path that needs no compilation.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import ConfigError

__all__ = ["permutation"]

logger = logging.getLogger(__name__)

# Below this size the plain Python path is fast enough (well under a millisecond) and never pays
# for compiling the kernel.
_SMALL_N = 2048
# Swap targets computed per batch in the kernel: a multiple of 4 (one Philox block) that fits L1.
_CHUNK = 4096

_Kernel = Callable[[np.uint64, np.uint64, np.ndarray], None]
_kernel: _Kernel | None = None
_kernel_lock = threading.Lock()


def permutation(seed: int, n: int) -> np.ndarray:
    """A permutation of ``range(n)`` as a ``uint32`` array, fixed forever by ``(seed, n)``.

    ``seed`` is any non-negative integer (as accepted by ``np.random.Philox``); ``0 <= n < 2**32``.
    """
    seed = _as_int("seed", seed)
    n = _as_int("n", n)
    if seed < 0:
        raise ConfigError(f"permutation: seed must be >= 0, got {seed}")
    if not 0 <= n < 1 << 32:
        raise ConfigError(f"permutation: n must be in [0, 2**32), got {n}")
    bit_generator = np.random.Philox(seed)
    if n < _SMALL_N:
        return _small_permutation(bit_generator, n)
    state = bit_generator.state
    # The kernel replays the generator from its key, so it must start where numpy's would.
    if state["state"]["counter"].any() or state["buffer_pos"] != 4:
        raise RuntimeError(f"unexpected initial Philox state {state!r}")  # numpy changed Philox
    key = state["state"]["key"]
    result = np.empty(n, np.uint32)
    _get_kernel()(key[0], key[1], result)
    return result


def warm_up(n: int) -> None:
    """Compile the kernel now if permutations of ``n`` items need it (~1 s once per process,
    holding the GIL), so that it does not happen inside a first fill."""
    if n >= _SMALL_N:
        _get_kernel()


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"permutation: {name} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(
            f"permutation: {name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None


def _small_permutation(bit_generator: np.random.Philox, n: int) -> np.ndarray:
    bounds = np.arange(1, n + 1, dtype=np.uint64)
    swaps = (bit_generator.random_raw(n) % bounds).tolist()
    result = list(range(n))
    for i in reversed(range(n)):
        j = swaps[i]
        result[i], result[j] = result[j], result[i]
    return np.array(result, dtype=np.uint32)


def _get_kernel() -> _Kernel:
    global _kernel
    if _kernel is None:
        with _kernel_lock:
            if _kernel is None:
                started = time.perf_counter()
                kernel = _build_kernel()
                kernel(np.uint64(0), np.uint64(0), np.empty(4, np.uint32))  # compile it now
                elapsed = time.perf_counter() - started
                logger.debug("compiled the permutation kernel in %.2fs", elapsed)
                _kernel = kernel
    return _kernel


def _build_kernel() -> _Kernel:
    """Define (not yet compile) the numba kernel; numba is imported only when first needed."""
    import numba
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def mulhilo(typingctx: Any, a: Any, b: Any) -> Any:
        """(high, low) 64-bit halves of the 128-bit product ``a * b`` of two uint64."""
        sig = types.UniTuple(types.uint64, 2)(types.uint64, types.uint64)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i64, i128 = ir.IntType(64), ir.IntType(128)
            product = builder.mul(builder.zext(args[0], i128), builder.zext(args[1], i128))
            high = builder.trunc(builder.lshr(product, ir.Constant(i128, 64)), i64)
            low = builder.trunc(product, i64)
            return context.make_tuple(builder, signature.return_type, [high, low])

        return sig, codegen

    # Philox4x64-10 constants (Salmon et al. 2011, Random123; numpy's philox.h).
    m0, m1 = np.uint64(0xD2E7470EE14C6C93), np.uint64(0xCA5A826395121157)
    w0, w1 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBB67AE8584CAA73B)
    zero = np.uint64(0)

    @numba.njit(inline="always")
    def philox_block(counter: np.uint64, k0: np.uint64, k1: np.uint64) -> tuple:
        c0, c1, c2, c3 = counter, zero, zero, zero
        for r in range(10):
            if r:
                k0 += w0
                k1 += w1
            hi0, lo0 = mulhilo(m0, c0)
            hi1, lo1 = mulhilo(m1, c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        return c0, c1, c2, c3

    @numba.njit(inline="always")
    def bounded(x: np.uint64, i: int) -> np.uint64:
        """``x % (i + 1)``, exactly; mostly via a float quotient (integer division is slow)."""
        d = np.uint64(i + 1)
        if i < 65536:  # keeps the float quotient below 2**48, safe to convert
            return x % d
        q = np.uint64(np.float64(x) / np.float64(d))
        # q * d < x + 2**12. If q * d <= x, r is exact and r < d iff q is the true quotient; if
        # q * d > x, r wraps to above 2**64 - 2**12 > d. So r < d exactly when r is right.
        r = x - q * d
        return r if r < d else x % d

    @numba.njit(nogil=True, cache=False)
    def kernel(k0: np.uint64, k1: np.uint64, result: np.ndarray) -> None:
        n = result.size
        for i in range(n):
            result[i] = i
        # Positions are shuffled from the last down, a chunk at a time: first the chunk's swap
        # targets raw[i] % (i + 1) (Philox can start at any block), then its swaps.
        swaps = np.empty(_CHUNK, np.uint32)
        end = n
        for start in range((n - 1) // _CHUNK * _CHUNK, -1, -_CHUNK):
            for block in range(start // 4, (end + 3) // 4):
                lanes = philox_block(np.uint64(block + 1), k0, k1)
                for lane in range(min(4, end - 4 * block)):
                    i = 4 * block + lane
                    swaps[i - start] = bounded(lanes[lane], i)
            for i in range(end - 1, start - 1, -1):
                j = swaps[i - start]
                result[i], result[j] = result[j], result[i]
            end = start

    return kernel
