//! A msgpack cursor that borrows, checks every declared length before reading, and charges
//! what an event decodes against its [`Budget`].

use super::DecodeError;

/// What an event may still allocate.
pub(super) struct Budget {
    pub(super) left: usize,
    pub(super) wire: usize,
}

impl Budget {
    pub(super) fn charge(&mut self, items: usize, each: usize) -> Result<(), DecodeError> {
        let cost = items.saturating_mul(each);
        self.left = self
            .left
            .checked_sub(cost)
            .ok_or(DecodeError::Budget(self.wire))?;
        Ok(())
    }
}

/// One msgpack token: a scalar, or the header of an array or a map whose elements follow.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Tok<'a> {
    Nil,
    Bool,
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    /// Elements that follow.
    Array(usize),
    /// Key-value pairs that follow.
    Map(usize),
    Ext,
}

impl Tok<'_> {
    pub(super) fn as_f64(&self) -> Option<f64> {
        match *self {
            Tok::Float(f) => Some(f),
            Tok::Uint(u) => i64::try_from(u).ok().map(|i| i as f64),
            Tok::Int(i) => Some(i as f64),
            _ => None,
        }
    }

    pub(super) fn as_u64(&self) -> Option<u64> {
        match *self {
            Tok::Uint(u) => Some(u),
            Tok::Int(i) => u64::try_from(i).ok(),
            _ => None,
        }
    }
}

/// A cursor over msgpack bytes. Every declared length is checked against the bytes left before
/// anything is read (an array or map element takes at least one byte), and nothing is
/// allocated: strings and binaries are borrowed.
#[derive(Debug, Clone)]
pub(super) struct Reader<'a> {
    buf: &'a [u8],
    pub(super) pos: usize,
}

fn truncated(pos: usize) -> DecodeError {
    DecodeError::Msgpack(format!("truncated at byte {pos}"))
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(super) fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| truncated(self.pos))?;
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    pub(super) fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub(super) fn len8(&mut self) -> Result<usize, DecodeError> {
        Ok(usize::from(self.be::<1>()?[0]))
    }

    pub(super) fn len16(&mut self) -> Result<usize, DecodeError> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }

    pub(super) fn len32(&mut self) -> Result<usize, DecodeError> {
        usize::try_from(u32::from_be_bytes(self.be()?)).map_err(|_| truncated(self.pos))
    }

    /// `count` elements of at least one byte each must fit in what is left.
    pub(super) fn elements(&self, count: usize, per: usize) -> Result<usize, DecodeError> {
        if count.saturating_mul(per) > self.left() {
            return Err(DecodeError::Msgpack(format!(
                "a length of {count} at byte {} is over the {} bytes left",
                self.pos,
                self.left()
            )));
        }
        Ok(count)
    }

    pub(super) fn next(&mut self) -> Result<Tok<'a>, DecodeError> {
        use rmp::Marker as M;
        let marker = M::from_u8(self.be::<1>()?[0]);
        Ok(match marker {
            M::FixPos(v) => Tok::Uint(u64::from(v)),
            M::FixNeg(v) => Tok::Int(i64::from(v)),
            M::Null => Tok::Nil,
            M::True | M::False => Tok::Bool,
            M::U8 => Tok::Uint(u64::from(u8::from_be_bytes(self.be()?))),
            M::U16 => Tok::Uint(u64::from(u16::from_be_bytes(self.be()?))),
            M::U32 => Tok::Uint(u64::from(u32::from_be_bytes(self.be()?))),
            M::U64 => Tok::Uint(u64::from_be_bytes(self.be()?)),
            M::I8 => Tok::Int(i64::from(i8::from_be_bytes(self.be()?))),
            M::I16 => Tok::Int(i64::from(i16::from_be_bytes(self.be()?))),
            M::I32 => Tok::Int(i64::from(i32::from_be_bytes(self.be()?))),
            M::I64 => Tok::Int(i64::from_be_bytes(self.be()?)),
            M::F32 => Tok::Float(f64::from(f32::from_be_bytes(self.be()?))),
            M::F64 => Tok::Float(f64::from_be_bytes(self.be()?)),
            M::FixStr(n) => Tok::Str(self.take(usize::from(n))?),
            M::Str8 => {
                let n = self.len8()?;
                Tok::Str(self.take(n)?)
            }
            M::Str16 => {
                let n = self.len16()?;
                Tok::Str(self.take(n)?)
            }
            M::Str32 => {
                let n = self.len32()?;
                Tok::Str(self.take(n)?)
            }
            M::Bin8 => {
                let n = self.len8()?;
                Tok::Bin(self.take(n)?)
            }
            M::Bin16 => {
                let n = self.len16()?;
                Tok::Bin(self.take(n)?)
            }
            M::Bin32 => {
                let n = self.len32()?;
                Tok::Bin(self.take(n)?)
            }
            M::FixArray(n) => Tok::Array(self.elements(usize::from(n), 1)?),
            M::Array16 => {
                let n = self.len16()?;
                Tok::Array(self.elements(n, 1)?)
            }
            M::Array32 => {
                let n = self.len32()?;
                Tok::Array(self.elements(n, 1)?)
            }
            M::FixMap(n) => Tok::Map(self.elements(usize::from(n), 2)?),
            M::Map16 => {
                let n = self.len16()?;
                Tok::Map(self.elements(n, 2)?)
            }
            M::Map32 => {
                let n = self.len32()?;
                Tok::Map(self.elements(n, 2)?)
            }
            M::FixExt1 | M::FixExt2 | M::FixExt4 | M::FixExt8 | M::FixExt16 => {
                let n = match marker {
                    M::FixExt1 => 1,
                    M::FixExt2 => 2,
                    M::FixExt4 => 4,
                    M::FixExt8 => 8,
                    _ => 16,
                };
                self.take(1 + n)?;
                Tok::Ext
            }
            M::Ext8 | M::Ext16 | M::Ext32 => {
                let n = match marker {
                    M::Ext8 => self.len8()?,
                    M::Ext16 => self.len16()?,
                    _ => self.len32()?,
                };
                self.take(1 + n)?;
                Tok::Ext
            }
            M::Reserved => {
                return Err(DecodeError::Msgpack(format!(
                    "reserved marker 0xc1 at byte {}",
                    self.pos - 1
                )))
            }
        })
    }

    /// Skip what follows `tok` (the elements of an array or a map; nothing for a scalar),
    /// without recursion or allocation.
    pub(super) fn skip_children(&mut self, tok: Tok<'_>) -> Result<(), DecodeError> {
        let mut pending: usize = match tok {
            Tok::Array(n) => n,
            Tok::Map(n) => n * 2,
            _ => 0,
        };
        while pending > 0 {
            pending -= 1;
            // Token ids are most of an event's bytes: skipped without building a token.
            if self.next_u32().is_some() {
                continue;
            }
            match self.next()? {
                Tok::Array(n) => pending += n,
                Tok::Map(n) => pending += n * 2,
                _ => {}
            }
        }
        Ok(())
    }

    /// The next value when it is an unsigned integer in a format of at most 32 bits (how
    /// token ids come), read; `None`, reading nothing, for anything else, including a value cut
    /// short (which [`Reader::next`] then reports).
    pub(super) fn next_u32(&mut self) -> Option<u32> {
        let at = |i: usize| self.buf.get(self.pos + i).copied();
        let (width, value) = match at(0)? {
            b @ 0x00..=0x7f => (1, u32::from(b)),
            0xcc => (2, u32::from(at(1)?)),
            0xcd => (3, u32::from(u16::from_be_bytes([at(1)?, at(2)?]))),
            0xce => (5, u32::from_be_bytes([at(1)?, at(2)?, at(3)?, at(4)?])),
            _ => return None,
        };
        self.pos += width;
        Some(value)
    }

    /// Skip one whole value.
    pub(super) fn skip(&mut self) -> Result<(), DecodeError> {
        let tok = self.next()?;
        self.skip_children(tok)
    }
}
