//! Events on a real API server: a repeat is counted in the first Event's series (the API
//! server accepts the patch), a different note is a new Event, and a series whose Event was
//! deleted starts again as a new one.

use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, PostParams};
use kube::Resource;
use weir_e2e::apiserver::TestApiServer;
use weir_operator::events::{EventNote, Publisher};

/// The Events about `name`, with their notes and series counts.
async fn events_about(api: &Api<Event>, name: &str) -> Vec<(String, Option<String>, Option<i32>)> {
    let mut found: Vec<_> = api
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.metadata.name.unwrap_or_default(), e.note, e.series.map(|s| s.count)))
        .collect();
    found.sort_by(|a, b| a.1.cmp(&b.1));
    found
}

#[tokio::test(flavor = "multi_thread")]
async fn repeats_count_in_a_series_and_new_notes_are_new_events() {
    let ns = "events";
    let (_server, client) = TestApiServer::with_namespace(ns).await.expect("API server starts");
    // Any object will do as the subject: a ConfigMap.
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let subject = cms
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({ "metadata": { "name": "subject" } })).unwrap(),
        )
        .await
        .unwrap();
    let regarding: ObjectReference = subject.object_ref(&());
    let publisher = Publisher::new(client.clone(), "weir-operator", Some("weir-operator-0".into()));
    let api: Api<Event> = Api::namespaced(client.clone(), ns);
    let failed = EventNote { warning: true, reason: "SavepointFailed", note: "runtime answered 500" };

    for _ in 0..3 {
        publisher.publish(failed, &regarding).await.unwrap();
    }
    let once = events_about(&api, "subject").await;
    assert_eq!(once.len(), 1, "three occurrences are one Event: {once:?}");
    assert_eq!(once[0].2, Some(3), "counted in its series: {once:?}");

    publisher.publish(EventNote { note: "runtime timed out", ..failed }, &regarding).await.unwrap();
    let two = events_about(&api, "subject").await;
    assert_eq!(two.len(), 2, "another note is another Event: {two:?}");
    assert_eq!(two[0].1.as_deref(), Some("runtime answered 500"));
    assert_eq!(two[1].1.as_deref(), Some("runtime timed out"));
    assert_eq!(two[1].2, None, "a first occurrence has no series");

    // The first Event is deleted (expired by the API server's TTL, or by hand): the next
    // occurrence is a new Event, not an error.
    api.delete(&once[0].0, &DeleteParams::default()).await.unwrap();
    publisher.publish(failed, &regarding).await.unwrap();
    let again = events_about(&api, "subject").await;
    assert_eq!(again.len(), 2, "{again:?}");
    let renewed = again.iter().find(|e| e.1.as_deref() == Some("runtime answered 500")).unwrap();
    assert_ne!(renewed.0, once[0].0, "a new Event");
    assert_eq!(renewed.2, None, "starting a new series");
    assert_eq!(publisher.remembered(), 2);

    let event = api.get(&renewed.0).await.unwrap();
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    assert_eq!(event.reporting_controller.as_deref(), Some("weir-operator"));
    assert_eq!(event.reporting_instance.as_deref(), Some("weir-operator-0"));
    assert_eq!(event.regarding.and_then(|r| r.uid), subject.metadata.uid);
}
