cd .gpu && ONLINE_NSYS_BEFORE=0 OUT=$OUT scripts/gpu_run.sh online   # staged with scripts/gpu_stage.sh at 0f53d01 (code of 2391727)
