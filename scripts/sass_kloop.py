#!/usr/bin/env python3
r"""Instruction mix per K-tile of the swap-AB decode K-loops, from SASS (no GPU needed).

Input: one kernel's SASS as cuobjdump prints it. The decode kernels are the templates
sm80_lutb_moe_swapab_gemm1 / sm80_lutb_moe_swapab_gemm2 of src/cuda/moe/sm80_lutb_moe_swapab.cuh,
instantiated in src/cuda/moe/lutb_moe_forward.cu: take them from the `gpu` preset's object of that
file (build/gpu/CMakeFiles/lutb_cuda.dir/src/cuda/moe/lutb_moe_forward.cu.o) or compile the file
alone with the preset's CUDA flags:

Usage:
  nvcc -std=c++20 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Iinclude -Isrc \
       -c src/cuda/moe/lutb_moe_forward.cu -o /tmp/lutb_moe_forward.o
  cuobjdump -elf /tmp/lutb_moe_forward.o | grep -o '_Z[A-Za-z0-9_]*swapab_gemm[12][A-Za-z0-9_]*' | sort -u
  cuobjdump -sass -fun <a mangled name of that list> /tmp/lutb_moe_forward.o > k.sass   # nvdisasm on PATH
  scripts/sass_kloop.py k.sass [--per-ktile-hmma 16]

Besides the opcode mix, each loop's count per K-tile by sm_90 issue pipe (PIPES
below): alu (integer/logic/select/permute/F2FP, half rate), fmaheavy (IMAD*), fma (FP32 / FP16x2
arithmetic, either FMA half), lsu (shared/global/constant loads, cp.async, shuffles), tensor
(HMMA), xu, uniform (U* datapath), branch (ADU / CBU) and other (unclassified: printed by opcode).
Checked against Nsight Compute's sm__inst_executed_pipe_* counts of GEMM1 at DeepSeek-V3 T = 16
(docs/perf/moe-gpu.md): moving 48 selector instructions per
K-tile from LOP3 / SHF / LEA to IMAD / IMAD.HI moved 33.65 M instructions from pipe_alu to
pipe_fmaheavy, 48 x the 0.70 M warp-K-tiles the HMMA count gives (33.7 M); pipe_alu's total (131.8 M)
needs F2FP on the ALU pipe (without it the loops alone would give ~84 M); lsu matches (28.9 M
measured, 28.1 M from the loop). VIADD's pipe was not isolated.
"""
import collections
import re
import sys


# Issue pipe of each SASS opcode on sm_90 (the FMA and ALU pipes are half rate: 16 lanes per cycle
# per SM sub-partition). IMAD and its forms (IMAD.MOV, IMAD.SHL, IMAD.HI, IMAD.WIDE, IMAD.IADD) are
# fmaheavy; MOV is alu. Opcodes not listed land in "other".
PIPES = {
    "alu": "LOP3 LOP SHF SHL SHR LEA IADD3 IADD ISETP SEL FSEL PRMT MOV FSETP HSETP2 IMNMX FMNMX PLOP3 BMSK "
           "P2R R2P IABS VIMNMX VIADD F2FP CS2R",
    "fmaheavy": "IMAD IDP IMUL",
    "fma": "FFMA FMUL FADD HFMA2 HMUL2 HADD2",
    "lsu": "LDS LDG LDC LDSM LDGSTS LDGDEPBAR STS STG SHFL ATOM ATOMS RED LD ST",
    "tensor": "HMMA IMMA QMMA",
    "xu": "MUFU I2F F2I POPC FLO BREV I2FP F2IP",
    "uniform": "ULDC UMOV UIADD3 ULOP3 USHF ULEA UISETP USEL UIMAD UPRMT UFLO UPOPC R2UR S2UR VOTEU",
    "branch": "BRA BSSY BSYNC WARPSYNC EXIT BAR DEPBAR NOP CALL RET YIELD ELECT",
}
PIPE_OF = {op: pipe for pipe, ops in PIPES.items() for op in ops.split()}


def main():
    args = sys.argv[1:]
    per = 16
    if "--per-ktile-hmma" in args:
        i = args.index("--per-ktile-hmma")
        per = int(args[i + 1])
        del args[i:i + 2]
    if len(args) != 1:
        sys.exit(__doc__)
    ins = []
    for line in open(args[0]):
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    index = {a: i for i, (a, _) in enumerate(ins)}

    def opcode(text):
        text = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
        return text.split()[0].split(".")[0]

    loops = []
    for i, (addr, text) in enumerate(ins):
        m = re.search(r"BRA(?:\.\S+)?\s+(?:!?U?P\d,\s*)?(?:`\()?0x([0-9a-f]+)", text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < addr and target in index:
            body = ins[index[target]:i + 1]
            mix = collections.Counter(opcode(t) for _, t in body)
            # K-loops issue no global stores and do not exit; the backward branches of the epilogue's
            # and the divergent-shuffle slow paths span the function and do both.
            if mix["HMMA"] >= per and mix["STG"] == 0 and mix["EXIT"] == 0:
                loops.append((target, addr, len(body), mix))
    # Innermost only: drop a loop that contains another HMMA loop.
    inner = [l for l in loops if not any(o is not l and l[0] <= o[0] and o[1] <= l[1] for o in loops)]
    for lo, hi, n, mix in inner:
        ktiles = mix["HMMA"] / per
        print(f"loop {lo:#x}-{hi:#x}: {n} instructions, {ktiles:g} K-tiles (unrolled), {n / ktiles:.1f} per K-tile")
        print("   " + ", ".join(f"{k} {v / ktiles:.1f}" for k, v in mix.most_common()))
        pipes = collections.Counter()
        other = collections.Counter()
        for k, v in mix.items():
            pipe = PIPE_OF.get(k, "other")
            pipes[pipe] += v
            if pipe == "other":
                other[k] += v
        print("   by pipe: " + ", ".join(f"{k} {v / ktiles:.1f}" for k, v in pipes.most_common()) +
              (" (other: " + ", ".join(f"{k} {v / ktiles:.1f}" for k, v in other.most_common()) + ")" if other else ""))


if __name__ == "__main__":
    main()
