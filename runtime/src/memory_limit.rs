//! How much memory this process may use: its cgroup's limit (a pod's `resources.limits.memory`)
//! or, without one, the machine's. Read from `/proc` and `/sys/fs/cgroup` (v1 and v2); the
//! parsing is pure and tested here.

/// Bytes this process may use: the smaller of its memory cgroup's limit and the machine's
/// memory, `None` when neither can be read.
pub fn process_memory_limit() -> Option<u64> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let own_cgroups = read("/proc/self/cgroup").unwrap_or_default();
    let cgroup = cgroup_limit_files(&own_cgroups).iter().find_map(|f| read(f).as_deref().and_then(parse_cgroup_limit));
    let machine = read("/proc/meminfo").as_deref().and_then(parse_mem_total);
    match (cgroup, machine) {
        (Some(c), Some(m)) => Some(c.min(m)),
        (c, m) => c.or(m),
    }
}

/// The files that may hold this process's memory limit, most specific first, from the text
/// of `/proc/self/cgroup`: its own cgroup's (v2 `memory.max`, v1 `memory.limit_in_bytes`),
/// then the mount's root (inside a container's cgroup namespace, its own).
fn cgroup_limit_files(proc_self_cgroup: &str) -> Vec<String> {
    let mut files = Vec::new();
    for line in proc_self_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else { continue };
        let path = path.trim_end_matches('/');
        if controllers.is_empty() {
            files.push(format!("/sys/fs/cgroup{path}/memory.max"));
        } else if controllers.split(',').any(|c| c == "memory") {
            files.push(format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"));
        }
    }
    files.push("/sys/fs/cgroup/memory.max".into());
    files.push("/sys/fs/cgroup/memory/memory.limit_in_bytes".into());
    files
}

/// A cgroup's memory limit file: bytes, or `None` for no limit (v2 `max`; v1 writes a number
/// near 2^63 rounded to pages).
fn parse_cgroup_limit(text: &str) -> Option<u64> {
    let bytes: u64 = text.trim().parse().ok()?;
    (bytes < 1 << 60).then_some(bytes)
}

/// `MemTotal` of `/proc/meminfo`, in bytes.
fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_read_from_cgroup_files_and_meminfo() {
        assert_eq!(parse_cgroup_limit("8589934592\n"), Some(8 << 30));
        assert_eq!(parse_cgroup_limit("max\n"), None);
        assert_eq!(parse_cgroup_limit("9223372036854771712\n"), None, "cgroup v1 without a limit");
        assert_eq!(parse_cgroup_limit(""), None);
        let meminfo = "MemTotal:       24567124 kB\nMemFree:        17000000 kB\n";
        assert_eq!(parse_mem_total(meminfo), Some(24567124 * 1024));
        assert_eq!(parse_mem_total("MemFree: 1 kB\n"), None);
    }

    #[test]
    fn the_processs_own_cgroup_is_looked_at_first() {
        let v1 = "12:memory:/kubepods/pod1/abc\n11:cpu,cpuacct:/kubepods/pod1/abc\n0::/\n";
        let files = cgroup_limit_files(v1);
        assert_eq!(files[0], "/sys/fs/cgroup/memory/kubepods/pod1/abc/memory.limit_in_bytes");
        assert_eq!(files[1], "/sys/fs/cgroup/memory.max");
        assert_eq!(files.last().unwrap(), "/sys/fs/cgroup/memory/memory.limit_in_bytes");
        let v2 = "0::/system.slice/weir.service\n";
        assert_eq!(cgroup_limit_files(v2)[0], "/sys/fs/cgroup/system.slice/weir.service/memory.max");
        assert_eq!(cgroup_limit_files("garbage")[0], "/sys/fs/cgroup/memory.max");
    }

    #[test]
    fn this_process_has_a_limit_no_larger_than_the_machine() {
        let limit = process_memory_limit().expect("Linux has /proc/meminfo");
        let machine = parse_mem_total(&std::fs::read_to_string("/proc/meminfo").unwrap()).unwrap();
        assert!(limit > 0 && limit <= machine, "{limit} against {machine}");
    }
}
