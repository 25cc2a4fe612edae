#!/usr/bin/env bash
# Runs Apache Flink and Weir on the same keyed count, one after the other in this invocation,
# and prints records per CPU-second of each and Weir ÷ Flink: the ratio is measured here, not
# quoted. The job: 1M keys drawn as Weir's generator draws them, keyBy, a running count per
# key emitted on every record and discarded, exactly-once checkpoints every second to local
# disk (Flink: heap `hashmap` state, or `rocksdb` with --backend; Weir: `heap`, or `rocksdb`
# with a cache of --weir-cache entries, a tenth of the keys by default, so that most
# accesses miss the cache as Flink's do), then the same with checkpoints off. CPU time is the whole process's user+system time (Flink: one JVM running a
# MiniCluster, ParallelGC; Weir: the `weir-runtime` binary).
#
# Flink's jars come from the `apache-flink-libraries` wheel on PyPI, cached under
# $WEIR_CACHE/flink; the Java job is runtime/benches/flink/KeyedCount.java.
#
# usage: runtime/benches/flink-peer.sh [--records N] [--keys K] [--parallelism P]
#                                      [--backend hashmap|rocksdb] [--weir-cache N]
#                                      [--flink-version V]
set -euo pipefail

records=20000000
keys=1000000
parallelism=2
backend=hashmap
weir_cache=
flink_version=2.3.0
while [ $# -gt 0 ]; do
    case "$1" in
        --records) records="$2"; shift 2 ;;
        --keys) keys="$2"; shift 2 ;;
        --parallelism) parallelism="$2"; shift 2 ;;
        --backend) backend="$2"; shift 2 ;;
        --weir-cache) weir_cache="$2"; shift 2 ;;
        --flink-version) flink_version="$2"; shift 2 ;;
        *) echo "flink-peer: unknown argument $1" >&2; exit 2 ;;
    esac
done

case "$backend" in
    hashmap) weir_backend="stateBackend: heap" ;;
    rocksdb) weir_backend="stateBackend: rocksdb
stateCacheEntries: ${weir_cache:-$((keys / 10))}" ;;
    *) echo "flink-peer: --backend is hashmap or rocksdb, not $backend" >&2; exit 2 ;;
esac

repo=$(cd "$(dirname "$0")/../.." && pwd)
cache=${WEIR_CACHE:-$HOME/.cache/weir}
flink_home=$cache/flink/$flink_version
if [ ! -f "$flink_home/lib/flink-dist-$flink_version.jar" ]; then
    echo "flink-peer: fetching apache-flink-libraries $flink_version from PyPI" >&2
    rm -rf "$flink_home.tmp" && mkdir -p "$flink_home.tmp"
    python3 -m pip download --quiet --no-deps "apache-flink-libraries==$flink_version" -d "$flink_home.tmp"
    (cd "$flink_home.tmp" && python3 -m zipfile -e ./*.whl unpacked)
    mkdir -p "$flink_home.tmp/lib"
    mv "$flink_home.tmp"/unpacked/pyflink/lib/*.jar "$flink_home.tmp/lib/"
    rm -rf "$flink_home.tmp/unpacked" "$flink_home.tmp"/*.whl
    rm -rf "$flink_home" && mv "$flink_home.tmp" "$flink_home"
fi
classes=$flink_home/classes
src=$repo/runtime/benches/flink/KeyedCount.java
if [ ! -f "$classes/KeyedCount.class" ] || [ "$src" -nt "$classes/KeyedCount.class" ]; then
    mkdir -p "$classes"
    javac -cp "$flink_home/lib/*" -d "$classes" "$src"
fi

echo "flink-peer: building weir-runtime (release)" >&2
# The Debian packages the build needs (RocksDB, libclang, librdkafka's), on a fresh machine.
bash "$repo/.ci/install-packages.sh" >&2
# Default features: `--backend rocksdb` needs the rocksdb backend, and the binary is then the one
# every other bench and `cargo build --release` make (no second build of the dependencies).
(cd "$repo" && cargo build --quiet --release -p weir-runtime)
target=${CARGO_TARGET_DIR:-$repo/target}
weir=$target/release/weir-runtime

work=$(mktemp -d /tmp/weir-flink-peer.XXXXXX)
trap 'rm -rf "$work"' EXIT

# Runs a command and prints its children's user+system CPU seconds and wall seconds.
cpu_of() {
    python3 - "$@" <<'PY'
import resource, subprocess, sys, time
t0 = time.monotonic()
p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
wall = time.monotonic() - t0
if p.returncode != 0:
    sys.stderr.write(p.stderr.decode(errors="replace")[-4000:])
    sys.exit(f"command failed ({p.returncode}): {' '.join(sys.argv[1:])}")
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"{r.ru_utime + r.ru_stime:.3f} {wall:.3f}")
PY
}

weir_job() {
    cat <<YAML
name: peer-count
parallelism: $parallelism
$weir_backend
checkpointing: { enabled: $1, interval: 1s, mode: exactly-once, incremental: true, fullEvery: 10 }
sources:
  - name: src
    uid: src
    generator: { count: $records, fields: [ { name: key, modulo: $keys } ] }
operators:
  - { name: by-key, keyBy: { fields: [key] } }
  - { name: counts, uid: counts, aggregate: { aggregates: [ { fn: count, as: n } ] } }
sinks:
  - { name: out, blackhole: {} }
YAML
}

run_weir() {
    local on=$1 dir=$work/weir-$1
    weir_job "$on" > "$work/job-$on.yaml"
    cpu_of "$weir" run "$work/job-$on.yaml" --checkpoint-dir "$dir"
}

run_flink() {
    local interval=$1 dir=$work/flink-$1
    mkdir -p "$dir"
    cpu_of java -XX:+UseParallelGC -Xms3g -Xmx3g -cp "$flink_home/lib/*:$classes" \
        KeyedCount "$records" "$keys" "$parallelism" "$backend" "$dir" "$interval"
}

rate() { python3 -c "import sys; print(f'{$records / float(sys.argv[1]) / 1e6:.3f}')" "$1"; }
ratio() { python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}')" "$1" "$2"; }
# overhead OFF_CPU ON_CPU: the share of records per CPU-second that checkpoints cost.
overhead() { python3 -c "import sys; print(f'{(1 - float(sys.argv[1]) / float(sys.argv[2])) * 100:.1f}%')" "$1" "$2"; }

echo "keyed count: $records records, $keys keys, parallelism $parallelism, Flink $flink_version ($backend state), weir: ${weir_backend//$'\n'/, }"
printf '%-8s %-12s %10s %10s %16s\n' engine checkpoints cpu-s wall-s "M records/CPU-s"
declare -A cpu
for on in true false; do
    interval=$([ "$on" = true ] && echo 1000 || echo 0)
    read -r c w < <(run_weir "$on")
    cpu[weir-$on]=$c
    printf '%-8s %-12s %10s %10s %16s\n' weir "$([ "$on" = true ] && echo 'every 1 s' || echo off)" "$c" "$w" "$(rate "$c")"
    read -r c w < <(run_flink "$interval")
    cpu[flink-$on]=$c
    printf '%-8s %-12s %10s %10s %16s\n' flink "$([ "$on" = true ] && echo 'every 1 s' || echo off)" "$c" "$w" "$(rate "$c")"
done
echo "weir ÷ flink per CPU-second, checkpoints every 1 s: $(ratio "${cpu[flink-true]}" "${cpu[weir-true]}")×"
echo "weir ÷ flink per CPU-second, checkpoints off:       $(ratio "${cpu[flink-false]}" "${cpu[weir-false]}")×"
echo "checkpoint overhead (records/CPU-s): weir $(overhead "${cpu[weir-false]}" "${cpu[weir-true]}"), flink $(overhead "${cpu[flink-false]}" "${cpu[flink-true]}")"
