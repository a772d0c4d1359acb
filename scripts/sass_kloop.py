#!/usr/bin/env python3
"""Instruction mix per K-tile of the swap-AB decode K-loops, from SASS (no GPU needed).

Usage:
  nvcc -std=c++20 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Iinclude -Isrc \
       -c src/cuda/moe_lutb.cu -o /tmp/moe_lutb.o
  cuobjdump -sass -fun <mangled kernel name> /tmp/moe_lutb.o > k.sass   # names: cuobjdump -elf ... | grep swapab_gemm
  scripts/sass_kloop.py k.sass [--per-ktile-hmma 16]

A loop is a backward branch; the K-loops are the innermost loops holding HMMA instructions. The
count per K-tile divides by (HMMA in the loop / HMMA per K-tile): 16 for the one-token-block
kernels (NB = 1: 4 m16 tiles x 2 blocks x 2 k16 steps), 32 for NB = 2. Loops holding other HMMA
loops, and loops that store to global memory or exit (the epilogue's and the slow paths' backward
branches), are skipped. docs/perf/moe-gpu.md ("Session 15") lists
the counts of the default kernels made this way. cuobjdump ships with the CUDA toolkit (pip package
nvidia-cuda-cuobjdump where the toolkit lacks it).
"""
import collections
import re
import sys


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


if __name__ == "__main__":
    main()
