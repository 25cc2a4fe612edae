//! Reads text lines from a file or from every regular file of a directory (sorted by name;
//! names starting with `.` or `_` are skipped). Files are the splits: file `i` belongs to
//! subtask `i mod parallelism`; a position is a byte offset. A record's event time is its line
//! number in its file; the watermark stays at its minimum until all files are read.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::operator::TaskError;
use crate::sources::{Source, SourcePoll};
use crate::value::{Record, Value};

#[derive(Serialize, Deserialize, Default)]
struct Positions {
    /// file name → (byte offset, lines read).
    files: BTreeMap<String, (u64, i64)>,
}

/// A file source subtask.
pub struct FileSource {
    files: Vec<(PathBuf, String)>,
    positions: BTreeMap<String, (u64, i64)>,
    current: Option<(usize, BufReader<File>)>,
    next_file: usize,
    line: String,
    done: bool,
}

fn list_files(path: &str) -> Result<Vec<(PathBuf, String)>, TaskError> {
    let read = |reason: String| TaskError::Read { what: path.to_string(), reason };
    let p = PathBuf::from(path.strip_prefix("file://").unwrap_or(path));
    let meta = std::fs::metadata(&p).map_err(|e| read(e.to_string()))?;
    if meta.is_file() {
        let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        return Ok(vec![(p, name)]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&p).map_err(|e| read(e.to_string()))? {
        let entry = entry.map_err(|e| read(e.to_string()))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if name.starts_with('.')
            || name.starts_with('_')
            || !entry.file_type().map_err(|e| read(e.to_string()))?.is_file()
        {
            continue;
        }
        files.push((entry.path(), name));
    }
    files.sort_by(|a, b| a.1.cmp(&b.1));
    Ok(files)
}

impl FileSource {
    /// Builds subtask `subtask` of `parallelism` from the union of restored positions.
    pub fn new(path: &str, subtask: u32, parallelism: u32, restored: &[&[u8]]) -> Result<Self, TaskError> {
        let files: Vec<_> = list_files(path)?
            .into_iter()
            .enumerate()
            .filter(|(i, _)| *i as u32 % parallelism == subtask)
            .map(|(_, f)| f)
            .collect();
        // Keep the positions of this subtask's own files only, so its snapshots never carry
        // stale copies of another subtask's positions; a file read by several earlier subtasks
        // (a rescale) resumes from the furthest position, as positions only grow.
        let mut positions: BTreeMap<String, (u64, i64)> = BTreeMap::new();
        for doc in restored {
            let p: Positions = serde_json::from_slice(doc)
                .map_err(|e| TaskError::Restore { uid: "file".into(), reason: e.to_string() })?;
            for (name, pos) in p.files {
                if files.iter().any(|(_, n)| *n == name) {
                    let entry = positions.entry(name).or_insert(pos);
                    *entry = (*entry).max(pos);
                }
            }
        }
        Ok(FileSource { files, positions, current: None, next_file: 0, line: String::new(), done: false })
    }
}

impl Source for FileSource {
    fn poll(&mut self, out: &mut Vec<Record>, max: usize) -> Result<SourcePoll, TaskError> {
        let mut produced = 0;
        while produced < max {
            if self.current.is_none() {
                if self.next_file >= self.files.len() {
                    self.done = true;
                    break;
                }
                let i = self.next_file;
                self.next_file += 1;
                let (path, name) = &self.files[i];
                let (offset, _) = self.positions.get(name).copied().unwrap_or((0, 0));
                let mut f = File::open(path)
                    .map_err(|e| TaskError::Read { what: path.display().to_string(), reason: e.to_string() })?;
                f.seek(SeekFrom::Start(offset))
                    .map_err(|e| TaskError::Read { what: path.display().to_string(), reason: e.to_string() })?;
                self.current = Some((i, BufReader::new(f)));
            }
            let Some((i, reader)) = self.current.as_mut() else { break };
            let name = self.files[*i].1.clone();
            self.line.clear();
            let n = reader
                .read_line(&mut self.line)
                .map_err(|e| TaskError::Read { what: name.clone(), reason: e.to_string() })?;
            if n == 0 {
                self.current = None;
                continue;
            }
            let pos = self.positions.entry(name).or_insert((0, 0));
            pos.0 += n as u64;
            pos.1 += 1;
            let text = self.line.trim_end_matches(['\n', '\r']);
            out.push(Record { time: pos.1 - 1, fields: smallvec::smallvec![Value::str(text)] });
            produced += 1;
        }
        Ok(if produced > 0 { SourcePoll::Data } else { SourcePoll::Finished })
    }

    fn watermark(&self) -> i64 {
        if self.done {
            i64::MAX
        } else {
            i64::MIN
        }
    }

    fn snapshot(&mut self, _checkpoint: u64) -> Vec<u8> {
        serde_json::to_vec(&Positions { files: self.positions.clone() }).expect("positions serialize")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_all_lines_and_resumes_from_offsets() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "one\ntwo\nthree\n").unwrap();
        std::fs::write(dir.path().join("b.txt"), "four\nfive").unwrap();
        std::fs::write(dir.path().join("_skip"), "no\n").unwrap();
        let path = dir.path().to_str().unwrap();
        let mut src = FileSource::new(path, 0, 1, &[]).unwrap();
        let mut out = Vec::new();
        src.poll(&mut out, 2).unwrap();
        let doc = src.snapshot(0);
        let mut resumed = FileSource::new(path, 0, 1, &[&doc]).unwrap();
        while resumed.poll(&mut out, 10).unwrap() != SourcePoll::Finished {}
        let lines: Vec<String> = out.iter().map(|r| r.fields[0].to_string()).collect();
        assert_eq!(lines, vec!["one", "two", "three", "four", "five"]);
        assert_eq!(resumed.watermark(), i64::MAX);
    }

    /// Shrunk from the chaos campaign: each subtask carried stale copies of the other
    /// subtasks' positions in its snapshot, and a second restore let a stale copy win, so
    /// lines were read twice.
    #[test]
    fn a_second_restore_does_not_rewind_another_subtasks_file() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["a", "b"] {
            std::fs::write(dir.path().join(f), (0..10).map(|i| format!("{f}{i}\n")).collect::<String>()).unwrap();
        }
        let path = dir.path().to_str().unwrap();
        let mut sources: Vec<FileSource> = (0..2).map(|s| FileSource::new(path, s, 2, &[]).unwrap()).collect();
        let mut out = Vec::new();
        for s in &mut sources {
            s.poll(&mut out, 3).unwrap();
        }
        let docs: Vec<Vec<u8>> = sources.iter_mut().map(|s| s.snapshot(0)).collect();
        let refs: Vec<&[u8]> = docs.iter().map(|d| d.as_slice()).collect();
        let mut sources: Vec<FileSource> = (0..2).map(|s| FileSource::new(path, s, 2, &refs).unwrap()).collect();
        for s in &mut sources {
            s.poll(&mut out, 4).unwrap();
        }
        let docs: Vec<Vec<u8>> = sources.iter_mut().map(|s| s.snapshot(0)).collect();
        let refs: Vec<&[u8]> = docs.iter().map(|d| d.as_slice()).collect();
        for s in 0..2 {
            let mut src = FileSource::new(path, s, 2, &refs).unwrap();
            while src.poll(&mut out, 10).unwrap() != SourcePoll::Finished {}
        }
        let mut lines: Vec<String> = out.iter().map(|r| r.fields[0].to_string()).collect();
        lines.sort();
        let mut expected: Vec<String> =
            ["a", "b"].iter().flat_map(|f| (0..10).map(move |i| format!("{f}{i}"))).collect();
        expected.sort();
        assert_eq!(lines, expected);
    }

    mod model {
        use proptest::prelude::*;

        use super::super::*;

        #[derive(Clone, Debug)]
        enum Op {
            Poll(usize, usize),
            Checkpoint,
            Restore(u32),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                6 => (0usize..3, 1usize..8).prop_map(|(s, n)| Op::Poll(s, n)),
                2 => Just(Op::Checkpoint),
                1 => (1u32..=3).prop_map(Op::Restore)
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

            /// Reads interleaved with checkpoints and restores at any parallelism: what was
            /// read up to the restored checkpoint plus everything read after it is every line
            /// of every file exactly once.
            #[test]
            fn every_line_exactly_once_through_restores_and_rescales(
                lens in proptest::collection::vec(0usize..12, 1..5),
                ops in proptest::collection::vec(op(), 0..60)
            ) {
                let dir = tempfile::tempdir().unwrap();
                let mut all = Vec::new();
                for (f, len) in lens.iter().enumerate() {
                    let lines: Vec<String> = (0..*len).map(|i| format!("f{f}-{i}")).collect();
                    all.extend(lines.iter().cloned());
                    std::fs::write(
                        dir.path().join(format!("f{f}")),
                        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
                    )
                    .unwrap();
                }
                let path = dir.path().to_str().unwrap().to_string();
                let start = |p: u32, docs: &[Vec<u8>]| -> Vec<FileSource> {
                    let refs: Vec<&[u8]> = docs.iter().map(|d| d.as_slice()).collect();
                    (0..p).map(|s| FileSource::new(&path, s, p, &refs).unwrap()).collect()
                };
                let mut sources = start(2, &[]);
                let (mut checkpointed, mut since): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
                let mut docs: Vec<Vec<u8>> = Vec::new();
                for op in ops {
                    match op {
                        Op::Poll(s, n) => {
                            let n_sources = sources.len();
                            let mut out = Vec::new();
                            sources[s % n_sources].poll(&mut out, n).unwrap();
                            since.extend(out.iter().map(|r| r.fields[0].to_string()));
                        }
                        Op::Checkpoint => {
                            docs = sources.iter_mut().map(|s| s.snapshot(0)).collect();
                            checkpointed.append(&mut since);
                        }
                        Op::Restore(p) => {
                            since.clear();
                            sources = start(p, &docs);
                        }
                    }
                }
                for s in &mut sources {
                    let mut out = Vec::new();
                    while s.poll(&mut out, 5).unwrap() != SourcePoll::Finished {}
                    since.extend(out.iter().map(|r| r.fields[0].to_string()));
                }
                checkpointed.append(&mut since);
                checkpointed.sort();
                all.sort();
                prop_assert_eq!(checkpointed, all);
            }
        }
    }
}
