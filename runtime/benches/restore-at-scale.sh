#!/usr/bin/env bash
# Measures what a crash costs a job with large heap state: the seconds from a new
# `weir-runtime` process's start to its `keyed state restored` line (process start, the
# checkpoint's metadata, reading and applying every file), per GiB of checkpoint, from local
# disk and from an S3-compatible server on loopback, in the same invocation, so the two are
# printed side by side with their ratio.
#
# The state: the job below run to its end with incremental checkpoints every second
# (`fullEvery: 10`): 17M keys, each holding the `max` of a 64-word text, about 10 GiB of
# checkpoint and 13 GB of heap (--keys scales it). With --shape count, a running count over
# 90M integer keys instead (--keys scales it): a chain of about 1.1 GiB of short entries, which
# a restore holds in memory and applies shard by shard. It is written once to local disk and once to
# the server, then each newest checkpoint is restored --runs times into a new root, the page
# cache dropped before each run when this runs as root (a crashed pod's replacement reads
# cold), and the process killed once its state is restored.
#
# Servers (--server):
#   minio   MinIO, the S3-compatible server most self-hosted object storage runs on, built once
#           from its Go module into $WEIR_CACHE/tools (single drive, its own bitrot checks on);
#   s3s-fs  the tests' server (.ci/install-tools.sh): it serves a GET as 4 KiB reads through
#           tokio's blocking pool, and bounds this measurement by its own CPU
#           (runtime/BENCHMARKS.md, session 44);
#   none    local disk only.
# The server shares the machine's cores with weir unless --pin puts weir on core 0 and the
# server on core 1 (as a remote server would not take weir's CPU; weir then has one core).
# --link-rate RATE (e.g. 4gbit; root, tc's tbf) limits loopback to RATE during the restores,
# as a network between weir and its object storage would (local disk is not limited).
# Its CPU time during each restore is printed too.
#
# Needs about twice the checkpoint's size of free disk under --work and the state's memory
# (13 GB at the default size). The work directory is removed at the end unless --keep.
#
# usage: runtime/benches/restore-at-scale.sh [--shape long-values|count] [--keys N] [--runs R]
#                                            [--server minio|s3s-fs|none] [--pin] [--work DIR]
#                                            [--link-rate RATE] [--keep]
set -euo pipefail

shape=long-values
keys=
runs=3
server=minio
pin=false
link_rate=
work=${TMPDIR:-/tmp}/weir-restore-at-scale
keep=false
while [ $# -gt 0 ]; do
    case "$1" in
        --shape) shape="$2"; shift 2 ;;
        --keys) keys="$2"; shift 2 ;;
        --runs) runs="$2"; shift 2 ;;
        --server) server="$2"; shift 2 ;;
        --pin) pin=true; shift ;;
        --link-rate) link_rate="$2"; shift 2 ;;
        --work) work="$2"; shift 2 ;;
        --keep) keep=true; shift ;;
        *) echo "restore-at-scale: unknown argument $1" >&2; exit 2 ;;
    esac
done
case "$shape" in
    long-values) keys=${keys:-17000000} ;;
    count) keys=${keys:-90000000} ;;
    *) echo "restore-at-scale: --shape is long-values or count, not $shape" >&2; exit 2 ;;
esac
case "$server" in
    minio | s3s-fs | none) ;;
    *) echo "restore-at-scale: --server is minio, s3s-fs or none, not $server" >&2; exit 2 ;;
esac

repo=$(cd "$(dirname "$0")/../.." && pwd)
cache=${WEIR_CACHE:-$HOME/.cache/weir}
tools=$cache/tools
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/target}
# The Debian packages the build needs (RocksDB, libclang, librdkafka's), on a fresh machine.
bash "$repo/.ci/install-packages.sh" >&2
# Default features, as `cargo test --release` in .ci/run builds them (`cloud` for s3://).
(cd "$repo" && cargo build --release --locked -p weir-runtime --bin weir-runtime >&2)
weir=$CARGO_TARGET_DIR/release/weir-runtime

# The MinIO commit is pinned: its releases are not semver tags, so the module proxy serves
# them as pseudo-versions of the repository's commits.
MINIO_VERSION=v0.0.0-20260212201848-7aac2a2c5b7c
port=9561
bucket=weir-bench
server_pid=
cleanup() {
    [ -n "$link_rate" ] && tc qdisc del dev lo root 2>/dev/null
    [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    if [ "$keep" = false ]; then rm -rf "$work"; else echo "restore-at-scale: kept $work" >&2; fi
}
trap cleanup EXIT
rm -rf "$work" && mkdir -p "$work/server"

export AWS_ACCESS_KEY_ID=weirbench AWS_SECRET_ACCESS_KEY=weirbenchsecret AWS_REGION=us-east-1 \
    AWS_ENDPOINT=http://127.0.0.1:$port AWS_ALLOW_HTTP=true
case "$server" in
    minio)
        if [ ! -x "$tools/bin/minio" ] || ! grep -q "$MINIO_VERSION" "$tools/.minio-version" 2>/dev/null; then
            echo "restore-at-scale: building minio $MINIO_VERSION into $tools (once)" >&2
            GOPATH="$cache/go" GOMODCACHE="$cache/go/pkg/mod" GOCACHE="$cache/go/cache" GOFLAGS=-buildvcs=false \
                GOBIN="$tools/bin" go install github.com/minio/minio@"$MINIO_VERSION" >&2
            echo "$MINIO_VERSION" > "$tools/.minio-version"
        fi
        MINIO_ROOT_USER=$AWS_ACCESS_KEY_ID MINIO_ROOT_PASSWORD=$AWS_SECRET_ACCESS_KEY MINIO_BROWSER=off \
            "$tools/bin/minio" server "$work/server" --address 127.0.0.1:$port --quiet > "$work/server.log" 2>&1 &
        server_pid=$!
        ;;
    s3s-fs)
        s3s=${WEIR_S3S_BIN:-$tools/bin/s3s-fs}
        [ -x "$s3s" ] || s3s=$(bash "$repo/.ci/install-tools.sh" | sed -n 's/^WEIR_S3S_BIN=//p')
        mkdir -p "$work/server/$bucket"
        "$s3s" --host 127.0.0.1 --port $port --access-key "$AWS_ACCESS_KEY_ID" \
            --secret-key "$AWS_SECRET_ACCESS_KEY" "$work/server" > "$work/server.log" 2>&1 &
        server_pid=$!
        ;;
esac
if [ -n "$server_pid" ]; then
    for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
    if [ "$server" = minio ]; then
        curl -sf -X PUT --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" --aws-sigv4 "aws:amz:us-east-1:s3" \
            "http://127.0.0.1:$port/$bucket" > /dev/null
    fi
fi

job=$work/job.yaml
if [ "$shape" = count ]; then
    cat > "$job" <<EOF
name: restore-at-scale
checkpointing: { enabled: true, interval: 1s, mode: exactly-once, incremental: true, fullEvery: 10 }
sources:
  - { name: src, uid: src, generator: { count: $keys, fields: [ { name: key, sequence: {} } ] } }
operators:
  - { name: by-key, keyBy: { fields: [key] } }
  - { name: counts, uid: counts, aggregate: { aggregates: [ { fn: count, as: n } ] } }
sinks: [ { name: out, blackhole: {} } ]
EOF
else
    cat > "$job" <<EOF
name: restore-at-scale
checkpointing: { enabled: true, interval: 1s, mode: exactly-once, incremental: true, fullEvery: 10 }
sources:
  - { name: src, uid: src, generator: { count: $keys, fields: [ { name: key, sequence: {} },
      { name: line, text: { words: 64, vocabulary: 100000 } } ] } }
operators:
  - { name: by-key, keyBy: { fields: [key] } }
  - { name: latest, uid: latest, aggregate: { aggregates: [ { fn: max, field: line, as: m } ] } }
sinks: [ { name: out, blackhole: {} } ]
EOF
fi

cpu_of() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }
newest_in() { ls "$1" | grep '^chk-' | sort -t- -k2 -n | tail -1; }

# generate <root>: runs the job to its end, writing its checkpoints under <root>.
generate() {
    local t0 t1
    t0=$(date +%s.%N)
    "$weir" run "$job" --checkpoint-dir "$1" > "$work/generate.log" 2>&1 \
        || { tail -5 "$work/generate.log" >&2; exit 1; }
    t1=$(date +%s.%N)
    printf 'restore-at-scale: state written to %s in %.1f s\n' "$1" "$(echo "$t1 - $t0" | bc)" >&2
}

# restore <checkpoint> <label> <run>: prints "<seconds> <bytes> <weir cpu> <server cpu>".
restore() {
    local log=$work/restore-$2-$3.log root=$work/restored-$2-$3 pid t0 t1 weir_cpu server_before server_after=0
    if [ -w /proc/sys/vm/drop_caches ]; then sync; echo 3 > /proc/sys/vm/drop_caches; fi
    server_before=0
    [ -n "$server_pid" ] && server_before=$(cpu_of "$server_pid")
    # The log exists before the loop below reads it (the process's redirection may come later).
    : > "$log"
    t0=$(date +%s.%N)
    if [ "$pin" = true ]; then
        WEIR_LOG=info taskset -c 0 "$weir" run "$job" --checkpoint-dir "$root" --restore "$1" > "$log" 2>&1 &
    else
        WEIR_LOG=info "$weir" run "$job" --checkpoint-dir "$root" --restore "$1" > "$log" 2>&1 &
    fi
    pid=$!
    # Waits for the line without polling: a loop of grep and sleep every 20 ms started about
    # 150 processes a second beside the restore it measured, on the same 2 cores. tail
    # follows the log by inotify and ends when the process does (the restore failed).
    if ! grep -q -m1 'keyed state restored' < <(tail -n +1 -F --pid="$pid" "$log" 2>/dev/null); then
        tail -5 "$log" >&2
        echo "restore-at-scale: the restore failed" >&2
        exit 1
    fi
    t1=$(date +%s.%N)
    weir_cpu=$(cpu_of "$pid")
    [ -n "$server_pid" ] && server_after=$(cpu_of "$server_pid")
    kill -9 "$pid"; wait "$pid" 2>/dev/null || true
    rm -rf "$root"
    echo "$(echo "$t1 - $t0" | bc) $(sed -n 's/.*restoring .* bytes=\([0-9]*\).*/\1/p' "$log" | head -1) $weir_cpu $(echo "$server_after - $server_before" | bc)"
}

[ -w /proc/sys/vm/drop_caches ] || echo "restore-at-scale: not root: the page cache is not dropped before each restore" >&2
if [ "$pin" = true ] && [ -n "$server_pid" ]; then taskset -acp 1 "$server_pid" > /dev/null; fi

generate "$work/local"
local_checkpoint=$work/local/checkpoints/$(newest_in "$work/local/checkpoints")
s3_checkpoint=
if [ -n "$server_pid" ]; then
    generate "s3://$bucket/gen"
    s3_checkpoint=s3://$bucket/gen/checkpoints/$(newest_in "$work/server/$bucket/gen/checkpoints")
fi

if [ -n "$link_rate" ]; then
    tc qdisc replace dev lo root tbf rate "$link_rate" burst 4mb latency 100ms \
        || { echo "restore-at-scale: cannot limit loopback to $link_rate (root and tc's tbf needed)" >&2; exit 1; }
fi

# median of the per-GiB figures given on stdin, one per line (the lower middle one of an even count)
median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
local_figures=()
s3_figures=()
for run in $(seq "$runs"); do
    # Alternating, so that both see the same state of the machine.
    read -r secs bytes cpu _ < <(restore "$local_checkpoint" local "$run")
    [ -n "${bytes:-}" ] || exit 1
    per_gib=$(echo "scale=3; $secs / ($bytes / 1073741824)" | bc)
    local_figures+=("$per_gib")
    printf 'run %d, local disk: %.2f s for %.2f GiB, %.2f s per GiB, weir CPU %.1f s\n' \
        "$run" "$secs" "$(echo "scale=3; $bytes / 1073741824" | bc)" "$per_gib" "$cpu"
    if [ -n "$s3_checkpoint" ]; then
        read -r secs bytes cpu server_cpu < <(restore "$s3_checkpoint" s3 "$run")
        [ -n "${bytes:-}" ] || exit 1
        per_gib=$(echo "scale=3; $secs / ($bytes / 1073741824)" | bc)
        s3_figures+=("$per_gib")
        printf 'run %d, %s: %.2f s for %.2f GiB, %.2f s per GiB, weir CPU %.1f s, the server'"'"'s CPU %.1f s\n' \
            "$run" "$server" "$secs" "$(echo "scale=3; $bytes / 1073741824" | bc)" "$per_gib" "$cpu" "$server_cpu"
    fi
done
local_median=$(printf '%s\n' "${local_figures[@]}" | median)
printf 'restore at scale (%s, %d keys), from a new process'"'"'s start to the state restored, median of %d:\n' "$shape" "$keys" "$runs"
printf '  local disk: %.2f s per GiB\n' "$local_median"
if [ ${#s3_figures[@]} -gt 0 ]; then
    s3_median=$(printf '%s\n' "${s3_figures[@]}" | median)
    printf '  %s on loopback%s%s: %.2f s per GiB (%.2f× local disk)\n' "$server" \
        "$([ -n "$link_rate" ] && echo " limited to $link_rate")" \
        "$([ "$pin" = true ] && echo ', weir on core 0 and the server on core 1' || echo ', sharing the cores')" \
        "$s3_median" "$(echo "scale=3; $s3_median / $local_median" | bc)"
fi
