#!/usr/bin/env bash
# Session 19 final device run (lead), m-run1, code cf173ab (main after the merges of nu19, act19 and the
# prefill hardware encode a06e07f): staged with STAGE_MODELS="tiny-qwen3-moe" scripts/gpu_stage.sh .gpu,
# run from the checkout root with carry [".gpu"]:
cd .gpu && OUT=/tmp/o scripts/gpu_run.sh all > /tmp/all.txt 2>&1
grep -E "PASSED|FAILED|tests ran|ERROR SUMMARY|RACECHECK SUMMARY" /tmp/all.txt | sort | uniq -c
