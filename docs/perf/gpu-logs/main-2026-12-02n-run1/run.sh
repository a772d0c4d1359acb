#!/usr/bin/env bash
# Session 21 confirmation run (lead), n-run1, code ad4b1b8 (CUDA sources as in cf173ab; session 21 changed
# only the CLI): staged with STAGE_MODELS="tiny-qwen3-moe" scripts/gpu_stage.sh .gpu, run from the
# checkout root with carry [".gpu"] (399 s on the machine, both modes):
cd .gpu && (OUT=$OUT/all scripts/gpu_run.sh all > $OUT/all.txt 2>&1; echo "all rc=$?" >> $OUT/all.txt)
(OUT=$OUT/cli scripts/gpu_run.sh cli > $OUT/cli.txt 2>&1; echo "cli rc=$?" >> $OUT/cli.txt)
grep -hE "PASSED|FAILED|tests ran|ERROR SUMMARY|RACECHECK SUMMARY| rc=" $OUT/all.txt $OUT/cli.txt | sort | uniq -c
# The cli mode's logs did not come back (too many files under $OUT); n-run2 reran it alone:
#   cd .gpu && OUT=/tmp/cli scripts/gpu_run.sh cli > /tmp/cli.txt 2>&1; tar czf $OUT/cli_logs.tgz -C /tmp cli cli.txt
