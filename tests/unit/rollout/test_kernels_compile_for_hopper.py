"""The decode kernels compiled for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter (the CPU tests) runs the kernels as Python, so it never
meets what only the GPU compiler checks, such as a loop-carried variable
whose type changes (int32 before the loop, int64 inside), which a GPU run
refused in session 9 after every CPU test had passed. This test compiles each
kernel at the launch shapes the decode step uses, down to a cubin, with the
ptxas Triton ships. It runs no kernel; the GPU tests do that. The compiling
runs in a child process without TRITON_INTERPRET (which the suite sets, and
under which `triton.jit` gives interpreted functions that do not compile).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="needs Triton (the dev extra installs it)")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from miniverl.engine.rollout import decode_attention, decode_projection  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def _ptxas_available() -> bool:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return (Path(nvidia.__file__).parent / "bin" / "ptxas").exists() or shutil.which("ptxas") is not None


pytestmark = pytest.mark.skipif(not _ptxas_available(), reason="Triton's NVIDIA backend (ptxas) is not installed")


def compile_for_hopper(kernel, types: dict[str, str], constants: dict, **options) -> bytes:
    """The cubin of `kernel` with `constants` as its constexprs and `types` for the other arguments (i32 else)."""
    return compiled_for_hopper(kernel, types, constants, **options).asm["cubin"]


def compiled_for_hopper(kernel, types: dict[str, str], constants: dict, **options):
    """`compile_for_hopper`'s compiled kernel itself (its metadata says the shared memory a program takes)."""
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constants.items()})
    return triton.compile(source, target=HOPPER, options=options)


def split_key_attention(prologue: bool, block_l: int, dot: bool, combine: bool = False):
    types = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "q_weight_ptr", "k_weight_ptr", "cos_ptr",
                                        "sin_ptr")}
    types.update({"positions_ptr": "*i64", "max_ptr": "*fp32", "sum_ptr": "*fp32", "acc_ptr": "*fp32",
                  "scale": "fp32", "eps": "fp32", "count_ptr": "*i32", "out_ptr": "*bf16"})
    group = 16 if dot else 2
    assert compile_for_hopper(decode_attention._split_attention, types, dict(
        GROUP=group, BLOCK_G=group, HEAD_DIM=128, BLOCK_L=block_l, DOT=dot, PROLOGUE=prologue, N_Q=16, DTYPE=3,
        COMBINE=combine, BLOCK_S=64, PDL=True), launch_pdl=True)


def combine_and_the_separate_prologue():
    assert compile_for_hopper(decode_attention._combine, {"max_ptr": "*fp32", "sum_ptr": "*fp32", "acc_ptr": "*fp32",
                                                          "out_ptr": "*bf16", "positions_ptr": "*i64"},
                              dict(HEAD_DIM=128, BLOCK_S=32, PDL=True), launch_pdl=True)
    types = {name: "*bf16" for name in ("qkv_ptr", "q_weight_ptr", "k_weight_ptr", "cos_ptr", "sin_ptr", "q_ptr",
                                        "k_cache_ptr", "v_cache_ptr")}
    types.update({"positions_ptr": "*i64", "eps": "fp32"})
    assert compile_for_hopper(decode_attention._qk_norm_rope_append, types,
                              dict(N_Q=16, N_KV=8, HEAD_DIM=128, DTYPE=3, PDL=True), launch_pdl=True)


# name: (weights NF4, the launch's constexprs beyond the shared ones, num_stages): the decode step's launches
# at one and eight slots as `tile_config` picks them (bf16 rounded by the GPU's conversion, DTYPE 3), and the
# variants the sweep times.
PROJECTIONS = {
    "qkv-broadcast-1": (False, dict(PARTS=3, NORM=True, BLOCK_B=1, SPLIT_K=1), None),
    "gate_up-pair-1": (False, dict(PARTS=2, SILU_MUL=True, NORM=True, BLOCK_B=1, SPLIT_K=1), None),
    "o-split-1": (False, dict(RESIDUAL=True, BLOCK_B=1, SPLIT_K=2, CHUNKS=2), None),
    "down-span-1": (False, dict(RESIDUAL=True, BLOCK_B=1, BLOCK_N=2, BLOCK_K=4096, SPLIT_K=1), None),
    "dense-qkv-broadcast-4": (False, dict(PARTS=3, NORM=True, BLOCK_B=4, SPLIT_K=1), None),
    "dense-down-split-no-lora-4": (False, dict(RESIDUAL=True, LORA=0, BLOCK_N=4, BLOCK_B=4, SPLIT_K=3), None),
    "nf4-gate_up-pair-8": (True, dict(PARTS=2, SILU_MUL=True, NORM=True, BLOCK_B=8, BLOCK_N=4, SPLIT_K=1), None),
    "nf4-qkv-narrow-2": (True, dict(PARTS=3, NORM=True, BLOCK_B=2, BLOCK_N=4, SPLIT_K=1), None),
    "nf4-qkv-narrow-8": (True, dict(PARTS=3, NORM=True, BLOCK_B=8, BLOCK_N=4, SPLIT_K=1), None),
    "nf4-down-split-8": (True, dict(RESIDUAL=True, BLOCK_B=8, SPLIT_K=3, CHUNKS=3), None),
    # the broadcast products of every row reduced at once (PRODUCT 3), a variant the sweep times
    "nf4-gate_up-pair-at-once-8": (True, dict(PARTS=2, SILU_MUL=True, NORM=True, BLOCK_B=8, BLOCK_N=4, SPLIT_K=1,
                                              PRODUCT=3), None),
    "nf4-qkv-at-once-8": (True, dict(PARTS=3, NORM=True, BLOCK_B=8, BLOCK_N=4, SPLIT_K=1, PRODUCT=3), None),
    # bf16 rounded by its bits (DTYPE 0, what the interpreter runs) rather than by the conversion the GPU takes
    "nf4-qkv-at-once-8-bit-rounding": (True, dict(PARTS=3, NORM=True, BLOCK_B=8, BLOCK_N=4, SPLIT_K=1, PRODUCT=3,
                                                  DTYPE=0), None),
    "nf4-down-split-at-once-8": (True, dict(RESIDUAL=True, BLOCK_B=8, SPLIT_K=3, CHUNKS=3, PRODUCT=3), None),
    "dense-qkv-at-once-4": (False, dict(PARTS=3, NORM=True, BLOCK_B=4, SPLIT_K=1, PRODUCT=3), None),
    "dense-down-split-at-once-8": (False, dict(RESIDUAL=True, BLOCK_B=8, SPLIT_K=3, CHUNKS=3, PRODUCT=3), None),
    "swap-qkv-a-per-program-8": (False, dict(PARTS=3, NORM=True, LORA=1, PRODUCT=1, SWAP=True, BLOCK_N=32,
                                             BLOCK_K=256, SPLIT_K=1), 3),
    "swap-gate_up-two-loops-8": (False, dict(PARTS=2, SILU_MUL=True, NORM=True, LORA=1, PRODUCT=1, SWAP=True,
                                             BLOCK_N=32, BLOCK_K=256, PAIR=False, SPLIT_K=1), 3),
    "swap-down-a-per-program-8": (False, dict(RESIDUAL=True, LORA=1, PRODUCT=1, SWAP=True, BLOCK_N=32, BLOCK_K=256,
                                              SPLIT_K=1), 3),
    "swap-down-split-8": (False, dict(RESIDUAL=True, PRODUCT=1, SWAP=True, BLOCK_N=32, BLOCK_K=256, SPLIT_K=4,
                                      CHUNKS=3), 3),
    "swap-down-split-a-per-program-8": (False, dict(RESIDUAL=True, LORA=1, PRODUCT=1, SWAP=True, BLOCK_N=64,
                                                    BLOCK_K=256, SPLIT_K=2), 3),
    "swap-down-split-no-lora-8": (False, dict(RESIDUAL=True, LORA=0, PRODUCT=1, SWAP=True, BLOCK_N=64, BLOCK_K=256,
                                              SPLIT_K=3), 3),
    "swap-gate_up-split-a-per-program-8": (False, dict(PARTS=2, SILU_MUL=True, NORM=True, LORA=1, PRODUCT=1,
                                                       SWAP=True, BLOCK_N=32, BLOCK_K=256, PAIR=False, SPLIT_K=2), 3),
}


def projection(name: str):
    assert projection_kernel(name).asm["cubin"]


def projection_kernel(name: str, **overrides):
    """`_project` compiled at the launch shape PROJECTIONS[name], `overrides` (num_warps, num_stages) on its
    options (benchmarks/kernel_sass_stats.py reads it)."""
    nf4, constants, stages = PROJECTIONS[name]
    lora = constants.get("LORA", 3)
    types = {"x_ptr": "*bf16", "norm_ptr": "*bf16", "eps": "fp32", "code_ptr": "*fp32", "code2_ptr": "*fp32",
             "y_ptr": "*bf16", "residual_ptr": "*bf16", "a_stacked_ptr": "*bf16", "xa_ptr": "*fp32",
             "sync_ptr": "*i32", "ws_ptr": "*fp32", "count_ptr": "*i32"}
    for i in range(3):
        types.update({f"w{i}": "*u8" if nf4 else "*bf16", f"absmax{i}": "*u8" if nf4 else "*bf16",
                      f"absmax2_{i}": "*fp32" if nf4 else "*bf16", f"offset{i}": "fp32",
                      f"a{i}": "*bf16" if lora == 1 else "*fp32", f"b{i}": "*bf16"})
    shared = dict(PARTS=1, SILU_MUL=False, DENSE=not nf4, NESTED=nf4, NORM=False, LORA=lora, RESIDUAL=False,
                  DTYPE=3, BLOCK_N=8, BLOCK_K=1024, BLOCK_R=16, PRODUCT=2, PDL=True, SWAP=False,
                  WAIT_IN_LOOP=False, DOWN_B=1, DOWN_R=8, DOWN_K=1024, PAIR=True, CHUNKS=1)
    constants = {**shared, **constants}
    if constants["SWAP"]:
        constants["BLOCK_B"] = 16
    options = {"launch_pdl": True} | ({} if stages is None else {"num_stages": stages}) | overrides
    return compiled_for_hopper(decode_projection._project, types, constants, **options)


CASES = {
    **{f"attention-{'prologue' if prologue else 'q'}-{block_l}{'-dot' if dot else ''}":
       (split_key_attention, (prologue, block_l, dot))
       for prologue in (True, False) for block_l, dot in ((16, False), (32, False), (32, True))},
    **{f"attention-combined-{'prologue' if prologue else 'q'}-{block_l}":
       (split_key_attention, (prologue, block_l, False, True)) for prologue in (True, False) for block_l in (16, 32)},
    "combine-and-prologue": (combine_and_the_separate_prologue, ()),
    **{f"project-{name}": (projection, (name,)) for name in PROJECTIONS},
}


def test_every_decode_kernel_compiles_for_hopper():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    report = child.stdout.splitlines()
    assert child.returncode == 0, "\n".join(line for line in report if line.startswith("FAILED")) or child.stderr[-3000:]
    assert sorted(line.split()[1] for line in report if line.startswith("compiled ")) == sorted(CASES), \
        "\n".join(report) + child.stderr[-3000:]


if __name__ == "__main__":  # the child: every case, one line each; a failed case's error and exit 1
    failed = False
    for case, (build, arguments) in CASES.items():
        try:
            build(*arguments)
            print(f"compiled {case}", flush=True)
        except Exception as error:  # noqa: BLE001 - report every case, not only the first
            failed = True
            print(f"FAILED {case}: {type(error).__name__}: {str(error)[:2000]}", flush=True)
    sys.exit(1 if failed else 0)
