// The Flink peer of Weir's keyed-count benchmark (runtime/benches/throughput.rs): the same key
// stream (splitmix64 of the sequence number, modulo the key count, as Weir's generator draws
// it), keyBy, a running count per key in keyed state, every update emitted and discarded,
// exactly-once checkpoints every second to the local file system. Run by
// runtime/benches/flink-peer.sh, which measures the whole process's CPU time.
//
// Usage: KeyedCount <records> <keys> <parallelism> <hashmap|rocksdb> <checkpoint-dir> <interval-ms>
// (interval 0: checkpoints off).

import org.apache.flink.api.common.JobExecutionResult;
import org.apache.flink.api.common.accumulators.LongCounter;
import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.configuration.CheckpointingOptions;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.StateBackendOptions;
import org.apache.flink.core.execution.CheckpointingMode;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink;
import org.apache.flink.util.Collector;

public class KeyedCount {
    /** Weir's salt for a generator's first field: mix64(0x2545_f491_4f6c_dd1d). */
    static final long SALT = mix64(0x2545f4914f6cdd1dL);

    /** splitmix64's finalizer, as runtime/src/value.rs `mix64`. */
    static long mix64(long x) {
        x += 0x9e3779b97f4a7c15L;
        x = (x ^ (x >>> 30)) * 0xbf58476d1ce4e5b9L;
        x = (x ^ (x >>> 27)) * 0x94d049bb133111ebL;
        return x ^ (x >>> 31);
    }

    /** Counts per key; emits (key, count) on every record, as Weir's `aggregate` does. */
    public static class Count extends KeyedProcessFunction<Long, Long, Tuple2<Long, Long>> {
        private transient ValueState<Long> count;
        private final LongCounter records = new LongCounter();

        @Override
        public void open(OpenContext ctx) {
            count = getRuntimeContext().getState(new ValueStateDescriptor<>("count", Types.LONG));
            getRuntimeContext().addAccumulator("records", records);
        }

        @Override
        public void processElement(Long key, Context ctx, Collector<Tuple2<Long, Long>> out) throws Exception {
            Long n = count.value();
            long next = n == null ? 1 : n + 1;
            count.update(next);
            records.add(1L);
            out.collect(Tuple2.of(key, next));
        }
    }

    public static void main(String[] args) throws Exception {
        long records = Long.parseLong(args[0]);
        long keys = Long.parseLong(args[1]);
        int parallelism = Integer.parseInt(args[2]);
        String backend = args[3];
        String dir = args[4];
        long interval = Long.parseLong(args[5]);

        Configuration conf = new Configuration();
        conf.set(StateBackendOptions.STATE_BACKEND, backend);
        conf.set(CheckpointingOptions.CHECKPOINT_STORAGE, "filesystem");
        conf.set(CheckpointingOptions.CHECKPOINTS_DIRECTORY, "file://" + dir);
        conf.set(CheckpointingOptions.INCREMENTAL_CHECKPOINTS, true);
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(parallelism);
        if (interval > 0) {
            env.enableCheckpointing(interval, CheckpointingMode.EXACTLY_ONCE);
        }
        env.fromSequence(0, records - 1)
                .map(seq -> Long.remainderUnsigned(mix64(seq ^ SALT), keys))
                .returns(Types.LONG)
                .keyBy(k -> k)
                .process(new Count())
                .returns(Types.TUPLE(Types.LONG, Types.LONG))
                .sinkTo(new DiscardingSink<>());
        JobExecutionResult result = env.execute("keyed-count");
        long counted = result.<Long>getAccumulatorResult("records");
        if (counted != records) {
            throw new IllegalStateException("counted " + counted + " of " + records + " records");
        }
        System.out.println("flink-keyed-count records=" + counted + " runtime_ms=" + result.getNetRuntime());
    }
}
