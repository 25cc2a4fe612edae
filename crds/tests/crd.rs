//! The committed CRD matches the Rust types, and its schema is one the API server accepts.

use weir_crds::StreamJob;

#[test]
fn committed_crds_match_the_rust_types() {
    let generated = weir_crds::streamjob::crd_yaml().unwrap();
    for path in [weir_crds::streamjob::CRD_PATH, weir_crds::streamjob::CHART_CRD_PATH] {
        let committed = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(
            committed == generated,
            "{path} is stale: run `cargo run -p weir-crds --bin crdgen -- --write` and commit it"
        );
    }
}

/// Visits every schema node (not the maps of property names, so a field called `properties`
/// is a field, not a keyword).
fn walk<'a>(v: &'a serde_json::Value, path: String, out: &mut Vec<(String, &'a serde_json::Value)>) {
    out.push((path.clone(), v));
    let Some(m) = v.as_object() else { return };
    if let Some(props) = m.get("properties").and_then(|p| p.as_object()) {
        for (name, x) in props {
            walk(x, format!("{path}.properties.{name}"), out);
        }
    }
    for key in ["items", "additionalProperties"] {
        if let Some(x) = m.get(key).filter(|x| x.is_object()) {
            walk(x, format!("{path}.{key}"), out);
        }
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        for (i, x) in m.get(key).and_then(|a| a.as_array()).into_iter().flatten().enumerate() {
            walk(x, format!("{path}.{key}[{i}]"), out);
        }
    }
}

#[test]
fn schema_is_structural_and_documented() {
    let crd = serde_json::to_value(weir_crds::streamjob::crd()).unwrap();
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let mut nodes = Vec::new();
    walk(schema, "schema".into(), &mut nodes);
    for (path, node) in &nodes {
        let Some(obj) = node.as_object() else { continue };
        // Structural schemas: no $ref, and anyOf/oneOf may not introduce types.
        assert!(!obj.contains_key("$ref"), "{path}: $ref is not allowed in a CRD schema");
        for key in ["anyOf", "oneOf", "allOf"] {
            if let Some(alts) = obj.get(key) {
                for alt in alts.as_array().unwrap() {
                    assert!(alt.get("type").is_none(), "{path}.{key}: alternatives may not set a type");
                }
            }
        }
        // Every property of our own types carries a description (`kubectl explain`).
        if let Some(props) = obj.get("properties").and_then(|p| p.as_object()) {
            if path.contains("resources")
                || path.contains("tolerations")
                || path.contains("conditions")
                || path.starts_with("schema.properties.metadata")
            {
                continue;
            }
            for (name, p) in props {
                assert!(p.get("description").is_some(), "{path}.properties.{name} has no description");
            }
        }
    }
    let text = serde_json::to_string(schema).unwrap();
    for rule in [
        "self.maxParallelism : 128) >= self.parallelism",
        "oldSelf.maxParallelism : 128)",
        "self == oldSelf",
        "has(self.inline) != has(self.configMapRef)",
    ] {
        assert!(text.contains(rule), "CEL rule `{rule}` missing");
    }
    assert_eq!(crd["spec"]["names"]["shortNames"][0], "sj");
    assert!(crd["spec"]["versions"][0]["subresources"]["status"].is_object(), "status subresource");
}

#[test]
fn the_example_streamjobs_are_valid() {
    for name in ["streamjob.yaml", "kafka-streamjob.yaml"] {
        let path = format!("{}/../examples/{name}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        let sj: StreamJob = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{path} is not a StreamJob: {e}"));
        let inline = sj.spec.job.inline.expect("an inline job");
        let job = weir_crds::JobSpec {
            sources: inline.sources,
            operators: inline.operators,
            sinks: inline.sinks,
            ..weir_crds::JobSpec::from_yaml("name: x\nsources: []\nsinks: []").unwrap()
        };
        weir_crds::validate(&job).unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}
