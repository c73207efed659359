echo "one job"
echo "another job" && echo "a combined job (bash syntax applies)"
bash local.sh && echo "you can also call local files: they are copied forward"
python3 -c 'import os; print("CUDA_VISIBLE_DEVICES=%r" % os.environ.get("CUDA_VISIBLE_DEVICES"))'
mkdir -p out && echo "results written by the job come back" > out/result.txt && cat out/result.txt
