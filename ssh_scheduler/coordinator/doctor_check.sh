# `ssh-scheduler doctor`'s check of one host, run by the host's sh (coordinator/doctor.py sends
# it as `sh -c` with these arguments):
#   $1  the work root as configured ("~" at its start is the remote home)
#   $2  the machine's setup: lines as one bash recipe, or empty
#   $3  "slurm" on a Slurm login node, else empty; $4 its command prefix (e.g. module load slurm)
# Each line it prints is key=value; coordinator/doctor.parse_report reads them.
echo "shell=$(ps -p $$ -o comm= 2>/dev/null || echo sh)"
if out=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>&1); then echo "python=$out"
else echo "python_error=$(echo "$out" | head -n 1)"; fi
case $1 in
  "~"*) root=$HOME${1#"~"} ;;
  *) root=$1 ;;
esac
mkdir -p "$root" 2>/dev/null
echo "disk_free_kb=$(df -Pk "$root" 2>/dev/null | awk 'NR==2 {print $4}')"
echo "cpus=$(nproc 2>/dev/null)"
awk '/^MemAvailable:/ {print "mem_free_kb=" $2}' /proc/meminfo 2>/dev/null
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits 2>&1 | sed 's/^/gpu=/'
  nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/cuda=\1/p'
fi
if [ "$3" = slurm ]; then
  # The prefix is the user's own shell text (their machine YAML), run as it is before every query.
  eval "$4"
  for tool in sbatch squeue scancel scontrol; do
    if out=$($tool --version 2>&1); then echo "slurm=$out"; else echo "slurm_error=$tool: $(echo "$out" | tail -n 1)"; fi
  done
  if ! out=$(squeue --me -h -o %i 2>&1); then echo "slurm_error=squeue: $(echo "$out" | tail -n 1)"; fi
fi
if [ -n "$2" ]; then
  if out=$(bash --norc -c "$2" 2>&1 </dev/null); then echo setup=ok
  else echo "setup_error=$(echo "$out" | tail -n 2 | tr "\n" " ")"; fi
fi
