"""What the decode projections compile to on Hopper, counted, on a machine without a GPU.

    python benchmarks/kernel_sass_stats.py --out benchmarks/results/kernel_sass_stats_session14.json

Each launch shape of `tests/unit/rollout/test_kernels_compile_for_hopper.py` (PROJECTIONS) is compiled for
sm_90 with the ptxas Triton ships, and its SASS (nvdisasm) is counted: instructions, barriers (BAR: a
cross-warp reduction or a `debug_barrier`), local-memory loads and stores (LDL/STL: register spills), warp
shuffles, the registers and stack `cuobjdump -res-usage` reports, and the shared memory a program takes
(static and dynamic, from Triton's metadata). `--num-warps` / `--num-stages` compile every case with those
instead of its own. The counts are static (each
instruction once, loops not unrolled by trip count), so they compare variants of one launch, not times:
times come from `decode_step_sweep.py` on a GPU. Run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit" / "rollout"))
import test_kernels_compile_for_hopper as hopper  # noqa: E402

OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", re.M)


def tool(name: str) -> str:
    import triton.backends.nvidia as nvidia
    return str(Path(nvidia.__file__).parent / "bin" / name)


def stats(kernel) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter(OPCODE.findall(sass))
    resources = {key.lower(): int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
    return {"instructions": sum(ops.values()), "barriers": ops["BAR"], "spill_loads": ops["LDL"],
            "spill_stores": ops["STL"], "shuffles": ops["SHFL"], **resources,
            "shared_bytes": kernel.metadata.shared, "top": dict(ops.most_common(8))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(hopper.PROJECTIONS), choices=list(hopper.PROJECTIONS))
    parser.add_argument("--num-warps", type=int)
    parser.add_argument("--num-stages", type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    overrides = {key: value for key, value in (("num_warps", args.num_warps), ("num_stages", args.num_stages))
                 if value is not None}
    rows = []
    for name in args.cases:
        row = {"case": name, **overrides, **stats(hopper.projection_kernel(name, **overrides))}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        record = {"command": "python " + " ".join(sys.argv), "target": "sm_90 (compiled, not run)", "rows": rows}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
