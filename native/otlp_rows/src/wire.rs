//! The OTLP gateway's split of an `ExportTraceServiceRequest` into one request per trace, done on the protobuf
//! wire bytes: each span, resource and scope is copied as the bytes it came as, never decoded into objects.
//!
//! It is the fast twin of `split_by_trace` and `validate` in `producers/otlp_gateway/otlp.py`, which stay the
//! reference (the tests check both give the same records). It decides nothing about the body's validity: the
//! caller has already parsed it with the same parser as before, and anything this walk does not expect (a group,
//! a known field with another wire type, a span near the size limit, where a re-encoded size could differ from
//! the bytes) makes it answer `None`, and the caller takes the reference path.
//!
//! Wire layout used (field numbers from opentelemetry-proto): ExportTraceServiceRequest { 1: ResourceSpans },
//! ResourceSpans { 1: Resource, 2: ScopeSpans, 3: schema_url }, ScopeSpans { 1: InstrumentationScope, 2: Span,
//! 3: schema_url }, Span { 1: trace_id, 2: span_id, ... }.

use std::collections::HashMap;

use crate::native::{varuint, varuint_len};

/// How far below the span limit a span's bytes must be for this walk to judge its size. The reference compares the
/// span's re-encoded size, which can exceed its bytes only by a few bytes (a negative enum written in 5 bytes is
/// re-encoded in 10); within this margin of the limit the reference path decides.
const SIZE_MARGIN: usize = 64;

const BAD_TRACE_ID: &str = "trace_id must be 16 bytes and not all zero";
const BAD_SPAN_ID: &str = "span_id must be 8 bytes and not all zero";

pub struct Split {
    pub accepted: usize,
    pub rejected: usize,
    pub reasons: Vec<String>,
    /// (trace id in hex, one ExportTraceServiceRequest holding only that trace's spans)
    pub records: Vec<(Vec<u8>, Vec<u8>)>,
    /// The body is one trace with nothing rejected: it is the one record, as it came (its value here is empty).
    pub whole: bool,
}

enum Value<'a> {
    Number,
    Bytes(&'a [u8]),
}

struct Fields<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Fields<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Fields { buf, pos: 0 }
    }

    fn varint(&mut self) -> Option<u64> {
        let mut value: u64 = 0;
        for shift in (0..70).step_by(7) {
            let byte = *self.buf.get(self.pos)?;
            self.pos += 1;
            value |= u64::from(byte & 0x7f).checked_shl(shift).unwrap_or(0);
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }

    fn skip(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|end| *end <= self.buf.len())?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Some(out)
    }

    /// The next field, `Some(None)` at the end, `None` for anything this walk does not handle (groups, bad bytes).
    fn next(&mut self) -> Option<Option<(u64, Value<'a>)>> {
        if self.pos == self.buf.len() {
            return Some(None);
        }
        let tag = self.varint()?;
        let value = match tag & 7 {
            0 => {
                self.varint()?;
                Value::Number
            }
            1 => {
                self.skip(8)?;
                Value::Number
            }
            2 => {
                let n = usize::try_from(self.varint()?).ok()?;
                Value::Bytes(self.skip(n)?)
            }
            5 => {
                self.skip(4)?;
                Value::Number
            }
            _ => return None,
        };
        Some(Some((tag >> 3, value)))
    }
}

/// Every occurrence of the length-delimited fields `wanted` names, in order, as (field number, bytes); `None` when
/// one of them comes with another wire type.
fn messages<'a>(buf: &'a [u8], wanted: &[u64]) -> Option<Vec<(u64, &'a [u8])>> {
    let mut found = Vec::new();
    let mut fields = Fields::new(buf);
    while let Some((number, value)) = fields.next()? {
        if wanted.contains(&number) {
            match value {
                Value::Bytes(bytes) => found.push((number, bytes)),
                Value::Number => return None,
            }
        }
    }
    Some(found)
}

/// A message field that was absent is written empty, as the reference's copy of it sets it (same bytes).
const EMPTY: &[&[u8]] = &[b""];

fn present<'s, 'a>(parts: &'s [&'a [u8]]) -> &'s [&'a [u8]] {
    if parts.is_empty() {
        EMPTY
    } else {
        parts
    }
}

struct Resource<'a> {
    parts: Vec<&'a [u8]>,      // field 1, every occurrence (they merge when read)
    schema_urls: Vec<&'a [u8]>, // field 3
}

struct Scope<'a> {
    resource: usize,
    parts: Vec<&'a [u8]>,
    schema_urls: Vec<&'a [u8]>,
}

/// Spans of one trace under one scope, in the order they came.
struct Group<'a> {
    scope: usize,
    spans: Vec<&'a [u8]>,
}

/// A length-delimited field's size on the wire: tag (one byte for fields 1-15), length, payload.
fn field_len(payload: usize) -> usize {
    1 + varuint_len(payload) + payload
}

fn put_field(out: &mut Vec<u8>, number: u8, payload: &[u8]) {
    out.push(number << 3 | 2);
    varuint(out, payload.len());
    out.extend_from_slice(payload);
}

struct Builder<'b, 'a> {
    resources: &'b [Resource<'a>],
    scopes: &'b [Scope<'a>],
}

impl Builder<'_, '_> {
    fn scope_spans_len(&self, group: &Group) -> usize {
        let scope = &self.scopes[group.scope];
        let parts: usize = present(&scope.parts).iter().chain(&scope.schema_urls).chain(&group.spans).map(|p| field_len(p.len())).sum();
        parts
    }

    fn resource_spans_len(&self, group: &Group) -> usize {
        let resource = &self.resources[self.scopes[group.scope].resource];
        let parts: usize = present(&resource.parts).iter().chain(&resource.schema_urls).map(|p| field_len(p.len())).sum();
        parts + field_len(self.scope_spans_len(group))
    }

    fn record_len(&self, groups: &[Group]) -> usize {
        groups.iter().map(|g| field_len(self.resource_spans_len(g))).sum()
    }

    fn write(&self, groups: &[Group]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.record_len(groups));
        for group in groups {
            let scope = &self.scopes[group.scope];
            let resource = &self.resources[scope.resource];
            out.push(1 << 3 | 2);
            varuint(&mut out, self.resource_spans_len(group));
            for part in present(&resource.parts) {
                put_field(&mut out, 1, part);
            }
            out.push(2 << 3 | 2);
            varuint(&mut out, self.scope_spans_len(group));
            for part in present(&scope.parts) {
                put_field(&mut out, 1, part);
            }
            for span in &group.spans {
                put_field(&mut out, 2, span);
            }
            for url in &scope.schema_urls {
                put_field(&mut out, 3, url);
            }
            for url in &resource.schema_urls {
                put_field(&mut out, 3, url);
            }
        }
        out
    }

    /// One record of `groups`, or, when it is larger than `max_record_bytes` and holds more than one span, the
    /// records of its two halves by spans (each span fits: larger ones were rejected). As in the reference, a
    /// half holds each span under its own ResourceSpans, so both give the same bytes.
    fn records(&self, groups: Vec<Group>, max_record_bytes: usize, out: &mut Vec<Vec<u8>>) {
        let spans: usize = groups.iter().map(|g| g.spans.len()).sum();
        if spans <= 1 || self.record_len(&groups) <= max_record_bytes {
            out.push(self.write(&groups));
            return;
        }
        let mut flat: Vec<Group> =
            groups.iter().flat_map(|g| g.spans.iter().map(move |s| Group { scope: g.scope, spans: vec![*s] })).collect();
        let second = flat.split_off(flat.len() / 2);
        self.records(flat, max_record_bytes, out);
        self.records(second, max_record_bytes, out);
    }
}

/// A span's trace and span ids (the last occurrence of each, as a parser keeps), `None` if either comes with
/// another wire type.
fn ids(span: &[u8]) -> Option<(&[u8], &[u8])> {
    let (mut trace_id, mut span_id): (&[u8], &[u8]) = (&[], &[]);
    for (number, bytes) in messages(span, &[1, 2])? {
        if number == 1 {
            trace_id = bytes;
        } else {
            span_id = bytes;
        }
    }
    Some((trace_id, span_id))
}

fn hex(bytes: &[u8]) -> Vec<u8> {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    bytes.iter().flat_map(|b| [DIGITS[usize::from(b >> 4)], DIGITS[usize::from(b & 15)]]).collect()
}

/// The body's spans checked and cut into one record per trace (see the module docs); `None`: take the reference.
pub fn split(body: &[u8], max_span_bytes: usize, max_record_bytes: usize) -> Option<Split> {
    let size_limit = max_span_bytes.checked_sub(SIZE_MARGIN)?;
    let mut resources: Vec<Resource> = Vec::new();
    let mut scopes: Vec<Scope> = Vec::new();
    let mut traces: Vec<(&[u8], Vec<Group>)> = Vec::new();
    let mut by_id: HashMap<&[u8], usize> = HashMap::new();
    let mut split = Split { accepted: 0, rejected: 0, reasons: Vec::new(), records: Vec::new(), whole: false };

    for (_, resource_spans) in messages(body, &[1])? {
        let resource = resources.len();
        let mut parts = Resource { parts: Vec::new(), schema_urls: Vec::new() };
        for (number, bytes) in messages(resource_spans, &[1, 2, 3])? {
            match number {
                1 => parts.parts.push(bytes),
                3 => parts.schema_urls.push(bytes),
                _ => {
                    let scope = scopes.len();
                    let mut scope_parts = Scope { resource, parts: Vec::new(), schema_urls: Vec::new() };
                    for (number, bytes) in messages(bytes, &[1, 2, 3])? {
                        match number {
                            1 => scope_parts.parts.push(bytes),
                            3 => scope_parts.schema_urls.push(bytes),
                            _ => {
                                let (trace_id, span_id) = ids(bytes)?;
                                let reason = if trace_id.len() != 16 || trace_id.iter().all(|b| *b == 0) {
                                    BAD_TRACE_ID
                                } else if span_id.len() != 8 || span_id.iter().all(|b| *b == 0) {
                                    BAD_SPAN_ID
                                } else if bytes.len() > size_limit {
                                    return None; // near or past the limit: the reference measures it
                                } else {
                                    ""
                                };
                                if !reason.is_empty() {
                                    split.rejected += 1;
                                    if !split.reasons.iter().any(|r| r == reason) {
                                        split.reasons.push(reason.to_string());
                                    }
                                    continue;
                                }
                                split.accepted += 1;
                                let index = *by_id.entry(trace_id).or_insert_with(|| {
                                    traces.push((trace_id, Vec::new()));
                                    traces.len() - 1
                                });
                                let groups = &mut traces[index].1;
                                match groups.last_mut() {
                                    Some(group) if group.scope == scope => group.spans.push(bytes),
                                    _ => groups.push(Group { scope, spans: vec![bytes] }),
                                }
                            }
                        }
                    }
                    scopes.push(scope_parts);
                }
            }
        }
        resources.push(parts);
    }

    if traces.len() == 1 && split.rejected == 0 && body.len() <= max_record_bytes {
        split.whole = true; // one trace, nothing dropped: the body is the record
        split.records.push((hex(traces[0].0), Vec::new()));
        return Some(split);
    }
    let builder = Builder { resources: &resources, scopes: &scopes };
    for (trace_id, groups) in traces {
        let key = hex(trace_id);
        let mut values = Vec::new();
        builder.records(groups, max_record_bytes, &mut values);
        split.records.extend(values.into_iter().map(|value| (key.clone(), value)));
    }
    Some(split)
}
