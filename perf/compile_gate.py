"""Ahead-of-time compile gate: every registered kvtier Triton kernel, at the K2/K3 shapes, for every target.

No GPU is needed: ``triton.compile`` with a ``GPUTarget`` runs the whole pipeline (TTIR → LLVM →
PTX/cubin with the ptxas bundled in triton, or AMDGCN/hsaco with the linker inside libtriton).
Kernels come from the registry in :mod:`kvtier.triton_kernels` (each module registers its
kernels and their K2 compile cases), so a new kernel joins by registering.

Resources per (kernel, case, target):
- CUDA (sm_90): ``REG``/``STACK``/``SHARED``/``LOCAL`` from ``cuobjdump --dump-resource-usage``
  on the cubin; spills = the stack frame plus local memory, bytes per thread. ptxas puts spilled
  registers in the stack frame (``ptxas -v``: "N bytes stack frame, M bytes spill stores"), and
  Triton kernels make no calls, so a non-zero STACK means spills.
- AMD (gfx942, gfx950; wave64): the AMDGPU metadata in the AMDGCN text (``.vgpr_count``,
  ``.agpr_count``, ``.sgpr_count``, ``.vgpr_spill_count``, ``.sgpr_spill_count``,
  ``.group_segment_fixed_size`` = LDS bytes, ``.private_segment_fixed_size`` = scratch bytes).
  SGPR spills go to VGPR lanes, not memory; VGPR spills and scratch go to memory.
- ``shared`` (all targets): Triton's own shared-memory/LDS estimate from the kernel metadata.

Usage::

    python perf/compile_gate.py                      # all kernels, all targets; writes the table
    python perf/compile_gate.py --kernels mla_decode_partial --targets sm_90 --no-write
    python perf/compile_gate.py --warm-cache         # reuse triton's cache (default: a fresh one)

Writes ``perf/results/kernel_resources.md`` and ``.csv``; exits 1 when a kernel fails to compile
or spills to memory (VGPR spills, scratch, or CUDA local memory).
Run without ``TRITON_INTERPRET`` (the gate removes it from its own environment).

Each case is built as Triton's JIT would specialise it at launch (:func:`jit_specialize`):
pointers 16-byte aligned, integer arguments from the case's ``values`` (1 -> constexpr, multiples
of 16 -> divisibility hint). A build without these hints is a different kernel (scalar loads, no
software pipelining) with different registers and spills.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # must precede the first @triton.jit (kernel import)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
if "--warm-cache" not in sys.argv:  # cold builds by default: honest compile times, no stale binaries
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvtier-compile-gate-")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {
    "gfx950": GPUTarget("hip", "gfx950", 64),
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "sm_90": GPUTarget("cuda", 90, 32),
}


@dataclass
class Row:
    kernel: str
    case: str
    target: str
    num_warps: int
    num_stages: int
    vgprs: int | None = None  # CUDA: registers per thread; AMD: VGPRs (arch VGPRs + AGPRs)
    agprs: int | None = None
    sgprs: int | None = None
    vgpr_spills: int | None = None
    sgpr_spills: int | None = None
    spill_bytes: int | None = None  # CUDA local memory / AMD private segment, bytes per thread
    shared_bytes: int | None = None  # Triton's estimate (shared memory / LDS)
    static_shared_bytes: int | None = None  # from the binary (CUDA SHARED / AMD group segment)
    compile_s: float = 0.0
    error: str = ""

    @property
    def spills_to_memory(self) -> bool:
        return bool(self.vgpr_spills) or bool(self.spill_bytes)


def _amd_resources(asm: str, name: str) -> dict:
    def field(key: str) -> int | None:
        m = re.search(rf"^[\s-]*\.{key}:\s*(\d+)", asm, re.MULTILINE)
        return int(m.group(1)) if m else None

    return {"vgprs": field("vgpr_count"), "agprs": field("agpr_count"), "sgprs": field("sgpr_count"),
            "vgpr_spills": field("vgpr_spill_count"), "sgpr_spills": field("sgpr_spill_count"),
            "spill_bytes": field("private_segment_fixed_size"),
            "static_shared_bytes": field("group_segment_fixed_size")}


def _cuda_resources(cubin: bytes, name: str) -> dict:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                              check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if m is None:
        raise RuntimeError(f"no resource line in cuobjdump output: {text!r}")
    reg, stack, shared, local = (int(x) for x in m.groups())
    return {"vgprs": reg, "spill_bytes": stack + local, "static_shared_bytes": shared}


def jit_specialize(fn, case) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of ``case`` as Triton's JIT specialises a launch: every
    pointer argument 16-byte aligned (``tt.divisibility`` 16; torch allocations are), and each
    integer argument named in ``case.values`` a constexpr when it is 1 or divisible by 16 when it
    is a multiple of 16. Integers without a value get no hint (as for an unaligned runtime value)."""
    signature, constexprs = dict(case.signature), dict(case.constexprs)
    unknown = sorted(set(case.values) - set(signature))
    if unknown:
        raise ValueError(f"{case.label}: values for unknown arguments {unknown}")
    names = list(fn.arg_names)
    attrs = dict(case.attrs)
    for name, ty in case.signature.items():
        value = case.values.get(name)
        if ty.startswith("i") and value == 1:
            signature[name], constexprs[name] = "constexpr", 1
        elif ty.startswith("*") or (ty.startswith("i") and value is not None and value % 16 == 0):
            attrs.setdefault((names.index(name),), []).append(["tt.divisibility", 16])
    return signature, constexprs, attrs


def compile_case(entry, case, target_name: str) -> Row:
    """Compile one case for one target and read its resources (errors become the row's ``error``)."""
    target = TARGETS[target_name]
    row = Row(entry.name, case.label, target_name, case.num_warps, case.num_stages)
    t0 = time.perf_counter()
    try:
        src = ASTSource(entry.fn, *jit_specialize(entry.fn, case))
        kernel = triton.compile(src, target=target, options={"num_warps": case.num_warps,
                                                             "num_stages": case.num_stages})
        row.shared_bytes = kernel.metadata.shared
        name = kernel.metadata.name
        res = (_cuda_resources(kernel.asm["cubin"], name) if target.backend == "cuda"
               else _amd_resources(kernel.asm["amdgcn"], name))
        for key, value in res.items():
            setattr(row, key, value)
    except Exception as exc:  # noqa: BLE001 - a failed build is a gate result, reported per row
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        row.error = f"{type(exc).__name__}: " + " / ".join(lines[:1] + lines[-2:])[:300]
    row.compile_s = round(time.perf_counter() - t0, 2)
    return row


def run_gate(kernels: list[str] | None = None, targets: list[str] | None = None) -> tuple[list[Row], list[str]]:
    """Compile every registered kernel (or those named) for every target (or those named).

    Returns (rows, import errors of kernel modules that could not be loaded).
    """
    from kvtier import triton_kernels

    registry, import_errors = triton_kernels.load_all()
    names = sorted(registry) if kernels is None else kernels
    unknown = sorted(set(names) - set(registry))
    if unknown:
        raise SystemExit(f"unknown kernel(s) {unknown}; registered: {sorted(registry)}")
    rows = []
    for target_name in targets or list(TARGETS):
        for name in names:
            entry = registry[name]
            arch = target_name
            for case in entry.cases(arch):
                rows.append(compile_case(entry, case, target_name))
    return rows, import_errors


COLUMNS = ["kernel", "case", "target", "num_warps", "num_stages", "vgprs", "agprs", "sgprs", "vgpr_spills",
           "sgpr_spills", "spill_bytes", "shared_bytes", "static_shared_bytes", "compile_s", "error"]


def write_tables(rows: list[Row], import_errors: list[str], seconds: float, out_dir: Path = RESULTS) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "kernel_resources.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in asdict(r).items()})
    fmt = lambda v: "–" if v is None else str(v)  # noqa: E731
    lines = [
        "# Triton kernel resources (ahead-of-time compile gate)",
        "",
        f"Generated by `python perf/compile_gate.py` (triton {triton.__version__}, {len(rows)} builds, "
        f"{seconds:.0f} s on this machine's CPU). K2 shapes: kv_lora_rank 512 + rope 64, page size 64, "
        "bf16 q/out, bf16 or fp8 e4m3 KV (e4m3fnuz on gfx942); h64 = 64 heads, h8-tp8 = 8 heads per rank. "
        "K3 KDA: 96 heads x head dim 128 (fp32 states, V tiles of 32), short conv over 3 x 12,288 channels, "
        "kernel 4. K3 MoE: 896 experts, top-16, I 3072 at latent width 3584, SiTU-GLU (bf16 fused_moe_gemm and "
        "mxfp4_gemm: tl.dot_scaled on gfx950, E2M1/E8M0 decoded in registers on gfx942 and sm_90).",
        "",
        "Columns: `regs` = registers per thread (CUDA) or VGPRs incl. AGPRs (AMD, of 512); `sgpr spills` go to",
        "VGPR lanes (no memory traffic); `vgpr spills` / `spill B` (CUDA stack frame + local memory, AMD scratch,",
        "bytes per thread) go to memory and fail the gate. `shared` = Triton's shared-memory/LDS estimate in bytes.",
        "Builds are specialised as the JIT does at launch (16-byte-aligned pointers; the K2 strides and sizes).",
        "",
        "| kernel | case | target | warps | stages | regs | agprs | sgprs | vgpr spills | sgpr spills | spill B | shared B | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.kernel} | {r.case} | {r.target} | {r.num_warps} | {r.num_stages} | FAILED: {r.error} "
                         "| | | | | | | |")
            continue
        lines.append(f"| {r.kernel} | {r.case} | {r.target} | {r.num_warps} | {r.num_stages} | {fmt(r.vgprs)} | "
                     f"{fmt(r.agprs)} | {fmt(r.sgprs)} | {fmt(r.vgpr_spills)} | {fmt(r.sgpr_spills)} | "
                     f"{fmt(r.spill_bytes)} | {fmt(r.shared_bytes)} | {r.compile_s} |")
    for err in import_errors:
        lines.append(f"\nModule failed to import (its kernels are missing above): `{err}`")
    (out_dir / "kernel_resources.md").write_text("\n".join(lines) + "\n")


def failures(rows: list[Row], import_errors: list[str]) -> list[str]:
    bad = [f"{r.kernel}/{r.case}/{r.target}: {r.error}" for r in rows if r.error]
    bad += [f"{r.kernel}/{r.case}/{r.target}: spills to memory (vgpr spills {r.vgpr_spills}, "
            f"{r.spill_bytes} B/thread)" for r in rows if not r.error and r.spills_to_memory]
    return bad + [f"import: {e}" for e in import_errors]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="*", help="registered kernel names (default: all)")
    parser.add_argument("--targets", nargs="*", choices=list(TARGETS), help="default: all")
    parser.add_argument("--no-write", action="store_true", help="do not rewrite perf/results/kernel_resources.*")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--warm-cache", action="store_true", help="reuse triton's on-disk cache (faster reruns)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rows, import_errors = run_gate(args.kernels, args.targets)
    seconds = time.perf_counter() - t0
    if not args.no_write:
        write_tables(rows, import_errors, seconds, args.out_dir)
    for r in rows:
        status = "FAIL " + r.error if r.error else ("SPILL" if r.spills_to_memory else "ok")
        print(f"{r.kernel:28s} {r.case:18s} {r.target:7s} regs={fmt_none(r.vgprs):>4s} "
              f"sgpr_spills={fmt_none(r.sgpr_spills):>3s} shared={fmt_none(r.shared_bytes):>6s} "
              f"{r.compile_s:5.1f}s {status}")
    bad = failures(rows, import_errors)
    print(f"{len(rows)} builds in {seconds:.1f} s; {len(bad)} failure(s)")
    for b in bad:
        print("  " + b)
    return 1 if bad else 0


def fmt_none(v) -> str:
    return "-" if v is None else str(v)


if __name__ == "__main__":
    sys.exit(main())
