//! The narrow records of stamped spans, for the transitions consumer's span feed (`consumers/transitions/feed.py`).
//!
//! Beside the Native block of every span, `Flattener.flatten_records` gives one Python tuple per span of a rollout
//! the caller wants (its `RolloutId` in the set given: the rollouts the consumer saw claimed) holding only what the
//! transitions builder reads, and the (rollout id, attempt) of the other stamped spans: the same values the
//! store would answer for `consumers/transitions/reader.py`'s query, so the consumer builds a finished rollout
//! from what it consumed instead of reading it back. Token ids and logprobs travel as little-endian bytes (u32,
//! f32): four bytes a token while a rollout waits for its end, not a Python int each.

use std::collections::HashSet;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::proto::KeyValue;

/// What a record holds besides the typed columns: the span attributes and the event attributes to copy (their
/// text, '' when absent), in the order the caller named them.
pub struct RecordKeys {
    pub attributes: Vec<String>,
    pub event_attributes: Vec<String>,
}

pub struct Record {
    pub rollout: String,
    pub attempt: u32,
    pub trace: String,
    pub span: String,
    pub parent: String,
    pub name: String,
    pub start: i64,
    pub duration: u64,
    pub agent: String,
    pub model_version: Option<u64>,
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub reward: Option<f64>,
    pub attributes: Vec<String>,
    pub event_times: Vec<i64>,
    /// Per event attribute key (`RecordKeys::event_attributes`), its text in each event.
    pub event_values: Vec<Vec<String>>,
    pub link_traces: Vec<String>,
    pub link_spans: Vec<String>,
}

/// What `flatten_records` gathers: the records of the spans of the `wanted` rollouts, and the (rollout id,
/// attempt) of the other stamped spans.
pub struct Collected {
    /// None: every stamped span is wanted.
    pub wanted: Option<HashSet<String>>,
    pub records: Vec<Record>,
    pub skipped: HashSet<(String, u32)>,
}

impl Collected {
    pub fn new(wanted: Option<HashSet<String>>) -> Self {
        Collected { wanted, records: Vec::new(), skipped: HashSet::new() }
    }

    pub fn wants(&self, rollout: &str) -> bool {
        self.wanted.as_ref().is_none_or(|wanted| wanted.contains(rollout))
    }

    pub fn add(&mut self, record: Result<Record, (String, u32)>) {
        match record {
            Ok(record) => self.records.push(record),
            Err(key) => {
                self.skipped.insert(key);
            }
        }
    }
}

/// The first value of `key` among `pairs` ('' when absent), as a Map lookup in the store answers it.
pub fn first<'a>(pairs: impl Iterator<Item = (&'a str, &'a str)>, key: &str) -> String {
    pairs.into_iter().find(|(k, _)| *k == key).map(|(_, v)| v.to_string()).unwrap_or_default()
}

/// The text of `key` in each event's attributes.
pub fn event_values(events: &[crate::proto::Event], keys: &[String], text: impl Fn(&KeyValue) -> String) -> Vec<Vec<String>> {
    keys.iter()
        .map(|key| {
            events
                .iter()
                .map(|e| e.attributes.iter().find(|kv| kv.key == *key).map(&text).unwrap_or_default())
                .collect()
        })
        .collect()
}

pub fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(HEX[(b >> 4) as usize] as char);
        out.push(HEX[(b & 0x0f) as usize] as char);
    }
    out
}

fn le_bytes<'py, T: Copy>(py: Python<'py>, values: &[T], to_le: impl Fn(T) -> [u8; 4]) -> Bound<'py, PyBytes> {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&to_le(*v));
    }
    PyBytes::new(py, &out)
}

impl Record {
    /// `(rollout id, attempt, trace id, span id, parent span id, name, start ns, duration ns, agent name, model
    /// version|None, prompt ids (u32 LE bytes), response ids (u32 LE), logprobs (f32 LE), reward|None,
    /// [attribute texts], [event start ns], [[event attribute texts] per key], [link trace ids], [link span ids])`
    pub fn into_py<'py>(self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let items: Vec<Bound<'py, PyAny>> = vec![
            self.rollout.into_pyobject(py)?.into_any(),
            self.attempt.into_pyobject(py)?.into_any(),
            self.trace.into_pyobject(py)?.into_any(),
            self.span.into_pyobject(py)?.into_any(),
            self.parent.into_pyobject(py)?.into_any(),
            self.name.into_pyobject(py)?.into_any(),
            self.start.into_pyobject(py)?.into_any(),
            self.duration.into_pyobject(py)?.into_any(),
            self.agent.into_pyobject(py)?.into_any(),
            self.model_version.into_pyobject(py)?.into_any(),
            le_bytes(py, &self.prompt, u32::to_le_bytes).into_any(),
            le_bytes(py, &self.response, u32::to_le_bytes).into_any(),
            le_bytes(py, &self.logprobs, f32::to_le_bytes).into_any(),
            self.reward.into_pyobject(py)?.into_any(),
            self.attributes.into_pyobject(py)?.into_any(),
            self.event_times.into_pyobject(py)?.into_any(),
            self.event_values.into_pyobject(py)?.into_any(),
            self.link_traces.into_pyobject(py)?.into_any(),
            self.link_spans.into_pyobject(py)?.into_any(),
        ];
        PyTuple::new(py, items)
    }
}
