//! The fuzz targets: what a tenant, a runtime image or damaged storage can hand Weir. Each runs
//! its corpus, then random and mutated inputs for `WEIR_FUZZ_SECONDS` (see `weir_fuzz`).

use proptest::prelude::*;
use proptest::sample::Index;
use weir_checkpoint::format::{self, FileKind, StateFileWriter};
use weir_checkpoint::metadata::{CheckpointMetadata, SnapshotKind, FORMAT_VERSION};
use weir_fuzz::fuzz;

/// `bytes` with each `(at, value)` written over it and, when given, cut at `cut`.
fn mutate(mut bytes: Vec<u8>, edits: &[(Index, u8)], cut: Option<Index>) -> Vec<u8> {
    if !bytes.is_empty() {
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = *value;
        }
    }
    if let Some(cut) = cut {
        bytes.truncate(cut.index(bytes.len() + 1));
    }
    bytes
}

/// Arbitrary bytes, or `valid` inputs with a few bytes changed and perhaps cut short.
fn bytes_near(valid: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let mutated = (valid, proptest::collection::vec((any::<Index>(), any::<u8>()), 0..6), any::<Option<Index>>())
        .prop_map(|(bytes, edits, cut)| mutate(bytes, &edits, cut));
    prop_oneof![proptest::collection::vec(any::<u8>(), 0..1024), mutated]
}

/// Text near `valid`: characters of `alphabet` inserted, removed or replaced here and there.
fn text_near(valid: impl Strategy<Value = String>, alphabet: &'static str) -> impl Strategy<Value = String> {
    let letters: Vec<char> = alphabet.chars().collect();
    let edit = (any::<Index>(), any::<Index>(), 0u8..3);
    let mutated = (valid, proptest::collection::vec(edit, 0..8)).prop_map(move |(text, edits)| {
        let mut chars: Vec<char> = text.chars().collect();
        for (at, letter, how) in edits {
            let c = letters[letter.index(letters.len())];
            match how {
                0 => chars.insert(at.index(chars.len() + 1), c),
                1 if !chars.is_empty() => {
                    chars.remove(at.index(chars.len()));
                }
                _ if !chars.is_empty() => {
                    let i = at.index(chars.len());
                    chars[i] = c;
                }
                _ => {}
            }
        }
        chars.into_iter().collect::<String>()
    });
    let letters: Vec<char> = alphabet.chars().collect();
    let random = proptest::collection::vec(any::<Index>(), 0..300)
        .prop_map(move |picks| picks.iter().map(|i| letters[i.index(letters.len())]).collect::<String>());
    prop_oneof![random, mutated]
}

/// A well-formed state file of every kind, from arbitrary entries.
fn state_file() -> impl Strategy<Value = Vec<u8>> {
    let entry =
        (0u32..300, proptest::collection::vec(any::<u8>(), 0..12), proptest::collection::vec(any::<u8>(), 0..24));
    (0u8..4, proptest::collection::vec(entry, 0..24), any::<bool>()).prop_map(|(kind, entries, delete_some)| {
        let mut w = match kind {
            0 => StateFileWriter::new(FileKind::KeyedFull, 64),
            1 => StateFileWriter::new(FileKind::KeyedIncrement, 64),
            2 => StateFileWriter::increment_by_key_group(64),
            _ => {
                let mut w = StateFileWriter::new(FileKind::OperatorState, 64);
                w.document(&entries.iter().flat_map(|(_, k, _)| k.clone()).collect::<Vec<u8>>());
                return w.finish().0.to_vec();
            }
        };
        for (i, (kg, key, value)) in entries.iter().enumerate() {
            if delete_some && kind != 0 && i % 3 == 0 {
                w.delete(*kg, key);
            } else {
                w.put(*kg, key, value);
            }
        }
        w.finish().0.to_vec()
    })
}

/// Every reader of state files over `bytes`, as a restore would call them, with the length
/// the file has and lengths a damaged `_metadata` could say instead.
fn read_state_file(bytes: &[u8]) {
    let walk = |body: &[u8]| {
        for entry in format::keyed_entries(body).take(1 << 16) {
            if entry.is_err() {
                break;
            }
        }
    };
    if let Ok((kind, body)) = format::open(bytes) {
        match kind {
            FileKind::OperatorState => drop(format::operator_document(body)),
            _ => walk(body),
        }
    }
    let _ = format::open_verified(bytes);
    let len = bytes.len() as u64;
    for said in [len, len.saturating_sub(1), len + 1, len * 2 + 4096, 1 << 40] {
        let _ = format::read_keyed_parts(bytes, said, 64, |part| {
            walk(part);
            Ok::<(), ()>(())
        });
        if let Ok(Some(index)) = format::read_increment_index(bytes, said) {
            let _ = index.pieces_of((0, 300), 64);
        }
        let _ = format::head_len(&bytes[..bytes.len().min(format::HEAD_BYTES as usize)], said);
    }
}

#[test]
fn state_files() {
    fuzz("state_file", |b| b.to_vec(), bytes_near(state_file()), |b| read_state_file(b));
}

fn metadata_document() -> impl Strategy<Value = Vec<u8>> {
    (any::<u64>(), "[a-z-]{0,12}", any::<u64>(), 1u32..40_000).prop_map(|(id, job, epoch, max_parallelism)| {
        CheckpointMetadata {
            format_version: FORMAT_VERSION,
            checkpoint_id: id,
            kind: SnapshotKind::Checkpoint,
            job_name: job,
            epoch,
            created_at_ms: id / 3,
            max_parallelism,
            operators: Default::default(),
        }
        .encode()
    })
}

/// A `_metadata` document decodes or is refused; one that decodes encodes back to itself.
#[test]
fn metadata_documents() {
    fuzz(
        "metadata",
        |b| b.to_vec(),
        bytes_near(metadata_document()),
        |bytes| {
            if let Ok(m) = CheckpointMetadata::decode(bytes) {
                assert_eq!(CheckpointMetadata::decode(&m.encode()).as_ref(), Ok(&m));
                let _ = m.required_files();
            }
        },
    );
}

const JOB: &str = "name: fuzzed
parallelism: 2
checkpointing: { interval: 1s }
sources:
  - name: events
    uid: events
    generator: { count: 10, fields: [ { name: k, modulo: 4 }, { name: w, word: { cardinality: 9 } } ] }
operators:
  - { name: small, filter: { expr: \"k < 2 && w.startsWith('a')\" } }
  - { name: by-k, keyBy: { fields: [k] } }
  - { name: counts, uid: counts, window: { type: tumbling, size: 1s, aggregates: [ { fn: count, as: n } ] } }
sinks: [ { name: out, file: { path: /tmp/out } } ]
";

const STREAMJOB: &str = "apiVersion: weir.dev/v1alpha1
kind: StreamJob
metadata: { name: fuzzed }
spec:
  image: weir-runtime:dev
  parallelism: 1
  podTemplate: { labels: { team: a } }
  checkpointing: { storage: s3://b/p }
  job:
    inline:
      sources: [ { name: s, uid: s, generator: { fields: [ { name: a, sequence: {} } ] } } ]
      sinks: [ { name: o, stdout: {} } ]
";

/// Job files (what the runtime reads and the operator validates for every tenant) and
/// StreamJobs parse or are refused, and whatever parses validates without panicking.
#[test]
fn job_files_and_streamjobs() {
    let valid = prop_oneof![Just(JOB.to_string()), Just(STREAMJOB.to_string())];
    let from_file = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    fuzz("job_file", from_file, text_near(valid, "abkwnz01:{}[],-'\"&|<>=.!() \n#*&?"), |text| {
        if let Ok(spec) = weir_crds::JobSpec::from_yaml(text) {
            let _ = weir_crds::validate(&spec);
        }
        if let Ok(sj) = serde_yaml::from_str::<weir_crds::StreamJob>(text) {
            let _ = weir_crds::streamjob::spec_violations("fuzzed", &sj.spec);
        }
    });
}

/// CEL expressions compile or are refused; none overflows a stack or panics.
#[test]
fn cel_expressions() {
    let valid = prop_oneof![
        Just("a + b * 2 > 3 && !(b in [1, 2])".to_string()),
        Just("a.size() > 0 ? [a, 'x'].exists(x, x == 'y') : {'k': b}['k'] == 1".to_string()),
        Just("r'\\d+' + \"\"\"ab\"\"\" + b'x'".to_string()),
    ];
    let from_file = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let fields: Vec<String> = ["a", "b"].iter().map(|s| s.to_string()).collect();
    fuzz("cel", from_file, text_near(valid, "ab12()[]{}.,:?!<>=&|+-*/%'\"\\r "), |text| {
        let _ = weir_crds::expr::compile(text, &fields);
    });
}
