#!/usr/bin/env bash
# Session 18 final device run (lead), l-run1, code d153264: build + GPU tests + sanitizers + benchmark
# (all), the CLI GPU tests (cli), the act18 rule A/B (0 vs 74, both orders) and main 639ff0f's
# production benchmark against this commit's in ABBA order. Staged with
# STAGE_MODELS="tiny-qwen3-moe tiny-deepseek-v3" scripts/gpu_stage.sh, plus
# `git archive 639ff0f src include bench scripts | xz > .gpu/old.tar.xz`; run as `bash .gpu/run_final.sh`.
cd "$(dirname "$0")"
mkdir -p /tmp/o
T0=$(date +%s)
mkdir -p old && tar xJf old.tar.xz -C old && ln -sfn ../deps old/deps
OUT=/tmp/o/all scripts/gpu_run.sh all > /tmp/o/all.txt 2>&1; echo "all rc=$? t=$(( $(date +%s)-T0 ))s"
grep -E "PASSED|FAILED|tests ran|ERROR SUMMARY|RACECHECK SUMMARY|hazard" /tmp/o/all.txt | sort | uniq -c | head -20
( cd old && OUT=/tmp/o/old scripts/gpu_run.sh moebench 'true' > /tmp/o/old_build.txt 2>&1; echo "old build rc=$?" ) &
( OUT=/tmp/o/newmb scripts/gpu_run.sh moebench 'true' > /tmp/o/new_build.txt 2>&1; echo "new build rc=$?" ) &
OUT=/tmp/o/cli scripts/gpu_run.sh cli > /tmp/o/cli.txt 2>&1; echo "cli rc=$? t=$(( $(date +%s)-T0 ))s"
wait
N=build/gpu/bench_moe_gpu_sm90; O=old/build/gpu/bench_moe_gpu_sm90
$N --tokens 1,4,8,16,64 --variants 0,74 > /tmp/o/ab_0_74.md 2>&1
$N --tokens 1,4,8,16,64 --variants 74,0 > /tmp/o/ab_74_0.md 2>&1
$N --tokens 1,4,16,64 --variants 0 > /tmp/o/new1.md 2>&1
$O --tokens 1,4,16,64 --variants 0 > /tmp/o/old1.md 2>&1
$O --tokens 1,4,16,64 --variants 0 > /tmp/o/old2.md 2>&1
$N --tokens 1,4,16,64 --variants 0 > /tmp/o/new2.md 2>&1
cp /tmp/o/all/*.md $OUT/ 2>/dev/null; cp /tmp/o/ab_*.md /tmp/o/new?.md /tmp/o/old?.md $OUT/
tar czf $OUT/logs.tgz -C /tmp o
