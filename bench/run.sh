#!/usr/bin/env bash
# Benchmarks flotilla against its peers and rewrites the sections of BENCHMARKS.md it produces
# (run it as `./dev bench`); every other section (an issue's figures) stays, and the blocks
# marked `<!-- bench: NAME -->` inside one are refilled (bench/sections.py).
# The peers (ray, dask[distributed], numpy) live in their own venv, .venv-bench, never in
# flotilla's dependencies. A stamp file skips the install when nothing changed.
# Extra arguments go to bench/bench.py (try `./dev bench --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-bench
PEERS=("ray" "dask[distributed]" "numpy" "torch==2.13.0")

ensure_venv() {
    local stamp="$VENV/.installed" want
    want=$( (sha256sum pyproject.toml bench/run.sh; echo "${PEERS[*]}") | sha256sum | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
        return
    fi
    echo "installing the benchmark peers into $VENV (once)..." >&2
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PEERS[@]}" -e .
    echo "$want" >"$stamp"
}

ensure_venv
mkdir -p bench/results
OTHERS=$(mktemp bench/results/others.XXXXXX.md)
trap 'rm -f "$OTHERS"' EXIT
"$VENV/bin/python" bench/bench.py --markdown BENCHMARKS.md --results bench/results "$@"
case " $* " in *" --quick "* | *" --systems "* | *" --help "* | *" -h "*) exit 0 ;; esac

# The other issues' benchmarks run with the project's venv (torch) and their sections are
# merged into the report: DDP and Image start-up, the command line, and SSH (root only:
# it makes test hosts in network namespaces).
{
    echo
    echo "## Training and node environments (issue 4)"
    echo
    .venv/bin/python bench/bench_env.py 2>/dev/null | sed 's/^## /### /'
    echo
    echo "## Command line (issue 5)"
    echo
    .venv/bin/python bench/bench_cli.py 2>/dev/null | sed 's/^## /### /'
    echo
    echo "## Managed jobs: recovery from a lost node (issue 13)"
    echo
    .venv/bin/python bench/bench_managed.py 2>/dev/null | sed 's/^## /### /'
    echo
    echo "## A torch group restarted after a rank raised, against torchrun"
    echo
    .venv/bin/python bench/bench_group_restart.py --rounds 3 2>/dev/null
    echo
    echo "## Frozen and lost nodes (issue 13)"
    echo
    .venv/bin/python bench/bench_liveness.py 2>/dev/null
    echo
    .venv/bin/python bench/bench_replace.py 2>/dev/null
    echo
    echo "## Bucket volumes: 200 MB on 4 nodes against a boto3 download (issue 25)"
    echo
    .venv/bin/python bench/bench_volumes.py --reps 3 2>/dev/null
    echo
    echo "## Distributed collections (issue 30)"
    echo
    "$VENV/bin/python" bench/bench_collections.py --ops 1000 2>/dev/null  # ray and dask: peers
    echo
    echo "## Worker slots and streaming (issue 30)"
    echo
    .venv/bin/python bench/bench_slots.py 2>/dev/null
    echo
    echo "## The server: the API and 100 event streams (issue 39)"
    echo
    .venv/bin/python bench/bench_server.py 2>/dev/null
    # Issue 42's section is written by hand; the run refills its two blocks (sections.py).
    echo
    echo "<!-- bench: nodestart -->"
    .venv/bin/python bench/bench_nodestart.py --reps 5 $([ "$(id -u)" = 0 ] && echo --ssh --bare-env) 2>/dev/null
    echo "<!-- /bench: nodestart -->"
    echo "<!-- bench: wait -->"
    .venv/bin/python bench/bench_wait.py --rounds 5 2>/dev/null
    echo
    .venv/bin/python bench/bench_wait.py --rounds 5 --loops-apart 2>/dev/null
    echo "<!-- /bench: wait -->"
    if [ "$(id -u)" = 0 ]; then
        echo
        echo "## SSH provider on 4 test hosts (issue 3)"
        echo
        .venv/bin/python bench/bench_ssh.py 2>/dev/null | sed 's/^## /### /'
        echo; echo "## SLURM provider on 3 test hosts (issue 15)"; echo
        .venv/bin/python bench/bench_slurm.py 2>/dev/null | sed 's/^## /### /'
        echo; echo "## AWS provider on moto and booting test hosts (issue 16)"; echo
        .venv/bin/python bench/bench_aws.py 2>/dev/null
        echo; echo "## Elastic AWS pools on moto and booting test hosts (issue 37)"; echo
        .venv/bin/python bench/bench_aws_elastic.py --reps 3 2>/dev/null
        echo
        .venv/bin/python bench/bench_elastic_labs.py --reps 3 2>/dev/null
        echo; echo "## Kubernetes provider on the test lab (issue 23)"; echo
        .venv/bin/python bench/bench_k8s.py 2>/dev/null
        echo; echo "## Vast.ai provider on the stand-in API (issue 24)"; echo
        .venv/bin/python bench/bench_vast.py --reps 3 --boot-delay 2 2>/dev/null
        echo; echo "## 128 SSH hosts (issue 27)"; echo
        .venv/bin/python bench/bench_scale.py --hosts 128 --reps 3 2>/dev/null
        .venv/bin/python bench/bench_fanout.py --hosts 128 --reps 1 2>/dev/null
        echo; echo "## AWS lab: 64 instances against 8 (issue 27)"; echo
        .venv/bin/python bench/bench_aws_scale.py --nodes 64 --reps 3 2>/dev/null
    fi
} >"$OTHERS"
"$VENV/bin/python" bench/sections.py BENCHMARKS.md "$OTHERS"
