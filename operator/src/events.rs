//! Kubernetes Events (`events.k8s.io/v1`) about StreamJobs, with series: the same event again
//! (same job, type, reason and note) within [`SERIES_WINDOW`] of the last one is counted in the
//! first one's `series` instead of creating another object, as client-go's recorder does. A
//! different note is a new event, so `kubectl describe` shows every distinct message.
//!
//! What is remembered per recent event is a hash of its key, the suffix of its name, a count
//! and a time (about 40 bytes): a recorder that keeps each Event object and its key held some
//! 3 KiB per job, the largest share of the operator's memory at 10,000 jobs. Which events are
//! repeats is decided by [`Series`], pure and tested here; [`Publisher`] does the API calls.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};

/// How long after its last occurrence an event can still be counted again in its series.
pub const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);

/// How often, at most, events older than the window are forgotten (a sweep visits them all).
const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// Longest note written, in characters (the API server refuses notes over 1 KiB).
pub const MAX_NOTE_CHARS: usize = 1000;

/// An event to publish about one object.
#[derive(Clone, Copy, Debug)]
pub struct EventNote<'a> {
    /// `Warning` rather than `Normal`.
    pub warning: bool,
    /// Machine-readable reason (`Deploying`, `SavepointFailed`, …).
    pub reason: &'a str,
    /// What happened, for a person.
    pub note: &'a str,
}

/// What [`Series::observe`] decided for an occurrence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Occurrence {
    /// Not seen within the window: create an Event whose name ends in `suffix`.
    New {
        /// Hex suffix of the Event's name (`<object>.<suffix>`), unique per object.
        suffix: u64,
    },
    /// Seen within the window: its Event (name ending in `suffix`) now counts `count`.
    Repeat {
        /// Suffix of the first occurrence's Event name.
        suffix: u64,
        /// Occurrences so far, this one included (2 or more).
        count: u32,
    },
}

/// One remembered event: its name suffix, how often it happened, when last (ms).
#[derive(Clone, Copy, Debug)]
struct Remembered {
    suffix: u64,
    count: u32,
    last_ms: i64,
}

/// The recent events, by a hash of their key. Pure: times are passed in.
#[derive(Debug, Default)]
pub struct Series {
    recent: HashMap<u64, Remembered>,
    swept_ms: i64,
}

impl Series {
    /// Records an occurrence of the event with key hash `key` at `now_ms`; `fresh_suffix` names
    /// its Event if it is new. Forgets events past the window (at most every [`SWEEP_EVERY`]).
    pub fn observe(&mut self, key: u64, now_ms: i64, fresh_suffix: u64) -> Occurrence {
        let window = SERIES_WINDOW.as_millis() as i64;
        if now_ms - self.swept_ms >= SWEEP_EVERY.as_millis() as i64 {
            self.recent.retain(|_, r| now_ms - r.last_ms < window);
            self.swept_ms = now_ms;
        }
        match self.recent.get_mut(&key) {
            Some(r) if now_ms - r.last_ms < window => {
                r.count = r.count.saturating_add(1);
                r.last_ms = now_ms;
                Occurrence::Repeat { suffix: r.suffix, count: r.count }
            }
            _ => {
                self.recent.insert(key, Remembered { suffix: fresh_suffix, count: 1, last_ms: now_ms });
                Occurrence::New { suffix: fresh_suffix }
            }
        }
    }

    /// Forgets the event with key hash `key`: its Event is gone, the next occurrence is new.
    pub fn forget(&mut self, key: u64) {
        self.recent.remove(&key);
    }

    /// How many events are remembered.
    pub fn len(&self) -> usize {
        self.recent.len()
    }

    /// Whether no event is remembered.
    pub fn is_empty(&self) -> bool {
        self.recent.is_empty()
    }
}

/// The hash that identifies an event: the object (namespace, name, uid), type, reason, note.
pub fn event_key(regarding: &ObjectReference, event: &EventNote<'_>) -> u64 {
    // SipHash with fixed keys: the same event hashes the same across the operator's life.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    (&regarding.namespace, &regarding.name, &regarding.uid).hash(&mut h);
    (event.warning, event.reason, event.note).hash(&mut h);
    h.finish()
}

/// The name of an Event about `regarding`: `<name>.<suffix in hex>`, as client-go names them.
fn event_name(regarding: &ObjectReference, suffix: u64) -> String {
    format!("{}.{suffix:x}", regarding.name.as_deref().unwrap_or("object"))
}

/// Publishes events with series, as `controller` (and `instance`, the operator's pod).
pub struct Publisher {
    client: kube::Client,
    controller: String,
    instance: String,
    series: std::sync::Mutex<Series>,
}

impl Publisher {
    /// A publisher reporting as `controller` from `instance` (the controller when `None`).
    pub fn new(client: kube::Client, controller: &str, instance: Option<String>) -> Self {
        Publisher {
            client,
            controller: controller.to_string(),
            instance: instance.unwrap_or_else(|| controller.to_string()),
            series: Default::default(),
        }
    }

    /// Publishes `event` about `regarding` (in its namespace): a new Event, or one more in the
    /// series of the same event within the window. A series whose Event is gone (expired by
    /// the API server, deleted) starts again as a new Event.
    pub async fn publish(&self, event: EventNote<'_>, regarding: &ObjectReference) -> Result<(), kube::Error> {
        let note: String = event.note.chars().take(MAX_NOTE_CHARS).collect();
        let event = EventNote { note: &note, ..event };
        let key = event_key(regarding, &event);
        let now = Timestamp::now();
        let now_ms = now.as_millisecond();
        let fresh = now.as_nanosecond() as u64;
        let occurrence = self.series.lock().unwrap_or_else(|e| e.into_inner()).observe(key, now_ms, fresh);
        let api: Api<Event> = Api::namespaced(self.client.clone(), regarding.namespace.as_deref().unwrap_or("default"));
        if let Occurrence::Repeat { suffix, count } = occurrence {
            let series = EventSeries { count: count as i32, last_observed_time: MicroTime(now) };
            let patch = serde_json::json!({ "series": series });
            match api.patch(&event_name(regarding, suffix), &PatchParams::default(), &Patch::Merge(&patch)).await {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    let mut series = self.series.lock().unwrap_or_else(|e| e.into_inner());
                    series.forget(key);
                    series.observe(key, now_ms, fresh);
                }
                Err(e) => return Err(e),
            }
        }
        api.create(&PostParams::default(), &self.event(&event, regarding, now, fresh)).await.map(|_| ())
    }

    /// The Event object for a first occurrence.
    fn event(&self, event: &EventNote<'_>, regarding: &ObjectReference, now: Timestamp, suffix: u64) -> Event {
        Event {
            metadata: ObjectMeta {
                name: Some(event_name(regarding, suffix)),
                namespace: regarding.namespace.clone(),
                ..Default::default()
            },
            action: Some("Reconcile".into()),
            reason: Some(event.reason.to_string()),
            note: Some(event.note.to_string()),
            type_: Some(if event.warning { "Warning" } else { "Normal" }.into()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            ..Default::default()
        }
    }

    /// How many events are remembered for their series.
    pub fn remembered(&self) -> usize {
        self.series.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;

    fn job(name: &str, uid: &str) -> ObjectReference {
        ObjectReference {
            namespace: Some("ns".into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            ..Default::default()
        }
    }

    fn note<'a>(reason: &'a str, note: &'a str) -> EventNote<'a> {
        EventNote { warning: false, reason, note }
    }

    #[test]
    fn a_repeat_within_the_window_is_counted_in_the_first_events_series() {
        let mut s = Series::default();
        let k = event_key(&job("a", "u1"), &note("Deploying", "pods created"));
        assert_eq!(s.observe(k, 0, 7), Occurrence::New { suffix: 7 });
        assert_eq!(s.observe(k, MIN, 8), Occurrence::Repeat { suffix: 7, count: 2 });
        // The window runs from the last occurrence, not the first.
        assert_eq!(s.observe(k, 6 * MIN + MIN / 2, 9), Occurrence::Repeat { suffix: 7, count: 3 });
        assert_eq!(s.observe(k, 13 * MIN, 10), Occurrence::New { suffix: 10 });
    }

    #[test]
    fn another_note_reason_type_or_object_is_another_event() {
        let base = event_key(&job("a", "u1"), &note("Deploying", "pods created"));
        let others = [
            event_key(&job("a", "u1"), &note("Deploying", "pods created again")),
            event_key(&job("a", "u1"), &note("Relaunching", "pods created")),
            event_key(&job("a", "u1"), &EventNote { warning: true, ..note("Deploying", "pods created") }),
            event_key(&job("b", "u1"), &note("Deploying", "pods created")),
            // A job deleted and created again under the same name.
            event_key(&job("a", "u2"), &note("Deploying", "pods created")),
        ];
        for other in others {
            assert_ne!(base, other);
        }
        assert_eq!(base, event_key(&job("a", "u1"), &note("Deploying", "pods created")));
    }

    #[test]
    fn events_past_the_window_are_forgotten_so_memory_follows_recent_activity() {
        let mut s = Series::default();
        for i in 0..1000u64 {
            s.observe(i, 0, i);
        }
        assert_eq!(s.len(), 1000);
        s.observe(5000, 3 * MIN, 5000);
        assert_eq!(s.len(), 1001, "within the window everything is kept");
        s.observe(5001, 7 * MIN, 5001);
        assert_eq!(s.len(), 2, "the first thousand are past the window");
        s.forget(5001);
        assert_eq!(s.observe(5001, 7 * MIN, 6000), Occurrence::New { suffix: 6000 });
    }
}
