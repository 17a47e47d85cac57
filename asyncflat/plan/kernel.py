"""The machine-code kernel behind :func:`asyncflat.plan.permutation.permutation`.

The kernel is written directly as LLVM IR with llvmlite (the code generator numba is built on) and
compiled in-process on first use: 0.10-0.14 s of CPU, most of it in LLVM with the GIL released,
where numba took 1.1-1.5 s per process to compile the same loop (and 0.55-0.63 s even when loaded
from numba's on-disk cache, which still initialises numba's whole typing and lowering context).
Nothing is written to disk, so there is no cache to keep safe under concurrent processes or
read-only installs.

It computes exactly what the frozen algorithm of :mod:`asyncflat.plan.permutation` computes:
Philox4x64-10 on the key of ``np.random.Philox(seed)`` (counter based, so raw draw ``i`` is lane
``i % 4`` of block ``i // 4 + 1``), swap targets ``raw % (i + 1)`` and the swaps from the last
position down, a chunk of ``CHUNK`` positions at a time (first the chunk's targets, then its
swaps). It is called through ctypes, which releases the GIL for the call.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator
from typing import Any

import llvmlite.binding as llvm
from llvmlite import ir

__all__ = ["CHUNK", "compile_kernel"]

# Swap targets computed per batch: a multiple of 4 (one Philox block) whose uint32 fit L1.
CHUNK = 4096

_I1, _I32, _I64, _I128 = ir.IntType(1), ir.IntType(32), ir.IntType(64), ir.IntType(128)
_F64 = ir.DoubleType()
_NAME = "asyncflat_permutation"

# Philox4x64-10 constants (Salmon et al. 2011, Random123; numpy's philox.h).
_M0, _M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
_W0, _W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B

#: ``kernel(k0, k1, result_address, n, scratch_address)``: fills ``result`` (``n`` uint32) with
#: the permutation; ``scratch`` holds ``CHUNK`` uint32.
Kernel = Callable[[int, int, int, int, int], None]


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


def _build_module() -> ir.Module:
    module = ir.Module(_NAME)
    signature = ir.FunctionType(
        ir.VoidType(), [_I64, _I64, _I32.as_pointer(), _I64, _I32.as_pointer()]
    )
    function = ir.Function(module, signature, _NAME)
    k0, k1, result, n, swaps = function.args
    b = ir.IRBuilder(function.append_basic_block("entry"))
    slot = b.alloca(_I64)  # swap target under construction (mem2reg turns it into a register)

    with _count(b, _const(0), n, 1) as i:  # result = arange(n)
        b.store(b.trunc(i, _I32), b.gep(result, [i]))

    last_start = b.mul(b.sdiv(b.sub(n, _const(1)), _const(CHUNK)), _const(CHUNK))
    with _count(b, last_start, _const(-1), -CHUNK) as start:
        end = b.select(
            b.icmp_signed("<", b.add(start, _const(CHUNK)), n), b.add(start, _const(CHUNK)), n
        )
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
        with _count(b, b.sub(end, _const(1)), b.sub(start, _const(1)), -1) as i:
            j = b.zext(b.load(b.gep(swaps, [b.sub(i, start)])), _I64)
            at_i, at_j = b.gep(result, [i]), b.gep(result, [j])
            value_i, value_j = b.load(at_i), b.load(at_j)
            b.store(value_j, at_i)
            b.store(value_i, at_j)
    b.ret_void()
    return module


def _optimise(module: Any, machine: Any) -> None:
    """LLVM's -O2 pipeline (-O3 measured no faster here and takes longer to run)."""
    if hasattr(llvm, "create_pass_builder"):  # llvmlite >= 0.44: the new pass manager
        builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(2))
        builder.getModulePassManager().run(module, builder)
    else:  # older llvmlite: the legacy pass manager
        manager = llvm.create_module_pass_manager()
        options = llvm.create_pass_manager_builder()
        options.opt_level = 2
        machine.add_analysis_passes(manager)
        options.populate(manager)
        manager.run(module)


# The JIT engine owns the machine code: it must live as long as the function pointer, which a
# daemon thread may still be running while the interpreter exits.
_engine: Any = None


def compile_kernel() -> Kernel:
    """Compile the kernel for this CPU and return it (~0.1 s of CPU; call once per process)."""
    global _engine
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    try:
        cpu, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
    except RuntimeError:  # some platforms cannot report features: the generic CPU is correct too
        cpu, features = "", ""
    target = llvm.Target.from_default_triple()
    machine = target.create_target_machine(cpu=cpu, features=features, opt=3)
    module = _build_module()
    module.triple = target.triple
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    _optimise(parsed, machine)
    engine = llvm.create_mcjit_compiler(parsed, machine)
    engine.finalize_object()
    prototype = ctypes.CFUNCTYPE(
        None, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p
    )
    kernel = prototype(engine.get_function_address(_NAME))
    # Never disposed: freeing the code at interpreter exit, under a thread still running it,
    # would crash the process. It is a few kilobytes, once per process.
    engine.detach()
    _engine = engine
    return kernel
