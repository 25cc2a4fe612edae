//! Writes the `StreamJob` CustomResourceDefinition as YAML: to stdout, or with `--write` to
//! `crds/streamjob.yaml` (a test fails when that file drifts from the Rust types).

use kube::CustomResourceExt;

fn main() -> std::process::ExitCode {
    let yaml = match weir_crds::streamjob::crd_yaml() {
        Ok(y) => y,
        Err(e) => {
            eprintln!("error: cannot render the CRD: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    if std::env::args().any(|a| a == "--write") {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/streamjob.yaml");
        if let Err(e) = std::fs::write(path, &yaml) {
            eprintln!("error: writing {path}: {e}");
            return std::process::ExitCode::FAILURE;
        }
        eprintln!("wrote {path} ({})", weir_crds::StreamJob::crd_name());
    } else {
        print!("{yaml}");
    }
    std::process::ExitCode::SUCCESS
}
