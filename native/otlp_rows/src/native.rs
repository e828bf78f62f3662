//! A writer of one ClickHouse Native block (https://clickhouse.com/docs/interfaces/formats/Native).
//!
//! Native is columnar: the block is `varuint columns, varuint rows`, then per column its name, its type and its
//! values, all rows of one column together. The server copies such columns nearly as they are, where RowBinary
//! makes it parse every row value by value (measured on the spans table: 2.5-7 us a span against 10-19).
//!
//! Each column keeps its own streams, filled span by span: array `offsets` (cumulative UInt64), the offsets of
//! maps inside an array (`inner_offsets`), the `nulls` map of a Nullable, map `keys`, and `data` (values, or map
//! values). Joined in that order they are the column's Native serialisation for every type used here: scalars
//! (data), Nullable(T) (nulls, data), Array(T) (offsets, data), Map(String, String) (offsets, keys, values) and
//! Array(Map(String, String)) (offsets, inner offsets, keys, values). Strings are `varuint length, bytes`.
//! Types are declared plain (String, not LowCardinality(String)): the server converts them on insert
//! (`input_format_native_allow_types_conversion`, on by default).

const HEX: &[u8; 16] = b"0123456789abcdef";

#[derive(Default)]
pub struct Column {
    offsets: Vec<u8>,
    total: u64,
    inner_offsets: Vec<u8>,
    inner_total: u64,
    nulls: Vec<u8>,
    keys: Vec<u8>,
    data: Vec<u8>,
}

pub(crate) fn varuint(buf: &mut Vec<u8>, mut n: usize) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            buf.push(byte);
            return;
        }
        buf.push(byte | 0x80);
    }
}

fn string(buf: &mut Vec<u8>, s: &[u8]) {
    varuint(buf, s.len());
    buf.extend_from_slice(s);
}

impl Column {
    pub fn str(&mut self, s: &str) {
        string(&mut self.data, s.as_bytes());
    }

    /// Bytes as a lowercase hex String (trace and span ids, as the Collector stores them).
    pub fn hex(&mut self, bytes: &[u8]) {
        varuint(&mut self.data, bytes.len() * 2);
        for b in bytes {
            self.data.push(HEX[(b >> 4) as usize]);
            self.data.push(HEX[(b & 0x0f) as usize]);
        }
    }

    pub fn i64(&mut self, v: i64) {
        self.data.extend_from_slice(&v.to_le_bytes());
    }

    pub fn u64(&mut self, v: u64) {
        self.data.extend_from_slice(&v.to_le_bytes());
    }

    pub fn u32(&mut self, v: u32) {
        self.data.extend_from_slice(&v.to_le_bytes());
    }

    pub fn nullable_u64(&mut self, v: Option<u64>) {
        self.nulls.push(v.is_none() as u8);
        self.u64(v.unwrap_or(0));
    }

    pub fn nullable_f64(&mut self, v: Option<f64>) {
        self.nulls.push(v.is_none() as u8);
        self.data.extend_from_slice(&v.unwrap_or(0.0).to_le_bytes());
    }

    /// Starts an array of `n` elements; its elements follow with the scalar writers (or `inner_map`).
    pub fn array(&mut self, n: usize) {
        self.total += n as u64;
        self.offsets.extend_from_slice(&self.total.to_le_bytes());
    }

    pub fn u32s(&mut self, values: &[u32]) {
        self.array(values.len());
        for v in values {
            self.u32(*v);
        }
    }

    pub fn f32s(&mut self, values: &[f32]) {
        self.array(values.len());
        for v in values {
            self.data.extend_from_slice(&v.to_le_bytes());
        }
    }

    /// One Map(String, String) value.
    pub fn map<'a>(&mut self, pairs: impl Iterator<Item = (&'a str, &'a str)>, count: usize) {
        self.array(count);
        self.pairs(pairs);
    }

    /// One map of an Array(Map(String, String)) value (after `array`).
    pub fn inner_map<'a>(&mut self, pairs: impl Iterator<Item = (&'a str, &'a str)>, count: usize) {
        self.inner_total += count as u64;
        self.inner_offsets.extend_from_slice(&self.inner_total.to_le_bytes());
        self.pairs(pairs);
    }

    fn pairs<'a>(&mut self, pairs: impl Iterator<Item = (&'a str, &'a str)>) {
        for (k, v) in pairs {
            string(&mut self.keys, k.as_bytes());
            string(&mut self.data, v.as_bytes());
        }
    }

    fn len(&self) -> usize {
        self.offsets.len() + self.inner_offsets.len() + self.nulls.len() + self.keys.len() + self.data.len()
    }
}

/// The columns of one block, `(name, Native type)` each, filled row by row through `row`.
pub struct Block {
    spec: &'static [(&'static str, &'static str)],
    columns: Vec<Column>,
    rows: usize,
}

impl Block {
    pub fn new(spec: &'static [(&'static str, &'static str)]) -> Self {
        Block { spec, columns: spec.iter().map(|_| Column::default()).collect(), rows: 0 }
    }

    /// The next row's columns, in the spec's order: take each with `Row::next`, every one exactly once.
    pub fn row(&mut self) -> Row<'_> {
        self.rows += 1;
        Row { columns: self.columns.iter_mut() }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The block's size in Native bytes (what `write_to` fills exactly).
    pub fn size(&self) -> usize {
        let header = varuint_len(self.spec.len()) + varuint_len(self.rows);
        let names: usize = self.spec.iter().map(|(name, kind)| string_len(name.len()) + string_len(kind.len())).sum();
        header + names + self.columns.iter().map(Column::len).sum::<usize>()
    }

    /// Writes the block into `out`, which is exactly `size()` bytes (the Python bytes object it is returned in).
    pub fn write_to(&self, out: &mut [u8]) {
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            out[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        let mut head = Vec::with_capacity(16);
        varuint(&mut head, self.spec.len());
        varuint(&mut head, self.rows);
        put(&head);
        for ((name, kind), c) in self.spec.iter().zip(&self.columns) {
            head.clear();
            string(&mut head, name.as_bytes());
            string(&mut head, kind.as_bytes());
            put(&head);
            for part in [&c.offsets, &c.inner_offsets, &c.nulls, &c.keys, &c.data] {
                put(part);
            }
        }
        assert_eq!(at, out.len(), "the block's size and its bytes disagree");
    }

    /// Empties the block for the next batch, keeping its columns' memory (no fresh pages to fault in).
    pub fn clear(&mut self) {
        for c in &mut self.columns {
            for part in [&mut c.offsets, &mut c.inner_offsets, &mut c.nulls, &mut c.keys, &mut c.data] {
                part.clear();
            }
            c.total = 0;
            c.inner_total = 0;
        }
        self.rows = 0;
    }
}

pub(crate) fn varuint_len(mut n: usize) -> usize {
    let mut len = 1;
    while n >= 0x80 {
        n >>= 7;
        len += 1;
    }
    len
}

fn string_len(n: usize) -> usize {
    varuint_len(n) + n
}

pub struct Row<'a> {
    columns: std::slice::IterMut<'a, Column>,
}

impl<'a> Row<'a> {
    /// The row's next column (panics past the last one: a writer that takes more columns than the spec is a bug).
    pub fn next(&mut self) -> &mut Column {
        self.columns.next().expect("a row writes every column of the block exactly once")
    }
}

impl Drop for Row<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            assert!(self.columns.len() == 0, "a row left columns unwritten");
        }
    }
}
