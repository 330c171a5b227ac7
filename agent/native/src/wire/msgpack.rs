//! The few msgpack forms the wire events use, written as msgpack-python's `packb` writes them
//! (`use_bin_type=True`): the shortest form of each int, floats as float64, str8 for short
//! strings; and a [`Reader`] of the agent's small reply maps (`crate::shm`).

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

/// Reads one msgpack document's values in order, each checked against the bytes left: the
/// agent's reply maps as `msgpack.packb` writes them (a damaged one is an error, never a read
/// past its end).
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

type Read<T> = Result<T, String>;

/// How deep [`Reader::skip`] follows maps and arrays into each other.
pub const MAX_DEPTH: usize = 32;

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, at: 0 }
    }

    /// Every byte was read.
    pub fn done(&self) -> bool {
        self.at == self.buf.len()
    }

    fn take(&mut self, n: usize) -> Read<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| format!("msgpack: {n} bytes past the end at {}", self.at))?;
        let out = &self.buf[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn byte(&mut self) -> Read<u8> {
        Ok(self.take(1)?[0])
    }

    fn be(&mut self, n: usize) -> Read<u64> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| acc << 8 | u64::from(b)))
    }

    /// The length of a map, array, str or bin whose lead byte is `lead`, given the lead bytes
    /// of its fixed form (`fix`, with `fix_bits` of length) and of its 8/16/32-bit forms.
    fn length(
        &mut self,
        lead: u8,
        fix: Option<(u8, u8)>,
        forms: [Option<u8>; 3],
        what: &str,
    ) -> Read<usize> {
        if let Some((base, mask)) = fix {
            if lead & !mask == base {
                return Ok(usize::from(lead & mask));
            }
        }
        for (form, width) in forms.iter().zip([1, 2, 4]) {
            if *form == Some(lead) {
                return Ok(self.be(width)? as usize);
            }
        }
        Err(format!("msgpack: {what} expected, lead byte {lead:#04x}"))
    }

    pub fn map(&mut self) -> Read<usize> {
        let lead = self.byte()?;
        self.length(
            lead,
            Some((0x80, 0x0f)),
            [None, Some(0xde), Some(0xdf)],
            "a map",
        )
    }

    pub fn array(&mut self) -> Read<usize> {
        let lead = self.byte()?;
        self.length(
            lead,
            Some((0x90, 0x0f)),
            [None, Some(0xdc), Some(0xdd)],
            "an array",
        )
    }

    pub fn str(&mut self) -> Read<&'a [u8]> {
        let lead = self.byte()?;
        let n = self.length(
            lead,
            Some((0xa0, 0x1f)),
            [Some(0xd9), Some(0xda), Some(0xdb)],
            "a str",
        )?;
        self.take(n)
    }

    pub fn bin(&mut self) -> Read<&'a [u8]> {
        let lead = self.byte()?;
        let n = self.length(lead, None, [Some(0xc4), Some(0xc5), Some(0xc6)], "a bin")?;
        self.take(n)
    }

    /// An int in [-2**63, 2**64), in any of its forms.
    pub fn int(&mut self) -> Read<i128> {
        let lead = self.byte()?;
        Ok(match lead {
            0x00..=0x7f => i128::from(lead),
            0xe0..=0xff => i128::from(lead as i8),
            0xcc..=0xcf => i128::from(self.be(1 << (lead - 0xcc))?),
            0xd0..=0xd3 => {
                let width = 1usize << (lead - 0xd0);
                let raw = self.be(width)?;
                let shift = 64 - 8 * width as u32;
                i128::from(((raw << shift) as i64) >> shift)
            }
            _ => return Err(format!("msgpack: an int expected, lead byte {lead:#04x}")),
        })
    }

    /// Pass over one value of any kind (a map's or array's members included, nested at most
    /// [`MAX_DEPTH`] deep).
    pub fn skip(&mut self) -> Read<()> {
        self.skip_nested(0)
    }

    fn skip_nested(&mut self, depth: usize) -> Read<()> {
        if depth > MAX_DEPTH {
            return Err(format!("msgpack: nested more than {MAX_DEPTH} deep"));
        }
        let lead = self
            .buf
            .get(self.at)
            .copied()
            .ok_or("msgpack: a value past the end")?;
        match lead {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => {
                self.at += 1;
            }
            0xcc..=0xd3 => {
                self.int()?;
            }
            0xca | 0xcb => {
                self.at += 1;
                self.take(if lead == 0xca { 4 } else { 8 })?;
            }
            0xa0..=0xbf | 0xd9..=0xdb => {
                self.str()?;
            }
            0xc4..=0xc6 => {
                self.bin()?;
            }
            0x90..=0x9f | 0xdc | 0xdd => {
                for _ in 0..self.array()? {
                    self.skip_nested(depth + 1)?;
                }
            }
            0x80..=0x8f | 0xde | 0xdf => {
                for _ in 0..self.map()? {
                    self.skip_nested(depth + 1)?;
                    self.skip_nested(depth + 1)?;
                }
            }
            _ => return Err(format!("msgpack: unsupported lead byte {lead:#04x}")),
        }
        Ok(())
    }
}
