"""The machine-code kernels behind :func:`asyncflat.plan.permutation.permutation` and
:func:`~asyncflat.plan.permutation.permutation_columns`.

Each kernel is written directly as LLVM IR with llvmlite (the code generator numba is built on)
and compiled in-process on first use, on its own (a process that needs one never compiles the
other): ~0.04 s for the permutation's (~0.06 s of CPU), ~0.07 s for the columns' (see
:func:`_optimise`), most of it in LLVM with the GIL released (importing llvmlite adds
~0.02 s once, and whatever garbage collection its objects set off: a full collection of a
process that imported JAX took ~0.04 s on a 2-core VM), where numba took 1.1-1.5 s per process
to compile the same loop (and 0.55-0.63 s even when loaded from numba's on-disk cache, which
still initialises numba's whole typing and lowering context). Nothing is written to disk, so
there is no cache to keep safe under concurrent processes or read-only installs.

It computes exactly what the frozen algorithm of :mod:`asyncflat.plan.permutation` computes:
Philox4x64-10 on the key of ``np.random.Philox(seed)`` (counter based, so raw draw ``i`` is lane
``i % 4`` of block ``i // 4 + 1``), swap targets ``raw % (i + 1)`` and the swaps from the last
position down. The permutation's draws and swaps are separate functions (:class:`Kernel`), so
that the caller can draw one piece of targets on another core while it swaps the last. They are
called through ctypes, which releases the GIL for the call. Every function reads a stop flag
(an int32 another thread may set) before each chunk and returns early when it is set,
so that closing a loader does not wait for a block order nobody will read (~1 s at 10^14
tokens); the caller then discards the result.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import llvmlite.binding as llvm
from llvmlite import ir

__all__ = [
    "CHUNK",
    "PREFETCH_AHEAD",
    "ColumnsKernel",
    "Kernel",
    "compile_columns_kernel",
    "compile_kernel",
]

# Swap targets computed per batch: a multiple of 4 (one Philox block) whose uint32 fit L1.
CHUNK = 4096
#: How many swaps ahead the permutation prefetches the entry a swap will touch.
PREFETCH_AHEAD = 64

_I1, _I8, _I32 = ir.IntType(1), ir.IntType(8), ir.IntType(32)
_I64, _I128 = ir.IntType(64), ir.IntType(128)
_F64 = ir.DoubleType()
_IOTA = "asyncflat_permutation_iota"
_DRAWS = "asyncflat_permutation_draws"
_SWAPS = "asyncflat_permutation_swaps"
_DRAW_ALL = "asyncflat_permutation_draw_all"
_DRAWS_MATCHING = "asyncflat_permutation_draws_matching"
_SWAP_ALL = "asyncflat_permutation_swap_all"
#: microseconds a thread of the permutation's two sleeps while it waits for the other's piece
_WAIT_US = 20
_COLUMNS = "asyncflat_permutation_columns"
_EMPTY = ir.Constant(_I32, 0xFFFFFFFF)
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: Fibonacci hashing

# Philox4x64-10 constants (Salmon et al. 2011, Random123; numpy's philox.h).
_M0, _M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
_W0, _W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B


class Kernel(NamedTuple):
    """The permutation's functions (arrays by address; ``stop`` the address of an int32: each
    returns early, its work unfinished, once that is non-zero).

    ``swap_all(k0, k1, result, ring, slots, piece, n, counters, stop, sleep)`` computes the
    permutation of ``n`` into ``result``, in pieces of ``piece`` positions (a multiple of 4)
    from the top down: each piece's swap targets drawn (Philox and a modulo), then its swaps
    done. With ``slots`` 0 it draws each piece itself into ``ring`` (a piece long). Else
    ``draw_all(k0, k1, ring, slots, piece, n, counters, stop, sleep)`` runs at once on another
    thread, drawing the pieces into a ring of ``slots`` pieces that ``swap_all`` swaps from:
    ``counters`` are three int64, zero at the start (pieces drawn, pieces swapped, and abort:
    either returns once it is non-zero while it waits), and each waits for the other by
    calling ``sleep`` (the address of a C ``usleep``) for 20 us at a time, never for the GIL.
    """

    swap_all: Callable[[int, int, int, int, int, int, int, int, int, int], None]
    draw_all: Callable[[int, int, int, int, int, int, int, int, int], None]
    #: ``draws_matching(k0, k1, targets, start, end, table, mask, hits, capacity, stop)``: the
    #: swap targets of positions ``[start, end)`` (``start`` a multiple of 4) into the uint32
    #: array at ``targets``, and the indices into it of those whose ``target & mask`` the byte
    #: ``table`` flags into the int32 array ``hits`` (its first ``capacity``); returns how many
    #: there are (more than ``capacity``: not all written), or -1 once ``stop`` is set (the
    #: targets unfinished). What :mod:`~asyncflat.plan.entries` walks: one pass with the GIL
    #: released, where numpy's draws, modulo and filter take ~2x the time in many calls.
    draws_matching: Callable[[int, int, int, int, int, int, int, int, int, int], int]


#: ``columns(k0, k1, n, streams, rank, served, keys, values, bits, out, scratch, stop)``
#: (addresses for the arrays): some columns of the permutation, see :func:`_build_columns`.
ColumnsKernel = Callable[[int, int, int, int, int, int, int, int, int, int, int, int], None]


def _const(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


@contextlib.contextmanager
def _count(b: ir.IRBuilder, start: Any, stop: Any, step: int) -> Iterator[Any]:
    """``for i in range(start, stop, step)`` over signed i64 values; yields ``i``."""
    before = b.block
    head = b.append_basic_block("head")
    body = b.append_basic_block("body")
    after = b.append_basic_block("after")
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(_I64)
    i.add_incoming(start, before)
    b.cbranch(b.icmp_signed("<" if step > 0 else ">", i, stop), body, after)
    b.position_at_end(body)
    yield i
    i.add_incoming(b.add(i, _const(step)), b.block)
    b.branch(head)
    b.position_at_end(after)


def _piece_end(b: ir.IRBuilder, start: Any, size: int, n: Any) -> Any:
    """``min(start + size, n)``: the end of the piece of positions starting at ``start``."""
    end = b.add(start, _const(size))
    return b.select(b.icmp_signed("<", end, n), end, n)


def _return_if_stopped(b: ir.IRBuilder, stop: Any) -> None:
    """Return from the kernel if the int32 at ``stop`` is non-zero (an atomic load: read again
    each time, never hoisted out of the loop)."""
    flag = b.load_atomic(stop, "monotonic", 4)
    with b.if_then(b.icmp_signed("!=", flag, ir.Constant(_I32, 0)), likely=False):
        b.ret_void()


def _mulhilo(b: ir.IRBuilder, a: int, x: Any) -> tuple[Any, Any]:
    """(high, low) 64-bit halves of the 128-bit product of the constant ``a`` and ``x``."""
    product = b.mul(ir.Constant(_I128, a), b.zext(x, _I128))
    return b.trunc(b.lshr(product, ir.Constant(_I128, 64)), _I64), b.trunc(product, _I64)


def _philox_block(b: ir.IRBuilder, counter: Any, k0: Any, k1: Any) -> list[Any]:
    zero = _const(0)
    c0, c1, c2, c3 = counter, zero, zero, zero
    for r in range(10):
        if r:
            k0, k1 = b.add(k0, _const(_W0)), b.add(k1, _const(_W1))
        hi0, lo0 = _mulhilo(b, _M0, c0)
        hi1, lo1 = _mulhilo(b, _M1, c2)
        c0, c1, c2, c3 = b.xor(b.xor(hi1, c1), k0), lo1, b.xor(b.xor(hi0, c3), k1), lo0
    return [c0, c1, c2, c3]


def _targets(b: ir.IRBuilder, k0: Any, k1: Any, start: Any, end: Any, swaps: Any) -> None:
    """Swap targets ``raw[i] % (i + 1)`` of positions ``[start, end)`` into ``swaps[i - start]``."""
    slot = b.alloca(_I64)  # swap target under construction (mem2reg turns it into a register)
    first_block = b.sdiv(start, _const(4))
    stop_block = b.sdiv(b.add(end, _const(3)), _const(4))
    with _count(b, first_block, stop_block, 1) as block:
        lanes = _philox_block(b, b.add(block, _const(1)), k0, k1)
        for lane, x in enumerate(lanes):
            i = b.add(b.mul(block, _const(4)), _const(lane))
            with b.if_then(b.icmp_signed("<", i, end)):
                d = b.add(i, _const(1))
                with b.if_else(b.icmp_signed("<", i, _const(65536))) as (small, large):
                    with small:  # the float quotient below is only safe above 2**16
                        b.store(b.urem(x, d), slot)
                    with large:
                        # q * d < x + 2**12. If q * d <= x, r is exact and r < d iff q is the
                        # true quotient; if q * d > x, r wraps to above 2**64 - 2**12 > d.
                        # So r < d exactly when r is right.
                        q = b.fptoui(b.fdiv(b.uitofp(x, _F64), b.uitofp(d, _F64)), _I64)
                        r = b.sub(x, b.mul(q, d))
                        b.store(r, slot)
                        with b.if_then(b.icmp_unsigned(">=", r, d), likely=False):
                            b.store(b.urem(x, d), slot)
                target = b.trunc(b.load(slot), _I32)
                b.store(target, b.gep(swaps, [b.sub(i, start)]))


def _build_permutation(module: ir.Module) -> tuple[ir.Function, ir.Function, ir.Function]:
    """``iota``, ``draws`` and ``swaps``, the parts :func:`_build_pipeline`'s functions call.

    Apart, so that the draws (~40% of the time: Philox and a modulo per position) can run on
    another core ahead of the swaps (random accesses, one after the other), which wait for
    nothing else.
    """
    ptr = _I32.as_pointer()
    iota = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr, _I64, ptr]), _IOTA)
    result, n, stop = iota.args
    b = ir.IRBuilder(iota.append_basic_block("entry"))
    # a stop check every 16 chunks: this pass alone first-writes the whole array when its pages
    # were not written ahead (0.4-0.7 s at 95M entries), and closing must not wait for it
    piece = 16 * CHUNK
    with _count(b, _const(0), n, piece) as lo:
        _return_if_stopped(b, stop)
        with _count(b, lo, _piece_end(b, lo, piece, n), 1) as i:
            b.store(b.trunc(i, _I32), b.gep(result, [i]))
    b.ret_void()

    signature = ir.FunctionType(ir.VoidType(), [_I64, _I64, ptr, _I64, _I64, ptr])
    draws = ir.Function(module, signature, _DRAWS)
    k0, k1, targets, start, end, stop = draws.args
    b = ir.IRBuilder(draws.append_basic_block("entry"))
    with _count(b, start, end, CHUNK) as lo:
        _return_if_stopped(b, stop)
        _targets(b, k0, k1, lo, _piece_end(b, lo, CHUNK, end), b.gep(targets, [b.sub(lo, start)]))
    b.ret_void()

    swaps = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr, ptr, _I64, _I64, ptr]), _SWAPS)
    result, targets, start, end, stop = swaps.args
    # llvm.prefetch(address, write, locality, data cache)
    prefetch = ir.Function(
        module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]),
        "llvm.prefetch.p0i8",
    )  # fmt: skip
    b = ir.IRBuilder(swaps.append_basic_block("entry"))
    with _count(b, b.sub(end, _const(1)), b.sub(start, _const(1)), -CHUNK) as top:
        _return_if_stopped(b, stop)
        low = b.sub(top, _const(CHUNK - 1))
        low = b.select(b.icmp_signed(">", low, start), low, start)
        with _count(b, top, b.sub(low, _const(1)), -1) as i:
            # Beyond the caches each swap is a random access: prefetch the entry the swap
            # PREFETCH_AHEAD positions down will touch (measured 15% faster at 2**24).
            ahead = b.sub(i, _const(PREFETCH_AHEAD))
            with b.if_then(b.icmp_signed(">=", ahead, start)):
                later = b.zext(b.load(b.gep(targets, [b.sub(ahead, start)])), _I64)
                address = b.bitcast(b.gep(result, [later]), _I8.as_pointer())
                b.call(prefetch, [address, *(ir.Constant(_I32, v) for v in (1, 3, 1))])
            j = b.zext(b.load(b.gep(targets, [b.sub(i, start)])), _I64)
            at_i, at_j = b.gep(result, [i]), b.gep(result, [j])
            value_i, value_j = b.load(at_i), b.load(at_j)
            b.store(value_j, at_i)
            b.store(value_i, at_j)
    b.ret_void()
    return iota, draws, swaps


def _build_draws_matching(module: ir.Module) -> None:
    """``draws_matching`` (see :class:`Kernel`): a chunk's targets drawn (:func:`_targets`), then
    read back from L1 through the filter table, one chunk at a time."""
    ptr, bytes_ = _I32.as_pointer(), _I8.as_pointer()
    signature = [_I64, _I64, ptr, _I64, _I64, bytes_, _I64, ptr, _I64, ptr]
    function = ir.Function(module, ir.FunctionType(_I64, signature), _DRAWS_MATCHING)
    k0, k1, targets, start, end, table, mask, hits, capacity, stop = function.args
    b = ir.IRBuilder(function.append_basic_block("entry"))
    count = b.alloca(_I64)
    b.store(_const(0), count)
    with _count(b, start, end, CHUNK) as lo:
        flag = b.load_atomic(stop, "monotonic", 4)
        with b.if_then(b.icmp_signed("!=", flag, ir.Constant(_I32, 0)), likely=False):
            b.ret(_const(-1))
        hi = _piece_end(b, lo, CHUNK, end)
        _targets(b, k0, k1, lo, hi, b.gep(targets, [b.sub(lo, start)]))
        with _count(b, b.sub(lo, start), b.sub(hi, start), 1) as k:
            low = b.and_(b.zext(b.load(b.gep(targets, [k])), _I64), mask)
            flagged = b.icmp_unsigned("!=", b.load(b.gep(table, [low])), ir.Constant(_I8, 0))
            with b.if_then(flagged, likely=False):
                found = b.load(count)
                with b.if_then(b.icmp_signed("<", found, capacity)):
                    b.store(b.trunc(k, _I32), b.gep(hits, [found]))
                b.store(b.add(found, _const(1)), count)
    b.ret(b.load(count))


def _build_pipeline(
    module: ir.Module, iota: ir.Function, draws: ir.Function, swaps: ir.Function
) -> None:
    """``swap_all`` and ``draw_all`` (see :class:`Kernel`): the whole permutation in one call
    per thread, with no Python between its pieces (each return to Python waits for the GIL, up
    to a switch interval while another thread runs Python: seconds at 10^14 tokens). Two
    threads hand the pieces over through a ring of ``slots`` pieces and counters."""
    ptr, counters_type = _I32.as_pointer(), _I64.as_pointer()
    sleep_type = ir.FunctionType(_I32, [_I32]).as_pointer()  # usleep's

    def wait(
        b: ir.IRBuilder, counter: Any, above: Any, counters: Any, stop: Any, sleep: Any
    ) -> None:
        """Until ``counter > above``; return from the function on ``stop`` or abort."""
        head, idle, ready = (b.append_basic_block(name) for name in ("wait", "idle", "ready"))
        b.branch(head)
        b.position_at_end(head)
        b.cbranch(b.icmp_signed(">", b.load_atomic(counter, "acquire", 8), above), ready, idle)
        b.position_at_end(idle)
        _return_if_stopped(b, stop)
        abort = b.load_atomic(b.gep(counters, [_const(2)]), "monotonic", 8)
        with b.if_then(b.icmp_signed("!=", abort, _const(0))):
            b.ret_void()
        b.call(sleep, [ir.Constant(_I32, _WAIT_US)])
        b.branch(head)
        b.position_at_end(ready)

    def pieces(b: ir.IRBuilder, n: Any, piece: Any) -> tuple[Any, Callable[[Any], tuple[Any, Any]]]:
        """The count of pieces, and ``[start, end)`` of piece ``k`` (counted from the top)."""
        count = b.sdiv(b.add(n, b.sub(piece, _const(1))), piece)

        def bounds(k: Any) -> tuple[Any, Any]:
            start = b.mul(b.sub(b.sub(count, _const(1)), k), piece)
            end = b.add(start, piece)
            return start, b.select(b.icmp_signed("<", end, n), end, n)

        return count, bounds

    # swap_all(k0, k1, result, ring, slots, piece, n, counters, stop, sleep): slots 0 draws here
    signature = [_I64, _I64, ptr, ptr, _I64, _I64, _I64, counters_type, ptr, sleep_type]
    function = ir.Function(module, ir.FunctionType(ir.VoidType(), signature), _SWAP_ALL)
    k0, k1, result, ring, slots, piece, n, counters, stop, sleep = function.args
    b = ir.IRBuilder(function.append_basic_block("entry"))
    b.call(iota, [result, n, stop])  # while a helper draws the first pieces
    drawn, swapped = b.gep(counters, [_const(0)]), b.gep(counters, [_const(1)])
    count, bounds = pieces(b, n, piece)
    here = b.icmp_signed("==", slots, _const(0))
    with _count(b, _const(0), count, 1) as k:
        start, end = bounds(k)
        with b.if_else(here) as (alone, helped):
            with alone:
                b.call(draws, [k0, k1, ring, start, end, stop])
            with helped:
                wait(b, drawn, k, counters, stop, sleep)
        divisor = b.select(here, _const(1), slots)  # (alone: slot 0, the ring itself)
        targets = b.gep(ring, [b.mul(b.srem(k, divisor), piece)])
        b.call(swaps, [result, targets, start, end, stop])
        b.store_atomic(b.add(k, _const(1)), swapped, "release", 8)
    b.ret_void()

    # draw_all(k0, k1, ring, slots, piece, n, counters, stop, sleep)
    signature = [_I64, _I64, ptr, _I64, _I64, _I64, counters_type, ptr, sleep_type]
    function = ir.Function(module, ir.FunctionType(ir.VoidType(), signature), _DRAW_ALL)
    k0, k1, ring, slots, piece, n, counters, stop, sleep = function.args
    b = ir.IRBuilder(function.append_basic_block("entry"))
    drawn, swapped = b.gep(counters, [_const(0)]), b.gep(counters, [_const(1)])
    count, bounds = pieces(b, n, piece)
    with _count(b, _const(0), count, 1) as k:
        wait(b, swapped, b.sub(k, slots), counters, stop, sleep)  # its slot's last piece swapped
        start, end = bounds(k)
        b.call(draws, [k0, k1, b.gep(ring, [b.mul(b.srem(k, slots), piece)]), start, end, stop])
        _return_if_stopped(b, stop)  # an unfinished piece is never handed over
        b.store_atomic(b.add(k, _const(1)), drawn, "release", 8)
    b.ret_void()


def _build_module(columns: bool) -> ir.Module:
    module = ir.Module(_COLUMNS if columns else "asyncflat_permutation")
    if columns:
        _build_columns(module)
    else:
        _build_pipeline(module, *_build_permutation(module))
        _build_draws_matching(module)
    return module


def _table_functions(module: ir.Module) -> tuple[ir.Function, ir.Function, ir.Function]:
    """``find``, ``insert`` and ``remove`` of an open-addressing table (linear probing, Knuth's
    deletion by backward shift, so no tombstones) of uint32 keys (``EMPTY`` marks a free slot)
    and uint32 values: ``(keys, values, bits, key[, value])``, 2**bits slots, Fibonacci hashing
    (the keys are strided positions)."""
    ptr = _I32.as_pointer()
    internal = []
    for name, extra, returns in (
        ("find", [_I32], _I64),
        ("insert", [_I32, _I32], ir.VoidType()),
        ("remove", [_I64], ir.VoidType()),
    ):
        function = ir.Function(module, ir.FunctionType(returns, [ptr, ptr, _I64, *extra]), name)
        function.linkage = "internal"
        internal.append(function)
    find, insert, remove = internal

    def home(b: ir.IRBuilder, key: Any, bits: Any) -> Any:
        return b.lshr(b.mul(b.zext(key, _I64), _const(_GOLDEN)), b.sub(_const(64), bits))

    # find: the slot holding ``key``, else the free slot where the probe ended.
    keys, _, bits, key = find.args
    b = ir.IRBuilder(find.append_basic_block("entry"))
    mask = b.sub(b.shl(_const(1), bits), _const(1))
    start = home(b, key, bits)
    entry, head, done = b.block, find.append_basic_block("probe"), find.append_basic_block("done")
    b.branch(head)
    b.position_at_end(head)
    j = b.phi(_I64)
    j.add_incoming(start, entry)
    seen = b.load(b.gep(keys, [j]))
    stop = b.or_(b.icmp_unsigned("==", seen, _EMPTY), b.icmp_unsigned("==", seen, key))
    j.add_incoming(b.and_(b.add(j, _const(1)), mask), head)
    b.cbranch(stop, done, head)
    b.position_at_end(done)
    b.ret(j)

    # insert: ``key`` is absent; the first free slot of its probe takes it.
    keys, values, bits, key, value = insert.args
    b = ir.IRBuilder(insert.append_basic_block("entry"))
    slot = b.call(find, [keys, values, bits, key])
    b.store(key, b.gep(keys, [slot]))
    b.store(value, b.gep(values, [slot]))
    b.ret_void()

    # remove: empty slot ``hole``, moving back each later entry of the run that may fill it.
    keys, values, bits, first = remove.args
    b = ir.IRBuilder(remove.append_basic_block("entry"))
    mask = b.sub(b.shl(_const(1), bits), _const(1))
    entry, head = b.block, remove.append_basic_block("shift")
    done = remove.append_basic_block("done")
    b.branch(head)
    b.position_at_end(head)
    hole, j = b.phi(_I64), b.phi(_I64)
    hole.add_incoming(first, entry)
    j.add_incoming(first, entry)
    nxt = b.and_(b.add(j, _const(1)), mask)
    seen = b.load(b.gep(keys, [nxt]))
    empty = b.icmp_unsigned("==", seen, _EMPTY)
    distance = b.and_(b.sub(nxt, home(b, seen, bits)), mask)  # from its home to nxt
    movable = b.and_(b.not_(empty), b.icmp_unsigned(">=", distance, b.and_(b.sub(nxt, hole), mask)))
    with b.if_then(movable):
        b.store(seen, b.gep(keys, [hole]))
        b.store(b.load(b.gep(values, [nxt])), b.gep(values, [hole]))
    hole.add_incoming(b.select(movable, nxt, hole), b.block)
    j.add_incoming(nxt, b.block)
    b.cbranch(empty, done, head)
    b.position_at_end(done)
    b.store(_EMPTY, b.gep(keys, [hole]))
    b.ret_void()
    return find, insert, remove


def _build_columns(module: ir.Module) -> None:
    """``columns(k0, k1, n, streams, rank, served, keys, values, bits, out, scratch)``: the
    entries of the permutation at positions ``p`` whose column ``p % streams`` has
    ``rank[column] >= 0``, into ``out[(p // streams) * served + rank[column]]``.

    Fisher-Yates swaps positions ``i`` and ``t[i] <= i`` from the top down; undone from the
    bottom up, the transpositions carry each wanted position back to the one it started from,
    which is the value the permutation holds there. Position ``i`` is first touched by undo
    step ``i``, so a wanted position enters the table (position -> output index) at its own
    step, and the table never holds more entries than the output: memory in proportion to the
    served columns, time in proportion to ``n`` (one draw and one probe per position).
    """
    ptr = _I32.as_pointer()
    signature = ir.FunctionType(
        ir.VoidType(), [_I64, _I64, _I64, _I64, ptr, _I64, ptr, ptr, _I64, ptr, ptr, ptr]
    )
    function = ir.Function(module, signature, _COLUMNS)
    k0, k1, n, streams, rank, served, keys, values, bits, out, swaps, stop = function.args
    find, insert, remove = _table_functions(module)
    b = ir.IRBuilder(function.append_basic_block("entry"))
    row, column = b.alloca(_I64), b.alloca(_I64)
    b.store(_const(0), row)
    b.store(_const(0), column)
    with _count(b, _const(0), n, CHUNK) as start:
        _return_if_stopped(b, stop)
        end = _piece_end(b, start, CHUNK, n)
        _targets(b, k0, k1, start, end, swaps)
        with _count(b, start, end, 1) as i:
            target = b.load(b.gep(swaps, [b.sub(i, start)]))
            here = b.trunc(i, _I32)
            col, line = b.load(column), b.load(row)
            position_rank = b.load(b.gep(rank, [col]))
            wanted = b.icmp_signed(">=", position_rank, ir.Constant(_I32, 0))
            index = b.trunc(b.add(b.mul(line, served), b.sext(position_rank, _I64)), _I32)
            wrap = b.icmp_signed("==", b.add(col, _const(1)), streams)
            b.store(b.select(wrap, _const(0), b.add(col, _const(1))), column)
            b.store(b.add(line, b.zext(wrap, _I64)), row)
            with b.if_else(b.icmp_unsigned("==", target, here)) as (stays, swapped):
                with stays, b.if_then(wanted):
                    b.call(insert, [keys, values, bits, here, index])
                with swapped:
                    slot = b.call(find, [keys, values, bits, target])
                    found = b.icmp_unsigned("==", b.load(b.gep(keys, [slot])), target)
                    with b.if_else(found) as (moved, vacant):
                        with moved:  # the wanted position at target moves up to i
                            carried = b.load(b.gep(values, [slot]))
                            with b.if_else(wanted) as (both, only):
                                with both:
                                    b.store(index, b.gep(values, [slot]))
                                with only:
                                    b.call(remove, [keys, values, bits, slot])
                            b.call(insert, [keys, values, bits, here, carried])
                        with vacant, b.if_then(wanted):  # i moves down to target's free slot
                            b.store(target, b.gep(keys, [slot]))
                            b.store(index, b.gep(values, [slot]))
    with _count(b, _const(0), b.shl(_const(1), bits), 1) as j:
        key = b.load(b.gep(keys, [j]))
        with b.if_then(b.icmp_unsigned("!=", key, _EMPTY)):
            b.store(key, b.gep(out, [b.zext(b.load(b.gep(values, [j])), _I64)]))
    b.ret_void()


def _optimise(module: Any, machine: Any, *, full: bool) -> None:
    """LLVM's -O2 pipeline (``full``), else only SROA, instcombine and simplifycfg.

    The permutation kernel's IR is written as the loop it should be: the three passes take
    ~6 ms against 40-50 ms for -O2, on the way to a large corpus's first batch, and the kernel
    runs as fast at large sizes (14.3M swaps 106-123 against 103-132 ms, interleaved fresh
    processes) and 5-8% slower in cache (2^20: ~0.2 ms a call). The columns kernel needs -O2:
    12% slower without it (145 against 128 ms for one column of 1,024 at 14.3M entries), more
    than the compile time saved at 10^14 tokens.
    """
    if hasattr(llvm, "create_pass_builder"):  # llvmlite >= 0.44: the new pass manager
        builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(2))
        if full:
            builder.getModulePassManager().run(module, builder)
            return
        functions = llvm.create_new_function_pass_manager()
        if hasattr(functions, "add_sroa_pass"):  # from 0.45: before it, the legacy one below
            functions.add_sroa_pass()
            functions.add_instruction_combine_pass()
            functions.add_simplify_cfg_pass()
            for function in module.functions:
                if not function.is_declaration:
                    functions.run(function, builder)
            return
    legacy = llvm.create_module_pass_manager()
    machine.add_analysis_passes(legacy)
    if full:
        options = llvm.create_pass_manager_builder()
        options.opt_level = 2
        options.populate(legacy)
    else:
        legacy.add_sroa_pass()
        legacy.add_instruction_combining_pass()
        legacy.add_cfg_simplification_pass()
    legacy.run(module)


# The JIT engines own the machine code: they must live as long as the function pointers, which
# a daemon thread may still be running while the interpreter exits.
_engines: list[Any] = []


def compile_kernel() -> Kernel:
    """Compile the permutation kernel for this CPU and return it (~0.04 s)."""
    swap_all, draw_all, draws_matching = _compile(columns=False)
    u64, i64, p = ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p
    return Kernel(
        ctypes.CFUNCTYPE(None, u64, u64, p, p, i64, i64, i64, p, p, p)(swap_all),
        ctypes.CFUNCTYPE(None, u64, u64, p, i64, i64, i64, p, p, p)(draw_all),
        ctypes.CFUNCTYPE(i64, u64, u64, p, i64, i64, p, i64, p, i64, p)(draws_matching),
    )


def compile_columns_kernel() -> ColumnsKernel:
    """Compile the columns kernel for this CPU and return it (~0.07 s of CPU). Apart from the
    permutation's: a process that needs one of them (a host serving every stream, or one of
    many) never compiles the other (compiling both took 0.13 s, on the way to a first batch)."""
    (address,) = _compile(columns=True)
    u64, i64, pointer = ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p
    return ctypes.CFUNCTYPE(
        None, u64, u64, i64, i64, pointer, i64, pointer, pointer, i64, pointer, pointer, pointer
    )(address)


def _compile(*, columns: bool) -> list[int]:
    """Compile one kernel's module; the addresses of its functions."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    try:
        cpu, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
    except RuntimeError:  # some platforms cannot report features: the generic CPU is correct too
        cpu, features = "", ""
    target = llvm.Target.from_default_triple()
    # The permutation's hand-written loops run as fast from code generated at level 1 (14.3M
    # positions 119 against 122-128 ms), which takes ~4 ms less to generate than level 3.
    machine = target.create_target_machine(cpu=cpu, features=features, opt=3 if columns else 1)
    module = _build_module(columns)
    module.triple = target.triple
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    _optimise(parsed, machine, full=columns)
    engine = llvm.create_mcjit_compiler(parsed, machine)
    engine.finalize_object()
    names = [_COLUMNS] if columns else [_SWAP_ALL, _DRAW_ALL, _DRAWS_MATCHING]
    addresses = [int(engine.get_function_address(name)) for name in names]
    # Never disposed: freeing the code at interpreter exit, under a thread still running it,
    # would crash the process. It is a few kilobytes, once per process.
    engine.detach()
    _engines.append(engine)
    return addresses
