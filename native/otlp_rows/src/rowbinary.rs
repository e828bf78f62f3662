//! A writer of ClickHouse RowBinary values (https://clickhouse.com/docs/interfaces/formats/RowBinary).

pub struct Writer {
    buf: Vec<u8>,
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl Writer {
    pub fn with_capacity(capacity: usize) -> Self {
        Writer { buf: Vec::with_capacity(capacity) }
    }

    pub fn into_inner(self) -> Vec<u8> {
        self.buf
    }

    /// A length as an unsigned LEB128 varint (strings, arrays and maps start with one).
    pub fn len(&mut self, mut n: usize) {
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                self.buf.push(byte);
                return;
            }
            self.buf.push(byte | 0x80);
        }
    }

    pub fn str(&mut self, s: &str) {
        self.len(s.len());
        self.buf.extend_from_slice(s.as_bytes());
    }

    /// Bytes as a lowercase hex String (trace and span ids, as the Collector stores them).
    pub fn hex(&mut self, bytes: &[u8]) {
        self.len(bytes.len() * 2);
        for b in bytes {
            self.buf.push(HEX[(b >> 4) as usize]);
            self.buf.push(HEX[(b & 0x0f) as usize]);
        }
    }

    pub fn i64(&mut self, v: i64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn nullable_u64(&mut self, v: Option<u64>) {
        match v {
            Some(x) => {
                self.buf.push(0);
                self.u64(x);
            }
            None => self.buf.push(1),
        }
    }

    pub fn nullable_f64(&mut self, v: Option<f64>) {
        match v {
            Some(x) => {
                self.buf.push(0);
                self.buf.extend_from_slice(&x.to_le_bytes());
            }
            None => self.buf.push(1),
        }
    }

    pub fn u32s(&mut self, values: &[u32]) {
        self.len(values.len());
        for v in values {
            self.u32(*v);
        }
    }

    pub fn f32s(&mut self, values: &[f32]) {
        self.len(values.len());
        for v in values {
            self.buf.extend_from_slice(&v.to_le_bytes());
        }
    }

    pub fn map<'a>(&mut self, pairs: impl Iterator<Item = (&'a str, &'a str)>, count: usize) {
        self.len(count);
        for (k, v) in pairs {
            self.str(k);
            self.str(v);
        }
    }
}
