#!/usr/bin/env bash
cd "$(dirname "$0")"
g++ --version | head -1
g++ -std=c++20 -O3 -Wall -Wextra -march=native -Iinclude -Isrc -c src/fit/tile_common.cpp -o /tmp/tc.o && echo "tile_common.cpp compiled (warnings above, if any)"
MOETESTS_SANITIZE=0 OUT=$OUT scripts/gpu_run.sh moetests '$BENCH --tokens 4,8,16,64 --variants 0,74' '$BENCH --tokens 4,8,16,64 --variants 74,0' > $OUT/moetests.txt 2>&1; echo "moetests rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]" $OUT/moetests.txt | head
