//! Fencing at process level: two runtimes on one storage root, the older frozen and woken
//! after its replacement started (as a pod on a partitioned node would be). The stale one
//! stops with the fenced exit code and publishes nothing; output stays exactly once. The same
//! scenario on S3 is in `s3.rs`.

mod common;

#[test]
fn a_frozen_runtime_woken_after_its_replacement_started_is_fenced_on_local_storage() {
    let (_d, out, chk) = common::workdir("zombie");
    common::zombie_scenario("zombie", chk.to_str().unwrap(), out.to_str().unwrap(), &[]);
}
