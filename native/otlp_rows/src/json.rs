//! Attribute values as Python writes them: `repr(float)` and compact `json.dumps` (ASCII-only), so that the
//! native and the pure-Python flattening store the same text.

use crate::proto::{any_value::Value, AnyValue};

/// Python's `repr(x)` of a float: shortest round-trip digits, scientific below 1e-4 and from 1e16.
pub fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    let sci = format!("{:e}", x); // shortest digits, e.g. "-1.2345e17"
    let (mantissa, exp) = sci.split_once('e').unwrap();
    let exp: i32 = exp.parse().unwrap();
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.push_str(&"0".repeat(int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.push_str(&"0".repeat((-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        out.push_str(&format!("{:02}", exp.abs()));
    }
    out
}

fn json_float(out: &mut String, x: f64) {
    if x.is_nan() {
        out.push_str("NaN");
    } else if x.is_infinite() {
        out.push_str(if x > 0.0 { "Infinity" } else { "-Infinity" });
    } else {
        out.push_str(&py_float_repr(x));
    }
}

fn json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{:04x}", unit));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = (chunk[0] as u32) << 16 | (*chunk.get(1).unwrap_or(&0) as u32) << 8 | *chunk.get(2).unwrap_or(&0) as u32;
        out.push(B64[(n >> 18) as usize & 63] as char);
        out.push(B64[(n >> 12) as usize & 63] as char);
        out.push(if chunk.len() > 1 { B64[(n >> 6) as usize & 63] as char } else { '=' });
        out.push(if chunk.len() > 2 { B64[n as usize & 63] as char } else { '=' });
    }
    out
}

/// `json.dumps(any_value(v), separators=(",", ":"))` of one value.
pub fn write_any(out: &mut String, value: &AnyValue) {
    match value.value.as_ref() {
        None => out.push_str("null"),
        Some(Value::StringValue(s)) => json_str(out, s),
        Some(Value::BoolValue(b)) => out.push_str(if *b { "true" } else { "false" }),
        Some(Value::IntValue(i)) => out.push_str(&i.to_string()),
        Some(Value::DoubleValue(d)) => json_float(out, *d),
        Some(Value::StringValueStrindex(i)) => out.push_str(&i.to_string()),
        Some(Value::BytesValue(b)) => json_str(out, &base64(b)),
        Some(Value::ArrayValue(a)) => {
            out.push('[');
            for (i, v) in a.values.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_any(out, v);
            }
            out.push(']');
        }
        Some(Value::KvlistValue(kv)) => {
            // A Python dict keeps a repeated key at its first position with its last value.
            let mut entries: Vec<(&str, &AnyValue)> = Vec::new();
            let empty = AnyValue { value: None };
            for pair in &kv.values {
                let v = pair.value.as_ref().unwrap_or(&empty);
                match entries.iter_mut().find(|(k, _)| *k == pair.key) {
                    Some(entry) => entry.1 = v,
                    None => entries.push((pair.key.as_str(), v)),
                }
            }
            out.push('{');
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                json_str(out, k);
                out.push(':');
                write_any(out, v);
            }
            out.push('}');
        }
    }
}
