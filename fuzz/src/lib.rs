//! The fuzz harness of Weir's decoders and validators, on stable Rust.
//!
//! A target is a function that must not panic, abort or hang on any input. [`fuzz`] runs it on
//! every file of `fuzz/corpus/<target>/` (inputs that once failed, and seeds), then on inputs
//! drawn by a proptest strategy until its time is up: `WEIR_FUZZ_SECONDS` per target (default
//! 10), from a seed it prints (`WEIR_FUZZ_SEED` replays one). A failure names the shrunk input;
//! the fix is kept by adding that input to the target's corpus.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// How long each target draws inputs (`WEIR_FUZZ_SECONDS`, default 10).
pub fn budget() -> Duration {
    let secs = std::env::var("WEIR_FUZZ_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    Duration::from_secs(secs)
}

/// The committed inputs of `target`, sorted by file name.
pub fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|entry| entry.expect("a corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files.into_iter().map(|p| (p.clone(), std::fs::read(&p).expect("a corpus file"))).collect()
}

/// Runs `run` on the corpus of `target` (each file through `from_file`), then on inputs of
/// `strategy` for [`budget`]; panics naming the input that fails. Returns how many inputs ran.
pub fn fuzz<S: Strategy>(
    target: &str,
    from_file: impl Fn(&[u8]) -> S::Value,
    strategy: S,
    run: impl Fn(&S::Value),
) -> u64 {
    let mut ran = 0u64;
    for (path, bytes) in corpus(target) {
        eprintln!("fuzz {target}: corpus {}", path.display());
        run(&from_file(&bytes));
        ran += 1;
    }
    let seed: u64 = std::env::var("WEIR_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    eprintln!("fuzz {target}: seed {seed} (WEIR_FUZZ_SEED={seed} replays it)");
    let deadline = Instant::now() + budget();
    let mut round = 0u64;
    while Instant::now() < deadline {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        key[8..16].copy_from_slice(&round.to_le_bytes());
        let config = Config { cases: 64, failure_persistence: None, ..Config::default() };
        let mut runner = TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &key));
        if let Err(failure) = runner.run(&strategy, |input| {
            run(&input);
            Ok(())
        }) {
            panic!("fuzz {target}: seed {seed}, round {round}: {failure}\nkeep the input in fuzz/corpus/{target}/");
        }
        ran += 64;
        round += 1;
    }
    eprintln!("fuzz {target}: {ran} inputs");
    ran
}
