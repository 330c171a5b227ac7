//! The few msgpack forms the wire events use, written as msgpack-python's `packb` writes them
//! (`use_bin_type=True`): the shortest form of each int, floats as float64, str8 for short
//! strings.

#[derive(Debug, Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub fn with_capacity(capacity: usize) -> Self {
        Writer {
            buf: Vec::with_capacity(capacity),
        }
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    pub fn raw(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    pub fn nil(&mut self) {
        self.buf.push(0xc0);
    }

    pub fn float(&mut self, value: f64) {
        self.buf.push(0xcb);
        self.buf.extend_from_slice(&value.to_be_bytes());
    }

    /// An int in [-2**63, 2**64), in the form msgpack-python picks for it.
    pub fn int(&mut self, value: i128) {
        let b = &mut self.buf;
        if (-0x20..0x80).contains(&value) {
            b.push(value as i8 as u8);
        } else if value >= 0 {
            if value <= 0xff {
                b.push(0xcc);
                b.push(value as u8);
            } else if value <= 0xffff {
                b.push(0xcd);
                b.extend_from_slice(&(value as u16).to_be_bytes());
            } else if value <= 0xffff_ffff {
                b.push(0xce);
                b.extend_from_slice(&(value as u32).to_be_bytes());
            } else {
                b.push(0xcf);
                b.extend_from_slice(&(value as u64).to_be_bytes());
            }
        } else if value >= -0x80 {
            b.push(0xd0);
            b.push(value as i8 as u8);
        } else if value >= -0x8000 {
            b.push(0xd1);
            b.extend_from_slice(&(value as i16).to_be_bytes());
        } else if value >= -0x8000_0000 {
            b.push(0xd2);
            b.extend_from_slice(&(value as i32).to_be_bytes());
        } else {
            b.push(0xd3);
            b.extend_from_slice(&(value as i64).to_be_bytes());
        }
    }

    pub fn str(&mut self, s: &str) {
        let n = s.len();
        let b = &mut self.buf;
        if n < 32 {
            b.push(0xa0 | n as u8);
        } else if n <= 0xff {
            b.push(0xd9);
            b.push(n as u8);
        } else if n <= 0xffff {
            b.push(0xda);
            b.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            b.push(0xdb);
            b.extend_from_slice(&(n as u32).to_be_bytes());
        }
        b.extend_from_slice(s.as_bytes());
    }

    pub fn array(&mut self, n: usize) {
        self.header(n, 0x90, 0xdc, 0xdd);
    }

    pub fn map(&mut self, n: usize) {
        self.header(n, 0x80, 0xde, 0xdf);
    }

    fn header(&mut self, n: usize, fix: u8, h16: u8, h32: u8) {
        let b = &mut self.buf;
        if n < 16 {
            b.push(fix | n as u8);
        } else if n <= 0xffff {
            b.push(h16);
            b.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            b.push(h32);
            b.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}
