//! Writes the `StreamJob` CustomResourceDefinition as YAML: to stdout, or with `--write` to
//! `crds/streamjob.yaml` and the Helm chart's `charts/weir-operator/crds/streamjob.yaml` (a
//! test fails when either drifts from the Rust types).

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
        for path in [weir_crds::streamjob::CRD_PATH, weir_crds::streamjob::CHART_CRD_PATH] {
            if let Err(e) = std::fs::write(path, &yaml) {
                eprintln!("error: writing {path}: {e}");
                return std::process::ExitCode::FAILURE;
            }
            eprintln!("wrote {path} ({})", weir_crds::StreamJob::crd_name());
        }
    } else {
        print!("{yaml}");
    }
    std::process::ExitCode::SUCCESS
}
