//! Native span flattening for Fulmen's spans consumer.
//!
//! Decodes OTLP `ExportTraceServiceRequest` protobuf (the records of the spans topic) and writes the rows of
//! the `otel_traces` table as one ClickHouse Native block (columnar; `COLUMNS` names them and their types). It is the
//! fast twin of `consumers/otlp_rows.py::SpanColumns`, which stays the reference: the tests check that both
//! produce the same rows. The attribute keys with a meaning (rollout id, token ids, ...) come from Python's
//! `schemas.semconv` when the `Flattener` is built, so no key is spelled here.

use prost::Message;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use std::collections::HashSet;
use std::sync::Mutex;

mod json;
mod native;
mod proto;
mod records;
mod wire;

use proto::{any_value::Value, AnyValue, ExportTraceServiceRequest, KeyValue, Span};
use native::{Block, Row};
use records::{Collected, Record, RecordKeys};

/// The block's columns, in `otel_traces` (and `SPAN_SCHEMA`) order, with the Native types written for them.
const COLUMNS: &[(&str, &str)] = &[
    ("Timestamp", "DateTime64(9, 'UTC')"),
    ("TraceId", "String"),
    ("SpanId", "String"),
    ("ParentSpanId", "String"),
    ("TraceState", "String"),
    ("SpanName", "String"),
    ("SpanKind", "String"),
    ("ServiceName", "String"),
    ("ResourceAttributes", "Map(String, String)"),
    ("ScopeName", "String"),
    ("ScopeVersion", "String"),
    ("SpanAttributes", "Map(String, String)"),
    ("Duration", "UInt64"),
    ("StatusCode", "String"),
    ("StatusMessage", "String"),
    ("Events.Timestamp", "Array(DateTime64(9, 'UTC'))"),
    ("Events.Name", "Array(String)"),
    ("Events.Attributes", "Array(Map(String, String))"),
    ("Links.TraceId", "Array(String)"),
    ("Links.SpanId", "Array(String)"),
    ("Links.TraceState", "Array(String)"),
    ("Links.Attributes", "Array(Map(String, String))"),
    ("RolloutId", "String"),
    ("Attempt", "UInt32"),
    ("AgentName", "String"),
    ("ModelVersion", "Nullable(UInt64)"),
    ("PromptTokenIds", "Array(UInt32)"),
    ("ResponseTokenIds", "Array(UInt32)"),
    ("ResponseLogprobs", "Array(Float32)"),
    ("Reward", "Nullable(Float64)"),
];

const KINDS: [&str; 6] = ["Unspecified", "Internal", "Server", "Client", "Producer", "Consumer"];
const STATUS: [&str; 3] = ["Unset", "Ok", "Error"];

/// The attribute keys the flattening gives a meaning to (from `schemas.semconv`).
#[pyclass(frozen)]
struct Flattener {
    service_name: String,
    rollout_id: String,
    attempt: String,
    model_version: String,
    prompt_ids: String,
    response_ids: String,
    logprobs: String,
    invalid: String,
    agent_keys: Vec<String>,
    reward_keys: Vec<String>,
    /// What `flatten_records` copies into each record besides the typed columns.
    record_keys: RecordKeys,
    /// The last batch's block, emptied: its columns keep their memory for the next batch.
    spare: Mutex<Option<Block>>,
}

#[pymethods]
impl Flattener {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (service_name, rollout_id, attempt, model_version, prompt_ids, response_ids, logprobs, invalid, agent_keys, reward_keys, record_attributes=Vec::new(), record_event_attributes=Vec::new()))]
    fn new(
        service_name: String,
        rollout_id: String,
        attempt: String,
        model_version: String,
        prompt_ids: String,
        response_ids: String,
        logprobs: String,
        invalid: String,
        agent_keys: Vec<String>,
        reward_keys: Vec<String>,
        record_attributes: Vec<String>,
        record_event_attributes: Vec<String>,
    ) -> Self {
        let record_keys = RecordKeys { attributes: record_attributes, event_attributes: record_event_attributes };
        Flattener { service_name, rollout_id, attempt, model_version, prompt_ids, response_ids, logprobs, invalid, agent_keys, reward_keys, record_keys, spare: Mutex::new(None) }
    }

    /// The names of the block's columns, in order.
    #[staticmethod]
    fn columns() -> Vec<&'static str> {
        COLUMNS.iter().map(|(name, _)| *name).collect()
    }

    /// One Native block of every span of every request, and how many rows it holds. The records are read where
    /// they are (not copied) and the block is written straight into the bytes object returned.
    fn flatten<'py>(&self, py: Python<'py>, requests: Vec<Bound<'py, PyBytes>>) -> PyResult<(Bound<'py, PyBytes>, usize)> {
        let (block, _) = self.decode_all(py, &requests, None)?;
        self.finish(py, block)
    }

    /// `flatten`, the record (see `records.rs`) of every span of a rollout in `wanted` (rollout ids; None: every
    /// stamped span), in the order they came, and the (rollout id, attempt) of the other stamped spans, once each.
    #[allow(clippy::type_complexity)]
    fn flatten_records<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<Bound<'py, PyBytes>>,
        wanted: Option<HashSet<String>>,
    ) -> PyResult<(Bound<'py, PyBytes>, usize, Bound<'py, PyList>, Vec<(String, u32)>)> {
        let (block, collected) = self.decode_all(py, &requests, Some(Collected::new(wanted)))?;
        let (data, rows) = self.finish(py, block)?;
        let collected = collected.unwrap_or_else(|| Collected::new(None));
        let tuples = collected.records.into_iter().map(|r| r.into_py(py)).collect::<PyResult<Vec<_>>>()?;
        Ok((data, rows, PyList::new(py, tuples)?, collected.skipped.into_iter().collect()))
    }
}

impl Flattener {
    /// Every request's spans into one block (the last batch's, emptied, when there is one), and their records
    /// into `collected` when given; a request that is not valid protobuf fails the whole call.
    fn decode_all(
        &self,
        py: Python<'_>,
        requests: &[Bound<'_, PyBytes>],
        mut collected: Option<Collected>,
    ) -> PyResult<(Block, Option<Collected>)> {
        let data: Vec<&[u8]> = requests.iter().map(|r| r.as_bytes()).collect();
        let spare = self.spare.lock().ok().and_then(|mut spare| spare.take());
        py.detach(|| {
            let mut block = spare.unwrap_or_else(|| Block::new(COLUMNS));
            for bytes in &data {
                match ExportTraceServiceRequest::decode(*bytes) {
                    Ok(request) => self.write_request(&mut block, &request, collected.as_mut()),
                    Err(e) => return Err(e.to_string()),
                }
            }
            Ok((block, collected))
        })
        .map_err(PyValueError::new_err)
    }

    /// The block as the bytes returned, and its row count; the block is kept, emptied, for the next call.
    fn finish<'py>(&self, py: Python<'py>, block: Block) -> PyResult<(Bound<'py, PyBytes>, usize)> {
        let rows = block.rows();
        let out = PyBytes::new_with(py, block.size(), |buf| {
            block.write_to(buf);
            Ok(())
        })?;
        let mut block = block;
        block.clear();
        if let Ok(mut spare) = self.spare.lock() {
            *spare = Some(block);
        }
        Ok((out, rows))
    }
}

struct Typed<'a> {
    texts: Vec<(&'a str, String)>,
    prompt: Option<Vec<u32>>,
    response: Option<Vec<u32>>,
    logprobs: Option<Vec<f32>>,
}

impl<'a> Typed<'a> {
    fn get(&self, key: &str) -> Option<&str> {
        self.texts.iter().rev().find(|(k, _)| *k == key).map(|(_, v)| v.as_str())
    }
}

impl Flattener {
    fn write_request(&self, block: &mut Block, request: &ExportTraceServiceRequest, mut collected: Option<&mut Collected>) {
        for resource_spans in &request.resource_spans {
            let empty = Vec::new();
            let resource_kvs = resource_spans.resource.as_ref().map(|r| &r.attributes).unwrap_or(&empty);
            let resource: Vec<(&str, String)> = resource_kvs.iter().map(|kv| (kv.key.as_str(), text(kv.value.as_ref()))).collect();
            let last = |key: &str| resource.iter().rev().find(|(k, _)| *k == key).map(|(_, v)| v.as_str());
            let service = last(&self.service_name).unwrap_or("");
            for scope_spans in &resource_spans.scope_spans {
                let (scope_name, scope_version) = scope_spans.scope.as_ref().map(|s| (s.name.as_str(), s.version.as_str())).unwrap_or(("", ""));
                for span in &scope_spans.spans {
                    let record = self.write_span(&mut block.row(), span, &resource, service, scope_name, scope_version, &last, collected.as_deref());
                    if let (Some(collected), Some(record)) = (collected.as_deref_mut(), record) {
                        collected.add(record);
                    }
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn write_span<'a>(
        &self,
        w: &mut Row,
        span: &'a Span,
        resource: &[(&str, String)],
        service: &str,
        scope_name: &str,
        scope_version: &str,
        resource_get: &dyn Fn(&str) -> Option<&'a str>,
        collected: Option<&Collected>,
    ) -> Option<Result<Record, (String, u32)>> {
        let mut attrs: Vec<(&str, String)> = Vec::with_capacity(span.attributes.len() + 1);
        let mut typed = Typed { texts: Vec::with_capacity(span.attributes.len()), prompt: None, response: None, logprobs: None };
        for kv in &span.attributes {
            let key = kv.key.as_str();
            let scalar = matches!(kv.value.as_ref().and_then(|v| v.value.as_ref()), Some(Value::StringValue(_) | Value::IntValue(_) | Value::DoubleValue(_) | Value::BoolValue(_)));
            if !scalar && (key == self.prompt_ids || key == self.response_ids || key == self.logprobs) {
                let value = kv.value.as_ref();
                if key == self.logprobs {
                    if let Some(v) = floats(value) {
                        typed.logprobs = Some(v);
                        continue;
                    }
                } else if let Some(v) = token_ids(value) {
                    if key == self.prompt_ids { typed.prompt = Some(v) } else { typed.response = Some(v) }
                    continue;
                }
                attrs.push((self.invalid.as_str(), format!("{key} is not an array of token ids or logprobs")));
            }
            let t = text(kv.value.as_ref());
            attrs.push((key, t.clone()));
            typed.texts.push((key, t));
        }
        let (start, end) = (span.start_time_unix_nano, span.end_time_unix_nano);
        w.next().i64(start as i64);
        w.next().hex(&span.trace_id);
        w.next().hex(&span.span_id);
        w.next().hex(&span.parent_span_id);
        w.next().str(&span.trace_state);
        w.next().str(&span.name);
        w.next().str(&enum_name(&KINDS, span.kind));
        w.next().str(service);
        w.next().map(resource.iter().map(|(k, v)| (*k, v.as_str())), resource.len());
        w.next().str(scope_name);
        w.next().str(scope_version);
        w.next().map(attrs.iter().map(|(k, v)| (*k, v.as_str())), attrs.len());
        w.next().u64(end.saturating_sub(start));
        let (code, message) = span.status.as_ref().map(|s| (s.code, s.message.as_str())).unwrap_or((0, ""));
        w.next().str(&enum_name(&STATUS, code));
        w.next().str(message);
        write_events_and_links(w, span);
        let columns = self.typed_columns(&typed, resource_get);
        columns.write(w, &typed);
        let collected = collected?;
        if columns.rollout.is_empty() {
            return None;
        }
        if !collected.wants(columns.rollout) {
            return Some(Err((columns.rollout.to_string(), columns.attempt)));
        }
        let (rollout, agent) = (columns.rollout.to_string(), columns.agent.to_string());
        let (attempt, model_version, reward) = (columns.attempt, columns.model_version, columns.reward);
        let keys = &self.record_keys;
        let pairs = || attrs.iter().map(|(key, value)| (*key, value.as_str()));
        Some(Ok(Record {
            rollout,
            attempt,
            trace: records::hex(&span.trace_id),
            span: records::hex(&span.span_id),
            parent: records::hex(&span.parent_span_id),
            name: span.name.clone(),
            start: start as i64,
            duration: end.saturating_sub(start),
            agent,
            model_version,
            prompt: typed.prompt.unwrap_or_default(),
            response: typed.response.unwrap_or_default(),
            logprobs: typed.logprobs.unwrap_or_default(),
            reward,
            attributes: keys.attributes.iter().map(|key| records::first(pairs(), key)).collect(),
            event_times: span.events.iter().map(|e| e.time_unix_nano as i64).collect(),
            event_values: records::event_values(&span.events, &keys.event_attributes, |kv| text(kv.value.as_ref())),
            link_traces: span.links.iter().map(|l| records::hex(&l.trace_id)).collect(),
            link_spans: span.links.iter().map(|l| records::hex(&l.span_id)).collect(),
        }))
    }

    fn typed_columns<'t, 'a: 't>(&self, typed: &'t Typed, resource_get: &dyn Fn(&str) -> Option<&'a str>) -> TypedColumns<'t> {
        let rollout = typed.get(&self.rollout_id).filter(|v| !v.is_empty()).or_else(|| resource_get(&self.rollout_id)).unwrap_or("");
        let attempt = typed.get(&self.attempt).filter(|v| !v.is_empty()).or_else(|| resource_get(&self.attempt));
        TypedColumns {
            rollout,
            attempt: attempt.and_then(|t| whole(t, 4_294_967_296.0)).unwrap_or(0) as u32,
            agent: self.agent_keys.iter().find_map(|k| typed.get(k).filter(|v| !v.is_empty())).unwrap_or(""),
            model_version: typed.get(&self.model_version).and_then(|t| whole(t, 9_223_372_036_854_775_808.0)),
            reward: self.reward_keys.iter().find_map(|k| typed.get(k)).and_then(strict_number),
        }
    }
}

/// The typed columns a span's attributes (or its resource's) give.
struct TypedColumns<'t> {
    rollout: &'t str,
    attempt: u32,
    agent: &'t str,
    model_version: Option<u64>,
    reward: Option<f64>,
}

impl TypedColumns<'_> {
    fn write(&self, w: &mut Row, typed: &Typed) {
        w.next().str(self.rollout);
        w.next().u32(self.attempt);
        w.next().str(self.agent);
        w.next().nullable_u64(self.model_version);
        w.next().u32s(typed.prompt.as_deref().unwrap_or(&[]));
        w.next().u32s(typed.response.as_deref().unwrap_or(&[]));
        w.next().f32s(typed.logprobs.as_deref().unwrap_or(&[]));
        w.next().nullable_f64(self.reward);
    }
}

fn write_events_and_links(w: &mut Row, span: &Span) {
    let (events, links) = (&span.events, &span.links);
    array_column(w, events, |c, e| c.i64(e.time_unix_nano as i64));
    array_column(w, events, |c, e| c.str(&e.name));
    array_column(w, events, |c, e| write_attrs(c, &e.attributes));
    array_column(w, links, |c, l| c.hex(&l.trace_id));
    array_column(w, links, |c, l| c.hex(&l.span_id));
    array_column(w, links, |c, l| c.str(&l.trace_state));
    array_column(w, links, |c, l| write_attrs(c, &l.attributes));
}

/// The row's next column, an array with one element per item, each written by `element`.
fn array_column<T>(w: &mut Row, items: &[T], element: impl Fn(&mut native::Column, &T)) {
    let c = w.next();
    c.array(items.len());
    for item in items {
        element(c, item);
    }
}

/// One map of an Array(Map(String, String)) column (the attributes of an event or a link).
fn write_attrs(c: &mut native::Column, kvs: &[KeyValue]) {
    let texts: Vec<(&str, String)> = kvs.iter().map(|kv| (kv.key.as_str(), text(kv.value.as_ref()))).collect();
    c.inner_map(texts.iter().map(|(k, v)| (*k, v.as_str())), texts.len());
}

fn enum_name(names: &[&str], value: i32) -> String {
    if value >= 0 && (value as usize) < names.len() { names[value as usize].to_string() } else { value.to_string() }
}

/// The attribute text, as the Collector's AsString (and `any_value_text` in Python) writes it.
fn text(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        None => String::new(),
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => json::py_float_repr(*d),
        Some(Value::BoolValue(b)) => if *b { "true".into() } else { "false".into() },
        Some(_) => {
            let mut out = String::new();
            json::write_any(&mut out, value.unwrap());
            out
        }
    }
}

fn token_ids(value: Option<&AnyValue>) -> Option<Vec<u32>> {
    match value?.value.as_ref()? {
        Value::ArrayValue(a) => a
            .values
            .iter()
            .map(|v| match v.value {
                Some(Value::IntValue(i)) if (0..=u32::MAX as i64).contains(&i) => Some(i as u32),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

fn floats(value: Option<&AnyValue>) -> Option<Vec<f32>> {
    match value?.value.as_ref()? {
        Value::ArrayValue(a) => a
            .values
            .iter()
            .map(|v| match v.value {
                Some(Value::DoubleValue(d)) => Some(d as f32),
                Some(Value::IntValue(i)) => Some(i as f32),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

/// A finite decimal number written in ASCII: `[+-]digits[.digits][e[+-]digits]` between ASCII spaces (the
/// same rule as `_number` in consumers/otlp_rows.py), else None.
fn strict_number(text: &str) -> Option<f64> {
    let t = text.trim_matches(|c: char| matches!(c, ' ' | '\t' | '\n' | '\r' | '\x0b' | '\x0c'));
    let b = t.as_bytes();
    let digits = |mut i: usize| {
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        (i, i - start)
    };
    let mut i = if !b.is_empty() && (b[0] == b'+' || b[0] == b'-') { 1 } else { 0 };
    let (after_int, int_digits) = digits(i);
    i = after_int;
    let mut frac_digits = 0;
    if i < b.len() && b[i] == b'.' {
        let (after_frac, n) = digits(i + 1);
        i = after_frac;
        frac_digits = n;
    }
    if int_digits + frac_digits == 0 {
        return None;
    }
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        i += 1;
        if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
            i += 1;
        }
        let (after_exp, n) = digits(i);
        if n == 0 {
            return None;
        }
        i = after_exp;
    }
    if i != b.len() {
        return None;
    }
    let x: f64 = t.parse().ok()?;
    if x.is_finite() { Some(x) } else { None }
}

/// The whole part of a number when it is in [0, `bound`), else None (Python: `int(x) <= bound - 1`).
fn whole(text: &str, bound: f64) -> Option<u64> {
    let x = strict_number(text)?;
    if x >= 0.0 && x.trunc() < bound { Some(x.trunc() as u64) } else { None }
}

/// The OTLP gateway's split of a protobuf `ExportTraceServiceRequest` body (already parsed once by the caller)
/// into records by trace, on the wire bytes (`wire.rs`): `(accepted, rejected, reasons, keys, values)`, or None
/// when the body holds something the reference path (`producers/otlp_gateway/otlp.py`) must decide.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn split_traces<'py>(
    py: Python<'py>,
    body: Bound<'py, PyBytes>,
    max_span_bytes: usize,
    max_record_bytes: usize,
) -> Option<(usize, usize, Vec<String>, Vec<Bound<'py, PyBytes>>, Vec<Bound<'py, PyBytes>>)> {
    let data = body.as_bytes();
    let split = py.detach(|| wire::split(data, max_span_bytes, max_record_bytes))?;
    let keys = split.records.iter().map(|(key, _)| PyBytes::new(py, key)).collect();
    let values = if split.whole {
        vec![body.clone()]
    } else {
        split.records.iter().map(|(_, value)| PyBytes::new(py, value)).collect()
    };
    Some((split.accepted, split.rejected, split.reasons, keys, values))
}

#[pymodule]
fn _otlp_rows(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Flattener>()?;
    m.add_function(wrap_pyfunction!(split_traces, m)?)?;
    Ok(())
}
